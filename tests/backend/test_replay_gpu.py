"""On a GPU: replayed Programs write mutated inputs back exactly once a call, and replay
turns itself off where it is slower than running uncaptured."""

from __future__ import annotations

import copy

import pytest
import torch

from stitch_backend import cudagraphs
from stitch_backend.backend import StitchBackend
from tests.backend.test_mutations import _Counting

pytestmark = pytest.mark.gpu


def _replay_notes(backend):
    """The replay notes of every record (two where the layouts were raced)."""
    assert backend.records
    return [n for rec in backend.records for n in rec.notes
            if "replay" in n or "uncaptured" in n]


def test_replayed_training_mode_batchnorm_updates_its_statistics_once_a_call():
    """KernelBench's way (training mode under no_grad): running statistics and the step
    counter are written inside the CUDA graph; a user input mutated in place after it."""
    torch.manual_seed(0)
    model = _Counting().cuda().train()
    ref = copy.deepcopy(model)
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    acc, ref_acc = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    with torch.no_grad():
        for _ in range(6):   # verification, warm-up, first replay (checked, timed), replays
            x = torch.randn(2, 3, 8, 8, device="cuda")
            torch.testing.assert_close(compiled(x, acc), ref(x, ref_acc), atol=1e-4, rtol=1e-4)
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 6
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    torch.testing.assert_close(acc, ref_acc)
    notes = _replay_notes(backend)
    assert any(n.startswith("CUDA graph replay on") for n in notes), notes
    assert any(n.startswith("one call:") for n in notes), notes   # the first replay was timed
    assert not any("differed" in n or "capture failed" in n for n in notes), notes


def test_replay_is_turned_off_where_copies_cost_more_than_launches(monkeypatch):
    """One pointwise kernel over 1 GiB, a new input each call (all held, so none lands
    where the last one was): once the input moves, a replay adds a 1 GiB copy in, and
    the re-timed first replay of the copying graph turns replay off. The first replay
    (reading its input in place: one kernel either way) is timed as a tie, so that the
    test reaches the copies: under 8 test processes on an H200 it timed 1.285 ms
    replayed against 1.196 uncaptured and replay went off before any input moved."""
    model = torch.nn.Hardtanh().cuda()
    backend = StitchBackend()
    real_wall_ms = cudagraphs.wall_ms

    def tie_until_copied(fn, runs=5):
        if any("inputs copied in" in n for n in _all_notes(backend)):
            return real_wall_ms(fn, runs)
        fn()
        return 1.0
    monkeypatch.setattr(cudagraphs, "wall_ms", tie_until_copied)
    compiled = torch.compile(model, backend=backend)
    xs = [torch.randn(256 * 2**20, device="cuda") for _ in range(4)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
    for x, y in zip(xs, outs):
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    notes = _replay_notes(backend)
    assert any("inputs copied in" in n for n in _all_notes(backend)), _all_notes(backend)
    assert any("replay off: slower than running uncaptured" in n for n in notes), notes


def _replay_kept(monkeypatch):
    """Every timing of replay against uncaptured calls a tie: the replay stays on."""
    monkeypatch.setattr(cudagraphs, "wall_ms", lambda fn, runs=5: (fn(), 1.0)[1])


def _all_notes(backend):
    return [n for rec in backend.records for n in rec.notes]


def test_an_input_passed_at_one_address_is_read_in_place(monkeypatch):
    """The same input tensor every call (changed in place between calls), then new ones:
    each result is eager's; the replay read the first in place, copied the moved ones in,
    and read them in place again once they stayed put."""
    _replay_kept(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 32)).cuda().eval()
    backend = StitchBackend(options={"eager_guard": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            x.mul_(1.5)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        (rec,) = backend.records
        replay = rec.program.replay
        assert replay is not None and replay.graph is not None, rec.notes
        assert replay.direct and not replay._copied, (replay.direct, rec.notes)
        ys = [torch.randn(16, 64, device="cuda") for _ in range(2)]
        for y in ys:                                  # moved: copied in
            torch.testing.assert_close(compiled(y), model(y), atol=1e-4, rtol=1e-4)
        assert replay.direct == set() and replay._copied, rec.notes
        z = torch.randn(16, 64, device="cuda")
        for _ in range(cudagraphs.STABLE_CALLS + 1):  # stays put: read in place again
            z.add_(0.25)
            torch.testing.assert_close(compiled(z), model(z), atol=1e-4, rtol=1e-4)
        assert replay.direct and replay.direct_returns == 1, rec.notes
        assert replay.disabled is None, rec.notes


class _SlicedState(torch.nn.Module):
    """Returns a slice of a wider intermediate, as KernelBench's Mamba2 final state is:
    eager's output is a view with gaps in its strides."""

    def forward(self, x):
        y = torch.tanh(x) * 2.0
        return y[..., 16:32], y.sum(-1)


def test_replayed_outputs_keep_eagers_strides():
    model = _SlicedState().cuda()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8, 64, 48, device="cuda")
            got, ref = compiled(x), model(x)
            for g, r in zip(got, ref):
                assert g.stride() == r.stride() and g.shape == r.shape
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert any(n.startswith("CUDA graph replay on") for n in _replay_notes(backend))


def test_replayed_outputs_are_handed_over_without_a_copy_unless_kept(monkeypatch):
    """A loop that drops each result gets the graph's buffers with no copy; results kept
    across calls are moved to memory of their own first; a kept view of one (which
    cannot be moved) makes the Program capture again; each value stays eager's."""
    _replay_kept(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 32)).cuda().eval()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    xs = [torch.randn(16, 64, device="cuda") for _ in range(8)]
    with torch.no_grad():
        for x in xs:                                   # results dropped at once
            torch.testing.assert_close(compiled(x).sum(), model(x).sum(), atol=1e-3, rtol=1e-4)
        (rec,) = backend.records
        replay = rec.program.replay
        assert replay is not None and replay.graph is not None, rec.notes
        # (the first replay's outputs were held while it timed further replays: moved)
        reused, moved = replay.reused, replay.moved
        for x in xs[:4]:
            torch.testing.assert_close(compiled(x).sum(), model(x).sum(), atol=1e-3, rtol=1e-4)
        assert (replay.reused, replay.moved) == (reused + 4, moved)
        moved = replay.moved
        kept = [compiled(x) for x in xs]               # results kept
        assert replay.moved - moved == len(xs) - 1
        views = [compiled(x)[:, :4] for x in xs[:2]]   # views of results kept
        assert replay.abandoned >= 1
        for x, y in zip(xs, kept):
            torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
        for x, v in zip(xs, views):
            torch.testing.assert_close(v, model(x)[:, :4], atol=1e-4, rtol=1e-4)
    assert len({y.data_ptr() for y in kept}) == len(kept)


