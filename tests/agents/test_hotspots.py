"""The Planner's profile: regions timed on ATen at the first call, ranked, shown in the
report, and used to send the LLM Coder to the slowest regions first."""

from __future__ import annotations

import pytest
import torch

from stitch_backend.agents.hotspots import Hotspots, measure
from stitch_backend.backend import StitchBackend

OPTIONS = {"cpu_interpret": True, "require_speedup": False}


def test_ranking_is_slowest_first_and_ties_keep_graph_order():
    spots = Hotspots(clock="host", ms={0: 1.0, 1: 5.0, 2: 1.0, 3: 3.0})
    assert spots.total_ms == pytest.approx(10.0)
    assert spots.ranked() == [1, 3, 0, 2]
    assert spots.ranked(among=[2, 0, 3, 9]) == [3, 0, 2]
    assert spots.share(1) == pytest.approx(0.5) and spots.share(9) == 0.0
    assert Hotspots(clock="host", ms={0: 0.0}).share(0) == 0.0


def test_hottest_covers_the_fraction_of_the_chosen_regions_time():
    spots = Hotspots(clock="host", ms={0: 2.0, 1: 60.0, 2: 8.0, 3: 30.0})
    assert spots.hottest([0, 1, 2, 3], 0.9) == [1, 3]          # 90 of 100
    assert spots.hottest([0, 1, 2, 3], 0.91) == [1, 3, 2]
    assert spots.hottest([0, 1, 2, 3], 1.0) == [1, 3, 2, 0]
    assert spots.hottest([0, 2], 0.5) == [2]                   # of the time of 0 and 2 alone
    assert spots.hottest([0, 1], 0.01) == [1]                  # never empty
    assert spots.hottest([], 0.9) == []


def _program(sizes=(384, 8)):
    """A Program of an inference graph with a slow region (a large matmul chain) and a
    fast one (a small add), on ATen."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.agents.planner import partition
    from stitch_backend.program import Program

    big, small = sizes

    def fn(a, b, c):
        return (torch.mm(torch.mm(a, b), b), c + 1.0)

    inputs = [torch.randn(big, big), torch.randn(big, big), torch.randn(small)]
    gm = make_fx(fn)(*inputs)
    plan = partition(gm, "g")
    return Program(gm, plan), plan, inputs, fn


def test_measure_times_every_region_and_finds_the_slow_one():
    program, plan, inputs, fn = _program()
    kept = [x.clone() for x in inputs]
    spots = measure(program, inputs)
    assert spots.clock == "host"
    assert set(spots.ms) == {r.id for r in plan.regions}
    assert all(ms >= 0 for ms in spots.ms.values())
    slow = [r.id for r in plan.regions if any("mm" in op for op in r.ops)]
    assert slow and spots.ranked()[0] in slow
    for x, y in zip(inputs, kept):   # inputs neither consumed nor changed
        assert torch.equal(x, y)


def test_first_call_keeps_aten_times_in_the_regions_and_the_report():
    torch.manual_seed(0)

    def fn(a, b, c):
        return torch.relu(torch.mm(a, b)) * 2.0, torch.softmax(c * 3.0, -1)

    a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.randn(4, 8)
    backend = StitchBackend(options=OPTIONS)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad():
        got = compiled(a, b, c)
    for x, y in zip(got, fn(a, b, c)):
        torch.testing.assert_close(x, y)
    (rec,) = backend.records
    timed = [r for r in rec.plan.regions if r.aten_ms is not None]
    assert timed and len(timed) == len(rec.plan.regions)
    report = backend.report()
    assert "hotspots: " in report and "of ATen time" in report
    slowest = max(timed, key=lambda r: r.aten_ms)
    assert f"slowest regions [{slowest.id}] " in report
    # kept with the plan, so a cache entry and ``explain --json`` carry it
    data = rec.to_dict()
    assert all(r["aten_ms"] is not None for r in data["regions"])


def test_llm_coder_takes_the_hottest_regions_slowest_first(monkeypatch):
    from types import SimpleNamespace

    from stitch_backend import config as config_mod
    from stitch_backend.agents import llm_extras
    from stitch_backend.agents.state import Task, Trajectory

    cfg = config_mod.Config().with_options({"coder": "template+llm",
                                            "llm_base_url": "http://127.0.0.1:9",
                                            "llm_model": "m", "llm_hot_percent": 80})
    templates = {rid: SimpleNamespace(stages=None, kernel=object(), alternatives=[])
                 for rid in (0, 2, 5, 7)}
    templates[9] = SimpleNamespace(stages=[], kernel=None, alternatives=[])  # staged: not eligible
    subtasks = {rid: object() for rid in templates}
    asked = []
    monkeypatch.setattr(llm_extras, "llm_candidates",
                        lambda *a, regions, **k: asked.append(list(regions)) or {})
    notes: list[str] = []
    task = Task(graph="g", key="k" * 64, arch="sm_90a", device="cuda")
    hook = llm_extras.first_call_extras(task, subtasks, templates, arch="sm_90a", cfg=cfg,
                                        trajectory=Trajectory(task=task), notes=notes)
    assert hook is not None
    spots = Hotspots(clock="cuda-events", ms={0: 1.0, 2: 30.0, 5: 5.0, 7: 60.0, 9: 4.0})
    hook(spots)
    hook(spots)    # a new shape's verification does not ask again
    assert asked == [[7, 2]]          # 90 of the 96 ms the eligible regions take
    assert len(notes) == 1 and "2 of 4 region(s)" in notes[0] and "80%" in notes[0]
    # without a profile: every eligible region, in graph order
    asked.clear()
    hook = llm_extras.first_call_extras(task, subtasks, templates, arch="sm_90a", cfg=cfg,
                                        trajectory=Trajectory(task=task), notes=notes)
    hook(None)
    assert asked == [[0, 2, 5, 7]]
    # not asked for: no hook
    assert llm_extras.first_call_extras(task, subtasks, templates, arch="sm_90a",
                                        cfg=config_mod.Config(), trajectory=None,
                                        notes=notes) is None


def test_hot_percent_is_checked():
    from stitch_backend import config as config_mod
    from stitch_backend.exc import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="percentage"):
        config_mod.Config().with_options({"llm_hot_percent": 0})
    assert config_mod.Config().with_options({"llm_hot_percent": "100"}).llm_hot_percent == 100
