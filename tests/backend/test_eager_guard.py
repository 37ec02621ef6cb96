"""The eager guard: a settled graph (inference, or a training graph's forward and
backward as one step) is timed against the graph as Dynamo traced it, and the faster one
runs from then on, said in the report."""

from __future__ import annotations

import pytest
import torch

from stitch_backend import eager_guard
from stitch_backend.backend import StitchBackend

ON = {"cpu_interpret": True, "require_speedup": False, "eager_guard": True}


class Softplus(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.softplus(x) * 2 + 1


@pytest.fixture
def guard_on_cpu(monkeypatch):
    """Guard CPU graphs too, and time with a script: wall_ms(fn) runs fn once (so the
    calls are real) and returns the next scripted time."""
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))
    timings: list[float] = []
    seen: list[int] = []

    def fake_wall_ms(fn, runs=5):
        fn()
        seen.append(1)
        return timings.pop(0)

    monkeypatch.setattr(eager_guard.cudagraphs, "wall_ms", fake_wall_ms)
    return timings, seen


def _run(model, x, options, calls=5):
    backend = StitchBackend(options=options)
    compiled = torch.compile(model, backend=backend)
    outs = []
    with torch.no_grad():
        for _ in range(calls):
            outs.append(compiled(x))
        want = model(x)
    for out in outs:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    return backend


def test_faster_eager_runs_the_graph_as_traced(guard_on_cpu):
    timings, _ = guard_on_cpu
    timings += [2.0, 1.0, 2.1, 1.1]   # stitched, eager, stitched, eager
    backend = _run(Softplus(), torch.randn(16, 32), ON)
    (rec,) = backend.records
    assert rec.runs_as_traced and rec.to_dict()["runs_as_traced"]
    assert rec.plan.counts()["generated"] == 0
    assert any("2.000 ms stitched vs 1.000 ms" in n for n in rec.notes)
    assert "runs as traced by Dynamo" in backend.report()
    assert all("Dynamo traced" in r.reason for r in rec.plan.regions)


@pytest.mark.parametrize("timings,traced", [([1.0, 1.0, 1.1, 1.0], False),   # a tie
                                            ([1.0, 0.99, 1.0, 0.99], True)])  # 1% loss
def test_a_tie_keeps_the_stitched_graph_a_loss_does_not(guard_on_cpu, timings, traced):
    scripted, _ = guard_on_cpu
    scripted += timings
    backend = _run(Softplus(), torch.randn(16, 32), ON)
    (rec,) = backend.records
    assert rec.runs_as_traced is traced
    assert (rec.plan.counts()["generated"] > 0) is not traced
    if not traced:
        assert any(n.startswith("eager guard: stitched kept, 1.000 ms stitched vs 1.000 ms")
                   for n in rec.notes)


def test_decides_once_after_verification(guard_on_cpu):
    timings, seen = guard_on_cpu
    timings += [1.0, 2.0, 1.0, 2.0]
    backend = StitchBackend(options=ON)
    compiled = torch.compile(Softplus(), backend=backend)
    x = torch.randn(8, 8)
    with torch.no_grad():
        compiled(x)                  # verification call: nothing timed yet
        assert not seen
        assert backend.records[0].program.pending == {}
        compiled(x)                  # settled: its own run, then four timings
        assert len(seen) == 4
        for _ in range(3):
            compiled(x)
    assert len(seen) == 4 and not timings


def test_the_graph_as_traced_is_called_without_nn_module_call(guard_on_cpu, monkeypatch):
    """A graph that runs as traced calls its GraphModule's forward directly: through the
    module's ``__call__`` (FX's _WrappedCall, nn.Module's hooks) it cost 1-3 us more."""
    backend = StitchBackend(options=dict(ON, codegen=False))
    compiled = torch.compile(lambda x: torch.nn.functional.softplus(x) * 2 + 1,
                             backend=backend)
    x = torch.randn(16, 32)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        assert backend.records[0].runs_as_traced
        calls = []
        real = torch.nn.Module._call_impl

        def counted(self, *args, **kwargs):
            calls.append(type(self).__name__)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Module, "_call_impl", counted)
        out = compiled(x)
    assert not calls
    torch.testing.assert_close(out, torch.nn.functional.softplus(x) * 2 + 1)


def test_all_aten_program_runs_as_traced_without_timing(guard_on_cpu):
    _, seen = guard_on_cpu
    backend = _run(Softplus(), torch.randn(16, 32), dict(ON, codegen=False))
    (rec,) = backend.records
    assert rec.runs_as_traced and not seen
    assert any("no region runs a generated kernel" in n for n in rec.notes)


