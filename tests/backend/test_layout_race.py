"""The ``layout_race`` option: an inference convolution graph compiled in both layouts,
both Programs run until settled, then timed and the faster kept (on CPU through the
kernel-IR interpreter; the GPU test races real kernels)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from stitch_backend.backend import StitchBackend


class ConvBNNet(nn.Module):
    """Two convolutions with training BatchNorms (whose running statistics each call
    updates) and a dropout-free head: small enough for the CPU interpreter."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))

    def forward(self, x):
        return torch.relu(self.body(x) + 1.0).mean(dim=(2, 3))


def _raced(**options):
    """A training-mode ConvBNNet, its eager copy, a backend racing layouts on the CPU
    interpreter (plus ``options``), the compiled model and an input."""
    torch.manual_seed(0)
    model = ConvBNNet().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": True,
                                     **options})
    return model, reference, backend, torch.compile(model, backend=backend), \
        torch.randn(2, 3, 12, 12)


def test_race_compiles_both_layouts_and_keeps_one_with_eager_results():
    """Both layouts compiled (one record each, the traced layout under ``auto``'s rule
    and the forced rewrite), every call gives eager's outputs and applies the running
    statistics' update once, and after the race both records say which runs."""
    model, reference, backend, compiled, x = _raced()
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    assert sorted(r.layout_applied for r in backend.records) == [False, True]
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(model.body[1], name), getattr(reference.body[1], name))
    assert model.body[1].num_batches_tracked == reference.body[1].num_batches_tracked == 4
    kept = [any("layout race" in n and "this Program runs" in n for n in r.notes)
            for r in backend.records]
    assert sorted(kept) == [False, True], [r.notes for r in backend.records]


def test_the_eager_guard_above_a_race_waits_for_both_programs(monkeypatch):
    """With the eager guard on (CPU added to its devices), the guard sees both records,
    decides after the race, and every call still gives eager's result with one update
    of the running statistics."""
    from stitch_backend import eager_guard

    monkeypatch.setattr(eager_guard, "DEVICES", ("cuda", "cpu"))
    model, reference, backend, compiled, x = _raced(eager_guard=True)   # conftest: off
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    assert model.body[1].num_batches_tracked == reference.body[1].num_batches_tracked == 5
    torch.testing.assert_close(model.body[4].running_var, reference.body[4].running_var)
    notes = [n for r in backend.records for n in r.notes]
    assert any("this Program runs" in n for n in notes), notes
    assert any("eager guard" in n or "runs as Dynamo traced it" in n
               for n in notes + [r.reason or "" for rec in backend.records
                                 for r in rec.plan.regions]), notes


def test_a_race_that_fails_keeps_the_first_program_and_says_why(monkeypatch, caplog):
    """The timing raises: the first Program runs from then on, eager's results still,
    and a warning and both records' notes say why."""
    from stitch_backend import layout_race

    def broken(fn, runs=5):
        raise RuntimeError("timer broke")

    monkeypatch.setattr(layout_race.cudagraphs, "wall_ms", broken)
    model, reference, backend, compiled, x = _raced()
    with torch.no_grad(), caplog.at_level("WARNING", logger="stitch_backend.layout_race"):
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    why = "layout race: stopped (RuntimeError: timer broke); the traced layout kept"
    assert all(why in r.notes for r in backend.records), [r.notes for r in backend.records]
    assert any(why in m for m in caplog.messages), caplog.messages


def _layouts(model, x, **options):
    """The ``layout_applied`` of each record ``model``'s compile at ``x`` makes, and
    whether any note mentions the race."""
    torch._dynamo.reset()
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, **options})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    return ([r.layout_applied for r in backend.records],
            any("layout race" in n for r in backend.records for n in r.notes))


class ConvInstanceNorm(nn.Module):
    """A convolution then an instance norm: ``auto`` declines it for a reason that is
    not a guess."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8)

    def forward(self, x):
        return self.norm(self.conv(x))


def test_auto_races_only_where_the_positions_rule_declined():
    """By default ('auto') a graph kept in its traced layout for too few BatchNorm
    positions (ConvBNNet, 288 a channel) is raced; with the option off it is not; a
    graph kept for another of ``auto``'s reasons (an instance norm) is not either."""
    x = torch.randn(2, 3, 12, 12)
    assert _layouts(ConvBNNet().train(), x) == ([False, True], True)
    assert _layouts(ConvBNNet().train(), x, layout_race=False) == ([False], False)
    assert _layouts(ConvInstanceNorm().train(), x) == ([False], False)
    # without training BatchNorms 'auto' rewrites the graph, and nothing is raced
    assert _layouts(ConvBNNet().eval(), x) == ([True], False)


