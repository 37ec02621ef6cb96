"""Second half of lowering: place outputs in the iteration space, tidy loop variables.

``finalize`` turns the lazily-built region (``lower.Ctx``) into a ``KernelIR``:
  1. fix the domain (the largest reduction's input, else the largest output),
  2. map each output onto the domain and classify its store (element / row / outer),
  3. drop extent-1 loop variables, order variables by memory stride (so the innermost
     loop walks contiguous memory) and merge adjacent variables that are contiguous in
     every tensor (``8*i0 + i1`` with extent(i1) = 8 becomes one variable),
  4. bind every size symbol to the region input it is read from at launch time.
"""

from __future__ import annotations

import sympy
import torch

from . import indexing as ix
from .kernel_ir import (
    Domain, Expr, IndexVal, KernelIR, Load, RedRef, Reduction, Store, SymbolBinding,
    TensorArg, Unsupported, map_expr, walk,
)
from .lower import LT, Ctx, cast, expr_vars


def finalize(ctx: Ctx, out_vals: list, int_inputs: list) -> KernelIR:
    outputs = []
    for k, (node, lt) in enumerate(out_vals):
        val = node.meta["val"]
        outputs.append(TensorArg(f"out{k}", k, val.dtype,
                                 tuple(ix.sympify_size(s) for s in val.shape),
                                 tuple(ix.sympify_size(s) for s in val.stride())))
    _fix_domain(ctx, outputs)
    stores = []
    for arg, (_, lt) in zip(outputs, out_vals):
        numel = ix.prod(arg.shape)
        if numel == 0:
            continue  # nothing to write (e.g. batch norm's empty saved stats in eval)
        stores.append(_store(ctx, arg, lt))
    return _tidy(ctx, outputs, stores, int_inputs)


def _largest(items, numel):
    best = items[0]
    for it in items[1:]:
        a, b = numel(it), numel(best)
        if ix.known_nonneg(a - b) and not ix.known_equal(a, b):
            best = it
    return best


def _fix_domain(ctx: Ctx, outputs: list[TensorArg]) -> None:
    if ctx.specs:
        primary = _largest(ctx.specs, lambda s: s.numel)
        ctx.fix_domain(primary.x.shape, primary.dims)
    else:
        nonempty = [o for o in outputs if ix.prod(o.shape) != 0] or outputs
        primary = _largest(nonempty, lambda o: ix.prod(o.shape))
        ctx.fix_domain(primary.shape, ())


def _store(ctx: Ctx, arg: TensorArg, lt: LT) -> Store:
    shape, vars_ = ctx.dom_shape, list(ctx.dom_vars)
    out_shape = arg.shape
    numel = ix.prod(out_shape)
    zero = sympy.Integer(0)
    cands = []
    if len(out_shape) == len(shape) and all(ix.known_equal(a, b) for a, b in zip(out_shape, shape)):
        cands.append((vars_, []))
    if ctx.red_dims and ix.known_equal(numel, ix.prod(ctx._row_sizes())):
        rlin = ix.linearize(list(ctx.row_vars), ctx._row_sizes())
        cands.append((ix.delinearize(rlin, list(out_shape)), list(ctx.red_vars)))
    off = len(shape) - len(out_shape)
    if off >= 0 and all(d == 1 or ix.known_equal(d, shape[j + off]) for j, d in enumerate(out_shape)):
        idx = [zero if d == 1 else vars_[j + off] for j, d in enumerate(out_shape)]
        used = {i for i in idx if i != 0}
        cands.append((idx, [v for v in vars_ if v not in used]))
    if len(out_shape) == 1 and out_shape[0] != 1:
        # a per-channel vector (e.g. batch norm's saved stats) along one domain dim
        for j, s in enumerate(shape):
            if ix.known_equal(s, out_shape[0]):
                cands.append(([vars_[j]], [v for v in vars_ if v != vars_[j]]))
    if ix.known_equal(numel, ix.prod(shape)):
        cands.append((ix.delinearize(ix.linearize(vars_, list(shape)), list(out_shape)), []))
    if numel == 1:
        cands.append(([zero] * len(out_shape), vars_))
    errors = []
    for idx, guards in cands:
        try:
            idx = [ctx.simplify(i) for i in idx]
            value = cast(lt.at(idx), arg.dtype)
            return _classify(ctx, arg, idx, value, guards)
        except Unsupported as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    raise Unsupported(f"output {arg.position} of shape {tuple(out_shape)} does not fit the "
                      f"iteration space {tuple(shape)} of the region")


