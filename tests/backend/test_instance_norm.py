"""Instance norm after a convolution under the layout pass: ``auto`` declines such
graphs; a forced rewrite computes the norm over the value's own dims
(``stitch_backend.instance_norm``), so no conversion precedes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stitch_backend import layout_auto
from tests.backend.test_layout import _auto_notes, _check

aten = torch.ops.aten


def test_auto_keeps_instance_norm_after_a_convolution_as_traced():
    """Instance norm runs BatchNorm over a (1, N*C, H, W) view, which needs the traced
    layout: ``auto`` declines with that reason (not the position rule's)."""
    make = lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8), nn.ReLU())  # noqa: E731
    x = torch.randn(2, 3, 100, 100)   # 19208 positions: the position rule would rewrite
    torch.manual_seed(0)
    (note,), _ = _auto_notes(make().train(), x)
    assert note.startswith("channels-last off: auto: ") and "instance norm" in note, note


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dims", [2, 3])
def test_forced_rewrite_computes_instance_norm_over_its_own_dims(affine, dims):
    """A forced rewrite replaces the view + BatchNorm by statistics over the trailing
    dims, which channels-last strides express: no conversion before the norm (only the
    input's and the output's), eager's values and strides."""
    conv, norm = (nn.Conv2d, nn.InstanceNorm2d) if dims == 2 else (nn.Conv3d, nn.InstanceNorm3d)
    make = lambda: nn.Sequential(conv(3, 8, 3), norm(8, affine=affine), nn.ReLU())  # noqa: E731
    x = torch.randn(2, 3, *([10] * dims))
    backend = _check(make, x, channels_last=True)
    rec = backend.records[0]
    assert rec.notes[0] == ("channels-last: 1 convolution(s) run NHWC, 2 layout conversion(s) "
                            "in the graph, 1 convolution weight(s) converted, 1 instance "
                            "norm(s) computed over their own dims "
                            "(no view of N*C channels)"), rec.notes[0]
    targets = [n.target for n in rec.gm.graph.nodes]
    assert not any(t in layout_auto._BN_TRAIN for t in targets)
    (stats,) = [n for n in rec.gm.graph.nodes if n.target is aten.var_mean.correction]
    assert stats.args[1] == list(range(2, 2 + dims))
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    assert stats.args[0].meta["val"].is_contiguous(memory_format=fmt)
    assert (aten.repeat.default in targets) is False
