"""The child process that benchmarks one problem under every backend.

``python -m stitch_backend.bench.worker --spec FILE --name NAME --out RECORDS.jsonl ...``
loads the problem (executing the user's file), builds references, then for each backend
in turn: builds the model under the same seed, compiles, checks correctness, times, and
appends one ``BenchRecord`` to ``--out`` (flushed, so a crash later keeps it). All
backends run in this one process, so their times are side by side. With
``--interleave``, every backend is compiled and checked first, then timed in rounds
that rotate their order, so a card that drifts while the task runs (warming up, its
clocks falling) weighs on every backend alike instead of on the ones timed last.

Following KernelBench: the model stays in training mode (``--eval`` switches), every
call runs under ``torch.no_grad()``, fp32, and ``torch.manual_seed(seed)`` precedes the
construction of each model instance (``--autocast bf16|fp16`` runs the forwards under
``torch.autocast``, the fp64 reference model without). Mode ``train-step`` (``stitchcuda
bench --training``) makes every call a training step instead (``training_step``): forward,
the outputs weighted by fixed random tensors and summed, backward; what is checked is
the outputs and every parameter's gradient, and what is timed is the whole step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import backends as backends_mod
from ..correctness import Comparison, compare, flatten_outputs
from .problems import Problem, load_problem
from .records import ERROR, OK, BenchRecord, append_records
from .steps import AUTOCAST, LossWeights, autocast, training_step
from .timing import L2Flusher, gpu_state, run_times, summarize, time_call, time_first_call
from .turns import GpuTurn

ERROR_TAIL_CHARS = 4000


@dataclass
class TaskConfig:
    """Everything the worker needs for one task; ``to_argv`` is its command line."""

    spec: str
    name: str
    backends: list[str]
    device: str = "cpu"
    mode: str = "train"
    trials: int = 5
    runs: int = 10
    warmup: int = 2
    seed: int = 42
    task_run: str = ""
    caches: str = "keep"
    recompile: bool = True
    ref_cache_bytes: int | None = None      # None: an eighth of device memory (CUDA), 4 GiB (CPU)
    interleave: bool = False                # compile all, then time in rotating rounds
    autocast: str = ""                      # "bf16" or "fp16": forwards under torch.autocast

    def to_argv(self, out: Path) -> list[str]:
        argv = ["--spec", self.spec, "--name", self.name, "--backends", ",".join(self.backends),
                "--device", self.device, "--mode", self.mode, "--trials", str(self.trials),
                "--runs", str(self.runs), "--warmup", str(self.warmup), "--seed", str(self.seed),
                "--task-run", self.task_run, "--caches", self.caches, "--out", str(out)]
        if not self.recompile:
            argv.append("--no-recompile")
        if self.ref_cache_bytes is not None:
            argv += ["--ref-cache-bytes", str(self.ref_cache_bytes)]
        if self.interleave:
            argv.append("--interleave")
        if self.autocast:
            argv += ["--autocast", self.autocast]
        return argv


@dataclass
class TrialRef:
    inputs: list[Any]
    eager: Any
    fp64: Any | None


def _to_device(inputs: list[Any], device: torch.device) -> list[Any]:
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]


def _clone(inputs: list[Any]) -> list[Any]:
    # Some models write into their inputs (in-place ReLU on x): every call gets its own copy.
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def _upcast(inputs: list[Any]) -> list[Any]:
    return [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
            else (x.clone() if isinstance(x, torch.Tensor) else x) for x in inputs]


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten_outputs(x) if isinstance(t, torch.Tensor))


def _max_abs_diff(a: Any, b: Any) -> float:
    """Max |a - b| over tensor leaves; inf when shapes differ or NaN patterns differ."""
    la, lb = flatten_outputs(a), flatten_outputs(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        if not isinstance(x, torch.Tensor):
            worst = max(worst, 0.0 if x == y else float("inf"))
            continue
        if x.shape != y.shape:
            return float("inf")
        if x.numel() == 0:
            continue
        if torch.equal(x, y):
            continue
        d = (x.double() - y.double()).abs()
        same_nan = torch.isnan(x) & torch.isnan(y)
        d = torch.where(same_nan, torch.zeros_like(d), d)
        worst = max(worst, float(torch.nan_to_num(d, nan=float("inf")).max()))
    return worst


def _fingerprint(x: Any) -> list[torch.Tensor]:
    """A small CPU sample of every output (up to 65536 elements each) to compare trials."""
    out = []
    for t in flatten_outputs(x):
        if isinstance(t, torch.Tensor) and t.numel():
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 65536)
            out.append(flat[::step].double().cpu())
    return out


def draw_inputs(problem: Problem, seed: int, device: torch.device) -> list[Any]:
    """The problem's inputs under ``seed``, drawn on ``device`` itself (a problem's
    ``torch.rand`` lands there directly: KernelBench's level-1 inputs are GBs, which the
    CPU takes seconds to draw, every trial); anything made elsewhere is moved."""
    torch.manual_seed(seed)
    if device.type == "cpu":
        return _to_device(problem.make_inputs(), device)
    with torch.device(device):
        return _to_device(problem.make_inputs(), device)


class References:
    """Eager and fp64 outputs per input trial, computed once and kept while they fit in
    ``cache_bytes`` (else recomputed on demand, from the same seeds)."""

    def __init__(self, problem: Problem, cfg: TaskConfig, device: torch.device):
        self.problem, self.cfg, self.device = problem, cfg, device
        rng = random.Random(cfg.seed)
        self.trial_seeds = [rng.randrange(2**31) for _ in range(cfg.trials)]
        self.weights = LossWeights(cfg.seed)
        self.model = build_model(problem, cfg, device)
        self.fp64_error = ""
        try:
            self.model64: torch.nn.Module | None = build_model(problem, cfg, device).double()
        except Exception as exc:
            self.model64, self.fp64_error = None, f"{type(exc).__name__}: {exc}"
        if cfg.ref_cache_bytes is not None:
            self.budget = cfg.ref_cache_bytes
        elif device.type == "cuda":
            self.budget = torch.cuda.get_device_properties(device).total_memory // 8
        else:
            self.budget = 4 << 30
        self._cache: dict[int, TrialRef] = {}
        self._cached_bytes = 0
        self.eager_deterministic: bool | None = None
        self.determinism_max_abs: float | None = None
        self.eager_output_varies: bool | None = None

    def inputs(self, t: int) -> list[Any]:
        return draw_inputs(self.problem, self.trial_seeds[t], self.device)

    def call(self, fn: Callable[..., Any], model: torch.nn.Module, inputs: list[Any],
             amp: bool = True) -> Any:
        """One call as this task makes it: ``fn(*inputs)``, or a training step of it;
        the forward under the task's autocast unless ``amp`` is False (the fp64 model)."""
        ctx = autocast(self.device, self.cfg.autocast if amp else "")
        if self.cfg.mode == "train-step":
            return training_step(fn, model, inputs, self.weights, ctx)
        with ctx:
            return fn(*inputs)

    def trial(self, t: int) -> TrialRef:
        if t in self._cache:
            return self._cache[t]
        inputs = self.inputs(t)
        torch.manual_seed(self.trial_seeds[t])
        eager = self.call(self.model, self.model, _clone(inputs))
        if t == 0 and self.eager_deterministic is None:
            # No reseed: a model that draws random numbers (dropout) must show it here.
            again = self.call(self.model, self.model, _clone(inputs))
            self.determinism_max_abs = _max_abs_diff(eager, again)
            self.eager_deterministic = self.determinism_max_abs == 0.0
            del again
        fp64 = None
        if self.model64 is not None:
            try:
                torch.manual_seed(self.trial_seeds[t])
                fp64 = self.call(self.model64, self.model64, _upcast(inputs), amp=False)
            except Exception as exc:
                self.fp64_error = f"{type(exc).__name__}: {exc}"
        ref = TrialRef(inputs, eager, fp64)
        size = _nbytes(inputs) + _nbytes(eager) + _nbytes(fp64)
        if self._cached_bytes + size <= self.budget:
            self._cache[t] = ref
            self._cached_bytes += size
        return ref

    def prepare(self) -> None:
        """Compute every trial once: fills the cache and the task-level facts."""
        prints = []
        for t in range(len(self.trial_seeds)):
            prints.append(_fingerprint(self.trial(t).eager))
        if len(prints) >= 2:
            # Relative threshold: run-to-run noise of a constant output is not variation.
            scale = max([float(t.abs().max()) for t in prints[0] if t.numel()] + [1e-30])
            self.eager_output_varies = any(_max_abs_diff(prints[0], p) > 1e-5 * scale
                                           for p in prints[1:])

    def facts(self) -> dict[str, Any]:
        return {"eager_deterministic": self.eager_deterministic,
                "determinism_max_abs": self.determinism_max_abs,
                "eager_output_varies": self.eager_output_varies}


