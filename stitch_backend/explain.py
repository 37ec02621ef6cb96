"""``stitchcuda explain``: the plan for a model, traced on meta tensors (no GPU needed).

The model is built and called under ``torch.device("meta")`` through
``torch.compile(..., backend=StitchBackend(...))``, so Dynamo and AOTAutograd produce
the same ATen graphs a GPU run would (up to device-specific op choices such as the
attention kernel), the Planner partitions them, and ``--emit-dir`` writes the CUDA
source the Coder generates for each region it covers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backend import GraphRecord, StitchBackend
from .correctness import flatten_outputs
from .ir import RegionKind

log = logging.getLogger("stitch_backend.explain")


@dataclass
class Emitted:
    """What ``--emit-dir`` did for one region."""

    graph: int
    region: int
    path: str | None
    reason: str | None = None
    # The region's nodes that run inside generated kernels (a replanned region keeps
    # some on ATen; a gemm/conv keeps its library call there).
    kernel_nodes: list[str] = field(default_factory=list)


@dataclass
class Explanation:
    records: list[GraphRecord]
    dynamo_graphs: int
    emitted: list[Emitted] = field(default_factory=list)


def trace(model: torch.nn.Module, inputs: list[Any], *, arch: str | None = None,
          training: bool = False, options: dict[str, Any] | None = None) -> Explanation:
    """Compile ``model`` with the backend and run it once on ``inputs`` (meta or real);
    return what the backend recorded. ``training`` also runs a backward pass."""
    opts = dict(options or {})
    if arch:
        opts["arch"] = arch
    backend = StitchBackend(options=opts)
    compiled = torch.compile(model, backend=backend)
    if training:
        out = compiled(*inputs)
        tensors = [o for o in flatten_outputs(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if tensors:
            sum(t.sum() for t in tensors).backward()
    else:
        with torch.no_grad():
            compiled(*inputs)
    return Explanation(records=list(backend.records), dynamo_graphs=backend.dynamo_graphs)


def explain_problem(spec: str, *, arch: str | None = None, training: bool = False,
                    emit_dir: Path | None = None, seed: int = 0) -> Explanation:
    """Load a KernelBench-format file or ``pkg.module:factory`` and explain it on meta."""
    from .bench.problems import load_problem

    problem = load_problem(spec)
    try:
        explanation = _trace_problem(problem, "meta", arch=arch, training=training, seed=seed)
    except Exception as err:  # noqa: BLE001 - meta tensors cannot run data-dependent code
        if "meta" not in str(err):
            raise
        # A model that reads tensor values (``.item()``, data-dependent shapes) cannot run
        # on meta tensors; real CPU tensors still need no GPU, only more time.
        log.warning("explain: %s cannot be traced on meta tensors (%s); tracing on the CPU",
                    spec, str(err).strip().splitlines()[-1][:200])
        torch._dynamo.reset()
        explanation = _trace_problem(problem, "cpu", arch=arch, training=training, seed=seed)
    if emit_dir is not None:
        explanation.emitted = emit_sources(explanation.records, Path(emit_dir), arch=arch)
    return explanation


def _trace_problem(problem, device: str, *, arch, training, seed) -> Explanation:
    torch.manual_seed(seed)
    with torch.device(device):
        model = problem.make_model()
        inputs = list(problem.make_inputs())
    if training:
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
    return trace(model, inputs, arch=arch, training=training)


def emit_sources(records: list[GraphRecord], emit_dir: Path, *,
                 arch: str | None = None) -> list[Emitted]:
    """Write the CUDA source the template Coder writes for every region; record why not
    where it writes none."""
    from stitch_backend.agents.coder import NoCandidate, TemplateCoder
    from stitch_backend.agents.state import subtask_for

    emit_dir.mkdir(parents=True, exist_ok=True)
    coder = TemplateCoder()
    out: list[Emitted] = []
    for rec in records:
        for region in rec.plan.regions:
            if region.kind is RegionKind.FALLBACK:
                continue
            name = f"g{rec.index}_{region.name}"
            try:
                cand = coder.propose(subtask_for(rec.gm, region, name))
            except NoCandidate as err:
                out.append(Emitted(rec.index, region.id, None, str(err)))
                continue
            path = emit_dir / f"{name}.cu"
            path.write_text(cand.source)
            region.kernel = cand.name
            if cand.stages is None:
                covered = list(region.nodes)
            else:
                covered = [n for st in cand.stages if st.kernel is not None for n in st.region.nodes]
            out.append(Emitted(rec.index, region.id, str(path), kernel_nodes=covered))
    return out


