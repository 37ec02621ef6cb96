"""Which graphs whole-Program CUDA graph replay may capture, and why not the others."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.cudagraphs import _identical, ineligible


def _why(fn, *inputs, **kw):
    gm = make_fx(fn)(*inputs)
    args = dict(device="cuda", dynamic=False, stage="inference", allow_training=False)
    args.update(kw)
    return ineligible(gm, inputs, **args)


def test_reasons_for_not_capturing():
    x = torch.randn(4, 8)
    assert _why(lambda x: x * 2, x, device="cpu") == "inputs are on cpu"
    assert "symbolic shapes" in _why(lambda x: x * 2, x, dynamic=True)
    assert "training graphs" in _why(lambda x: x * 2, x, stage="forward")
    # random ops on the default generator are graph-safe: here only the CPU input stops it
    assert "input lives on cpu" in _why(lambda x: F.dropout(x, 0.5, True), x)
    gen = torch.Generator()
    assert "generator of its own" in _why(
        lambda x: x + torch.rand(x.shape, generator=gen), x)
    assert "view of one" in _why(lambda x: (x.view(-1), x * 2), x)
    # a training forward may return its inputs (saved for the backward): handed over as
    # views of the caller's; here the CPU input is what stops it
    assert "input lives on cpu" in _why(lambda x: (x.view(-1), x * 2), x, stage="forward",
                                        allow_training=True)
    assert "input lives on cpu" in _why(lambda x: x * 2, x)  # structure fine, inputs not


def test_inputs_too_large_to_copy_in_each_replay_are_not_captured(monkeypatch):
    """Over COPY_LIMIT of non-static inputs (the ones copied in before each replay), no
    capture; parameters and buffers (AOTAutograd's static inputs) are not copied."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stitch_backend import cudagraphs

    with FakeTensorMode():
        big = torch.empty(cudagraphs.COPY_LIMIT // 4 + 1, device="cuda")
        small = torch.empty(16, device="cuda")
        gm = make_fx(lambda a, b: a * 2 + b.sum())(big, small)
    args = dict(device="cuda", dynamic=False, stage="inference", allow_training=False)
    monkeypatch.setattr(cudagraphs, "static_input_indices", lambda: set())
    assert "GiB of inputs would be copied" in ineligible(gm, [big, small], **args)
    monkeypatch.setattr(cudagraphs, "static_input_indices", lambda: {0})   # a parameter
    assert ineligible(gm, [big, small], **args) is None
    monkeypatch.setattr(cudagraphs, "static_input_indices", lambda: set())
    assert ineligible(gm, [small, small], **args) is None


def test_training_capture_only_when_asked():
    x = torch.randn(4, 8)
    assert "input lives on cpu" in _why(lambda x: x * 2, x, stage="forward",
                                        allow_training=True)


def test_identical_is_bitwise_and_nan_aware():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert _identical((a, [a]), (a.clone(), [a.clone()]))
    assert not _identical(a, a + 1e-6 * torch.tensor([0.0, 0.0, 1.0]))
    assert not _identical(a, a.double())


def test_a_replay_of_a_repeatable_program_must_be_bitwise():
    from stitch_backend.cudagraphs import replay_disagrees

    a = torch.randn(64)
    off = a + 1e-7
    assert "differed" in replay_disagrees([off], [a], None)        # no rerun (mutations)
    assert "differed" in replay_disagrees([off], [a], [a.clone()])  # the rerun is identical


def test_a_replay_of_a_nondeterministic_program_is_judged_by_tolerance_and_spread():
    """Two uncaptured runs differ (cuDNN's convolution backward): the replay stands when
    it is within the correctness rule of the first run, or within twice the runs'
    spread of it; a larger difference still turns replay off."""
    from stitch_backend.cudagraphs import replay_disagrees

    a = torch.randn(64) * 1000
    rerun = a.clone()
    rerun[3] += 0.05                                   # the Program's own spread
    assert replay_disagrees([a + 1e-3], [a], [rerun]) is None     # within 1e-4 relative
    big = a.clone()
    big[5] += 0.08                                     # beyond tolerance, within 2 x 0.05
    assert replay_disagrees([big], [a], [rerun]) is None
    big[5] += 1.0
    why = replay_disagrees([big], [a], [rerun])
    assert why and "beyond twice the 0.05" in why


def test_replay_stays_on_unless_running_uncaptured_is_faster(monkeypatch):
    """The first replay's timing decides (wall clock per call, copies included): the
    faster way is kept (cuDNN's choices while capturing made a graph of convolutions 10%
    slower replayed), except that replay stays on within REPLAY_MARGIN (2%), where the
    two timings are noise."""
    from stitch_backend import cudagraphs

    class _Program:
        writebacks: list = []

        def __init__(self):
            self.notes_sink: list[str] = []

        def generated_steps(self):
            return []          # nothing generated: no run on ATen alone to time

    # (replay, uncaptured) twice, interleaved; the best of each decides
    for first, (replay_ms, plain_ms), off in [
            ((9.0, 3.0), (9.0, 3.0), True), ((9.06, 8.24), (9.5, 8.3), True),
            ((1.0, 1.0), (1.0, 1.0), False), ((1.0, 2.0), (1.0, 2.0), False),
            ((1.2, 1.0), (1.0, 1.1), False),     # a noisy first pass does not turn it off
            ((1.015, 1.0), (1.02, 1.0), False),  # 1.5% slower replayed: within the margin
            ((1.03, 1.0), (1.05, 1.0), True)]:   # 3%: off
        times = iter([*first, replay_ms, plain_ms])
        replay_ms, plain_ms = min(first[0], replay_ms), min(first[1], plain_ms)
        monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn: next(times))
        program = _Program()
        why = cudagraphs.GraphReplay(program, set())._slower_than_uncaptured([], [])
        assert (why is not None) == off, (replay_ms, plain_ms, why)
        assert program.notes_sink == [f"one call: {replay_ms:.3f} ms replayed, {plain_ms:.3f} ms "
                                      "uncaptured (wall clock, best of two medians of 5, on the "
                                      "first replay)"]
        if off:
            assert why == (f"slower than running uncaptured ({replay_ms:.3f} ms vs "
                           f"{plain_ms:.3f} ms a call)")


def test_replay_is_not_timed_where_mutated_inputs_are_too_large_to_save(monkeypatch):
    from stitch_backend import cudagraphs

    class _Program:
        writebacks: list = []

        def __init__(self):
            self.notes_sink: list[str] = []

    def no_timing(fn):
        raise AssertionError("timed although the mutated inputs are over the limit")

    monkeypatch.setattr(cudagraphs, "wall_ms", no_timing)
    monkeypatch.setattr(cudagraphs, "SNAPSHOT_LIMIT", 1024)
    program = _Program()
    replay = cudagraphs.GraphReplay(program, set())
    assert replay._slower_than_uncaptured([], [torch.zeros(512)]) is None   # 2 KiB
    assert program.notes_sink[0].startswith("replay kept without timing it: 0 MiB of mutated")


def _counter_replay(monkeypatch):
    """A Program that counts its calls in a buffer it mutates, and its GraphReplay with a
    stand-in for the captured graph (which runs the Program and writes static mutated
    inputs, as the capture records), so that the first replay's logic runs on the CPU."""
    from stitch_backend import cudagraphs
    from stitch_backend.agents.planner import partition
    from stitch_backend.mutations import split_outputs, strip_input_mutations, write_back
    from stitch_backend.program import Program

    aten = torch.ops.aten

    def step(x, count):
        new = aten.add.Tensor(count, 1)
        aten.copy_.default(count, new)
        return (aten.mul.Tensor(x, new),)

    functional, writebacks = strip_input_mutations(make_fx(step)(torch.randn(3), torch.zeros(())))
    program = Program(functional, partition(functional, graph_name="g"))
    program.writebacks = writebacks
    replay = cudagraphs.GraphReplay(program, {1})          # count: a buffer, read in place

    class _Graph:
        def __init__(self):   # what the capture read (in place or the graph's copies)
            self.read = list(replay.static_inputs)

        def replay(self):  # as a CUDA graph does: the captured outputs' memory rewritten
            fresh = program.run_inputs(self.read)
            for dst, src in zip(replay.static_outputs, fresh):
                dst.copy_(src)
            _, values = split_outputs(fresh, writebacks)
            write_back([self.read[1]], values)

    monkeypatch.setattr(cudagraphs, "capture", lambda fn: (_Graph(), fn()))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # fn(): uncaptured
    replay.warm = True
    return program, replay


def test_first_replay_is_checked_timed_and_mutates_once(monkeypatch):
    """Outputs checked, timing runs' mutations undone, the counter advanced exactly once."""
    from stitch_backend import cudagraphs

    _, replay = _counter_replay(monkeypatch)
    timed = []
    monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn: (fn(), timed.append(fn), 1.0)[-1])
    x, count = torch.randn(3), torch.zeros(())
    out = replay([x, count])
    assert len(timed) == 4 and replay.disabled is None     # equal times: replay stays on
    assert count.item() == 1.0                             # once, despite 5 extra runs
    torch.testing.assert_close(out, (x * 1.0,), rtol=0, atol=0)
    out = replay([x, count])
    assert count.item() == 2.0
    torch.testing.assert_close(out, (x * 2.0,), rtol=0, atol=0)


