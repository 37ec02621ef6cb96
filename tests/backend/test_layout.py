"""The channels-last pass: convolutions read NHWC, values and output strides stay eager's,
stride-dependent uses get the traced layout back, and where it cannot apply it says why."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

from stitch_backend import layout, layout_auto
from stitch_backend.backend import StitchBackend
from stitch_backend.examples import conv_bn_relu, depthwise_separable, residual_block

aten = torch.ops.aten


def _compile(model, x, **options):
    # one record a graph: the layout race has its own tests (test_layout_race.py)
    options = {"cpu_interpret": True, "cache": False, "channels_last": True,
               "layout_race": False, **options}
    backend = StitchBackend(options=options)
    compiled = torch.compile(model, backend=backend)
    return backend, compiled


def _conv_inputs(gm):
    return [n.args[0].meta["val"] for n in gm.graph.nodes
            if n.target in (aten.convolution.default, aten._convolution.default)]


@pytest.fixture
def outputs_fail(monkeypatch):
    """The graph's outputs do not hold the rule with TF32 everywhere (on the CPU they
    always would: no TF32), so the per-convolution verdicts stand."""
    from stitch_backend.graph_precision import GraphVerdict

    monkeypatch.setattr(layout, "outputs_hold",
                        lambda *args, **kw: GraphVerdict(False, "outputs fail (the test)"))


def tf32_noisy(monkeypatch):
    """Every convolution's TF32 NHWC result noisy, its TF32-off one exact (the CPU has no
    TF32 to do it)."""
    real = layout.conv_outputs

    def tf32_noise(node, exact=False):
        traced, nhwc, fp64 = real(node, exact)
        return traced, nhwc if exact else nhwc + 1e-3 * torch.randn_like(nhwc), fp64

    monkeypatch.setattr(layout, "conv_outputs", tf32_noise)
    monkeypatch.setattr(layout, "tf32_may_apply", lambda node: True)


def _check(model_factory, x, train_mode=True, **options):
    torch.manual_seed(0)
    model = model_factory().train(train_mode)
    reference = copy.deepcopy(model)
    backend, compiled = _compile(model, x, **options)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), reference(x)
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
                assert g.stride() == w.stride()
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, dict(reference.named_buffers())[name])
    return backend


@pytest.mark.parametrize("example", [conv_bn_relu, residual_block, depthwise_separable],
                         ids=["conv_bn_relu", "residual_block", "depthwise_separable"])
def test_zoo_convolutions_run_channels_last_with_eager_results(example):
    x = example.get_inputs()[0]
    backend = _check(lambda: example.Model(*example.get_init_inputs()), x)
    (rec,) = backend.records
    assert any(n.startswith("channels-last: ") for n in rec.notes), rec.notes
    ins = _conv_inputs(rec.gm)
    assert ins and all(v.is_contiguous(memory_format=torch.channels_last) for v in ins)
    assert rec.plan.counts()["generated"] >= 1


class Flatten(nn.Module):
    """A view the new strides cannot express (flatten after a conv) and an as_strided."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        z = self.conv2(y)
        return y.view(y.shape[0], -1) * 2, z.as_strided((2, 8), (1, 2)) + 1, z.sum()


def test_views_and_as_strided_see_the_traced_layout():
    backend = _check(Flatten, torch.randn(2, 3, 6, 6))
    (rec,) = backend.records
    assert rec.notes[0].startswith("channels-last: 2 convolution(s)"), rec.notes


