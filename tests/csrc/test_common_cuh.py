"""csrc/common.cuh: every helper compiles (nvcc for sm_90a and sm_80, NVRTC) and matches torch on the GPU.

The exercise kernels are generated from one table (helper expression -> torch
reference), so adding a helper to common.cuh means adding one row here.
"""

import math

import pytest

from stitch_backend import toolchain

# name -> (CUDA expression over float v (input) and g (second input), torch reference (x, g) -> tensor)
POINTWISE = {
    "relu": ("sc_relu(v)", lambda t, x, g: t.relu(x)),
    "relu6": ("sc_relu6(v)", lambda t, x, g: t.nn.functional.relu6(x)),
    "hardtanh": ("sc_hardtanh(v, -0.5f, 0.75f)", lambda t, x, g: t.nn.functional.hardtanh(x, -0.5, 0.75)),
    "clamp": ("sc_clamp(v, -1.f, 2.f)", lambda t, x, g: t.clamp(x, -1.0, 2.0)),
    "sigmoid": ("sc_sigmoid(v)", lambda t, x, g: t.sigmoid(x)),
    "silu": ("sc_silu(v)", lambda t, x, g: t.nn.functional.silu(x)),
    "gelu_erf": ("sc_gelu_erf(v)", lambda t, x, g: t.nn.functional.gelu(x)),
    "gelu_tanh": ("sc_gelu_tanh(v)", lambda t, x, g: t.nn.functional.gelu(x, approximate="tanh")),
    "gelu_erf_grad": ("sc_gelu_erf_grad(g, v)", lambda t, x, g: t.ops.aten.gelu_backward(g, x)),
    "gelu_tanh_grad": ("sc_gelu_tanh_grad(g, v)",
                       lambda t, x, g: t.ops.aten.gelu_backward(g, x, approximate="tanh")),
    "softplus": ("sc_softplus(v)", lambda t, x, g: t.nn.functional.softplus(x)),
    "softplus_b2_t5": ("sc_softplus(v, 2.f, 5.f)", lambda t, x, g: t.nn.functional.softplus(x, beta=2.0, threshold=5.0)),
    "mish": ("sc_mish(v)", lambda t, x, g: t.nn.functional.mish(x)),
    "hardswish": ("sc_hardswish(v)", lambda t, x, g: t.nn.functional.hardswish(x)),
    "hardsigmoid": ("sc_hardsigmoid(v)", lambda t, x, g: t.nn.functional.hardsigmoid(x)),
    "elu": ("sc_elu(v)", lambda t, x, g: t.nn.functional.elu(x)),
    "elu_a13": ("sc_elu(v, 1.3f)", lambda t, x, g: t.nn.functional.elu(x, alpha=1.3)),
    "selu": ("sc_selu(v)", lambda t, x, g: t.selu(x)),
    "celu_a07": ("sc_celu(v, 0.7f)", lambda t, x, g: t.nn.functional.celu(x, alpha=0.7)),
    "leaky_relu": ("sc_leaky_relu(v)", lambda t, x, g: t.nn.functional.leaky_relu(x)),
    "leaky_relu_02": ("sc_leaky_relu(v, 0.2f)", lambda t, x, g: t.nn.functional.leaky_relu(x, 0.2)),
    "maxf": ("sc_maxf(v, g)", lambda t, x, g: t.maximum(x, g)),
    "minf": ("sc_minf(v, g)", lambda t, x, g: t.minimum(x, g)),
    "std_max": ("sc_std_max(v, g)", None),  # std::max semantics: no torch op; checked on finite inputs below
    "half_roundtrip": ("sc_to_float(sc_from_float<__half>(v))", lambda t, x, g: x.half().float()),
    "bf16_roundtrip": ("sc_to_float(sc_from_float<__nv_bfloat16>(v))", lambda t, x, g: x.bfloat16().float()),
}


def pointwise_source() -> str:
    lines = [f"  out[{i} * (long long)n + i] = {expr};" for i, (expr, _) in enumerate(POINTWISE.values())]
    return (
        '#include "common.cuh"\n'
        "// Applies every sc_ pointwise helper: out is [num_helpers][n].\n"
        'extern "C" __global__ void sc_test_pointwise(const float* __restrict__ x, const float* __restrict__ gy,\n'
        "                                             float* __restrict__ out, int n) {\n"
        "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  if (i >= n) return;\n"
        "  const float v = x[i], g = gy[i];\n" + "\n".join(lines) + "\n}\n"
    )