def _oom(*_a, **_k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.97 GiB. GPU 0 has a "
                                 "total capacity of 79.18 GiB of which 7.73 GiB is free.")


def test_a_first_replay_whose_timing_runs_out_of_memory_keeps_the_checked_replay(monkeypatch):
    """KernelBench L1 63 on an H100 (an 8 GiB output, a second backend held in the same
    process): the timing runs beside the graph's buffers ran out of memory, and the error
    reached the user's call. The replay was already checked: it stays, untimed, said so."""
    from stitch_backend import cudagraphs

    program, replay = _counter_replay(monkeypatch)
    monkeypatch.setattr(cudagraphs, "wall_ms", _oom)
    x, count = torch.randn(3), torch.zeros(())
    out = replay([x, count])
    torch.testing.assert_close(out, (x * 1.0,), rtol=0, atol=0)
    assert count.item() == 1.0 and replay.disabled is None
    assert any(n.startswith("replay kept without timing it against running uncaptured: out "
                            "of GPU memory") and "Tried to allocate 7.97 GiB" in n
               and "total capacity" not in n for n in program.notes_sink)
    torch.testing.assert_close(replay([x, count]), (x * 2.0,), rtol=0, atol=0)


def test_a_first_replay_whose_check_runs_out_of_memory_runs_uncaptured(monkeypatch):
    """The check's uncaptured run does not fit beside the graph's buffers: replay off (its
    buffers freed), the call runs uncaptured (NotCaptured), nothing mutated by the try."""
    from stitch_backend import cudagraphs

    program, replay = _counter_replay(monkeypatch)
    run_inputs = program.run_inputs
    calls = []

    def oom_once(inputs, *a, **k):
        calls.append(1)
        if len(calls) == 2:          # the capture's own run first, then the check's
            _oom()
        return run_inputs(inputs, *a, **k)

    monkeypatch.setattr(program, "run_inputs", oom_once)
    x, count = torch.randn(3), torch.zeros(())
    with pytest.raises(cudagraphs.NotCaptured, match="out of GPU memory for the first replay"):
        replay([x, count])
    assert count.item() == 0.0 and replay.graph is None and replay.static_outputs is None
    assert replay.disabled.startswith("out of GPU memory for the first replay's check")
    with pytest.raises(cudagraphs.NotCaptured):    # for good: the Program runs uncaptured
        replay([x, count])