def test_timing_failure_keeps_the_stitched_graph(monkeypatch):
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))

    def broken(fn, runs=5):
        raise RuntimeError("clock broke")

    monkeypatch.setattr(eager_guard.cudagraphs, "wall_ms", broken)
    backend = _run(Softplus(), torch.randn(16, 32), ON)
    (rec,) = backend.records
    assert not rec.runs_as_traced and rec.plan.counts()["generated"] > 0
    assert any("timing failed (RuntimeError: clock broke)" in n for n in rec.notes)


def test_option_off_and_cpu_graphs_are_not_guarded(monkeypatch):
    calls = []
    monkeypatch.setattr(eager_guard.cudagraphs, "wall_ms", lambda fn, runs=5: calls.append(1))
    _run(Softplus(), torch.randn(4, 4), ON)                        # cpu is not in DEVICES
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))
    _run(Softplus(), torch.randn(4, 4), dict(ON, eager_guard=False))
    assert not calls


class BatchNormTrain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x).relu()


class Dropout(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True) + 1


def _records(model, x, grad=False):
    backend = StitchBackend(options={"codegen": False})
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(grad):
        compiled(x)
    return backend.records


def test_ineligible_graphs_say_why(monkeypatch):
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))
    x = torch.randn(4, 8)
    assert eager_guard.ineligible(_records(Softplus(), x)) is None
    assert eager_guard.ineligible(_records(BatchNormTrain(), x)) is None  # saved, restored
    assert eager_guard.ineligible(_records(Dropout(), x)) is None   # generators put back
    lin = torch.nn.Linear(8, 8)
    assert eager_guard.ineligible(_records(lin, x, grad=True)) is None   # training: a step
    (rec,) = _records(BatchNormTrain(), x)
    rec.aot_mutations = None
    assert "mutations are unknown" in eager_guard.ineligible([rec])
    rec.aot_mutations = len(rec.program.writebacks) + 1   # one applied outside the graph
    assert "outside the graph" in eager_guard.ineligible([rec])
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda",))
    assert "inputs are on cpu" in eager_guard.ineligible(_records(Softplus(), x))
    assert eager_guard.ineligible([]) == "no stitched graph"


def test_a_graph_left_unguarded_says_why_in_its_notes(monkeypatch):
    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))
    backend = StitchBackend(options={"codegen": False, "eager_guard": True})
    with torch.no_grad():
        torch.compile(Softplus(), backend=backend, dynamic=True)(torch.randn(4, 8))
    (rec,) = backend.records
    assert any(n.startswith("eager guard off: symbolic sizes") for n in rec.notes), rec.notes
    assert "eager guard off" in backend.report()


@pytest.mark.parametrize("timings,traced", [([2.0, 1.0, 2.1, 1.1], True),
                                            ([1.0, 2.0, 1.1, 2.1], False)])
def test_a_graph_drawing_random_numbers_is_timed_with_its_generators_put_back(
        guard_on_cpu, timings, traced):
    """Dropout: the timing calls draw numbers inside ``torch.random.fork_rng``, so a
    seeded run of five calls draws eager's numbers call for call, whichever way the
    guard went (without it, every call after the decision would differ)."""
    guard_timings, seen = guard_on_cpu
    guard_timings += timings
    model, x = Dropout(), torch.randn(64, 32)
    backend = StitchBackend(options=ON)
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(0)
    with torch.no_grad():
        got = [compiled(x) for _ in range(5)]
    torch.manual_seed(0)
    want = [model(x) for _ in range(5)]
    assert len(seen) == 4, "the guard did not time the graph"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    (rec,) = backend.records
    assert rec.runs_as_traced is traced, rec.notes


@pytest.mark.parametrize("timings,traced", [([2.0, 1.0, 2.0, 1.0], True),
                                            ([1.0, 2.0, 1.0, 2.0], False)])
def test_mutated_inputs_are_updated_once_per_call(guard_on_cpu, timings, traced):
    """BatchNorm in training mode under no_grad: the timing runs update the running
    statistics many times; they are put back, so after five calls the statistics are
    eager's after five calls, whichever way the guard went."""
    scripted, _ = guard_on_cpu
    scripted += timings
    torch.manual_seed(0)
    model, reference = BatchNormTrain(), BatchNormTrain()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(16, 8)
    backend = StitchBackend(options=ON)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(compiled(x), reference(x), atol=1e-5, rtol=1e-5)
    (rec,) = backend.records
    assert rec.program.writebacks and rec.runs_as_traced is traced and not scripted
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(reference.bn, name))
    assert int(model.bn.num_batches_tracked) == 5


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.nn.functional.softplus(self.bn(self.conv(x))) * 2


