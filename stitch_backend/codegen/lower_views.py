"""Lowering rules for views and gathers: they only rewrite the index of their input.

reshape/view split and merge dims (one linearise/delinearise per group of dims whose
sizes match), permute/transpose reorder, expand/unsqueeze/squeeze insert or drop
constant-0 indices, slice/select/narrow/split offset them, unfold (sliding windows, a
ViT's patches) reads window position times step plus offset; cat picks the input its
index falls in, constant_pad_nd reads its input inside and the value outside, flip
reads from the other end;
gather/index_select/embedding index with a loaded value (a data-dependent index symbol).
"""

from __future__ import annotations

import sympy
import torch

from . import indexing as ix
from .kernel_ir import Const, IndexVal, Unsupported
from .lower import LT, bcast_index, cast
from .lower_ops import _dt, _inside, _maybe, _op, _shape, _val, rule

aten = torch.ops.aten


# ----------------------------------------------------------------------------- views


def _norm_dim(d, nd):
    return d % nd if nd else 0


def _reshape_index(o, out_shape, in_shape):
    """Index into ``in_shape`` for index ``o`` of its row-major reshape ``out_shape``."""
    ins = [(j, s) for j, s in enumerate(in_shape) if s != 1]
    outs = [(j, s) for j, s in enumerate(out_shape) if s != 1]
    idx = [sympy.Integer(0)] * len(in_shape)
    groups = []
    a = b = 0
    while a < len(ins) or b < len(outs):
        ga, gb = [ins[a]] if a < len(ins) else [], [outs[b]] if b < len(outs) else []
        a += bool(ga)
        b += bool(gb)
        pa, pb = ix.prod(s for _, s in ga), ix.prod(s for _, s in gb)
        while not ix.known_equal(pa, pb):
            if pa.is_Integer and pb.is_Integer:
                if pa < pb and a < len(ins):
                    ga.append(ins[a]); a += 1; pa = pa * ins[a - 1][1]
                elif pb < pa and b < len(outs):
                    gb.append(outs[b]); b += 1; pb = pb * outs[b - 1][1]
                else:
                    break
            else:
                break
        if not ix.known_equal(pa, pb):
            groups = None
            break
        groups.append((ga, gb))
    if groups is None:  # one big group: linearize everything
        groups = [(ins, outs)]
    for ga, gb in groups:
        lin = ix.linearize([o[j] for j, _ in gb], [s for _, s in gb])
        digits = ix.delinearize(lin, [s for _, s in ga])
        for (j, _), d in zip(ga, digits):
            idx[j] = d
    return tuple(idx)


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
      _maybe("view_copy", "default"))
def _view(ctx, node, x, shape):
    out_shape = _shape(node)
    return LT(out_shape, x.dtype, lambda o: x.at(_reshape_index(o, out_shape, x.shape)))


@rule(aten.permute.default)
def _permute(ctx, node, x, dims):
    nd = x.ndim
    dims = [_norm_dim(d, nd) for d in dims]

    def fn(o):
        idx = [None] * nd
        for j, d in enumerate(dims):
            idx[d] = o[j]
        return x.at(tuple(idx))
    return LT(_shape(node), x.dtype, fn)


@rule(aten.t.default)
def _t(ctx, node, x):
    if x.ndim < 2:
        return x
    return LT(_shape(node), x.dtype, lambda o: x.at((o[1], o[0])))


@rule(aten.transpose.int)
def _transpose(ctx, node, x, a, b):
    nd = x.ndim
    a, b = _norm_dim(a, nd), _norm_dim(b, nd)

    def fn(o):
        idx = list(o)
        idx[a], idx[b] = o[b], o[a]
        return x.at(tuple(idx))
    return LT(_shape(node), x.dtype, fn)


@rule(aten.expand.default, _maybe("expand_copy", "default"))
def _expand(ctx, node, x, sizes, implicit=False):
    shape = _shape(node)
    return LT(shape, x.dtype, lambda o: x.at(bcast_index(x.shape, shape, o)))


@rule(aten.unsqueeze.default)
def _unsqueeze(ctx, node, x, dim):
    d = dim % (x.ndim + 1)
    return LT(_shape(node), x.dtype, lambda o: x.at(o[:d] + o[d + 1:]))


@rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(ctx, node, x, dims=None):
    nd = x.ndim
    if dims is None:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    drop = {_norm_dim(d, nd) for d in dims if x.shape[_norm_dim(d, nd)] == 1} if nd else set()

    def fn(o):
        it = iter(o)
        return x.at(tuple(sympy.Integer(0) if j in drop else next(it) for j in range(nd)))
    return LT(_shape(node), x.dtype, fn)


def _slice_lt(x, dim, start, length_shape, step=1):
    def fn(o):
        idx = list(o)
        idx[dim] = start + o[dim] * step
        return x.at(tuple(idx))
    return LT(length_shape, x.dtype, fn)


def _norm_start(start, size):
    if start is None:
        return sympy.Integer(0)
    start = ix.sympify_size(start) if not isinstance(start, int) else sympy.Integer(start)
    if start.is_Integer and start < 0:
        start = start + size
        if start.is_Integer and start < 0:
            start = sympy.Integer(0)
    return start


@rule(aten.slice.Tensor)
def _slice(ctx, node, x, dim=0, start=None, end=None, step=1):
    dim = _norm_dim(dim, x.ndim)
    return _slice_lt(x, dim, _norm_start(start, x.shape[dim]), _shape(node), step)


@rule(aten.narrow.default)
def _narrow(ctx, node, x, dim, start, length):
    dim = _norm_dim(dim, x.ndim)
    return _slice_lt(x, dim, _norm_start(start, x.shape[dim]), _shape(node))


@rule(aten.select.int)
def _select(ctx, node, x, dim, index):
    dim = _norm_dim(dim, x.ndim)
    index = _norm_start(index, x.shape[dim])
    return LT(_shape(node), x.dtype, lambda o: x.at(o[:dim] + (index,) + o[dim:]))


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(ctx, node, x, arg=None, dim=0):
    name = node.target.overloadpacket.__name__
    if name == "unbind":
        dim = _norm_dim(arg if arg is not None else 0, x.ndim)
        return tuple(LT(tuple(v.shape), x.dtype, (lambda k: lambda o: x.at(o[:dim] + (sympy.Integer(k),) + o[dim:]))(k))
                     for k, v in enumerate(_val(node)))
    dim = _norm_dim(dim, x.ndim)
    outs, start = [], sympy.Integer(0)
    for v in _val(node):
        shape = tuple(v.shape)
        outs.append(_slice_lt(x, dim, start, shape))
        start = start + ix.sympify_size(shape[dim])
    return tuple(outs)


@rule(aten.unfold.default)
def _unfold(ctx, node, x, dim, size, step):
    """Windows of ``size`` every ``step`` along ``dim``, as a last dim: window ``w``'s
    element ``k`` is ``x[..., w * step + k, ...]``."""
    if x.ndim == 0:
        raise Unsupported("unfold of a 0-dim tensor")
    dim = _norm_dim(dim, x.ndim)

    def fn(o):
        return x.at(o[:dim] + (o[dim] * step + o[-1],) + o[dim + 1:-1])
    return LT(_shape(node), x.dtype, fn)


@rule(aten.flip.default)
def _flip(ctx, node, x, dims):
    """Reversed along ``dims``: element ``i`` of a flipped dim reads ``size - 1 - i``."""
    flipped = {_norm_dim(d, x.ndim) for d in dims}

    def fn(o):
        return x.at(tuple(x.shape[j] - 1 - i if j in flipped else i for j, i in enumerate(o)))
    return LT(_shape(node), x.dtype, fn)


# ----------------------------------------------------------------------------- concatenation


