"""Sibling fusion for the Planner: a pointwise op none of whose producers is a fused
region may still join a fused region that reads what it reads (``may_join``), so one
kernel reads the shared value once and one launch goes where there were two.

What is shared is a value computed in the graph (``bases``) or, where the Planner does
not defer roots (inference graphs by default), a graph input (``bases(inputs=True)``): L1 88's
tanh-GELU, ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))``, opened a region for
``0.5 * x`` and another for the rest, two kernels reading x (0.179 + 0.265 ms on the
H100, where one pass over x and the output takes about 0.18)."""

from __future__ import annotations

import torch
import torch.fx

from stitch_backend.layout import CONVERSION as LAYOUT_CONVERSION
from stitch_backend.opclass import OpClass, classify


def numel(node: torch.fx.Node):
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


def same_numel(a, b) -> bool:
    if a is None or b is None:
        return False
    try:
        return bool(a == b)
    except Exception:  # symbolic comparison that cannot be decided statically
        return str(a) == str(b)


def bases(node: torch.fx.Node, inputs: bool = False) -> set[torch.fx.Node]:
    """The values computed in the graph that ``node`` reads, looking through views; with
    ``inputs``, the graph inputs (placeholders) it reads too."""
    out, stack = set(), list(node.all_input_nodes)
    while stack:
        d = stack.pop()
        if classify(d) is OpClass.VIEW and d.all_input_nodes:
            stack.extend(d.all_input_nodes)
        elif d.op == "call_function" or (inputs and d.op == "placeholder"):
            out.add(d)
    return out


def may_join(node: torch.fx.Node, region) -> bool:
    """Whether pointwise ``node`` may join ``region``, a fused region it has no producer
    in, as a sibling: both read the same value, so one kernel reads it once, and one
    launch goes where there were two (in a CUDA graph replay of a small model each launch
    costs microseconds: the softmax of scaled_dot_product_attention's math path, and its
    check of rows masked throughout, were two kernels over the same scores; the scaling
    of q and of k, views of one projection, were two more).

    ``node`` must be of the size of the largest value in ``region``, so the kernel keeps
    its iteration space; a region with a reduction takes it only where ``node`` reads the
    very value the reduction reads (its rows), not another view of it. A layout
    conversion's region takes none (its tiled template copies one value)."""
    if any(n.meta.get(LAYOUT_CONVERSION) for n in region.nodes):
        return False
    sizes = [size for size in map(numel, region.nodes) if size is not None]
    if not sizes or not same_numel(numel(node), max(sizes, key=_as_int)):
        return False
    classes = {classify(n) for n in region.nodes}
    if classes <= {OpClass.POINTWISE, OpClass.VIEW, OpClass.FACTORY}:
        return True
    rows = {OpClass.REDUCTION, OpClass.NORM}
    if not classes <= {OpClass.POINTWISE, OpClass.VIEW, OpClass.FACTORY} | rows:
        return False
    reduced = {a for n in region.nodes if classify(n) in rows for a in n.all_input_nodes}
    return any(a in reduced for a in node.all_input_nodes)


def _as_int(n) -> int:
    try:
        return int(n)
    except Exception:  # symbolic: sizes are compared with same_numel instead
        return 0
