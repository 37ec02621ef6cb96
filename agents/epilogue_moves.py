"""Epilogue moves between the Planner's regions: what follows a gemm or a convolution
moves into the region that reads it, where that saves writing a product-sized tensor and
reading it back (``defer_epilogues``); ``move_to_sole_reader`` is the mechanism, also used
by the Planner to move a convolution's BatchNorm into the next convolution's region."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from stitch_backend.agents.siblings import numel as _numel, same_numel
from stitch_backend.ir import RegionKind
from stitch_backend.layout import CONVERSION as LAYOUT_CONVERSION
from stitch_backend.opclass import OpClass, classify

if TYPE_CHECKING:
    from stitch_backend.agents.planner import _Open

aten = torch.ops.aten


def defer_epilogues(gm: torch.fx.GraphModule, regions: list[_Open]) -> None:
    """Move a gemm's pointwise epilogue into the one fused region that consumes it.

    The library writes the product either way; an epilogue kernel would then write a
    second tensor of that size that its consumer reads back. Computed in the consumer
    (a softmax after attention's ``q @ k^T * scale``, a reduction after a Linear's
    activation), the epilogue costs no pass of its own. Where later regions read it too
    and it reads a second tensor of the product's size (a transformer block's residual
    sum, read by the next layer norm and by the block's last residual add), it moves
    into the first reader, which writes it for the others: it is then written once and
    not read back by that region (Inductor fuses L3 MiniGPT's residual add and layer norm
    so). A bias or a copy alone stays with the gemm there (cuBLASLt adds a bias in its
    call). An epilogue that opens with an activation cuBLASLt can fuse (relu, tanh-gelu)
    stays for that alternative; one that the graph returns stays too.

    A convolution's pointwise epilogue moves into its one fused reader the same way
    (KernelBench L2 32: the bias and scale before a min over the channels; L2 36 and 38
    likewise), unless it ends in a layout conversion (its kernel then writes the traced
    layout, see ``layout``) or holds a copy (a layout change: its consumer would read
    the convolution's own): cuDNN writes its output either way, and the epilogue kernel
    wrote and its consumer read back a second tensor of that size (2.1 GB each way for
    L2 32)."""
    from stitch_backend.lt_ops import activation_epilogue

    def pointwise(epi: list[torch.fx.Node], target: _Open) -> list[torch.fx.Node]:
        classes = [classify(n) for n in epi]
        if target.kind is not RegionKind.FUSED or not all(
                c in (OpClass.POINTWISE, OpClass.VIEW) for c in classes):
            return []
        return [n for n, c in zip(epi, classes) if c is OpClass.POINTWISE]

    def movable(anchor: torch.fx.Node, epi: list[torch.fx.Node], target: _Open,
                shared: bool) -> bool:
        compute = pointwise(epi, target)
        return (bool(compute) and activation_epilogue(compute[0]) is None
                and (not shared or _reads_product_sized(anchor, epi)))

    def conv_movable(anchor: torch.fx.Node, epi: list[torch.fx.Node], target: _Open,
                     shared: bool = False) -> bool:
        # a copy there changes the layout its consumer reads (L3 SwinMLP's transposes)
        return bool(pointwise(epi, target)) and not any(
            n.meta.get(LAYOUT_CONVERSION) or n.target is aten.clone.default
            for n in [*epi, *target.nodes])

    move_to_sole_reader(gm, regions, RegionKind.GEMM, OpClass.GEMM, movable, returned_ok=False,
                        first_reader=True)
    move_to_sole_reader(gm, regions, RegionKind.CONV, OpClass.CONV, conv_movable,
                        returned_ok=False)


def move_to_sole_reader(gm: torch.fx.GraphModule, regions: list[_Open], kind: RegionKind,
                        anchor_class: OpClass, movable, returned_ok: bool,
                        first_reader: bool = False) -> None:
    """For each ``kind`` region with one ``anchor_class`` node: where one later region
    alone reads what follows the anchor (the graph's output aside, with ``returned_ok``)
    and ``movable(anchor, epilogue, that region)``, the epilogue moves there. With
    ``first_reader``, where several later regions read it, it moves into the first of
    them (which then writes it for the others)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner = {n: i for i, r in enumerate(regions) for n in r.nodes}
    for i, region in enumerate(regions):
        if region.kind is not kind:
            continue
        anchors = [n for n in region.nodes if classify(n) is anchor_class]
        if len(anchors) != 1:
            continue
        epi = sorted((n for n in region.nodes if order[n] > order[anchors[0]]),
                     key=order.__getitem__)
        members = set(epi)
        readers = {u for n in epi for u in n.users
                   if u not in members and not (returned_ok and u.op == "output")}
        targets = {owner.get(u, -1) for u in readers}
        if not targets or (len(targets) > 1 and not first_reader):
            continue
        j = min(targets)
        if j <= i or not movable(anchors[0], epi, regions[j], len(targets) > 1):
            continue
        region.nodes = [n for n in region.nodes if n not in members]
        regions[j].nodes += epi
        for n in epi:
            owner[n] = j


def absorb_split_epilogues(gm: torch.fx.GraphModule, regions: list[_Open]) -> None:
    """Move a fused region of pointwise ops into the gemm region that produces every
    value it reads (graph inputs aside), where that gemm region already runs an epilogue
    kernel and every value the merged epilogue hands on has one element count.

    The Planner joins a pointwise op to a gemm's epilogue only where it is of the
    product's size. An op on a part of the product is not: attention's projection
    ``qkv = x @ w + b`` is split into q, k and v, and ``q * s`` and ``k * s`` (the math
    path of scaled_dot_product_attention) are each a third of it. They became a region
    of their own: one more launch per attention layer, which in a CUDA graph replay of a
    small model costs microseconds a layer, and one more pass over q and k (KernelBench
    L3 32's plan on meta tensors: 64 regions, 58 with this move; on an H100 its
    attention traced to one efficient-attention call instead). In the epilogue kernel,
    whose iteration space is then a third of the product, each thread reads its q, k and
    v elements of the product and writes the scaled q and k and the copied v."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner = {n: i for i, r in enumerate(regions) for n in r.nodes}
    for j, region in enumerate(regions):
        host_idx = _split_epilogue_host(region, regions, owner, j)
        if host_idx is None:
            continue
        host = regions[host_idx]
        anchors = [n for n in host.nodes if classify(n) is OpClass.GEMM]
        if len(anchors) != 1:
            continue
        epi = [n for n in host.nodes if order[n] > order[anchors[0]]]
        if all(classify(n) is OpClass.VIEW for n in epi):
            continue    # no epilogue kernel to join: moving the ops saves no launch
        merged = set(host.nodes) | set(region.nodes)
        handed_on = [n for n in [*epi, *region.nodes]
                     if any(u not in merged for u in n.users)]
        sizes = [_numel(n) for n in handed_on]
        if not sizes or not all(same_numel(s, sizes[0]) for s in sizes):
            continue
        host.nodes += region.nodes
        for n in region.nodes:
            owner[n] = host_idx
        region.nodes = []
    regions[:] = [r for r in regions if r.nodes]


def _split_epilogue_host(region: _Open, regions: list[_Open], owner: dict,
                         j: int) -> int | None:
    """The index of the one gemm region (before ``j``) that computes every value the
    pointwise fused ``region`` reads, graph inputs aside; else None."""
    if region.kind is not RegionKind.FUSED or not region.nodes:
        return None
    classes = [classify(n) for n in region.nodes]
    if not all(c in (OpClass.POINTWISE, OpClass.VIEW) for c in classes) or \
            OpClass.POINTWISE not in classes:
        return None
    members = set(region.nodes)
    sources = {owner.get(a, -1) for n in region.nodes for a in n.all_input_nodes
               if a not in members and a.op not in ("placeholder", "get_attr")}
    if len(sources) != 1:
        return None
    i = sources.pop()
    if not 0 <= i < j or regions[i].kind is not RegionKind.GEMM:
        return None
    return i


def _reads_product_sized(anchor: torch.fx.Node, epi: list[torch.fx.Node]) -> bool:
    """Whether the epilogue ``epi`` of ``anchor`` reads a value of the product's size
    from outside (a residual), not only the product and smaller values (a bias)."""
    members, size = set(epi) | {anchor}, _numel(anchor)
    return any(isinstance(a, torch.fx.Node) and a not in members
               and same_numel(_numel(a), size)
               for n in epi if classify(n) is OpClass.POINTWISE for a in n.all_input_nodes)


__all__ = ["absorb_split_epilogues", "defer_epilogues", "move_to_sole_reader"]
