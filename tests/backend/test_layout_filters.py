"""Convolution weights in the channels-last pass (``layout._Rewrite._filter``): each
filter not channels-last already is converted once in the graph, a region of its own."""

from __future__ import annotations

import torch
import torch.nn as nn

from stitch_backend import layout

from .test_layout import _check

aten = torch.ops.aten


class SharedFilters(nn.Module):
    """A 3x3 convolution applied twice (one weight, two convolutions), a 1x1 and a
    depthwise one: filters whose channels-last layout differs from the traced one only
    where the kernel is wider than 1x1 and the input has more than one channel."""

    def __init__(self):
        super().__init__()
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.pointwise = nn.Conv2d(8, 16, 1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x):
        y = torch.relu(self.conv3(torch.relu(self.conv3(x))))
        return self.depthwise(self.pointwise(y))


def test_convolution_weights_are_converted_once_in_the_graph():
    """cuDNN's NHWC kernels read channels-last filters: the pass converts each weight
    that is not so already with a clone of the graph's own (a region the Coder
    generates), once per weight, before its first convolution; results stay eager's."""
    backend = _check(SharedFilters, torch.randn(2, 8, 10, 10), train_mode=False)
    (rec,) = backend.records
    convs = [n for n in rec.gm.graph.nodes
             if n.target in (aten.convolution.default, aten._convolution.default)]
    assert len(convs) == 4
    weights = [n.args[1] for n in convs]
    # every convolution reads a channels-last filter
    assert all(w.meta["val"].is_contiguous(memory_format=torch.channels_last) for w in weights)
    converted = [w for w in weights if w.op == "call_function"]
    # the shared 3x3 weight: one conversion for both of its convolutions; the 1x1 and the
    # depthwise weights are channels-last as traced and read directly
    assert len(converted) == 2 and converted[0] is converted[1]
    (clone,) = set(converted)
    assert clone.target is aten.clone.default and clone.args[0].op == "placeholder"
    assert clone.kwargs["memory_format"] is torch.channels_last and clone.meta[layout.FILTER]
    assert [w.op for w in weights[2:]] == ["placeholder", "placeholder"]
    note = next(n for n in rec.notes if n.startswith("channels-last: "))
    assert ", 1 convolution weight(s) converted" in note, note
    # the conversion is a region of its own, generated (not left on ATen)
    (region,) = [r for r in rec.plan.regions if clone.name in r.nodes]
    assert region.nodes == [clone.name] and region.kind.name == "FUSED"
    assert region.kernel is not None and rec.plan.counts()["fallback"] == 0
