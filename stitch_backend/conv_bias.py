"""Convolution bias as an epilogue: ``convolution(x, w, b)`` -> ``convolution(x, w, None) + b``.

For a cuDNN convolution, ATen computes the product and then adds the bias in a separate
pass (``output.add_(bias.reshape(1, C, 1, ...))``: a broadcasting elementwise kernel
that reads and writes the whole output). With the bias as its own ``add`` node, the
Planner fuses it into the convolution's epilogue (BatchNorm, activation, ...), so that
pass disappears; the values are the same, since eager adds the same two fp32 numbers
once. On the H200, L3 RegNet spent 0.29 ms of its 2.0 ms call in those six bias adds.

Only convolutions cuDNN runs are rewritten (CUDA values, cuDNN enabled, one group):
ATen's own depthwise kernel starts its sum from the bias, a different rounding order.
For fp16/bf16, cuDNN's path in ATen rounds the product to the output's type and then
adds the bias (rounding again), as the split graph does. ATen's CPU convolutions (the
CPU interpreter's tests) add a bf16 bias inside the kernel, rounding once, so there
only fp32 convolutions are split (under CPU autocast, L2 25's doubly rounded values
moved its channel minimum at near ties and its bias gradient off eager's by 4x).
"""

from __future__ import annotations

import torch
import torch.fx

from .regions import inherit_source, rewritable_copy

aten = torch.ops.aten
# aten._convolution: the layout pass's convolutions with cuDNN's TF32 off
CONVS = (aten.convolution.default, aten._convolution.default)


def _eligible(node: torch.fx.Node, device: str) -> bool:
    if node.op != "call_function" or node.target not in CONVS:
        return False
    x, w, bias = node.args[:3]
    groups = node.args[8] if len(node.args) > 8 else node.kwargs.get("groups", 1)
    if not isinstance(bias, torch.fx.Node) or groups != 1:
        return False
    vals = [a.meta.get("val") for a in (x, w, bias)] + [node.meta.get("val")]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    xv, _, bv, out = vals
    if device != "cuda" and out.dtype != torch.float32:
        return False
    return (xv.device.type == device and bv.dim() == 1
            and isinstance(bv.shape[0], int) and out.dim() >= 3)


def cudnn_runs_convolutions() -> bool:
    return torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()


def split_conv_bias(gm: torch.fx.GraphModule, device: str = "cuda"
                    ) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with each convolution on ``device`` that has a bias and one group moved
    into an ``add`` after it (a new module; ``gm`` is not changed), and how many moved;
    ``gm`` itself when none. The caller checks that cuDNN runs them
    (``cudnn_runs_convolutions``; the CPU interpreter's tests use ``device="cpu"``)."""
    copied = rewritable_copy(gm, lambda n: _eligible(n, device))
    if copied is None:
        return gm, 0
    new, mode = copied
    graph = new.graph
    moved = 0
    for node in list(graph.nodes):
        if not _eligible(node, device):
            continue
        bias = node.args[2]
        out = node.meta["val"]
        shape = [1, int(bias.meta["val"].shape[0])] + [1] * (out.dim() - 2)
        with graph.inserting_after(node):
            view = graph.call_function(aten.view.default, (bias, shape))
        with graph.inserting_after(view):
            add = graph.call_function(aten.add.Tensor, (node, view))
        node.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
        node.args = node.args[:2] + (None,) + node.args[3:]
        with mode:
            view.meta["val"] = aten.view.default(bias.meta["val"], shape)
            add.meta["val"] = aten.add.Tensor(out, view.meta["val"])
        inherit_source(node, view, add)
        moved += 1
    graph.lint()
    new.recompile()
    return new, moved


__all__ = ["cudnn_runs_convolutions", "split_conv_bias"]
