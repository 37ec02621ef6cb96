"""The agent loop for one graph: Planner's plan -> Coder -> compile -> (Verifier at first call).

Candidates are compiled in parallel (for the backend on a background thread, which the
first call waits for); a region whose candidate cannot be produced or compiled stays on
ATen with the reason written into the Plan. Verification needs real
inputs, so it happens on the Program's first call (``stitch_backend.program``), which
calls back into ``agents.acceptance``. With ``coder="template+llm"`` the LLM Coder adds
untrusted candidates beside the template's there, once the regions' ATen times on the
real inputs rank them (``agents.llm_extras``, ``agents.hotspots``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from stitch_backend import progress
from stitch_backend.ir import Plan, RegionKind
from stitch_backend.logs import OUTPUT_CODE

from .coder import NoCandidate, TemplateCoder
from .state import Attempt, Candidate, Subtask, Task, Trajectory, subtask_for

log = logging.getLogger("stitch_backend.agents.loop")
code_log = logging.getLogger(OUTPUT_CODE)


@dataclass
class Implementation:
    """What the loop produced for one graph: compiled candidates awaiting verification."""

    candidates: dict[int, Candidate] = field(default_factory=dict)
    trajectory: Trajectory | None = None
    compile_s: float = 0.0
    # What was compiled: kernels (the candidates' own, then their alternatives'), and
    # the compiler's own seconds over them, summed and the longest (wall vs work).
    compiled: tuple[int, int] = (0, 0)
    compiler_s: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)   # for the graph's report
    # The subtask of every region with a candidate (the LLM Coder's work orders).
    subtasks: dict[int, Subtask] = field(default_factory=dict)

    # the compile: a Future of (results, seconds), done already where it ran in the
    # foreground; how its results are given to the candidates (``_settle``)
    _compiling: Any = field(default=None, repr=False)
    _settle: Any = field(default=None, repr=False)

    def finish(self) -> None:
        """Wait for the kernels' compile (``implement(background=True)``) and give each
        candidate its cubin; a compile that raised (no NVRTC, say) leaves every
        candidate out, each region saying why. Nothing to wait for: returns at once."""
        if self._settle is None:
            return
        settle, self._settle = self._settle, None
        compiling, self._compiling = self._compiling, None
        try:
            compiled, self.compile_s = compiling.result()
        except Exception as err:  # noqa: BLE001 - the graph runs on ATen, saying why
            why = f"compile failed: {type(err).__name__}: {' '.join(str(err).split())}"
            log.warning("stitchcuda: %s", why)
            self.notes.append(f"{why}; every region runs on ATen")
            settle([], failed=why)
            return
        settle(compiled)

    def compile_note(self) -> str:
        """How long the compile took, for the graph's report: e.g. "30 kernels (18
        candidates, 12 alternatives) compiled in 2.10 s; the compiler's own times sum
        to 4.05 s, the longest 0.43 s" (a sum near the wall time: compiled one at a time)."""
        own, alts = self.compiled
        note = (f"{own + alts} kernel(s) ({own} candidate(s), {alts} alternative(s)) "
                f"compiled in {self.compile_s:.2f} s")
        if own + alts:
            note += (f"; the compiler's own times sum to {self.compiler_s[0]:.2f} s, the "
                     f"longest {self.compiler_s[1]:.2f} s")
        return note


