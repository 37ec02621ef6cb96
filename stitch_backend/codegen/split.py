"""Split a whole-tensor reduction across the GPU.

A region whose reductions cover every element (``x.sum()``, ``x.mean()``, ``x.amax()``)
has a single row; as is, one block would do all the work. ``split_full_reductions``
rewrites it as ``S`` rows of ``C`` elements (the ``inner`` reductions, one block each)
plus ``outer`` reductions over the ``S`` partial results, which the emitter runs in the
last block to finish. ``S`` and ``C`` depend only on the sizes and the SM count, so the
summation order, and hence the result bits, are the same on every run.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from . import indexing as ix
from .kernel_ir import Cast, Domain, Expr, KernelIR, Op, RedRef, Reduction, Store, map_expr

SPLIT_MIN_ELEMENTS = 1 << 15  # below this one block is as fast as any split
CHUNK_MULTIPLE = 16  # chunk sizes stay multiples of every vector width


def _rebuild(e: Expr, refs: dict, memo: dict) -> Expr:
    """``e`` with RedRef rids renamed by ``refs``."""
    if e in memo:
        return memo[e]
    if isinstance(e, RedRef):
        out = replace(e, rid=refs[e.rid])
    elif isinstance(e, Op):
        out = replace(e, args=tuple(_rebuild(a, refs, memo) for a in e.args))
    elif isinstance(e, Cast):
        out = replace(e, x=_rebuild(e.x, refs, memo))
    else:
        out = e
    memo[e] = out
    return out


def split_full_reductions(ir: KernelIR, sm_count: int) -> KernelIR:
    """``ir`` split as described above when it is a single-row, single-pass reduction of
    at least ``SPLIT_MIN_ELEMENTS`` elements (or of a symbolic count); else ``ir``."""
    d = ir.domain
    if not ir.reductions or d.row_vars or not d.red_vars or ir.outer_reductions:
        return ir
    if any(r.phase != 0 or r.kind in ("argmax", "argmin", "softmax") for r in ir.reductions):
        return ir
    if any(s.level == "element" for s in ir.stores):
        return ir
    K = sympy.expand(d.reduce_len)
    splits = 2 * sm_count
    if K.is_Integer:
        if int(K) < SPLIT_MIN_ELEMENTS:
            return ir
        chunk = -(-int(K) // splits)
        chunk = sympy.Integer(-(-chunk // CHUNK_MULTIPLE) * CHUNK_MULTIPLE)
        splits = -(-int(K) // int(chunk))
    else:
        step = splits * CHUNK_MULTIPLE
        chunk = ix.FDiv(K + step - 1, sympy.Integer(step)) * CHUNK_MULTIPLE
    j, m = ix.loop_var(900), ix.loop_var(901)
    kk = j * chunk + m
    digits = ix.delinearize(kk, list(d.red_extents))
    mapping = dict(zip(d.red_vars, digits))
    ranges = {j: (sympy.Integer(0), sympy.Integer(splits - 1)), m: (sympy.Integer(0), chunk - 1)}
    simp = ix.Simplifier(ranges)
    memo: dict = {}

    def sub(e):
        return simp.simplify(e.xreplace(mapping))

    n = len(ir.reductions)
    reductions, refs = [], {}
    for r in ir.reductions:
        reductions.append(replace(r, body=map_expr(r.body, sub, memo)))
    for r in ir.reductions:
        refs[r.rid] = n + r.rid
        reductions.append(Reduction(n + r.rid, r.kind, RedRef(r.dtype, r.rid), r.dtype, "outer"))
    rmemo: dict = {}
    stores = tuple(Store(s.out, s.offset, _rebuild(s.value, refs, rmemo), (), "outer") for s in ir.stores)
    data = tuple((g, map_expr(e, sub, memo)) for g, e in ir.data_vars)
    limit = None if (K.is_Integer and int(K) == splits * int(chunk)) else sympy.Min(chunk, K - j * chunk)
    domain = Domain((j,), (sympy.Integer(splits),), (m,), (chunk,), limit)
    return replace(ir, domain=domain, reductions=tuple(reductions), stores=stores, data_vars=data,
                   notes=ir.notes + (f"whole-tensor reduction split into {splits} rows of {chunk}",))