def test_a_layout_conversion_after_a_batchnorm_ends_its_region():
    """After training BatchNorm statistics the one-kernel template writes its result and
    the conversion back to NCHW is a stage of its own (a reduction's kernel cannot tile
    the store); split statistics normalise in a pointwise stage that writes the traced
    layout itself, through the tiled template."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.state import subtask_for
    from stitch_backend.kernels import InterpretedRunner, runner_for
    from stitch_backend.regions import region_module
    from tests.agents.test_stem_conv_alternative import _region_inputs

    example = residual_block
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0])
    (rec,) = backend.records
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    conversions = [n for n in nodes.values()
                   if layout.CONVERSION in n.meta and layout.FILTER not in n.meta]
    assert len(conversions) == 2     # the input to NHWC, the output back to NCHW
    back = conversions[-1].name
    (region,) = [r for r in rec.plan.regions if back in r.nodes]
    assert region.kind.value == "conv" and region.nodes[-1] == back, region
    cand = TemplateCoder().propose(subtask_for(rec.gm, region, "k"))
    last = cand.stages[-1]
    assert last.kernel is not None and back in last.region.nodes and len(cand.stages) >= 3
    splits = [a for a in cand.alternatives if a.name.endswith("_split1p")]
    assert splits, [a.name for a in cand.alternatives]
    assert back in splits[0].stages[-1].region.nodes        # normalised, added, converted
    assert splits[0].stages[-1].kernel.emitted.kind == "pointwise"
    # (here the residual is read NCHW, so the plain template is as coalesced as a tile;
    # with every load channels-last the stage is tiled:)
    example = conv_bn_relu
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0])
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    cand = TemplateCoder().propose(subtask_for(rec.gm, region, "k"))
    split = next(a for a in cand.alternatives if a.name.endswith("_split1p"))
    assert split.stages[-1].kernel.emitted.layout == "tiled", split.stages[-1].kernel.source
    inputs = _region_inputs(rec, region)
    want = region_module(rec.gm, region)(*inputs)
    for alt in [cand, *cand.alternatives]:
        for g, w in zip(runner_for(alt, base=InterpretedRunner)(*inputs), want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert g.stride() == w.stride()


class ConvEpilogue(nn.Module):
    """A convolution with a pointwise epilogue, its output back to NCHW."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 40, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(40, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x)) + self.bias


def test_the_output_conversion_ends_a_pointwise_epilogue_through_the_tiled_template():
    from stitch_backend.codegen import generate
    from stitch_backend.regions import boundary, region_module

    backend = _check(ConvEpilogue, torch.randn(2, 3, 8, 8))
    (rec,) = backend.records
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    (conv,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    tail = [n for n in conv.nodes if layout.CONVERSION in nodes[n].meta]
    assert len(tail) == 1 and conv.nodes[-1] == tail[0], conv.nodes
    epilogue = [n for n in conv.nodes if nodes[n].target is not aten.convolution.default]
    region = rec.plan.regions[conv.id]
    sub = type(region)(id=99, kind=region.kind, nodes=epilogue, ops=[], inputs=[], outputs=[])
    sub.inputs, sub.outputs = boundary(rec.gm, epilogue)
    kernel = generate(region_module(rec.gm, sub), "epilogue_tiled")
    assert kernel.emitted.layout == "tiled", kernel.source


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(x).transpose(1, 2) + 0   # traced strides: neither layout


def test_an_output_layout_it_cannot_restore_leaves_the_graph_as_traced():
    backend = _check(Transposed, torch.randn(2, 3, 5, 7))
    (rec,) = backend.records
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last off: ") and "cannot restore" in note, note
    assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))


def test_grouped_convolutions_are_left_alone():
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU())
    backend = _check(lambda: model, torch.randn(2, 8, 6, 6))
    note = next(n for n in backend.records[0].notes if n.startswith("channels-last"))
    assert "grouped convolutions (100% of the convolution FLOPs)" in note, note


def _auto_notes(model, x):
    """The channels-last notes of ``model``'s one record under ``auto`` (not raced)."""
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "channels_last": "auto", "layout_race": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    return [n for n in rec.notes if n.startswith("channels-last")], rec


def test_auto_by_default():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 3, 6, 6))
    assert backend.config.channels_last is None
    assert any(n.startswith("channels-last: ") for n in backend.records[0].notes)
    assert all(v.is_contiguous(memory_format=torch.channels_last)
               for v in _conv_inputs(backend.records[0].gm))


