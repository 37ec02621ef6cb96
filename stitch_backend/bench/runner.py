"""Drive a bench run: one child process per task, records appended, summary at the end.

A task that crashes, hangs past its timeout or raises costs its own rows, never the
run. Each child may get fresh compile caches (``caches="fresh"``: Inductor, Triton and
stitchcuda cache directories in a temporary folder removed afterwards), so the first
call's time is a cold compile; ``caches="keep"`` leaves the environment's caches alone
(a warm-start measurement when they are already filled).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .metrics import BackendSummary, TaskResult, latest_runs, machine_runs, summarise
from .problems import ProblemRef
from .records import CRASH, TIMEOUT, BenchRecord, append_records, read_records
from .report import render_markdown, write_plot
from .turns import GPU_SHARED_ENV, GPU_TURN_ENV
from .worker import TaskConfig

log = logging.getLogger("stitch_backend.bench.runner")

RESULTS_NAME = "results.jsonl"
SUMMARY_NAME = "summary.md"
PLOT_NAME = "speedups.png"
STDERR_TAIL_CHARS = 4000


@dataclass
class BenchConfig:
    """A whole run's settings (the CLI's flags, resolved)."""

    backends: list[str]              # eager first (validate_backends ensures it)
    device: str = "cpu"
    mode: str = "train"
    trials: int = 5
    runs: int = 10
    warmup: int = 2
    timeout_s: float = 600.0
    out_dir: Path = Path("bench-out")
    resume: bool = False
    report_only: bool = False        # run nothing: summarise OUT/results.jsonl as it is
    seed: int = 42
    caches: str = "fresh"            # "fresh" or "keep"
    recompile: bool = True
    interleave: bool = True          # compile every backend, then time in rotating rounds
    autocast: str = ""               # "bf16"/"fp16": forwards under torch.autocast
    plot: bool = True
    progress: bool = True
    python: str = sys.executable
    jobs: int = 1                    # tasks run at once; on CUDA, one GPU each
    share_gpu: bool = False          # more jobs than GPUs: tasks on one GPU take turns
    gpus: int = 0                    # GPUs torch sees (CUDA)


@dataclass
class BenchResult:
    """What a run produced; ``markdown`` is also in ``summary_path``."""

    results: list[TaskResult]
    summaries: list[BackendSummary]
    markdown: str
    results_path: Path
    summary_path: Path
    plot_note: str
    skipped: list[str] = field(default_factory=list)     # tasks skipped by --resume
    notes: list[str] = field(default_factory=list)


def _package_root() -> Path:
    import stitch_backend
    return Path(stitch_backend.__file__).resolve().parent.parent


@dataclass(frozen=True)
class Slot:
    """Where one of ``--jobs N`` runs its tasks: a GPU (None: the default device), and
    when the GPU is shared with other slots, the lock file its tasks take turns by."""

    gpu: str | None = None
    turn_lock: str | None = None
    shared_by: int = 1


def _child_env(cfg: BenchConfig, tmp: Path, slot: Slot = Slot()) -> dict[str, str]:
    env = dict(os.environ)
    if slot.gpu is not None:         # parallel CUDA tasks: each child sees its own GPU
        env["CUDA_VISIBLE_DEVICES"] = slot.gpu
    if slot.turn_lock is not None:
        env[GPU_TURN_ENV] = slot.turn_lock
        env[GPU_SHARED_ENV] = str(slot.shared_by)
        # Compiles overlap other tasks' timing: leave the timing process cores of its own.
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // (cfg.jobs + 1)))
    # The child must import this same stitch_backend even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_package_root()), env.get("PYTHONPATH")) if p)
    if cfg.caches == "fresh":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
        env["STITCHCUDA_CACHE_DIR"] = str(tmp / "stitchcuda-cache")
    return env


def _tail(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-STDERR_TAIL_CHARS:]
    except OSError:
        return ""


def run_task_process(cfg: BenchConfig, ref: ProblemRef, task_run: str,
                     slot: Slot = Slot()) -> list[BenchRecord]:
    """Run one task in a child process (on ``slot``'s GPU when it names one); a record
    for every backend, the child's own or a timeout/crash record carrying the tail of
    its stderr."""
    task_cfg = TaskConfig(spec=ref.spec, name=ref.name, backends=list(cfg.backends),
                          device=cfg.device, mode=cfg.mode, trials=cfg.trials, runs=cfg.runs,
                          warmup=cfg.warmup, seed=cfg.seed, task_run=task_run,
                          caches=cfg.caches, recompile=cfg.recompile,
                          interleave=cfg.interleave, autocast=cfg.autocast)
    with tempfile.TemporaryDirectory(prefix="stitchcuda-bench-") as tmp_name:
        tmp = Path(tmp_name)
        out = tmp / "records.jsonl"
        # -P: the child must import the installed package, not a source tree in the cwd
        # (agents/ and cache/ only become stitch_backend.* when installed).
        cmd = [cfg.python, "-P", "-m", "stitch_backend.bench.worker", *task_cfg.to_argv(out)]
        t0 = time.monotonic()
        with (tmp / "stdout.txt").open("wb") as so, (tmp / "stderr.txt").open("wb") as se:
            # Its own session, so a timeout kills the child and anything it started (nvcc).
            proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=_child_env(cfg, tmp, slot),
                                    start_new_session=True)
            timed_out = False
            with _LIVE.tracking(proc):
                try:
                    rc = proc.wait(timeout=cfg.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc)
                    rc = proc.wait()
                except BaseException:          # Ctrl-C: leave no orphan behind
                    _kill_group(proc)
                    proc.wait()
                    raise
        wall = time.monotonic() - t0
        records = read_records(out)
        tail = _tail(tmp / "stderr.txt") or _tail(tmp / "stdout.txt")
    have = {r.backend for r in records}
    for b in cfg.backends:
        if b in have:
            continue
        if timed_out:
            status, reason = TIMEOUT, f"task ran past --timeout {cfg.timeout_s:g} s (killed after {wall:.0f} s)"
        else:
            status = CRASH
            reason = (f"worker exited with {_describe_rc(rc)} before writing this record")
        records.append(BenchRecord(task=ref.name, spec=ref.spec, backend=b, status=status,
                                   device=cfg.device, mode=cfg.mode,
                                   autocast=cfg.autocast, task_run=task_run,
                                   caches=cfg.caches, trials=cfg.trials, reason=reason,
                                   error=tail, time_unix=time.time()))
    order = {b: i for i, b in enumerate(cfg.backends)}
    return sorted(records, key=lambda r: order.get(r.backend, len(order)))


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


class _LiveChildren:
    """The task children running now, so that Ctrl-C in the main thread can kill those
    that worker threads of ``--jobs N`` are waiting on (a signal reaches only the main
    thread)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def tracking(self, proc: subprocess.Popen) -> Iterator[None]:
        with self._lock:
            self._procs.add(proc)
        try:
            yield
        finally:
            with self._lock:
                self._procs.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            _kill_group(proc)


_LIVE = _LiveChildren()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # our child's own session, nothing else
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _done_tasks(records: list[BenchRecord], cfg: BenchConfig) -> set[str]:
    """Tasks whose last run covered every requested backend on this device, mode and
    autocast."""
    done = set()
    for r in latest_runs(records):
        recs = r.records
        if all(b in recs for b in cfg.backends) and all(
                x.device == cfg.device and x.mode == cfg.mode and x.autocast == cfg.autocast
                for x in recs.values()):
            done.add(r.task)
    return done


def _one_line(result: Sequence[BenchRecord]) -> str:
    by = {r.backend: r for r in result}
    parts = []
    eager = by.get("eager")
    for b, r in by.items():
        if r.status != "ok":
            parts.append(f"{b} {r.status}")
        elif b == "eager":
            parts.append(f"eager {r.median_ms:.3f} ms" if r.timed else "eager untimed")
        elif eager is not None and eager.timed and r.timed:
            mark = "" if r.correct_kernelbench else ("†" if r.correct_design else " WRONG")
            parts.append(f"{b} {eager.median_ms / r.median_ms:.2f}x{mark}")
        else:
            parts.append(f"{b} ran")
    return ", ".join(parts)


def _plan(cfg: BenchConfig, problems: list[ProblemRef],
          results_path: Path) -> tuple[list[ProblemRef], list[ProblemRef], list[str], list[str]]:
    """(problems to report, problems to run, skipped task names, notes)."""
    notes: list[str] = []
    if cfg.report_only:
        existing = read_records(results_path)
        if not problems:                 # every task in the file, in its order
            problems = [ProblemRef(r.task, next(iter(r.records.values())).spec)
                        for r in latest_runs(existing)]
        have = {r.task for r in existing}
        missing = [p.name for p in problems if p.name not in have]
        if missing:
            notes.append(f"--report-only: {len(missing)} selected task(s) have no records")
        return problems, [], [p.name for p in problems], notes
    if results_path.exists() and not cfg.resume:
        kept = results_path.with_name(f"results-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        results_path.rename(kept)
        notes.append(f"previous results moved to {kept} (use --resume to continue them)")
    done = _done_tasks(read_records(results_path), cfg) if cfg.resume else set()
    skipped = [p.name for p in problems if p.name in done]
    if skipped:
        notes.append(f"--resume: {len(skipped)} task(s) already in {results_path.name}, skipped")
    return problems, [p for p in problems if p.name not in done], skipped, notes


def run_bench(cfg: BenchConfig, problems: Sequence[ProblemRef]) -> BenchResult:
    """Benchmark ``problems`` under ``cfg``: records to ``out_dir/results.jsonl``, the
    markdown summary to ``out_dir/summary.md``, the plot to ``out_dir/speedups.png``."""
    from tqdm import tqdm

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results_path = cfg.out_dir / RESULTS_NAME
    problems, todo, skipped, notes = _plan(cfg, list(problems), results_path)

    bar = tqdm(total=len(todo), desc="bench", unit="task", file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True)

    def finished(ref: ProblemRef, recs: list[BenchRecord]) -> None:
        append_records(results_path, recs)
        line = f"{ref.name}: {_one_line(recs)}"
        log.info(line)
        bar.update(1)
        if cfg.progress:
            bar.write(line, file=sys.stderr)

    if cfg.jobs <= 1:
        for ref in todo:
            bar.set_postfix_str(ref.name)
            finished(ref, run_task_process(cfg, ref, _task_run_id()))
    else:
        _run_parallel(cfg, todo, finished)
    bar.close()

    # The summary covers the selected tasks, read back from the file (resumed ones too).
    pos = {p.name: i for i, p in enumerate(problems)}
    results = sorted((r for r in latest_runs(read_records(results_path)) if r.task in pos),
                     key=lambda r: pos[r.task])
    backends = list(cfg.backends)
    if cfg.report_only:                  # the records say which backends ran
        seen = {b for r in results for b in r.records}
        backends = ([b for b in backends if b in seen]
                    + sorted(seen - set(backends), key=lambda b: (b != "eager", b)))
    summaries = summarise(results, backends)
    markdown = render_markdown(results, summaries, backends, _meta(cfg, results))
    summary_path = cfg.out_dir / SUMMARY_NAME
    summary_path.write_text(markdown, encoding="utf-8")
    plot_note = (write_plot(results, backends, cfg.out_dir / PLOT_NAME)
                 if cfg.plot else "plot: disabled")
    return BenchResult(results, summaries, markdown, results_path, summary_path,
                       plot_note, skipped, notes)


def _task_run_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def _run_parallel(cfg: BenchConfig, todo: Sequence[ProblemRef],
                  finished: Callable[[ProblemRef, list[BenchRecord]], None]) -> None:
    """``cfg.jobs`` tasks at once, each in its own child; on CUDA each slot owns one GPU
    (CUDA_VISIBLE_DEVICES), so no two timed tasks share a device, unless ``share_gpu``,
    where slots on one GPU take turns on it. Records are written as tasks finish, one
    task at a time."""
    slots: queue.SimpleQueue = queue.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="stitchcuda-bench-turns-") as turns:
        for slot in plan_slots(cfg, Path(turns)):
            slots.put(slot)
        _run_slots(cfg, todo, finished, slots)


def plan_slots(cfg: BenchConfig, turns: Path) -> list[Slot]:
    """One Slot per job: GPUs in the order CUDA_VISIBLE_DEVICES lists them (or 0..n-1),
    dealt round-robin when ``share_gpu``; a shared GPU gets a lock file under ``turns``."""
    if cfg.device != "cuda":
        return [Slot() for _ in range(cfg.jobs)]
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    n = len(visible) or max(cfg.gpus, 1)
    names = visible or [str(i) for i in range(n)]
    if not cfg.share_gpu:
        return [Slot(gpu=names[i] if i < len(names) else str(i)) for i in range(cfg.jobs)]
    chosen = [names[i % n] for i in range(cfg.jobs)]
    out = []
    for gpu in chosen:
        k = chosen.count(gpu)
        out.append(Slot(gpu=gpu, turn_lock=str(turns / f"gpu{gpu}.lock") if k > 1 else None,
                        shared_by=k))
    return out


OUT_OF_MEMORY = "OutOfMemoryError"   # in a record's error: the task ran out of GPU memory


def _run_slots(cfg: BenchConfig, todo: Sequence[ProblemRef],
               finished: Callable[[ProblemRef, list[BenchRecord]], None],
               slots: queue.SimpleQueue) -> None:
    lock = threading.Lock()
    stopping = threading.Event()
    alone: list[tuple[ProblemRef, Slot]] = []   # out of GPU memory: run again (_rerun)

    def one(ref: ProblemRef) -> None:
        if stopping.is_set():
            return
        slot = slots.get()
        try:
            recs = run_task_process(cfg, ref, _task_run_id(), slot)
        finally:
            slots.put(slot)
        with lock:
            if stopping.is_set():      # a child killed by Ctrl-C is no result: --resume reruns it
                return
            if any(OUT_OF_MEMORY in r.error for r in recs) and (slot.shared_by > 1
                                                                or cfg.interleave):
                alone.append((ref, slot))
                log.warning("%s: out of GPU memory %s after the others", ref.name,
                            "while sharing the GPU; it runs again alone" if slot.shared_by > 1
                            else "with every backend held at once; it runs again with its "
                                 "backends one after another")
            else:
                finished(ref, recs)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.jobs)
    futures = [pool.submit(one, ref) for ref in todo]
    try:
        for fut in futures:
            fut.result()
    except BaseException:
        stopping.set()
        for fut in futures:
            fut.cancel()
        _LIVE.kill_all()
        raise
    finally:
        pool.shutdown(wait=True)
    # A shared GPU's memory is what the other tasks left free (their models, inputs and
    # references stay allocated while they wait their turn): KernelBench L1's 6 GiB
    # tensors ran out of memory beside two others on an 80 GiB H100.
    for ref, slot in alone:
        finished(ref, _rerun(cfg, ref, slot))