def build_model(problem: Problem, cfg: TaskConfig, device: torch.device) -> torch.nn.Module:
    """A fresh instance under ``manual_seed(cfg.seed)``, on ``device``, in the configured mode."""
    torch.manual_seed(cfg.seed)
    model = problem.make_model().to(device)
    model.train(cfg.mode != "eval")
    return model


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers depend on: versions, device, TF32 settings."""
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": device.type,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    return env


def _error_fields(exc: BaseException, prefix: str = "") -> dict[str, Any]:
    # Dynamo wraps backend errors as "backend='x' raised:\nTheRealError: ...\n\nSet TORCH...":
    # keep the first two message lines so the reason names the real error.
    lines = [ln.strip() for ln in str(exc).splitlines()
             if ln.strip() and not ln.startswith(("Set TORCHDYNAMO_VERBOSE", "You can suppress"))]
    return {"status": ERROR, "reason": f"{prefix}{type(exc).__name__}: {' '.join(lines[:2])}"[:500],
            "error": traceback.format_exc()[-ERROR_TAIL_CHARS:]}


def _aggregate(checks: list[tuple[str, Comparison]]) -> dict[str, Any]:
    def worst(values: list[float]) -> float | None:
        finite = [v for v in values if v == v]          # drop NaN (no fp64 reference)
        return max(finite) if finite else None
    failing = [f"{label}: {c.reason}" for label, c in checks if not (c.ok_kernelbench and c.ok_design)]
    if failing:
        reason = failing[0] + (f" (and {len(failing) - 1} more checks)" if len(failing) > 1 else "")
    else:
        label, c = max(checks, key=lambda lc: lc[1].max_abs)
        reason = f"{len(checks)} checks passed; worst ({label}): {c.reason}"
    return {
        "correct_kernelbench": all(c.ok_kernelbench for _, c in checks),
        "correct_design": all(c.ok_design for _, c in checks),
        "max_abs": worst([c.max_abs for _, c in checks]),
        "norm_err": worst([c.norm_err for _, c in checks]),
        "eager_norm_err": worst([c.eager_norm_err for _, c in checks]),
        "reason": reason,
    }


def _call_peak_mb(call, device: torch.device) -> float | None:
    """Device memory one call needs beyond what is allocated before it (MiB), so a
    backend's memory plan can be compared with eager's side by side; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return round((peak - base) / 2**20, 3)


