"""The ``auto`` setting of the channels-last pass (``layout``): the graphs whose traced
layout it keeps, each rule with the measurement behind it. ``auto_declines`` says why
(None: the pass rewrites the graph, its precision checks still to come) and whether the
rule is a guess that measurements went both ways on (``few_positions``: the
``layout_race`` option's 'auto' then times both layouts)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx

from .instance_norm import VIEWS as _VIEWS
from .instance_norm import merges_batch_into_channels
from .layout import CONV

aten = torch.ops.aten

# The ``auto`` setting rewrites a graph only where every training BatchNorm has at least
# this many positions (N*H*W) per channel. Measured on the H200 (L3, side by side, one
# run): channels-last won with ResNetBasicBlock (501760 positions, 1.188 vs 1.667 ms)
# and RegNet (25088 and up, 1.663 vs 2.087 ms) and lost with ResNet18 (down to 98:
# 0.770 vs 0.656 ms) and MobileNetV1 (down to 490: 1.189 vs 1.041 ms), whose small
# late-layer statistics regions ran 2x slower than ATen's NHWC BatchNorm in our kernels.
AUTO_MIN_POSITIONS = 16384
_BN_TRAIN = frozenset({aten._native_batch_norm_legit_functional.default,
                       aten._native_batch_norm_legit.default,
                       aten._native_batch_norm_legit.no_stats,
                       aten.native_batch_norm.default})


def auto_declines(gm: torch.fx.GraphModule) -> str | None:
    """Why the ``auto`` setting keeps ``gm``'s traced layout (None: rewrite it)."""
    return (_strided_layer_norm(gm) or _strided_softmax(gm) or _instance_norm(gm)
            or few_positions(gm))


def _training_batch_norms(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, torch.Tensor]]:
    """``gm``'s training BatchNorms over 4-D or 5-D values, with the value."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _BN_TRAIN:
            continue
        training = node.args[3] if node.target is aten._native_batch_norm_legit.no_stats \
            else node.args[5]
        if not training:
            continue                     # inference BatchNorm: pointwise, any layout
        x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() in (4, 5):
            yield node, x


def _instance_norm(gm: torch.fx.GraphModule) -> str | None:
    for node, _ in _training_batch_norms(gm):
        if merges_batch_into_channels(node.args[0]):
            return (f"auto: {node.name} is an instance norm, whose statistics read rows of "
                    "the traced layout (channels_last=True forces the rewrite, and computes "
                    "them over the value's own dims where it can)")
    return None


def few_positions(gm: torch.fx.GraphModule) -> str | None:
    """Why ``gm``'s training BatchNorms keep its traced layout (too few positions per
    channel), or None. The rule is a guess: forced NHWC, ResNet18 and MobileNetV1 (below
    the threshold) ran faster on an H100 in session 24 and ResNet18 again in session 26
    (0.548 against 0.586 ms), MobileNetV2 and EfficientNetB0 slower (``layout_race``'s
    docstring); so the ``layout_race`` option's 'auto' times both layouts there."""
    for node, x in _training_batch_norms(gm):
        if merges_batch_into_channels(node.args[0]):
            continue
        positions = x.numel() // x.shape[1]
        if positions < AUTO_MIN_POSITIONS:
            return (f"auto: {node.name} computes BatchNorm statistics over {positions} "
                    f"positions per channel, fewer than {AUTO_MIN_POSITIONS} (channels_last=True "
                    "forces the rewrite)")
    return None


def _strided_layer_norm(gm: torch.fx.GraphModule) -> str | None:
    """A layer norm over the trailing sizes of a 4-D or 5-D value, channels excluded: in
    channels-last its rows are strided by the channel count. On the H200 (KernelBench L2
    3, ConvTranspose3d + LayerNorm over W + AvgPool3d + GELU, one run) the generated
    region of layer norm, pooling and GELU took 5.00 ms channels-last; the whole graph
    stitched in its traced layout had taken 2.92 ms in the session before."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.native_layer_norm.default:
            continue
        x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() in (4, 5) and len(node.args[1]) < x.dim() - 1:
            return (f"auto: {node.name} normalises over the last {len(node.args[1])} of "
                    f"{x.dim()} dims, rows strided channels-last (channels_last=True forces "
                    "the rewrite)")
    return None


_SOFTMAX = frozenset({aten._softmax.default, aten._log_softmax.default})


def _strided_softmax(gm: torch.fx.GraphModule) -> str | None:
    """A softmax over the positions of a convolution's output (read through pointwise
    ops and views: ``softmax(x.view(b, c, -1), 2)``): channels-last, its rows are strided
    by the channel count. On an H100 (KernelBench L2 38, 2026-12-06) that region took
    4.28 ms over rows of 131072 positions (ATen's 4.72), and the whole graph ran at 0.99x
    eager where Inductor's ran 2.04x; in the traced layout the rows are contiguous."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX:
            continue
        src, conv = node.args[0], _conv_source(node.args[0])
        if conv is None:
            continue
        x, v = src.meta.get("val"), conv.meta.get("val")
        if not isinstance(x, torch.Tensor) or not isinstance(v, torch.Tensor) or v.dim() not in (4, 5):
            continue
        d = node.args[1] % x.dim()
        flat = x.dim() == 3 and tuple(x.shape[:2]) == tuple(v.shape[:2])
        if (x.dim() == v.dim() and d >= 2) or (flat and d == 2):
            return (f"auto: {node.name} is a softmax over the positions of {conv.name}'s "
                    "output, rows strided channels-last (channels_last=True forces the "
                    "rewrite)")
    return None


def _conv_source(node: Any) -> torch.fx.Node | None:
    """The convolution ``node`` is computed from through views and pointwise ops (their
    first argument), or None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is CONV:
            return node
        if node.target not in _VIEWS and torch.Tag.pointwise not in getattr(
                node.target, "tags", ()):
            return None
        node = node.args[0]
    return None


__all__ = ["AUTO_MIN_POSITIONS", "auto_declines", "few_positions"]
