"""A disjoint-window pooling after a convolution's epilogue joins the convolution's
region: the pooled kernel reads the epilogue's values as it computes them (with split
BatchNorm statistics, the normalisation runs inside the pooling's kernel) instead of a
written copy. Planned, proposed and run through the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module
from tests.agents.test_stem_conv_alternative import _region_inputs

aten = torch.ops.aten


class ConvBnPool(nn.Module):
    def __init__(self, cin=4, cout=8, pool="max", tail=False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.pool = nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)
        self.tail = tail

    def forward(self, x):
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        return torch.tanh(y) * 2 if self.tail else y


class ConvActPool(nn.Module):
    """L2 35's shape: conv, pointwise, max pool, pointwise."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        y = nn.functional.hardswish(self.conv(x) - 0.5)
        return nn.functional.mish(nn.functional.max_pool2d(y, 2))


def _compiled(model, x):
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "layout_race": False})  # one record
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    return rec, out


def _eager_then_compiled(model, reference, x):
    """``reference(x)`` (eager), then ``model`` compiled on ``x``: same values, same
    strides; the record and the output."""
    with torch.no_grad():
        expected = reference(x)
    rec, out = _compiled(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out.stride() == expected.stride()
    return rec, out


def _node_ops(rec, region):
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    return [str(nodes[n].target) for n in region.nodes]


@pytest.mark.parametrize("layout", [None, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("pool,tail", [("max", False), ("avg", True)], ids=["max", "avg_tail"])
def test_the_pooling_joins_the_convolution_region_and_the_result_is_eager(layout, pool, tail):
    torch.manual_seed(0)
    model = ConvBnPool(4, 8, pool, tail).train()
    x = torch.randn(4, 4, 16, 16)
    want = ConvBnPool(4, 8, pool, tail).train()
    want.load_state_dict(model.state_dict())
    rec, _ = _eager_then_compiled(model, want, x if layout is None else
                                  x.contiguous(memory_format=layout))
    (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    reduce = "aten.amax.default" if pool == "max" else "aten.mean.dim"
    assert reduce in _node_ops(rec, conv)
    if tail:   # pointwise ops of the pooled size follow it into the region
        assert "aten.tanh.default" in _node_ops(rec, conv)
    assert not [r for r in rec.plan.regions if r is not conv and reduce in _node_ops(rec, r)]


def test_split_statistics_normalise_inside_the_pooling_kernel():
    torch.manual_seed(0)
    model = ConvBnPool(4, 8, "max").train()
    x = torch.randn(8, 4, 32, 32).contiguous(memory_format=torch.channels_last)
    rec, _ = _compiled(model, x)
    (region,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    cand = TemplateCoder().propose(subtask_for(rec.gm, region, "k"))
    splits = [a for a in cand.alternatives if a.name.endswith("split1p")]
    assert splits
    # the normalisation and the pooling in one kernel (the view back to NCHW after it)
    last = [s.kernel for s in splits[0].stages if s.kernel is not None][-1]
    assert {"aten.amax.default", "aten.mul.Tensor", "aten.relu.default"} <= set(last.ops), last.ops
    inputs = _region_inputs(rec, region)
    want = region_module(rec.gm, region)(*inputs)
    for alt in [cand, *cand.alternatives]:
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_an_activation_between_convolution_and_pooling_fuses_too():
    torch.manual_seed(0)
    model = ConvActPool()
    rec, _ = _eager_then_compiled(model, model, torch.randn(4, 3, 18, 18))
    (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    ops = _node_ops(rec, conv)
    # channels-last: the Mish after the pooling runs before the view back to NCHW, so
    # the template writes the epilogue, the pooling and the Mish in one kernel
    cand = TemplateCoder().propose(subtask_for(rec.gm, conv, "k"))
    kernels = [s.kernel for s in cand.stages if s.kernel is not None]
    assert len(kernels) == 1 and {"aten.amax.default", "aten.tanh.default"} <= set(kernels[0].ops)
    assert "aten.amax.default" in ops and "aten.sub.Tensor" in ops, ops
    assert "aten.mish.default" in ops or "aten.tanh.default" in ops, ops  # after the pool


class PoolTwice(nn.Module):
    """The pooled value returned as is and through pointwise ops: both keep eager's
    values and strides when the ops move before the view back to NCHW."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        p = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return p, torch.tanh(p) * 2 + 1, p.sum(dim=1)


def test_pointwise_ops_after_a_channels_last_pooling_keep_values_and_strides():
    torch.manual_seed(0)
    model = PoolTwice()
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model(x)
    rec, out = _compiled(model, x)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-4)
        assert o.stride() == e.stride()
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    tanh = next(n for n in nodes.values() if n.target is aten.tanh.default)
    assert tanh.args[0].target is aten.amax.default    # computed on the (N, H, W, C) rows


class ConvBnOverlapPool(nn.Module):
    """A ResNet stem's shape: conv, BatchNorm, ReLU, then a pooling over overlapping
    windows (codegen.lower_pooling), a pointwise op of the pooled size after it."""

    def __init__(self, pool="max"):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1) if pool == "max" else nn.AvgPool2d(3, 1, 1)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(self.conv(x)))) * 2


@pytest.mark.parametrize("layout", [None, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_an_overlapping_pooling_joins_the_convolution_region_and_the_result_is_eager(layout, pool):
    torch.manual_seed(0)
    model = ConvBnOverlapPool(pool).train()
    want = ConvBnOverlapPool(pool).train()
    want.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 64, 64)
    rec, _ = _eager_then_compiled(model, want, x if layout is None else
                                  x.contiguous(memory_format=layout))
    (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    target = ("aten.max_pool2d_with_indices.default" if pool == "max"
              else "aten.avg_pool2d.default")
    ops = _node_ops(rec, conv)
    assert target in ops and "aten.mul.Tensor" in ops, ops
    assert conv.backend == "kernel", conv.reason
    # with split statistics, the normalisation runs inside the pooling's kernel
    cand = TemplateCoder().propose(subtask_for(rec.gm, conv, "k"))
    inputs = _region_inputs(rec, conv)
    region_out = region_module(rec.gm, conv)(*inputs)
    splits = [a for a in cand.alternatives if a.name.endswith("split1p")]
    assert splits
    last = [s.kernel for s in splits[0].stages if s.kernel is not None][-1]
    assert {target, "aten.relu.default"} <= set(last.ops), last.ops
    for alt in [cand, *cand.alternatives]:
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, region_out):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


class ConvGlobalPool(nn.Module):
    """KernelBench L2 67's shape: conv, GELU, a global pooling (``adaptive_avg_pool2d(x,
    1)``, ``x.mean((2, 3))``, ``amax`` over the spatial dims); ``x.sum((1, 2, 3))`` also
    reduces the channels, not a pooling."""

    def __init__(self, how):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.how = how

    def forward(self, x):
        y = nn.functional.gelu(self.conv(x))
        if self.how == "adaptive":
            return nn.functional.adaptive_avg_pool2d(y, 1).flatten(1) * 2
        if self.how == "mean":
            return y.mean((-1, -2))
        if self.how == "amax":
            return y.amax((2, 3), keepdim=True)
        return y.sum((1, 2, 3))


@pytest.mark.parametrize("layout", [None, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("how", ["adaptive", "mean", "amax", "channels_too"])
def test_a_global_pooling_joins_the_convolution_region_and_the_result_is_eager(layout, how):
    torch.manual_seed(0)
    model = ConvGlobalPool(how)
    x = torch.randn(4, 3, 18, 18)
    rec, _ = _eager_then_compiled(model, model, x if layout is None else
                                  x.contiguous(memory_format=layout))
    (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    ops = _node_ops(rec, conv)
    reduce = {"adaptive": "aten.mean.dim", "mean": "aten.mean.dim", "amax": "aten.amax.default",
              "channels_too": "aten.sum.dim_IntList"}[how]
    if how == "channels_too":
        assert reduce not in ops, ops
        return
    assert reduce in ops and "aten.gelu.default" in ops, ops
    if how == "adaptive":     # a pointwise op of the pooled size follows it in
        assert "aten.mul.Tensor" in ops, ops
    assert conv.backend == "kernel", conv.reason
    cand = TemplateCoder().propose(subtask_for(rec.gm, conv, "k"))
    # the epilogue and the pooling in one kernel: the epilogue's values are never written
    kernels = [s.kernel for s in cand.stages if s.kernel is not None]
    assert {reduce, "aten.gelu.default"} <= set(kernels[0].ops), kernels[0].ops