def test_a_training_step_is_replayed_though_cudnn_adds_in_varying_order():
    """cudagraphs_training: a conv net's backward (cuDNN's weight gradient is not bit for
    bit repeatable) keeps its replay, judged by tolerance against an uncaptured run; its
    forward, which returns its input and weights for the backward, is captured too
    (handing over views of the caller's tensors); every step's gradients stay eager's
    (a new batch each step: a saved input must be this step's, not the graph's copy),
    judged by DESIGN.md's rule against an fp64 copy: on the H100 (first run of this test)
    the first conv's weight gradient differed from eager's by up to 0.004 at 16 of 9216
    elements, every run alike (TF32 convolutions, and our BatchNorm backward summing in
    another order), beyond a fixed 1e-3. The first conv has no bias: ahead of a training
    BatchNorm its gradient is zero in exact arithmetic, so any fp32 value is rounding noise
    and no relative rule can judge it (the second run on the H100 failed on just that)."""
    from stitch_backend.correctness import compare

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU()).cuda()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    backend = StitchBackend(options={"cudagraphs_training": True, "eager_guard": False})
    compiled = torch.compile(model, backend=backend)
    for step in range(6):   # verification, warm-up, first replay (checked, timed), replays
        x = torch.randn(8, 16, 32, 32, device="cuda")
        for m in (model, ref, ref64):
            m.zero_grad(set_to_none=True)
        compiled(x).square().sum().backward()
        ref(x).square().sum().backward()
        ref64(x.double()).square().sum().backward()
        grads = [[p.grad for p in m.parameters()] for m in (model, ref, ref64)]
        cmp = compare(*grads)
        assert cmp.ok_design, f"step {step}: {cmp.reason}"
    backward = next(r for r in backend.records if r.stage == "backward")
    replay = backward.program.replay
    # captured and its first replay judged correct; it may then lose on time alone (an
    # H100 under 8 test processes timed 0.630 ms replayed against 0.571 ms uncaptured)
    assert replay is not None and replay.captures >= 1, backward.notes
    assert replay.disabled is None or replay.disabled.startswith(
        "slower than running uncaptured"), backward.notes
    # the forward returns its input and weights for the backward: captured all the same
    forward = next(r for r in backend.records if r.stage == "forward")
    assert forward.program.replay is not None, forward.notes
    assert forward.program.replay.captures >= 1, forward.notes


def test_two_replayed_forwards_before_their_backwards_keep_eagers_gradients(monkeypatch):
    """A siamese step (the model run on two batches, one backward of both): the second
    forward's replay finds the first's outputs and saved activations still held. They
    are moved out of the graph's buffers (autograd's version counters kept), so both
    backwards read their own forward's values, and the graph is not captured again."""
    # among 8 test processes sharing the GPU, a 0.2 ms call once timed 3.3 ms replayed
    # against 3.2 uncaptured and replay went off
    _replay_kept(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1)).cuda()   # its output is not saved
    ref = copy.deepcopy(model)
    backend = StitchBackend(options={"cudagraphs_training": True, "eager_guard": False})
    compiled = torch.compile(model, backend=backend)
    for _ in range(6):
        a, b = (torch.randn(4, 16, 16, 16, device="cuda") for _ in range(2))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        ya, yb = compiled(a), compiled(b)
        ra, rb = ref(a), ref(b)
        torch.testing.assert_close(ya, ra, atol=1e-4, rtol=1e-4)
        (ya.square().sum() + (yb * 2).sum()).backward()
        (ra.square().sum() + (rb * 2).sum()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-3)
    forward = next(r for r in backend.records if r.stage == "forward")
    replay = forward.program.replay
    assert replay is not None and replay.disabled is None, forward.notes
    assert replay.moved > 0 and replay.abandoned == 0, (replay.moved, replay.abandoned,
                                                         forward.notes)