@dataclass
class Ready:
    """A backend compiled and checked, its timing still to come: ``call()`` runs it once
    on the timing inputs; ``fields`` are its record's so far."""

    name: str
    model: torch.nn.Module
    compiled: backends_mod.Compiled
    marker: Any
    call: Callable[[], Any]
    fields: dict[str, Any]


def prepare_backend(name: str, problem: Problem, refs: References, cfg: TaskConfig,
                    device: torch.device, turn: GpuTurn | None = None,
                    reset: bool = True) -> Ready:
    """Compile and check one backend (raises on failure): its first call and the input
    trials. ``reset`` forgets what Dynamo compiled before
    (off while earlier backends wait to be timed: they would compile again). With a
    shared GPU (``turn``), everything but a host-compiled backend's first call (its
    compile) runs in this task's turn on the GPU."""
    import torch._dynamo

    turn = turn or GpuTurn(None)
    fields: dict[str, Any] = {}
    with turn:
        if reset:
            torch._dynamo.reset()
        model = build_model(problem, cfg, device)
        compiled = backends_mod.wrap(name, model)
        marker = backends_mod.graph_count_marker(compiled)
        # the first call's inputs only (trial 0's, drawn again from its seed): the
        # references are made after it, so the backend compiles (and verifies) without
        # eager's and the fp64 outputs held beside it (24 GiB for a 6 GiB L1 input)
        first_inputs = refs.inputs(0)
    with contextlib.nullcontext() if backends_mod.compiles_on_host(name) else turn:
        torch.manual_seed(refs.trial_seeds[0])
        fields["cold_first_call_s"], out = time_first_call(
            lambda: refs.call(compiled.fn, model, first_inputs), device)
    with turn:
        first_inputs = None   # freed before the references are made
        ref0 = refs.trial(0)
        checks = [("first call", compare(out, ref0.eager, ref0.fp64))]
        out_bytes = _nbytes(out)
        del out, ref0
        for t in range(cfg.trials):
            ref = refs.trial(t)
            torch.manual_seed(refs.trial_seeds[t])
            out = refs.call(compiled.fn, model, _clone(ref.inputs))
            checks.append((f"trial {t}", compare(out, ref.eager, ref.fp64)))
            del out, ref
        fields.update(_aggregate(checks))
        if refs.fp64_error:
            fields["reason"] += f" [fp64 reference unavailable: {refs.fp64_error}]"
        timing_inputs = _clone(refs.trial(0).inputs)
        fields["io_bytes"] = (_nbytes(timing_inputs) + out_bytes
                              + sum(_nbytes(t) for t in (*model.parameters(), *model.buffers())))
    return Ready(name, model, compiled, marker,
                 lambda: refs.call(compiled.fn, model, timing_inputs), fields)