def test_a_replayed_program_drawing_random_numbers_draws_what_eager_would(monkeypatch):
    """Dropout in a replayed Program, on the CPU with the CPU generator standing in for
    CUDA's: the capture's run, the first replay's reference run and the timing runs
    leave the generator alone, so each call's mask is the one eager draws at that point
    of a seeded run, and the generator ends where eager's calls leave it."""
    from stitch_backend import cudagraphs, rng
    from stitch_backend.agents.planner import partition
    from stitch_backend.program import Program

    def f(x):
        return (F.dropout(x, 0.5, True) * 2,)

    functional = make_fx(f)(torch.randn(64))
    program = Program(functional, partition(functional, graph_name="g"))
    assert cudagraphs.draws_random(functional)
    replay = cudagraphs.GraphReplay(program, set(), random=True)

    class _Graph:
        def __init__(self):   # what the capture read (in place or the graph's copies)
            self.read = list(replay.static_inputs)

        def replay(self):  # as a CUDA graph does: draws from the generator as it is now
            for dst, src in zip(replay.static_outputs, program.run_inputs(self.read)):
                dst.copy_(src)

    monkeypatch.setattr(cudagraphs, "capture", lambda fn: (_Graph(), fn()))
    monkeypatch.setattr(rng, "rng_state",
                        lambda active=True: torch.get_rng_state() if active else None)
    monkeypatch.setattr(rng, "rng_set",
                        lambda state: None if state is None else torch.set_rng_state(state))
    monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn: (fn(), 1.0)[-1])
    x = torch.randn(64)
    torch.manual_seed(0)
    expected = [f(x)[0] for _ in range(3)]
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    replay.warm = True
    got = [replay([x])[0].clone() for _ in range(3)]
    assert replay.disabled is None and replay.checked
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert not torch.equal(got[0], got[1])
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_outputs_handed_over_keep_eagers_strides():
    """A replay's outputs are copies; a view with gaps keeps its strides (a contiguous
    copy failed the stride check on KernelBench L3 Mamba2ReturnFinalState), an expanded
    output (overlapping elements) is copied densely, containers keep their type."""
    from stitch_backend.replay_outputs import _clone

    wide = torch.randn(2, 8, 64, 48)
    gappy = wide[..., 16:32]                       # strides (24576, 3072, 48, 1)
    expanded = torch.randn(4, 1).expand(4, 5)
    out = _clone((gappy, [expanded, 3]))
    assert isinstance(out, tuple) and isinstance(out[1], list) and out[1][1] == 3
    assert out[0].stride() == gappy.stride() and torch.equal(out[0], gappy)
    assert out[0].data_ptr() != gappy.data_ptr()
    assert torch.equal(out[1][0], expanded) and out[1][0].is_contiguous()


