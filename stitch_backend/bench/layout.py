"""What channels-last is worth to eager itself: GPU time per call of each problem's
model, NCHW as written against the model and its 4-D inputs in channels-last, both as
CUDA-graph replays (so the host is out of the measure), under ``no_grad`` in the bench's
mode. The ceiling for the ``channels_last`` option's convolutions.

    python3 -P -m stitch_backend.bench.layout PROBLEM [PROBLEM ...] [--mode train|eval]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from .problems import load_problem
from .worker import TaskConfig, build_model, draw_inputs


def replay_ms(fn: Callable[[], Any], reps: int = 20, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``reps`` back-to-back replays of one
    CUDA graph of ``fn`` (``cudagraphs.capture``, after two warm calls)."""
    from ..cudagraphs import capture

    for _ in range(2):
        fn()
    graph, _ = capture(fn)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def _channels_last(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitch_backend.bench.layout",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", nargs="+")
    parser.add_argument("--mode", choices=["train", "eval"], default="train")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layout: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print("| problem | NCHW ms | channels-last ms | ratio |")
    print("|---|---|---|---|")
    for spec in args.problems:
        problem = load_problem(spec)
        cfg = TaskConfig(spec=spec, name=problem.name, backends=[], device="cuda",
                         mode=args.mode)
        model = build_model(problem, cfg, device)
        inputs = draw_inputs(problem, cfg.seed, device)
        with torch.no_grad():
            nchw = replay_ms(lambda: model(*inputs))
            model_cl = model.to(memory_format=torch.channels_last)
            inputs_cl = [_channels_last(x) for x in inputs]
            nhwc = replay_ms(lambda: model_cl(*inputs_cl))
        print(f"| {problem.name} | {nchw:.3f} | {nhwc:.3f} | {nchw / nhwc:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
