"""Prologue moves between the Planner's regions: a copy that only makes a bmm's operand
contiguous moves into the bmm's region (``copies_into_products``).

Attention's q, k and v are views of the packed projection whose (batch, head) slices
are not one batch stride apart, so the traced graph copies them contiguous before each
bmm (L3 MiniGPT: three clones, which the Planner had fused into one region of their
own). In the bmm's region, the Coder can race the copies and ATen's bmm against per-head
cuBLASLt calls that read the views in place (``stitch_backend.lt_heads``); its template
still generates a kernel for the copies (a prologue stage), so the region costs what the
copies' own region did where the library calls lose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from stitch_backend.ir import RegionKind
from stitch_backend.opclass import OpClass, classify

if TYPE_CHECKING:
    from stitch_backend.agents.planner import _Open

aten = torch.ops.aten


def copies_into_products(gm: torch.fx.GraphModule, regions: list[_Open]) -> None:
    """For each gemm region with one bmm: where an operand is (through views) a clone of
    a non-contiguous value (a layout change) in a fused region, the value it copies comes
    from outside that region, and every reader of the clone and of the views between it
    and the bmm is in the bmm's region, the clone, those views and the views above it
    that only they read move into the bmm's region. A fused region left empty is
    dropped."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner = {n: i for i, r in enumerate(regions) for n in r.nodes}
    for j, region in enumerate(regions):
        if region.kind is not RegionKind.GEMM:
            continue
        anchors = [n for n in region.nodes if n.target is aten.bmm.default]
        if len(anchors) != 1:
            continue
        for operand in anchors[0].args[:2]:
            moving = _prologue(operand, owner, regions, j)
            if not moving:
                continue
            i = owner[moving[0]]
            members = set(moving)
            regions[i].nodes = [n for n in regions[i].nodes if n not in members]
            region.nodes = sorted(region.nodes + moving, key=order.__getitem__)
            for n in moving:
                owner[n] = j
    regions[:] = [r for r in regions if r.nodes]


def _prologue(operand: object, owner: dict, regions: list[_Open], j: int
              ) -> list[torch.fx.Node]:
    """The nodes that move for one bmm operand (see ``copies_into_products``); []."""
    chain: list[torch.fx.Node] = []
    node = operand
    while isinstance(node, torch.fx.Node) and node.op == "call_function" \
            and classify(node) is OpClass.VIEW:
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.clone.default:
        return []
    src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(src, torch.Tensor) or src.is_contiguous():
        return []    # not a layout change (a dropout of p = 0 traces to one): it stays fused
    i = owner.get(node)
    if i is None or i == j or regions[i].kind is not RegionKind.FUSED:
        return []
    moving = [node] + [n for n in chain if owner.get(n) == i]
    above = node.args[0]     # views above the clone that only the moving nodes read
    while isinstance(above, torch.fx.Node) and owner.get(above) == i \
            and classify(above) is OpClass.VIEW and all(u in moving for u in above.users):
        moving.append(above)
        above = above.args[0]
    if owner.get(above) == i:
        return []    # the copy reads what its region computes: moved, that would be written
    members = set(moving)
    if any(u not in members and owner.get(u) != j for n in moving for u in n.users):
        return []
    return moving


__all__ = ["copies_into_products"]
