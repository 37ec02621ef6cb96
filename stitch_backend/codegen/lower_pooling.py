"""Lowering rules for max and average pooling over any windows (2-D and 3-D; 1-D pooling
reaches ATen as 2-D): a reduction over a lazy tensor of the windows.

``windows[..., o1, o2, k1, k2] = x[..., o1 * s1 + k1 * d1 - p1, o2 * s2 + k2 * d2 - p2]``,
read at a clamped position and replaced by the pooling's padding value (-inf for max,
0 for average) where the position falls in the padding; the pooled value is the max
(NaN propagating, as ATen's pooling kernels) or the sum over the window dims divided as
ATen divides. In ceil mode the last window of a dim may reach past the input (and its
padding): those positions read the fill too, and an average divides by the window's
part within the padded input (``count_include_pad``) or within the input, as ATen's
kernels do; ATen's output size rule drops a last window that would start past it. Max
pooling's indices are not computed: a graph that reads them keeps ATen's op (the
Planner does not fuse it: ``opclass.classify``). Windows that tile their input exactly
are rewritten earlier into a view and an ``amax``/``mean`` (``stitch_backend.pooling``).
"""

from __future__ import annotations

import math

import sympy
import torch

from .kernel_ir import Const, IndexVal, Unsupported, opmath
from .lower import LT, cast, pointwise
from .lower_ops import _dt, _inside, _op, rule
from ..opclass import pool_unsupported

aten = torch.ops.aten


def _check(node) -> None:
    """Unsupported where the Planner would not fuse this pooling either (the same
    reasons: ``opclass.pool_unsupported``)."""
    why = pool_unsupported(node)
    if why:
        raise Unsupported(why)


def _per_dim(v, n: int, what: str) -> list[int]:
    """A pooling argument (an int or a list of 1 or n) as n ints."""
    v = [v] if isinstance(v, int) else list(v)
    if len(v) == 1:
        v = v * n
    if len(v) != n or not all(isinstance(i, int) for i in v):
        raise Unsupported(f"pooling {what} {v}: not {n} static sizes")
    return v


class _Window:
    """One pooling's geometry over the last ``n`` dims of ``x``."""

    def __init__(self, x: LT, n: int, kernel, stride, padding, dilation, ceil: bool = False):
        if x.ndim < n + 1:
            raise Unsupported(f"pooling over {n} dims of a {x.ndim}-D input")
        sizes = x.shape[-n:]
        if not all(s.is_Integer for s in sizes):
            raise Unsupported("pooling over symbolic sizes")
        self.n = n
        self.sizes = [int(s) for s in sizes]
        self.kernel = _per_dim(kernel, n, "kernel_size")
        self.stride = _per_dim(stride or self.kernel, n, "stride")
        self.padding = _per_dim(padding, n, "padding")
        self.dilation = _per_dim(dilation, n, "dilation")
        self.out = [_out_size(s, k, st, p, d, ceil) for s, k, st, p, d in zip(
            self.sizes, self.kernel, self.stride, self.padding, self.dilation)]
        if min(self.out) < 1:
            raise Unsupported("pooling with an empty output")
        # dims whose windows may read outside the input: padding, or a ceil-mode window
        # reaching past the end
        self.guarded = [i for i in range(n) if self.padding[i] or (
            (self.out[i] - 1) * self.stride[i] - self.padding[i]
            + self.dilation[i] * (self.kernel[i] - 1) > self.sizes[i] - 1)]
        self.overhang = any((o - 1) * st - p + k > size + p for o, st, p, k, size in zip(
            self.out, self.stride, self.padding, self.kernel, self.sizes))

    def starts(self, outs) -> list[sympy.Expr]:
        """Each dim's window start (in the unpadded input, may be negative)."""
        return [o * s - p for o, s, p in zip(outs, self.stride, self.padding)]

    def windows(self, x: LT, fill: float) -> LT:
        """``x``'s windows: shape ``lead + out + kernel``; ``fill`` in the padding."""
        n, lead = self.n, x.shape[:-self.n]
        c = x.dtype

        def fn(o):
            head, outs, ks = o[:len(lead)], o[len(lead):len(lead) + n], o[len(lead) + n:]
            pos = [st + k * d for st, k, d in zip(self.starts(outs), ks, self.dilation)]
            padded = self.guarded
            at = [sympy.Max(0, sympy.Min(pos[i], self.sizes[i] - 1)) if i in padded else pos[i]
                  for i in range(n)]
            value = x.at(tuple(head) + tuple(at))
            if not padded:
                return value
            # a position within a dim's size, padding either side: 32 bits
            inside = _inside([(pos[i], self.sizes[i]) for i in padded], torch.int32)
            return _op("where", c, inside, value, Const(c, fill))

        return LT(tuple(lead) + tuple(self.out) + tuple(self.kernel), c, fn)

    def dims(self, x: LT) -> tuple[int, ...]:
        """The window dims of ``windows(x)``: its last n."""
        nd = x.ndim + self.n
        return tuple(range(nd - self.n, nd))


