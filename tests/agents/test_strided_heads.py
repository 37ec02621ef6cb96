"""Attention's products read where the packed projection keeps q, k and v: the copies
that make them contiguous move into their bmm's region (agents.prologue_moves); its
template generates them as a prologue kernel before ATen's bmm, and the Coder offers one
cuBLASLt call per head that reads the views in place and writes the result in its final
layout (stitch_backend.lt_heads), which the Verifier races. On the CPU, the library by a
stand-in."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from stitch_backend import lt_heads
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

from .test_pool_epilogue import _compiled, _node_ops

BMM, CLONE = "aten.bmm.default", "aten.clone.default"
VIEWS = ("aten.view.default", "aten.expand.default", "aten._unsafe_view.default")


class CausalAttention(nn.Module):
    """minGPT's causal self-attention: one packed projection split into q, k and v, each
    viewed as (B, heads, T, head size), a masked softmax (then a dropout of p = 0, which
    traces to a copy in training mode), the heads merged back."""

    def __init__(self, d=32, heads=4, t=16):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.0)
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = self.drop(torch.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")),
                                      dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


def _bmm_regions(rec):
    return [r for r in rec.plan.regions if BMM in _node_ops(rec, r)]


def _reference_product(a, b, out):
    out.copy_(torch.bmm(a, b))


def test_the_copies_join_their_products_and_the_softmax_keeps_its_own():
    torch.manual_seed(0)
    model, x = CausalAttention(), torch.randn(2, 16, 32)
    with torch.no_grad():
        want = model(x)
    rec, out = _compiled(model, x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    scores, mixed = _bmm_regions(rec)
    assert [r.kind.value for r in (scores, mixed)] == ["gemm", "gemm"]
    assert _node_ops(rec, scores).count(CLONE) == 2      # q and k, copied before q @ k^T
    # v's copy before att @ v, and the merge of the heads after it
    assert _node_ops(rec, mixed).count(CLONE) == 2
    for r in rec.plan.regions:
        ops = [o for o in _node_ops(rec, r) if o not in VIEWS]
        assert ops != [CLONE] * len(ops) or not ops, f"a region of copies alone is left: {ops}"
    # the softmax's own copy (a dropout of p = 0) is no layout change: it stays fused
    (soft,) = [r for r in rec.plan.regions if "aten._softmax.default" in _node_ops(rec, r)]
    assert CLONE in _node_ops(rec, soft) and soft.kind.value == "fused"
    for r in (scores, mixed):     # the template: the copies as a prologue kernel
        assert r.backend == "kernel", r.reason


@pytest.mark.parametrize("which", [0, 1], ids=["q_at_kT", "att_at_v"])
def test_the_coder_offers_per_head_library_calls_that_give_the_regions_values(monkeypatch, which):
    monkeypatch.setattr(lt_heads, "_product", _reference_product)
    torch.manual_seed(0)
    rec, _ = _compiled(CausalAttention(), torch.randn(2, 16, 32))
    region = _bmm_regions(rec)[which]
    cand = TemplateCoder(library_on_cpu=True).propose(subtask_for(rec.gm, region, "k"))
    assert cand.stages[0].kernel is not None and cand.stages[0].kernel.entry == "k_in"
    alts = {a.name: a for a in cand.alternatives}
    assert "k_lt" in alts and alts["k_lt"].library, list(alts)
    (stage,) = alts["k_lt"].stages
    targets = [n.target for n in stage.module.graph.nodes if n.op == "call_function"]
    assert targets == [lt_heads.lt_bmm_heads], targets      # no copy, no bmm left
    module = region_module(rec.gm, region)
    gen = torch.Generator().manual_seed(1)
    inputs = [_like(ph.meta["val"], gen) for ph in module.graph.find_nodes(op="placeholder")]
    want = module(*inputs)
    for c in (cand, alts["k_lt"]):
        got = runner_for(c, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.stride() == w.stride()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _like(val: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values with ``val``'s shape and strides (a view into a larger buffer where
    its strides leave gaps, as q is a view of the packed projection)."""
    span = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
    return torch.randn(span, generator=gen).as_strided(tuple(val.shape), val.stride())


