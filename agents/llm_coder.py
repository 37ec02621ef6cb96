"""The LLM Coder: extra, untrusted candidates for regions the templates already cover.

The model gets the region's ops and the template kernel (source, entry, exact
parameter list, launch rule) and writes a drop-in replacement: same entry and
parameters, launched by the template's launch rule. The loop is the paper's routing,
in the shape of mini-swe-agent's: generate, then feedback decides the next step —
no single ```cuda block (FormatError), a screen rejection, a compile error, a failed
first run or a wrong result -> repair; correct but slow -> optimise with the measured
times; ok -> done. A Budget (model calls, tokens, wall seconds) bounds it
(LimitsExceeded). Each step is appended to the Trajectory (and its JSONL file at once).

``evaluate(candidate) -> Feedback`` is the caller's: it screens and compiles in a child
process (``screen_and_compile``) and, where the region's real values from the first
call are at hand (``agents.samples``), launches the compiled kernel once on them in a
child process and compares with ATen (``screen_compile_and_run``): a fault or a hang is
"run" feedback, a result beyond DESIGN.md's rule is "wrong". A candidate never replaces the template's; the Verifier treats it as
untrusted.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .llm import LLMClient, LLMError, LLMReply
from .prompts import render
from .screen import EntrySignature, parse_entry, screen
from .state import Attempt, Candidate, Subtask, Trajectory

log = logging.getLogger("stitch_backend.agents.llm_coder")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)```", re.S)
REPAIR_KINDS = ("format", "screen", "compile", "run", "wrong")


class FormatError(Exception):
    """The reply did not hold exactly one ```cuda fenced block."""


class LimitsExceeded(Exception):
    """The budget (model calls, tokens or wall seconds) is spent."""


@dataclass(frozen=True)
class Budget:
    """What one region's loop may spend."""

    iterations: int = 4         # model calls, generate and repairs together
    tokens: int = 100_000       # prompt + completion tokens
    seconds: float = 600.0      # wall time of the whole loop


@dataclass(frozen=True)
class Feedback:
    """What became of a candidate: ``kind`` is "ok", "slow" (correct, not fast enough),
    or a failure: "format", "screen", "compile", "run", "wrong". ``detail`` is shown to
    the model (the nvcc log, the Verifier's reason); times are milliseconds."""

    kind: str
    message: str
    detail: str = ""
    eager_ms: float | None = None
    template_ms: float | None = None
    candidate_ms: float | None = None


Evaluate = Callable[[Candidate], Feedback]


@dataclass
class _Session:
    """One region's conversation."""

    subtask: Subtask
    template: Candidate
    entry: EntrySignature
    messages: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)


def extract_cuda(text: str) -> str:
    """The one ```cuda fenced block of ``text``; FormatError if there are none or several."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in ("cuda", "cu")]
    if len(blocks) != 1:
        raise FormatError(f"expected exactly one ```cuda fenced block, found {len(blocks)}")
    source = blocks[0].strip("\n")
    if not source.strip():
        raise FormatError("the ```cuda block is empty")
    return source + "\n"


def launch_rule(kernel: Any) -> str:
    """How the template's launch rule launches ``kernel`` (a codegen FusedKernel), in words."""
    em = getattr(kernel, "emitted", None)
    if em is None:
        return "as the template (same grid, block and arguments)."
    if em.kind == "pointwise":
        text = ("a 1-D grid-stride launch: blockDim = (256, 1, 1); gridDim.x = "
                "min(ceil(n / (256 * vector width)), resident blocks), so the grid may be "
                "smaller than the work.")
    else:
        text = ("blockDim.x = RB * TK threads (at most 1024), TK = 1 << log2_tk threads per "
                "row (a power of two, passed as the last argument), RB = blockDim.x >> "
                "log2_tk rows per block; gridDim.x is at most the number of row groups and "
                "may be smaller. No dynamic shared memory.")
    if em.workspaces:
        text += (" Scratch buffers (ws*) have one element per row; sfk_ticket is one "
                 "unsigned int that is zero at launch and must be zero again at exit.")
    return text