def _classify(ctx: Ctx, arg: TensorArg, idx, value: Expr, guards) -> Store:
    extents = dict(zip(ctx.dom_vars, ctx.dom_shape))
    guards = [g for g in guards if extents.get(g) != 1]
    offset = sympy.Integer(0)
    for i, s, st in zip(idx, arg.shape, arg.stride):
        if s != 1:
            offset = offset + i * st
    offset = ctx.simplify(offset)
    data = ctx.data_exprs()
    used = expr_vars(value, data) | {s for s in offset.free_symbols if ix.is_loop_var(s)}
    reds = {n.rid for n in walk([value] + [data[s] for s in _data_syms(value, data)])
            if isinstance(n, RedRef)}
    outer = any(ctx.reductions[r].level == "outer" for r in reds)
    all_vars = {v for v in ctx.dom_vars if extents[v] != 1}
    red_vars = {v for v in ctx.red_vars if extents[v] != 1}
    if outer:
        if not set(guards) >= all_vars:
            raise Unsupported("an output with more than one element uses a cross-row reduction "
                              "(it would need a second pass over the rows)")
        zero = {v: 0 for v in ctx.dom_vars}
        return Store(arg.position, offset.subs(zero), _subs(value, zero), (), "outer")
    if ctx.red_dims and not (used & red_vars) and set(guards) >= red_vars:
        return Store(arg.position, offset, value,
                     tuple(g for g in guards if g not in red_vars), "row")
    return Store(arg.position, offset, value, tuple(guards), "element")


def _data_syms(e: Expr, data: dict) -> list:
    out, todo = [], [e]
    while todo:
        for n in walk([todo.pop()]):
            exprs = (n.offset,) if isinstance(n, Load) else (n.expr,) if isinstance(n, IndexVal) else ()
            for ie in exprs:
                for s in ie.free_symbols:
                    if ix.is_data_var(s) and s not in out:
                        out.append(s)
                        todo.append(data[s])
    return out


def _subs(e: Expr, mapping: dict, simp=None, memo=None) -> Expr:
    def f(ie):
        out = sympy.expand(ie.xreplace({k: sympy.sympify(v) for k, v in mapping.items()}))
        return simp.simplify(out) if simp is not None else out
    return map_expr(e, f, memo)


# ----------------------------------------------------------------------------- tidy up


class _Kernel:
    """Mutable working copy of everything that holds index expressions."""

    def __init__(self, ctx: Ctx, stores: list[Store]):
        self.stores = stores
        self.reductions = list(ctx.reductions)
        data = ctx.data_exprs()
        used = []
        for root in [s.value for s in stores] + [r.body for r in self.reductions]:
            for s in _data_syms(root, data):
                if s not in used:
                    used.append(s)
        self.data = [(s, data[s]) for s in sorted(used, key=lambda s: int(s.name[1:]))]

    def substitute(self, mapping: dict, simp: ix.Simplifier) -> None:
        memo: dict = {}

        def f(ie):
            return simp.simplify(ie.xreplace(mapping))

        self.stores = [Store(s.out, f(s.offset), map_expr(s.value, f, memo),
                             tuple(f(g) for g in s.guards), s.level) for s in self.stores]
        self.reductions = [Reduction(r.rid, r.kind, map_expr(r.body, f, memo), r.dtype, r.level,
                                     None if r.index is None else f(r.index), r.phase)
                           for r in self.reductions]
        self.data = [(s, map_expr(e, f, memo)) for s, e in self.data]

    def index_exprs(self) -> list:
        roots = [s.value for s in self.stores] + [r.body for r in self.reductions]
        roots += [e for _, e in self.data]
        out = [s.offset for s in self.stores]
        out += [r.index for r in self.reductions if r.index is not None]
        for n in walk(roots):
            if isinstance(n, Load):
                out.append(n.offset)
            elif isinstance(n, IndexVal):
                out.append(n.expr)
        return out


def _tidy(ctx: Ctx, outputs: list[TensorArg], stores: list[Store], int_inputs) -> KernelIR:
    k = _Kernel(ctx, stores)
    extents = dict(zip(ctx.dom_vars, ctx.dom_shape))
    ranges = dict(ctx.simp.ranges)
    ones = {v: sympy.Integer(0) for v, e in extents.items() if e == 1}
    simp = ix.Simplifier(ranges)
    k.substitute(ones, simp)
    rows = [v for v in ctx.row_vars if v not in ones]
    reds = [v for v in ctx.red_vars if v not in ones]
    ref = _reference_expr(ctx, k)
    # Rows follow the reference load; where its strides are not plain numbers (a
    # pooling's clamped window, a pad) they follow the stores instead, so a channels-last
    # pooling walks its channels innermost, as it reads and writes them
    rows = _order(rows, ref, *(s.offset for s in k.stores))
    reds = _order(reds, ref)
    counter = [len(ctx.dom_vars)]
    rows = _merge(rows, extents, k, ranges, counter)
    reds = _merge(reds, extents, k, ranges, counter)
    domain = Domain(tuple(rows), tuple(extents[v] for v in rows),
                    tuple(reds), tuple(extents[v] for v in reds))
    symbols = _bind_symbols(ctx, outputs, domain, k)
    return KernelIR(
        name=ctx.name, ops=tuple(ctx.ops), inputs=tuple(ctx.inputs), outputs=tuple(outputs),
        n_region_inputs=len([n for n in ctx.gm.graph.nodes if n.op == "placeholder"]),
        symbols=symbols, domain=domain, reductions=tuple(k.reductions), stores=tuple(k.stores),
        data_vars=tuple(k.data), int_inputs=tuple(int_inputs),
        data_extents=tuple((s, ctx.data_ranges[s][1] + 1) for s, _ in k.data))


