"""Where one call's GPU time goes: the top CUDA kernels of a problem under each backend.

    python -m stitch_backend.bench.profile PROBLEM [--backends eager,stitchcuda] [--top 12]
                                           [--report]

PROBLEM is a KernelBench-format file or ``package.module:factory``. Each backend gets a
fresh model (same seed), warm calls (three; twelve for stitchcuda, which
settles over its first calls) under ``no_grad`` in the bench's mode, then one
profiled call; the table lists kernels by total CUDA time, then the call's total.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import backends as backends_mod
from .problems import load_problem
from .timing import L2Flusher
from .worker import TaskConfig, build_model, draw_inputs


WARM_CALLS = 12


TIMED_CALLS = 20


def host_and_wall_ms(fn, device: str = "cuda", flush=None) -> tuple[float, float, float]:
    """Medians over TIMED_CALLS calls of ``fn``, each from an idle GPU: milliseconds
    until the call returns on the host (its launch and wrapper overhead, where the GPU
    keeps up), until the GPU finishes, and until it finishes after ``flush()`` (an
    L2 flush by default; on the CPU: the same call three ways, a testing aid)."""
    import statistics
    import time

    cuda = device == "cuda"
    if flush is None:
        flush = L2Flusher(torch.device(device)) if cuda else (lambda: None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host, wall, cold = [], [], []
    for flushed in (False, True):
        for _ in range(TIMED_CALLS):
            if flushed:
                flush()
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if flushed:
                cold.append((t2 - t0) * 1e3)
            else:
                host.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(wall), statistics.median(cold)


def profile_backend(name: str, problem, cfg: TaskConfig, top: int, report: bool = False) -> str:
    """The kernel table of one profiled call of ``problem`` under backend ``name``; with
    ``report``, then the stitchcuda report of the graphs that call compiled."""
    import torch._dynamo

    from ..backend import compiled_graphs
    from ..report import render_text

    torch._dynamo.reset()
    device = torch.device("cuda")
    model = build_model(problem, cfg, device)
    before = len(compiled_graphs())
    compiled = backends_mod.wrap(name, model)
    inputs = draw_inputs(problem, cfg.seed, device)
    with torch.no_grad():
        # stitchcuda settles over its first calls (verification, replay capture and
        # check, the eager guard's timing): profile a settled call
        for _ in range(WARM_CALLS if name.startswith("stitchcuda") else 3):
            compiled.fn(*inputs)
        torch.cuda.synchronize()
        flush = L2Flusher(device)
        host, wall, cold = host_and_wall_ms(lambda: compiled.fn(*inputs), flush=flush)
        # the same call twice: as it is, then from a cold L2 (the bench's condition)
        warm_events = _profiled(lambda: compiled.fn(*inputs))
        flush()
        torch.cuda.synchronize()
        cold_events = _profiled(lambda: compiled.fn(*inputs))
    total = sum(ms for _, ms in warm_events.values())
    cold_total = sum(ms for _, ms in cold_events.values())
    lines = [f"## {name}: {total:.3f} ms of kernels in one call ({cold_total:.3f} from a cold "
             f"L2), {sum(n for n, _ in warm_events.values())} launches",
             "", f"one call, median of {TIMED_CALLS}: {host:.3f} ms on the host until it "
             f"returns, {wall:.3f} ms until the GPU finishes, {cold:.3f} ms from a cold L2 "
             "(the bench's condition)",
             "", "| kernel | calls | ms | ms, cold L2 | share |", "|---|---|---|---|---|"]
    for key in sorted(warm_events.keys() | cold_events.keys(),
                      key=lambda k: -max(warm_events.get(k, (0, 0.0))[1],
                                         cold_events.get(k, (0, 0.0))[1]))[:top]:
        count, ms = warm_events.get(key, (0, 0.0))
        lines.append(f"| {key[:90]} | {count} | {ms:.3f} | "
                     f"{cold_events.get(key, (0, 0.0))[1]:.3f} | {ms / max(total, 1e-9):.0%} |")
    records = compiled_graphs()[before:]
    if report and records:
        lines += ["", "```", render_text(records), "```"]
    return "\n".join(lines)


def _profiled(call) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches, milliseconds) of one profiled ``call()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return {e.key: (e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stitch_backend.bench.profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("problem")
    p.add_argument("--backends", default="eager,stitchcuda")
    p.add_argument("--mode", choices=["train", "eval"], default="train")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--report", action="store_true",
                   help="after each stitchcuda table, its report: regions, kernels, fallbacks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile: needs a CUDA device", file=sys.stderr)
        return 2
    problem = load_problem(args.problem)
    cfg = TaskConfig(spec=args.problem, name=problem.name, backends=[], device="cuda",
                     mode=args.mode)
    for name in backends_mod.validate_backends(args.backends.split(",")):
        print(profile_backend(name, problem, cfg, args.top, args.report), flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