class LLMCoder:
    """Asks ``client`` for drop-in replacements of template kernels, within ``budget``.

    ``propose`` and ``repair`` are the two skills; ``run`` is the loop around them."""

    origin = "llm"

    def __init__(self, client: LLMClient, budget: Budget | None = None, *,
                 arch: str = "sm_90a", trajectory: Trajectory | None = None,
                 trajectory_path: Path | None = None):
        self.client = client
        self.budget = budget or Budget()
        self.arch = arch
        self.trajectory = trajectory
        self.trajectory_path = trajectory_path
        self._sessions: dict[int, _Session] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the two skills

    def propose(self, subtask: Subtask, template: Candidate) -> Candidate:
        """A new conversation for ``subtask``: the task prompt, the model's kernel as a
        Candidate(origin="llm") that launches like ``template``. Raises FormatError,
        LimitsExceeded or LLMError."""
        if template.stages is not None or template.kernel is None:
            raise ValueError("the LLM Coder replaces single-kernel candidates only")
        entry = parse_entry(template.source)
        sess = _Session(subtask, template, entry)
        sess.messages = [
            {"role": "system", "content": render("system", arch=self.arch, entry=entry.name)},
        ]
        with self._lock:
            self._sessions[subtask.region_id] = sess
        user = render("generate", region_name=subtask.region_name,
                      ops="\n".join(f"- {op}" for op in subtask.ops) or "- (none listed)",
                      signature=entry.text, launch_rule=launch_rule(template.kernel),
                      template_source=template.source.rstrip("\n"), entry=entry.name)
        return self._ask(sess, user, "generate")

    def repair(self, candidate: Candidate, feedback: Feedback) -> Candidate:
        """The model's next kernel after ``feedback`` on ``candidate`` (its own last one):
        a repair prompt for failures, an optimise prompt for "slow"."""
        sess = self._sessions.get(candidate.region_id)
        if sess is None:
            raise ValueError(f"no conversation for region {candidate.region_id}: propose first")
        if feedback.kind == "slow":
            user = render("optimise", entry=sess.entry.name, signature=sess.entry.text,
                          eager_ms=_ms(feedback.eager_ms), template_ms=_ms(feedback.template_ms),
                          candidate_ms=_ms(feedback.candidate_ms))
            return self._ask(sess, user, "optimise")
        detail = feedback.detail.strip()
        if detail:
            detail = f"Details:\n```\n{_tail(detail)}\n```"
        user = render("repair", entry=sess.entry.name, signature=sess.entry.text,
                      problem=feedback.message, feedback=detail)
        return self._ask(sess, user, "repair")

    def _ask(self, sess: _Session, user: str, action: str) -> Candidate:
        self._check_budget(sess)
        sess.messages.append({"role": "user", "content": user})
        sent = [dict(m) for m in sess.messages]
        try:
            reply = self.client.complete(sent)
        except BaseException:
            sess.messages.pop()  # the conversation stays well-formed for a later try
            raise
        sess.calls += 1
        # Servers that report no usage are charged about four characters a token.
        sess.tokens += reply.tokens or (
            sum(len(m["content"]) for m in sent) + len(reply.text)) // 4
        text = self.client.redact(reply.text)
        sess.messages.append({"role": "assistant", "content": text})
        cand = Candidate(region_id=sess.subtask.region_id, origin=self.origin,
                         name=sess.template.name, source="", signature=sess.template.signature,
                         kernel=sess.template.kernel)
        try:
            cand.source = extract_cuda(text)
        except FormatError as err:
            self._record(action, cand, sent, reply, text, feedback=f"format: {err}")
            raise
        self._record(action, cand, sent, reply, text, feedback=None)
        return cand

    # ------------------------------------------------------------------ the loop

    def run(self, subtask: Subtask, template: Candidate, evaluate: Evaluate) -> list[Candidate]:
        """Generate, evaluate and repair/optimise until ``evaluate`` says "ok" or the
        budget or the endpoint gives out. Returns the candidates judged "ok" (at most
        one today); never raises for what the model or the endpoint does."""
        accepted: list[Candidate] = []
        cand: Candidate | None = None
        feedback: Feedback | None = None
        while True:
            try:
                cand = (self.propose(subtask, template) if cand is None and feedback is None
                        else self.repair(cand or _placeholder(template), feedback))
            except FormatError as err:
                feedback = Feedback("format", f"{err} in your reply")
                cand = cand or _placeholder(template)
                continue
            except LimitsExceeded as err:
                log.info("LLM Coder stops on %s: %s", subtask.region_name, err)
                return accepted
            except LLMError as err:
                log.warning("LLM Coder stops on %s: %s", subtask.region_name,
                            self.client.redact(str(err)))
                return accepted
            except Exception as err:  # noqa: BLE001 - a Coder bug must not break the compile
                log.warning("LLM Coder failed on %s: %s: %s", subtask.region_name,
                            type(err).__name__, self.client.redact(str(err)))
                return accepted
            try:
                feedback = evaluate(cand)
            except Exception as err:  # noqa: BLE001 - an evaluator bug ends the loop only
                log.warning("LLM Coder: evaluating a candidate for %s failed: %s: %s",
                            subtask.region_name, type(err).__name__, err)
                return accepted
            self._note_feedback(cand, feedback)
            if feedback.kind == "ok":
                accepted.append(cand)
                return accepted
            if feedback.kind not in REPAIR_KINDS + ("slow",):
                log.warning("LLM Coder: unknown feedback kind %r; stopping", feedback.kind)
                return accepted

    # ------------------------------------------------------------------ bookkeeping

    def _check_budget(self, sess: _Session) -> None:
        b = self.budget
        if sess.calls >= b.iterations:
            raise LimitsExceeded(f"{sess.calls} model calls (budget {b.iterations})")
        if sess.tokens >= b.tokens:
            raise LimitsExceeded(f"{sess.tokens} tokens (budget {b.tokens})")
        spent = time.monotonic() - sess.started
        if spent >= b.seconds:
            raise LimitsExceeded(f"{spent:.0f} s (budget {b.seconds:g} s)")

    def _record(self, action: str, cand: Candidate, sent: list[dict[str, str]],
                reply: LLMReply, text: str, feedback: str | None) -> None:
        if self.trajectory is None:
            return
        attempt = Attempt(action, cand, None, feedback=feedback, messages=sent, reply=text,
                          prompt_tokens=reply.prompt_tokens,
                          completion_tokens=reply.completion_tokens, llm_seconds=reply.seconds)
        with self._lock:
            self.trajectory.add(attempt, self.trajectory_path)

    def _note_feedback(self, cand: Candidate, feedback: Feedback) -> None:
        """Say what the candidate's evaluation found, in the trajectory."""
        if self.trajectory is None:
            return
        text = self.client.redact(f"{feedback.kind}: {feedback.message}")
        if feedback.detail:
            text += "\n" + self.client.redact(_tail(feedback.detail))
        with self._lock:
            self.trajectory.add(Attempt("evaluate", cand, None, feedback=text),
                                self.trajectory_path)