def run_backend(name: str, problem: Problem, refs: References, cfg: TaskConfig,
                device: torch.device, flusher: L2Flusher | None,
                turn: GpuTurn | None = None) -> dict[str, Any]:
    """Compile, check and time one backend; the record's fields (raises on failure)."""
    turn = turn or GpuTurn(None)
    ready = prepare_backend(name, problem, refs, cfg, device, turn)
    with turn:
        before = gpu_state(device)
        timing = time_call(ready.call, device, runs=cfg.runs, warmup=cfg.warmup, flusher=flusher)
        ready.fields.update(gpu_before=before, gpu_after=gpu_state(device),
                            median_ms=timing.median_ms, p10_ms=timing.p10_ms,
                            p90_ms=timing.p90_ms, runs=timing.runs, clock=timing.clock,
                            host_ms=timing.host_ms)
        return _finish(ready, refs, cfg, device)


def _finish(ready: Ready, refs: References, cfg: TaskConfig,
            device: torch.device) -> dict[str, Any]:
    """After the timing (a backend settled over its calls): the memory one call needs,
    the recompile (where configured) and the backend's own records."""
    import torch._dynamo

    fields = ready.fields
    fields["call_peak_mb"] = _call_peak_mb(ready.call, device)
    # the timed graphs' records, before the recompile adds its own (a backend object keeps
    # every graph it compiled: L1 39's notes read "1/2 graph(s) run as traced", the
    # recompile's graph, called once, being the second)
    fields["backend_records"] = backends_mod.backend_records(ready.compiled, since=ready.marker)
    if cfg.recompile and ready.name not in ("eager", "eager-again"):
        # Dynamo forgets everything; Inductor's/stitchcuda's own caches stay warm.
        torch._dynamo.reset()
        again = backends_mod.wrap(ready.name, ready.model)
        again_marker = backends_mod.graph_count_marker(again)
        torch.manual_seed(refs.trial_seeds[0])
        inputs = _clone(refs.trial(0).inputs)
        fields["recompile_first_call_s"], _ = time_first_call(
            lambda: refs.call(again.fn, ready.model, inputs), device)
        fields.update(_backend_share(backends_mod.backend_records(again, since=again_marker)))
        del again
    fields["backend_source"] = ready.compiled.source
    return fields