# Asked to interleave, a task out of GPU memory with the GPU to itself is timed again
# with its backends one after another (one held at a time): KernelBench L1 63 (an 8 GiB
# output, eager and stitchcuda held at once) ran out of memory on an 80 GiB H100.
SEQUENTIAL_WHY = "out of GPU memory with every backend held at once: timed one after another"


def _rerun(cfg: BenchConfig, ref: ProblemRef, slot: Slot) -> list[BenchRecord]:
    """``ref`` again after it ran out of GPU memory on ``slot``: first with the GPU to
    itself (where ``slot`` shared it), then, where it was interleaved and still runs out,
    with its backends one after another, its records saying so (``sequential_why``)."""
    alone = Slot(gpu=slot.gpu)
    if slot.shared_by > 1:
        recs = run_task_process(cfg, ref, _task_run_id(), alone)
        if not (cfg.interleave and any(OUT_OF_MEMORY in r.error for r in recs)):
            return recs
        log.warning("%s: out of GPU memory alone with every backend held at once; it runs "
                    "again with the backends one after another", ref.name)
    recs = run_task_process(replace(cfg, interleave=False), ref, _task_run_id(), alone)
    for r in recs:
        r.sequential_why = SEQUENTIAL_WHY
    return recs


def _meta(cfg: BenchConfig, results: Sequence[TaskResult]) -> dict[str, object]:
    env: dict[str, object] = {}
    first: BenchRecord | None = None
    for r in results:
        for rec in r.records.values():
            first = first or rec
            if rec.env:
                env = rec.env
                break
        if env:
            break
    machines = machine_runs(results)
    if len(machines) > 1:   # a resumed run that went on elsewhere: say which tasks ran where
        env = {**env, "gpu": "several (below)", "torch": None}
    meta = _meta_facts(cfg, results, first, env)
    if len(machines) > 1:
        meta["machines"] = [m.describe() for m in machines]
    return meta


