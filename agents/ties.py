"""Integer outputs that select a position, and bool outputs that compare with a number,
judged by the values they come from.

Max pooling's indices (which a training graph saves for the backward), ``max.dim`` /
``min.dim``'s indices and ``argmax`` / ``argmin`` name where a maximum or minimum is.
Where two candidates are nearly equal, a rounding difference upstream (a fused epilogue
adds in another order than ATen) makes the Program pick the other one, and an exact
comparison of the indices then fails the whole graph: L3 RegNet's training forward at
224x224 lost all 8 of its verified kernels that way (its second max pooling's indices).

So before the end-to-end comparison, each such output that differs from eager's is
looked at through the values it selects from: the selected op's input, taken from the
Program's own outputs (a training forward returns it for the backward) or the graph's
inputs. Where, in the Program's values, the position it picked and the one eager
picked hold values within the dtype's tolerance of each other (the rule ``correctness``
applies to values), widened by twice the largest difference between the Program's
values and eager's (values that differ by up to d elementwise can move a maximum to any
position within 2d of it: bf16 values under autocast differ from eager's by an ulp),
the pick is a near tie and eager's indices stand in for the Program's in the
comparison. Any other difference, or one whose values cannot be found, still fails;
the values themselves are judged as every output is. Only the comparison sees the substitute: the user gets the
Program's indices, whose backward routes the gradient to a value equal within
tolerance.

A bool output that compares values with a number (ReLU's mask ``le(relu(x), 0)``,
ReLU6's ``le(y, 0) | ge(y, 6)``, which a training forward saves for the backward) is
settled alike: where it differs from eager's, the compared value (the Program's, found
the same way, through aliases) must lie within the tolerance, plus twice the values'
largest difference from eager's, of a threshold. Where the compared value is neither an
output nor an input, nothing is settled: in a CPU sweep (2026-12-05) the differing masks
of KernelBench L3 10 ResNet101 and 22 EfficientNetB0 were of such values, and their
forward graphs still go back to ATen.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx

from stitch_backend.correctness import flatten_outputs, tolerance_for

aten = torch.ops.aten

# max pooling -> how many trailing (spatial) dimensions its indices are flat over
_POOLS = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3}
_REDUCTIONS = (aten.max.dim, aten.min.dim)
_ARGS = (aten.argmax.default, aten.argmin.default)
_COMPARISONS = (aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar)
_ALIASES = (aten.alias.default, aten.detach.default)
_COMBINED = (aten.bitwise_or.Tensor, aten.bitwise_and.Tensor, aten.logical_or.default,
             aten.logical_and.default)


@dataclass(frozen=True)
class Settled:
    """An output whose differing indices were all near ties."""

    output: int
    differing: int       # how many indices differ from eager's
    total: int


def settle(gm: torch.fx.GraphModule, inputs: Sequence[Any], got: Any,
           reference: Any) -> tuple[list[Any], list[Settled]]:
    """``got``'s outputs, flattened, with each selection index that differs from eager's
    only at near ties replaced by eager's; and which outputs that was done for."""
    outs, refs = flatten_outputs(got), flatten_outputs(reference)
    nodes = output_nodes(gm)
    if len(nodes) != len(outs) or len(outs) != len(refs):
        return outs, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # node -> (the Program's values, eager's): the same for graph inputs
    values_of: dict[torch.fx.Node, tuple[Any, Any]] = {
        n: (x, x) for n, x in zip(placeholders, inputs)}
    for node, value, ref in zip(nodes, outs, refs):
        if isinstance(node, torch.fx.Node):
            values_of.setdefault(node, (value, ref))
    result, settled = list(outs), []
    for i, (node, o, e) in enumerate(zip(nodes, outs, refs)):
        if not (isinstance(node, torch.fx.Node) and isinstance(o, torch.Tensor)
                and isinstance(e, torch.Tensor) and o.dtype == e.dtype
                and o.shape == e.shape and not torch.equal(o, e)):
            continue
        if _is_index(o):
            select = _selection(node)
            if select is None:
                continue
            source, gather = select
            near = lambda v, spread, g=gather: _near_ties(v, spread, g, o, e)  # noqa: E731
        elif o.dtype == torch.bool:
            compared = _comparison(node)
            if compared is None:
                continue
            source, thresholds = compared
            near = lambda v, spread, t=thresholds: _near_threshold(v, spread, t, o, e)  # noqa: E731
        else:
            continue
        values, eager_values = values_of.get(source, (None, None))
        if not (isinstance(values, torch.Tensor) and values.is_floating_point()
                and isinstance(eager_values, torch.Tensor)
                and eager_values.shape == values.shape):
            continue
        if near(values, _max_diff(values, eager_values)):
            result[i] = e
            settled.append(Settled(i, int((o != e).sum()), o.numel()))
    return result, settled


