"""Which graphs whole-Program CUDA graph replay may capture, and why not the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.cudagraphs import _identical, ineligible


def _why(fn, *inputs, **kw):
    gm = make_fx(fn)(*inputs)
    args = dict(device="cuda", dynamic=False, stage="inference", allow_training=False)
    args.update(kw)
    return ineligible(gm, inputs, **args)


def test_reasons_for_not_capturing():
    x = torch.randn(4, 8)
    assert _why(lambda x: x * 2, x, device="cpu") == "inputs are on cpu"
    assert "symbolic shapes" in _why(lambda x: x * 2, x, dynamic=True)
    assert "training graphs" in _why(lambda x: x * 2, x, stage="forward")
    assert "random op" in _why(lambda x: F.dropout(x, 0.5, True), x)
    assert "view of one" in _why(lambda x: (x.view(-1), x * 2), x)
    assert "input lives on cpu" in _why(lambda x: x * 2, x)  # structure fine, inputs not


def test_training_capture_only_when_asked():
    x = torch.randn(4, 8)
    assert "input lives on cpu" in _why(lambda x: x * 2, x, stage="forward",
                                        allow_training=True)


def test_identical_is_bitwise_and_nan_aware():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert _identical((a, [a]), (a.clone(), [a.clone()]))
    assert not _identical(a, a + 1e-6 * torch.tensor([0.0, 0.0, 1.0]))
    assert not _identical(a, a.double())
