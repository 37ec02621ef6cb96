"""The bench's outputs for people: a markdown summary and an optional speedup plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from .metrics import BASELINE, FAST_P, BackendSummary, TaskResult
from .records import OK, BenchRecord

LEGEND = ("Cells: speedup over eager in the same process (median time). "
          "No mark: within 1e-4 of eager (KernelBench's rule); "
          "`†`: misses 1e-4 of eager but is as close to fp64 as eager (DESIGN.md's rule); "
          "`✗`: incorrect by both rules.")


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def _cell(result: TaskResult, backend: str) -> str:
    rec = result.records.get(backend)
    if rec is None:
        return "—"
    if rec.status != OK:
        return rec.status
    if not rec.timed:
        return "untimed"
    if backend == BASELINE:
        return f"{rec.median_ms:.3f} ms"
    mark = "" if rec.correct_kernelbench else ("†" if rec.correct_design else " ✗")
    sp = result.speedup(backend)
    return f"{_fmt(sp, '.2f', 'x')}{mark} ({rec.median_ms:.3f} ms)"


def _compile_cell(result: TaskResult, backend: str) -> str:
    rec = result.records.get(backend)
    if rec is None or rec.status != OK or rec.cold_first_call_s is None:
        return "—" if rec is None or rec.status == OK else rec.status
    cold = f"{rec.cold_first_call_s:.2f}"
    if rec.recompile_first_call_s is None:
        return cold
    cell = f"{cold} / {rec.recompile_first_call_s:.2f}"
    if rec.recompile_backend_s is not None:
        cell += (f" (backend {rec.recompile_backend_s:.2f}"
                 f"{', cache hit' if rec.recompile_cached else ''})")
    return cell


def _gpu_cell(rec: BenchRecord | None) -> str:
    """Before -> after a backend's timing: temperature, SM clock, power (where NVML was
    read), the device's free memory, and allocations retried meanwhile ("—" unknown)."""
    if rec is None or not rec.gpu_before or not rec.gpu_after:
        return "—"
    a, b = rec.gpu_before, rec.gpu_after
    parts = [f"{a[k]:.0f} -> {b[k]:.0f} {unit}" for k, unit in
             (("temp_c", "C"), ("sm_mhz", "MHz"), ("power_w", "W")) if k in a and k in b]
    parts.append(f"{b.get('free_gib', 0):.0f} GiB free")
    retries = b.get("alloc_retries", 0) - a.get("alloc_retries", 0)
    if retries:
        parts.append(f"{retries:.0f} allocation retries")
    return ", ".join(parts)


def _notes(result: TaskResult) -> str:
    notes = []
    any_rec = next(iter(result.records.values()))
    if any_rec.clock == "cpu" or any(r.clock == "cpu" for r in result.records.values()):
        notes.append("cpu")
    det = [r for r in result.records.values() if r.eager_deterministic is not None]
    if det and not det[0].eager_deterministic:
        notes.append(f"eager nondeterministic (max diff {_fmt(det[0].determinism_max_abs, '.2g')})")
    var = [r for r in result.records.values() if r.eager_output_varies is not None]
    if var and not var[0].eager_output_varies:
        notes.append("eager output same for every input")
    notes += _hotter_card(result)
    why = next((r.sequential_why for r in result.records.values() if r.sequential_why), "")
    if why:
        notes.append(why)
    for backend, rec in result.records.items():
        traced = [g for g in (rec.backend_records or [])
                  if isinstance(g, dict) and g.get("runs_as_traced")]
        if traced:
            notes.append(f"{backend}: {len(traced)}/{len(rec.backend_records)} graph(s) run "
                         "as traced (eager guard)")
    return ", ".join(notes)


# A backend whose timing began on a card this much hotter than the first backend's is
# named in its task's notes: on an H100 (2026-12-07, L2) fp32 GEMM tasks timed last,
# 9-19 C hotter than eager's, read 3-4% slower than eager with the same cuBLAS kernel
# (heat is one explanation; --interleave tells).
HOTTER_C = 10.0


def _hotter_card(result: TaskResult) -> list[str]:
    """A note for each backend timed on a card HOTTER_C or more hotter than the first
    backend timed (none where the backends were interleaved: each round rotates them)."""
    timed = [(b, r) for b, r in result.records.items()
             if r.gpu_before and "temp_c" in r.gpu_before and not r.timing_rounds]
    if len(timed) < 2:
        return []
    first, base = timed[0][0], timed[0][1].gpu_before["temp_c"]
    return [f"{b} timed on a card {r.gpu_before['temp_c'] - base:.0f} C hotter than "
            f"{first}'s (--interleave rotates the order)" for b, r in timed[1:]
            if r.gpu_before["temp_c"] - base >= HOTTER_C]