def _is_index(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.int64, torch.int32)


def output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    """The nodes (or constants) ``gm`` returns, flattened as its outputs are."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return flatten_outputs(out.args[0])


Gather = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _selection(node: torch.fx.Node) -> tuple[torch.fx.Node, Gather] | None:
    """The node whose values ``node`` indexes, and how to gather them; None when
    ``node`` is not a selection index."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args[1] == 1:
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "call_function":
            return None
        if src.target in _POOLS:
            return src.args[0], _pool_gather(_POOLS[src.target])
        if src.target in _REDUCTIONS:
            dim = src.args[1]
            keepdim = src.args[2] if len(src.args) > 2 else src.kwargs.get("keepdim", False)
            return src.args[0], _dim_gather(dim, keepdim)
        return None
    if node.target in _ARGS:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return node.args[0], (_flat_gather if dim is None else _dim_gather(dim, keepdim))
    return None


def _comparison(node: torch.fx.Node) -> tuple[torch.fx.Node, list[float]] | None:
    """(the node whose values ``node`` compares with numbers, those numbers) where
    ``node`` is such a comparison, through aliases: ReLU's mask ``le(relu(x), 0)``,
    ReLU6's ``le(y, 0) | ge(y, 6)`` (a training forward saves them for the backward).
    None otherwise."""
    if node.op != "call_function":
        return None
    if node.target in _COMBINED:
        parts = [_comparison(a) if isinstance(a, torch.fx.Node) else None
                 for a in node.args[:2]]
        if any(p is None for p in parts) or parts[0][0] is not parts[1][0]:
            return None
        return parts[0][0], parts[0][1] + parts[1][1]
    if node.target not in _COMPARISONS:
        return None
    src, threshold = node.args[0], node.args[1]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        return None
    while isinstance(src, torch.fx.Node) and src.op == "call_function" \
            and src.target in _ALIASES:
        src = src.args[0]
    return (src, [float(threshold)]) if isinstance(src, torch.fx.Node) else None


def _pool_gather(spatial: int) -> Gather:
    def gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        flat = values.flatten(-spatial)
        return flat.gather(-1, index.flatten(-spatial))
    return gather


def _dim_gather(dim: int, keepdim: bool) -> Gather:
    def gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        d = dim % max(values.dim(), 1)
        return values.gather(d, index if keepdim else index.unsqueeze(d))
    return gather


def _flat_gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1)[index.reshape(-1)]


def _max_diff(values: torch.Tensor, eager_values: torch.Tensor) -> float:
    """The largest |Program - eager| over the finite values (inf where they differ in
    shape of non-finite entries: then no pick is explained by it)."""
    a, b = values.detach().double(), eager_values.detach().to(values.device).double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(b)):
        return math.inf
    return float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0


def _near_threshold(values: torch.Tensor, spread: float, thresholds: list[float],
                    ours: torch.Tensor, eager: torch.Tensor) -> bool:
    """Whether, at every position where the comparison's result differs from eager's,
    the compared value (the Program's) lies within the dtype's tolerance plus
    ``2 * spread`` of one of the thresholds: a value that close may fall on either side."""
    if math.isinf(spread) or values.shape != ours.shape:
        return False
    differ = (ours != eager).to(values.device)
    v = values.detach().double()[differ]
    t = tolerance_for(values.dtype)
    near = torch.zeros_like(v, dtype=torch.bool)
    for threshold in thresholds:
        near |= (v - threshold).abs() <= t + t * abs(threshold) + 2 * spread
    return bool(near.all())


def _near_ties(values: torch.Tensor, spread: float, gather: Gather, ours: torch.Tensor,
               eager: torch.Tensor) -> bool:
    """Whether every position ``ours`` picks holds, in ``values``, what eager's pick
    holds, within the dtype's tolerance plus ``2 * spread`` (an index out of range is
    no tie)."""
    if math.isinf(spread):
        return False
    try:
        mine = gather(values, ours.to(values.device)).double()
        theirs = gather(values, eager.to(values.device)).double()
    except (IndexError, RuntimeError):
        return False
    t = tolerance_for(values.dtype)
    return bool(((mine - theirs).abs() <= t + t * theirs.abs() + 2 * spread).all())
