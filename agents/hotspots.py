"""The Planner's profile: how long each region takes on ATen, measured on the real inputs
of the Program's first call, and the ranking that follows from it.

The Plan is made at compile time, where AOTAutograd hands over fake tensors; the first
call has real ones. Before any candidate is judged, the Program runs on ATen once to warm
up (lazy module loading, cuDNN's algorithm search, the allocator) and then ``runs`` more
times, timed. On CUDA an event is recorded on the current stream after every step, so a
region's time is its work in the stream as the graph really runs (launch gaps included
where the host is the bottleneck); elsewhere the host clock times each step. A region's
time is the least of its timed runs. Nothing is written back (the Program's input
mutations stay outputs until ``Program.finish_call``); the caller puts the random-number
state back (``acceptance`` does, so the user's generator advances as in eager).

Events between steps rather than ``torch.profiler``: the profiler attributes kernels to
ATen ops, which would then have to be mapped back to regions, and it would clash with a
profiling session of the user's own; an event between steps attributes by construction.

What uses it: each region's ``aten_ms`` (the report's share of the graph, kept in the
cache entry with the plan), and the LLM Coder (``llm_extras``), which works on the
hottest regions first and leaves out those outside the hottest ``llm_hot_fraction`` of
the graph's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

# Timed runs after the warm-up; a region's time is the least of them.
RUNS = 2


@dataclass(frozen=True)
class Hotspots:
    """Measured ATen time per region of one graph (milliseconds)."""

    clock: str                                        # "cuda-events" or "host"
    ms: dict[int, float] = field(default_factory=dict)  # region id -> time

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    def share(self, region_id: int) -> float:
        """The region's fraction of the graph's measured time (0 when nothing took time)."""
        total = self.total_ms
        return self.ms.get(region_id, 0.0) / total if total > 0 else 0.0

    def ranked(self, among: Sequence[int] | None = None) -> list[int]:
        """Region ids, slowest first (ties in graph order); ``among`` limits the ids."""
        ids = list(self.ms) if among is None else [i for i in among if i in self.ms]
        order = {rid: k for k, rid in enumerate(self.ms)}
        return sorted(ids, key=lambda rid: (-self.ms[rid], order[rid]))

    def hottest(self, among: Sequence[int], fraction: float) -> list[int]:
        """The slowest of ``among`` that together take at least ``fraction`` of the time
        all of ``among`` take, slowest first (all of them at ``fraction`` >= 1)."""
        ranked = self.ranked(among)
        total = sum(self.ms[rid] for rid in ranked)
        chosen: list[int] = []
        covered = 0.0
        for rid in ranked:
            if chosen and covered >= fraction * total:
                break
            chosen.append(rid)
            covered += self.ms[rid]
        return chosen


def measure(program: Any, inputs: Sequence[Any], *, runs: int = RUNS) -> Hotspots:
    """Time every step of ``program`` on ATen over ``inputs`` (not consumed): one warm-up
    run, then ``runs`` timed ones. Graphs that draw random numbers advance the generator."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
    best: dict[int, float] = {}
    for k in range(runs + 1):
        times = _cuda_run(program, inputs) if on_cuda else _host_run(program, inputs)
        if k == 0:
            continue
        for rid, ms in times.items():
            best[rid] = min(ms, best.get(rid, ms))
    return Hotspots(clock="cuda-events" if on_cuda else "host", ms=best)


def _cuda_run(program: Any, inputs: Sequence[Any]) -> dict[int, float]:
    marks: list[tuple[int, Any]] = []
    start = torch.cuda.Event(enable_timing=True)

    def tick(step: Any, _inputs: Any, _outs: Any) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((step.region.id, event))

    start.record()
    program.run_inputs(inputs, observe=tick, on_aten=True)
    torch.cuda.synchronize()
    times: dict[int, float] = {}
    before = start
    for rid, event in marks:
        times[rid] = before.elapsed_time(event)
        before = event
    return times


def _host_run(program: Any, inputs: Sequence[Any]) -> dict[int, float]:
    times: dict[int, float] = {}
    last = [time.perf_counter()]

    def tick(step: Any, _inputs: Any, _outs: Any) -> None:
        now = time.perf_counter()
        times[step.region.id] = (now - last[0]) * 1e3
        last[0] = now

    program.run_inputs(inputs, observe=tick, on_aten=True)
    return times
