"""Checks that several codegen test modules share: every kernel of a list compiles for
sm_90a in one unit (CPU, nvcc), and a kernel launched on the GPU gives eager's values,
bit-identical on a second launch."""

from __future__ import annotations

import torch

from stitch_backend import toolchain


def assert_compiles_for_sm90a(kernels, unit: str) -> None:
    job = toolchain.CompileJob("\n".join(k.source for k in kernels), unit, "sm_90a")
    (res,) = toolchain.compile_many([job], max_workers=1)
    assert not isinstance(res, toolchain.CompileError), str(res)
    for k in kernels:
        assert k.entry.encode() in res.cubin


def assert_eager_values(kernel, fn, xs, equal_nan: bool = False) -> None:
    """``kernel`` on ``xs`` against ``fn(*xs)`` (1e-5 in fp32, 2e-2 in 16-bit types; NaN
    where eager has NaN, with ``equal_nan``), and the same bits from a second launch
    (outputs poisoned before each)."""
    from stitch_backend.cuda_driver import CudaModule

    from .test_gpu import _launch

    cubin = toolchain.compile_cubin(kernel.source, kernel.entry, toolchain.device_arch()).cubin
    launch = CudaModule(cubin).function(kernel.entry, kernel.signature)
    (got,) = _launch(kernel, launch, xs)
    want = fn(*xs)
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=equal_nan)
    (again,) = _launch(kernel, launch, xs)
    assert torch.equal(again, got) or (equal_nan and torch.equal(again.nan_to_num(7.0), got.nan_to_num(7.0)))
