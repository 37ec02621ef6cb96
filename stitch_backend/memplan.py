"""Peak memory of a Program's intermediate values, worked out from the traced graph.

The Program runs as one straight-line function (program.py): the ops of a region left on
ATen inlined, each generated region one call, every value freed after its last reader;
torch's caching allocator reuses the freed blocks, so the peak is set by which values
are alive at once. This module computes that peak without running anything, twice:

- the graph as traced, op by op, each value freed after its last use (what eager's
  order of operations needs; views and multi-output ops keep their base alive);
- the Program, in its regions' order: an ATen region's ops as op by op; a generated
  kernel materialises only its region's outputs and holds its inputs until it returns;
  a region with a library call (a GEMM or convolution ahead of an epilogue kernel)
  materialises that call's output too, and drops a value after the last stage reading
  it (``kernels``' ``call_boxed``): a convolution's input is gone before its epilogue
  writes the output.

The first call runs the Program step by step for the Verifier (a region's values then
live until its step ends), so its peak can be higher than this estimate.

Inputs (parameters included) are not counted: they exist before the call. Symbolic
sizes count at the traced example's sizes; a data-dependent size (nonzero's output) has
no number, and the estimate then says so instead of guessing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from .ir import Plan, RegionKind
from .opclass import OpClass, classify

#: the documented margin: a Program's estimated peak stays within this ratio of the
#: traced graph's (``within_margin``), and the report flags any estimate above it
FLAG_RATIO = 1.10


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of intermediates and outputs (None with ``unknown`` saying why)."""

    program_bytes: int | None
    graph_bytes: int | None
    unknown: str = ""

    @property
    def ratio(self) -> float | None:
        if not self.program_bytes or not self.graph_bytes:
            return None
        return self.program_bytes / self.graph_bytes

    def line(self) -> str:
        """One line for the report."""
        if self.program_bytes is None or self.graph_bytes is None:
            return f"memory plan: not estimated ({self.unknown})"
        text = (f"memory plan: intermediates and outputs peak at {_mib(self.program_bytes)} "
                f"(the traced graph op by op: {_mib(self.graph_bytes)})")
        ratio = self.ratio
        if ratio is not None and ratio > FLAG_RATIO:
            text += f", {100 * (ratio - 1):.0f}% above it"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"program_bytes": self.program_bytes, "graph_bytes": self.graph_bytes,
                "unknown": self.unknown}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class _Symbolic(Exception):
    """A value's size is symbolic."""


def _bytes(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor):
        n = value.numel()
        if not isinstance(n, int):
            try:
                n = int(n)      # a symbolic size with a hint: the traced example's size
            except Exception:  # noqa: BLE001 - unbacked (data-dependent) or unhinted
                raise _Symbolic(f"the size of {name} depends on the data") from None
        return n * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v, name) for v in value)
    return 0


def _is_alias(node: torch.fx.Node) -> bool:
    """A view of its first input, or an element of a multi-output op's result."""
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    return node.target is operator.getitem or classify(node) is OpClass.VIEW


def estimate(gm: torch.fx.GraphModule, plan: Plan) -> MemoryEstimate:
    """Both peaks for ``gm`` run as ``plan`` says (regions with ``backend == "kernel"``
    as generated kernels, the rest on ATen)."""
    try:
        return MemoryEstimate(_program_peak(gm, plan, _generated(plan)), _graph_peak(gm))
    except _Symbolic as err:
        return MemoryEstimate(None, None, str(err))


def within_margin(gm: torch.fx.GraphModule, plan: Plan,
                  generated: set[int]) -> tuple[list[int], MemoryEstimate]:
    """Which of the ``generated`` regions (ids, run as kernels) go back to ATen so that the
    Program's estimated peak is within ``FLAG_RATIO`` of the graph's, and the estimate
    then: regions are tried largest outputs first, each kept on ATen only where that
    lowers the peak, until the peak is within the margin. ``plan`` is not changed."""
    try:
        graph_bytes = _graph_peak(gm)
        kernels = set(generated)
        est = MemoryEstimate(_program_peak(gm, plan, kernels), graph_bytes)
        dropped: list[int] = []
        if est.ratio is None or est.ratio <= FLAG_RATIO:
            return dropped, est
        meta = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        by_id = {r.id: r for r in plan.regions}
        order = sorted(kernels, key=lambda rid: -sum(
            _bytes(meta.get(x), x) for x in by_id[rid].outputs))
        for rid in order:
            trial = MemoryEstimate(_program_peak(gm, plan, kernels - {rid}), graph_bytes)
            if trial.program_bytes < est.program_bytes:
                kernels.discard(rid)
                dropped.append(rid)
                est = trial
                if trial.ratio is not None and trial.ratio <= FLAG_RATIO:
                    break
        return dropped, est
    except _Symbolic as err:
        return [], MemoryEstimate(None, None, str(err))