# Interleaved timing: the runs of each backend split over this many rounds at most (each
# round at least INTERLEAVE_MIN_RUNS runs), the backends' order rotating every round.
INTERLEAVE_ROUNDS = 4
INTERLEAVE_MIN_RUNS = 3


def time_interleaved(ready: list[Ready], cfg: TaskConfig, device: torch.device,
                     flusher: L2Flusher | None, turn: GpuTurn) -> None:
    """Time every backend of ``ready`` in rounds, round i starting at backend i (mod n);
    the timing fields go into each one's ``fields``, the GPU's state as the first round
    began and the last ended."""
    rounds = max(1, min(INTERLEAVE_ROUNDS, cfg.runs // INTERLEAVE_MIN_RUNS))
    share = [cfg.runs // rounds + (1 if i < cfg.runs % rounds else 0) for i in range(rounds)]
    times: dict[str, list[float]] = {r.name: [] for r in ready}
    host: dict[str, list[float]] = {r.name: [] for r in ready}
    with turn:
        before = gpu_state(device)
        for i, runs in enumerate(share):
            for r in ready[i % len(ready):] + ready[:i % len(ready)]:
                times[r.name] += run_times(r.call, device, runs=runs,
                                           warmup=cfg.warmup if i == 0 else 1, flusher=flusher,
                                           host=host[r.name])
        after = gpu_state(device)
    for r in ready:
        timing = summarize(times[r.name], cfg.warmup, device, host[r.name])
        r.fields.update(gpu_before=before, gpu_after=after, median_ms=timing.median_ms,
                        p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, runs=timing.runs,
                        clock=timing.clock, timing_rounds=rounds, host_ms=timing.host_ms)


def _backend_share(records: list[Any] | None) -> dict[str, Any]:
    """recompile_backend_s (the summed ``compile_ms`` of the graphs a recompile made) and
    recompile_cached, for backends whose records say so (stitchcuda's)."""
    dicts = [r for r in records or [] if isinstance(r, dict) and "compile_ms" in r]
    if not dicts:
        return {}
    return {"recompile_backend_s": sum(r["compile_ms"] for r in dicts) / 1e3,
            "recompile_cached": all(bool(r.get("cached")) for r in dicts)}


def run_task(cfg: TaskConfig, sink: Callable[[BenchRecord], None]) -> None:
    """Benchmark ``cfg.spec`` under every backend of ``cfg.backends``; one record each to
    ``sink``. Python exceptions become error records; nothing is raised."""
    device = torch.device(cfg.device)
    env = environment(device)
    base = dict(task=cfg.name, spec=cfg.spec, device=device.type, mode=cfg.mode,
                autocast=cfg.autocast, task_run=cfg.task_run, caches=cfg.caches,
                trials=cfg.trials)

    def emit(backend: str, fields: dict[str, Any]) -> None:
        sink(BenchRecord(backend=backend, **base, **fields, env=env, time_unix=time.time()))

    turn = GpuTurn.from_env()
    if turn.shared_by:
        env["gpu_shared_by"] = turn.shared_by
    with torch.no_grad():
        started = time.perf_counter()
        try:
            problem = load_problem(cfg.spec)
            with turn:
                refs = References(problem, cfg, device)
                refs.prepare()
        except Exception as exc:
            fields = _error_fields(exc, prefix="loading/reference (eager) failed: ")
            for b in cfg.backends:
                emit(b, dict(fields))
            return
        base["references_s"] = round(time.perf_counter() - started, 3)
        with turn:
            flusher = L2Flusher(device) if device.type == "cuda" else None
        if cfg.interleave:
            _run_interleaved(cfg, problem, refs, device, flusher, turn, emit)
            return
        for b in cfg.backends:
            started = time.perf_counter()
            try:
                fields = {"status": OK, **run_backend(b, problem, refs, cfg, device, flusher, turn)}
            except Exception as exc:
                fields = _error_fields(exc)
            fields.update(refs.facts(), wall_s=round(time.perf_counter() - started, 3))
            emit(b, fields)
            _release(device, turn)


def _release(device: torch.device, turn: GpuTurn) -> None:
    """Free what the last backend left behind before the next one runs."""
    gc.collect()
    if device.type == "cuda":
        with turn:
            torch.cuda.empty_cache()


def _run_interleaved(cfg: TaskConfig, problem: Problem, refs: References, device: torch.device,
                     flusher: L2Flusher | None, turn: GpuTurn,
                     emit: Callable[[str, dict[str, Any]], None]) -> None:
    """Every backend compiled and checked (Dynamo reset once, before the first), then all
    timed in rotating rounds, then each finished (its recompile) and emitted, in order."""
    ready: list[Ready] = []
    failed: dict[str, dict[str, Any]] = {}
    wall: dict[str, float] = {}
    for i, b in enumerate(cfg.backends):
        started = time.perf_counter()
        try:
            ready.append(prepare_backend(b, problem, refs, cfg, device, turn, reset=i == 0))
        except Exception as exc:
            failed[b] = _error_fields(exc)
        wall[b] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        if ready:
            time_interleaved(ready, cfg, device, flusher, turn)
    except Exception as exc:
        failed.update({r.name: _error_fields(exc, prefix="interleaved timing: ") for r in ready})
        ready = []
    share = (time.perf_counter() - started) / max(1, len(ready))
    finished: dict[str, dict[str, Any]] = {}
    for r in ready:
        started = time.perf_counter()
        try:
            with turn:
                finished[r.name] = {"status": OK, **_finish(r, refs, cfg, device)}
        except Exception as exc:
            failed[r.name] = _error_fields(exc)
        wall[r.name] += share + time.perf_counter() - started
    del ready
    _release(device, turn)
    for b in cfg.backends:
        fields = finished.get(b) or failed[b]
        fields.update(refs.facts(), wall_s=round(wall[b], 3))
        emit(b, fields)


def _parse(argv: list[str] | None) -> tuple[TaskConfig, Path]:
    p = argparse.ArgumentParser(prog="python -m stitch_backend.bench.worker",
                                description="benchmark one problem (internal: run by `stitchcuda bench`)")
    p.add_argument("--spec", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--backends", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", choices=("train", "eval", "train-step"), default="train")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--task-run", default="")
    p.add_argument("--caches", default="keep")
    p.add_argument("--no-recompile", action="store_true")
    p.add_argument("--ref-cache-bytes", type=int, default=None)
    p.add_argument("--interleave", action="store_true")
    p.add_argument("--autocast", choices=("", *AUTOCAST), default="")
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    cfg = TaskConfig(spec=a.spec, name=a.name, backends=[b for b in a.backends.split(",") if b],
                     device=a.device, mode=a.mode, trials=a.trials, runs=a.runs, warmup=a.warmup,
                     seed=a.seed, task_run=a.task_run, caches=a.caches,
                     recompile=not a.no_recompile, ref_cache_bytes=a.ref_cache_bytes,
                     interleave=a.interleave, autocast=a.autocast)
    return cfg, a.out


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: exit 0 when every backend got a record (even an error record)."""
    cfg, out = _parse(argv)
    run_task(cfg, lambda rec: append_records(out, [rec]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
