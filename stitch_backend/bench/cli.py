"""``stitchcuda bench``: eager vs Inductor vs stitchcuda in one run, KernelBench's rules.

The main CLI calls ``add_parser(subparsers)`` and, for the ``bench`` command,
``run(args)``. ``python -m stitch_backend.bench ...`` runs the same command alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .problems import ProblemError, ProblemRef, ref_for, select_kernelbench

USAGE_ERROR = 2
SUITES = ("examples",)

DESCRIPTION = """\
Benchmark models under several backends, KernelBench's way: the module left in training
mode (--eval for inference), torch.no_grad(), fp32, weights seeded identically for every
backend. Each task runs in its own child process (all its backends in that process, so
ratios are side by side), with a timeout; a crash costs that task's rows only.
Correctness: --trials fresh input draws; KernelBench's rule (atol=rtol=1e-4 vs eager) and
DESIGN.md's (as close to an fp64 run as eager is), plus an eager-vs-eager determinism
control. Loading a problem file executes it (it is your model).
Timing: CUDA events, warm-up, L2 flushed, median and p10/p90 (CPU: perf_counter, marked
"cpu"). Compile: the first call of a fresh compile ("cold", with --caches fresh), and
the first call after torch._dynamo.reset() in the same process ("recompile", compile
caches warm); a backend that keeps its own report (stitchcuda's `records`) has it
copied into the record.

Outputs in --out: results.jsonl (one record per task and backend), summary.md (also
printed last), speedups.png (if matplotlib is installed)."""


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("problems (any combination)")
    src.add_argument("files", nargs="*", metavar="FILE",
                     help="KernelBench-format .py files, or package.module:factory "
                          "(factory() returns (model, inputs))")
    src.add_argument("--kernelbench", metavar="DIR",
                     help="a KernelBench checkout (tasks in DIR/KernelBench/levelN/*.py)")
    src.add_argument("--level", type=int, metavar="N", help="KernelBench level (with --kernelbench)")
    src.add_argument("--problems", metavar="SPEC",
                     help="task numbers within the level, e.g. 1-20,25 (default: all)")
    src.add_argument("--suite", choices=SUITES, help="a bundled suite: 'examples' (stitch_backend/examples)")
    p.add_argument("--backends", default="eager,inductor,stitchcuda",
                   help="comma list from eager, inductor, inductor-reduce-overhead, "
                        "inductor-max-autotune, stitchcuda, aot_eager (or any Dynamo backend); "
                        "NAME:KEY=VALUE+KEY=VALUE passes options, e.g. "
                        "stitchcuda:split_stats=1 beside stitchcuda; "
                        "eager always runs, as the baseline; eager-again times eager once more "
                        "after the others, in the same process, as a noise control; dynamo is "
                        "torch.compile's own per-call cost (Dynamo with its eager backend) "
                        "(default: %(default)s)")
    p.add_argument("--eval", action="store_true", help="model.eval() (default: training mode, as KernelBench)")
    p.add_argument("--training", action="store_true",
                   help="time a training step instead of a forward under no_grad: forward, "
                        "the outputs weighted by fixed random tensors and summed, backward; "
                        "outputs and parameter gradients are checked")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default="",
                   help="run the forwards under torch.autocast to this dtype (the fp64 "
                        "reference model without)")
    p.add_argument("--trials", type=int, default=5, help="correctness input draws (default: %(default)s)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default: 100 on cuda, 10 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default: 10 on cuda, 2 on cpu)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per task (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="tasks run at once, each in its own process; on CUDA each gets its own "
                        "GPU, so N needs N GPUs unless --share-gpu (default: %(default)s)")
    p.add_argument("--share-gpu", action="store_true",
                   help="with --jobs N above the GPU count: tasks share GPUs and take turns on "
                        "them (references, checks, timing and stitchcuda's compile hold the "
                        "GPU; Inductor's compile overlaps others' work): faster runs, compile "
                        "times measured under CPU contention; the summary says so. A task "
                        "that runs out of GPU memory beside the others runs again alone "
                        "after them")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: ./bench-out)")
    p.add_argument("--resume", action="store_true",
                   help="skip tasks already in OUT/results.jsonl with every requested backend")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite summary.md and the plot from OUT/results.jsonl "
                        "(e.g. after concatenating the results of runs made in chunks); "
                        "problems selected as usual, or all in the file when none are given")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=42, help="weight seed (default: %(default)s, as KernelBench)")
    p.add_argument("--caches", choices=("fresh", "keep"), default="fresh",
                   help="fresh: per-task empty Inductor/Triton/stitchcuda caches, so the first "
                        "call is a cold compile; keep: use the environment's (default: %(default)s)")
    p.add_argument("--no-recompile", action="store_true",
                   help="skip the in-process recompile timing (torch._dynamo.reset() + first call)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="compile and check every backend of a task first, then time them in "
                        "rounds that rotate their order, so that a card drifting during the "
                        "task weighs on all alike (default; all backends stay in memory at "
                        "once, and a task out of GPU memory so is timed again sequentially). "
                        "--no-interleave: each backend compiled and timed after the one before")
    p.add_argument("--no-plot", action="store_true", help="do not write speedups.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-task lines")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``bench`` command on the main CLI's subparsers; sets ``func=run``."""
    p = subparsers.add_parser("bench", help="eager vs Inductor vs stitchcuda on KernelBench-format problems",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _select(args: argparse.Namespace, allow_none: bool = False) -> list[ProblemRef]:
    refs: list[ProblemRef] = [ref_for(f) for f in args.files]
    if args.kernelbench:
        if args.level is None:
            raise ProblemError("--kernelbench", "needs --level N")
        refs += select_kernelbench(args.kernelbench, args.level, args.problems)
    elif args.level is not None or args.problems:
        raise ProblemError("--level/--problems", "only meaningful with --kernelbench DIR")
    if args.suite == "examples":
        from stitch_backend.examples import list_examples
        refs += [ProblemRef(name=f"examples/{p.stem}", spec=str(p)) for p in list_examples()]
    seen: dict[str, str] = {}
    for r in refs:
        if r.name in seen and seen[r.name] != r.spec:
            raise ProblemError(r.spec, f"two problems named {r.name!r} ({seen[r.name]}); "
                                       "bench them in separate runs")
        seen[r.name] = r.spec
    unique = list({r.name: r for r in refs}.values())
    if not unique and not allow_none:
        raise ProblemError("bench", "no problems: give FILEs, --kernelbench DIR --level N, or --suite examples")
    return unique


def run(args: argparse.Namespace) -> int:
    """Run the bench from parsed arguments. Returns 0 when the run completed (failed tasks
    are rows, not failures of the run), 2 on a usage error (said on stderr)."""
    import torch

    from .backends import UnknownBackendError, validate_backends
    from .runner import BenchConfig, run_bench

    try:
        problems = _select(args, allow_none=args.report_only)
        backends = validate_backends(args.backends.split(","))
    except (ProblemError, UnknownBackendError, ValueError) as exc:
        print(f"stitchcuda bench: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if args.report_only and not (args.out / "results.jsonl").exists():
        print(f"stitchcuda bench: error: --report-only: no {args.out / 'results.jsonl'}", file=sys.stderr)
        return USAGE_ERROR
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.report_only:
        print("stitchcuda bench: error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return USAGE_ERROR
    on_gpu = device == "cuda"
    if args.jobs < 1:
        print("stitchcuda bench: error: --jobs must be positive", file=sys.stderr)
        return USAGE_ERROR
    gpus = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and args.jobs > 1 and args.jobs > gpus and not args.share_gpu:
        print(f"stitchcuda bench: error: --jobs {args.jobs} needs {args.jobs} GPUs (one per "
              f"task, so timings do not mix); torch sees {gpus} (--share-gpu lets tasks take "
              "turns on one)", file=sys.stderr)
        return USAGE_ERROR
    for flag in ("trials", "runs", "warmup"):
        v = getattr(args, flag)
        if v is not None and v < (0 if flag == "warmup" else 1):
            print(f"stitchcuda bench: error: --{flag} must be positive", file=sys.stderr)
            return USAGE_ERROR
    if args.eval and args.training:
        print("stitchcuda bench: error: --eval and --training exclude each other (a training "
              "step runs the module in training mode)", file=sys.stderr)
        return USAGE_ERROR
    cfg = BenchConfig(
        backends=backends, device=device,
        mode="eval" if args.eval else ("train-step" if args.training else "train"),
        autocast=args.autocast,
        trials=args.trials,
        runs=args.runs if args.runs is not None else (100 if on_gpu else 10),
        warmup=args.warmup if args.warmup is not None else (10 if on_gpu else 2),
        timeout_s=args.timeout, out_dir=args.out, resume=args.resume, seed=args.seed,
        caches=args.caches, recompile=not args.no_recompile, interleave=args.interleave,
        plot=not args.no_plot,
        progress=not args.no_progress, report_only=args.report_only, jobs=args.jobs,
        share_gpu=on_gpu and args.share_gpu and args.jobs > gpus,
        gpus=gpus)
    try:
        result = run_bench(cfg, problems)
    except KeyboardInterrupt:
        print(f"stitchcuda bench: interrupted; finished tasks are in {args.out / 'results.jsonl'} "
              "(the same command with --resume goes on)", file=sys.stderr)
        return 130
    for note in result.notes:
        print(note)
    print(result.plot_note)
    print(f"records: {result.results_path}\nsummary: {result.summary_path}\n")
    print(result.markdown, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m stitch_backend.bench``)."""
    parser = argparse.ArgumentParser(prog="stitchcuda")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run(args)
