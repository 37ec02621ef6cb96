"""Channels-last TF32 convolutions judged at the graph's outputs (graph_precision.py):
where a convolution fails the check alone but the graph's outputs keep the correctness
rule, every convolution runs channels-last with TF32; where they do not, the
per-convolution verdicts stand; verdicts are kept in the cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend import graph_precision, layout, traced_check
from stitch_backend.backend import StitchBackend
from stitch_backend.cache import Store

aten = torch.ops.aten


def _traced(fn, *inputs):
    return make_fx(fn, decomposition_table=core_aten_decompositions(),
                   tracing_mode="fake")(*inputs)


def _pooled(x, w):
    return F.gelu(F.conv2d(x, w, padding=1)).mean((2, 3))


def test_outputs_hold_where_the_rewrite_computes_the_same_and_not_where_it_drifts():
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    traced = _traced(_pooled, x, w)
    same = _traced(lambda a, b: _pooled(a.contiguous(memory_format=torch.channels_last), b),
                   x, w)
    drifted = _traced(lambda a, b: _pooled(a, b) * (1 + 1e-3), x, w)
    held = graph_precision.outputs_hold(traced, same)
    assert held.ok and held.final, held.why
    failed = graph_precision.outputs_hold(traced, drifted)
    assert not failed.ok and failed.final and "beyond 0.0001 of eager" in failed.why


def test_graph_verdicts_are_kept_in_the_cache(monkeypatch, tmp_path):
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    traced = _traced(_pooled, x, w)
    drifted = _traced(lambda a, b: _pooled(a, b) * (1 + 1e-3), x, w)
    runs = []
    real = graph_precision._judge

    def counted(a, b):
        runs.append(1)
        return real(a, b)

    monkeypatch.setattr(graph_precision, "_judge", counted)
    store = Store(tmp_path)
    first = graph_precision.outputs_hold(traced, drifted, store)
    again = graph_precision.outputs_hold(traced, drifted, Store(tmp_path))
    assert len(runs) == 1 and (first.ok, first.why) == (again.ok, again.why) and not again.ok
    assert list((tmp_path / "notes" / graph_precision.NOTE_KIND).iterdir())


class ConvGeluPool(nn.Module):
    """KernelBench L2 67's shape, smaller: a convolution, GELU, a global average pool."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return F.adaptive_avg_pool2d(F.gelu(self.conv(x)), 1).flatten(1)


def _conv_fails_alone(monkeypatch):
    """Every convolution fails the layout pass's check alone: on the CPU, noise on its
    channels-last result stands in for cuDNN's TF32 kernel (even with TF32 off)."""
    real = layout.conv_outputs

    def noisy(node, exact=False):
        traced, nhwc, fp64 = real(node, exact)
        return traced, nhwc + 1e-3 * torch.randn_like(nhwc), fp64

    monkeypatch.setattr(layout, "conv_outputs", noisy)
    monkeypatch.setattr(layout, "tf32_may_apply", lambda node: True)


def test_a_convolution_less_accurate_alone_keeps_tf32_where_the_outputs_hold(monkeypatch):
    """cuDNN's TF32 NHWC kernel fails the check alone (simulated on the CPU: noise on
    the channels-last result, even with TF32 off), the pooled output holds the rule:
    the convolution runs channels-last as plain ``aten.convolution`` (TF32 allowed),
    and the compiled model keeps eager's values and strides."""
    _conv_fails_alone(monkeypatch)
    torch.manual_seed(0)
    model = ConvGeluPool().eval()
    x = torch.randn(2, 3, 16, 16)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})   # auto
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
    (rec,) = backend.records
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last: 1 convolution(s) run NHWC (1 less accurate alone "
                           "in cuDNN's TF32 NHWC kernel, kept so"), note
    (conv,) = [n for n in rec.gm.graph.nodes if n.target is aten.convolution.default]
    assert conv.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert not [n for n in rec.gm.graph.nodes if n.target is aten._convolution.default]


@pytest.mark.gpu
def test_on_cuda_a_pooled_convolution_is_correct_by_the_design_rule():
    """On the GPU, with cuDNN's TF32 allowed (torch's default): whichever way the layout
    pass decides (TF32 kept for the pooled output, or TF32 off), the compiled result is
    correct by DESIGN.md's rule against eager and an fp64 run."""
    from stitch_backend.correctness import compare

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 64, 3), nn.GELU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten()).cuda().eval()
    x = torch.rand(16, 8, 128, 128, device="cuda")
    backend = StitchBackend(options={"cache": False})
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
        ref = model.double()(x.double())
    cmp = compare(got, want, ref)
    assert cmp.ok_design, (cmp.reason, backend.records[0].notes)