REDUCE_SOURCE = r"""
#include "common.cuh"
// One block per row: sum, max, min, mean, var (correction 1) of x[row, :cols] -> out[row, 0:5].
extern "C" __global__ void sc_test_block_reduce(const float* __restrict__ x, float* __restrict__ out, int cols) {
  __shared__ float scratch[32];
  __shared__ sc_welford wscratch[32];
  const float* row = x + (long long)blockIdx.x * cols;
  float s = 0.f, mx = sc_op_max::identity(), mn = sc_op_min::identity();
  sc_welford w = sc_welford_init();
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = row[j];
    s += v; mx = sc_maxf(mx, v); mn = sc_minf(mn, v); w = sc_welford_update(w, v);
  }
  s = sc_block_sum(s, scratch);
  mx = sc_block_max(mx, scratch);
  mn = sc_block_min(mn, scratch);
  w = sc_block_welford(w, wscratch);
  // Every thread must hold the same bits: check it, then let thread 0 write.
  const float s0 = __shfl_sync(SC_FULL_MASK, s, 0);
  SC_DEVICE_CHECK(s == s0 || (s != s && s0 != s0));
  if (threadIdx.x == 0) {
    float* o = out + blockIdx.x * 5;
    o[0] = s; o[1] = mx; o[2] = mn; o[3] = w.mean; o[4] = sc_welford_var(w, 1.f);
  }
}

// One warp per row (blockDim.x == 32): warp-level sum, max, min, mean, var.
extern "C" __global__ void sc_test_warp_reduce(const float* __restrict__ x, float* __restrict__ out, int cols) {
  const float* row = x + (long long)blockIdx.x * cols;
  float s = 0.f, mx = sc_op_max::identity(), mn = sc_op_min::identity();
  sc_welford w = sc_welford_init();
  for (int j = threadIdx.x; j < cols; j += 32) {
    const float v = row[j];
    s += v; mx = sc_maxf(mx, v); mn = sc_minf(mn, v); w = sc_welford_update(w, v);
  }
  s = sc_warp_sum(s); mx = sc_warp_max(mx); mn = sc_warp_min(mn); w = sc_warp_welford(w);
  if (threadIdx.x == 0) {
    float* o = out + blockIdx.x * 5;
    o[0] = s; o[1] = mx; o[2] = mn; o[3] = w.mean; o[4] = sc_welford_var(w, 1.f);
  }
}
"""

VECTOR_SOURCE = r"""
#include "common.cuh"
// Each thread moves 8 floats: f4 loads -> packed half8 / bf16x8 stores, then reloads and unpacks them;
// also pairs through h2/bf2 accessors. n is a multiple of 8 and all pointers 16-byte aligned.
extern "C" __global__ void sc_test_vector(const float* __restrict__ x, __half* __restrict__ h, __nv_bfloat16* __restrict__ b,
                                          float* __restrict__ back_h, float* __restrict__ back_b,
                                          __half* __restrict__ h_pairs, __nv_bfloat16* __restrict__ b_pairs, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int i = t * 8;
  if (i >= n) return;
  SC_DEVICE_CHECK(sc_is_aligned16(x + i) && sc_is_aligned16(h + i) && sc_is_aligned16(b + i));
  float v[8];
  const float4 lo = sc_ld_f4(x + i), hi = sc_ldg_f4(x + i + 4);
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  sc_st_u4(h + i, sc_pack_half8(v));
  sc_st_u4(b + i, sc_pack_bf16x8(v));
  float uh[8], ub[8];
  sc_unpack_half8(sc_ld_u4(h + i), uh);
  sc_unpack_bf16x8(sc_ld_u4(b + i), ub);
  sc_st_f4(back_h + i, make_float4(uh[0], uh[1], uh[2], uh[3]));
  sc_st_f4(back_h + i + 4, make_float4(uh[4], uh[5], uh[6], uh[7]));
  sc_st_f4(back_b + i, make_float4(ub[0], ub[1], ub[2], ub[3]));
  sc_st_f4(back_b + i + 4, make_float4(ub[4], ub[5], ub[6], ub[7]));
#pragma unroll
  for (int k = 0; k < 8; k += 2) {
    const float2 ph = sc_to_float2(sc_ld_h2(h + i + k));
    const float2 pb = sc_to_float2(sc_ld_bf2(b + i + k));
    sc_st_h2(h_pairs + i + k, sc_float2_to_half2(ph));
    sc_st_bf2(b_pairs + i + k, sc_float2_to_bf162(pb));
  }
}
"""

