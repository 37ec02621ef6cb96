"""Disjoint-window pooling as an amax/mean reduction: eager's values, generated kernels,
and the poolings it cannot express left as they are."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from stitch_backend.backend import StitchBackend
from stitch_backend.pooling import pools_as_reductions

aten = torch.ops.aten


class PoolNet(nn.Module):
    """conv -> BN -> ReLU -> 2x2 max pool (rewritten), a 3x3/2 padded max pool (kept as
    a pooling op), a 2x2 average pool (rewritten), a padded average pool (kept)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2, 2)
        self.overlap = nn.MaxPool2d(3, 2, padding=1)
        self.avg = nn.AvgPool2d(2)
        self.avg_padded = nn.AvgPool2d(2, padding=1)

    def forward(self, x):
        y = self.overlap(self.pool(torch.relu(self.bn(self.conv(x)))))
        return self.avg(y) + 1, self.avg_padded(y)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _pool_net():
    """PoolNet, an eager copy, and a backend interpreting its kernels on the CPU."""
    torch.manual_seed(0)
    model = PoolNet().train()
    return model, copy.deepcopy(model), StitchBackend(options={
        "cpu_interpret": True, "cache": False, "require_speedup": False,
        "layout_race": False})


def test_disjoint_pooling_runs_as_a_generated_amax_with_eager_values():
    model, reference, backend = _pool_net()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 16, 16)
    x[0, 0, 0, 0] = float("nan")                  # NaN propagates through both
    with torch.no_grad():
        for _ in range(2):
            for got, want in zip(compiled(x), reference(x)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    (rec,) = backend.records
    targets = _targets(rec.gm)
    assert targets.count(aten.max_pool2d_with_indices.default) == 1    # the padded ones
    assert targets.count(aten.avg_pool2d.default) == 1
    assert "2 pooling(s) over disjoint windows run as amax/mean reductions the Coder " \
           "generates" in rec.notes
    # the overlapping (padded) ones stay pooling ops, lowered to window reductions
    for target in (aten.amax.default, aten.mean.dim, aten.max_pool2d_with_indices.default,
                   aten.avg_pool2d.default):
        node = next(n for n in rec.gm.graph.nodes if n.target is target)
        region = next(r for r in rec.plan.regions if node.name in r.nodes)
        assert region.backend == "kernel", (target, region.backend, region.reason)


def test_a_pooling_whose_indices_a_backward_reads_stays_on_aten_and_says_why():
    model, reference, backend = _pool_net()
    x = torch.randn(2, 3, 16, 16)
    got = torch.compile(model, backend=backend)(x)
    want = reference(x)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(model.conv.weight.grad, reference.conv.weight.grad,
                               rtol=1e-4, atol=1e-4)
    forward = backend.records[0]
    def regions(prefix):
        return [r for r in forward.plan.regions if any(n.startswith(prefix) for n in r.nodes)]
    pools = regions("max_pool2d_with_indices")     # both: the backward reads their indices
    assert len(pools) == 2
    for pool in pools:
        assert pool.backend == "aten" and "indices are read" in pool.reason, pool.reason
    avgs = regions("avg_pool2d")                   # nothing of theirs is saved
    assert avgs and all(r.backend == "kernel" for r in avgs), [r.reason for r in avgs]


def test_indices_in_use_or_uneven_windows_keep_the_pooling():
    def graph(fn, x):
        backend = StitchBackend(options={"codegen": False})
        with torch.no_grad():
            torch.compile(fn, backend=backend)(x)
        return backend.records[0].gm

    with_indices = graph(lambda x: nn.functional.max_pool2d(x, 2, return_indices=True)[1] * 1,
                         torch.randn(1, 2, 8, 8))
    uneven = graph(lambda x: nn.functional.max_pool2d(x, 2), torch.randn(1, 2, 7, 8))
    for gm in (with_indices, uneven):
        assert pools_as_reductions(gm) == (gm, 0)
    even = graph(lambda x: nn.functional.max_pool2d(x, 2) + 1, torch.randn(1, 2, 8, 8))
    new, count = pools_as_reductions(even)
    assert count == 1 and aten.max_pool2d_with_indices.default not in _targets(new)
    x = torch.randn(1, 2, 8, 8)
    torch.testing.assert_close(new(x)[0], nn.functional.max_pool2d(x, 2) + 1)


def test_symbolic_sizes_keep_the_pooling():
    backend = StitchBackend(options={"codegen": False})
    fn = torch.compile(lambda x: nn.functional.avg_pool2d(x, 2) * 2, backend=backend,
                       dynamic=True)
    with torch.no_grad():
        fn(torch.randn(2, 2, 8, 8))
    gm = backend.records[-1].gm
    (pool,) = [n for n in gm.graph.nodes if n.target is aten.avg_pool2d.default]
    assert any(isinstance(s, torch.SymInt) for s in pool.args[0].meta["val"].shape)
    assert pools_as_reductions(gm) == (gm, 0)


def test_a_channels_last_pooling_reduces_along_channels_and_keeps_its_strides():
    """A pooling whose input is channels-last (the layout pass's convolutions; here a
    channels-last input on the CPU) is pooled as (N, H, W, C): permute, view, reduce,
    permute back, so the generated reduction reads and writes with C contiguous and its
    result has the channels-last strides ATen's pooling gives; values as eager's."""
    import torch.nn.functional as F
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b):
        return F.avg_pool2d(F.max_pool2d(torch.relu(F.conv2d(x, w, b, padding=1)), 2), 2)

    torch.manual_seed(0)
    args = (torch.randn(2, 3, 16, 12).to(memory_format=torch.channels_last),
            torch.randn(8, 3, 3, 3), torch.randn(8))
    traced = make_fx(f, decomposition_table=core_aten_decompositions(),
                     tracing_mode="fake")(*args)
    traced.graph.eliminate_dead_code()      # the unused indices (AOTAutograd drops them)
    traced.recompile()
    new, count = pools_as_reductions(traced)
    assert count == 2
    targets = _targets(new)
    assert aten.max_pool2d_with_indices.default not in targets
    assert aten.avg_pool2d.default not in targets
    assert targets.count(aten.permute.default) == 4
    for target in (aten.amax.default, aten.mean.dim):
        node = next(n for n in new.graph.nodes if n.target is target)
        assert node.args[1] == [2, 4]
        assert node.meta["val"].is_contiguous()          # (N, H/k, W/k, C), C contiguous
    want = f(*args)
    assert want.is_contiguous(memory_format=torch.channels_last) and not want.is_contiguous()
    out = next(n for n in new.graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].stride() == want.stride()
    got = new(*args)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)
