"""The cuBLASLt alternative for a residual added to a product (``lt_ops.residual_chain``):
the residual becomes cuBLASLt's C (beta = 1), read by the product's epilogue instead of
by a kernel after it. Values checked on the CPU with a stand-in for the library call;
the call itself runs on the GPU in the test below and in tests/csrc/test_gemm_lt.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stitch_backend import lt_ops
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module
from tests.agents.test_lt_alternative import _gemm_candidates


class Residual(nn.Module):
    """``r + dropout(linear(x))`` (dropout of p = 0 in training mode, as MiniGPT's
    residual branches), then perhaps more pointwise work."""

    def __init__(self, bias=True, dropout=True, tail=False, relu_first=False):
        super().__init__()
        self.lin = nn.Linear(32, 48, bias=bias)
        self.drop = nn.Dropout(0.0) if dropout else nn.Identity()
        self.tail, self.relu_first = tail, relu_first

    def forward(self, xr):
        x, r = xr
        y = self.lin(x)
        y = torch.relu(y) if self.relu_first else y
        z = r + self.drop(y)
        return z * 2.0 + 1.0 if self.tail else z


def _stand_in(calls):
    def stand_in(a, b, bias, epilogue, c=None):
        calls.append((epilogue, c is not None))
        y = a @ b + (bias if bias is not None else 0)
        y = torch.relu(y) if epilogue.startswith("RELU") else y
        return y + c if c is not None else y
    return stand_in


@pytest.mark.parametrize("bias,dropout,tail,shape", [
    (True, True, False, (16, 32)),
    (True, True, True, (2, 8, 32)),
    (False, False, False, (2, 8, 32)),
    (True, False, True, (16, 32)),
], ids=["bias_dropout", "bias_3d_tail", "no_bias_3d", "no_dropout_tail"])
def test_residual_becomes_the_products_c(monkeypatch, bias, dropout, tail, shape):
    calls = []
    monkeypatch.setattr(lt_ops, "_matmul", _stand_in(calls))
    torch.manual_seed(0)
    model = Residual(bias, dropout, tail).train()
    x, r = torch.randn(shape), torch.randn(*shape[:-1], 48)
    ((rec, region, cand),) = _gemm_candidates(model, (x, r))
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_lt")]
    first = alt.source.splitlines()[0]
    assert "+ residual (C, beta 1)" in first, first
    assert ("epilogue BIAS" if bias else "epilogue DEFAULT") in first, first
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    assert calls == [("BIAS" if bias else "DEFAULT", True)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class NotResidual(nn.Module):
    """Adds that are not a residual cuBLASLt can take as C."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(32, 48), kind

    def forward(self, xr):
        x, r = xr
        y = self.lin(x)
        if self.kind == "broadcast":          # a row, not a full matrix
            return y + r[0]
        if self.kind == "computed":           # the other operand is computed in the region
            return y + torch.sin(y)
        if self.kind == "product_kept":       # the product is an output too
            return y + r, y
        return y + r.t().contiguous().t()     # "strided": not contiguous


@pytest.mark.parametrize("kind", ["broadcast", "computed", "product_kept", "strided"])
def test_no_residual_where_c_cannot_take_it(kind):
    x, r = torch.randn(16, 32), torch.randn(16, 48)
    for _, _, cand in _gemm_candidates(NotResidual(kind), (x, r)):
        for alt in cand.alternatives:
            assert "residual" not in alt.source.splitlines()[0], alt.source.splitlines()[0]


def test_an_activation_first_keeps_its_own_epilogue(monkeypatch):
    """``r + relu(linear(x))``: C is added before cuBLASLt's activation, so the residual
    stays in the epilogue kernel after RELU_BIAS."""
    x, r = torch.randn(16, 32), torch.randn(16, 48)
    ((_, _, cand),) = _gemm_candidates(Residual(relu_first=True).train(), (x, r))
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_lt")]
    first = alt.source.splitlines()[0]
    assert "RELU_BIAS" in first and "residual" not in first, first


@pytest.mark.gpu
def test_residual_c_on_the_gpu_gives_eager_values():
    """cuBLASLt with C on the GPU: the compiled model gives eager's values, and the
    residual candidate is verified correct (whichever is faster)."""
    from tests.agents.test_lt_alternative import _raced_on_cuda

    torch.manual_seed(0)
    model = Residual(tail=False).cuda().train()
    x, r = torch.randn(4, 64, 32, device="cuda"), torch.randn(4, 64, 48, device="cuda")
    verified = _raced_on_cuda(model, (x, r))     # each library candidate correct
    assert any("+ residual (C, beta 1)" in a.candidate.source.splitlines()[0]
               for a in verified), [a.candidate.name for a in verified]
