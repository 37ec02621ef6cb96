"""Region samples: the real inputs and ATen outputs of chosen regions at the first call,
and an untrusted candidate's first run on them in the sandbox's child process.

The LLM Coder's loop sends a wrong result back to the model as a repair ("wrong"
feedback), but a kernel is only wrong on inputs. At compile time AOTAutograd hands over
fake tensors; at the first call the Program runs on ATen anyway (the hotspots, the
reference run), so one more run on ATen keeps, for each region the Coder works on, the
values its step read and wrote. A candidate that compiles is then launched once on those
values in a child process (``sandbox.first_run_in_child``: a fault or a hang there is a
rejection, never a dead user process) and compared with ATen's outputs by DESIGN.md's
rule. Acceptance uses the same first run (``first_run``) before anything untrusted runs
in the user's process.

Values are held, not copied: the Program's steps are functional and its run drops its
own references as it goes, so a held value is never written again. What is held is
bounded (``capture``'s ``max_bytes``; ``byte_budget`` on CUDA: a quarter of the free
device memory): the regions that do not fit, the least hot first, are left out, and
their loop gets compile-only feedback (the caller says so in the graph's notes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from stitch_backend.correctness import compare

from .state import Candidate

# Of the device memory free at the first call, the share region samples may hold.
FREE_MEMORY_SHARE = 0.25


@dataclass
class RegionSample:
    """One region's step on the first call's real inputs, run on ATen."""

    inputs: list[Any]
    outputs: list[Any]
    aten_ms: float | None = None      # the region's ATen time at the first call (hotspots)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in [*self.inputs, *self.outputs]
                   if isinstance(x, torch.Tensor))


@dataclass
class Samples:
    """What ``capture`` kept: region id -> sample, and the ids left out for their size."""

    regions: dict[int, RegionSample] = field(default_factory=dict)
    left_out: list[int] = field(default_factory=list)


# What the first-call hook is handed: region ids, most wanted first -> their samples.
Sampler = Callable[[Sequence[int]], Samples]


@dataclass(frozen=True)
class FirstRun:
    """A candidate's first run in a child process: ``kind`` is "ok", "run" (it failed to
    run: a fault, a hang, a launch error) or "wrong" (it ran; the result is not ATen's)."""

    kind: str
    reason: str
    log: str = ""
    candidate_ms: float | None = None   # with ``time_against``: median ms of a launch
    baseline_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def byte_budget(inputs: Sequence[Any]) -> int | None:
    """How many bytes samples may hold for a graph with ``inputs``: a share of the free
    device memory on CUDA; None (no bound) elsewhere."""
    device = next((x.device for x in inputs
                   if isinstance(x, torch.Tensor) and x.is_cuda), None)
    if device is None:
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * FREE_MEMORY_SHARE)


def capture(program: Any, inputs: Sequence[Any], region_ids: Sequence[int], *,
            max_bytes: int | None) -> Samples:
    """Run ``program`` on ATen over ``inputs`` once and keep the step values of
    ``region_ids`` (most wanted first). Where they would hold more than ``max_bytes``,
    the least wanted are dropped as the run goes. Random numbers drawn by the run
    advance the generators: the caller restores them."""
    rank = {rid: k for k, rid in enumerate(region_ids)}
    got = Samples()

    def observe(step: Any, step_inputs: list[Any], outs: Sequence[Any]) -> None:
        rid = step.region.id
        if rid not in rank:
            return
        got.regions[rid] = RegionSample(list(step_inputs), list(outs), step.region.aten_ms)
        if max_bytes is None:
            return
        held = sum(s.nbytes for s in got.regions.values())
        for drop in sorted(got.regions, key=rank.__getitem__, reverse=True):
            if held <= max_bytes:
                break
            held -= got.regions.pop(drop).nbytes
            got.left_out.append(drop)

    program.run_inputs(list(inputs), observe=observe, on_aten=True)
    got.left_out.sort(key=rank.__getitem__)
    return got


def first_run(cand: Candidate, inputs: Sequence[Any], expected: Sequence[Any], *,
              timeout_s: float, time_against: bytes | None = None,
              child: Sequence[str] | None = None) -> FirstRun:
    """Launch ``cand`` (compiled: its cubin) once on ``inputs`` in a child process, by its
    template's launch rule, and compare its outputs with ``expected`` (ATen's). With
    ``time_against`` (the template's cubin), a correct candidate is also timed against
    it there (``candidate_ms``, ``baseline_ms``)."""
    from .sandbox import first_run_in_child

    if cand.cubin is None or cand.kernel is None or cand.stages is not None:
        return FirstRun("run", "not a single compiled kernel")
    plan = cand.kernel.prepare(list(inputs))
    res = first_run_in_child(cand.source, cand.kernel.entry, cand.kernel.signature,
                             list(inputs), plan, arch="", cubin=cand.cubin,
                             timeout_s=timeout_s, time_against=time_against, child=child)
    if not res.ok:
        return FirstRun("run", res.reason, res.log)
    cmp = compare(res.outputs, list(expected), None)
    if not cmp.ok_design:
        return FirstRun("wrong", f"wrong result: {cmp.reason}")
    times = res.times or {}
    return FirstRun("ok", "matched ATen", candidate_ms=times.get("candidate"),
                    baseline_ms=times.get("baseline"))