ALL_SOURCES = {
    "sc_test_pointwise": pointwise_source(),
    "sc_test_block_reduce": REDUCE_SOURCE,
    "sc_test_vector": VECTOR_SOURCE,
}


# --------------------------------------------------------------------------- compile (no GPU)


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("name", sorted(ALL_SOURCES))
def test_common_cuh_compiles_with_nvcc(name, arch):
    kernel = toolchain.compile_cubin(ALL_SOURCES[name], name, arch)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert name.encode() in kernel.cubin  # the extern "C" symbol is in the cubin
    assert kernel.arch == arch


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,native", [("sm_90a", True), ("sm_80", True), ("sm_75", False)])
def test_nan_propagating_max_and_min_are_ptx_max_nan_from_sm80(arch, native, tmp_path):
    """sc_maxf / sc_minf (and the generated kernels' sfk_maximum / sfk_minimum, which call
    them) are PTX's max.NaN / min.NaN from sm_80: the portable form compiled to two
    compares and two branches an element. Before sm_80 the portable form stays."""
    import subprocess

    src = tmp_path / "mx.cu"
    src.write_text('#include "fused_ops.cuh"\n'
                   'extern "C" __global__ void mx(const float* a, float* o) {\n'
                   '  o[0] = sc_maxf(a[0], a[1]); o[1] = sc_minf(a[0], a[1]);\n'
                   '  o[2] = sfk_maximum(a[2], a[3]); o[3] = sfk_minimum(a[2], a[3]);\n}\n')
    ptx = tmp_path / "mx.ptx"
    subprocess.run([toolchain.find_nvcc(), "-ptx", f"-arch={arch}", "-std=c++17",
                    f"-I{toolchain.csrc_dir()}", "-o", str(ptx), str(src)], check=True)
    text = ptx.read_text()
    if native:
        assert text.count("max.NaN.f32") == 2 and text.count("min.NaN.f32") == 2, text
    else:
        assert "max.NaN" not in text and "min.NaN" not in text


def _nvrtc_or_skip():
    try:
        return toolchain.nvrtc_version()
    except toolchain.ToolchainError as e:
        pytest.skip(f"libnvrtc does not load here: {str(e).splitlines()[0]}")


@pytest.mark.parametrize("name", sorted(ALL_SOURCES))
def test_common_cuh_compiles_with_nvrtc(name):
    _nvrtc_or_skip()
    kernel = toolchain.compile_nvrtc(ALL_SOURCES[name], name, "sm_90a")
    assert kernel.cubin[:4] == b"\x7fELF"
    assert kernel.cmd[0] == "nvrtc"


# --------------------------------------------------------------------------- GPU checks


def _inputs(torch, n=4096):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * 4
    special = torch.tensor([0.0, -0.0, 1e-7, -1e-7, 3.0, -3.0, 2.5, 10.0, 19.9, 20.1, 30.0, -30.0, 88.0, -88.0,
                            100.0, -100.0, float("inf"), float("-inf"), float("nan")])
    x[: special.numel()] = special
    g = torch.randn(n, generator=gen)
    g[5] = float("nan")
    return x.cuda(), g.cuda()


def _load(name):
    from stitch_backend.cuda_driver import CudaModule

    kernel = toolchain.compile_kernel(ALL_SOURCES[name], name, toolchain.device_arch())
    return CudaModule(kernel.cubin)


