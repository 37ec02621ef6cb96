"""An eval-mode BatchNorm folded into its convolution, the ReLU (and a residual) into cuDNN.

In inference a BatchNorm is an affine map per channel with constants from its running
statistics: ``bn(conv(x, w) + b) = conv(x, w * s) + (b - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``. Folding alone saves nothing here: the conv region's
template already applies the BatchNorm and the activation in the one epilogue kernel
that reads the convolution's output once. What folding makes possible is an epilogue
cuDNN applies itself: ``aten.cudnn_convolution_relu(x, w', b')`` is
``relu(conv(x, w') + b')`` and ``aten.cudnn_convolution_add_relu(x, w', z, 1, b')`` is
``relu(conv(x, w') + z + b')`` (a ResNet block's last BatchNorm, the shortcut added,
ReLU), so the output is written once and never read back.

The folded weight and bias are computed in every call from the graph's inputs, the live
parameters and buffers (``fold_bn``: a few small kernels over the weight; in a replayed
CUDA graph they replay with it), never from values captured at compile time: a model
whose weights change between calls (fine-tuning, a loaded checkpoint) stays correct.

The Coder proposes it (``agents.conv_fold``) as an alternative for a conv region whose
epilogue starts with such a chain; the Verifier judges it by DESIGN.md's rule (the
folded weight rounds differently from eager's two steps) and keeps it only where it is
faster. On the CPU (the tests) ``conv_relu`` computes the same with ATen's convolution.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from .lt_ops import only_user as _only_user
from .regions import tensor_val as _val

aten = torch.ops.aten

NORM = aten._native_batch_norm_legit_no_training.default
_ADDS = (aten.add.Tensor,)
_RELUS = (aten.relu.default,)


@dataclass(frozen=True)
class FoldChain:
    """``conv`` [-> ``bias_add`` of ``bias``] -> ``norm`` -> ``item`` (its output)
    [-> ``residual_add`` of ``residual``] -> ``relu``: each node's one user the next."""

    conv: torch.fx.Node
    bias_add: torch.fx.Node | None
    bias: torch.fx.Node | None
    norm: torch.fx.Node
    item: torch.fx.Node
    residual_add: torch.fx.Node | None
    residual: torch.fx.Node | None
    relu: torch.fx.Node

    @property
    def nodes(self) -> list[torch.fx.Node]:
        """The chain's nodes in graph order, the bias's view (1, C, 1, 1) included."""
        view = self.bias_add.args[1] if self.bias_add is not None else None
        return [n for n in (self.conv, view, self.bias_add, self.norm, self.item,
                            self.residual_add, self.relu) if n is not None]

    @property
    def what(self) -> str:
        """The cuDNN call that replaces the chain."""
        add = "_add" if self.residual is not None else ""
        return f"cudnn_convolution{add}_relu"


def _bias_of(add: torch.fx.Node, conv: torch.fx.Node, channels: int) -> torch.fx.Node | None:
    """The 1-D bias ``add`` adds to ``conv`` through a view (1, C, 1, ...)
    (``conv_bias.split_conv_bias``'s form), else None."""
    if add.target not in _ADDS or len(add.args) != 2 or add.kwargs or add.args[0] is not conv:
        return None
    view = add.args[1]
    if not isinstance(view, torch.fx.Node) or view.target is not aten.view.default:
        return None
    bias = view.args[0]
    bv = _val(bias)
    return bias if bv is not None and bv.dim() == 1 and bv.shape[0] == channels else None