def _reference_expr(ctx: Ctx, k: _Kernel) -> sympy.Expr | None:
    """The index expression whose memory order the loops should follow."""
    if ctx.red_dims and k.reductions:
        best, nvars = None, -1
        for r in k.reductions:
            for n in walk([r.body]):
                if isinstance(n, Load):
                    cnt = len([s for s in n.offset.free_symbols if ix.is_loop_var(s)])
                    if cnt > nvars:
                        best, nvars = n.offset, cnt
        return best
    elem = [s for s in k.stores if s.level == "element"]
    if not elem:
        return None
    return max(elem, key=lambda s: len(s.offset.free_symbols)).offset


def _order(vars_: list, ref: sympy.Expr | None, *fallbacks: sympy.Expr) -> list:
    """Sort by decreasing stride in ``ref`` when the strides are known numbers, not all
    zero; else in the first of ``fallbacks`` where they are; else as they are."""
    if len(vars_) < 2:
        return vars_
    for expr in (ref, *fallbacks):
        if expr is None:
            continue
        coeffs = []
        for v in vars_:
            c = sympy.expand(sympy.diff(expr, v))
            if not c.is_Number:
                break
            coeffs.append(int(c))
        else:
            if any(coeffs):
                order = sorted(range(len(vars_)), key=lambda j: -coeffs[j])
                return [vars_[j] for j in order]
    return vars_


def _linear_coeff(e: sympy.Expr, v: sympy.Symbol):
    """Coefficient of ``v`` in ``e`` if ``v`` occurs only linearly, else None."""
    for f in e.atoms(ix.FDiv, ix.IMod):
        if v in f.free_symbols:
            return None
    d = sympy.expand(sympy.diff(e, v))
    if v in d.free_symbols:
        return None
    return d


def _merge(vars_: list, extents: dict, k: _Kernel, ranges: dict, counter: list) -> list:
    changed = True
    while changed and len(vars_) > 1:
        changed = False
        exprs = k.index_exprs()
        for j in range(len(vars_) - 1):
            a, b = vars_[j], vars_[j + 1]
            ok = True
            for e in exprs:
                ca, cb = _linear_coeff(e, a), _linear_coeff(e, b)
                if ca is None or cb is None or not ix.known_equal(ca, cb * extents[b]):
                    ok = False
                    break
            if not ok:
                continue
            m = ix.loop_var(counter[0])
            counter[0] += 1
            extents[m] = sympy.expand(extents[a] * extents[b])
            ranges[m] = (sympy.Integer(0), extents[m] - 1)
            simp = ix.Simplifier(ranges)
            k.substitute({a: ix.FDiv(m, extents[b]), b: ix.IMod(m, extents[b])}, simp)
            vars_ = vars_[:j] + [m] + vars_[j + 2:]
            changed = True
            break
    return vars_


def _bind_symbols(ctx: Ctx, outputs, domain: Domain, k: _Kernel) -> tuple:
    needed: set = set()
    for e in list(domain.row_extents) + list(domain.red_extents) + k.index_exprs():
        needed |= e.free_symbols
    for arg in list(ctx.inputs) + list(outputs):
        for e in arg.shape + arg.stride:
            needed |= e.free_symbols
    roots = [s.value for s in k.stores] + [r.body for r in k.reductions] + [e for _, e in k.data]
    for n in walk(roots):
        if hasattr(n, "expr") and isinstance(getattr(n, "expr"), sympy.Basic):
            needed |= n.expr.free_symbols
    needed = {s for s in needed if not ix.is_loop_var(s) and not ix.is_data_var(s)}
    bindings: dict = {}
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    for pos, node in enumerate(placeholders):
        val = node.meta["val"]
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                e = ix.sympify_size(s)
                if isinstance(e, sympy.Symbol) and e not in bindings:
                    bindings[e] = SymbolBinding(e, pos, d, "size")
            for d, s in enumerate(val.stride()):
                e = ix.sympify_size(s)
                if isinstance(e, sympy.Symbol) and e not in bindings:
                    bindings[e] = SymbolBinding(e, pos, d, "stride")
        elif isinstance(val, torch.SymInt):
            e = ix.sympify_size(val)
            if isinstance(e, sympy.Symbol) and e not in bindings:
                bindings[e] = SymbolBinding(e, pos, None, "int")
    missing = needed - set(bindings)
    if missing:
        raise Unsupported(f"size symbols {sorted(map(str, missing))} cannot be read from the "
                          "region's inputs")
    return tuple(bindings[s] for s in sorted(needed, key=str))