def _out_size(size: int, k: int, stride: int, pad: int, dilation: int, ceil: bool) -> int:
    """ATen's pooling output size (``pooling_output_shape``): in ceil mode one more
    window where the division leaves a remainder, unless it would start past the input
    and its left padding."""
    out = (size + 2 * pad - dilation * (k - 1) - 1 + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _max_pool(n: int):
    def fn(ctx, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        _check(node)
        out = _dt(node, 0)
        w = _Window(x, n, kernel_size, stride, padding, dilation, bool(ceil_mode))
        c = opmath(out)
        xa = pointwise([x], lambda e: cast(e, c), c)
        m = ctx.reduce("max", w.windows(xa, float("-inf")), w.dims(x), False, c,
                       what=str(node.target))
        values = pointwise([m], lambda e: cast(e, out), out)

        def unread(o):
            raise Unsupported("max pooling's indices are read")
        # a traced graph may keep a view of the indices that nothing reads
        return values, LT(m.shape, torch.int64, unread)
    return fn


def _avg_pool(n: int):
    def fn(ctx, node, x, kernel_size, stride=(), padding=0, ceil_mode=False,
           count_include_pad=True, divisor_override=None):
        _check(node)
        out = _dt(node)
        w = _Window(x, n, kernel_size, stride, padding, 1, bool(ceil_mode))
        c = opmath(out)
        xa = pointwise([x], lambda e: cast(e, c), c)
        s = ctx.reduce("sum", w.windows(xa, 0.0), w.dims(x), False, c, what=str(node.target))
        lead = x.ndim - n

        def divisor(o):
            if divisor_override:
                return Const(c, float(divisor_override))
            if (count_include_pad or not any(w.padding)) and not w.overhang:
                # every window lies inside the padded input
                return Const(c, float(math.prod(w.kernel)))
            if count_include_pad:
                # ceil mode: the window's part within the padded input
                count = sympy.Integer(1)
                for st, k, size, p in zip(w.starts(o[lead:]), w.kernel, w.sizes, w.padding):
                    count *= sympy.Min(st + k, size + p) - st
                return cast(IndexVal(torch.int32, count), c)
            # the window's positions inside the unpadded input
            count = sympy.Integer(1)
            for st, k, size in zip(w.starts(o[lead:]), w.kernel, w.sizes):
                count *= sympy.Min(st + k, size) - sympy.Max(st, 0)
            return cast(IndexVal(torch.int32, count), c)

        return LT(s.shape, out, lambda o: cast(_op("div", c, s.at(o), divisor(o)), out))
    return fn


rule(aten.max_pool2d_with_indices.default)(_max_pool(2))
rule(aten.max_pool3d_with_indices.default)(_max_pool(3))
rule(aten.avg_pool2d.default)(_avg_pool(2))
rule(aten.avg_pool3d.default)(_avg_pool(3))
