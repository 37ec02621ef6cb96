"""First-call acceptance: verify candidates on the real inputs, then the whole Program.

The Program's first call runs every region on ATen (so the user gets eager's results
whatever happens); as each region with a candidate runs, the Verifier checks the
candidate on that region's real inputs and fresh draws and times it. Candidates that
pass are installed; the whole Program is then run again with them and compared with the
ATen run (and, if needed, an fp64 run) before it is accepted. The random-number state is
restored around the re-runs, so the user's generator advances exactly as in eager.

A template candidate may carry untrusted ``alternatives`` (LLM-written kernels launched
by its launch rule). Each is first run in a child process on the region's real inputs
(``agents.sandbox``) and compared with ATen's outputs; only then is it loaded here and
verified like any candidate. The fastest verified candidate of a region wins. A region
won by an untrusted kernel is stored in the cache as ATen (the cache rebuilds template
kernels only), with the reason.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from stitch_backend import progress
from stitch_backend.correctness import compare, flatten_outputs, run_fp64
from stitch_backend.rng import RngState
from stitch_backend.memplan import FLAG_RATIO, within_margin
from stitch_backend.program import Program, Step
from stitch_backend.regions import constant_inputs

from .hotspots import Hotspots
from .hotspots import measure as measure_hotspots
from .samples import Sampler, Samples, byte_budget, capture, first_run
from .state import Attempt, Candidate, Trajectory, Verdict
from .ties import settle as settle_ties
from .unused_outputs import unused_rng_outputs
from .verifier import Verifier

log = logging.getLogger("stitch_backend.agents.acceptance")

# A candidate that is a library call alone (cuBLASLt for a gemm ATen also gives to
# cuBLAS/cuBLASLt: ``Candidate.library``) replaces ATen's call only when this much
# faster: the two differ by an algorithm choice, and a short timing's small lead did not
# survive the benchmark. On the H200, L2 39 and 41 (Linear 4096 -> 4096 over 16384
# rows) took cuBLASLt's call at 1.01x ATen's in the Verifier, and the tasks then ran
# 2.5% and 2.7% slower than eager in the bench (eager interleaved, one run).
LIBRARY_MARGIN = 0.03




def verify_first_call(program: Program, inputs: list[Any], *, verifier: Verifier,
                      trajectory: Trajectory | None = None,
                      on_done: Callable[[Program], None] | None = None,
                      make_runner: Callable[[Any], Any] | None = None,
                      extras: Callable[[Hotspots | None, Sampler], None] | None = None,
                      show_progress: bool = False) -> Any:
    """Measure ``program``'s regions on ATen for ``inputs`` (``hotspots``), let ``extras``
    add candidates knowing those times and able to sample chosen regions' real values
    (the LLM Coder, ``agents.samples``), then run it on ATen once more,
    verify and install its pending candidates, check the whole Program, and return the
    ATen outputs. ``make_runner(candidate)`` builds the callable that runs a candidate
    (default: load its cubin on the GPU). ``show_progress``: a progress bar over the
    regions judged (on a terminal, when it takes a while)."""
    from stitch_backend.kernels import runner_for

    make_runner = make_runner or runner_for
    spots = _hotspots(program, inputs)
    if extras is not None:
        extras(spots, _sampler(program, inputs))

    pending = dict(program.pending)
    program.pending = {}
    accepted: dict[int, Any] = {}
    verdicts: dict[int, Verdict] = {}

    def observe(step: Step, step_inputs: list[Any], outs: Sequence[Any]) -> None:
        cand = pending.get(step.region.id)
        if cand is None:
            return
        try:
            judge(step, step_inputs, outs, cand)
        finally:
            shown.update()

    def judge(step: Step, step_inputs: list[Any], outs: Sequence[Any], cand: Candidate) -> None:
        best: tuple[Any, Verdict] | None = None
        own: Verdict | None = None
        others: list[str] = []
        judged: list[tuple[Any, Verdict]] = []
        for choice in [cand, *cand.alternatives]:
            runner, verdict = _judge(choice, step, step_inputs, outs, verifier, make_runner)
            judged.append((choice, verdict))
            if trajectory is not None:
                trajectory.attempts.append(Attempt("verify", choice, verdict))
            if choice is cand:
                own = verdict
            elif not verdict.ok:
                others.append(verdict.reason)
            if verdict.ok and runner is not None and (best is None or _faster(verdict, best[1])):
                best = (runner, verdict)
        if best is not None:
            accepted[step.region.id], verdicts[step.region.id] = best
            if len(judged) > 1:
                program.notes_sink.append(_race_note(step.region.name, judged, best[1]))
        else:
            assert own is not None
            if others:
                own.reason += (f"; {len(others)} alternative candidate(s) rejected too "
                               f"({others[0]})")
            verdicts[step.region.id] = own

    before = RngState()
    with progress.bar(len(pending), f"verifying {program.plan.graph_name}", "region",
                      enabled=show_progress) as shown:
        reference = program.run_inputs(inputs, observe=observe)
    after = RngState()

    for rid, verdict in verdicts.items():
        region = program.step_of(rid).region
        region.speedup = verdict.speedup
        region.time_ms = verdict.candidate_ms
        if not verdict.ok:
            region.reason = f"candidate rejected: {verdict.reason}"
    _within_memory_margin(program, accepted)
    if accepted:
        for rid, runner in accepted.items():
            program.step_of(rid).fn = runner
        before.restore()
        got, ties = settle_ties(program.graph_module, inputs, program.run_inputs(inputs),
                                reference)
        got = _without_unused(program, got, reference)
        cmp = compare(got, reference, None)
        if not cmp.ok_design:
            before.restore()
            ref64 = _run_aten(program, inputs)
            cmp = compare(got, reference, ref64)
        if cmp.ok_design:
            for tie in ties:
                program.notes_sink.append(
                    f"end-to-end check: output {tie.output}'s indices pick another position "
                    f"than eager's at {tie.differing} of {tie.total} places, each a near tie "
                    "(the values there equal within tolerance and within twice their "
                    "largest difference from eager's values): judged as eager's")
            for rid, runner in accepted.items():
                region = program.step_of(rid).region
                region.backend = "kernel"
                region.kernel = runner.candidate.name
                if not runner.candidate.trusted:
                    region.kernel += f" ({runner.candidate.origin})"
                region.reason = None
        else:
            log.warning("end-to-end check failed (%s): every region of %s stays on ATen",
                        cmp.reason, program.plan.graph_name)
            # said once for the graph; each region's reason repeats it for tools
            program.notes_sink.append(f"end-to-end check failed: {cmp.reason}: every region "
                                      "with a verified kernel stays on ATen")
            for rid in accepted:
                step = program.step_of(rid)
                step.fn = step.aten
                step.region.reason = f"end-to-end check failed: {cmp.reason}"
        after.restore()
    if on_done is not None:
        with _untrusted_stored_as_aten(program, accepted):
            on_done(program)
    return reference


def _within_memory_margin(program: Program, accepted: dict[int, Any]) -> None:
    """Drops from ``accepted`` the kernels that would put the Program's estimated peak
    memory more than ``memplan.FLAG_RATIO`` above the graph's op by op (the documented
    margin), each with the reason, and says so in the notes."""
    if not accepted:
        return
    installed = {s.region.id for s in program.generated_steps()}
    dropped, est = within_margin(program.graph_module, program.plan, set(accepted) | installed)
    dropped = [rid for rid in dropped if rid in accepted]
    if not dropped:
        return
    margin = f"{100 * (FLAG_RATIO - 1):.0f}%"
    for rid in dropped:
        accepted.pop(rid)
        program.step_of(rid).region.reason = (
            f"kept on ATen for memory: its kernel (correct) would hold the Program's "
            f"estimated peak more than {margin} above the graph's op by op")
    now = f"{100 * (est.ratio - 1):+.0f}%" if est.ratio is not None else "not estimated"
    program.notes_sink.append(
        f"memory: {len(dropped)} region(s) kept on ATen for the documented margin: the "
        f"estimated peak {margin} at most above the graph's (now {now})")


def _without_unused(program: Program, got: list[Any], reference: Any) -> list[Any]:
    """``got`` with eager's values at the outputs that hold no result (an attention
    op's dropout seed and offset at dropout 0: ``unused_outputs``), said in the notes."""
    unused = unused_rng_outputs(program.graph_module)
    if not unused:
        return got
    refs = flatten_outputs(reference)
    if len(refs) != len(got):
        return got
    got = list(got)
    for i in unused:
        got[i] = refs[i]
    program.notes_sink.append(
        f"end-to-end check: output(s) {', '.join(map(str, unused))} not compared: an "
        "attention op's dropout seed/offset at dropout_p=0, which nothing reads")
    return got