def _field(name: str, spec: str) -> Callable[[BenchRecord | None], str]:
    return lambda rec: _fmt(getattr(rec, name, None), spec)


# The per-backend sections after the compile table: (title, intro, whether a record
# asks for the section, its cell).
_SECTIONS: list[tuple[str, str, Callable[[BenchRecord], bool],
                      Callable[[BenchRecord | None], str]]] = [
    ("Memory: MiB one call needs beyond its inputs (CUDA)", "",
     lambda rec: rec.call_peak_mb is not None, _field("call_peak_mb", ".1f")),
    ("Bandwidth: GB/s counting inputs, parameters and outputs once",
     "The least traffic a call can have over its median time: a floor on the bandwidth "
     "achieved, comparable to the copy ceiling for memory-bound problems (H200: about "
     "4300 GB/s).",
     lambda rec: rec.device == "cuda" and rec.gb_per_s is not None, _field("gb_per_s", ".0f")),
    ("Host: median ms until a timed call returned (CUDA)",
     "Its GPU work queued, not done: the call's host path (Dynamo's guards, AOTAutograd's "
     "wrappers, the backend's own launches). Each timed run starts on an idle GPU, so the "
     "part of it before the first launch is in the times above; `dynamo` shows Dynamo's "
     "share.",
     lambda rec: rec.device == "cuda" and rec.host_ms is not None, _field("host_ms", ".3f")),
    ("GPU while timing: temperature, SM clock, power, memory",
     "As each backend's timed runs began -> ended (NVML, the caching allocator); timed one "
     "after another (--no-interleave), a later backend may meet a hotter, lower-clocked "
     "card or less free memory; allocation retries are timed calls that had to return "
     "cached memory to the driver first.",
     lambda rec: bool(rec.gpu_before), _gpu_cell),
]