def test_a_bmm_of_contiguous_operands_keeps_its_plain_plan():
    """No copy before the product: the region is the bmm alone, as before, and the Coder
    leaves it to the library call."""
    from stitch_backend.agents.coder import NoCandidate

    class Plain(nn.Module):
        def forward(self, a, b):
            return torch.relu(a) @ b

    rec = _plain_record(Plain(), torch.randn(4, 8, 16), torch.randn(4, 16, 8))
    (region,) = _bmm_regions(rec)
    assert [o for o in _node_ops(rec, region) if o not in VIEWS] == [BMM]
    with pytest.raises(NoCandidate, match="followed only by views|no epilogue"):
        TemplateCoder(library_on_cpu=True).propose(subtask_for(rec.gm, region, "k"))


def _plain_record(model, *inputs):
    from stitch_backend.backend import StitchBackend

    backend = StitchBackend(options={"cpu_interpret": True, "cache": False, "layout_race": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    (rec,) = backend.records
    return rec


@pytest.mark.parametrize("copied", [True, False], ids=["copied", "not_copied"])
def test_the_pattern_follows_a_permute_only_through_a_copy(monkeypatch, copied):
    """heads_pattern follows the output through view, permute, clone, view: the heads
    merged back (B, T, heads * N) is a pattern, with the permutation; the permuted value
    returned without its copy (not contiguous, not the layout lt_bmm_heads writes) is
    not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten
    contiguous = {"memory_format": torch.contiguous_format}

    def f(a, b):
        y = aten.bmm.default(aten.view.default(aten.clone.default(a, **contiguous), [8, 5, 6]),
                             aten.view.default(aten.clone.default(b, **contiguous), [8, 6, 7]))
        y = aten.permute.default(aten.view.default(y, [2, 4, 5, 7]), [0, 2, 1, 3])
        if copied:
            y = aten.view.default(aten.clone.default(y, **contiguous), [2, 5, 28])
        return (y,)

    a = torch.randn(2, 5, 4, 6).transpose(1, 2)
    b = torch.randn(2, 6, 4, 7).transpose(1, 2)
    gm = make_fx(f, tracing_mode="fake")(a, b)
    nodes = list(gm.graph.nodes)
    bmm = next(n for n in nodes if n.target is aten.bmm.default)
    members = {n for n in nodes if n.op == "call_function"}
    inputs = {n.name for n in nodes if n.op == "placeholder"}
    (out,) = [n.name for n in gm.graph.output_node().args[0]]
    pat = lt_heads.heads_pattern(bmm, members, inputs, [out])
    if not copied:
        assert pat is None
        return
    assert pat is not None and pat.perm == (0, 2, 1, 3) and pat.shape == (2, 5, 28)
    # the call, each head's product by a stand-in: slices land where the merge puts them
    monkeypatch.setattr(lt_heads, "_product", _reference_product)
    got = lt_heads.lt_bmm_heads(a, b, list(pat.perm), list(pat.shape))
    (want,) = f(a, b)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.nvcc
def test_the_prologue_kernels_compile_for_sm90a():
    from stitch_backend import toolchain

    torch.manual_seed(0)
    rec, _ = _compiled(CausalAttention(), torch.randn(2, 16, 32))
    sources = []
    for i, region in enumerate(_bmm_regions(rec)):
        cand = TemplateCoder().propose(subtask_for(rec.gm, region, f"k{i}"))
        sources.append(cand.source)
    res = toolchain.compile_cubin("\n".join(sources), "heads_prologue_unit", "sm_90a")
    for entry in ("k0_in", "k1_in"):
        assert entry.encode() in res.cubin


@pytest.mark.gpu
def test_on_the_gpu_per_head_calls_give_atens_products_and_the_model_eagers_values():
    from stitch_backend.backend import StitchBackend

    torch.manual_seed(0)
    qkv = torch.randn(4, 64, 3 * 96, device="cuda")
    q, k, v = (z.view(4, 64, 3, 32).transpose(1, 2) for z in qkv.split(96, dim=2))
    s = lt_heads.lt_bmm_heads(q, k.transpose(-2, -1), [0, 1, 2, 3], [12, 64, 64])
    torch.testing.assert_close(s, torch.matmul(q, k.transpose(-2, -1)).reshape(12, 64, 64),
                               rtol=1e-4, atol=1e-4)
    att = torch.softmax(s.view(4, 3, 64, 64), dim=-1)
    y = lt_heads.lt_bmm_heads(att, v, [0, 2, 1, 3], [4 * 64, 96])
    torch.testing.assert_close(y, torch.matmul(att, v).transpose(1, 2).reshape(4 * 64, 96),
                               rtol=1e-4, atol=1e-4)

    model, x = CausalAttention(96, 3, 64).cuda(), torch.randn(4, 64, 96, device="cuda")
    with torch.no_grad():
        want = model(x)
        backend = StitchBackend(options={"cache": False})
        got = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for rec in backend.records:
        for region in _bmm_regions(rec):
            # the prologue kernel or the per-head calls, by the Verifier's timing
            assert region.backend == "kernel" or region.reason, region


def test_a_copy_of_what_its_region_computes_stays_there():
    """y = relu(x) permuted and copied before a bmm: moved, the copy would read y from
    memory, which its fused region now computes in the kernel that writes the copy."""

    class Computed(nn.Module):
        def forward(self, x, w):
            y = torch.relu(x).transpose(1, 2).contiguous()
            return y @ w

    rec = _plain_record(Computed(), torch.randn(4, 16, 8), torch.randn(4, 16, 5))
    (region,) = _bmm_regions(rec)
    assert CLONE not in _node_ops(rec, region)
    (copier,) = [r for r in rec.plan.regions if CLONE in _node_ops(rec, r)]
    assert "aten.relu.default" in _node_ops(rec, copier)


def test_a_per_head_winner_is_cached_and_warm_starts(monkeypatch, tmp_path):
    """The whole pipeline on CPU (cpu_interpret), each head's product by a stand-in; CPU
    runs are not timed, so the race is scripted (the last verified candidate wins): the
    per-head calls win both bmm regions, the model gives eager's values, and a second
    compile loads the same choices from the cache."""
    import copy

    from stitch_backend.agents import acceptance

    from .test_lt_alternative import compile_twice

    monkeypatch.setattr(acceptance, "_faster", lambda a, b: True)
    monkeypatch.setattr(TemplateCoder, "library_on_cpu", True)
    monkeypatch.setattr(lt_heads, "_product", _reference_product)
    torch.manual_seed(0)
    model = CausalAttention()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 32)
    first, second = compile_twice(model, reference, x, {
        "cpu_interpret": True, "cache_dir": str(tmp_path), "eager_guard": False,
        "layout_race": False})
    winners = [r.kernel for r in _bmm_regions(first)]
    assert all(w is not None and w.endswith("_lt") for w in winners), winners
    assert not first.cached and second.cached, second.notes
    assert [r.kernel for r in second.plan.regions] == [r.kernel for r in first.plan.regions]


def test_a_training_step_through_the_moved_copies_gives_eager_gradients():
    """Forward and backward graphs both hold bmms of copied views (the backward's
    products of gradients with q, k, v): planned with the move, interpreted on the CPU,
    the gradients are eager's."""
    from .test_split_epilogue import training_step_matches

    backend = training_step_matches(CausalAttention, torch.randn(2, 16, 32))
    moved = [r for rec in backend.records for r in _bmm_regions(rec)
             if CLONE in _node_ops(rec, r)]
    # a kernel, or ATen with the reason (at these sizes the memory rule can keep a
    # forward region whose copy is saved for the backward on ATen)
    assert moved and all(r.backend == "kernel" or r.reason for r in moved)
    assert any(r.backend == "kernel" for r in moved), [(r.id, r.backend, r.reason) for r in moved]
