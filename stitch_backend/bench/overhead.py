"""Host time per call of a Program that runs uncaptured: a stack of small blocks (60
regions inference, 269 with the backward) whose ops are tiny, so the time is nearly all
host work. Compares eager, aot_eager and stitchcuda with every region on ATen
(codegen off), run as the step loop and as the straight-line function.

    python3 -P -m stitch_backend.bench.overhead [--device cpu|cuda] [--blocks 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from stitch_backend import program as program_mod
from stitch_backend.backend import StitchBackend


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.lin(x))) * 0.5


def _best_ms(fn, x, device: str, calls: int = 300, repeats: int = 5) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        fn(x)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(16) for _ in range(args.blocks)]).to(args.device)
    x = torch.randn(4, 16, device=args.device)
    print(f"host time per call, ms (best of 5 x 300 calls; {args.device}, {args.blocks} blocks)")
    print(f"{'':12s} {'eager':>8s} {'aot_eager':>10s} {'step loop':>10s} {'straight':>9s}")
    for training in (False, True):
        def step(f):
            return (lambda x: f(x).sum().backward()) if training else f

        row = []
        with torch.set_grad_enabled(training):
            row.append(_best_ms(step(model), x, args.device))
            torch._dynamo.reset()
            row.append(_best_ms(step(torch.compile(model, backend="aot_eager")), x, args.device))
            for straight in (False, True):
                program_mod.STRAIGHT_LINE = straight
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=StitchBackend(options={"codegen": False}))
                row.append(_best_ms(step(compiled), x, args.device))
        program_mod.STRAIGHT_LINE = True
        label = "train step" if training else "inference"
        print(f"{label:12s} " + " ".join(f"{v:{w}.3f}" for v, w in zip(row, (8, 10, 10, 9))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
