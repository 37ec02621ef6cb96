"""Loads a where does not read (``codegen.guards``): a causal mask's scores above the
diagonal are not loaded. The emitted chunk decides first whether any lane takes the
branch that reads them; a load read elsewhere too, or an option that turns this off,
keeps the plain load; the Coder offers the plain loads as an alternative the Verifier
races (``launch_alternatives.loads_kept``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from stitch_backend import toolchain
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.codegen import generate
from stitch_backend.codegen.guards import guarded_loads
from stitch_backend.codegen.kernel_ir import Load
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

from .cases import BIG, CASES

BY_NAME = {c.name: c for c in CASES + BIG}


def _kernel(name: str, entry: str | None = None, **how):
    return generate(BY_NAME[name].trace(), entry or name, **how)


@pytest.mark.parametrize("name", ["norm_softmax_causal", "norm_softmax_causal_f16",
                                  "pw_masked_fill_causal", "big_softmax_causal"])
def test_the_scores_a_causal_mask_hides_are_loaded_only_where_a_lane_reads_them(name):
    k = _kernel(name)
    assert k.emitted.skipped_loads == 1, k.source
    # the scores (in0) wait for the mask's decision; the mask (in1) is always loaded
    assert "sfk_ldv_unless<4>(skip_vin0_" in k.source and "sfk_ldv<4>(in0" not in k.source
    assert "sfk_ldv<4>(in1" in k.source and "sfk_ldv_unless<4>(skip_vin1" not in k.source
    # every pass over the row (softmax: maximum, sum, store) skips them
    passes = 1 if k.emitted.kind == "pointwise" else 3
    assert k.source.count("sfk_ldv_unless<") == passes


def test_the_guard_is_the_wheres_condition_and_names_the_branch_that_reads():
    k = _kernel("norm_softmax_causal")
    (vload,) = [ld for ld in guarded_loads(k.ir, {ld: "x" for ld in k.ir.all_exprs()
                                                   if isinstance(ld, Load)})]
    assert vload.buf == "in0"
    (guard,) = guarded_loads(k.ir, {vload: "x"}).values()
    assert guard.skip_when is True and guard.cond.name == "eq"


@pytest.mark.parametrize("name", ["norm_softmax_causal_read_twice", "big_softmax", "pw_where_cmp",
                                  "norm_layer_norm"])
def test_loads_read_outside_the_wheres_branch_are_not_skipped(name):
    """The scores added to the softmax again, a where whose condition reads both sides,
    and kernels with no where: every load stays plain."""
    k = _kernel(name)
    assert k.emitted.skipped_loads == 0 and "sfk_ldv_unless" not in k.source


def test_skip_loads_false_keeps_every_load():
    k = _kernel("norm_softmax_causal", skip_loads=False)
    assert k.emitted.skipped_loads == 0 and "sfk_ldv_unless" not in k.source
    assert k.source.count("sfk_ldv<4>(in0") == 3


@pytest.mark.nvcc
def test_both_variants_compile_for_sm90a():
    kernels = [_kernel(n, f"{n}_{'skip' if s else 'all'}", skip_loads=s) for n in (
        "norm_softmax_causal", "norm_softmax_causal_f16", "pw_masked_fill_causal")
        for s in (True, False)]
    res = toolchain.compile_cubin("\n".join(k.source for k in kernels), "skipped_loads_unit",
                                  "sm_90a")
    for k in kernels:
        assert k.entry.encode() in res.cubin


class CausalScores(nn.Module):
    """Masked attention probabilities over a causal mask held as a buffer (minGPT's)."""

    def __init__(self, t: int = 32):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, q, k):
        att = (q @ k.transpose(-2, -1)) * 0.25
        att = att.masked_fill(self.bias == 0, float("-inf"))
        return torch.softmax(att, dim=-1)


def _softmax_region(rec):
    return next(r for r in rec.plan.regions if r.kind.value == "fused"
                and any("softmax" in op for op in r.ops))


def test_the_coder_offers_the_kernel_that_loads_everything_as_an_alternative():
    q, k = torch.randn(2, 4, 32, 16), torch.randn(2, 4, 32, 16)
    backend_rec = _record(CausalScores(), q, k)
    region = _softmax_region(backend_rec)
    cand = TemplateCoder().propose(subtask_for(backend_rec.gm, region, "k"))
    assert any(kk.emitted.skipped_loads for kk in cand.kernels), cand.source
    alts = {a.name: a for a in cand.alternatives}
    assert "k_ld" in alts, list(alts)
    assert all(kk.emitted.skipped_loads == 0 for kk in alts["k_ld"].kernels)
    module = region_module(backend_rec.gm, region)
    # the scores, and the mask buffer (1, 1, 32, 32) as the model holds it
    inputs = [torch.ones(ph.meta["val"].shape).tril() if ph.meta["val"].shape[:2] == (1, 1)
              else torch.randn(ph.meta["val"].shape)
              for ph in module.graph.find_nodes(op="placeholder")]
    want = module(*inputs)
    for c in (cand, alts["k_ld"]):
        got = runner_for(c, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want if isinstance(want, (tuple, list)) else [want]):
            torch.testing.assert_close(g, w, equal_nan=True)


def _record(model, *inputs):
    from stitch_backend.backend import StitchBackend

    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    (rec,) = backend.records
    return rec


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["big_softmax_causal", "pw_masked_fill_causal"])
def test_skipped_loads_give_eagers_values_and_the_plain_kernels_bits_on_gpu(name):
    """NaN written where the mask hides the scores: no lane reads them, so the output is
    eager's (no NaN), bit for bit the kernel that loads everything."""
    from stitch_backend.cuda_driver import CudaModule

    from .test_gpu import _launch

    case = BY_NAME[name]
    gm = case.trace(device="cuda")
    scores, mask = case.make_inputs(3, device="cuda")
    scores = scores.masked_fill(mask == 0, float("nan"))
    arch = toolchain.device_arch()
    got = []
    for skip in (True, False):
        k = generate(gm, f"{name}_{'skip' if skip else 'all'}", skip_loads=skip)
        assert bool(k.emitted.skipped_loads) == skip
        fn = CudaModule(toolchain.compile_cubin(k.source, k.entry, arch).cubin).function(
            k.entry, k.signature)
        (out,) = _launch(k, fn, [scores, mask])
        got.append(out)
    want = gm(scores, mask)
    want = want[0] if isinstance(want, (tuple, list)) else want
    assert not want.isnan().any()
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], got[1], atol=0, rtol=0)