def test_auto_declines_batchnorm_statistics_over_few_positions(monkeypatch):
    example = conv_bn_relu
    torch.manual_seed(0)
    x = example.get_inputs()[0]
    (note,), rec = _auto_notes(example.Model(*example.get_init_inputs()).train(), x)
    assert note.startswith("channels-last off: auto: ") and "positions per channel" in note, note
    assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))
    # The same graph with the threshold below its positions: rewritten.
    monkeypatch.setattr(layout_auto, "AUTO_MIN_POSITIONS", x.shape[0] * x.shape[2] * x.shape[3] // 4)
    torch._dynamo.reset()
    (note,), rec = _auto_notes(example.Model(*example.get_init_inputs()).train(), x)
    assert note.startswith("channels-last: "), note
    assert all(v.is_contiguous(memory_format=torch.channels_last) for v in _conv_inputs(rec.gm))


def test_auto_rewrites_convolutions_without_training_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    (note,), rec = _auto_notes(model, torch.randn(2, 3, 6, 6))
    assert note.startswith("channels-last: 2 convolution(s) run NHWC"), note


def test_option_off_and_training_graphs_keep_the_traced_layout():
    example = conv_bn_relu
    x = example.get_inputs()[0]
    backend = _check(lambda: example.Model(*example.get_init_inputs()), x, channels_last=False)
    assert not any(n.startswith("channels-last") for n in backend.records[0].notes)

    torch.manual_seed(0)
    model = example.Model(*example.get_init_inputs())
    backend, compiled = _compile(model, x)
    compiled(x.requires_grad_()).sum().backward()
    assert {r.stage for r in backend.records} == {"forward", "backward"}
    for rec in backend.records:
        assert not any(n.startswith("channels-last") for n in rec.notes)
        assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))


def test_a_convolution_less_accurate_channels_last_leaves_the_graph_as_traced(monkeypatch, outputs_fail):
    """cuDNN may run NHWC in TF32 where NCHW is exact: the check sees the larger error
    (simulated here: 1e-3 of noise on the channels-last result) and the pass says no."""
    real = layout.conv_outputs
    calls = []

    def noisier(node, exact=False):
        traced, nhwc, fp64 = real(node, exact)
        calls.append(node.name)
        return traced, nhwc + 1e-3 * torch.randn_like(nhwc), fp64

    monkeypatch.setattr(layout, "conv_outputs", noisier)
    example = residual_block
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0])
    (rec,) = backend.records
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last off: ") and "less accurate" in note, note
    assert calls and all(v.is_contiguous() for v in _conv_inputs(rec.gm))


def test_precision_verdicts_are_kept_in_the_cache_so_a_warm_start_runs_no_convolution(
        monkeypatch, tmp_path, outputs_fail):
    real = layout.conv_outputs
    runs = []

    def counted(node, exact=False):
        runs.append(node.name)
        return real(node, exact)

    monkeypatch.setattr(layout, "conv_outputs", counted)
    example = residual_block
    options = {"cache": True, "cache_dir": str(tmp_path)}
    for _ in range(2):
        torch._dynamo.reset()
        backend = _check(lambda: example.Model(*example.get_init_inputs()),
                         example.get_inputs()[0], **options)
        assert any(n.startswith("channels-last: ") for n in backend.records[0].notes)
    first = len(runs)
    assert first >= 1 and len(runs) == first, runs      # the second compile ran none
    notes = list((tmp_path / "notes" / layout.NOTE_KIND).iterdir())
    assert len(notes) == first

    # A stored "less accurate" verdict is honoured without running anything.
    from stitch_backend.cache import Store
    store = Store(tmp_path)
    for path in notes:
        doc = json.loads(path.read_text())
        store.write_note(layout.NOTE_KIND, json.loads(doc["key"]), {"why": "stored verdict"})
    torch._dynamo.reset()
    backend = _check(lambda: example.Model(*example.get_init_inputs()),
                     example.get_inputs()[0], **options)
    note = next(n for n in backend.records[0].notes if n.startswith("channels-last"))
    assert note == ("channels-last off: stored verdict; TF32 at the graph's outputs: outputs "
                    "fail (the test)") and len(runs) == first