def _train(options, timings_seen=None, steps=4, backward=True, device="cpu"):
    """``steps`` training steps of ConvBN compiled with ``options`` beside an eager twin:
    outputs, every gradient and the running statistics equal eager's after each step."""
    torch.manual_seed(0)
    model, reference = ConvBN().to(device), ConvBN().to(device)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8, device=device)
    backend = StitchBackend(options=options)
    compiled = torch.compile(model, backend=backend)
    for step in range(steps):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        out, want = compiled(x), reference(x)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        if timings_seen is not None and step == 0:
            assert not timings_seen            # nothing timed before the backward ran
        if backward:
            out.sum().backward()
            want.sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)
    assert int(model.bn.num_batches_tracked) == steps
    return backend


@pytest.mark.parametrize("timings,traced", [([2.0, 1.0, 2.0, 1.0], True),
                                            ([1.0, 2.0, 1.0, 2.0], False)])
def test_a_training_graph_is_timed_as_a_step_once_its_backward_settled(
        guard_on_cpu, timings, traced):
    """Forward and backward: decided at the second call (after the first backward),
    each timing a forward plus autograd.grad; the user's gradients, outputs and running
    statistics stay eager's whichever way it goes (no timing gradient accumulates)."""
    scripted, seen = guard_on_cpu
    scripted += timings
    backend = _train(ON, seen)
    assert len(seen) == 4 and not scripted
    stages = sorted(r.stage for r in backend.records)
    assert stages == ["backward", "forward"]
    assert all(r.runs_as_traced is traced for r in backend.records)
    forward = next(r for r in backend.records if r.stage == "forward")
    assert any("a forward and backward each" in n for n in forward.notes), forward.notes


def test_a_training_graph_whose_backward_never_runs_is_kept_untimed(guard_on_cpu):
    scripted, seen = guard_on_cpu
    backend = _train(ON, seen, steps=eager_guard.LATEST_CALL + 1, backward=False)
    (rec,) = backend.records
    assert not seen and not rec.runs_as_traced
    assert any("no backward has run" in n for n in rec.notes), rec.notes


@pytest.mark.gpu
def test_gpu_decomposed_aten_loses_to_the_graph_as_traced():
    """codegen off: the Program is softplus decomposed (four passes over 64M floats),
    the traced graph one softplus kernel: the guard must pick the latter."""
    backend = _run(Softplus(), torch.randn(8192, 8192, device="cuda"),
                   {"codegen": False, "eager_guard": True}, calls=6)
    (rec,) = backend.records
    assert rec.runs_as_traced, rec.notes


@pytest.mark.gpu
def test_gpu_fused_chain_keeps_its_kernel():
    """Eight pointwise ops over 64M floats: one generated pass against eight eager ones."""

    class Chain(torch.nn.Module):
        def forward(self, x):
            return ((x * 1.5 + 2).sigmoid() * x - 0.5).relu().exp().clamp(max=4.0)

    backend = _run(Chain(), torch.randn(8192, 8192, device="cuda"),
                   {"eager_guard": True}, calls=6)
    (rec,) = backend.records
    assert not rec.runs_as_traced and rec.plan.counts()["generated"] > 0, rec.notes
    assert any(n.startswith("eager guard: stitched kept") for n in rec.notes)


@pytest.mark.gpu
def test_gpu_batchnorm_training_statistics_updated_once_per_call():
    """The guard's timing runs on a graph that mutates its running statistics (L1
    BatchNorm's case): after six calls they are eager's after six calls."""
    torch.manual_seed(0)
    model = torch.nn.BatchNorm2d(32).cuda()
    reference = torch.nn.BatchNorm2d(32).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 32, 128, 128, device="cuda")
    backend = StitchBackend(options={"eager_guard": True})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(compiled(x), reference(x), atol=1e-4, rtol=1e-4)
    (rec,) = backend.records
    assert any(n.startswith("eager guard") or "Dynamo traced" in n for n in rec.notes), rec.notes
    torch.testing.assert_close(model.running_mean, reference.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.running_var, reference.running_var, atol=1e-5, rtol=1e-5)
    assert int(model.num_batches_tracked) == 6


@pytest.mark.gpu
def test_gpu_training_step_is_guarded_and_keeps_eager_gradients():
    """On CUDA, the real timing: decided once the backward settled, either way the
    gradients and running statistics stay eager's."""
    backend = _train({"eager_guard": True}, steps=5, device="cuda")
    forward = next(r for r in backend.records if r.stage == "forward")
    assert any("a forward and backward each" in n for n in forward.notes) or \
        any("no region runs a generated kernel" in n for n in forward.notes), forward.notes
