"""Plain reductions over few long rows, split across the whole GPU (part of the
split-statistics alternative, ``split_stats.split_norms``).

A region that reduces a large value to a few rows and then reads the value again
(L1 37: ``x / torch.norm(x, p='fro')``, one row of 1.9e9 elements) is one template
kernel with a block per row: the statistics and the division both run in that one
block. On the H100 that kernel took 301 ms against ATen's 8.5 ms. Here the reduction is
two-level instead, as the layer norm's statistics are: ``x.view(R, G, L)`` reduced over
L gives R * G partial results (rows enough for every SM), a small kernel finishes each
row, and the rest of the region (the division) is the last, pointwise, stage.

Sums, means, maxima, minima and the 1- and 2-norms of ``linalg_vector_norm`` over the
trailing dims of a contiguous fp32 value of static sizes; anything else is left to the
template. Like the norms' splits, it is an alternative the Verifier races against the
template's kernel.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.fx

from .split_stats import _Builder, _pointwise_chain, groups_for

aten = torch.ops.aten
SUM = aten.sum.dim_IntList
MEAN = aten.mean.dim
AMAX = aten.amax.default
AMIN = aten.amin.default
NORM = aten.linalg_vector_norm.default
REDUCE_TARGETS = (SUM, MEAN, AMAX, AMIN, NORM)


class _ReducePlan(NamedTuple):
    """``rows`` rows of ``size`` elements, each reduced in ``groups`` parts; ``order``
    the norm's order (None for the other reductions); ``out_shape`` the result's."""

    rows: int
    size: int
    groups: int
    order: float | None
    out_shape: tuple[int, ...]


def _dims_and_order(red: torch.fx.Node) -> tuple[list[int] | None, float | None, bool]:
    """(reduced dims or None for all, norm order, whether the arguments are ones the
    split reproduces: no dtype argument)."""
    args, kwargs = list(red.args), dict(red.kwargs)
    if kwargs.get("dtype") is not None:
        return None, None, False
    if red.target is NORM:
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dims = args[2] if len(args) > 2 else kwargs.get("dim")
        return dims, order, True
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    return dims, None, True


def plan_reduce(red: torch.fx.Node, sm_count: int, contiguous: bool) -> _ReducePlan | None:
    """The split of reduction ``red``; None where it does not apply: not over trailing
    dims of a contiguous fp32 value of static sizes that the region reads directly or
    through a short pointwise chain, an order other than 1 or 2, rows enough for one
    kernel, or ``contiguous`` off."""
    x = red.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    out = red.meta.get("val")
    if (not contiguous or not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor)
            or xv.dtype != torch.float32 or out.dtype != torch.float32 or xv.dim() == 0
            or any(isinstance(s, torch.SymInt) for s in (*xv.shape, *out.shape))
            or not xv.is_contiguous() or _pointwise_chain(x) is None):
        return None
    dims, order, ok = _dims_and_order(red)
    if not ok or (red.target is NORM and order not in (1, 2)):
        return None
    nd = xv.dim()
    dims = sorted({d % nd for d in ([dims] if isinstance(dims, int) else dims or range(nd))})
    if dims != list(range(nd - len(dims), nd)):
        return None
    axis = nd - len(dims)
    rows = math.prod(int(s) for s in xv.shape[:axis])
    size = math.prod(int(s) for s in xv.shape[axis:])
    groups = groups_for(rows, size, sm_count)
    if groups is None:
        return None
    return _ReducePlan(rows, size, groups, float(order) if order is not None else None,
                       tuple(int(s) for s in out.shape))


def rewrite_reduce(new: torch.fx.GraphModule, red: torch.fx.Node, plan: _ReducePlan,
                   stages: list[list[str]], single_pass: bool) -> None:
    """Replace ``red`` in ``new`` by partial results over ``x.view(rows, groups, -1)``
    (``stages[0]``) and their combination per row (``stages[3]``); ``single_pass`` does
    not apply (the statistics read the value once either way)."""
    rows, size, groups, order, out_shape = plan
    b = _Builder(new, stages, red.args[0])
    op = b.op
    combine = {AMAX: aten.amax.default, AMIN: aten.amin.default}.get(red.target, SUM)
    with new.graph.inserting_before(red):
        part = op(0, aten.view.default, b.x_in(0), [rows, groups, size // groups])
        if order == 2:
            part = op(0, aten.mul.Tensor, part, part)
        elif order == 1:
            part = op(0, aten.abs.default, part)
        total = op(3, combine, op(0, combine, part, [2]), [1])
        if red.target is MEAN:
            total = op(3, aten.div.Tensor, total, float(size))
        elif order == 2:
            total = op(3, aten.sqrt.default, total)
        result = op(3, aten.view.default, total, list(out_shape))
    red.replace_all_uses_with(result)
    new.graph.erase_node(red)


__all__ = ["REDUCE_TARGETS", "plan_reduce", "rewrite_reduce"]
