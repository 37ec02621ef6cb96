"""The channels-last ceiling tool: a clear refusal without CUDA; on the GPU, one row per
problem with both times (measured, not asserted)."""

import pytest
import torch

from stitch_backend.bench import layout
from stitch_backend.examples import list_examples

EXAMPLES = {p.stem: p for p in list_examples()}


def test_without_cuda_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert layout.main([str(EXAMPLES["conv_bn_relu"])]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_rows_on_the_gpu(capsys):
    assert layout.main([str(EXAMPLES["conv_bn_relu"]), str(EXAMPLES["residual_block"])]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 2
    for name, nchw, nhwc, ratio in rows:
        assert float(nchw) > 0 and float(nhwc) > 0 and ratio.strip().endswith("x")