def test_overlap_detection():
    from stitch_backend.replay_outputs import _overlapping

    assert not _overlapping(torch.randn(3, 4)[:, 1:3])
    assert not _overlapping(torch.randn(3, 4).t())
    assert _overlapping(torch.randn(3, 1).expand(3, 4))
    assert _overlapping(torch.randn(10).as_strided((3, 3), (2, 1)))   # rows share elements
    assert not _overlapping(torch.randn(1, 5)[:, :1])


def test_where_uncaptured_wins_the_graph_also_races_aten_alone(monkeypatch):
    """Replay off, then the Program uncaptured against every region on ATen: the
    generated kernels are set aside only where ATen alone is faster, and the notes say
    which three times decided it."""
    from stitch_backend import cudagraphs

    class _Program:
        writebacks: list = []

        def __init__(self):
            self.notes_sink: list[str] = []
            self.aten_reason = None

        def generated_steps(self):
            return ["a kernel"]

        def use_aten(self, reason):
            self.aten_reason = reason

    for times_ms, aten_used in [((9.0, 3.0, 2.5), True), ((9.0, 3.0, 3.5), False)]:
        times = iter((9.0, 3.0) + times_ms)
        monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn: next(times))
        program = _Program()
        why = cudagraphs.GraphReplay(program, set())._slower_than_uncaptured([], [])
        assert why.startswith("slower than running uncaptured")
        assert program.notes_sink == [
            f"one call: 9.000 ms replayed, 3.000 ms uncaptured, {times_ms[2]:.3f} ms uncaptured "
            "on ATen alone (wall clock, best of two medians of 5, on the first replay)"]
        assert (program.aten_reason is not None) == aten_used
        if aten_used:
            assert program.aten_reason.startswith("the whole graph ran faster on ATen alone "
                                                  "(2.500 ms vs 3.000 ms")
    times = iter((1.0, 3.0, 1.0, 3.0))             # replay wins: ATen alone is not timed
    monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn: next(times))
    program = _Program()
    assert cudagraphs.GraphReplay(program, set())._slower_than_uncaptured([], []) is None
    assert program.aten_reason is None


def test_a_program_runs_on_aten_alone_when_asked_and_can_give_up_its_kernels():
    from stitch_backend.agents.planner import partition
    from stitch_backend.program import Program

    gm = make_fx(lambda x: (torch.sin(x) * 2.0,))(torch.randn(5))
    plan = partition(gm, graph_name="g")
    rid = plan.regions[0].id
    wrong = lambda *a: [torch.zeros(5)]            # a stand-in "kernel", told apart by its output
    program = Program(gm, plan, implementations={rid: wrong})
    x = torch.randn(5)
    assert [s.region.id for s in program.generated_steps()] == [rid]
    assert torch.equal(program.run_inputs([x])[0], torch.zeros(5))
    torch.testing.assert_close(program.run_inputs([x], on_aten=True)[0], torch.sin(x) * 2.0)
    program.use_aten("measured slower in context")
    assert program.generated_steps() == []
    assert program.steps[0].region.backend == "aten"
    assert program.steps[0].region.reason == "measured slower in context"
    assert program.notes_sink == ["every region on ATen: measured slower in context"]
    torch.testing.assert_close(program.run_inputs([x])[0], torch.sin(x) * 2.0)