def test_a_graph_too_large_for_free_memory_is_not_judged(monkeypatch):
    """The three runs would need more than MEMORY_SHARE of the free device memory (made
    small here): no run, and no verdict kept (a later compile, with more memory free,
    tries again); the per-convolution verdicts stand."""
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    traced = _traced(_pooled, x, w)
    monkeypatch.setattr(graph_precision, "free_bytes", lambda metas: 1024)
    monkeypatch.setattr(graph_precision, "_draw", lambda *a: pytest.fail("it ran"))
    verdict = graph_precision.outputs_hold(traced, traced)
    assert not verdict.ok and not verdict.final
    assert "GiB free" in verdict.why and "not judged" in verdict.why


def _conv_bn_eval(x, w, mean, var):
    return F.batch_norm(F.conv2d(x, w, padding=1), mean, var, training=False)


def test_a_running_variance_is_drawn_positive_so_the_outputs_are_judged():
    """An eval-mode BatchNorm's running variance drawn standard normal gives NaN in every
    run (and NaN matches itself): its placeholder is drawn in [0.5, 1.5) instead, and a
    rewrite that drifts is then caught. Found on an H100: the zoo's residual blocks held
    this way and ran TF32 convolutions 1000x further from fp64 than eager."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 3, 3)
    mean, var = torch.randn(8), torch.rand(8) + 0.5
    traced = _traced(_conv_bn_eval, x, w, mean, var)
    assert graph_precision._variances(traced) == {3}
    metas = [n.meta["val"] for n in traced.graph.find_nodes(op="placeholder")]
    drawn = graph_precision._draw(metas, {3})
    assert bool((drawn[3] >= 0.5).all()) and bool((drawn[3] < 1.5).all())
    assert bool((drawn[2] < 0).any())           # the running mean: standard normal
    drifted = _traced(lambda *a: _conv_bn_eval(*a) * (1 + 1e-3), x, w, mean, var)
    verdict = graph_precision.outputs_hold(traced, drifted)
    assert not verdict.ok and "beyond 0.0001 of eager" in verdict.why, verdict.why
    assert graph_precision.outputs_hold(traced, traced).ok


def test_a_graph_whose_fp64_run_is_not_finite_on_random_inputs_is_not_held():
    """Where random inputs give NaN (a log of standard normal values), the runs agree on
    nothing that can be judged: the graph is not held, with the reason."""
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    traced = _traced(lambda a, b: torch.log(F.conv2d(a, b)), x, w)
    verdict = graph_precision.outputs_hold(traced, traced)
    assert not verdict.ok and "not finite" in verdict.why, verdict.why


def test_a_drift_only_non_negative_inputs_show_is_caught_by_the_uniform_draw():
    """Both draws must hold: a rewrite that agrees with the traced graph on standard
    normal inputs and drifts where every input is non-negative (as L2 27's TF32
    convolution did, before a group norm, on KernelBench's uniform inputs) is refused,
    and the reason names the draw."""
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    traced = _traced(_pooled, x, w)

    def drifts_on_non_negative(a, b):
        flag = ((a >= 0).all() & (b >= 0).all()).to(a.dtype)
        return _pooled(a, b) * (1 + 1e-3 * flag)

    drifted = _traced(drifts_on_non_negative, x, w)
    verdict = graph_precision.outputs_hold(traced, drifted)
    assert not verdict.ok and verdict.final, verdict.why
    assert verdict.why.startswith("on uniform [0, 1) random inputs:"), verdict.why
    assert "beyond 0.0001 of eager" in verdict.why
    assert graph_precision.outputs_hold(traced, traced).ok


def _drifting_rewrite(monkeypatch):
    """The channels-last rewrite made to drift by 1e-3 on every input (a stand-in, on the
    CPU, for cuDNN's TF32 kernels on inputs the random draws did not show), with its
    convolution failing alone and the graph's outputs holding on the random draws."""
    real_rewrite = layout.to_channels_last

    def drifting(gm, notes=None, partial=False):
        new, result = real_rewrite(gm, notes, partial)
        if result.applied:
            for conv in [n for n in new.graph.nodes if n.target is aten.convolution.default]:
                with new.graph.inserting_after(conv):
                    scaled = new.graph.call_function(aten.mul.Tensor, (conv, 1.001))
                scaled.meta = dict(conv.meta)
                conv.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
            new.recompile()
        return new, result

    _conv_fails_alone(monkeypatch)
    monkeypatch.setattr(layout, "to_channels_last", drifting)
    monkeypatch.setattr(graph_precision, "_judge",
                        lambda a, b: graph_precision.GraphVerdict(True, "held (simulated)"))


def test_a_rewrite_that_fails_on_the_users_inputs_runs_the_graph_as_traced(monkeypatch,
                                                                            tmp_path):
    """The graph's outputs held on the random draws, the rewrite kept TF32, and the
    user's real inputs show it wrong: the first call returns the traced graph's values,
    every later call runs the traced graph, the record says why, and the cache keeps the
    failure, so the next compile keeps the traced layout and is not judged again."""
    _drifting_rewrite(monkeypatch)
    torch.manual_seed(0)
    model = ConvGeluPool().eval()
    x = torch.rand(2, 3, 16, 16)
    options = {"cpu_interpret": True, "cache": True, "cache_dir": str(tmp_path)}
    backend = StitchBackend(options=options)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        first = compiled(x)
        torch.testing.assert_close(first, model(x), atol=1e-6, rtol=1e-6)
        second = compiled(x * 2)
        torch.testing.assert_close(second, model(x * 2), atol=1e-6, rtol=1e-6)
    (rec,) = backend.records
    assert rec.notes[0].startswith("channels-last: 1 convolution(s) run NHWC (1 less "
                                   "accurate alone"), rec.notes
    assert rec.program.as_traced is not None and not rec.program.generated_steps()
    why = next(n for n in rec.notes if n.startswith("every region on ATen: on the first "
                                                    "call's inputs"))
    assert "the channels-last rewrite's TF32 convolutions" in why
    assert "not correct by the rule against the graph as traced" in why, why
    assert all(r.backend == "aten" and r.reason for r in rec.plan.regions)
    stored = list((tmp_path / "notes" / graph_precision.NOTE_KIND).iterdir())
    assert len(stored) == 1

    torch._dynamo.reset()
    again = StitchBackend(options=options)
    with torch.no_grad():
        got = torch.compile(model, backend=again)(x)
    torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
    (rec2,) = again.records
    assert rec2.notes[0].startswith("channels-last off"), rec2.notes
    assert "on the first call's inputs" in rec2.notes[0], rec2.notes[0]
    assert rec2.program.judge_against is None and rec2.program.as_traced is None


def test_a_rewrite_that_holds_on_the_users_inputs_keeps_its_program(monkeypatch):
    """The same check where the rewrite computes the traced values (no drift): the
    Program keeps its kernels and nothing is remembered."""
    _conv_fails_alone(monkeypatch)
    remembered, judged = [], []
    monkeypatch.setattr(graph_precision, "remember_failure", lambda *a: remembered.append(a))
    real_judged = traced_check.judged

    def counted(check, inputs, run):
        out, why = real_judged(check, inputs, run)
        judged.append(why)
        return out, why

    monkeypatch.setattr(traced_check, "judged", counted)
    torch.manual_seed(0)
    model = ConvGeluPool().eval()
    x = torch.rand(2, 3, 16, 16)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    (rec,) = backend.records
    assert rec.program.judge_against is None and rec.program.as_traced is None
    assert rec.program.generated_steps() and not remembered and judged == [None]


class ConvGroupNormMean(nn.Module):
    """KernelBench L2 27's shape, smaller: Conv3d, HardSwish, GroupNorm, the mean over the
    positions. Its outputs are small differences of channel means that non-negative
    inputs make large: TF32 convolutions miss DESIGN.md's rule there by 1000x."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 16, 4)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x):
        return self.norm(F.hardswish(self.conv(x))).mean((2, 3, 4))


@pytest.mark.gpu
def test_on_cuda_a_group_norm_of_non_negative_inputs_is_correct_by_the_design_rule():
    """On the GPU with cuDNN's TF32 allowed, on uniform inputs as KernelBench draws them:
    the compiled result meets DESIGN.md's rule, on the first call and on a later one
    (the uniform draw refuses the TF32 rewrite, or the first call's check runs the graph
    as traced)."""
    from stitch_backend.correctness import compare

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = ConvGroupNormMean().cuda()
    backend = StitchBackend(options={"cache": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            x = torch.rand(64, 3, 16, 32, 32, device="cuda")
            got, want = compiled(x), model(x)
            ref = model.double()(x.double())
            model.float()
            cmp = compare(got, want, ref)
            assert cmp.ok_design, (cmp.reason, backend.records[0].notes)