def graph_peak(gm: torch.fx.GraphModule) -> int | None:
    """Peak bytes of the traced graph's intermediates and outputs op by op (inputs not
    counted); None for a data-dependent size."""
    try:
        return _graph_peak(gm)
    except _Symbolic:
        return None


def _generated(plan: Plan) -> set[int]:
    return {r.id for r in plan.regions if r.backend == "kernel"}


def _graph_peak(gm: torch.fx.GraphModule) -> int:
    """The traced graph's peak, op by op."""
    nodes = list(gm.graph.nodes)
    computed = {n.name for n in nodes if n.op == "call_function"}
    return _walk(nodes, [n.name for n in nodes], computed, region_end=None)


def _program_peak(gm: torch.fx.GraphModule, plan: Plan, generated: set[int]) -> int:
    """The Program's peak, its ``generated`` regions (ids) run as kernels."""
    nodes = list(gm.graph.nodes)
    computed = {n.name for n in nodes if n.op == "call_function"}
    order = [x for region in plan.regions for x in region.nodes]
    region_end: dict[str, int] = {}     # node -> position of its region's last node
    start = 0
    for region in plan.regions:
        start += len(region.nodes)
        for x in region.nodes:
            region_end[x] = start - 1
    kept, held = _materialised(gm, plan, generated)
    return _walk(nodes, order, kept & computed, region_end, held)


def _walk(nodes: list[torch.fx.Node], order: list[str], materialised: set[str],
          region_end: dict[str, int] | None, held: frozenset[str] = frozenset()) -> int:
    """Peak of live bytes running ``order``: each materialised value is allocated at its
    position and freed after its storage's last reader (never, for the graph's
    outputs). An alias of a materialised value shares its storage; an alias of a value
    a kernel never wrote (a view at a fused region's boundary) is written whole.
    A value read by a ``held`` node (inside a generated kernel) lives until that
    node's region ends (``region_end``): a kernel reads its inputs while it writes its
    outputs."""
    index = {name: i for i, name in enumerate(order)}
    by_name = {n.name: n for n in nodes}
    root: dict[str, str] = {}
    size: dict[str, int] = {}
    for n in nodes:
        base = n.all_input_nodes[0].name if _is_alias(n) else None
        if base is not None and (base in materialised or base not in index
                                 or by_name[base].op != "call_function"):
            root[n.name] = root.get(base, base)
            size[n.name] = 0
        else:
            root[n.name] = n.name
            size[n.name] = _bytes(n.meta.get("val"), n.name) if n.name in materialised else 0
    out_node = next(n for n in nodes if n.op == "output")
    outputs = {root[a.name] for a in out_node.all_input_nodes}
    last: dict[str, int] = {}
    for n in nodes:
        if n.name not in index:
            continue
        for inp in n.all_input_nodes:
            t = index[n.name]
            if region_end is not None and n.name in held:
                t = region_end[n.name]     # read inside a kernel
            r = root[inp.name]
            last[r] = max(last.get(r, -1), t)
    frees: dict[int, list[str]] = {}
    for name in order:
        if size[name] and root[name] == name and name not in outputs:
            frees.setdefault(last.get(name, index[name]), []).append(name)
    live = peak = 0
    for i, name in enumerate(order):
        live += size[name]
        peak = max(peak, live)
        for gone in frees.get(i, ()):
            live -= size[gone]
    return peak


def _materialised(gm: torch.fx.GraphModule, plan: Plan,
                  generated: set[int]) -> tuple[set[str], frozenset[str]]:
    """Node names whose values exist when the Program runs: every node of an ATen
    region; a ``generated`` (kernel) region's outputs (and a library call's own output
    ahead of its epilogue kernel). And the nodes that run inside a generated kernel
    (every node of a generated region but its library call)."""
    kept: set[str] = set()
    held: set[str] = set()
    nodes = {n.name: n for n in gm.graph.nodes}
    for region in plan.regions:
        if region.id not in generated:
            kept.update(region.nodes)
            continue
        kept.update(region.outputs)
        anchor = None
        if region.kind in (RegionKind.GEMM, RegionKind.CONV):
            anchor = next((x for x in region.nodes if nodes[x].op == "call_function"
                           and not _is_alias(nodes[x])), None)
            if anchor is not None:
                kept.add(anchor)
        held.update(x for x in region.nodes if x != anchor)
    return kept, frozenset(held)
