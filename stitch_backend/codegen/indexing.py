"""Index arithmetic for generated kernels: sympy expressions over loop variables and sizes.

An index expression is a sympy expression built from
  * loop variables (``i0, i1, ...``: integer, non-negative, each with an extent),
  * size symbols taken from torch's ShapeEnv (``s0, s7, ...``: positive integers; they
    become kernel arguments),
  * data-dependent indices (``g0, g1, ...``: the value of a loaded tensor, used by gather),
  * ``FDiv(a, b)`` (floor division) and ``IMod(a, b)`` (remainder), both on non-negative
    operands.

Views (reshape, permute, slice, ...) rewrite a tensor's index in these terms; the
simplifier here undoes round trips such as ``(8*i0 + i1) // 8 -> i0`` using the loop
variables' ranges, so the code the emitter prints has no needless divisions.
"""

from __future__ import annotations

import functools
from typing import Mapping

import sympy

Range = tuple[sympy.Expr, sympy.Expr]


class FDiv(sympy.Function):
    """Floor division of non-negative integers."""

    is_integer = True
    is_nonnegative = True
    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        return None


class IMod(sympy.Function):
    """Remainder of non-negative integers."""

    is_integer = True
    is_nonnegative = True
    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if b == 1 or a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        return None


def loop_var(n: int) -> sympy.Symbol:
    """The loop variable named ``i<n>``."""
    return sympy.Symbol(f"i{n}", integer=True, nonnegative=True)


def data_var(n: int) -> sympy.Symbol:
    """The data-dependent index named ``g<n>`` (its value comes from a load)."""
    return sympy.Symbol(f"g{n}", integer=True, nonnegative=True)


def is_loop_var(s: sympy.Basic) -> bool:
    return isinstance(s, sympy.Symbol) and s.name.startswith("i") and s.name[1:].isdigit()


def is_data_var(s: sympy.Basic) -> bool:
    return isinstance(s, sympy.Symbol) and s.name.startswith("g") and s.name[1:].isdigit()


def sympify_size(value) -> sympy.Expr:
    """A torch size (int or SymInt) as a sympy expression."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a size")
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, sympy.Basic):
        return value
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    if expr is None:
        raise TypeError(f"not a size: {value!r}")
    return sympy.sympify(expr)


def prod(values) -> sympy.Expr:
    out = sympy.Integer(1)
    for v in values:
        out = out * v
    return out


def known_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when ``a == b`` is provable (sizes are positive integers)."""
    return sympy.expand(a - b) == 0


def known_nonneg(e: sympy.Expr) -> bool:
    e = sympy.expand(e)
    if e.is_Number:
        return bool(e >= 0)
    return bool(e.is_nonnegative)


def _divides(term: sympy.Expr, d: sympy.Expr) -> sympy.Expr | None:
    """term / d when that is a polynomial with integer coefficients, else None."""
    q = sympy.cancel(term / d)
    num, den = sympy.fraction(q)
    if den != 1:
        return None
    coeff, _ = q.as_coeff_Mul()
    if not coeff.is_Integer:
        return None
    return q


