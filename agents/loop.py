"""The agent loop for one graph: Planner's plan -> Coder -> compile -> (Verifier at first call).

Candidates are compiled in parallel; a region whose candidate cannot be produced or
compiled stays on ATen with the reason written into the Plan. Verification needs real
inputs, so it happens on the Program's first call (``stitch_backend.program``), which
calls back into ``agents.acceptance``. With ``coder="template+llm"`` the LLM Coder adds
untrusted candidates beside the template's there, once the regions' ATen times on the
real inputs rank them (``agents.llm_extras``, ``agents.hotspots``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

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
              compile: bool = True, config: Any = None) -> Implementation:
    """Propose and compile a candidate for every region the templates cover
    (``compile=False``: propose only, for the CPU interpreter); ``config`` (default: the
    process settings) says whether the split-statistics variants are proposed."""
    from stitch_backend.toolchain import (CompileError, CompileJob, compile_many, csrc_dir,
                                          has_clusters)

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

    if not compile:
        out = Implementation(trajectory=trajectory, subtasks=subtasks)
        for cand in proposals:
            out.candidates[cand.region_id] = cand
            trajectory.attempts.append(Attempt("generate", cand, None))
        return out
    t0 = time.perf_counter()
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
    with progress.bar(len(jobs), f"compiling {task.graph}", "kernel",
                      enabled=cfg.progress) as shown:
        compiled = compile_many(jobs, max_workers=workers or None,
                                on_done=shown.update) if jobs else []
    by_cand = {id(c): r for c, r in zip(built, compiled)}
    results = [by_cand.get(id(c)) for c in proposals]   # None: nothing to build
    alt_results = compiled[len(built):]
    notes = []
    for alt, result in zip(alternatives, alt_results):
        if isinstance(result, CompileError):  # the template's own candidate still races
            notes.append(f"alternative {alt.name} does not compile "
                         f"({str(result).splitlines()[0]}); its region's template races alone")
            log.warning("%s", notes[-1])
            alt.compile_error = str(result)
        else:
            alt.cubin, alt.compile_s = result.cubin, result.seconds
    for cand in proposals:
        cand.alternatives = [a for a in cand.alternatives if a.compile_error is None]
    own = [r.seconds for r in compiled if not isinstance(r, CompileError)]
    out = Implementation(trajectory=trajectory, compile_s=time.perf_counter() - t0, notes=notes,
                         subtasks=subtasks, compiled=(len(built), len(alternatives)),
                         compiler_s=(sum(own), max(own, default=0.0)))
    by_id = {r.id: r for r in plan.regions}
    for cand, result in zip(proposals, results):
        if isinstance(result, CompileError):
            cand.compile_error = str(result)
            by_id[cand.region_id].reason = f"compile error: {str(result).splitlines()[0]}"
            trajectory.attempts.append(Attempt("generate", cand, None))
            continue
        if result is not None:
            cand.cubin, cand.compile_s = result.cubin, result.seconds
        out.candidates[cand.region_id] = cand
        trajectory.attempts.append(Attempt("generate", cand, None))
    return out


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
