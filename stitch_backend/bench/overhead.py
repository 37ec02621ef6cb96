"""Host time per call of a Program that runs uncaptured: a stack of small blocks (60
regions inference, 269 with the backward) whose ops are tiny, so the time is nearly all
host work. Compares eager, aot_eager and stitchcuda with every region on ATen
(codegen off), run as the step loop and as the straight-line function. Then one tiny
op (KernelBench L1 12's broadcast multiply, 8 x 8) under Dynamo's eager backend and
under stitchcuda called directly and through AOTAutograd's runtime wrapper
(``aot_direct``).

    python3 -P -m stitch_backend.bench.overhead [--device cpu|cuda] [--blocks 30]
        [--rows inference,train,one-op]
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


ROWS = ("inference", "train", "one-op")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"which rows, comma-separated, of: {', '.join(ROWS)} (default all; "
                             "on a GPU the train row compiles for minutes)")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        parser.error(f"--rows: unknown {', '.join(unknown) or '(none given)'}; "
                     f"expected some of {', '.join(ROWS)}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(16) for _ in range(args.blocks)]).to(args.device)
    x = torch.randn(4, 16, device=args.device)
    stacks = [t for t, name in ((False, "inference"), (True, "train")) if name in rows]
    if stacks:
        print(f"host time per call, ms (best of 5 x 300 calls; {args.device}, "
              f"{args.blocks} blocks)")
        print(f"{'':12s} {'eager':>8s} {'aot_eager':>10s} {'step loop':>10s} {'straight':>9s}")
    for training in stacks:
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
    if "one-op" in rows:
        _one_op(args.device)
    return 0


def _one_op(device: str) -> None:
    """Host time per call of one tiny op: eager, Dynamo's eager backend, stitchcuda
    called directly and through AOTAutograd's runtime wrapper (each its own class, so
    that one code object's cache holds one entry)."""
    from stitch_backend import aot_direct

    def fresh() -> torch.nn.Module:
        class Scale(torch.nn.Module):
            def forward(self, pair):
                a, b = pair
                return a.unsqueeze(1) * b
        return Scale()

    pair = (torch.rand(8, device=device), torch.rand(8, 8, device=device))
    real = aot_direct.why_not
    torch._dynamo.reset()
    with torch.no_grad():
        fns = {"eager": fresh(), "dynamo": torch.compile(fresh(), backend="eager"),
               "direct": torch.compile(fresh(), backend=StitchBackend(options={"cache": False}))}
        aot_direct.why_not = lambda gm, inputs: "kept for the comparison"
        try:
            fns["wrapped"] = torch.compile(fresh(), backend=StitchBackend(options={"cache": False}))
            fns["wrapped"](pair)
        finally:
            aot_direct.why_not = real
        row = [_best_ms(f, pair, device, calls=3000) * 1e3 for f in fns.values()]
    print("\none op, µs a call: " + "  ".join(f"{k} {v:.1f}" for k, v in zip(fns, row)))


if __name__ == "__main__":
    raise SystemExit(main())
