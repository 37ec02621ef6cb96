"""First-call acceptance: verify candidates on the real inputs, then the whole Program.

The Program's first call runs every region on ATen (so the user gets eager's results
whatever happens); as each region with a candidate runs, the Verifier checks the
candidate on that region's real inputs and fresh draws and times it. Candidates that
pass are installed; the whole Program is then run again with them and compared with the
ATen run (and, if needed, an fp64 run) before it is accepted. The random-number state is
restored around the re-runs, so the user's generator advances exactly as in eager.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from stitch_backend.bench.compare import compare
from stitch_backend.program import Program, Step

from .state import Attempt, Trajectory, Verdict
from .verifier import Verifier

log = logging.getLogger("stitch_backend.agents.acceptance")


class _RngState:
    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _upcast(inputs: Sequence[Any]) -> list[Any]:
    return [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs]


def verify_first_call(program: Program, inputs: list[Any], *, verifier: Verifier,
                      trajectory: Trajectory | None = None,
                      on_done: Callable[[Program], None] | None = None,
                      make_runner: Callable[[Any], Any] | None = None) -> Any:
    """Run ``program`` on ATen for ``inputs``, verify and install its pending candidates,
    check the whole Program, and return the ATen outputs. ``make_runner(candidate)``
    builds the callable that runs a candidate (default: load its cubin on the GPU)."""
    from stitch_backend.kernels import runner_for

    make_runner = make_runner or runner_for

    pending = dict(program.pending)
    program.pending = {}
    accepted: dict[int, Any] = {}
    verdicts: dict[int, Verdict] = {}

    def observe(step: Step, step_inputs: list[Any], _outs: Sequence[Any]) -> None:
        cand = pending.get(step.region.id)
        if cand is None:
            return
        try:
            runner = make_runner(cand)
            verdict = verifier.check(runner.poisoning(), step.aten, step_inputs,
                                     seed=step.region.id)
        except Exception as err:  # noqa: BLE001 - a broken candidate is a rejection
            verdict = Verdict(ok=False, reason=f"could not run: {type(err).__name__}: {err}")
            runner = None
        verdicts[step.region.id] = verdict
        if trajectory is not None:
            trajectory.attempts.append(Attempt("verify", cand, verdict))
        if verdict.ok and runner is not None:
            accepted[step.region.id] = runner

    before = _RngState()
    reference = program.run_inputs(inputs, observe=observe)
    after = _RngState()

    for rid, verdict in verdicts.items():
        region = program.step_of(rid).region
        region.speedup = verdict.speedup
        region.time_ms = verdict.candidate_ms
        if not verdict.ok:
            region.reason = f"candidate rejected: {verdict.reason}"
    if accepted:
        for rid, runner in accepted.items():
            program.step_of(rid).fn = runner
        before.restore()
        got = program.run_inputs(inputs)
        cmp = compare(got, reference, None)
        if not cmp.ok_design:
            before.restore()
            ref64 = _run_aten(program, _upcast(inputs))
            cmp = compare(got, reference, ref64)
        if cmp.ok_design:
            for rid, runner in accepted.items():
                region = program.step_of(rid).region
                region.backend = "kernel"
                region.kernel = runner.candidate.name
                region.reason = None
        else:
            log.warning("end-to-end check failed (%s): every region of %s stays on ATen",
                        cmp.reason, program.plan.graph_name)
            for rid in accepted:
                step = program.step_of(rid)
                step.fn = step.aten
                step.region.reason = f"end-to-end check failed: {cmp.reason}"
        after.restore()
    if on_done is not None:
        on_done(program)
    return reference


def _run_aten(program: Program, inputs: list[Any]) -> Any:
    fns = [(s, s.fn) for s in program.steps]
    try:
        for s, _ in fns:
            s.fn = s.aten
        return program.run_inputs(inputs)
    except Exception:  # noqa: BLE001 - an op without an fp64 kernel: no fp64 reference
        return None
    finally:
        for s, fn in fns:
            s.fn = fn
