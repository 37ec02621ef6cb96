"""The ``stitchcuda`` command line: doctor, explain, demo, cache, warmup, bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from .exc import StitchError


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose, render

    report = diagnose()
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0 if report.healthy else 1


def _cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain_problem
    from .report import render_json, render_text

    explanation = explain_problem(args.file, arch=args.arch, training=args.training,
                                  emit_dir=Path(args.emit_dir) if args.emit_dir else None)
    if args.json:
        data = render_json(explanation.records)
        data["dynamo_graphs"] = explanation.dynamo_graphs
        data["emitted"] = [e.__dict__ for e in explanation.emitted]
        print(json.dumps(data, indent=2))
    else:
        print(render_text(explanation.records, dynamo_graphs=explanation.dynamo_graphs))
        if args.emit_dir:
            written = [e for e in explanation.emitted if e.path]
            print(f"\nemitted {len(written)} CUDA source(s) to {args.emit_dir}")
            for e in explanation.emitted:
                if not e.path:
                    print(f"  graph {e.graph} region {e.region}: not generated: {e.reason}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.example, device=args.device)


def _add_optional(sub: argparse._SubParsersAction, module: str) -> None:
    """Subcommands that live in their own modules (each has add_parser and run)."""
    import importlib

    try:
        mod = importlib.import_module(module, __package__)
    except ImportError:
        return
    before = set(sub.choices)
    mod.add_parser(sub)
    for name in set(sub.choices) - before:
        if sub.choices[name].get_default("func") is None:
            sub.choices[name].set_defaults(func=mod.run)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input, shown as one line rather than a traceback."""
    errors: list[type[BaseException]] = [StitchError]
    try:
        from .bench.problems import ProblemError

        errors.append(ProblemError)
    except ImportError:
        pass
    return tuple(errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stitchcuda",
        description="A PyTorch compiler backend of verified, fused CUDA kernels. "
                    "Use it with torch.compile(model, backend='stitchcuda').")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("doctor", help="check torch, CUDA, the GPU, nvcc and the cache")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("explain", help="show the plan for a model (no GPU needed)")
    p.add_argument("file", help="a KernelBench-format .py file, or package.module:factory "
                                "returning (model, inputs)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("--emit-dir", help="write the CUDA source of every generated region here")
    p.add_argument("--arch", help="target arch for generated code, e.g. sm_90a")
    p.add_argument("--training", action="store_true",
                   help="also trace the backward graph (inputs require grad)")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("demo", help="run a bundled example with eager and stitchcuda")
    p.add_argument("--example", default="transformer_block",
                   help="name of a bundled example (stitch_backend/examples)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.set_defaults(func=_cmd_demo)

    _add_optional(sub, ".cli_cache")
    _add_optional(sub, ".warmup")
    _add_optional(sub, ".bench.cli")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stitchcuda`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        if getattr(args, "command", None) and hasattr(args, "run"):
            func = args.run
        else:
            parser.print_help()
            return 2
    try:
        return int(func(args) or 0)
    except _user_errors() as err:
        print(f"stitchcuda: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