def _sampler(program: Program, inputs: list[Any]) -> Sampler:
    """Chosen regions' real values (``samples.capture``), the generators put back."""
    def sample(region_ids: Sequence[int]) -> Samples:
        rng = RngState()
        try:
            return capture(program, inputs, region_ids, max_bytes=byte_budget(inputs))
        finally:
            rng.restore()

    return sample


def _hotspots(program: Program, inputs: list[Any]) -> Hotspots | None:
    """The regions' ATen times on ``inputs``, also kept as each region's ``aten_ms``
    (None, with the reason in the graph's notes, where the measurement failed: the
    verification that follows does not depend on it)."""
    rng = RngState()
    try:
        spots = measure_hotspots(program, inputs)
    except Exception as err:  # noqa: BLE001 - a profile is advice, never a failed call
        program.notes_sink.append(f"hotspots not measured ({type(err).__name__}: {err}): "
                                  "regions are taken in graph order")
        return None
    finally:
        rng.restore()
    for step in program.steps:
        step.region.aten_ms = spots.ms.get(step.region.id)
    return spots


def _judge(cand: Candidate, step: Step, inputs: list[Any], eager_outs: Sequence[Any],
           verifier: Verifier, make_runner: Callable[[Any], Any]) -> tuple[Any, Verdict]:
    """(runner, verdict) for one candidate on one region's real inputs; untrusted ones
    must survive a first run in a child process before anything of theirs runs here."""
    try:
        if not cand.trusted:
            why = _first_run_elsewhere(cand, inputs, eager_outs)
            if why:
                return None, Verdict(ok=False, reason=why)
        runner = make_runner(cand)
        verdict = verifier.check(runner.poisoning(), step.aten, inputs, seed=step.region.id,
                                 timed=runner, keep=constant_inputs(step.aten))
        if cand.library and verdict.ok and verdict.speedup is not None and (
                verdict.speedup < 1.0 + LIBRARY_MARGIN):
            verdict.ok = False
            verdict.reason = (f"correct, {verdict.speedup:.2f}x ATen's call, but a library "
                              f"call must be {LIBRARY_MARGIN:.0%} faster to replace it "
                              f"({verdict.clock})")
        return runner, verdict
    except Exception as err:  # noqa: BLE001 - a broken candidate is a rejection
        return None, Verdict(ok=False, reason=f"could not run: {type(err).__name__}: {err}")


