"""A kernel's fp32 exponentials and divisions in their fast forms (the Coder's
``_clf_r`` alternative, raced beside the accurate kernel, never its replacement).

A row reduction that keeps its row on chip (the cluster layout) is no longer bound by
memory but by its instructions: L1 23's softmax, one block an SM, spends about 46 an
element where the H200's copy rate leaves about 31 (session 38's count), most of them in
``expf`` (a range reduction around ``MUFU.EX2``) and in the IEEE division by the row's
sum. Its cluster kernel compiled with ``--use_fast_math`` took 6.70 ms on an H100
against 8.57 as generated (session 39, ``kb/tune/cluster_ab.py``). The fast forms:

- ``exp`` of fp32 values becomes ``__expf`` (``MUFU.EX2`` of x * log2(e)); its error is
  2 + 1.17 |x| ulp (CUDA C++ Programming Guide, intrinsic functions), about 1e-5
  relative at |x| = 87, where fp32's exp leaves the normal range;
- the online softmax statistics (``sfk_online_add``, ``sfk_op_online``) take the same
  ``__expf`` (the header's ``sfk_exp_`` under ``SFK_FAST_EXP``), and a vector chunk adds
  its lanes at once (``sfk_online_addv``: the chunk's maximum, at most one rescale, the
  exponentials summed as a tree) where the accurate kernel compares and branches an
  element, as the hand-written kernel of ``kb/tune`` that reached 4.67 ms did;
- a division by a value that does not change along the row (a reduction's result, a
  constant, or an expression of those: the softmax's sum, a norm's root) becomes a
  multiply by its reciprocal, which the emitter declares once a row; at most one more
  rounding than the division (1.5 ulp).

Everything else, sums and their order included, is the accurate kernel's. Values move by
a few ulp, far inside the Verifier's 1e-4; the Verifier checks each kernel on its region's
inputs before one is kept. fp64 and integer arithmetic keep their forms.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .kernel_ir import Cast, Expr, IndexVal, KernelIR, Load, Op, Unsupported, walk


def _row_invariant(e: Expr, memo: dict) -> bool:
    """Whether ``e`` reads no element of the row (no load, no loop index): a reduction's
    result, a size, a constant and what is computed from them."""
    if e in memo:
        return memo[e]
    if isinstance(e, (Load, IndexVal)):
        out = False
    elif isinstance(e, Op):
        out = all(_row_invariant(a, memo) for a in e.args)
    elif isinstance(e, Cast):
        out = _row_invariant(e.x, memo)
    else:
        out = True
    memo[e] = out
    return out


def _rewrite(e: Expr, memo: dict, inv: dict) -> Expr:
    if e in memo:
        return memo[e]
    if isinstance(e, Cast):
        out = replace(e, x=_rewrite(e.x, memo, inv))
    elif isinstance(e, Op):
        args = tuple(_rewrite(a, memo, inv) for a in e.args)
        if (e.name == "div" and e.dtype == torch.float32 and args[1].dtype == torch.float32
                and _row_invariant(args[1], inv)):
            out = Op(e.dtype, "mul", (args[0], Op(e.dtype, "reciprocal", (args[1],))))
        else:
            out = replace(e, args=args)
    else:
        out = e
    memo[e] = out
    return out


def why_not_fast(ir: KernelIR) -> str | None:
    """None where ``fast_math`` changes ``ir``'s kernel; else why it would not."""
    if any(r.kind == "softmax" and r.dtype == torch.float32 for r in ir.reductions):
        return None
    inv: dict = {}
    for e in walk([s.value for s in ir.stores] + [r.body for r in ir.reductions]):
        if isinstance(e, Op) and e.dtype == torch.float32 and (
                e.name == "exp" or (e.name == "div" and _row_invariant(e.args[1], inv)
                                    and not _row_invariant(e.args[0], inv))):
            return None
    return "no fp32 exp, online softmax or division of elements by a row's value to make fast"


def fast_math(ir: KernelIR) -> KernelIR:
    """``ir`` with its fp32 exponentials and divisions by row-invariant values in their
    fast forms (above); raises ``Unsupported`` where it has none."""
    why = why_not_fast(ir)
    if why is not None:
        raise Unsupported(why)
    memo: dict = {}
    inv: dict = {}
    stores = tuple(replace(s, value=_rewrite(s.value, memo, inv)) for s in ir.stores)
    reductions = tuple(replace(r, body=_rewrite(r.body, memo, inv)) for r in ir.reductions)
    return replace(ir, stores=stores, reductions=reductions, fast_math=True)


__all__ = ["fast_math", "why_not_fast"]
