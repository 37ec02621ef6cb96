"""Correctness sweep without a GPU: KernelBench problems, shrunk, through the CPU
interpreter (``cpu_interpret``), one training step each, judged by DESIGN.md's rule.

    python3 -P -m stitch_backend.bench.cpu_sweep KB_DIR LEVEL [--problems 1-20,25]
        [--autocast bf16|fp16 | --cast bf16|fp16] [--batches] [--batch-only]

A developer's tool: it runs the whole pipeline (graph passes, Planner, Coder, Verifier,
Program, forward and backward) on shapes a CPU can afford, so what breaks on real models
shows up before any device time is spent. Speed means nothing here.

Each problem file's module-level integer assignments are rewritten before it runs:
``batch_size`` becomes 2, sizes with a size-like name above 32 become 32, in lists and
tuples of sizes too, products of integers (``8192 * 2``) read as their value
(``--batch-only`` leaves them; L3 2's ``hidden_layer_sizes = [32768, 32768]`` kept whole
took 23.7 GB and the OOM killer ended the sweep, as L1 98's ``8192 * 2`` did), group
counts above 8 become 8. A problem whose own shapes do not survive
that fails at construction; run it again with ``--batch-only``.

Per problem: the module in training mode, its inputs, a training step (forward, the
outputs weighted by fixed random tensors and summed, backward; no backward where nothing
requires a gradient). The step runs on eager, on an fp64 copy without autocast (the
reference), and twice compiled (the first call verifies and returns ATen's results, the
second runs the verified kernels). Outputs and parameter gradients are judged against
eager and fp64. ``--autocast`` runs the forwards under ``torch.autocast``; ``--cast``
converts model and inputs to that dtype instead; ``--batches`` makes the three compiled
steps use batches 2, 3 and 2 (Dynamo's symbolic batch on the second). One line per
problem: ``ok`` or ``FAIL`` with the reasons, the generated kernels in use, the graphs
(``f``/``b``/``i``, ``*`` symbolic) and any "end-to-end check failed" note; ``NOT RUN``
where eager's own step or the fp64 reference's raises (a model that reuses a graph across
steps, in-place ops on what autograd saved, tensors ``.double()`` does not convert), so
there is nothing to judge against; ``UNCOMPILED`` where the results were right but only
because a graph the backend failed to compile ran as traced (a backend bug: L3 46/47's
backward graphs, a planner error, read "ok" before); ``ERROR`` where anything else raises.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch

from ..correctness import compare
from .problems import select_kernelbench
from .steps import AUTOCAST, LossWeights, autocast, training_step

_SIZE_NAME = re.compile(r"(height|width|depth|length|seq|dim|size|shape|features|channels|hidden|"
                        r"embed|len|_h$|_w$|_d$|^[hwdnmkl]$|^[MNK]$)", re.I)
# an integer, or a product of integers (L1 98's ``batch_size = 8192 * 2``)
_INT = r"\d+(?:\s*\*\s*\d+)*"
_ASSIGN = re.compile(rf"^(\w+(?:\s*=\s*\w+)*)\s*=\s*({_INT})\s*(#.*)?$")
# a list or tuple of sizes (``hidden_layer_sizes = [32768, 32768]``, ``[1024] * 16``,
# ``input_shape = (8192 * 2,)``)
_ASSIGN_LIST = re.compile(r"^(\w+)\s*=\s*([\[(])([\d\s,*]+)[\])](.*)$")


def _product(text: str) -> int:
    value = 1
    for factor in text.split("*"):
        value *= int(factor)
    return value


def shrink(source: str, *, batch: int = 2, sizes: bool = True) -> str:
    """``source`` with its module-level integer assignments shrunk (see the module's notes)."""
    out = []
    for line in source.splitlines():
        m = _ASSIGN.match(line)
        if m:
            names = [n.strip() for n in m.group(1).split("=")]
            value = _product(m.group(2))
            if "batch_size" in names:
                line = f"{m.group(1)} = {batch}"
            elif value > 8 and any("group" in n for n in names):
                line = f"{m.group(1)} = 8"
            elif sizes and value > 32 and any(_SIZE_NAME.search(n) for n in names):
                line = f"{m.group(1)} = 32"
        listed = _ASSIGN_LIST.match(line)
        if sizes and listed and _SIZE_NAME.search(listed.group(1)):
            values = [min(_product(v), 32) for v in listed.group(3).split(",") if v.strip()]
            shown = str(values) if listed.group(2) == "[" else str(tuple(values))
            line = f"{listed.group(1)} = {shown}{listed.group(4)}"
        out.append(line)
    return "\n".join(out) + "\n"


def load(path: Path, *, sizes: bool = True) -> types.ModuleType:
    """The problem file ``path`` executed, shrunk, as a module of its own."""
    mod = types.ModuleType(path.stem)
    mod.__file__ = str(path)
    exec(compile(shrink(path.read_text(), sizes=sizes), str(path), "exec"), mod.__dict__)
    return mod


def _float(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _present(values: list[Any]) -> list[Any]:
    return [v for v in values if v is not None]


class NotRun(Exception):
    """Eager's own step or the fp64 reference's raised: nothing to judge against."""


def _step_or_not_run(what: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return training_step(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - said on the problem's line
        raise NotRun(f"{what} raises {type(err).__name__}: {str(err)[:200]}") from err


def _build(mod) -> torch.nn.Module:
    """A fresh model in training mode with seed 0's weights. Built again for each copy,
    not deep-copied: a model may hold a lambda over its own submodules (L3 44's
    ``mlpf``), which ``deepcopy`` shares, so a copy would run the original's layers."""
    torch.manual_seed(0)
    return mod.Model(*mod.get_init_inputs()).train()


def check_problem(path: Path, *, amp: str = "", cast: str = "", batches: bool = False,
                  sizes: bool = True) -> str:
    """One problem's line (see the module's notes)."""
    from ..backend import StitchBackend

    mod = load(path, sizes=sizes)
    model, compiled_model, model64 = _build(mod), _build(mod), _build(mod).double()
    if cast:
        model, compiled_model = model.to(AUTOCAST[cast]), compiled_model.to(AUTOCAST[cast])
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "cache": False})
    compiled = torch.compile(compiled_model, backend=backend)
    cpu = torch.device("cpu")
    problems: list[str] = []
    for k, batch in enumerate((2, 3, 2) if batches else (2, 2)):
        if batches:
            mod.batch_size = batch
        torch.manual_seed(1 + (k if batches else 0))
        inputs = list(mod.get_inputs())
        inputs64 = [_float(x, torch.float64) for x in inputs]
        if cast:
            inputs = [_float(x, AUTOCAST[cast]) for x in inputs]
        weights = LossWeights(7)
        eager = _step_or_not_run("eager's own step", model, model, inputs, weights,
                                 autocast(cpu, amp))
        reference = _step_or_not_run("the fp64 reference's step", model64, model64, inputs64,
                                     weights)
        got = training_step(compiled, compiled_model, inputs, weights, autocast(cpu, amp))
        for what, a, e, r in zip(("outputs", "gradients"), got, eager, reference):
            cmp = compare(_present(a), _present(e), _present(r))
            if not cmp.ok_design:
                problems.append(f"call {k + 1} {what}: {cmp.reason}")
    kernels = sum(r.backend == "kernel" for rec in backend.records for r in rec.plan.regions)
    graphs = ",".join(rec.stage[0] + ("*" if rec.dynamic else "") for rec in backend.records)
    failed_checks = [n for rec in backend.records for n in rec.notes
                     if n.startswith("end-to-end check failed")]
    # correct, but only because a graph the backend could not compile ran as traced
    status = "UNCOMPILED" if backend.failures else "ok"
    line = ("FAIL " + " | ".join(problems) if problems else status)[:600]
    line += f" ({kernels} kernels; graphs {graphs or '-'}"
    if backend.failures:
        line += f"; not compiled: {backend.failures[0][:200]}"
    if failed_checks:
        line += f"; {failed_checks[0][:200]}"
    return line + ")"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stitch_backend.bench.cpu_sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("kernelbench", help="a KernelBench checkout (or its inner KernelBench folder)")
    p.add_argument("level", type=int)
    p.add_argument("--problems", default=None, help="task numbers, e.g. 1-20,25 (default: all)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--autocast", choices=tuple(AUTOCAST), default="")
    how.add_argument("--cast", choices=tuple(AUTOCAST), default="")
    p.add_argument("--batches", action="store_true", help="compiled steps at batch 2, 3, 2")
    p.add_argument("--batch-only", action="store_true", help="shrink the batch alone")
    a = p.parse_args(argv)
    ok = not_run = uncompiled = total = 0
    for ref in select_kernelbench(a.kernelbench, a.level, a.problems):
        t0 = time.perf_counter()
        try:
            line = check_problem(Path(ref.spec), amp=a.autocast, cast=a.cast,
                                 batches=a.batches, sizes=not a.batch_only)
        except NotRun as err:
            line = f"NOT RUN: {err}"
        except Exception as err:  # noqa: BLE001 - one problem costs one line
            where = traceback.extract_tb(err.__traceback__)[-1]
            line = (f"ERROR {type(err).__name__}: {str(err)[:300]} "
                    f"at {Path(where.filename).name}:{where.lineno}")
        torch._dynamo.reset()
        total += 1
        ok += line.startswith("ok")
        not_run += line.startswith("NOT RUN")
        uncompiled += line.startswith("UNCOMPILED")
        print(f"{ref.name}: {line} [{time.perf_counter() - t0:.1f} s]", flush=True)
    print(f"{ok} of {total} ok" + (f", {not_run} not run" if not_run else "")
          + (f", {uncompiled} with a graph the backend could not compile" if uncompiled else ""),
          flush=True)
    return 0 if ok + not_run == total else 1


if __name__ == "__main__":
    sys.exit(main())