def test_precision_check_runs_each_distinct_convolution_once_and_passes_exact_ones(monkeypatch):
    real = layout.conv_outputs
    seen = []

    def spy(node, exact=False):
        out = real(node, exact)
        seen.append((node.name, out))
        return out

    monkeypatch.setattr(layout, "conv_outputs", spy)

    class Twice(nn.Module):      # two convolutions of the same sizes, one other
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.c = nn.Conv2d(4, 6, 1, stride=2)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    backend = _check(Twice, torch.randn(2, 4, 8, 8))
    assert any(n.startswith("channels-last: 3 convolution(s)") for n in backend.records[0].notes)
    assert len(seen) == 2, [name for name, _ in seen]
    for _, (traced, nhwc, fp64) in seen:
        assert traced.is_contiguous() and nhwc.is_contiguous() and fp64.dtype == torch.float64
        torch.testing.assert_close(nhwc, traced, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(traced.double(), fp64, rtol=1e-4, atol=1e-4)


def test_same_layout_ignores_strides_of_single_element_dims():
    a = torch.empty(2, 3, 1, 1)
    assert layout.same_layout(a, a.contiguous(memory_format=torch.channels_last))
    b = torch.empty(2, 3, 4, 4)
    assert not layout.same_layout(b, b.contiguous(memory_format=torch.channels_last))
    assert not layout.same_layout(b, torch.empty(2, 3, 4, 5))


def _upsample_example():
    return Upsample(), torch.randn(8, 4, 32, 32)


def _dense_block_example():
    from tests.backend.test_cat import DenseBlock   # (test_cat imports this module)

    return DenseBlock(16, 32, 4), torch.randn(4, 16, 20, 20)


def _zoo_example(example):
    return lambda: (example.Model(*example.get_init_inputs()), example.get_inputs()[0])


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_zoo_example(residual_block), _zoo_example(depthwise_separable),
                                  _upsample_example, lambda: (Volume(), torch.randn(4, 3, 16, 16, 16)),
                                  lambda: (Grouped(), torch.randn(4, 3, 16, 16)),
                                  _dense_block_example],
                         ids=["residual_block", "depthwise_separable", "transposed", "3d",
                              "group_norm", "dense_block"])
def test_channels_last_on_cuda_is_correct_by_the_design_rule(make):
    """Training-mode BatchNorm under no_grad, as KernelBench runs it: channels-last convs
    (other cuDNN kernels than eager's NCHW ones), replay, the guard; DESIGN.md's rule."""
    from stitch_backend.correctness import compare

    torch.manual_seed(0)
    model, x = make()
    model = model.cuda().train()
    reference = copy.deepcopy(model)
    fp64 = copy.deepcopy(model).double()
    backend = StitchBackend(options={"cache": False, "channels_last": True})
    compiled = torch.compile(model, backend=backend)
    x = x.cuda()
    with torch.no_grad():
        for _ in range(4):
            got, want, ref64 = compiled(x), reference(x), fp64(x.double())
            verdict = compare(got, want, ref64)
            assert verdict.ok_design, verdict.reason
            assert got.stride() == want.stride()
    (rec,) = backend.records
    # Applied, or left as traced by the precision check (cuDNN's NHWC choice was TF32
    # where the NCHW one was exact fp32: what made this test fail before the check).
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last: ") or "less accurate" in note, note
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, dict(reference.named_buffers())[name], rtol=1e-3, atol=1e-3)