def _moved_check(device):
    """GraphReplay._params_moved over inputs on ``device``: static inputs 0 and 2."""
    from stitch_backend.cudagraphs import GraphReplay

    replay = GraphReplay(program=None, static_indices={2, 0})
    inputs = [torch.zeros(3, device=device), torch.zeros(2, device=device), 7,
              torch.ones(4, device=device)]
    inputs[2] = torch.ones(5, device=device)
    replay.captured_ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None
                            for x in inputs]
    assert not replay._params_moved(inputs)
    moved = list(inputs)
    moved[1] = torch.zeros(2, device=device)         # not static: a copy-in, not a move
    assert not replay._params_moved(moved)
    moved[2] = torch.ones(5, device=device)          # a parameter now lives elsewhere
    assert replay._params_moved(moved)


def test_a_parameter_that_moved_is_seen(monkeypatch):
    from stitch_backend import cudagraphs

    monkeypatch.setattr(cudagraphs, "_PTRS_EQUAL", None)    # the Python loop
    _moved_check("cpu")


@pytest.mark.gpu
def test_a_parameter_that_moved_is_seen_by_torchs_pointer_check():
    """The C++ check of torch's CUDA builds, with the arguments this module passes."""
    from stitch_backend import cudagraphs

    assert cudagraphs._PTRS_EQUAL is not None
    _moved_check("cuda")


def _handing_replay(outputs):
    """A GraphReplay whose 'graph' produced ``outputs`` (the handover logic alone)."""
    from types import SimpleNamespace

    from stitch_backend.cudagraphs import GraphReplay, _tensors

    replay = GraphReplay(SimpleNamespace(notes_sink=[], writebacks=[],
                                         plan=SimpleNamespace(graph_name="g")), set())
    replay._own = outputs
    replay._flat_own = _tensors(outputs)
    return replay


def test_outputs_nobody_holds_are_reused_and_kept_ones_moved_out():
    """A replay hands over aliases of the graph's buffers. Before the next replay: a
    dropped output lets the graph overwrite its buffer; a kept one (the tensor itself,
    or inside the container the call returned) is moved to memory of its own with its
    values, sizes and strides; a kept view of one (which cannot be moved) tells the
    caller to leave the buffers to it. (A Python storage object alone is not counted by
    torch's storage reference count: cudagraphs.py's docstring says so.)"""
    own = [torch.arange(12.0).view(3, 4).t(), torch.ones(5)]
    replay = _handing_replay(own)
    out = replay._hand_over()
    assert out[0].data_ptr() == own[0].data_ptr() and out[0].stride() == own[0].stride()
    del out
    assert replay._release_outputs() and replay.reused == 1 and replay.moved == 0

    out = replay._hand_over()
    first = out[0]
    assert replay._release_outputs() and replay.moved == 2    # both: the list is held too
    assert first.data_ptr() != own[0].data_ptr() and first.stride() == own[0].stride()
    own[0].fill_(-1.0)                                         # the graph's next replay
    assert torch.equal(first, torch.arange(12.0).view(3, 4).t())
    assert torch.equal(out[1], torch.ones(5))
    del out, first

    out = replay._hand_over()
    row = out[1][1:3]                                          # a view: cannot be moved
    del out
    assert not replay._release_outputs()
    del row
    out = replay._hand_over()
    del out
    assert replay._release_outputs()


def test_a_kept_expanded_output_is_moved_out_dense():
    own = [torch.randn(4, 1).expand(4, 5)]
    replay = _handing_replay(own)
    out = replay._hand_over()
    assert replay._release_outputs() and replay.moved == 1
    assert out[0].is_contiguous() and torch.equal(out[0], own[0])
    assert out[0].data_ptr() != own[0].data_ptr()