def fold_chain(conv: torch.fx.Node, names: set[str]) -> FoldChain | None:
    """The chain from 2-D convolution ``conv`` through an eval-mode BatchNorm to a ReLU
    (perhaps a residual added before it), all among ``names`` (the region's nodes); None
    where the region's epilogue does not start so, or a step's value is used elsewhere."""
    if conv.target is not aten.convolution.default or len(conv.args) != 9 or conv.kwargs:
        return None
    x, w, cbias, _stride, _padding, _dilation, transposed, _out_pad, _groups = conv.args
    out, wv = _val(conv), _val(w)
    if transposed or out is None or wv is None or out.dim() != 4 or not out.is_floating_point():
        return None
    if any(isinstance(s, torch.SymInt) for s in out.shape):
        return None
    channels = int(wv.shape[0])
    step = _only_user(conv)
    bias_add = bias = None
    if step is not None and cbias is None and step.target in _ADDS:
        bias = _bias_of(step, conv, channels)
        if bias is None:
            return None
        bias_add, step = step, _only_user(step)
    norm = step
    if norm is None or norm.target is not NORM or norm.args[0] is not (bias_add or conv):
        return None
    item = _only_user(norm)
    if item is None or item.target is not operator.getitem or item.args[1] != 0:
        return None
    step = _only_user(item)
    residual_add = residual = None
    if step is not None and step.target in _ADDS and len(step.args) == 2 and not step.kwargs:
        other = step.args[1] if step.args[0] is item else step.args[0]
        ov = _val(other)
        if other is item or ov is None or ov.shape != out.shape or ov.dtype != out.dtype:
            return None
        residual_add, residual, step = step, other, _only_user(step)
    relu = step
    if relu is None or relu.target not in _RELUS:
        return None
    chain = FoldChain(conv, bias_add, bias, norm, item, residual_add, residual, relu)
    if not all(n.name in names for n in chain.nodes):
        return None
    rv = _val(relu)
    if rv is None or rv.stride() != out.stride() or rv.dtype != out.dtype:
        return None   # cuDNN writes the convolution's layout
    return chain


def fold_bn(w: torch.Tensor, b: torch.Tensor | None, gamma: torch.Tensor | None,
            beta: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded weight and bias, ``w * s`` and ``beta - mean * s + b * s`` with
    ``s = gamma / sqrt(var + eps)``, computed in fp32 and rounded to ``w``'s type: five
    small kernels for fp32 parameters with an affine BatchNorm and no bias (each a
    launch in every call, replayed with the CUDA graph)."""
    scale = torch.rsqrt(var.float() + eps)
    if gamma is not None:
        scale.mul_(gamma.float())
    base = beta.float() if beta is not None else torch.zeros_like(scale)
    shift = torch.addcmul(base, mean.float(), scale, value=-1)
    if b is not None:
        shift.addcmul_(b.float(), scale)
    w2 = w.float() * scale.view([-1] + [1] * (w.dim() - 1))
    return w2.to(w.dtype), shift.to(w.dtype)


def conv_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, z: torch.Tensor | None,
              stride: list[int], padding: list[int], dilation: list[int],
              groups: int) -> torch.Tensor:
    """``relu(conv(x, w) + b [+ z])``: cuDNN's fused call on CUDA, ATen's ops elsewhere."""
    if x.is_cuda:
        if z is None:
            return aten.cudnn_convolution_relu(x, w, b, stride, padding, dilation, groups)
        return aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, stride, padding, dilation, groups)
    y = aten.convolution(x, w, b, stride, padding, dilation, False, [0] * len(stride), groups)
    return torch.relu(y if z is None else y + z)


def rewrite(graph: torch.fx.Graph, chain: FoldChain) -> None:
    """Replace ``chain`` (its nodes by name in ``graph``, a region's module) with
    ``fold_bn`` and ``conv_relu``, in place. The call goes where the ReLU was: every
    operand (the residual too) is computed by then."""
    local = {n.name: n for n in graph.nodes}
    conv = local[chain.conv.name]
    x, w, cbias, stride, padding, dilation = conv.args[:6]
    groups = conv.args[8]
    norm = local[chain.norm.name]
    _, gamma, beta, mean, var, _, eps = norm.args
    b = local[chain.bias.name] if chain.bias is not None else cbias
    z = local[chain.residual.name] if chain.residual is not None else None
    relu = local[chain.relu.name]
    with graph.inserting_before(relu):
        folded = graph.call_function(fold_bn, (w, b, gamma, beta, mean, var, eps))
        w2 = graph.call_function(operator.getitem, (folded, 0))
        b2 = graph.call_function(operator.getitem, (folded, 1))
        call = graph.call_function(conv_relu, (x, w2, b2, z, stride, padding, dilation, groups))
        call.meta = dict(relu.meta)
    relu.replace_all_uses_with(call)
    for node in reversed(chain.nodes):
        graph.erase_node(local[node.name])
    graph.eliminate_dead_code()
    graph.lint()


__all__ = ["FoldChain", "conv_relu", "fold_bn", "fold_chain", "rewrite"]