class Simplifier:
    """Range-aware rewriting of FDiv/IMod; ``ranges`` maps each variable to (lo, hi)."""

    def __init__(self, ranges: Mapping[sympy.Symbol, Range]):
        self.ranges = dict(ranges)
        # a variable of one value is that value: a size-1 dim's loop variable is 0 (a
        # contiguous size-1 dim shares the next dim's stride, so an index read back from
        # an offset may carry it elsewhere: i1 + i2 where i2 only takes 0 is i1)
        self.fixed = {v: lo for v, (lo, hi) in self.ranges.items()
                      if lo == hi and getattr(lo, "is_Integer", False)}

    def bounds(self, e: sympy.Expr) -> Range | None:
        """Inclusive (lo, hi) of ``e`` or None when unknown (e.g. negative coefficients)."""
        e = sympy.expand(e)
        if e.is_Number:
            return e, e
        if isinstance(e, sympy.Symbol):
            if e in self.ranges:
                return self.ranges[e]
            return sympy.Integer(1), sympy.oo  # a positive size symbol
        if isinstance(e, FDiv):
            b = self.bounds(e.args[0])
            d = e.args[1]
            if b is None:
                return None
            lo, hi = b
            return (FDiv(lo, d) if lo != 0 else sympy.Integer(0)), _floor_div_bound(hi, d)
        if isinstance(e, IMod):
            return sympy.Integer(0), e.args[1] - 1
        if e.is_Add:
            lo, hi = sympy.Integer(0), sympy.Integer(0)
            for t in e.args:
                b = self.bounds(t)
                if b is None:
                    return None
                lo, hi = lo + b[0], hi + b[1]
            return lo, hi
        if e.is_Mul:
            lo, hi = sympy.Integer(1), sympy.Integer(1)
            for f in e.args:
                b = self.bounds(f)
                if b is None or not known_nonneg(b[0]):
                    return None
                lo, hi = lo * b[0], hi * b[1]
            return lo, hi
        if e.is_Pow and e.exp.is_Integer and e.exp > 0:
            b = self.bounds(e.base)
            if b is None or not known_nonneg(b[0]):
                return None
            return b[0] ** e.exp, b[1] ** e.exp
        return None

    def _below(self, e: sympy.Expr, d: sympy.Expr) -> bool:
        """0 <= e < d provably."""
        b = self.bounds(e)
        if b is None or not known_nonneg(b[0]):
            return False
        if b[1] is sympy.oo:
            return False
        return known_nonneg(d - 1 - b[1])

    def simplify(self, e: sympy.Expr) -> sympy.Expr:
        e = sympy.expand(e)
        if self.fixed:
            e = sympy.expand(e.xreplace(self.fixed))
        return self._simp(e)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one Simplifier per kernel
    def _simp(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom:
            return e
        if isinstance(e, FDiv):
            return self._fdiv(self._simp(sympy.expand(e.args[0])), e.args[1])
        if isinstance(e, IMod):
            return self._imod(self._simp(sympy.expand(e.args[0])), e.args[1])
        args = [self._simp(a) for a in e.args]
        out = sympy.expand(e.func(*args))
        if out.is_Add:
            out = self._merge_div_mod(out)
        return out

    def _split(self, a: sympy.Expr, d: sympy.Expr):
        q, r = sympy.Integer(0), sympy.Integer(0)
        for t in sympy.Add.make_args(a):
            t_div = _divides(t, d)
            if t_div is not None:
                q += t_div
            else:
                r += t
        return sympy.expand(q), sympy.expand(r)

    def _fdiv(self, a: sympy.Expr, d: sympy.Expr) -> sympy.Expr:
        if d == 1:
            return a
        q, r = self._split(a, d)
        if r == 0:
            return q
        if self._below(r, d):
            return q
        # Nested floor division: (x // a) // b == x // (a*b).
        if isinstance(r, FDiv) and q == 0:
            return self._fdiv(r.args[0], r.args[1] * d)
        common = self._common_factor(r, d)
        if common is not None:   # (g*y + s) // (g*k) == y // k where 0 <= s < g
            g, y, _ = common
            return q + self._fdiv(y, _divides(d, g))
        return q + FDiv(r, d)

    def _common_factor(self, a: sympy.Expr, d: sympy.Expr):
        """(g, y, s) with a == g*y + s, g > 1 an integer dividing ``d``, 0 <= s < g
        provably (the largest such g among a's terms' coefficients), or None: the
        digits of a row-major position that a division by a whole stride ignores
        (``(36*i1 + 6*i2 + i3) // 288`` is ``i1 // 8`` for i2, i3 < 6)."""
        coeffs = {abs(int(t.as_coeff_Mul()[0])) for t in sympy.Add.make_args(a)
                  if t.as_coeff_Mul()[0].is_Integer}
        for g in sorted((c for c in coeffs if c > 1), reverse=True):
            if _divides(d, sympy.Integer(g)) is None:
                continue
            y, s = self._split(a, sympy.Integer(g))
            if y != 0 and (s == 0 or self._below(s, sympy.Integer(g))):
                return g, y, s
        return None

    def _imod(self, a: sympy.Expr, d: sympy.Expr) -> sympy.Expr:
        if d == 1:
            return sympy.Integer(0)
        _, r = self._split(a, d)
        if r == 0:
            return sympy.Integer(0)
        if self._below(r, d):
            return r
        # (x % (a*b)) // a style patterns are left alone; x % a where x = y % (a*k) -> y % a.
        if isinstance(r, IMod) and _divides(r.args[1], d) is not None:
            return self._imod(r.args[0], d)
        common = self._common_factor(r, d)
        if common is not None:   # (g*y + s) % (g*k) == g*(y % k) + s where 0 <= s < g
            g, y, s = common
            return sympy.expand(g * self._imod(y, _divides(d, sympy.Integer(g))) + s)
        return IMod(r, d)

    def _merge_div_mod(self, e: sympy.Expr) -> sympy.Expr:
        """c*d*FDiv(x, d) + c*IMod(x, d) -> c*x, with FDiv(x, d) as ``_fdiv`` writes it:
        the digits of a flattened (13, 29, 29) view, 841*(i // 841) + 29*((i // 29) % 29)
        + i % 29, are i (the first pair's FDiv(FDiv(i, 29), 29) is FDiv(i, 841))."""
        terms = list(sympy.Add.make_args(e))
        changed = True
        while changed:
            changed = False
            for i, t in enumerate(terms):
                c, m = t.as_coeff_Mul()
                mods = [f for f in sympy.Mul.make_args(m) if isinstance(f, IMod)]
                if len(mods) != 1:
                    continue
                mod = mods[0]
                rest = c * sympy.Mul(*[f for f in sympy.Mul.make_args(m) if f is not mod])
                x, d = mod.args
                want = sympy.expand(rest * d * self._fdiv(x, d))
                for j, u in enumerate(terms):
                    if j != i and sympy.expand(u - want) == 0:
                        new = sympy.expand(rest * x)
                        terms = [v for k, v in enumerate(terms) if k not in (i, j)]
                        terms.extend(sympy.Add.make_args(new))
                        changed = True
                        break
                if changed:
                    break
        return sympy.expand(sympy.Add(*terms))


def _floor_div_bound(hi: sympy.Expr, d: sympy.Expr) -> sympy.Expr:
    if hi is sympy.oo:
        return sympy.oo
    if hi.is_Integer and d.is_Integer:
        return sympy.Integer(int(hi) // int(d))
    q = sympy.cancel(hi / d)
    num, den = sympy.fraction(q)
    if den == 1:
        return q
    # hi = d*k - 1 is the common case: floor((d*k - 1)/d) = k - 1.
    q1 = sympy.cancel((hi + 1) / d)
    if sympy.fraction(q1)[1] == 1:
        return sympy.expand(q1 - 1)
    return FDiv(hi, d)


def delinearize(linear: sympy.Expr, sizes: list[sympy.Expr]) -> list[sympy.Expr]:
    """Row-major digits of ``linear`` over ``sizes`` (outermost first)."""
    out: list[sympy.Expr] = []
    stride = sympy.Integer(1)
    for size in reversed(sizes):
        if size == 1:
            out.append(sympy.Integer(0))
            continue
        digit = FDiv(linear, stride) if stride != 1 else linear
        out.append(IMod(digit, size) if not known_equal(stride * size, prod(sizes)) else digit)
        stride = stride * size
    return list(reversed(out))


def linearize(index: list[sympy.Expr], sizes: list[sympy.Expr]) -> sympy.Expr:
    """Row-major linear position of ``index`` in ``sizes``."""
    out = sympy.Integer(0)
    for i, s in zip(index, sizes):
        out = out * s + i
    return sympy.expand(out)


def contiguous_strides(sizes: list[sympy.Expr]) -> list[sympy.Expr]:
    out = []
    acc = sympy.Integer(1)
    for s in reversed(sizes):
        out.append(acc)
        acc = acc * s
    return list(reversed(out))


def unclamped(offset: sympy.Expr, keep=frozenset()) -> sympy.Expr:
    """``offset`` with each clamp of one index expression into constant bounds
    (``Min(31, Max(0, c - 32))``: a concatenation's input read at its own position)
    replaced by that expression: where the input is read, its stride is the
    expression's. Clamps of an expression that mixes a variable of ``keep`` with others
    stay (a pooling window's position, output index times stride plus the window's
    reduced index: its clamps are its real access pattern)."""
    keep = set(keep)
    while True:
        clamps = {}
        for m in offset.atoms(sympy.Min, sympy.Max):
            free = [x for x in m.args if x.free_symbols]
            syms = free[0].free_symbols if len(free) == 1 else set()
            if len(free) == 1 and not (syms & keep and syms - keep):
                clamps[m] = free[0]
        if not clamps:
            return offset
        offset = offset.xreplace(clamps)