@pytest.mark.gpu
def test_pointwise_helpers_match_torch():
    import torch

    x, g = _inputs(torch)
    n = x.numel()
    out = torch.full((len(POINTWISE), n), float("nan"), device="cuda")
    mod = _load("sc_test_pointwise")
    mod.function("sc_test_pointwise", "pppi").launch(((n + 255) // 256, 1, 1), (256, 1, 1),
                                                     (x.data_ptr(), g.data_ptr(), out.data_ptr(), n))
    torch.cuda.synchronize()
    failures = []
    for row, (name, (expr, ref_fn)) in enumerate(POINTWISE.items()):
        got = out[row]
        if ref_fn is None:  # std::max: (a < b) ? b : a, checked where both are finite
            finite = torch.isfinite(x) & torch.isfinite(g)
            ref = torch.where(x < g, g, x)
            if not torch.equal(got[finite], ref[finite]):
                failures.append(f"{name}: differs from (a<b)?b:a")
            continue
        ref = ref_fn(torch, x, g)
        try:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6, equal_nan=True)
        except AssertionError as e:
            bad = (~torch.isclose(got, ref, rtol=2e-6, atol=1e-6, equal_nan=True)).nonzero().flatten()[:5]
            failures.append(f"{name} ({expr}): " + ", ".join(
                f"x={x[i].item()!r} g={g[i].item()!r} got={got[i].item()!r} torch={ref[i].item()!r}" for i in bad)
                            + f" [{str(e).splitlines()[0]}]")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("cols,block", [(1, 32), (37, 32), (1000, 96), (4096, 256), (65536, 1024)])
def test_block_and_warp_reductions_match_torch(cols, block):
    import torch

    rows = 16
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(rows, cols, generator=gen) * 3 + 1).cuda()
    x[3, cols // 2] = float("nan")  # max/min/sum propagate NaN like torch
    mod = _load("sc_test_block_reduce")
    for kernel, blk in (("sc_test_block_reduce", block), ("sc_test_warp_reduce", 32)):
        fn = mod.function(kernel, "ppi")
        outs = []
        for _ in range(2):
            out = torch.full((rows, 5), float("nan"), device="cuda")
            fn.launch((rows, 1, 1), (blk, 1, 1), (x.data_ptr(), out.data_ptr(), cols))
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), f"{kernel} is not deterministic"
        out = outs[0].double()
        xd = x.double()
        tol = 1e-6 * math.sqrt(cols) + 1e-6
        scale = xd.abs().nan_to_num(0).sum(1) / cols  # mean |x| per row
        checks = {
            "sum": (out[:, 0], xd.sum(1), tol * scale * cols),
            "max": (out[:, 1], xd.amax(1), 0.0 * scale),
            "min": (out[:, 2], xd.amin(1), 0.0 * scale),
            "mean": (out[:, 3], xd.mean(1), tol * scale),
            "var": (out[:, 4], xd.var(1, correction=1), tol * xd.var(1, correction=1).abs().nan_to_num(0) + 1e-30),
        }
        for stat, (got, ref, atol) in checks.items():
            nan_ok = torch.isnan(got) == torch.isnan(ref)
            close = ((got - ref).abs() <= atol) | (torch.isnan(got) & torch.isnan(ref)) | (got == ref)
            assert bool(nan_ok.all() and close.all()), (
                f"{kernel} cols={cols} {stat}: got {got.tolist()} want {ref.tolist()}")


@pytest.mark.gpu
def test_vector_access_and_conversions_match_torch():
    import torch

    n = 8 * 1000
    x = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 100).cuda()
    x[:4] = torch.tensor([70000.0, -1e-8, 65504.0, 3.0e38])  # overflow to inf in half; tiny; max half; bf16 range
    h = torch.empty(n, dtype=torch.half, device="cuda")
    b = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    back_h, back_b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    h_pairs, b_pairs = torch.empty_like(h), torch.empty_like(b)
    mod = _load("sc_test_vector")
    mod.function("sc_test_vector", "pppppppi").launch(
        ((n // 8 + 127) // 128, 1, 1), (128, 1, 1),
        (x.data_ptr(), h.data_ptr(), b.data_ptr(), back_h.data_ptr(), back_b.data_ptr(), h_pairs.data_ptr(),
         b_pairs.data_ptr(), n))
    torch.cuda.synchronize()
    assert torch.equal(h.view(torch.int16), x.half().view(torch.int16))
    assert torch.equal(b.view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(back_h, x.half().float())
    assert torch.equal(back_b, x.bfloat16().float())
    assert torch.equal(h_pairs.view(torch.int16), h.view(torch.int16))
    assert torch.equal(b_pairs.view(torch.int16), b.view(torch.int16))
