"""The ``_pv`` alternative (``launch_alternatives.cached_values``): a reduction kernel
that streams its row once a pass (a masked softmax, whose passes call exp) is proposed
again with persistent rows that keep computed values in registers; a layer norm, whose
template already keeps its loads, and a single pass get none. Its outputs are the
region's (kernel IR interpreter on CPU, the Verifier on the GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

from .region_inputs import region_inputs


class MaskedScores(nn.Module):
    """MiniGPT's attention probabilities, smaller: scaled scores, a causal mask, a
    softmax; then a layer norm of the values."""

    def __init__(self, t: int = 64, d: int = 32):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))
        self.norm = nn.LayerNorm(d)
        self.scale = 1.0 / d ** 0.5

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * self.scale
        t = att.size(-1)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return self.norm(torch.softmax(att, dim=-1) @ v)


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 64, 32, generator=g).to(device) for _ in range(3)]


def _regions():
    backend = StitchBackend(options={"codegen": False})
    torch.manual_seed(0)
    with torch.no_grad():
        torch.compile(MaskedScores(), backend=backend)(*_inputs())
    (rec,) = backend.records
    fused = [r for r in rec.plan.regions if r.kind == "fused"]
    softmax = next(r for r in fused if "_softmax" in r.nodes)
    norm = next(r for r in fused if "native_layer_norm" in r.nodes)
    return rec.gm, softmax, norm


def test_a_masked_softmax_gets_a_cached_values_alternative_with_the_regions_values():
    gm, softmax, norm = _regions()
    cand = TemplateCoder().propose(subtask_for(gm, softmax, "k"))
    assert "persist_row" not in cand.source
    (pv,) = [a for a in cand.alternatives if a.name.endswith("_pv")]
    assert pv.kernel.emitted.cached_values >= 2 and "persist_row" in pv.source
    inputs = region_inputs(gm, softmax)
    want = region_module(gm, softmax)(*inputs)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    got = runner_for(pv, base=InterpretedRunner)(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)

    # the layer norm's template keeps its loads already: no second persistent kernel
    norm_cand = TemplateCoder().propose(subtask_for(gm, norm, "k"))
    assert "persist_row" in norm_cand.source
    assert not [a for a in norm_cand.alternatives if a.name.endswith("_pv")]


@pytest.mark.gpu
def test_the_cached_values_alternative_verifies_on_the_gpu():
    """The Verifier on the GPU passes the ``_pv`` kernel of the masked softmax, and the
    compiled model gives eager's result."""
    torch.manual_seed(0)
    model = MaskedScores().cuda()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cache": False, "require_speedup": False})
    inputs = _inputs("cuda")
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(*inputs)
        torch.testing.assert_close(got, reference(*inputs), rtol=1e-4, atol=1e-4)
    verdicts = {a.candidate.name: a.verdict.ok for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_pv")}
    assert verdicts and all(verdicts.values()), verdicts