def test_auto_races_a_rewrite_that_turned_tf32_off(monkeypatch):
    """A rewrite whose convolution is as accurate channels-last only with cuDNN's TF32
    off (simulated on the CPU: noise on the TF32 NHWC result, the graph's outputs failing
    too) is raced against the traced layout, where the convolution runs as eager's."""
    from stitch_backend import layout
    from stitch_backend.graph_precision import GraphVerdict
    from tests.backend.test_layout import tf32_noisy

    tf32_noisy(monkeypatch)
    monkeypatch.setattr(layout, "outputs_hold", lambda *a, **kw: GraphVerdict(False, "test"))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 3, 12, 12)
    assert _layouts(model, x) == ([True, False], True)
    assert _layouts(model, x, layout_race=False) == ([True], False)


def test_no_race_where_the_other_layout_does_not_apply():
    """Grouped convolutions (several input channels a group) are not rewritten even when
    forced: one record, whose note says why the race did not run."""
    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=2), nn.ReLU()).eval()
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": True})
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    (rec,) = backend.records
    assert rec.layout_applied is False
    assert any(n.startswith("layout race: not run, the other layout does not apply")
               for n in rec.notes), rec.notes


def test_forced_layouts_are_not_raced():
    """``channels_last`` set by the user is a decision, not a guess: no race."""
    model = ConvBNNet().train()
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": True,
                                     "channels_last": True})
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 3, 12, 12))
    assert [r.layout_applied for r in backend.records] == [True]


@pytest.mark.gpu
def test_race_on_the_gpu_gives_eager_results():
    """On the GPU: both Programs verified and replayed, the race decided within the
    first calls, and every call eager's result."""
    torch.manual_seed(0)
    model = ConvBNNet().cuda().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cache": False, "layout_race": True})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(10):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    notes = [n for r in backend.records for n in r.notes if "layout race" in n]
    assert any("this Program runs" in n for n in notes), notes


def test_a_later_process_builds_the_remembered_winner_alone(tmp_path):
    """The race's verdict goes into the cache's notes; a later compile of the same graph
    (same options, device and versions) builds the winner's layout alone, says so, and
    gives eager's results; a different input shape is raced again."""
    from stitch_backend import layout_race

    options = {"cpu_interpret": True, "cache": True, "cache_dir": str(tmp_path),
               "require_speedup": False}
    model, reference, backend, compiled, x = _raced(**options)
    with torch.no_grad():
        for _ in range(4):
            compiled(x)
    (won,) = [r.layout_applied for r in backend.records
              if any("this Program runs" in n for n in r.notes)]
    assert len(list((tmp_path / "notes" / layout_race.NOTE_KIND).iterdir())) == 1

    torch._dynamo.reset()
    again = StitchBackend(options={**options, "layout_race": None})
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=again)(x), reference(x),
                                   rtol=1e-4, atol=1e-4)
    (rec,) = again.records
    assert rec.layout_applied is won
    assert any(n.startswith("layout race: decided by an earlier process (the cache's "
                            "notes): ") for n in rec.notes), rec.notes
    assert _layouts(ConvBNNet().train(), torch.randn(2, 3, 10, 10),
                    cache=True, cache_dir=str(tmp_path)) == ([False, True], True)


@pytest.mark.gpu
def test_on_the_gpu_a_remembered_race_builds_one_program(tmp_path):
    """On the GPU: the race decides and stores its verdict; a second compile (a new
    process, as far as the backend knows) builds the winner alone, with eager's values."""
    torch.manual_seed(0)
    model = ConvBNNet().cuda().train()
    reference = copy.deepcopy(model)
    options = {"cache": True, "cache_dir": str(tmp_path)}
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        first = StitchBackend(options=options)
        compiled = torch.compile(model, backend=first)
        for _ in range(10):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
        (won,) = [r.layout_applied for r in first.records
                  if any("this Program runs" in n for n in r.notes)]
        torch._dynamo.reset()
        again = StitchBackend(options=options)
        compiled = torch.compile(model, backend=again)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    (rec,) = again.records
    assert rec.layout_applied is won
    assert any("decided by an earlier process" in n for n in rec.notes), rec.notes


def test_no_race_where_two_programs_may_not_fit(monkeypatch):
    """Where the traced graph's peak is above the share of free memory the race may
    take (simulated on the CPU: a tiny 'free memory'), one Program is built and its
    note says why the race did not run."""
    from stitch_backend import layout_race

    monkeypatch.setattr(layout_race, "free_bytes", lambda metas: 1024)
    model, _, backend, compiled, x = _raced(layout_race=None)
    with torch.no_grad():
        compiled(x)
    (rec,) = backend.records
    assert any(n.startswith("layout race: not run, the graph's peak (") for n in rec.notes), \
        rec.notes