@rule(aten.cat.default)
def _cat(ctx, node, tensors, dim=0):
    """Each element read from the input its index along ``dim`` falls in: every input
    is loaded at a position clamped into its own bounds (never outside its memory) and a
    ``where`` per boundary picks the one that holds it; inputs promote to the result's
    dtype. Legacy 1-D empty inputs and inputs empty along ``dim`` contribute nothing."""
    out, shape = _dt(node), _shape(node)
    d = _norm_dim(dim, len(shape))
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0) and t.shape[d] != 0]
    if not parts:
        raise Unsupported("cat of empty tensors")
    sizes = [t.shape[d] for t in parts]
    if not all(sympy.sympify(n).is_Integer for n in sizes):
        raise Unsupported("cat along a symbolic size")
    starts = [sum(int(n) for n in sizes[:i]) for i in range(len(parts))]
    index_type = torch.int32 if sum(int(n) for n in sizes) < 2 ** 31 else torch.int64

    def fn(o):
        j = o[d]

        def read(i):
            local = j - starts[i]
            if i > 0:
                local = sympy.Max(0, local)
            if i < len(parts) - 1:
                local = sympy.Min(local, int(sizes[i]) - 1)
            return cast(parts[i].at(o[:d] + (local,) + o[d + 1:]), out)

        value = read(len(parts) - 1)
        for i in range(len(parts) - 2, -1, -1):
            before = _op("lt", torch.bool, IndexVal(index_type, j),
                         Const(index_type, starts[i + 1]))
            value = _op("where", out, before, read(i), value)
        return value
    return LT(shape, out, fn)


@rule(aten.constant_pad_nd.default)
def _constant_pad(ctx, node, x, pad, value=0):
    """``pad`` = (before, after) pairs from the last dim backwards, negative ones
    cropping: inside, the input at the index less its ``before`` (read at a clamped
    position, never outside its memory); outside, ``value``."""
    out, shape = _dt(node), _shape(node)
    pairs = [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    if not all(isinstance(v, int) for pair in pairs for v in pair) or not all(
            sympy.sympify(n).is_Integer for n in x.shape):
        raise Unsupported("constant_pad_nd with symbolic sizes or pads")
    sizes = [int(n) for n in x.shape]
    index_type = torch.int32 if max(sizes + [1]) < 2 ** 31 else torch.int64
    nd = len(sizes)

    def fn(o):
        at, bounds = list(o), []
        for i, (before, _) in enumerate(pairs):
            d = nd - 1 - i
            pos = o[d] - before
            at[d] = sympy.Max(0, sympy.Min(pos, sizes[d] - 1))
            if before > 0 or int(shape[d]) - before > sizes[d]:
                bounds.append((pos, sizes[d]))
        inside = _inside(bounds, index_type)
        read = cast(x.at(tuple(at)), out)
        return read if inside is None else _op("where", out, inside, read, Const(out, value))
    return LT(shape, out, fn)


# ----------------------------------------------------------------------------- gathers


@rule(aten.gather.default)
def _gather(ctx, node, x, dim, index, sparse_grad=False):
    dim = _norm_dim(dim, x.ndim)

    def fn(o):
        g = ctx.data_index(index.at(o), x.shape[dim])
        return x.at(o[:dim] + (g,) + o[dim + 1:])
    return LT(_shape(node), x.dtype, fn)


@rule(aten.index_select.default)
def _index_select(ctx, node, x, dim, index):
    dim = _norm_dim(dim, x.ndim)

    def fn(o):
        g = ctx.data_index(index.at((o[dim],) if index.ndim else ()), x.shape[dim])
        return x.at(o[:dim] + (g,) + o[dim + 1:])
    return LT(_shape(node), x.dtype, fn)


@rule(aten.index.Tensor)
def _index(ctx, node, x, indices):
    """``x[..., idx, ...]`` with one integer index tensor (``opclass`` leaves every other
    form to ATen): its dims replace the indexed dim; negative indices count from the
    end, as in Python."""
    where = [k for k, i in enumerate(indices) if i is not None]
    if len(where) != 1:
        raise Unsupported("indexing with more than one index tensor")
    k, idx = where[0], indices[where[0]]
    size = x.shape[k]
    if not sympy.sympify(size).is_Integer:
        raise Unsupported("indexing along a symbolic size")

    def fn(o):
        v = cast(idx.at(o[k:k + idx.ndim]), torch.int64)
        wrapped = _op("where", torch.int64, _op("lt", torch.bool, v, Const(torch.int64, 0)),
                      _op("add", torch.int64, v, Const(torch.int64, int(size))), v)
        g = ctx.data_index(wrapped, size)
        return x.at(o[:k] + (g,) + o[k + idx.ndim:])
    return LT(_shape(node), x.dtype, fn)


@rule(aten.embedding.default)
def _embedding(ctx, node, weight, indices, *rest):
    def fn(o):
        g = ctx.data_index(indices.at(o[:-1]), weight.shape[0])
        return weight.at((g, o[-1]))
    return LT(_shape(node), weight.dtype, fn)
