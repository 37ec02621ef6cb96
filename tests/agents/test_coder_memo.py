"""The Coder generates once per region structure: what it hands out for a repeated
region is exactly what a fresh generation under that name gives (the warm start compares
source hashes, so any difference would cost a rebuild, or worse)."""

from __future__ import annotations

import torch
import torch.nn as nn

import stitch_backend.agents.coder as coder_mod
from stitch_backend.agents.coder import NoCandidate, TemplateCoder, structure_key
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.codegen.fused import generate
from tests.zoo import zoo


class Repeated(nn.Module):
    """Identical blocks (as in ResNet stages), plus a scalar constant per block."""

    def __init__(self, c=8, blocks=3):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(blocks))
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for _ in range(blocks))

    def forward(self, x):
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = torch.relu(bn(conv(x))) * (1.5 + i) + x
        return x.softmax(-1)


def _records(model, inputs, training=False):
    backend = StitchBackend(options={"codegen": False})
    compiled = torch.compile(model, backend=backend)
    if training:
        compiled(*inputs).sum().backward()
    else:
        with torch.no_grad():
            compiled(*inputs)
    return backend.records


def _proposals(coder, rec):
    out = {}
    for region in rec.plan.regions:
        try:
            out[region.id] = coder.propose(subtask_for(rec.gm, region, f"k_{region.name}"))
        except NoCandidate as err:
            out[region.id] = str(err)
    return out


def test_memoised_kernels_equal_fresh_generation(monkeypatch):
    models = [(Repeated().train(), [torch.randn(2, 8, 6, 6)], True),
              (Repeated().eval(), [torch.randn(2, 8, 6, 6)], False)]
    models += [(cls(), make(4), False) for cls, make in zoo().values()]
    calls = {"n": 0}
    real_generate = coder_mod.generate

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real_generate(*args, **kwargs)

    # a proposal may generate several times (stages, split alternatives): the memo's
    # hits are the generations a fresh Coder runs that the memoising one does not
    monkeypatch.setattr(coder_mod, "generate", counted)
    hits = 0
    for model, inputs, training in models:
        torch._dynamo.reset()
        for rec in _records(model, inputs, training):
            memo = TemplateCoder()
            calls["n"] = 0
            with_memo = _proposals(memo, rec)
            memo_calls = calls["n"]
            with monkeypatch.context() as m:
                m.setattr(coder_mod, "structure_key", lambda m: None)
                calls["n"] = 0
                fresh = _proposals(TemplateCoder(), rec)
            assert with_memo.keys() == fresh.keys()
            for rid, cand in with_memo.items():
                if isinstance(cand, str):
                    assert isinstance(fresh[rid], str)
                    continue
                assert cand.source == fresh[rid].source, rec.plan.regions[rid].name
                assert cand.name == fresh[rid].name
            assert memo_calls <= calls["n"]
            hits += calls["n"] - memo_calls
    assert hits > 0, "no region structure repeated: the memo was never exercised"


def test_constants_and_layouts_are_part_of_the_key():
    def module(fn, *args):
        from torch.fx.experimental.proxy_tensor import make_fx
        return make_fx(fn, tracing_mode="fake")(*args)

    x = torch.randn(4, 4)
    a = module(lambda t: t * 2.0, x)
    assert structure_key(a) == structure_key(module(lambda t: t * 2.0, torch.randn(4, 4)))
    assert structure_key(a) != structure_key(module(lambda t: t * 3.0, x))
    assert structure_key(a) != structure_key(module(lambda t: t * 2.0, torch.randn(4, 4).t()))
    assert structure_key(a) != structure_key(module(lambda t: t * 2.0, torch.randn(4, 5)))
    c1 = module(lambda t: t + torch.tensor([1.0, 2.0, 3.0, 4.0]), x)
    c2 = module(lambda t: t + torch.tensor([1.0, 2.0, 3.0, 5.0]), x)
    assert structure_key(c1) != structure_key(c2)


def test_renamed_kernel_is_a_fresh_generation_under_the_new_name():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda t: (t.exp() / t.exp().sum(-1, keepdim=True)), tracing_mode="fake")(
        torch.randn(8, 16))
    k = generate(gm, "first_name")
    r = k.renamed("second")
    fresh = generate(gm, "second")
    assert (r.source, r.entry, r.emitted.source, r.ir.name) == (
        fresh.source, fresh.entry, fresh.emitted.source, "second")
    assert "first_name" not in r.source
    x = torch.randn(8, 16)
    assert torch.equal(r.interpret([x])[0], fresh.interpret([x])[0])
