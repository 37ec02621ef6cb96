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
    """conv -> BN -> ReLU -> 2x2 max pool (rewritten), a 3x3/2 padded max pool (kept),
    a 2x2 average pool (rewritten), a padded average pool (kept)."""

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


def test_disjoint_pooling_runs_as_a_generated_amax_with_eager_values():
    torch.manual_seed(0)
    model = PoolNet().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False})
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
    for target in (aten.amax.default, aten.mean.dim):
        node = next(n for n in rec.gm.graph.nodes if n.target is target)
        region = next(r for r in rec.plan.regions if node.name in r.nodes)
        assert region.backend == "kernel", (region.backend, region.reason)


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
