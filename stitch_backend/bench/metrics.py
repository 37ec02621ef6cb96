"""Metrics over bench records: correct counts, geomean speedups, KernelBench's fast_p.

Ratios are only formed between records of one ``task_run`` (one child process), so
every speedup compares times measured side by side. When a task was run more than once
(``--resume`` after adding a backend, or a re-run), its last run counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .records import BenchRecord

FAST_P = (0.0, 1.0, 1.5, 2.0)
BASELINE = "eager"
INDUCTOR = "inductor"


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values; None for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    if any(v <= 0 for v in vals):
        raise ValueError(f"geomean needs positive values, got {min(vals)}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def fast_p(correct: Sequence[bool], speedups: Sequence[float | None], p: float) -> float:
    """KernelBench's fast_p: the fraction of ALL tasks that are correct and have
    speedup > p (so fast_0 is the fraction correct and timed). 0.0 for no tasks."""
    if len(correct) != len(speedups):
        raise ValueError("correct and speedups differ in length")
    if not correct:
        return 0.0
    hits = sum(1 for c, s in zip(correct, speedups) if c and s is not None and s > p)
    return hits / len(correct)


@dataclass
class TaskResult:
    """One task's records from one child process, by backend."""

    task: str
    task_run: str
    records: dict[str, BenchRecord]

    def speedup(self, backend: str, over: str = BASELINE) -> float | None:
        """``over``'s median time / ``backend``'s, when both were timed in this run."""
        a, b = self.records.get(over), self.records.get(backend)
        if a is None or b is None or not a.timed or not b.timed:
            return None
        return a.median_ms / b.median_ms


def latest_runs(records: Iterable[BenchRecord]) -> list[TaskResult]:
    """Per task (in order of first appearance), the records of its last ``task_run``."""
    order: list[str] = []
    last_run: dict[str, str] = {}
    by_run: dict[tuple[str, str], dict[str, BenchRecord]] = {}
    for rec in records:
        if rec.task not in last_run:
            order.append(rec.task)
        last_run[rec.task] = rec.task_run
        by_run.setdefault((rec.task, rec.task_run), {})[rec.backend] = rec
    return [TaskResult(t, last_run[t], by_run[(t, last_run[t])]) for t in order]


@dataclass
class BackendSummary:
    """One backend over all tasks. Speedups are geomeans of eager time / backend time."""

    backend: str
    tasks: int
    timed: int
    errors: int
    correct_kernelbench: int
    correct_design: int
    geomean_vs_eager: float | None          # over tasks correct by KernelBench's rule
    geomean_vs_eager_design: float | None   # over tasks correct by DESIGN.md's rule
    fast_p: dict[float, float] = field(default_factory=dict)   # KernelBench's rule
    geomean_vs_inductor: float | None = None  # tasks where both ran, both correct (DESIGN rule)
    vs_inductor_tasks: int = 0
    cold_first_call_s_total: float = 0.0     # sum over tasks that ran (compile included)
    cold_first_call_s_max: float | None = None


def summarise(results: Sequence[TaskResult], backends: Sequence[str]) -> list[BackendSummary]:
    """A ``BackendSummary`` per backend over ``results`` (a task missing a backend's
    record counts as not correct, as in KernelBench)."""
    out: list[BackendSummary] = []
    for b in backends:
        recs = [r.records.get(b) for r in results]
        sp = [r.speedup(b) for r in results]
        ok_kb = [bool(x is not None and x.timed and x.correct_kernelbench) for x in recs]
        ok_d = [bool(x is not None and x.timed and x.correct_design) for x in recs]
        vs_ind: list[float] = []
        if b != INDUCTOR:
            for r, good in zip(results, ok_d):
                ind = r.records.get(INDUCTOR)
                s = r.speedup(b, over=INDUCTOR)
                if good and ind is not None and ind.correct_design and s is not None:
                    vs_ind.append(s)
        cold = [x.cold_first_call_s for x in recs
                if x is not None and x.status == "ok" and x.cold_first_call_s is not None]
        out.append(BackendSummary(
            backend=b,
            tasks=len(results),
            timed=sum(1 for x in recs if x is not None and x.timed),
            errors=sum(1 for x in recs if x is None or x.status != "ok"),
            correct_kernelbench=sum(ok_kb),
            correct_design=sum(ok_d),
            geomean_vs_eager=geomean(s for s, c in zip(sp, ok_kb) if c and s is not None),
            geomean_vs_eager_design=geomean(s for s, c in zip(sp, ok_d) if c and s is not None),
            fast_p={p: fast_p(ok_kb, sp, p) for p in FAST_P},
            geomean_vs_inductor=geomean(vs_ind),
            vs_inductor_tasks=len(vs_ind),
            cold_first_call_s_total=sum(cold),
            cold_first_call_s_max=max(cold) if cold else None,
        ))
    return out


@dataclass(frozen=True)
class MachineRun:
    """Consecutive tasks (in the results' order) whose records name one machine: its GPU
    (or None: a CPU run) and torch version."""

    gpu: str | None
    torch: str | None
    first: str
    last: str
    tasks: int

    def describe(self) -> str:
        what = f"{self.gpu or 'no GPU'}, torch {self.torch or '?'}"
        span = self.first if self.tasks == 1 else f"{self.first} .. {self.last}"
        return f"{what}: {self.tasks} task(s), {span}"


def machine_runs(results: Sequence[TaskResult]) -> list[MachineRun]:
    """The machines ``results`` ran on, as runs of consecutive tasks: one entry for a
    run on one machine; several where ``--resume`` went on elsewhere (every ratio is
    still side by side within its task, but times and speedups of tasks on different
    cards are not comparable)."""
    out: list[MachineRun] = []
    for r in results:
        env = next((rec.env for rec in r.records.values() if rec.env), None)
        if env is None:
            continue
        key = (env.get("gpu"), env.get("torch"))
        if out and (out[-1].gpu, out[-1].torch) == key:
            last = out[-1]
            out[-1] = MachineRun(last.gpu, last.torch, last.first, r.task, last.tasks + 1)
        else:
            out.append(MachineRun(key[0], key[1], r.task, r.task, 1))
    return out
