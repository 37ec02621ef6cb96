"""``stitchcuda demo``: a bundled example run with eager and with stitchcuda, side by side."""

from __future__ import annotations

import copy
import time

import torch


def run_demo(example: str, *, device: str | None = None, seed: int = 0) -> int:
    """Run ``example`` eagerly and compiled; print both results, the timing and the plan.
    Returns 0 when the outputs agree by DESIGN.md's rule, 1 otherwise."""
    from .backend import StitchBackend
    from .correctness import compare
    from .examples import load_example

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = load_example(example)
    torch.manual_seed(seed)
    model = problem.make_model().to(device)
    reference = copy.deepcopy(model)
    torch.manual_seed(seed + 1)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in problem.make_inputs()]

    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    print(f"stitchcuda demo: example {example!r} on {device} "
          f"(torch {torch.__version__})")
    with torch.no_grad():
        t0 = time.perf_counter()
        out = compiled(*inputs)
        first_ms = (time.perf_counter() - t0) * 1e3
        ref = reference(*inputs)
        ref64 = copy.deepcopy(reference).double()(
            *[x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs])
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    refs64 = ref64 if isinstance(ref64, (tuple, list)) else (ref64,)
    ok = True
    for i, (o, r, r64) in enumerate(zip(outs, refs, refs64)):
        cmp = compare(o, r, r64)
        ok = ok and cmp.ok_design
        print(f"output {i}: shape {tuple(o.shape)}  max |stitchcuda - eager| = {cmp.max_abs:.3e}  "
              f"-> {'match' if cmp.ok_design else 'MISMATCH: ' + cmp.reason}")
    print(f"first call (compile + run): {first_ms:.0f} ms\n")
    print(backend.report())
    return 0 if ok else 1
