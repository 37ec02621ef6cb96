"""``auto`` keeps the traced layout where a softmax runs over a convolution's positions
(rows strided channels-last, KernelBench L2 38), and rewrites where it runs over the
channels or over values no convolution made."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.backend.test_layout import _auto_notes, _check, _conv_inputs


class SpatialSoftmax(nn.Module):
    """L2 38's tail, smaller: Conv3d, clamp, a softmax over the flattened positions."""

    def __init__(self, dim: int = 2):
        super().__init__()
        self.conv, self.dim = nn.Conv3d(3, 8, 3, padding=1), dim

    def forward(self, x):
        y = torch.clamp(self.conv(x), 0.0, 1.0)
        b, c = y.shape[:2]
        return torch.softmax(y.view(b, c, -1), dim=self.dim).view_as(y)


def test_auto_declines_a_softmax_over_a_convolutions_positions():
    torch.manual_seed(0)
    (note,), rec = _auto_notes(SpatialSoftmax(), torch.randn(2, 3, 4, 4, 4))
    assert note.startswith("channels-last off: auto: ") and "softmax over the positions" in note
    assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))
    # forced, the rewrite applies and the values stay eager's
    torch._dynamo.reset()
    backend = _check(SpatialSoftmax, torch.randn(2, 3, 4, 4, 4), channels_last=True)
    assert backend.records[0].notes[0].startswith("channels-last: 1 convolution(s)")


def test_auto_rewrites_a_softmax_over_channels_or_over_other_values():
    torch.manual_seed(0)
    (note,), _ = _auto_notes(SpatialSoftmax(dim=1), torch.randn(2, 3, 4, 4, 4))
    assert note.startswith("channels-last: 1 convolution(s)"), note

    class ConvThenAttention(nn.Module):
        """A patch embedding, then a softmax over scores the convolution did not make."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Conv2d(3, 8, 2, stride=2)

        def forward(self, x):
            t = self.embed(x).flatten(2).transpose(1, 2)          # (b, tokens, 8)
            return torch.softmax(t @ t.transpose(1, 2), dim=-1) @ t

    torch._dynamo.reset()
    (note,), _ = _auto_notes(ConvThenAttention(), torch.randn(2, 3, 8, 8))
    assert note.startswith("channels-last: 1 convolution(s)"), note