def _placeholder(template: Candidate) -> Candidate:
    return replace(template, origin="llm", source="", cubin=None, alternatives=[])


def _ms(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "(not measured)"


def _tail(text: str, lines: int = 60) -> str:
    rows = text.splitlines()
    return "\n".join(rows[-lines:]) if len(rows) > lines else text


# --------------------------------------------------------------------------- at compile time


def screen_and_compile(arch: str, *, timeout_s: float = 120.0,
                       child: list[str] | None = None) -> Evaluate:
    """An evaluator for compile time (no inputs yet): the static screen against the
    template's entry, then nvcc in a child process. On "ok" the candidate carries its
    cubin; a compile error's feedback carries nvcc's log."""
    from .sandbox import compile_in_child

    def evaluate(cand: Candidate) -> Feedback:
        template = parse_entry(cand.kernel.source)
        verdict = screen(cand.source, template)
        if not verdict.ok:
            cand.compile_error = f"screen: {verdict.reason}"
            return Feedback("screen", f"the static screen refused it: {verdict.reason}")
        res = compile_in_child(cand.source, template.name, arch, timeout_s=timeout_s,
                               child=child)
        if res.stage == "compile":
            cand.compile_error = res.log
            return Feedback("compile", "nvcc could not compile it", res.log)
        if not res.ok:
            cand.compile_error = res.reason
            return Feedback("run", f"compiling it failed: {res.reason}", res.log)
        cand.cubin, cand.compile_s = res.cubin, res.compile_s
        return Feedback("ok", "compiled")

    return evaluate


# A correct candidate whose launch the child timed this much slower than the template's
# gets "slow" feedback (the optimise prompt) instead of "ok". Only clearly slower: two
# equal kernels differ by noise in a short timing, and the Verifier decides the race.
# SLOW_FLOOR_MS on top: a few-microsecond kernel's events jitter by more than 5%.
SLOW_MARGIN = 0.05
SLOW_FLOOR_MS = 0.002


def screen_compile_and_run(arch: str, samples: dict[int, Any], *, timeout_s: float = 120.0,
                           templates: dict[int, Candidate] | None = None,
                           child: list[str] | None = None) -> Evaluate:
    """``screen_and_compile``, then, for a region with a sample (``samples``: region id
    -> ``agents.samples.RegionSample``), one launch of the compiled candidate on the
    sample's inputs in a child process, compared with its ATen outputs; where the
    region's template (``templates``) has a cubin, the child also times the two, and a
    candidate clearly slower (``SLOW_MARGIN``, ``SLOW_FLOOR_MS``) gets "slow" feedback
    with the times."""
    from .samples import first_run

    compiled = screen_and_compile(arch, timeout_s=timeout_s, child=child)
    templates = templates or {}

    def evaluate(cand: Candidate) -> Feedback:
        feedback = compiled(cand)
        sample = samples.get(cand.region_id)
        if feedback.kind != "ok" or sample is None:
            return feedback
        template = templates.get(cand.region_id)
        run = first_run(cand, sample.inputs, sample.outputs, timeout_s=timeout_s,
                        time_against=template.cubin if template is not None else None,
                        child=child)
        if run.kind == "run":
            return Feedback("run", "it compiled, but its first run on the region's real "
                            f"inputs failed: {run.reason}", run.log)
        if run.kind == "wrong":
            return Feedback("wrong", "it compiled and ran, but on the region's real inputs "
                            f"its {run.reason}")
        timed = run.candidate_ms is not None and run.baseline_ms is not None
        if timed and run.candidate_ms > run.baseline_ms * (1 + SLOW_MARGIN) + SLOW_FLOOR_MS:
            return Feedback("slow", "correct on the region's real inputs, but slower than "
                            f"the template kernel: {run.candidate_ms:.4f} ms against "
                            f"{run.baseline_ms:.4f} ms a launch", eager_ms=sample.aten_ms,
                            template_ms=run.baseline_ms, candidate_ms=run.candidate_ms)
        said = (f" ({run.candidate_ms:.4f} ms a launch, the template {run.baseline_ms:.4f} ms)"
                if timed else "")
        return Feedback("ok", "compiled; its first run on the region's real inputs matched "
                        f"ATen{said}", candidate_ms=run.candidate_ms,
                        template_ms=run.baseline_ms)

    return evaluate