def test_a_convolution_that_loses_precision_keeps_its_layout_and_the_others_go_nhwc(monkeypatch, outputs_fail):
    """The precision check refuses one convolution (as the H200 refused the 3->64 first
    convolutions of L3 ResNetBasicBlock and RegNet): it reads its traced NCHW input, the
    others still run channels-last, and values and output strides stay eager's."""
    judged = []

    def judge(node):
        judged.append(node.name)
        first = len(judged) == 1
        return layout.Verdict("refused for the test" if first else None)

    monkeypatch.setattr(layout, "_judge", judge)
    example = residual_block
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0])
    (rec,) = backend.records
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last: 2 convolution(s) run NHWC, 1 kept in the traced "
                           "layout (refused for the test)"), note
    ins = {n.name: n.args[0].meta["val"] for n in rec.gm.graph.nodes
           if n.target is aten.convolution.default}
    assert ins[judged[0]].is_contiguous()
    others = [v for name, v in ins.items() if name != judged[0]]
    assert len(others) == 2
    assert all(v.is_contiguous(memory_format=torch.channels_last) for v in others)

    # 'auto' (the default) keeps the whole graph as traced when a convolution is refused
    judged.clear()
    torch._dynamo.reset()
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0],
                     train_mode=False, channels_last=None)   # eval: auto would apply
    note = next(n for n in backend.records[0].notes if n.startswith("channels-last"))
    assert note.startswith("channels-last off: refused for the test; TF32 at the graph's "
                           "outputs: outputs fail"), note


def test_a_convolution_exact_only_without_tf32_runs_nhwc_with_tf32_off(monkeypatch, outputs_fail):
    """cuDNN's TF32 NHWC kernel is less accurate than eager's exact NCHW one (the 3->64
    first convolution of L3 ResNetBasicBlock and RegNet on the H200); with TF32 off it is
    exact again: the graph runs that convolution NHWC as ``aten._convolution`` with
    ``allow_tf32=False``, the others as before (simulated on the CPU: noise on the
    default channels-last result, none on the TF32-off one)."""
    real = layout.conv_outputs
    runs = []

    def tf32_noise(node, exact=False):
        runs.append((node.name, exact))
        traced, nhwc, fp64 = real(node, exact)
        first = node.name == runs[0][0]
        return traced, (nhwc + 1e-3 * torch.randn_like(nhwc) if first and not exact
                        else nhwc), fp64

    monkeypatch.setattr(layout, "conv_outputs", tf32_noise)
    monkeypatch.setattr(layout, "tf32_may_apply", lambda node: True)
    example = conv_bn_relu
    backend = _check(lambda: example.Model(*example.get_init_inputs()), example.get_inputs()[0],
                     channels_last=None, train_mode=False)
    (rec,) = backend.records
    note = next(n for n in rec.notes if n.startswith("channels-last"))
    assert note.startswith("channels-last: 1 convolution(s) run NHWC (1 with cuDNN's TF32 "
                           "off"), note
    assert runs[:2] == [(runs[0][0], False), (runs[0][0], True)], runs
    (conv,) = [n for n in rec.gm.graph.nodes if n.target is aten._convolution.default]
    assert conv.args[-1] is False and len(conv.args) == 13
    assert conv.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert not [n for n in rec.gm.graph.nodes if n.target is aten.convolution.default]

    # with a bias, the flagged convolution's bias still moves into the epilogue
    runs.clear()
    torch._dynamo.reset()
    backend = _check(lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
                     torch.randn(2, 3, 8, 8), train_mode=False)
    (rec,) = backend.records
    assert any("1 convolution bias(es)" in n for n in rec.notes), rec.notes
    (conv,) = [n for n in rec.gm.graph.nodes if n.target is aten._convolution.default]
    assert conv.args[2] is None and conv.args[-1] is False


