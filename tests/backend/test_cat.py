"""Concatenation is fused like any pointwise op (it was a fallback region of its own):
a ViT-style class token, and a DenseNet-style concatenation feeding a BatchNorm; with
channels-last convolutions, a DenseNet block's concatenations stay channels-last."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from stitch_backend import layout
from stitch_backend.backend import StitchBackend
from tests.backend.test_layout import _check

aten = torch.ops.aten


class ClassToken(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 7, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.proj(x)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.norm(x)


class DenseConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(torch.cat([x, self.conv(x)], 1)))


def _run(model, x):
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": False})
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-4)
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if any(n.startswith("cat") for n in r.nodes)]
    return rec, region


def test_a_class_token_concatenation_is_fused_with_what_follows():
    rec, region = _run(ClassToken().eval(), torch.randn(3, 6, 8))
    assert region.kind.value != "fallback" and region.backend == "kernel", region.reason
    assert any(n.startswith("add") for n in region.nodes), region.nodes
    assert not [r for r in rec.plan.regions if r.kind.value == "fallback"]


def test_a_concatenation_feeding_a_batchnorm_runs_generated():
    rec, region = _run(DenseConcat().train(), torch.randn(2, 4, 6, 6))
    assert region.backend == "kernel", region.reason
    assert not [r for r in rec.plan.regions if r.kind.value == "fallback"]


class DenseBlock(nn.Module):
    """DenseNet's block: each layer (BatchNorm, ReLU, convolution) reads the concatenation
    of the block's input and every earlier layer's output."""

    def __init__(self, channels=8, growth=8, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(channels + i * growth), nn.ReLU(),
                          nn.Conv2d(channels + i * growth, growth, 3, padding=1))
            for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


def test_a_dense_blocks_concatenations_run_channels_last():
    """The block's NCHW input is concatenated with channels-last convolution outputs:
    converted once, it keeps every concatenation channels-last, so no layer converts
    its whole concatenation for its convolution (before: one conversion a layer after
    the first). Conversions: the input before the first convolution, the input for
    the concatenations, the output back to NCHW, whatever the number of layers; the last
    one ends the last concatenation's region (one tiled kernel writes the output)."""
    for layers in (3, 5):
        backend = _check(lambda: DenseBlock(layers=layers), torch.randn(2, 8, 6, 6))
        (rec,) = backend.records
        nodes = {n.name: n for n in rec.gm.graph.nodes}
        conversions = [n for n in nodes.values()
                       if layout.CONVERSION in n.meta and layout.FILTER not in n.meta]
        assert len(conversions) == 3, [n.format_node() for n in conversions]
        cats = [n for n in nodes.values() if n.target is aten.cat.default and len(n.args[0]) > 1]
        assert len(cats) == layers and all(n.meta["val"].is_contiguous(memory_format=torch.channels_last) for n in cats)
        back = conversions[-1]
        (region,) = [r for r in rec.plan.regions if back.name in r.nodes]
        assert [nodes[n].target for n in region.nodes] == [aten.cat.default, aten.clone.default]
