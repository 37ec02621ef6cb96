"""The single-pass statistics alternative (``launch_alternatives.single_pass_stats``,
``_sp``): a norm whose variance takes a second pass over long static rows is generated
again with the mean and the variance summed in one pass over shifted values; proposed
for long rows only, its values as close to fp64 as eager's (interpreted on CPU, the
Verifier on the GPU)."""

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

from .test_split_stats import FewRowsLayerNorm, _graph, _group_norm_region, _layer_norm_region


class WideGroupNorm(nn.Module):
    """A group norm over rows of 32768 (2 samples, 4 groups of 2 x 128 x 128)."""

    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(4, 8)

    def forward(self, x):
        return torch.relu(self.gn(x * 2.0))


def test_long_rows_get_a_single_pass_statistics_alternative():
    """Rows of 32768: the candidate again with the variance summed in the same pass as
    the mean (shifted by each row's first element), one reduction phase instead of two;
    it gives the region's outputs, also where the mean is far from the spread."""
    rec = _graph(WideGroupNorm().train(), torch.randn(2, 8, 128, 128))
    region = _group_norm_region(rec)
    alts = {a.name: a for a in TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives}
    assert "k_sp" in alts, list(alts)
    (kernel,) = alts["k_sp"].kernels
    assert {r.phase for r in kernel.ir.inner_reductions} == {0}
    module = region_module(rec.gm, region)
    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(2, 8, 128, 128, generator=gen),
              300.0 + 0.01 * torch.randn(2, 8, 128, 128, generator=gen)):
        inputs = [x if ph.meta["val"].dim() == 4 else torch.rand(ph.meta["val"].shape) + 0.5
                  for ph in module.graph.find_nodes(op="placeholder")]
        got = runner_for(alts["k_sp"], base=InterpretedRunner)(*inputs)
        want = module(*inputs)
        exact = module(*[t.double() for t in inputs])
        for g, w, e in zip(got, want, exact):
            err, eager_err = (g.double() - e).abs().max(), (w.double() - e).abs().max()
            assert err <= 2 * eager_err + 1e-6 * e.abs().max(), (err, eager_err)


def test_short_rows_and_softmax_get_no_single_pass_alternative():
    """Rows of 8192 (a layer norm that L1 still holds between passes), and a softmax over
    long rows (its max-then-sum is no variance): no ``_sp`` candidate."""
    rec = _graph(FewRowsLayerNorm().train(), torch.randn(2, 8, 32, 32))
    names = [a.name for a in TemplateCoder().propose(
        subtask_for(rec.gm, _layer_norm_region(rec), "k")).alternatives]
    assert not any(n.endswith("_sp") for n in names), names
    rec = _graph(nn.Softmax(dim=-1), torch.randn(4, 32768))
    region = next(r for r in rec.plan.regions if r.kind.value == "fused")
    names = [a.name for a in TemplateCoder().propose(subtask_for(rec.gm, region, "k")).alternatives]
    assert not any(n.endswith("_sp") for n in names), names


@pytest.mark.gpu
def test_single_pass_statistics_verify_on_the_gpu():
    """The ``_sp`` candidate of a group norm over rows of 32768 passes the Verifier on
    the GPU, and the compiled model's result is as close to fp64 as eager's (DESIGN.md's
    rule), also on inputs whose mean is far from their spread (there eager's own error
    is about 4e-3: the input's rounding at 600 against a spread of 0.02)."""
    torch.manual_seed(0)
    model = WideGroupNorm().cuda().train()
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    backend = StitchBackend(options={"cache": False, "require_speedup": False,
                                     "channels_last": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for x in (torch.randn(2, 8, 128, 128, device="cuda"),
                  300.0 + 0.01 * torch.randn(2, 8, 128, 128, device="cuda")):
            want = exact(x.double())
            err = (compiled(x).double() - want).abs().max().item()
            eager_err = (reference(x).double() - want).abs().max().item()
            assert err <= 2 * eager_err + 1e-6, (err, eager_err)
    verdicts = {a.candidate.name: a.verdict.ok for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_sp")}
    assert verdicts and all(verdicts.values()), verdicts
