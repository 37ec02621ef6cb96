"""GPU benchmark: a generated fused kernel vs eager PyTorch on big inputs (not a test).

    python -m stitch_backend.codegen.bench_fused [--sm-count N] [--iters N]
        [--long-rows] [--layouts inner,cluster] [--only NAME ...]

For each region: compile, check the result against eager, then time both with CUDA
events (median of ``iters`` runs, L2 flushed before each run) and print the effective
bandwidth (bytes read + written by the region, once each) in GB/s. ``--long-rows``
times KernelBench L1's long-row reductions instead (L1 23 softmax, 24 log_softmax, 34
instance norm, 38/39 row norms: 6-9 GB each); ``--layouts`` generates each region in
each reduction layout named (``emit_reduction``; the cluster layout needs sm_90), one
row per layout.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from .. import toolchain
from .fused import Unsupported, generate


def _regions(device: str):
    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype)

    return [
        ("bias_gelu_fp32 4096x4096", lambda a, b: F.gelu(a + b), [r(4096, 4096), r(4096)]),
        ("add_relu_fp16 8192x8192", lambda a, b: (a + b).relu(), [r(8192, 8192, dtype=torch.float16), r(8192, 8192, dtype=torch.float16)]),
        ("softmax_fp32 8192x4096", lambda a: torch.softmax(a, -1), [r(8192, 4096)]),
        ("softmax_fp16 16384x1024", lambda a: torch.softmax(a, -1), [r(16384, 1024, dtype=torch.float16)]),
        ("layer_norm_fp32 16384x1024", lambda a, w, b: F.layer_norm(a, (1024,), w, b),
         [r(16384, 1024), r(1024), r(1024)]),
        ("layer_norm_bf16 8192x4096", lambda a, w, b: F.layer_norm(a, (4096,), w, b),
         [r(8192, 4096, dtype=torch.bfloat16), r(4096, dtype=torch.bfloat16), r(4096, dtype=torch.bfloat16)]),
        ("sum_dim0_fp32 8192x4096", lambda a: a.sum(0), [r(8192, 4096)]),
    ]


def _long_rows(device: str):
    def r(*shape):
        return torch.rand(*shape, device=device)

    return [
        # inputs made when timed (one region's 6-9 GB at a time)
        ("L1 23 softmax 4096x393216", lambda a: torch.softmax(a, 1), lambda: [r(4096, 393216)]),
        ("L1 24 log_softmax 4096x393216", lambda a: torch.log_softmax(a, 1),
         lambda: [r(4096, 393216)]),
        ("L1 34 instance_norm 112x64x512x512", lambda a: F.instance_norm(a),
         lambda: [r(112, 64, 512, 512)]),
        ("L1 38 l1 row norm 32768x65535", lambda a: a / a.abs().mean(1, keepdim=True),
         lambda: [r(32768, 65535)]),
        ("L1 39 l2 row norm 32768x65535", lambda a: a / a.norm(p=2, dim=1, keepdim=True),
         lambda: [r(32768, 65535)]),
    ]


def _time(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(sm_count: int | None = None, iters: int = 50, long_rows: bool = False,
          layouts: tuple = (None,), only: tuple = ()) -> list[dict]:
    """Time every region (each of ``layouts``: None is the template's choice); returns
    one row per region and layout (and prints a table)."""
    from ..cuda_driver import CudaModule

    device = "cuda"
    sm = sm_count or torch.cuda.get_device_properties(0).multi_processor_count
    arch = toolchain.device_arch()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # > the 60 MB L2
    rows = []
    print(f"{'region':34s} {'eager ms':>9s} {'fused ms':>9s} {'eager GB/s':>11s} {'fused GB/s':>11s} {'speedup':>8s}")
    for (name, fn, make), layout in [(reg, lay) for reg in (_long_rows if long_rows else _regions)(device)
                                     for lay in layouts]:
        if only and not any(o in name for o in only):
            continue
        inputs = make() if callable(make) else make
        gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*inputs)
        entry = "bench_" + "".join(ch if ch.isalnum() else "_" for ch in name) + f"_{layout or 'default'}"
        try:
            kernel = generate(gm, entry, sm_count=sm, layout=layout)
        except Unsupported as err:
            print(f"{name:34s} {layout}: {err}")
            continue
        name = f"{name} [{kernel.emitted.layout or 'pointwise'}]"
        cubin = toolchain.compile_kernel(kernel.source, kernel.entry, arch).cubin
        func = CudaModule(cubin).function(kernel.entry, kernel.signature)
        plan = kernel.prepare(inputs)

        def run_fused(plan=plan, func=func):
            func.launch(plan.grid, plan.block, plan.args, plan.shared_mem)

        run_fused()
        ref = gm(*inputs)
        ref = ref if isinstance(ref, (tuple, list)) else [ref]
        tol = 1e-2 if any(x.dtype != torch.float32 for x in inputs) else 1e-4
        for o, e in zip(plan.outputs, ref):
            torch.testing.assert_close(o, e, atol=tol, rtol=tol)
        nbytes = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
        nbytes += sum(o.numel() * o.element_size() for o in plan.outputs)
        t_eager = _time(lambda: fn(*inputs), iters, flush)     # the function as written
        t_fused = _time(run_fused, iters, flush)
        row = dict(region=name, eager_ms=t_eager, fused_ms=t_fused, eager_gbs=nbytes / t_eager / 1e6,
                   fused_gbs=nbytes / t_fused / 1e6, speedup=t_eager / t_fused, grid=plan.grid,
                   block=plan.block)
        rows.append(row)
        inputs = ref = plan = None     # free this region's tensors before the next
        print(f"{name:34s} {t_eager:9.3f} {t_fused:9.3f} {row['eager_gbs']:11.0f} {row['fused_gbs']:11.0f} "
              f"{row['speedup']:7.2f}x")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sm-count", type=int, default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--long-rows", action="store_true", help="KernelBench L1's long-row reductions")
    ap.add_argument("--layouts", default="", help="comma list of reduction layouts (default: the template's)")
    ap.add_argument("--only", nargs="*", default=[], help="regions whose name contains one of these")
    args = ap.parse_args(argv)
    layouts = tuple(x or None for x in args.layouts.split(",")) if args.layouts else (None,)
    bench(args.sm_count, args.iters, args.long_rows, layouts, tuple(args.only))


if __name__ == "__main__":
    main()