def _meta_facts(cfg: BenchConfig, results: Sequence[TaskResult], first: BenchRecord | None,
                env: dict[str, object]) -> dict[str, object]:
    if cfg.report_only and first is not None:     # describe the run that made the records
        return {"device": first.device, "gpu": env.get("gpu"), "torch": env.get("torch"),
                "triton": env.get("triton"), "mode": first.mode,
                "autocast": first.autocast or None, "trials": first.trials,
                "caches": first.caches, "tasks": len(results), "report": "--report-only",
                "gpu_shared_by": max((rec.env.get("gpu_shared_by") or 0 for r in results
                                      for rec in r.records.values()), default=0) or None}
    return {"device": cfg.device, "gpu": env.get("gpu"), "torch": env.get("torch"),
            "triton": env.get("triton"), "mode": cfg.mode, "autocast": cfg.autocast or None,
            "trials": cfg.trials,
            "runs": cfg.runs, "caches": cfg.caches, "tasks": len(results),
            "gpu_shared_by": _shared_by(cfg),
            "timing": "interleaved rounds" if cfg.interleave else None}


def _shared_by(cfg: BenchConfig) -> int | None:
    """How many tasks took turns on one GPU at most (None: each had its own)."""
    if not cfg.share_gpu:
        return None
    return -(-cfg.jobs // max(cfg.gpus, 1))