def _first_run_elsewhere(cand: Candidate, inputs: list[Any],
                         eager_outs: Sequence[Any]) -> str | None:
    """None when ``cand``'s first run in a child process matched ATen; else why not."""
    from stitch_backend import config as config_mod

    if cand.cubin is None or cand.kernel is None or cand.stages is not None:
        return "untrusted candidate without a single compiled kernel"
    if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        return "untrusted candidates run only on CUDA inputs"
    run = first_run(cand, inputs, eager_outs,
                    timeout_s=float(config_mod.current().llm_sandbox_timeout_s))
    return None if run.ok else f"first run in a child process: {run.reason}"


def _race_note(region: str, judged: list[tuple[Any, Verdict]], won: Verdict) -> str:
    """One line on a region whose candidates raced: which kernel won, and each other one's
    time (correct but not faster) or why it was rejected."""
    def ms(v: Verdict) -> str:
        return f"{v.candidate_ms:.4f} ms" if v.candidate_ms is not None else "untimed"

    winner = next(c for c, v in judged if v is won)
    lost = [f"{c.name} {'correct, ' + ms(v) if v.ok else 'rejected: ' + v.reason}"
            for c, v in judged if v is not won]
    return f"{region}: {winner.name} kept ({ms(won)}); " + "; ".join(lost)


def _faster(a: Verdict, b: Verdict) -> bool:
    """Whether verdict ``a`` timed strictly faster than ``b`` (untimed never wins)."""
    if a.candidate_ms is None:
        return False
    return b.candidate_ms is None or a.candidate_ms < b.candidate_ms


@contextlib.contextmanager
def _untrusted_stored_as_aten(program: Program, accepted: dict[int, Any]) -> Iterator[None]:
    """While the Program is stored, regions won by untrusted kernels read as ATen: the
    cache rebuilds template kernels only, so such a region must warm-start on ATen."""
    saved = []
    for rid, runner in accepted.items():
        region = program.step_of(rid).region
        if not runner.candidate.trusted and region.backend == "kernel":
            saved.append((region, region.backend, region.kernel, region.reason))
            region.backend, region.kernel = "aten", None
            region.reason = ("an LLM-written kernel won this region in the process that "
                             "built the entry; the cache keeps template kernels only")
    try:
        yield
    finally:
        for region, backend, kernel, reason in saved:
            region.backend, region.kernel, region.reason = backend, kernel, reason


def _run_aten(program: Program, inputs: list[Any]) -> Any:
    """The Program's fp64 run on ATen (``correctness.run_fp64``), or None."""
    fns = [(s, s.fn) for s in program.steps]
    try:
        for s, _ in fns:
            s.fn = s.aten
        return run_fp64(lambda *xs: program.run_inputs(list(xs)), inputs)
    except Exception:  # noqa: BLE001 - an op without an fp64 kernel: no fp64 reference
        return None
    finally:
        for s, fn in fns:
            s.fn = fn
