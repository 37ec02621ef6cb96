"""Generated kernels on the GPU: launched through ``cuda_driver`` on fresh random inputs,
outputs poisoned first, compared with eager CUDA, and bit-identical across two runs."""

from __future__ import annotations

import os

import pytest
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend import toolchain
from stitch_backend.codegen import generate
from stitch_backend.codegen.lower_reductions import ONLINE_SOFTMAX_MIN

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


def test_cache_values_kernels_match_eager_and_the_template_on_gpu():
    """Every case whose persistent rows keep computed values between passes
    (``generate(cache_values=True)``, a tuning option): eager's values
    on fresh inputs, bit-identical on a second launch, and on a misaligned copy (the
    streaming scalar path) the same bits as aligned."""
    from stitch_backend.cuda_driver import CudaModule

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = toolchain.device_arch()
    checked = []
    for case in ALL:
        gm = case.trace(device="cuda")
        kernel = generate(gm, case.name + "_pv", sm_count=sms, cache_values=True)
        if not kernel.emitted.cached_values:
            continue
        fn = CudaModule(toolchain.compile_cubin(kernel.source, kernel.entry, arch).cubin) \
            .function(kernel.entry, kernel.signature)
        for seed in (21, 22):
            _check(case, gm, kernel, fn, seed)
        checked.append(case.name)
        if case.name == "big_softmax":
            x = case.make_inputs(5, device="cuda")[0]
            shifted = torch.empty(x.numel() + 1, device="cuda")[1:].view_as(x)
            shifted.copy_(x)
            torch.testing.assert_close(_launch(kernel, fn, [x])[0],
                                       _launch(kernel, fn, [shifted])[0], atol=0, rtol=0)
    assert "big_softmax" in checked and "big_layer_norm_f16" in checked, checked


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_one_pass_softmax_statistics_keep_eagers_special_values(log):
    """Softmax's maximum and sum in one pass over long rows (partial sums rescaled as
    maxima combine): rows of only -inf (NaN, as eager), -inf runs before and after finite
    values, a NaN, a +inf, huge magnitudes, and rising rows (a new maximum at every
    element)."""
    from stitch_backend.cuda_driver import CudaModule

    fn = (lambda a: torch.log_softmax(a, -1)) if log else (lambda a: torch.softmax(a, -1))
    n = ONLINE_SOFTMAX_MIN
    rows = [torch.randn(n), torch.full((n,), float("-inf")), torch.randn(n), torch.randn(n),
            torch.randn(n), torch.randn(n) * 1e30, torch.linspace(-50, 50, n),
            torch.linspace(50, -50, n), torch.randn(n)]
    rows[2][: n // 2] = float("-inf")
    rows[3][n // 2:] = float("-inf")
    rows[4][7] = float("nan")
    rows[8][123] = float("inf")
    x = torch.stack(rows).cuda()
    gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)
    kernel = generate(gm, "online_softmax_special",
                      sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    assert "sfk_online_add" in kernel.source     # the one-pass form, not max then sum
    cubin = toolchain.compile_cubin(kernel.source, kernel.entry, toolchain.device_arch()).cubin
    launch = CudaModule(cubin).function(kernel.entry, kernel.signature)
    (got,) = _launch(kernel, launch, [x])
    torch.testing.assert_close(got, fn(x), atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("what", ["softmax", "softmax_odd", "log_softmax_f16", "norm"])
def test_column_layout_matches_the_inner_layout_and_eager(what):
    """A reduction over the channels of a channels-last input written back NCHW (rows
    not a multiple of 32, channels not a power of two, or odd): the column and staged
    layouts the Coder proposes beside the inner one give eager's values and strides, bit
    for bit on a second launch."""
    from stitch_backend.codegen.emit_reduction import stores_across_rows
    from stitch_backend.cuda_driver import CudaModule

    fns = {
        "softmax": lambda a: torch.sigmoid(torch.softmax(a, 1) * 2.0).contiguous(),
        "softmax_odd": lambda a: torch.softmax(a, 1).contiguous(),
        "log_softmax_f16": lambda a: torch.log_softmax(a, 1).contiguous(),
        "norm": lambda a: ((a - a.mean(1, keepdim=True))
                           * torch.rsqrt(a.var(1, keepdim=True) + 1e-5)).contiguous(),
    }
    dtype = torch.float16 if what.endswith("f16") else torch.float32
    channels = 37 if what == "softmax_odd" else 40     # odd: the staged tile's pitch
    x = torch.randn(3, 7, 9, channels, device="cuda").to(dtype).permute(0, 3, 1, 2)
    gm = make_fx(fns[what], decomposition_table=core_aten_decompositions(),
                 tracing_mode="fake")(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = fns[what](x)
    for layout in ("inner", "column", "staged"):
        kernel = generate(gm, f"col_{what}_{layout}", sm_count=sms, layout=layout)
        assert stores_across_rows(kernel.ir) and kernel.emitted.layout == layout
        cubin = toolchain.compile_cubin(kernel.source, kernel.entry, toolchain.device_arch()).cubin
        launch = CudaModule(cubin).function(kernel.entry, kernel.signature)
        (got,) = _launch(kernel, launch, [x])
        assert got.stride() == want.stride()
        tol = 1e-2 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        (again,) = _launch(kernel, launch, [x])
        torch.testing.assert_close(again, got, atol=0, rtol=0)


@pytest.mark.parametrize("channels", [128, 37])
def test_a_narrow_column_launch_gives_the_template_launchs_values(channels):
    """A channels-last BatchNorm's statistics and normalisation over few channels (ResNet18
    layer2's 128 x 1568 positions; 37, not a power of two): the column kernel launched
    ``narrow`` (one or a few channels a block, as many blocks as channels) gives eager's
    values, as the template's launch of eight channels a block does."""
    from stitch_backend.cuda_driver import CudaModule

    def norm(a):
        mean = a.mean((0, 2, 3), keepdim=True)
        var = a.var((0, 2, 3), keepdim=True, correction=0)
        return torch.relu((a - mean) * torch.rsqrt(var + 1e-5))

    x = torch.randn(2, 28, 28, channels, device="cuda").permute(0, 3, 1, 2)
    gm = make_fx(norm, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = norm(x)
    for narrow in (False, True):
        kernel = generate(gm, f"nrw_{channels}_{int(narrow)}", sm_count=sms, layout="column",
                          narrow=narrow)
        blocks = kernel.launch_shape(channels, 2 * 28 * 28)[0]
        assert (blocks >= channels) if narrow else (blocks <= -(-channels // 8))
        cubin = toolchain.compile_cubin(kernel.source, kernel.entry, toolchain.device_arch()).cubin
        launch = CudaModule(cubin).function(kernel.entry, kernel.signature)
        (got,) = _launch(kernel, launch, [x])
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("columns", [3, 64, 4500])
@pytest.mark.parametrize("what", ["sum", "amax", "argmax"])
def test_column_reductions_combine_each_rows_threads_for_every_rows_per_block(columns, what):
    """Column-layout reductions of a (3000, ``columns``) value over its 3000 rows: 3 and
    64 columns launch 4 and 8 columns a block (``sfk_group_reduce``'s warp shuffles, then
    one value a warp), 4500 launch 32 (no two threads of a column share a warp: one value
    a thread); the narrow launch takes one column a block. Each gives eager's result,
    bit-identical on a second run."""
    from stitch_backend.cuda_driver import CudaModule

    def f(a):
        return getattr(torch, what)(a, 0)

    gen = torch.Generator(device="cuda").manual_seed(columns)
    x = torch.randn(3000, columns, device="cuda", generator=gen)
    gm = make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = f(x)
    for narrow in (False, True):
        kernel = generate(gm, f"col_{what}_{columns}_{int(narrow)}", sm_count=sms,
                          layout="column", narrow=narrow)
        assert kernel.emitted.layout == "column"
        cubin = toolchain.compile_cubin(kernel.source, kernel.entry, toolchain.device_arch()).cubin
        launch = CudaModule(cubin).function(kernel.entry, kernel.signature)
        (got,) = _launch(kernel, launch, [x])
        if what == "argmax":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        (again,) = _launch(kernel, launch, [x])
        assert torch.equal(again, got)


@pytest.mark.parametrize("rows", [(2, 30, 30), (8, 64, 64)])
def test_a_lean_column_launch_gives_the_template_launchs_values(rows):
    """KernelBench L2 92's last kernel, smaller: tanh and hardswish, then a logsumexp over
    the 64 channels of an NCHW value (a column reduction). Launched lean (fewer threads a
    row: 8 rows a block and then 32; ``FusedKernel.lean``) it gives eager's values, as
    the template's launch does, bit-identical on a second run."""
    import dataclasses

    from stitch_backend.cuda_driver import CudaModule

    def f(a):
        y = torch.nn.functional.hardswish(torch.tanh(a)) + a
        return torch.logsumexp(y, 1, keepdim=True)

    n, h, w = rows
    x = torch.randn(n, 64, h, w, device="cuda")
    gm = make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = f(x)
    base = generate(gm, f"lse_{n}", sm_count=sms, layout="column")
    cubin = toolchain.compile_cubin(base.source, base.entry, toolchain.device_arch()).cubin
    launch = CudaModule(cubin).function(base.entry, base.signature)
    lean = dataclasses.replace(base, lean=True, _layouts={})
    assert base.launch_shape(n * h * w, 64)[1:] != lean.launch_shape(n * h * w, 64)[1:]
    for kernel in (base, lean):
        (got,) = _launch(kernel, launch, [x])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        (again,) = _launch(kernel, launch, [x])
        assert torch.equal(again, got)
