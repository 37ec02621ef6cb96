"""``stitchcuda warmup FILE...``: compile, verify and cache every graph of some models.

Each model is built on the current GPU, compiled with the backend and called once (the
first call verifies the candidates on real inputs and stores the Program), so a later
process starts warm. FILE takes the same forms as ``explain``. ``--training`` runs a
training step as a training loop makes it (parameters require gradients, inputs do not:
an input that did would give other graphs, and the cache entries would not be the ones
the loop looks up); ``--autocast bf16|fp16`` runs the forward under ``torch.autocast``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class WarmupRow:
    model: str
    graphs: int
    generated: int
    fallback: int
    regions: int
    cached: int
    geomean_speedup: float | None
    seconds: float
    error: str | None = None


def warm_one(spec: str, *, training: bool, device: str, seed: int = 0,
             autocast: str = "", options: dict | None = None) -> WarmupRow:
    """Compile and run one model once with the backend (``options``) on ``device``; a
    training step with ``training``, the forward under ``autocast`` ("bf16"/"fp16")."""
    from .backend import StitchBackend
    from .bench.problems import load_problem
    from .bench.steps import autocast as autocast_to

    t0 = time.perf_counter()
    problem = load_problem(spec)
    torch.manual_seed(seed)
    model = problem.make_model().to(device)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in problem.make_inputs()]
    backend = StitchBackend(options=options)
    compiled = torch.compile(model, backend=backend)
    amp = autocast_to(torch.device(device), autocast)
    if training:
        model.train()
        with amp:
            out = compiled(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        terms = [o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if terms:
            sum(terms).backward()
    else:
        with torch.no_grad(), amp:
            compiled(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    regions = [r for rec in backend.records for r in rec.plan.regions]
    speedups = [r.speedup for r in regions if r.backend == "kernel" and r.speedup]
    return WarmupRow(
        model=problem.name, graphs=len(backend.records),
        generated=sum(r.backend != "aten" for r in regions),
        fallback=sum(r.kind.value == "fallback" for r in regions), regions=len(regions),
        cached=sum(rec.cached for rec in backend.records),
        geomean_speedup=math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        if speedups else None,
        seconds=time.perf_counter() - t0)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("warmup", help="compile, verify and cache models ahead of time")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="KernelBench-format .py files or package.module:factory")
    p.add_argument("--training", action="store_true",
                   help="a training step: also compile the backward graphs")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default="",
                   help="run the forward under torch.autocast to this dtype")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--device", default=None, help="default: cuda")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .exc import UnsupportedDeviceError

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedDeviceError(
            "stitchcuda warmup needs a CUDA device (it verifies kernels on the GPU it caches "
            "them for); none is visible. Use 'stitchcuda explain' to see plans without one.")
    rows: list[WarmupRow] = []
    for spec in tqdm(args.files, desc="warmup", unit="model"):
        torch._dynamo.reset()
        try:
            rows.append(warm_one(spec, training=args.training, device=device,
                                 autocast=args.autocast))
        except Exception as err:  # noqa: BLE001 - one bad model costs one row
            rows.append(WarmupRow(spec, 0, 0, 0, 0, 0, None, 0.0,
                                  error=f"{type(err).__name__}: {err}"[:300]))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(render_rows(rows))
    return 1 if any(r.error for r in rows) else 0


def render_rows(rows: list[WarmupRow]) -> str:
    """A markdown table of the warm-up."""
    lines = ["| model | graphs | regions | generated | fallback | from cache | "
             "verified speedup (geomean) | s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | error: {r.error} | | | | | | |")
            continue
        sp = f"{r.geomean_speedup:.2f}x" if r.geomean_speedup else "-"
        lines.append(f"| {r.model} | {r.graphs} | {r.regions} | {r.generated} | {r.fallback} | "
                     f"{r.cached}/{r.graphs} | {sp} | {r.seconds:.1f} |")
    return "\n".join(lines)
