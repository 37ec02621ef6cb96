"""Sibling fusion in the Planner: a pointwise op with no fused producer joins a fused
region that reads the same computed value (scaled_dot_product_attention's math path: the
softmax of the scores and the check of rows masked throughout; the scaling of q and k,
views of one projection). Checked on the plan and, through the CPU interpreter, on the
values."""

from __future__ import annotations

import torch

from stitch_backend.agents.planner import check_plan
from stitch_backend.backend import StitchBackend
from stitch_backend.ir import RegionKind

OPTIONS = {"cpu_interpret": True, "require_speedup": False, "eager_guard": False}


def masked_rows_softmax(q, k, mask):
    """The math path's tail: softmax of q k^T + mask, with rows that are -inf throughout
    set to 0."""
    s = torch.bmm(q, k.transpose(1, 2)) + mask
    p = torch.softmax(s, -1)
    dead = (s == float("-inf")).logical_not().any(-1, keepdim=True).logical_not()
    return torch.where(dead, torch.zeros_like(p), p)


def scaled_heads(x, w):
    """q and k scaled apart, as the math path does, from views of one projection."""
    qk = (x @ w).view(x.shape[0], 2, 4, -1)
    q, k = qk[:, 0], qk[:, 1]
    return torch.bmm(q * 0.5, (k.transpose(1, 2) * 0.5).contiguous())


def _run(fn, *inputs):
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad():
        compiled(*inputs)             # ATen run; candidates verified on these inputs
        got = compiled(*inputs)       # verified kernels installed
    (rec,) = backend.records
    check_plan(rec.gm, rec.plan)
    return got, rec.plan.regions


def test_softmax_and_the_masked_row_check_are_one_kernel():
    torch.manual_seed(0)
    q, k, mask = torch.randn(3, 5, 8), torch.randn(3, 6, 8), torch.zeros(3, 5, 6)
    mask[1, 2] = float("-inf")    # a row of scores -inf throughout (NaN in softmax)
    mask[0, :, 4] = float("-inf")
    got, regions = _run(masked_rows_softmax, q, k, mask)
    fused = [r for r in regions if r.kind is RegionKind.FUSED]
    assert len(fused) == 1, [r.ops for r in regions]
    assert {"aten._softmax.default", "aten.any.dim", "aten.where.self"} <= set(fused[0].ops)
    assert fused[0].backend == "kernel", fused[0].reason
    want = masked_rows_softmax(q, k, mask)
    assert torch.equal(got[1, 2], torch.zeros(6))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_two_scalings_of_views_of_one_product_are_one_kernel():
    torch.manual_seed(0)
    x, w = torch.randn(3, 4, 16), torch.randn(16, 16)
    got, regions = _run(scaled_heads, x, w)
    muls = [r for r in regions if r.kind is RegionKind.FUSED and "aten.mul.Tensor" in r.ops]
    assert len(muls) == 1 and muls[0].ops.count("aten.mul.Tensor") == 2, [r.ops for r in regions]
    assert muls[0].backend == "kernel", muls[0].reason
    torch.testing.assert_close(got, scaled_heads(x, w), atol=1e-5, rtol=1e-5)


def test_a_softmax_region_takes_no_sibling_reading_another_view_of_its_rows():
    """``bmm(q, k^T).softmax(-1)`` and ``bmm(q, k^T).transpose(1, 2) * 2`` read one value,
    but the second does not walk the softmax's rows: two regions, as before."""

    def fn(q, k):
        s = torch.bmm(q, k.transpose(1, 2))
        return s.softmax(-1), s.transpose(1, 2) * 2.0

    q, k = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    got, regions = _run(fn, q, k)
    (soft,) = [r for r in regions if "aten._softmax.default" in r.ops]
    (mul,) = [r for r in regions if "aten.mul.Tensor" in r.ops]
    assert soft is not mul
    for a, b in zip(got, fn(q, k)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def new_gelu(x):
    """L1 88's tanh-GELU: ``0.5 * x`` and ``x ** 3`` both read only the graph input."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def test_ops_reading_the_same_graph_input_are_one_kernel_in_inference():
    torch.manual_seed(0)
    x = torch.randn(64, 48)
    got, regions = _run(new_gelu, x)
    assert len(regions) == 1, [r.ops for r in regions]
    assert regions[0].backend == "kernel", regions[0].reason
    torch.testing.assert_close(got, new_gelu(x), atol=1e-6, rtol=1e-6)


def test_roots_of_different_graph_inputs_stay_apart():
    """``log(p)`` and ``t * 2`` read different inputs: no siblings, two regions, with and
    without deferred roots (backward graphs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.agents.planner import partition

    def f(p, t):
        return torch.log(p).sum(), (t * 2).amax()

    gm = make_fx(f)(torch.rand(8, 8), torch.rand(8, 8))
    for defer in (False, True):
        plan = partition(gm, defer_roots=defer)
        assert [r.kind for r in plan.regions] == [RegionKind.FUSED] * 2, \
            [r.ops for r in plan.regions]
