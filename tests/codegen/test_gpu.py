"""Generated kernels on the GPU: launched through ``cuda_driver`` on fresh random inputs,
outputs poisoned first, compared with eager CUDA, and bit-identical across two runs."""

from __future__ import annotations

import os

import pytest
import torch

from stitch_backend import toolchain
from stitch_backend.codegen import generate

from .cases import BIG, CASES, Case

pytestmark = pytest.mark.gpu

ALL = CASES + BIG


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


@pytest.fixture(scope="module")
def built():
    """{case name: (GraphModule traced on CUDA, FusedKernel, CudaFunction)}, compiled in parallel."""
    from stitch_backend.cuda_driver import CudaModule

    arch = toolchain.device_arch()
    traced = {}
    for c in ALL:
        gm = c.trace(device="cuda")
        traced[c.name] = (gm, generate(gm, c.name, sm_count=torch.cuda.get_device_properties(0).multi_processor_count))
    jobs = [toolchain.CompileJob(k.source, k.entry, arch) for _, k in traced.values()]
    results = toolchain.compile_many(jobs, max_workers=os.cpu_count())
    out = {}
    for (name, (gm, k)), res in zip(traced.items(), results):
        assert not isinstance(res, toolchain.CompileError), f"{name}: {res}"
        out[name] = (gm, k, CudaModule(res.cubin).function(k.entry, k.signature))
    return out


def _launch(kernel, fn, inputs):
    plan = kernel.prepare(inputs)
    for o in plan.outputs:
        _poison(o)
    fn.launch(plan.grid, plan.block, plan.args, plan.shared_mem)
    torch.cuda.synchronize()
    return list(plan.outputs)


def _check(case: Case, gm, kernel, fn, seed: int, alt: bool = False):
    inputs = case.make_inputs(seed, device="cuda", alt=alt)
    ref = gm(*inputs)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    got = _launch(kernel, fn, inputs)
    tol = 1e-2 if case.half else 1e-4
    for i, (g, r) in enumerate(zip(got, ref)):
        if case.compare is not None and i not in case.compare:
            continue
        assert (g.shape, g.dtype) == (r.shape, r.dtype), f"output {i}"
        if r.numel():
            assert g.stride() == r.stride(), f"output {i}: strides {g.stride()} vs {r.stride()}"
        if r.dtype.is_floating_point:
            torch.testing.assert_close(g, r, atol=tol, rtol=tol, equal_nan=True, msg=f"output {i}")
        else:
            assert torch.equal(g, r), f"output {i} differs"
    again = _launch(kernel, fn, inputs)
    for i, (a, b) in enumerate(zip(got, again)):
        if case.compare is not None and i not in case.compare:
            continue
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True, msg=f"output {i} not bit-identical")


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_kernel_matches_eager_on_gpu(case: Case, built):
    gm, kernel, fn = built[case.name]
    for seed in (11, 12):
        _check(case, gm, kernel, fn, seed)
    if case.alt_inputs is not None:
        _check(case, gm, kernel, fn, 13, alt=True)


def test_misaligned_inputs_take_the_scalar_path_with_the_same_bits(built):
    """A row kernel's result must not depend on pointer alignment (vector vs scalar path)."""
    case = next(c for c in ALL if c.name == "big_softmax")
    gm, kernel, fn = built[case.name]
    x = case.make_inputs(5, device="cuda")[0]
    base = torch.empty(x.numel() + 1, device="cuda")
    shifted = base[1:].view_as(x)  # 4-byte aligned only
    shifted.copy_(x)
    a = _launch(kernel, fn, [x])[0]
    b = _launch(kernel, fn, [shifted])[0]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
