"""The folded-BatchNorm alternative of a conv region (``stitch_backend.bn_fold``,
``agents.conv_fold``): where it is proposed, that it computes the region on the CPU (ATen's
convolution in place of cuDNN's fused call) from the live parameters, and on the GPU that
cuDNN's fused calls give eager's values and the backend runs such a model correctly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitch_backend import bn_fold
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.conv_bias import split_conv_bias
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module
from tests.agents.test_depthwise_alternative import _conv_candidate


class Block(nn.Module):
    """conv -> BatchNorm [-> + x] -> ReLU [-> max pool]."""

    def __init__(self, bias=False, residual=False, pool=False, affine=True, cout=8):
        super().__init__()
        self.conv = nn.Conv2d(8, cout, 3, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(cout, affine=affine)
        self.residual, self.pool = residual, pool

    def forward(self, x):
        y = self.bn(self.conv(x))
        y = torch.relu(y + x if self.residual else y)
        return F.max_pool2d(y, 2) if self.pool else y


def _record(model, x):
    """The conv region of ``model``'s graph (its template candidate, on the CPU, has no
    folded alternative: ``library_on_cpu`` is off by default)."""
    rec, region, cand = _conv_candidate(model, x)
    assert not any(a.name.endswith("_bnf") for a in cand.alternatives)
    return rec, region


def _alternatives(rec, region, library_on_cpu=True):
    cand = TemplateCoder(library_on_cpu=library_on_cpu).propose(subtask_for(rec.gm, region, "k"))
    return [a for a in cand.alternatives if a.name.endswith("_bnf")]


def _inputs(rec, region, seed=1):
    """Random values for the region's inputs; 1-D ones (BatchNorm's parameters and
    statistics, the bias) positive, so that a running variance is one."""
    vals = {n.name: n.meta["val"] for n in rec.gm.graph.nodes if n.op == "placeholder"}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in region.inputs:
        t = torch.randn(vals[n].shape, generator=gen)
        out.append(t.abs() + 0.1 if t.dim() == 1 else t)
    return out


@pytest.mark.parametrize("bias,residual,pool,affine", [
    (False, False, False, True), (True, False, False, True), (False, True, False, True),
    (True, True, False, False), (False, False, True, True)],
    ids=["plain", "bias", "residual", "bias_residual_no_affine", "pool_after"])
def test_the_folded_alternative_computes_the_region(bias, residual, pool, affine):
    torch.manual_seed(0)
    rec, region = _record(Block(bias, residual, pool, affine).eval(), torch.randn(2, 8, 10, 10))
    (alt,) = _alternatives(rec, region)
    head = alt.stages[0]
    targets = [n.target for n in head.module.graph.nodes if n.op == "call_function"]
    assert bn_fold.conv_relu in targets and bn_fold.fold_bn in targets
    assert not any("batch_norm" in str(t) or "convolution" in str(t) for t in targets)
    assert ("add_relu" in alt.source) == residual
    # a pooling after the ReLU is the rest of the epilogue: its own kernel stage
    assert len(alt.stages) == (2 if pool else 1) and alt.library == (not pool)
    _assert_computes(alt, rec, region, _inputs(rec, region))


def _assert_computes(alt, rec, region, inputs):
    want = region_module(rec.gm, region)(*inputs)
    for g, w in zip(runner_for(alt, base=InterpretedRunner)(*inputs), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_the_fold_follows_the_live_statistics():
    """The folded weight is computed in the call from the region's inputs: new running
    statistics (a checkpoint loaded, fine-tuning) give new values, as eager does."""
    rec, region = _record(Block().eval(), torch.randn(2, 8, 10, 10))
    (alt,) = _alternatives(rec, region)
    first = _inputs(rec, region, 1)
    second = [t * 3 if t.dim() == 1 else t for t in first]
    for inputs in (first, second):
        _assert_computes(alt, rec, region, inputs)
    run = runner_for(alt, base=InterpretedRunner)
    assert not torch.allclose(run(*first)[0], run(*second)[0])


def test_the_chain_takes_the_split_bias_of_a_cuda_graph():
    """On CUDA the bias of a cuDNN convolution is split into an add after it
    (``conv_bias``); the chain takes that add and the bias's view, and folds the bias."""
    rec, region = _record(Block(bias=True).eval(), torch.randn(2, 8, 10, 10))
    gm, moved = split_conv_bias(rec.gm, device="cpu")
    assert moved == 1
    conv = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default)
    chain = bn_fold.fold_chain(conv, {n.name for n in gm.graph.nodes})
    assert chain is not None and chain.bias is not None and chain.bias_add is not None
    assert chain.nodes[1].target is torch.ops.aten.view.default
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = _inputs(rec, region)
    want = gm(*[inputs[region.inputs.index(n)] for n in names])
    folded = torch.fx.GraphModule(gm, gm.graph)
    bn_fold.rewrite(folded.graph, chain)
    folded.recompile()
    got = folded(*[inputs[region.inputs.index(n)] for n in names])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


