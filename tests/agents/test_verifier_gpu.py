"""On a GPU: the Verifier's clocks. Graph timing measures GPU time of both sides as CUDA
graph replays, and falls back to CUDA events for both when either cannot be captured."""

from __future__ import annotations

import pytest
import torch

from stitch_backend.agents.verifier import Verifier, VerifySettings

pytestmark = pytest.mark.gpu


def _settings(graph: bool) -> VerifySettings:
    return VerifySettings(graph_timing=graph, warmup=2, runs=5, require_speedup=False)


def test_graph_timing_times_both_sides_as_replays():
    x = torch.randn(1 << 20, device="cuda")
    v = Verifier(_settings(True)).check(lambda t: [t * 2], lambda t: [t + t], [x])
    assert v.ok and v.clock == "cuda-graph", v.reason
    assert v.candidate_ms > 0 and v.eager_ms > 0
    assert "cuda-graph" in v.reason


def test_an_uncapturable_side_falls_back_to_events_for_both():
    x = torch.randn(1024, device="cuda")

    def syncs(t):  # .item() synchronises: not allowed while capturing
        return [t * (2.0 if t.sum().item() > -1e30 else 1.0)]

    v = Verifier(_settings(True)).check(syncs, lambda t: [t + t], [x])
    # the clock names why graph timing was not used (no silent fallback)
    assert v.ok and v.clock.startswith("cuda-events: graph timing failed"), v.reason
    assert v.clock in v.reason
    # the process's CUDA state survived the failed capture, random ops included
    assert torch.equal((x * 2).cpu(), (x + x).cpu())
    torch.manual_seed(0)
    a = torch.randn(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn(8, device="cuda"))


def test_without_graph_timing_events_are_used():
    x = torch.randn(4096, device="cuda")
    v = Verifier(_settings(False)).check(lambda t: [t * 2], lambda t: [t + t], [x])
    assert v.clock == "cuda-events"


def test_fresh_draws_are_made_on_the_inputs_device():
    from stitch_backend.agents.verifier import DeviceGenerators, fresh_draw

    x = torch.randn(1 << 20, device="cuda")
    idx = torch.arange(100, device="cuda")
    state = torch.cuda.get_rng_state()
    a = fresh_draw([x, idx], DeviceGenerators(7))
    b = fresh_draw([x, idx], DeviceGenerators(7))
    assert all(t.is_cuda for t in a)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], x)
    assert torch.equal(a[1].sort().values, idx)
    assert torch.equal(torch.cuda.get_rng_state(), state)   # the user's generator untouched
