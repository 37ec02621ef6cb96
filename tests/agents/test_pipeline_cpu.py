"""The Coder -> Verifier -> Program pipeline, run on the CPU through the IR interpreter.

``cpu_interpret`` swaps nvcc and the GPU for the kernel-IR interpreter, so everything but
the CUDA launch itself (which the gpu tests cover) is exercised here: candidates are
proposed per region, verified on the real inputs and fresh draws at the first call,
installed when correct, rejected with the reason when not, and the Program checked end
to end.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from stitch_backend import kernels
from stitch_backend.agents.verifier import Verifier, VerifySettings
from stitch_backend.backend import StitchBackend
from tests.zoo import DropoutModel, zoo

OPTIONS = {"cpu_interpret": True, "require_speedup": False}


def _flat(v):
    return [x for item in v for x in _flat(item)] if isinstance(v, (tuple, list)) else [v]


def _regions(backend):
    return [r for rec in backend.records for r in rec.plan.regions]


@pytest.mark.parametrize("name", ["transformer_block", "gru_cell", "views_and_inplace",
                                  "norm_zoo", "manual_attention"])
def test_verified_kernels_replace_fused_regions(name):
    cls, make_inputs = zoo()[name]
    torch.manual_seed(0)
    model = cls().eval()
    inputs = make_inputs(4)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        first = compiled(*inputs)     # ATen run; candidates verified on these inputs
        second = compiled(*inputs)    # verified kernels installed
        want = model(*inputs)
    for a, b, w in zip(_flat(first), _flat(second), _flat(want)):
        torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-6)  # decomposed ATen vs eager
        torch.testing.assert_close(b, w, atol=1e-5, rtol=1e-5)
    regions = _regions(backend)
    assert any(r.backend == "kernel" and r.kernel for r in regions)
    for r in regions:
        assert r.backend == "kernel" or r.reason, f"region {r.id} on ATen without a reason"
    verdicts = [a.verdict for t in backend.trajectories for a in t.attempts if a.verdict]
    assert verdicts and all(v.draws >= 4 for v in verdicts)


def test_training_with_interpreted_kernels_gives_eager_gradients():
    cls, make_inputs = zoo()["transformer_block"]
    torch.manual_seed(0)
    model = cls().train()
    reference = copy.deepcopy(model)
    x = make_inputs(2)[0]
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second step runs the installed kernels
        for p in list(model.parameters()) + list(reference.parameters()):
            p.grad = None
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=n)
    stages = {rec.stage for rec in backend.records}
    assert stages == {"forward", "backward"}
    assert any(r.backend == "kernel" for rec in backend.records if rec.stage == "backward"
               for r in rec.plan.regions)


def test_wrong_candidates_are_rejected_and_outputs_stay_eager(monkeypatch):
    real = kernels.InterpretedRunner.__call__

    def off_by_a_little(self, *inputs):
        outs = real(self, *inputs)
        return [o + 1e-2 if o.is_floating_point() else o for o in outs]

    monkeypatch.setattr(kernels.InterpretedRunner, "__call__", off_by_a_little)
    cls, make_inputs = zoo()["transformer_block"]
    torch.manual_seed(0)
    model = cls().eval()
    x = make_inputs(2)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(*x), model(*x), atol=1e-6, rtol=1e-6)
    fused = [r for r in _regions(backend) if r.kind.value == "fused"]
    assert fused and all(r.backend == "aten" and "wrong result" in r.reason for r in fused)


def test_unwritten_output_elements_are_caught(monkeypatch):
    real = kernels.InterpretedRunner.__call__

    def forgets_one(self, *inputs):
        outs = [o.clone() for o in real(self, *inputs)]
        for o in outs:
            if o.is_floating_point() and o.numel():
                o.view(-1)[-1] = float("nan")  # what a poisoned, unwritten element looks like
        return outs

    monkeypatch.setattr(kernels.InterpretedRunner, "__call__", forgets_one)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(lambda x: torch.softmax(x * 2.0, -1), backend=backend)
    x = torch.randn(8, 16)
    with torch.no_grad():
        compiled(x)
        torch.testing.assert_close(compiled(x), torch.softmax(x * 2.0, -1))
    (region,) = [r for r in _regions(backend) if r.kind.value == "fused"]
    assert region.backend == "aten" and "NaN" in region.reason


def test_seeded_dropout_model_matches_eager_with_kernels():
    torch.manual_seed(0)
    model = DropoutModel().train()
    x = torch.randn(8, 32)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for seed in (5, 6):  # the first call verifies (re-running regions), the second runs kernels
            torch.manual_seed(seed)
            got = compiled(x)
            after = torch.rand(3)
            torch.manual_seed(seed)
            want = model(x)
            want_after = torch.rand(3)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            # The generator advanced exactly as eager's did, verification included.
            torch.testing.assert_close(after, want_after, atol=0, rtol=0)
    assert any(r.backend == "kernel" for r in _regions(backend))


def test_dynamic_shapes_keep_their_kernels():
    torch.manual_seed(0)
    model = zoo()["transformer_block"][0]().eval()
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for b in (2, 3, 5, 7):
            x = torch.randn(b, 8, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    dynamic = [rec for rec in backend.records if rec.dynamic]
    assert len(dynamic) == 1, "one symbolic graph should serve every later batch size"
    assert any(r.backend == "kernel" for r in dynamic[0].plan.regions)


def test_verifier_flags_a_degenerate_reference_and_widens_draws():
    verifier = Verifier(VerifySettings(require_speedup=False))
    eager = lambda x: [torch.clamp(x, min=5.0, max=6.0) * 0.0 + 1.0]
    verdict = verifier.check(eager, eager, [torch.randn(64)])
    assert verdict.ok and verdict.degenerate
    assert verdict.draws == 1 + 3 + 2
    assert "barely depends" in verdict.reason


def test_verifier_rejects_wrong_shape_and_raising_candidates():
    verifier = Verifier(VerifySettings(require_speedup=False))
    eager = lambda x: [F.relu(x)]
    assert not verifier.check(lambda x: [F.relu(x).t()], eager, [torch.randn(4, 5)]).ok

    def boom(x):
        raise RuntimeError("illegal address")

    verdict = verifier.check(boom, eager, [torch.randn(4, 5)])
    assert not verdict.ok and "illegal address" in verdict.reason


@pytest.mark.parametrize("name,kind", [("mlp", "gemm"), ("conv_bn_relu", "conv"),
                                       ("residual_block", "conv")])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_gemm_and_conv_epilogues_run_as_library_call_plus_kernel(name, kind, training):
    cls, make_inputs = zoo()[name]
    torch.manual_seed(0)
    model = cls().train(training)
    reference = copy.deepcopy(model)
    inputs = make_inputs(4)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(*inputs)
        reference(*inputs)
        got, want = compiled(*inputs), reference(*inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Training-mode BatchNorm updates running stats through the epilogue's outputs.
    for (n, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, atol=1e-5, rtol=1e-5, msg=n)
    anchored = [r for r in _regions(backend) if r.kind.value == kind]
    with_kernel = [r for r in anchored if r.backend == "kernel"]
    assert with_kernel, [r.reason for r in anchored]
    for r in anchored:
        assert r.backend == "kernel" or "no epilogue" in r.reason or "only by views" in r.reason


def test_coder_replans_a_region_no_single_kernel_can_express():
    """softmax over rows then a sum over the columns: two iteration spaces, so the
    Coder splits the region into kernel stages, verified and installed as one."""
    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.state import Subtask
    from stitch_backend.regions import region_module

    fn = lambda x: torch.softmax(x * 3.0, dim=-1).sum(dim=0) + 1.0
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(fn, backend=backend)
    x = torch.randn(16, 32)
    with torch.no_grad():
        compiled(x)
        torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if r.kind.value == "fused"]
    assert region.backend == "kernel", region.reason
    sub = Subtask(region_id=region.id, region_name="replanned", kind="fused", ops=region.ops,
                  module=region_module(rec.gm, region), graph=rec.gm, region=region)
    cand = TemplateCoder().propose(sub)
    assert cand.stages is not None and len(cand.kernels) >= 2
    assert len({k.entry for k in cand.kernels}) == len(cand.kernels)  # unique entry names


def test_symbolic_graph_reverifies_kernels_on_each_new_shape(monkeypatch):
    """A kernel verified at one batch size is verified again at the next: one that is
    wrong only for batch 7 is dropped there, and the model stays eager-correct."""
    real = kernels.InterpretedRunner.__call__

    def wrong_at_seven(self, *inputs):
        outs = real(self, *inputs)
        if any(isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 7 for x in inputs):
            outs = [o + 1e-2 if o.is_floating_point() else o for o in outs]
        return outs

    monkeypatch.setattr(kernels.InterpretedRunner, "__call__", wrong_at_seven)
    fn = lambda x: torch.softmax(x * 2.0, -1) + 1.0
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad():
        for b in (2, 3, 5, 7, 7, 9):
            x = torch.randn(b, 16)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-6, rtol=1e-6)
    dynamic = [rec for rec in backend.records if rec.dynamic]
    assert len(dynamic) == 1
    (region,) = [r for r in dynamic[0].plan.regions if r.kind.value == "fused"]
    assert region.backend == "aten" and "wrong result" in region.reason


def test_a_tensor_constant_in_forward_is_inlined_into_the_generated_kernel():
    """``torch.min(x, torch.tensor(0.5))`` (a graph constant, a CPU tensor even when ``x``
    is on the GPU) fuses with its neighbours into a generated kernel; the values are
    eager's, and the same model with 0.7 compiles its own kernel (Dynamo traces that one
    as a ``scalar_tensor``)."""
    class ClampMin(torch.nn.Module):
        def __init__(self, value: float):
            super().__init__()
            self.value = value

        def forward(self, x):
            return torch.min(torch.tanh(x), torch.tensor(self.value)) * 3.0

    x = torch.randn(64, 33)
    for value in (0.5, 0.7):
        backend = StitchBackend(options={**OPTIONS, "cache": False})
        compiled = torch.compile(ClampMin(value), backend=backend)
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(compiled(x), ClampMin(value)(x))
        regions = [r for r in _regions(backend) if r.ops]
        assert all(r.backend == "kernel" for r in regions), [r.reason for r in regions]
        assert any("aten.minimum.default" in r.ops for r in regions)


def test_gathers_run_in_generated_kernels_with_eagers_values():
    """Cross entropy's gather of the target's log probability and an embedding lookup
    are fused into generated kernels (before, each was an ATen region of its own: "no
    stitchcuda template covers aten.gather.default"), with eager's values."""
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)

        def forward(self, tokens, logits, target):
            return self.emb(tokens) * 2.0, F.cross_entropy(logits, target)

    torch.manual_seed(0)
    model = Tagger()
    inputs = (torch.randint(0, 50, (4, 7)), torch.randn(32, 40), torch.randint(0, 40, (32,)))
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(*inputs)
        got = compiled(*inputs)
        want = model(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    regions = _regions(backend)
    gathers = [r for r in regions if any(op in ("aten.gather.default", "aten.embedding.default")
                                         for op in r.ops)]
    assert len(gathers) == 2, [r.ops for r in regions]
    for r in gathers:
        assert r.backend == "kernel" and r.kernel, (r.ops, r.reason)


def test_a_language_model_step_with_gathers_gives_eagers_gradients():
    """Token embedding, a linear head and the cross-entropy loss in the compiled
    function, trained: the forward's gathers run in generated kernels (interpreted),
    the backward's scatters on ATen, and the gradients are eager's."""
    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(30, 16)
            self.head = torch.nn.Linear(16, 30)

        def forward(self, tokens, target):
            logits = self.head(torch.tanh(self.emb(tokens)))
            return F.cross_entropy(logits.view(-1, 30), target.view(-1))

    torch.manual_seed(0)
    model = TinyLM().train()
    reference = copy.deepcopy(model)
    tokens, target = torch.randint(0, 30, (4, 6)), torch.randint(0, 30, (4, 6))
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second step runs the installed kernels
        for p in list(model.parameters()) + list(reference.parameters()):
            p.grad = None
        loss = compiled(tokens, target)
        loss.backward()
        want = reference(tokens, target)
        want.backward()
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=n)
    forward = [r for rec in backend.records if rec.stage == "forward" for r in rec.plan.regions]
    gathers = [r for r in forward if any(op in ("aten.gather.default", "aten.embedding.default")
                                         for op in r.ops)]
    assert gathers and all(r.backend == "kernel" for r in gathers), [
        (r.ops, r.backend, r.reason) for r in forward]