class Unfoldable(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.what = what
        self.conv = (nn.ConvTranspose2d(8, 8, 3, padding=1) if what == "transposed"
                     else nn.Conv2d(8, 8, 3, padding=1))
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if self.what == "no_relu":
            return y
        if self.what == "norm_used_twice":
            return torch.relu(y), y * 2
        return torch.relu(y)


@pytest.mark.parametrize("what", ["no_relu", "norm_used_twice", "transposed", "training"])
def test_no_fold_where_it_does_not_apply(what):
    """Nothing for cuDNN to apply after the fold (no ReLU), a BatchNorm's output used
    elsewhere too, a transposed convolution (its weight's channels are its second
    dimension), a training graph (batch statistics)."""
    model = Unfoldable(what)
    model.train(what == "training")
    rec, region = _record(model, torch.randn(2, 8, 10, 10))
    assert _alternatives(rec, region) == []


def test_no_fold_for_cpu_values_unless_asked():
    rec, region = _record(Block().eval(), torch.randn(2, 8, 10, 10))
    assert _alternatives(rec, region, library_on_cpu=False) == []
    assert len(_alternatives(rec, region)) == 1


def test_fold_bn_is_the_batchnorm_in_fp32_rounded_to_the_weights_type():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(6, 4, 3, 3, generator=gen), torch.randn(6, generator=gen)
    gamma, beta, mean = (torch.randn(6, generator=gen) for _ in range(3))
    var = torch.rand(6, generator=gen) + 0.5
    x = torch.randn(2, 4, 7, 7, generator=gen)
    want = F.batch_norm(F.conv2d(x, w, b), mean, var, gamma, beta, False, 0.1, 1e-3)
    w2, b2 = bn_fold.fold_bn(w, b, gamma, beta, mean, var, 1e-3)
    torch.testing.assert_close(F.conv2d(x, w2, b2), want, rtol=1e-5, atol=1e-5)
    w2, b2 = bn_fold.fold_bn(w, None, None, None, mean, var, 1e-3)   # affine=False, no bias
    want = F.batch_norm(F.conv2d(x, w), mean, var, None, None, False, 0.1, 1e-3)
    torch.testing.assert_close(F.conv2d(x, w2, b2), want, rtol=1e-5, atol=1e-5)
    w2, b2 = bn_fold.fold_bn(w.half(), None, gamma, beta, mean, var, 1e-3)
    assert w2.dtype == b2.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["relu", "add_relu"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_cudnns_fused_calls_give_the_convolution_and_relu(residual, layout):
    """``conv_relu`` on CUDA (cuDNN's fused calls) against ATen's ops, TF32 off; the
    output in the convolution's own layout."""
    torch.backends.cudnn.allow_tf32 = False
    try:
        gen = torch.Generator(device="cuda").manual_seed(5)
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(4, 16, 28, 28, device="cuda", generator=gen).contiguous(memory_format=fmt)
        w = torch.randn(32 if not residual else 16, 16, 3, 3, device="cuda",
                        generator=gen).contiguous(memory_format=fmt)
        b = torch.randn(w.shape[0], device="cuda", generator=gen)
        z = torch.randn_like(x) if residual else None
        got = bn_fold.conv_relu(x, w, b, z, [1, 1], [1, 1], [1, 1], 1)
        y = F.conv2d(x, w, b, padding=1)
        want = torch.relu(y + z if residual else y)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == y.stride()
    finally:
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.gpu
def test_an_eval_resnet_block_runs_correctly_on_the_gpu():
    """The backend on a ResNet-like eval block (conv-BN-ReLU, conv-BN + shortcut, ReLU):
    eager's values, and the folded alternative raced in both conv regions."""
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(cout=8), Block(residual=True)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = Res().cuda().eval()
    for bn in (model.a.bn, model.b.bn):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(8, 8, 56, 56, device="cuda")
    backend = StitchBackend(options={"cache": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        want = model(x)
        for _ in range(3):
            got = compiled(x)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    verified = [a.verdict for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_bnf")]
    # correct in both regions; kept or not by its time (a race it loses, or a library
    # call short of the margin a call must win by, is still a correct verdict)
    assert len(verified) >= 2 and all(v.ok or v.correct for v in verified), verified


def test_a_folded_winner_is_cached_and_warm_starts(monkeypatch, tmp_path):
    """The whole pipeline on the CPU (cpu_interpret; the race scripted, CPU runs are not
    timed: the last verified candidate wins): the folded candidate wins its region, the
    model's values are eager's, and a second compile finds it in the cache."""
    import copy

    from stitch_backend.agents import acceptance
    from tests.agents.test_lt_alternative import compile_twice

    monkeypatch.setattr(acceptance, "_faster", lambda a, b: True)
    monkeypatch.setattr(TemplateCoder, "library_on_cpu", True)
    torch.manual_seed(0)
    model = Block(bias=True, residual=True).eval()
    model.bn.running_var.uniform_(0.5, 2)
    reference = copy.deepcopy(model)
    first, second = compile_twice(model, reference, torch.randn(2, 8, 10, 10), {
        "cpu_interpret": True, "cache_dir": str(tmp_path), "eager_guard": False})
    (conv,) = [r for r in first.plan.regions if r.kind.value == "conv"]
    assert conv.backend == "kernel" and conv.kernel.endswith("_bnf"), first.plan.regions
    assert not first.cached and second.cached, second.notes
    assert [r.kernel for r in second.plan.regions] == [r.kernel for r in first.plan.regions]
