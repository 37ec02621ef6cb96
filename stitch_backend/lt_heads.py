"""Batched products read where attention keeps its heads: per-head cuBLASLt calls.

Attention's ``q @ k^T`` and ``att @ v`` are batched over (batch, head). q, k and v are
views of the packed projection (B, T, 3C), so their (batch, head) slices are not one
batch stride apart, and ATen's bmm needs them copied contiguous first (L3 MiniGPT: three
copies of 201 MB each way, 0.336 ms on the H200); the product of ``att @ v`` is then
copied again into the (B, T, C) layout the next Linear reads. cuBLASLt takes any leading
dimension and batch stride, so one call per head, batched over the batch, reads q, k and
v in place and writes the output straight into its final layout.

``heads_pattern`` recognises such a region (a bmm whose operands are copies of 4-D
region inputs merged over their first two dims, whose output is perhaps viewed to 4-D,
permuted, copied and viewed again); ``lt_bmm_heads`` is the call the Coder's candidate
makes (``agents.coder``), raced by the Verifier against the copies and ATen's bmm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .regions import tensor_val as _val

aten = torch.ops.aten

_PASS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.clone.default, aten.expand.default)


@dataclass(frozen=True)
class HeadsPattern:
    """``output = (a @ b)`` over the first two dims of the 4-D region inputs ``a`` (P, Q,
    M, K) and ``b`` (P, Q, K, N), permuted by ``perm``, contiguous, viewed as ``shape``."""

    bmm: torch.fx.Node
    a: torch.fx.Node
    b: torch.fx.Node
    output: torch.fx.Node
    perm: tuple[int, ...]
    shape: tuple[int, ...]


def _copy_only(node: torch.fx.Node) -> bool:
    """A clone that keeps the layout's meaning (contiguous or preserve), no other args."""
    fmt = node.kwargs.get("memory_format", torch.preserve_format)
    return len(node.args) == 1 and fmt in (torch.preserve_format, torch.contiguous_format)


def _source(operand: torch.fx.Node, members: set, inputs: set) -> torch.fx.Node | None:
    """The 4-D region input ``operand`` (a bmm's 3-D operand) is, merged over its first
    two dims, through views, same-shape expands and copies; else None."""
    node = operand
    while node.name not in inputs:
        if node not in members or node.target not in _PASS:
            return None
        if node.target is aten.clone.default and not _copy_only(node):
            return None
        src = node.args[0]
        if node.target is aten.expand.default and (
                _val(src) is None or tuple(_val(src).shape) != tuple(_val(node).shape)):
            return None
        if not isinstance(src, torch.fx.Node):
            return None
        node = src
    x, op = _val(node), _val(operand)
    if x is None or op is None or x.dim() != 4 or op.dim() != 3:
        return None
    p, q, m, k = (int(s) for s in x.shape)
    if tuple(int(s) for s in op.shape) != (p * q, m, k):
        return None
    if 1 not in (x.stride(-1), x.stride(-2)):   # a slice must be a matrix cuBLASLt reads
        return None
    return node


def heads_pattern(bmm: torch.fx.Node, members: set, inputs: set,
                  outputs: list[str]) -> HeadsPattern | None:
    """The pattern of a region (its nodes ``members``, input and output names) whose one
    bmm is ``bmm``; None where it does not hold."""
    if bmm.target is not aten.bmm.default or len(bmm.args) != 2 or bmm.kwargs:
        return None
    a, b = (_source(x, members, inputs) if isinstance(x, torch.fx.Node) else None
            for x in bmm.args)
    va, vb, out = _val(a), _val(b), _val(bmm)
    if va is None or vb is None or out is None or va.dtype not in (
            torch.float32, torch.float16, torch.bfloat16) or vb.dtype != va.dtype:
        return None
    p, q, m, _ = va.shape
    if tuple(vb.shape[:2]) != (p, q) or va.shape[3] != vb.shape[2]:
        return None
    n = int(vb.shape[3])
    logical = (int(p), int(q), int(m), n)
    node, perm, copied = bmm, (0, 1, 2, 3), True
    while node.name not in outputs:
        if len(node.users) != 1:
            return None
        (node,) = node.users
        if node not in members:
            return None
        if node.target is aten.permute.default and perm == (0, 1, 2, 3) and copied:
            perm, copied = tuple(node.args[1]), False
            if sorted(perm) != [0, 1, 2, 3] or tuple(_val(node.args[0]).shape) != logical:
                return None
        elif node.target is aten.clone.default and _copy_only(node):
            copied = True
        elif node.target not in (aten.view.default, aten._unsafe_view.default,
                                 aten.reshape.default) or not copied:
            return None    # a view of a permuted, uncopied value is not a reshape of it
    if outputs != [node.name] or not copied or not _val(node).is_contiguous():
        return None    # lt_bmm_heads hands over a contiguous tensor
    return HeadsPattern(bmm, a, b, node, perm, tuple(int(s) for s in _val(node).shape))


def lt_bmm_heads(a: torch.Tensor, b: torch.Tensor, perm: list[int],
                 shape: list[int]) -> torch.Tensor:
    """``a`` (P, Q, M, K) @ ``b`` (P, Q, K, N) over the first two dims, permuted by
    ``perm``, contiguous, viewed as ``shape``: one cuBLASLt call for each index of the
    shorter of P and Q, batched over the other, reading ``a`` and ``b`` where they lie
    and writing each slice where the permuted result keeps it."""
    p, q, m, _ = a.shape
    logical = (p, q, m, b.shape[3])
    base = torch.empty([logical[i] for i in perm], dtype=a.dtype, device=a.device)
    inverse = [perm.index(i) for i in range(4)]
    out = base.permute(inverse)
    d = 1 if q <= p else 0
    for j in range(logical[d]):
        _product(a.select(d, j), b.select(d, j), out.select(d, j))
    return base.view(shape)


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` (3-D, batched) by ``lt_ops._matmul`` (the algorithm timed at the
    problem's first call). Looked up at each call so that CPU tests can stand in for the
    library."""
    from . import lt_ops

    lt_ops._matmul(a, b, None, "DEFAULT", out=out)


__all__ = ["HeadsPattern", "heads_pattern", "lt_bmm_heads"]