def test_exact_args_carry_cudnn_flags_with_tf32_off():
    args = ("x", "w", None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    flagged = layout.exact_args(args)
    assert flagged[:9] == args and flagged[-1] is False
    assert flagged[9:12] == (torch.backends.cudnn.benchmark,
                             torch.backends.cudnn.deterministic
                             or torch.are_deterministic_algorithms_enabled(),
                             torch.backends.cudnn.enabled)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(layout.CONV_FLAGGED(*layout.exact_args((x, w) + args[2:])),
                               aten.convolution.default(x, w, *args[2:]))


class Upsample(nn.Module):
    """A transposed convolution and its epilogue (KernelBench L2's common shape)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return torch.tanh(self.up(x) - 0.5)


def test_transposed_convolutions_run_channels_last_too():
    backend = _check(Upsample, torch.randn(2, 4, 6, 6))
    (rec,) = backend.records
    assert rec.notes[0].startswith("channels-last: 1 convolution(s)"), rec.notes
    ins = _conv_inputs(rec.gm)
    assert len(ins) == 1 and ins[0].is_contiguous(memory_format=torch.channels_last)


class Volume(nn.Module):
    """3-D convolutions (a third of KernelBench L2): conv, BatchNorm, pooling, transposed."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm3d(8)
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)

    def forward(self, x):
        y = nn.functional.max_pool3d(torch.relu(self.bn(self.conv(x))), 2)
        return torch.sigmoid(self.up(y)) * 2


def test_3d_convolutions_run_channels_last_3d():
    backend = _check(Volume, torch.randn(2, 3, 8, 8, 8))
    (rec,) = backend.records
    assert rec.notes[0].startswith("channels-last: 2 convolution(s)"), rec.notes
    ins = _conv_inputs(rec.gm)
    assert len(ins) == 2 and all(v.is_contiguous(memory_format=torch.channels_last_3d)
                                 for v in ins)


class Grouped(nn.Module):
    """A convolution and a GroupNorm: ATen's CUDA group norm takes only NCHW inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)

    def forward(self, x):
        return torch.tanh(self.norm(torch.relu(self.conv(x))))


def test_group_norm_reads_its_input_in_the_traced_layout():
    backend = _check(Grouped, torch.randn(2, 3, 8, 8))
    (rec,) = backend.records
    assert rec.notes[0].startswith("channels-last: 1 convolution(s)"), rec.notes
    (norm,) = [n for n in rec.gm.graph.nodes if n.target is aten.native_group_norm.default]
    assert norm.args[0].meta["val"].is_contiguous()
    (conv_in,) = _conv_inputs(rec.gm)
    assert conv_in.is_contiguous(memory_format=torch.channels_last)


class VolumeNorm(nn.Module):
    """A transposed 3-D convolution and a layer norm over the last size (KernelBench L2 3)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose3d(3, 8, 2, stride=2)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return nn.functional.gelu(self.norm(self.up(x) + 1.0))


def test_auto_declines_a_layer_norm_over_trailing_sizes():
    torch.manual_seed(0)
    (note,), rec = _auto_notes(VolumeNorm(), torch.randn(2, 3, 4, 4, 4))
    assert note.startswith("channels-last off: auto: ") and "last 1 of 5 dims" in note, note
    assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))
    # forced, the rewrite applies and the values stay eager's
    torch._dynamo.reset()
    backend = _check(VolumeNorm, torch.randn(2, 3, 4, 4, 4))
    assert backend.records[0].notes[0].startswith("channels-last: 1 convolution(s)")


def test_auto_keeps_a_3d_convolution_exact_only_without_tf32_as_traced(monkeypatch, outputs_fail):
    """A 3-D convolution that channels-last needs TF32 off for: ``auto`` keeps the graph
    as traced (slower so on the H200), a forced rewrite runs it NHWC with TF32 off."""
    tf32_noisy(monkeypatch)
    model = lambda: nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.ReLU())  # noqa: E731
    x = torch.randn(2, 3, 6, 6, 6)
    torch.manual_seed(0)
    (note,), rec = _auto_notes(model(), x)
    assert note.startswith("channels-last off: ") and "3-D convolution" in note, note
    assert all(v.is_contiguous() for v in _conv_inputs(rec.gm))
    torch._dynamo.reset()
    backend = _check(model, x)
    note = backend.records[0].notes[0]
    assert note.startswith("channels-last: 1 convolution(s) run NHWC (1 with cuDNN's TF32 off"), note
