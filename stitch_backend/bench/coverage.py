"""How much of a model's pointwise/reduction/normalisation work the Coder covers.

    python -m stitch_backend.bench.coverage --kernelbench DIR --level 2 3
    python -m stitch_backend.bench.coverage FILE...

Traces each problem as ``stitchcuda explain --emit-dir`` does (meta tensors, no GPU) and
counts the pointwise, reduction and normalisation ATen nodes that land inside kernels the
template Coder writes (a replanned region's ATen stages and a gemm/conv library call do
not count). This is what the Coder proposes; what runs is what the Verifier accepts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass

import torch


@dataclass
class Coverage:
    name: str
    covered: int
    total: int
    error: str | None = None


def coverage_of(spec: str) -> Coverage:
    """Covered and total pointwise/reduction/norm nodes of one problem's graphs."""
    from stitch_backend.explain import explain_problem
    from stitch_backend.opclass import OpClass, classify

    torch._dynamo.reset()
    try:
        explanation = explain_problem(spec, emit_dir=tempfile.mkdtemp(prefix="stitch-cov-"))
    except Exception as err:  # noqa: BLE001 - one problem's failure is one row
        return Coverage(spec, 0, 0, f"{type(err).__name__}: {str(err)[:200]}")
    inside = {(e.graph, n) for e in explanation.emitted for n in e.kernel_nodes}
    covered = total = 0
    for rec in explanation.records:
        nodes = {n.name: n for n in rec.gm.graph.nodes}
        for region in rec.plan.regions:
            for name in region.nodes:
                if classify(nodes[name]) in (OpClass.POINTWISE, OpClass.REDUCTION, OpClass.NORM):
                    total += 1
                    covered += (rec.index, name) in inside
    return Coverage(spec, covered, total)


def main(argv: list[str] | None = None) -> int:
    from .problems import select_kernelbench

    parser = argparse.ArgumentParser(prog="python -m stitch_backend.bench.coverage")
    parser.add_argument("files", nargs="*")
    parser.add_argument("--kernelbench")
    parser.add_argument("--level", type=int, nargs="*", default=[])
    args = parser.parse_args(argv)
    specs = list(args.files)
    for level in args.level:
        specs += [ref.spec for ref in select_kernelbench(args.kernelbench, level)]
    rows = [coverage_of(s) for s in specs]
    for r in rows:
        print(f"{r.name}: " + (f"error {r.error}" if r.error else f"{r.covered}/{r.total}"))
    covered, total = sum(r.covered for r in rows), sum(r.total for r in rows)
    print(f"pointwise/reduction/norm nodes inside generated kernels: {covered}/{total} = "
          f"{100.0 * covered / max(total, 1):.1f}% over {len(rows)} problems "
          f"({sum(1 for r in rows if r.error)} failed to trace)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
