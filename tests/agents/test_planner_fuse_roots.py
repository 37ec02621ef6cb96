"""The Planner's experimental ``fuse_roots``: pointwise roots (ops reading only graph
inputs) join their first fused consumer's region; the partition stays complete and
ordered, and the pipeline keeps eager's results on every zoo model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stitch_backend.agents.planner import check_plan
from stitch_backend.backend import StitchBackend
from stitch_backend.ir import RegionKind
from tests.zoo import zoo


class KLDiv(torch.nn.Module):
    def forward(self, predictions, targets):
        return F.kl_div(torch.log(predictions), targets, reduction="batchmean")


class RootIntoMatmul(torch.nn.Module):
    """A root (x * 2) that a matrix product consumes, and one the graph only returns."""

    def forward(self, x, w):
        return (x * 2) @ w, (w + 1)


def _kl_inputs():
    return [torch.randn(8, 32).softmax(-1), torch.randn(8, 32).softmax(-1)]


def _plan(model, inputs, **options):
    backend = StitchBackend(options=dict({"codegen": False}, **options))
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    (rec,) = backend.records
    check_plan(rec.gm, rec.plan)
    return rec.plan


def test_kl_div_becomes_one_fused_region():
    # by default the roots join as siblings over their shared inputs (and input-less
    # factories, scalar_tensor, wait for their consumer); with fuse_roots they wait for
    # their consumer: one region either way (four before sibling fusion took graph inputs)
    for options in ({}, {"fuse_roots": True}):
        plan = _plan(KLDiv(), _kl_inputs(), **options)
        assert [r.kind for r in plan.regions] == [RegionKind.FUSED], [r.ops for r in plan.regions]
        assert "aten.isnan.default" in plan.regions[0].ops


def test_roots_before_a_library_call_or_returned_get_their_own_fused_region():
    plan = _plan(RootIntoMatmul(), [torch.randn(4, 8), torch.randn(8, 3)], fuse_roots=True)
    kinds = [r.kind for r in plan.regions]
    assert RegionKind.GEMM in kinds
    gemm = next(r for r in plan.regions if r.kind is RegionKind.GEMM)
    assert all(op in ("aten.mm.default",) for op in gemm.ops), gemm.ops
    assert sum(1 for r in plan.regions if r.kind is RegionKind.FUSED) == 2


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("name", sorted(zoo()))
def test_zoo_keeps_eager_results_with_fuse_roots(name, training):
    cls, make_inputs = zoo()[name]
    torch.manual_seed(0)
    model = cls()
    model = model.train() if training else model.eval()
    inputs = make_inputs(2)
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "fuse_roots": True})
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    with torch.set_grad_enabled(training):
        got = compiled(*inputs)
    torch.manual_seed(1)
    with torch.set_grad_enabled(training):
        want = model(*inputs)
    flat = lambda v: [x for i in v for x in flat(i)] if isinstance(v, (list, tuple)) else [v]
    for g, w in zip(flat(got), flat(want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for rec in backend.records:
        check_plan(rec.gm, rec.plan)


def test_kl_div_single_region_is_generated_and_correct():
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                     "fuse_roots": True})
    compiled = torch.compile(KLDiv(), backend=backend)
    inputs = _kl_inputs()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(*inputs), KLDiv()(*inputs))
    (rec,) = backend.records
    assert rec.plan.counts()["generated"] == 1, [r.reason for r in rec.plan.regions]


class ConvBNReLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_auto_fuses_roots_in_backward_graphs_only_and_keeps_eagers_gradients():
    """'auto': a training BatchNorm's backward (two per-channel sums, the input gradient)
    is one fused region instead of four; the forward is planned as by default; the
    gradients are eager's (CPU interpreter of the generated kernels)."""
    torch.manual_seed(0)
    model = ConvBNReLU().train()
    ref = ConvBNReLU().train()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 4, 10, 10)
    counts = {}
    for fuse_roots in (False, None):
        backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False,
                                         "fuse_roots": fuse_roots})
        compiled = torch.compile(model, backend=backend)
        xc = x.clone().requires_grad_()
        compiled(xc).square().sum().backward()
        counts[fuse_roots] = {r.stage: r.plan.counts()["fused"] for r in backend.records}
        xr = x.clone().requires_grad_()
        ref(xr).square().sum().backward()
        torch.testing.assert_close(xc.grad, xr.grad, atol=1e-4, rtol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
        (bw,) = [r for r in backend.records if r.stage == "backward"]
        assert bw.plan.counts()["generated"] == 1, [r.reason for r in bw.plan.regions]
        model.zero_grad()
        ref.zero_grad()
        torch._dynamo.reset()
    assert counts[None]["forward"] == counts[False]["forward"]
    # without deferred roots, the Planner's root-host rule (an op reading an older fused
    # region and a newest one of ops on graph inputs alone folds the newest into the
    # older) now reaches the same single region here; before it, sibling fusion left 3
    assert counts[None]["backward"] == 1 and counts[False]["backward"] == 1, counts