def test_kept_inference_tensors_are_moved_out_too():
    with torch.inference_mode():
        own = [torch.randn(4, 4)]
    replay = _handing_replay(own)
    out = replay._hand_over()
    assert out[0].is_inference()
    assert replay._release_outputs() and replay.moved == 1
    assert out[0].data_ptr() != own[0].data_ptr() and torch.equal(out[0], own[0])


def _as_training_forward(w: torch.Tensor, out: torch.Tensor, saved: torch.Tensor):
    """What AOTAutograd does with a replayed training forward's outputs: ``out`` becomes
    the op's output (autograd gives that very tensor its grad_fn) and ``saved`` its
    saved activation (kept as the tensor itself, not an output of the op)."""

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            ctx.save_for_backward(saved)
            return out

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return g * a

    return Forward.apply(w)


def test_outputs_autograd_saved_or_tracks_are_moved_out_before_their_backward():
    """A training step's second forward before the first's backward: the first
    forward's output (which requires grad) and its saved activation are moved out of
    the graph's buffers; the backward then passes autograd's in-place check and reads
    the moved values, though the graph has overwritten its buffers since."""
    own = [torch.tensor([0.5, 0.25, 2.0]), torch.tensor([1.0, 2.0, 3.0])]
    replay = _handing_replay(own)
    handed = replay._hand_over()
    w = torch.ones(3, requires_grad=True)
    y = _as_training_forward(w, handed[0], handed[1])
    assert y is handed[0] and y.requires_grad
    del handed
    assert replay._release_outputs() and replay.moved == 2
    for buf in own:   # the next replay overwrites the buffers, unseen by autograd
        buf.data.fill_(-7.0)
    assert torch.equal(y, torch.tensor([0.5, 0.25, 2.0]))
    y.sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 2.0, 3.0]))


def test_after_views_were_kept_twice_outputs_are_cloned(monkeypatch):
    """Each time a held view stops the graph from overwriting its buffers, the graph is
    left to it and captured again; the second time, outputs are cloned from then on."""
    own = [torch.randn(6)]
    replay = _handing_replay(own)
    captured = []
    monkeypatch.setattr(replay, "_capture", lambda inputs: captured.append(inputs))
    for _ in range(2):
        from stitch_backend.cudagraphs import _tensors
        replay._own, replay._flat_own = own, _tensors(own)
        view = replay._hand_over()[0][1:]
        assert not replay._release_outputs()
        replay._abandon(["x"])
        del view
    assert captured == [["x"], ["x"]] and replay.clone_outputs
    assert any("cloned from now on" in n for n in replay.program.notes_sink)
    again = [n for n in replay.program.notes_sink if n.startswith("CUDA graph captured again")]
    assert len(again) == 2 and "still held through a view" in again[0], again
    replay._own = own
    out = replay._hand_over()
    assert out[0].data_ptr() != own[0].data_ptr() and torch.equal(out[0], own[0])


def test_outputs_that_are_inputs_become_views_of_the_callers_inputs():
    """A training forward returns its batch and weights for the backward: at capture
    they are found by storage among the graph's inputs, and each call hands over views
    of the caller's tensors (sizes, strides and offset kept), never the graph's copy."""
    from stitch_backend.cudagraphs import _with_input_views, input_views

    weight = torch.randn(4, 3)
    static_x = torch.randn(6, 4)                         # the graph's copy of the batch
    own = torch.randn(5)                                 # a buffer of the graph's
    outputs = [own, static_x[2:], weight, weight.t()]
    views = input_views(outputs, [static_x, weight])
    assert views == {1: (0, (4, 4), (4, 1), 8), 2: (1, (4, 3), (3, 1), 0),
                     3: (1, (3, 4), (1, 3), 0)}
    base = torch.randn(100)
    caller_x = base[10:34].view(6, 4)                    # the caller's batch, offset 10
    caller_w = weight.clone().requires_grad_(True)
    got = _with_input_views((outputs[0], [outputs[1], outputs[2]], outputs[3]), views,
                            [caller_x, caller_w])
    assert got[0] is own
    assert got[1][0].data_ptr() == caller_x[2:].data_ptr()
    assert torch.equal(got[1][0], caller_x[2:])
    assert got[1][1].data_ptr() == caller_w.data_ptr() and not got[1][1].requires_grad
    assert torch.equal(got[2], caller_w.detach().t())