def implement(task: Task, gm: torch.fx.GraphModule, plan: Plan, *, arch: str,
              sm_count: int = 132, workers: int | None = None,
              compile: bool = True, config: Any = None,
              background: bool = False) -> Implementation:
    """Propose and compile a candidate for every region the templates cover
    (``compile=False``: propose only, for the CPU interpreter); ``config`` (default: the
    process settings) says whether the split-statistics variants are proposed.

    ``background``: the kernels compile on a background thread (one graph's batch at a
    time) and this returns at once; ``Implementation.finish()`` waits for them. Until
    then ``candidates`` holds every proposal; a candidate that did not compile leaves
    it at ``finish``."""
    from stitch_backend.toolchain import CompileJob, csrc_dir, has_clusters

    from stitch_backend import config as config_mod

    cfg = config if config is not None else config_mod.current()
    coder = TemplateCoder(sm_count=sm_count, split_stats=cfg.split_stats,
                          clusters=has_clusters(arch))
    trajectory = Trajectory(task=task)
    proposals: list[Candidate] = []
    subtasks: dict[int, Subtask] = {}
    for region in plan.regions:
        if region.kind is RegionKind.FALLBACK:
            continue
        name = f"{task.graph}_{region.name}"
        try:
            sub = subtask_for(gm, region, name)
            cand = coder.propose(sub)
        except NoCandidate as err:
            region.reason = str(err)
            continue
        except Exception as err:  # noqa: BLE001 - a Coder bug must not break the user's model
            log.warning("coder failed on %s: %s: %s", name, type(err).__name__, err)
            region.reason = f"coder error: {type(err).__name__}: {err}"
            continue
        code_log.debug("// region %s\n%s", sub.region_name, cand.source)
        proposals.append(cand)
        subtasks[region.id] = sub

    out = Implementation(trajectory=trajectory, subtasks=subtasks,
                         candidates={c.region_id: c for c in proposals})
    if not compile:
        for cand in proposals:
            trajectory.attempts.append(Attempt("generate", cand, None))
        return out
    if torch.cuda.is_available() and any(_calls_cublaslt(c) for c in proposals):
        # the cuBLASLt runtime (built once per machine) compiles beside the kernels, for
        # the visible GPU's arch as its first use (lt_ops) would build it
        from stitch_backend.runtime import prebuild

        prebuild()
    # a library-only alternative (a cuBLASLt call, no generated kernel) compiles nothing
    alternatives = [a for c in proposals for a in c.alternatives if a.kernels]
    # and so does a library-only candidate of its own (a plain gemm's cuBLASLt call)
    built = [c for c in proposals if c.kernels]
    jobs = [CompileJob(source=c.source, name=c.name, arch=arch, include_dirs=(csrc_dir(),),
                       compiler=cfg.compiler)
            for c in built + alternatives]
    out.compiled = (len(built), len(alternatives))
    batch = functools.partial(_compile_batch, jobs, workers, f"compiling {task.graph}",
                              cfg.progress)
    out._settle = functools.partial(_settle, out, plan, proposals, built, alternatives)
    if background:
        out._compiling = _background().submit(batch)
    else:
        out._compiling = Future()
        out._compiling.set_result(batch())    # a compile that raises, raises here
        out.finish()
    return out


class CompileWait:
    """A graph's wait for its kernels, run once: ``()`` waits (``Implementation.finish``),
    puts the compile's note and the loop's notes into ``notes`` (the graph's report;
    ``report``: say how the compile went) and returns the seconds waited;
    ``before(verify)`` is ``verify`` that waits first, as a Program's first call does."""

    def __init__(self, impl: Implementation, notes: list[str], *, report: bool,
                 background: bool):
        self.impl, self.notes, self.report, self.background = impl, notes, report, background
        self.done = False

    def __call__(self) -> float:
        if self.done:
            return 0.0
        self.done = True
        t0 = time.perf_counter()
        self.impl.finish()
        waited = time.perf_counter() - t0
        if self.report:
            self.notes.append(self.impl.compile_note() + (
                f"; the first call waited {waited:.2f} s for it" if self.background else ""))
        self.notes.extend(self.impl.notes)
        return waited

    def before(self, verify: Callable[..., Any]) -> Callable[..., Any]:
        def verify_compiled(program: Any, inputs: list[Any], **kw: Any) -> Any:
            # candidates that did not compile are no longer pending; the wait is the
            # compile's, not the verification's (verify_s adds this call's whole time)
            program.verify_s -= self()
            program.pending = {rid: c for rid, c in program.pending.items()
                               if rid in self.impl.candidates}
            return verify(program, inputs, **kw)

        return verify_compiled


