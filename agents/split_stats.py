"""Training BatchNorm over few channels, and layer, group and instance norm over few
rows, split across the whole GPU (an alternative candidate the Verifier races against the
one-kernel template); a group or instance norm whose output is only reduced further,
split into its statistics and a last stage that normalises inside the reduction's kernel.

The template lowers a training BatchNorm to one kernel with a block per channel: with
64 channels on 132 SMs, half the GPU idles while each block reads its channel three
times. Here the statistics are two-level sums instead: ``x.view(N, C, G, L)`` summed
over N and L gives C*G partial sums (rows enough for every SM), a small kernel finishes
each channel; the same for the squared deviations (two-pass variance, as robust as
eager's); then one pointwise kernel normalises and runs the rest of the region. A layer
norm over few long rows (L1's (16, 64, 256, 256) normalised over its last three dims:
16 blocks for 132 SMs) is split the same way, ``x.view(R, G, L)`` summed over L.

Everything is expressed as core ATen ops on a copy of the region module, so each stage
is an ordinary generated kernel (the same templates the GPU tests cover), and the ATen
semantics of the rewrite are checked on CPU like any region.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from stitch_backend.regions import copy_graph

aten = torch.ops.aten
BN_TRAIN = aten._native_batch_norm_legit_functional.default
LAYER_NORM = aten.native_layer_norm.default
GROUP_NORM = aten.native_group_norm.default
INSTANCE_NORM = aten._native_batch_norm_legit.no_stats   # over a (1, N*C, ...) view
# each planned and rewritten per _SPLITS
SPLIT_TARGETS = (BN_TRAIN, LAYER_NORM, GROUP_NORM, INSTANCE_NORM)

# Split only when the channels leave SMs idle and each partial sum still has work.
MIN_PARTIAL_LEN = 512


@dataclass
class StatsSplit:
    """The rewritten region module and its stages (node names, in run order)."""

    module: torch.fx.GraphModule
    stages: list[list[str]]
    groups: int


def groups_for(channels: int, spatial: int, sm_count: int) -> int | None:
    """Partial sums per channel: a power of two dividing ``spatial`` that gives about two
    rows per SM, each at least MIN_PARTIAL_LEN long; None when one kernel is enough."""
    if channels >= sm_count:
        return None
    best = None
    g = 2
    while channels * g <= 4 * sm_count and spatial % g == 0 and spatial // g >= MIN_PARTIAL_LEN:
        best = g
        if channels * g >= 2 * sm_count:
            break
        g *= 2
    return best


# Column partial sums (channels-last inputs): the column template gives a block 32
# channels (one 128-byte line of fp32 per position) when there are rows enough, so the
# grid has about two blocks an SM when channels * groups is near 64 blocks' worth of
# channels an SM. Swept on the H200 (sum of d and d*d over (G, L, C) views): for
# (10, 64, 224, 224) G=128 ran 0.044 ms against 0.066 for the G=64 this chose before
# (8 channels a block), for (8, 128, 112, 112) G=64 0.024 against 0.042 for G=32, for
# (10, 64, 56, 56) G=64 0.009 against 0.016 for G=32 (partials of 490 positions).
COLUMN_CHANNELS = 32
MIN_COLUMN_LEN = 256


def groups_for_columns(channels: int, rows: int, sm_count: int) -> int | None:
    """Partial sums per channel of a channels-last input (``rows`` = N*H*W positions, each
    ``channels`` wide): the power of two dividing ``rows`` that makes ``channels *
    groups`` closest to 2 * sm_count * COLUMN_CHANNELS (two blocks an SM), each partial
    at least MIN_COLUMN_LEN long; None when one kernel is enough (channels that give
    every SM two blocks of 8 already) or the rows are too few to split."""
    if channels >= 16 * sm_count:
        return None
    target = 2 * sm_count * COLUMN_CHANNELS

    def miss(g: int) -> float:
        return abs(math.log2(channels * g / target))

    best = None
    g = 2
    while rows % g == 0 and rows // g >= MIN_COLUMN_LEN:
        if best is None or miss(g) < miss(best):
            best = g
        if channels * g >= target:
            break
        g *= 2
    return best


def split_norms(module: torch.fx.GraphModule, sm_count: int,
                contiguous: bool = True, single_pass: bool = False) -> StatsSplit | None:
    """``module`` (a region module) with its training BatchNorms, layer norms, group
    norms and instance norms rewritten into two-level sums (a group or instance norm's
    may be one-level: ``_plan_row_norm``), or None when the rewrite does not apply to
    each of them or would not help. Plain reductions to few rows are rewritten too where they apply
    (``split_reduce``), and left in the last stage where they do not.

    A channels-last input (the layout pass's convolutions) is always split when its
    channels leave SMs idle: one kernel per region would reduce it as columns with a
    block per 8 channels. A contiguous (NCHW) BatchNorm input, and a layer norm's (rows
    that leave SMs idle), only with ``contiguous``.

    Several BatchNorms (a residual block's two branches, which the Planner puts in one
    region: ``agents.planner._defer_norms``) each get their statistics stages; one last
    pointwise stage normalises them all and runs the rest of the region.

    ``single_pass``: the statistics read the input once instead of twice. The partial
    sums are of ``d = x - s`` and ``d * d``, where ``s`` is the channel's (the row's)
    first element (a shift close to its values, so ``E[d^2] - E[d]^2`` does not cancel
    the way ``E[x^2] - E[x]^2`` does where the mean is large against the spread); three
    kernels instead of five."""
    from .split_reduce import REDUCE_TARGETS, plan_reduce, rewrite_reduce

    splits = {**_SPLITS, **{t: (plan_reduce, rewrite_reduce) for t in REDUCE_TARGETS}}
    targets = [n for n in module.graph.nodes if n.op == "call_function" and n.target in splits]
    plans = {n.name: splits[n.target][0](n, sm_count, contiguous) for n in targets}
    # every norm must split (its statistics cannot join the last stage); a plain
    # reduction that does not stays where it is (``split_reduce``)
    if any(plans[n.name] is None for n in targets if n.target in SPLIT_TARGETS):
        return None
    plans = {name: p for name, p in plans.items() if p is not None}
    if not plans:
        return None
    new = torch.fx.GraphModule(module, copy_graph(module.graph))
    new_targets = [nd for nd in new.graph.nodes if nd.name in plans]
    # statistics stages (0-3) of each norm or reduction in turn, then the normalisation
    # (the rest of the region) of all
    stages: list[list[str]] = [[] for _ in range(4 * len(plans) + 1)]
    for i, node in enumerate(new_targets):
        splits[node.target][1](new, node, plans[node.name],
                               stages[4 * i: 4 * i + 4] + [stages[-1]], single_pass)
    ours = {name for stage in stages for name in stage}
    stages[-1] += [nd.name for nd in new.graph.nodes
                   if nd.op == "call_function" and nd.name not in ours]
    new.graph.eliminate_dead_code()
    order = {nd.name: i for i, nd in enumerate(new.graph.nodes)}
    stages = [sorted((s for s in stage if s in order), key=order.__getitem__)
              for stage in stages]
    new.graph.lint()
    new.recompile()
    _propagate_metas(new)
    return StatsSplit(new, [s for s in stages if s], next(iter(plans.values())).groups)


class _SplitPlan(NamedTuple):
    """How one BatchNorm's input is split: its sizes (``spatial``: (H, W) or (D, H, W)),
    layout and partial sums a channel."""

    n: int
    c: int
    spatial: tuple[int, ...]
    channels_last: bool
    groups: int


class _RowPlan(NamedTuple):
    """How one layer norm's input is split: ``rows`` rows of ``size`` elements, each
    summed in ``groups`` parts; ``stat_shape`` is its mean's and 1/std's shape."""

    rows: int
    size: int
    groups: int
    stat_shape: tuple[int, ...]


def _static_fp32(x, users) -> torch.Tensor | None:
    """``x``'s value where a split can recompute and read it: fp32 of static sizes,
    computed in the region by a short pointwise chain at most, the norm's outputs taken
    by getitem; else None."""
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if (not isinstance(xv, torch.Tensor) or xv.dtype != torch.float32
            or _pointwise_chain(x) is None
            or any(isinstance(s, torch.SymInt) for s in xv.shape)
            or not all(u.op == "call_function" and u.target is operator.getitem
                       for u in users)):
        return None
    return xv


def _plan(bn: torch.fx.Node, sm_count: int, contiguous: bool) -> _SplitPlan | None:
    """The split of ``bn``'s statistics; None where it does not
    apply (eval mode, not 4-D or 5-D fp32 of static sizes, an input the stages cannot
    recompute, channels enough for one kernel)."""
    x, weight, bias, rmean, rvar, training, momentum, eps = bn.args
    xv = _static_fp32(x, bn.users)
    if not training or xv is None or xv.dim() not in (4, 5):
        return None
    n, c, *spatial = (int(s) for s in xv.shape)
    positions = math.prod(spatial)
    fmt = torch.channels_last if xv.dim() == 4 else torch.channels_last_3d
    channels_last = not xv.is_contiguous() and xv.is_contiguous(memory_format=fmt)
    if channels_last:
        groups = groups_for_columns(c, n * positions, sm_count)
    elif contiguous and xv.is_contiguous():
        groups = groups_for(c, positions, sm_count)
    else:
        return None
    if groups is None or n * positions < 2:
        return None
    return _SplitPlan(n, c, tuple(spatial), channels_last, groups)


def _plan_rows(ln: torch.fx.Node, sm_count: int, contiguous: bool) -> _RowPlan | None:
    """The split of layer norm ``ln``'s statistics; None where it does not apply (not
    fp32 of static sizes and contiguous, rows enough for one kernel) or ``contiguous``
    is off."""
    x, shape, weight, bias = ln.args[:4]
    xv = _static_fp32(x, ln.users)
    if not contiguous or xv is None or not xv.is_contiguous() or not shape:
        return None
    if any(isinstance(t, torch.fx.Node) and t.meta.get("val") is not None
           and t.meta["val"].dtype != torch.float32 for t in (weight, bias)):
        return None
    axis = xv.dim() - len(shape)
    rows = math.prod(int(s) for s in xv.shape[:axis])
    size = math.prod(int(s) for s in xv.shape[axis:])
    groups = groups_for(rows, size, sm_count)
    if groups is None:
        return None
    return _RowPlan(rows, size, groups, tuple(int(s) for s in xv.shape[:axis]) + (1,) * len(shape))


class _Builder:
    """Appends a rewrite's nodes to ``new``, each named into the stage that runs it."""

    def __init__(self, new: torch.fx.GraphModule, stages: list[list[str]], x: torch.fx.Node):
        self.new, self.stages, self.x = new, stages, x
        self.chain = _pointwise_chain(x)
        self.recomputed: dict[int, torch.fx.Node] = {}

    def op(self, stage: int, target, *args) -> torch.fx.Node:
        node = self.new.graph.call_function(target, args)
        node._rename(f"sk_{target.__name__.split('.')[0]}")
        self.stages[stage].append(node.name)
        return node

    def x_in(self, stage: int) -> torch.fx.Node:
        """The norm's input as ``stage`` reads it: computed again in that stage's kernel
        where the region computes it (a convolution's bias add) instead of stored."""
        if not self.chain:
            return self.x
        if stage not in self.recomputed:
            copies: dict[torch.fx.Node, torch.fx.Node] = {}
            for nd in self.chain:
                copy = self.new.graph.node_copy(nd, lambda a: copies.get(a, a))
                copy._rename(f"sk_{nd.name}")
                self.stages[stage].append(copy.name)
                copies[nd] = copy
            self.recomputed[stage] = copies[self.x]
        return self.recomputed[stage]

    def moments(self, grouped, per_group, shift, part_dims: list[int],
                total_dims: list[int], count: float, single_pass: bool):
        """(mean, biased variance) from two-level sums of ``grouped(stage)`` (the input
        viewed with a partial-sum axis): partial sums over ``part_dims`` (stage 0), then
        over ``total_dims``; ``per_group(stage, v)`` views a statistic to broadcast
        against ``grouped``; ``shift(stage)`` is the single pass's shift."""
        op = self.op
        if single_pass:
            # stage 0: partial sums of d and d*d; 3: mean and (biased) variance
            d = op(0, aten.sub.Tensor, grouped(0), per_group(0, shift(0)))
            parts = op(0, aten.sum.dim_IntList, d, part_dims)
            parts2 = op(0, aten.sum.dim_IntList, op(0, aten.mul.Tensor, d, d), part_dims)
            md = op(3, aten.div.Tensor, op(3, aten.sum.dim_IntList, parts, total_dims), count)
            ed2 = op(3, aten.div.Tensor, op(3, aten.sum.dim_IntList, parts2, total_dims), count)
            var = op(3, aten.clamp_min.default,
                     op(3, aten.sub.Tensor, ed2, op(3, aten.mul.Tensor, md, md)), 0.0)
            return op(3, aten.add.Tensor, shift(3), md), var
        # stage 0: partial sums; 1: means; 2: partial squared deviations; 3: variance
        parts = op(0, aten.sum.dim_IntList, grouped(0), part_dims)
        mean = op(1, aten.div.Tensor, op(1, aten.sum.dim_IntList, parts, total_dims), count)
        dev = op(2, aten.sub.Tensor, grouped(2), per_group(2, mean))
        parts2 = op(2, aten.sum.dim_IntList, op(2, aten.mul.Tensor, dev, dev), part_dims)
        var = op(3, aten.div.Tensor, op(3, aten.sum.dim_IntList, parts2, total_dims), count)
        return mean, var

    def row_moments(self, rows: int, groups: int, size: int, single_pass: bool):
        """``moments`` of the input as ``rows`` rows of ``size`` (a layer or group norm's),
        each summed in ``groups`` parts of ``x.view(rows, groups, -1)``; the single pass
        shifts each row by its first element."""
        op, x_in = self.op, self.x_in

        def grouped(stage: int) -> torch.fx.Node:
            return op(stage, aten.view.default, x_in(stage), [rows, groups, size // groups])

        def per_group(stage: int, v: torch.fx.Node) -> torch.fx.Node:
            return op(stage, aten.view.default, v, [rows, 1, 1])

        def shift(stage: int) -> torch.fx.Node:
            return op(stage, aten.select.int, op(stage, aten.view.default, x_in(stage),
                                                 [rows, size]), 1, 0)

        return self.moments(grouped, per_group, shift, [2], [1], float(size), single_pass)

    def replace(self, norm: torch.fx.Node, results: list[torch.fx.Node]) -> None:
        """Point each ``getitem`` of ``norm`` at its result; drop ``norm``."""
        for user in list(norm.users):
            user.replace_all_uses_with(results[user.args[1]])
            self.new.graph.erase_node(user)
        self.new.graph.erase_node(norm)


def _rewrite(new: torch.fx.GraphModule, bn: torch.fx.Node, plan: _SplitPlan,
             stages: list[list[str]], single_pass: bool) -> None:
    """Replace ``bn`` in ``new`` by its two-level statistics (node names appended to
    ``stages[0..3]``) and its normalisation (``stages[4]``)."""
    n, c, spatial, channels_last, groups = plan
    x, weight, bias, rmean, rvar, _, momentum, eps = bn.args
    b = _Builder(new, stages, x)
    op, x_in = b.op, b.x_in
    count = float(n * math.prod(spatial))
    dims = 2 + len(spatial)

    def per_channel(stage: int, v: torch.fx.Node) -> torch.fx.Node:
        return op(stage, aten.view.default, v, [1, c] + [1] * len(spatial))

    if channels_last:
        # x as (N*H*W, C) rows, split into ``groups`` runs of rows: (groups, L, C)
        def grouped(stage: int) -> torch.fx.Node:
            return op(stage, aten.view.default, op(stage, aten.permute.default, x_in(stage),
                                                   [0, *range(2, dims), 1]),
                      [groups, -1, c])

        def per_group_channel(stage: int, v: torch.fx.Node) -> torch.fx.Node:
            return op(stage, aten.view.default, v, [1, 1, c])
        part_dims, total_dims = [1], [0]
    else:
        # x as (N, C, groups, L): partial sums over N and L
        def grouped(stage: int) -> torch.fx.Node:
            return op(stage, aten.view.default, x_in(stage), [n, c, groups, -1])
        def per_group_channel(stage: int, v: torch.fx.Node) -> torch.fx.Node:
            return op(stage, aten.view.default, v, [1, c, 1, 1])
        part_dims, total_dims = [0, 3], [1]

    def shift(stage: int) -> torch.fx.Node:
        """x[0, :, 0, 0] (x[0, :, 0, 0, 0]), one value per channel."""
        first = op(stage, aten.select.int, x_in(stage), 0, 0)
        for _ in spatial:
            first = op(stage, aten.select.int, first, 1, 0)
        return first

    with new.graph.inserting_before(bn):
        mean, var = b.moments(grouped, per_group_channel, shift, part_dims, total_dims,
                              count, single_pass)
        # stage 3: 1/std, running statistics (as the template computes them)
        rstd = op(3, aten.rsqrt.default, op(3, aten.add.Tensor, var, eps))
        new_mean = op(3, aten.add.Tensor, op(3, aten.mul.Tensor, mean, momentum),
                      op(3, aten.mul.Tensor, rmean, 1.0 - momentum))
        unbiased = op(3, aten.div.Tensor, op(3, aten.mul.Tensor, var, count), count - 1.0)
        new_var = op(3, aten.add.Tensor, op(3, aten.mul.Tensor, unbiased, momentum),
                     op(3, aten.mul.Tensor, rvar, 1.0 - momentum))
        # stage 4: normalise (then the rest of the region joins this stage)
        y = op(4, aten.mul.Tensor, op(4, aten.sub.Tensor, x, per_channel(4, mean)),
               per_channel(4, rstd))
        if weight is not None:
            y = op(4, aten.mul.Tensor, y, per_channel(4, weight))
        if bias is not None:
            y = op(4, aten.add.Tensor, y, per_channel(4, bias))
    b.replace(bn, [y, mean, rstd, new_mean, new_var])


def _rewrite_rows(new: torch.fx.GraphModule, ln: torch.fx.Node, plan: _RowPlan,
                  stages: list[list[str]], single_pass: bool) -> None:
    """Replace layer norm ``ln`` in ``new`` by its two-level statistics over
    ``x.view(rows, groups, -1)`` (``stages[0..3]``) and its normalisation (``stages[4]``)."""
    rows, size, groups, stat_shape = plan
    x, _, weight, bias, eps = ln.args
    b = _Builder(new, stages, x)
    op = b.op

    def per_row(stage: int, v: torch.fx.Node) -> torch.fx.Node:
        return op(stage, aten.view.default, v, list(stat_shape))

    with new.graph.inserting_before(ln):
        mean, var = b.row_moments(rows, groups, size, single_pass)
        rstd = op(3, aten.rsqrt.default, op(3, aten.add.Tensor, var, eps))
        y = op(4, aten.mul.Tensor, op(4, aten.sub.Tensor, x, per_row(4, mean)),
               per_row(4, rstd))
        if weight is not None:
            y = op(4, aten.mul.Tensor, y, weight)
        if bias is not None:
            y = op(4, aten.add.Tensor, y, bias)
        results = [y, per_row(3, mean), per_row(3, rstd)]
    b.replace(ln, results)


def _plan_groups(gn: torch.fx.Node, sm_count: int, contiguous: bool) -> _RowPlan | None:
    """The split of group norm ``gn``'s statistics over its N * G rows (``_plan_row_norm``);
    None where its sizes are symbolic or a weight is not fp32."""
    x, weight, bias, n, c, hxw, group = gn.args[:7]
    if not all(isinstance(v, int) for v in (n, c, hxw, group)):
        return None
    if any(isinstance(t, torch.fx.Node) and t.meta.get("val") is not None
           and t.meta["val"].dtype != torch.float32 for t in (weight, bias)):
        return None
    return _plan_row_norm(gn, x, n * group, (c // group) * hxw, (n, group), sm_count,
                          contiguous)


def _plan_instance(bn: torch.fx.Node, sm_count: int, contiguous: bool) -> _RowPlan | None:
    """The split of an instance norm's statistics: training BatchNorm without running
    statistics or affine parameters over a (1, R, ...) value, one row per channel R
    (``_plan_row_norm``); None otherwise."""
    x, weight, bias, training = bn.args[:4]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if (not training or weight is not None or bias is not None
            or not isinstance(xv, torch.Tensor) or xv.dim() < 3
            or any(isinstance(s, torch.SymInt) for s in xv.shape) or xv.shape[0] != 1):
        return None
    rows = int(xv.shape[1])
    return _plan_row_norm(bn, x, rows, math.prod(int(s) for s in xv.shape[2:]), (rows,),
                          sm_count, contiguous)


def _plan_row_norm(norm: torch.fx.Node, x, rows: int, size: int, stat_shape: tuple,
                   sm_count: int, contiguous: bool) -> _RowPlan | None:
    """The split of a norm over ``rows`` contiguous rows of ``size`` elements of ``x`` (a
    group norm's N * G groups, an instance norm's channels): in parts where the rows
    leave SMs idle (as a layer norm's), whole where they do not but the normalised value
    is only reduced further (``_only_reduced``); None otherwise, where ``x`` is not
    contiguous fp32 of static sizes, or ``contiguous`` is off."""
    xv = _static_fp32(x, norm.users)
    if not contiguous or xv is None or not xv.is_contiguous() or xv.dim() < 2:
        return None
    groups = groups_for(rows, size, sm_count)
    if groups is None:
        if size < MIN_PARTIAL_LEN or not _only_reduced(norm):
            return None
        groups = 1
    return _RowPlan(rows, size, groups, stat_shape)


def _only_reduced(norm: torch.fx.Node) -> bool:
    """Whether ``norm``'s normalised output is used only through pointwise ops and views
    that end in reductions, none of them a region output: then the last stage can
    recompute it from the statistics inside the reduction's kernel instead of one
    kernel writing it and the next reading it back (KernelBench L2 27: a group norm of
    716 MB, then its mean over the positions)."""
    from stitch_backend.opclass import OpClass, classify

    todo = [u for u in norm.users if u.args[1] == 0]
    seen: set[torch.fx.Node] = set()
    reduced = False
    while todo:
        nd = todo.pop()
        if nd in seen:
            continue
        seen.add(nd)
        if nd.op != "call_function":
            return False                      # the output node: stored after all
        kind = classify(nd)
        if kind is OpClass.REDUCTION:
            reduced = True
            continue
        if kind not in (OpClass.POINTWISE, OpClass.VIEW):
            return False
        todo += list(nd.users)
    return reduced


def _rewrite_row_norm(new: torch.fx.GraphModule, norm: torch.fx.Node, plan: _RowPlan,
                      stages: list[list[str]], single_pass: bool) -> None:
    """Replace group norm or instance norm ``norm`` in ``new`` by its statistics over
    ``x.view(rows, parts, -1)`` (``stages[0..3]``) and its normalisation (``stages[4]``),
    a group norm's affine map per channel included; its mean and 1/std come out in
    ``plan.stat_shape``, as the op gives them."""
    rows, size, groups, stat_shape = plan
    if norm.target is GROUP_NORM:
        x, weight, bias, _, c, _, _, eps = norm.args
    else:
        x, weight, bias, c, eps = norm.args[0], None, None, None, norm.args[5]
    shape = list(x.meta["val"].shape)
    b = _Builder(new, stages, x)
    op = b.op

    def per_channel(v: torch.fx.Node) -> torch.fx.Node:
        return op(4, aten.view.default, v, [1, c] + [1] * (len(shape) - 2))

    def per_row(stage: int, v: torch.fx.Node, tail: list[int]) -> torch.fx.Node:
        return op(stage, aten.view.default, v, list(stat_shape) + tail)

    with new.graph.inserting_before(norm):
        mean, var = b.row_moments(rows, groups, size, single_pass)
        rstd = op(3, aten.rsqrt.default, op(3, aten.add.Tensor, var, eps))
        xr = op(4, aten.view.default, x, list(stat_shape) + [size])
        y = op(4, aten.mul.Tensor, op(4, aten.sub.Tensor, xr, per_row(4, mean, [1])),
               per_row(4, rstd, [1]))
        y = op(4, aten.view.default, y, shape)
        if weight is not None:
            y = op(4, aten.mul.Tensor, y, per_channel(weight))
        if bias is not None:
            y = op(4, aten.add.Tensor, y, per_channel(bias))
        results = [y, per_row(3, mean, []), per_row(3, rstd, [])]
    b.replace(norm, results)


# target -> (its plan, its rewrite)
_SPLITS = {BN_TRAIN: (_plan, _rewrite), LAYER_NORM: (_plan_rows, _rewrite_rows),
           GROUP_NORM: (_plan_groups, _rewrite_row_norm),
           INSTANCE_NORM: (_plan_instance, _rewrite_row_norm)}


# BatchNorm's input may be computed in the region by at most this many pointwise/view ops
# (a convolution's bias add and its view, an activation): each statistics stage computes
# it again, which costs arithmetic, not memory traffic. At 4, KernelBench L2 52 (bias
# add, view and Mish's six ops before a BatchNorm of 128 channels over 1M NHWC
# positions) had no split and its one-kernel template, a column reduction with a block
# per 128 channels, took 6.97 ms on the H200 against 2.95 for the region on ATen.
MAX_CHAIN = 12


def _pointwise_chain(x: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The region's nodes that compute ``x`` from its inputs, in graph order ([] when
    ``x`` is an input); None when one is not a cheap pointwise or view op."""
    from stitch_backend.opclass import OpClass, classify

    found: set[torch.fx.Node] = set()
    todo = [x]
    while todo:
        nd = todo.pop()
        if nd.op == "placeholder" or nd in found:
            continue
        if (nd.op != "call_function"
                or classify(nd) not in (OpClass.POINTWISE, OpClass.VIEW)
                or len(found) >= MAX_CHAIN):
            return None
        found.add(nd)
        todo += [a for a in nd.all_input_nodes]
    return [nd for nd in x.graph.nodes if nd in found]


def _propagate_metas(module: torch.fx.GraphModule) -> None:
    """``meta["val"]`` for every node (the Coder reads shapes and strides from it), in
    the fake mode of the region's own example values."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [nd.meta.get("val") for nd in module.graph.nodes if nd.op == "placeholder"]
    mode = detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
    args = [mode.from_tensor(v) if isinstance(v, torch.Tensor) and not
            isinstance(v, torch._subclasses.fake_tensor.FakeTensor) else v for v in vals]
    FakeTensorProp(module, mode).propagate_dont_convert_inputs(*args)


__all__ = ["StatsSplit", "groups_for", "split_norms"]