def _backend_table(title: str, intro: str, results: Sequence[TaskResult],
                   backends: Sequence[str], cell: Callable[[Any], str]) -> list[str]:
    """A section of one row a task and one column a backend, ``cell(record)`` in each
    (the record None where the backend has none for the task)."""
    head = ["task", *backends]
    lines = [f"## {title}", ""] + ([intro, ""] if intro else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in results:
        lines.append("| " + " | ".join([r.task, *(cell(r.records.get(b)) for b in backends)])
                     + " |")
    return lines + [""]


def _header_lines(meta: dict[str, Any]) -> list[str]:
    lines = ["# stitchcuda bench", ""]
    facts = [f"{k}: {v}" for k, v in meta.items() if v not in (None, "") and k != "machines"]
    if facts:
        lines += ["; ".join(facts), ""]
    if meta.get("machines"):
        lines += ["These tasks ran on more than one machine (a run resumed elsewhere): each "
                  "speedup compares times measured side by side in its own task's process, "
                  "but times and speedups of tasks on different cards are not comparable, "
                  "and the summary's geomeans mix the cards.", ""]
        lines += [f"- {m}" for m in meta["machines"]] + [""]
    if meta.get("caches") == "fresh":
        lines += ["Compile caches (Inductor, Triton, stitchcuda) are fresh per task and shared by "
                  "that task's backends, in the order listed: the first Inductor-family backend's "
                  "first call is a cold compile, later ones may reuse its kernels. `recompile` is "
                  "the first call after torch._dynamo.reset() with those caches warm; `backend` "
                  "is the backend's own share of it where it reports one (stitchcuda: the "
                  "warm start from its cache), the rest is Dynamo, AOTAutograd and the call.", ""]
    if meta.get("gpu_shared_by"):
        lines += [f"GPUs shared by up to {meta['gpu_shared_by']} tasks (--share-gpu): each task "
                  "held its GPU for references, checks, timing and GPU-timing compiles "
                  "(stitchcuda), so no two timings overlapped; host-only compiles (Inductor) "
                  "overlapped other tasks' turns, and every compile time was measured with "
                  "other tasks' compiles competing for the CPU. Their work on the CPU (imports, "
                  "inputs, compiles) may also slow a timed call's host path, which is inside "
                  "its time (the Host table); --jobs 1 times calls without it.", ""]
    if meta.get("device") == "cpu":
        lines += ["Timed on CPU (time.perf_counter, few runs): these numbers test the harness, "
                  "they are not the product's claim.", ""]
    return lines


def render_markdown(results: Sequence[TaskResult], summaries: Sequence[BackendSummary],
                    backends: Sequence[str], meta: dict[str, Any]) -> str:
    """The whole report: per-task table, errors, then the per-backend summary table last."""
    lines = _header_lines(meta)
    lines += ["## Tasks", "", LEGEND, ""]
    head = ["task", *backends, "notes"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in results:
        lines.append("| " + " | ".join([r.task, *(_cell(r, b) for b in backends), _notes(r)]) + " |")
    lines.append("")

    lines += ["## Compile: first call in seconds, cold / after recompile", ""]
    head = ["task", *backends]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in results:
        lines.append("| " + " | ".join([r.task, *(_compile_cell(r, b) for b in backends)]) + " |")
    lines.append("")

    recs = [rec for r in results for rec in r.records.values()]
    for title, intro, shown, cell in _SECTIONS:
        if any(shown(rec) for rec in recs):
            lines += _backend_table(title, intro, results, backends, cell)

    failed: list[tuple[str, BenchRecord]] = [
        (r.task, rec) for r in results for rec in r.records.values()
        if rec.status != OK or not (rec.correct_kernelbench or rec.correct_design)]
    if failed:
        lines += ["## Errors and incorrect results", ""]
        for task, rec in failed:
            why = rec.reason or (rec.error.strip().splitlines() or [""])[-1]
            status = "incorrect" if rec.status == OK else rec.status
            lines.append(f"- {task} / {rec.backend}: {status}: {why[:300]}")
        lines.append("")

    lines += ["## Summary", ""]
    fp_heads = [f"fast_{p:g}" for p in FAST_P]
    head = ["backend", "tasks", "correct (1e-4)", "correct (fp64 rule)", "geomean vs eager",
            "geomean vs eager (fp64 rule)", *fp_heads, "vs inductor", "cold first calls s (sum / max)",
            "errors"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for s in summaries:
        vs_ind = ("—" if s.geomean_vs_inductor is None
                  else f"{s.geomean_vs_inductor:.2f}x ({s.vs_inductor_tasks} tasks)")
        row = [s.backend, str(s.tasks), f"{s.correct_kernelbench}/{s.tasks}",
               f"{s.correct_design}/{s.tasks}", _fmt(s.geomean_vs_eager, ".2f", "x"),
               _fmt(s.geomean_vs_eager_design, ".2f", "x"),
               *(f"{s.fast_p[p]:.0%}" for p in FAST_P), vs_ind,
               f"{s.cold_first_call_s_total:.1f} / {_fmt(s.cold_first_call_s_max, '.1f')}",
               str(s.errors)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "geomean vs eager and fast_p count tasks correct by KernelBench's rule "
              "(fast_p over all tasks); vs inductor: tasks where both ran and both pass "
              "the fp64 rule."]
    return "\n".join(lines) + "\n"


def write_plot(results: Sequence[TaskResult], backends: Sequence[str], path: Path) -> str:
    """Write a per-task speedup bar chart to ``path``; returns a one-line note saying what
    was done (matplotlib is optional: without it, nothing is written and the note says so)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return (f"note: matplotlib is not installed; skipped the plot {path.name} "
                "(pip install matplotlib, or stitchcuda[bench])")
    shown = [b for b in backends if b != BASELINE]
    tasks = [r.task for r in results]
    if not shown or not tasks:
        return "note: nothing to plot (no backend other than eager, or no task)"
    from matplotlib.ticker import FuncFormatter

    width = 0.8 / len(shown)
    fig = Figure(figsize=(max(6.0, 0.35 * len(tasks) * len(shown) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, b in enumerate(shown):
        good: tuple[list[float], list[float]] = ([], [])
        wrong: tuple[list[float], list[float]] = ([], [])
        for j, r in enumerate(results):
            s = r.speedup(b)
            if s is not None:
                dest = good if r.records[b].correct_kernelbench else wrong
                dest[0].append(j + (i - (len(shown) - 1) / 2) * width)
                dest[1].append(s)
        # explicit colours: a backend with no timed task must not shift the others'
        timed = bool(good[0] or wrong[0])
        ax.bar(*good, width=width, label=b if timed else f"{b} (none timed)", color=f"C{i}")
        ax.bar(*wrong, width=width, color=f"C{i}", alpha=0.45, hatch="//")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("speedup over eager")
    ax.set_title("hatched: not within 1e-4 of eager (KernelBench's rule)", fontsize=8)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(tasks, rotation=60, ha="right", fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"