def _compile_batch(jobs: list[Any], workers: int | None, label: str,
                   shown: bool) -> tuple[list[Any], float]:
    """One graph's compile jobs, with a progress bar: (results in job order, wall seconds)."""
    from stitch_backend.toolchain import compile_many

    t0 = time.perf_counter()
    with progress.bar(len(jobs), label, "kernel", enabled=shown) as bar:
        compiled = (compile_many(jobs, max_workers=workers or None, on_done=bar.update)
                    if jobs else [])
    return compiled, time.perf_counter() - t0


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_fork_hook = False        # whether _forget_executor runs in forked children


def _background() -> ThreadPoolExecutor:
    """The one thread background compiles run on, in the order they were asked for
    (each batch uses the helper processes of ``compile_many`` already)."""
    global _executor, _fork_hook
    with _executor_lock:
        if _executor is None:
            if not _fork_hook:
                # a forked child has no copy of the thread: its compiles start another
                # (the copied executor would queue them forever)
                os.register_at_fork(after_in_child=_forget_executor)
                _fork_hook = True
            _executor = ThreadPoolExecutor(max_workers=1,
                                           thread_name_prefix="stitchcuda-compile")
        return _executor


def _forget_executor() -> None:
    global _executor, _executor_lock
    _executor, _executor_lock = None, threading.Lock()


def _settle(out: Implementation, plan: Plan, proposals: list[Candidate],
            built: list[Candidate], alternatives: list[Candidate],
            compiled: list[Any], failed: str | None = None) -> None:
    """Give each candidate and alternative its cubin, or its compile error: an
    alternative that failed is dropped (the template still races), a candidate that
    failed leaves ``out.candidates`` with the reason on its region. ``failed``: the
    whole compile raised, so every candidate leaves, with that reason."""
    from stitch_backend.toolchain import CompileError

    by_id = {r.id: r for r in plan.regions}
    if failed is not None:
        for cand in proposals:
            out.trajectory.attempts.append(Attempt("generate", cand, None))
            cand.compile_error = by_id[cand.region_id].reason = failed
        out.candidates.clear()
        return
    by_cand = {id(c): r for c, r in zip(built, compiled)}
    results = [by_cand.get(id(c)) for c in proposals]   # None: nothing to build
    for alt, result in zip(alternatives, compiled[len(built):]):
        if isinstance(result, CompileError):  # the template's own candidate still races
            out.notes.append(f"alternative {alt.name} does not compile "
                             f"({str(result).splitlines()[0]}); its region's template "
                             "races alone")
            log.warning("%s", out.notes[-1])
            alt.compile_error = str(result)
        else:
            alt.cubin, alt.compile_s = result.cubin, result.seconds
    for cand in proposals:
        cand.alternatives = [a for a in cand.alternatives if a.compile_error is None]
    own = [r.seconds for r in compiled if not isinstance(r, CompileError)]
    out.compiler_s = (sum(own), max(own, default=0.0))
    for cand, result in zip(proposals, results):
        out.trajectory.attempts.append(Attempt("generate", cand, None))
        if isinstance(result, CompileError):
            cand.compile_error = str(result)
            by_id[cand.region_id].reason = f"compile error: {str(result).splitlines()[0]}"
            del out.candidates[cand.region_id]
        elif result is not None:
            cand.cubin, cand.compile_s = result.cubin, result.seconds


# Where the candidates' cuBLASLt calls live (stitch_backend.lt_ops, lt_heads).
_CUBLASLT_MODULES = ("stitch_backend.lt_ops", "stitch_backend.lt_heads")


def _calls_cublaslt(cand: Candidate) -> bool:
    """Whether ``cand`` or one of its alternatives has a stage that calls the cuBLASLt
    runtime (so it will be loaded when the candidates are verified)."""
    for choice in (cand, *cand.alternatives):
        for stage in choice.stages or ():
            graph = getattr(stage.module, "graph", None)
            if graph is not None and any(
                    n.op == "call_function"
                    and getattr(n.target, "__module__", "") in _CUBLASLT_MODULES
                    for n in graph.nodes):
                return True
    return False
