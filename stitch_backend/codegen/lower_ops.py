"""Per-op lowering rules: ATen op -> lazy tensor(s). Registered in ``RULES``.

Pointwise ops follow PyTorch's type promotion (the node's ``meta['val']`` dtype is the
result type) and compute in the op-math type (fp32 for fp16/bf16), rounding each result
to its eager dtype. Normalisations are written here as their textbook formulas in fp32,
the way ATen's CUDA kernels compute them; reductions accumulate in fp32 (fp64 for
double, int64 for integers and bools).
"""

from __future__ import annotations

import math

import sympy
import torch

from .kernel_ir import Const, Expr, IndexVal, Op, SizeVal, Unsupported, opmath
from .lower import LT, cast, const_lt, pointwise

aten = torch.ops.aten
prims = torch.ops.prims
RULES: dict = {}


def rule(*targets):
    def deco(fn):
        for t in targets:
            if t is not None:
                RULES[t] = fn
        return fn
    return deco


def _maybe(packet: str, overload: str | None = None):
    p = getattr(aten, packet, None)
    if p is None or overload is None:
        return p
    return getattr(p, overload, None)


def _val(node):
    return node.meta["val"]


def _dt(node, i: int | None = None) -> torch.dtype:
    v = _val(node)
    return (v[i] if i is not None else v).dtype


def _shape(node, i: int | None = None):
    v = _val(node)
    return tuple((v[i] if i is not None else v).shape)


# ----------------------------------------------------------------------------- scalars


def _scalar_lt(x, dtype: torch.dtype) -> LT:
    """A Python number or size expression as a 0-d LT of ``dtype``."""
    if isinstance(x, LT):
        return x
    if isinstance(x, sympy.Basic) and not x.is_Number:
        e = cast(SizeVal(torch.int64, x), dtype)
        return LT((), dtype, lambda o: e)
    if isinstance(x, sympy.Basic):
        x = int(x) if x.is_Integer else float(x)
    return const_lt(x, dtype)


def _meta_like(x) -> object:
    if isinstance(x, LT):
        return torch.empty((1,) * x.ndim, dtype=x.dtype, device="meta")
    if isinstance(x, sympy.Basic):
        return int(x) if x.is_Integer or not x.is_Number else float(x)
    return x


def _promote(*xs) -> torch.dtype:
    metas = [_meta_like(x) for x in xs]
    dt = torch.result_type(metas[0], metas[1]) if len(metas) > 1 else metas[0].dtype
    for m in metas[2:]:
        dt = torch.result_type(torch.empty((1,), dtype=dt, device="meta"), m)
    return dt


def _ew(args, out_dtype, compute, fn, shape=None) -> LT:
    """Elementwise: args cast to ``compute``; fn(*exprs) -> Expr in ``compute``; result
    rounded to ``out_dtype``."""
    lts = [_scalar_lt(a, compute) for a in args]
    return pointwise(lts, lambda *es: cast(fn(*(cast(e, compute) for e in es)), out_dtype),
                     out_dtype, shape)


def _op(name, dtype, *args, params=()) -> Expr:
    return Op(dtype, name, tuple(args), tuple(params))


def _inside(bounds, index_type: torch.dtype) -> Expr | None:
    """Whether every position lies in its dim: ``bounds`` is (position, size) pairs; the
    bool expression ``0 <= position < size`` for all (None for no pairs). A pooling's
    windows and a pad read a clamped position and keep the value only where this holds."""
    inside = None
    for pos, size in bounds:
        p = IndexVal(index_type, pos)
        ok = _op("logical_and", torch.bool, _op("ge", torch.bool, p, Const(index_type, 0)),
                 _op("lt", torch.bool, p, Const(index_type, size)))
        inside = ok if inside is None else _op("logical_and", torch.bool, inside, ok)
    return inside


# ----------------------------------------------------------------------------- pointwise

_UNARY_FLOAT = {
    "sqrt": "sqrt", "rsqrt": "rsqrt", "exp": "exp", "exp2": "exp2", "expm1": "expm1",
    "log": "log", "log1p": "log1p", "log2": "log2", "log10": "log10", "sin": "sin", "cos": "cos",
    "tan": "tan", "tanh": "tanh", "sigmoid": "sigmoid", "erf": "erf", "erfc": "erfc",
    "erfinv": "erfinv", "asin": "asin", "acos": "acos", "atan": "atan", "sinh": "sinh",
    "cosh": "cosh", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "reciprocal": "reciprocal",
}
_UNARY_SAME = {"neg": "neg", "abs": "abs", "sign": "sign", "sgn": "sign", "relu": "relu",
               "frac": "frac", "floor": "floor", "ceil": "ceil", "trunc": "trunc", "fix": "trunc"}


def _unary_rule(irname: str, float_only: bool):
    def fn(ctx, node, x, *rest, **kw):
        out = _dt(node)
        if irname in ("floor", "ceil", "trunc", "round") and not out.is_floating_point:
            return pointwise([x], lambda e: cast(e, out), out, _shape(node))
        compute = opmath(out)
        return _ew([x], out, compute, lambda e: _op(irname, compute, e), _shape(node))
    return fn


for _name, _ir in {**_UNARY_FLOAT, **_UNARY_SAME}.items():
    _p = getattr(aten, _name, None)
    if _p is not None:
        RULES[_p.default] = _unary_rule(_ir, _name in _UNARY_FLOAT)


@rule(aten.round.default)
def _round(ctx, node, x):
    return _unary_rule("round", False)(ctx, node, x)


@rule(aten.round.decimals)
def _round_dec(ctx, node, x, decimals=0):
    if decimals != 0:
        raise Unsupported("aten.round.decimals with decimals != 0")
    return _round(ctx, node, x)


def _bool_rule(irname):
    def fn(ctx, node, x):
        compute = opmath(x.dtype)
        return _ew([x], torch.bool, compute, lambda e: _op(irname, torch.bool, e), _shape(node))
    return fn


for _name in ("isnan", "isinf", "isfinite", "signbit"):
    RULES[getattr(aten, _name).default] = _bool_rule(_name)


@rule(aten.logical_not.default)
def _lnot(ctx, node, x):
    return pointwise([x], lambda e: _op("logical_not", torch.bool, e), torch.bool, _shape(node))


@rule(aten.bitwise_not.default)
def _bnot(ctx, node, x):
    out = _dt(node)
    return pointwise([x], lambda e: _op("bitwise_not", out, cast(e, out)), out, _shape(node))


def _arith(irname):
    def fn(ctx, node, a, b, alpha=1, **kw):
        out = _dt(node)
        compute = opmath(out)
        if irname in ("div",) and not compute.is_floating_point:
            compute = torch.float32
        if alpha != 1 and irname in ("add", "sub"):
            al = _scalar_lt(alpha, compute)
            return _ew([a, b, al], out, compute,
                       lambda x, y, s: _op(irname, compute, x, _op("mul", compute, y, s)),
                       _shape(node))
        return _ew([a, b], out, compute, lambda x, y: _op(irname, compute, x, y), _shape(node))
    return fn


for _name, _ir in {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "fmod": "fmod",
                   "remainder": "remainder", "maximum": "maximum", "minimum": "minimum",
                   "fmax": "fmax", "fmin": "fmin", "atan2": "atan2", "copysign": "copysign",
                   "hypot": "hypot", "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or",
                   "bitwise_xor": "bitwise_xor", "floor_divide": "div_floor"}.items():
    _p = getattr(aten, _name, None)
    if _p is None:
        continue
    for _ov in ("Tensor", "Scalar", "default"):
        if hasattr(_p, _ov):
            RULES[getattr(_p, _ov)] = _arith(_ir)


@rule(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx, node, a, b, alpha=1):
    return _arith("sub")(ctx, node, b, a, alpha)


@rule(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(ctx, node, a, b, rounding_mode=None):
    if rounding_mode is None:
        return _arith("div")(ctx, node, a, b)
    name = {"trunc": "div_trunc", "floor": "div_floor"}[rounding_mode]
    return _arith(name)(ctx, node, a, b)


def _cmp(irname):
    def fn(ctx, node, a, b):
        compute = opmath(_promote(a, b))
        return _ew([a, b], torch.bool, compute, lambda x, y: _op(irname, torch.bool, x, y),
                   _shape(node))
    return fn


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    for _ov in ("Tensor", "Scalar"):
        RULES[getattr(getattr(aten, _name), _ov)] = _cmp(_name)


def _logical(irname):
    def fn(ctx, node, a, b):
        lts = [_scalar_lt(a, torch.bool if not isinstance(a, LT) else a.dtype),
               _scalar_lt(b, torch.bool if not isinstance(b, LT) else b.dtype)]
        return pointwise(lts, lambda x, y: _op(irname, torch.bool, x, y), torch.bool, _shape(node))
    return fn


for _name in ("logical_and", "logical_or", "logical_xor"):
    RULES[getattr(aten, _name).default] = _logical(_name)


@rule(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(ctx, node, a, b):
    out = _dt(node)
    compute = opmath(out)
    if not compute.is_floating_point:
        if isinstance(b, LT) or isinstance(a, LT) and not (isinstance(b, int) and b >= 0):
            raise Unsupported("integer pow with a tensor or negative exponent")

        def ipow(x, y):
            acc = Const(compute, 1)
            for _ in range(int(b)):
                acc = _op("mul", compute, acc, x)
            return acc
        return _ew([a, b], out, compute, ipow, _shape(node))
    return _ew([a, b], out, compute, lambda x, y: _op("pow", compute, x, y), _shape(node))


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx, node, c, a, b):
    out = _dt(node)
    compute = opmath(out)
    cl = _scalar_lt(c, torch.bool)
    lts = [cl, _scalar_lt(a, compute), _scalar_lt(b, compute)]
    return pointwise(lts, lambda cc, x, y: cast(
        _op("where", compute, cast(cc, torch.bool), cast(x, compute), cast(y, compute)), out),
        out, _shape(node))


def _clamp_lt(x, lo, hi, out, shape):
    compute = opmath(out)
    args = [x]
    if lo is not None:
        args.append(lo)
    if hi is not None:
        args.append(hi)

    def fn(*es):
        v = es[0]
        k = 1
        if lo is not None:
            v = _op("maximum", compute, v, es[k])
            k += 1
        if hi is not None:
            v = _op("minimum", compute, v, es[k])
        return v
    return _ew(args, out, compute, fn, shape)


@rule(aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx, node, x, min=None, max=None):
    return _clamp_lt(x, min, max, _dt(node), _shape(node))


@rule(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(ctx, node, x, lo):
    return _clamp_lt(x, lo, None, _dt(node), _shape(node))


@rule(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(ctx, node, x, hi):
    return _clamp_lt(x, None, hi, _dt(node), _shape(node))


@rule(aten.hardtanh.default)
def _hardtanh(ctx, node, x, min_val=-1.0, max_val=1.0):
    return _clamp_lt(x, min_val, max_val, _dt(node), _shape(node))


@rule(aten.relu6.default if hasattr(aten, "relu6") else None)
def _relu6(ctx, node, x):
    return _clamp_lt(x, 0.0, 6.0, _dt(node), _shape(node))


@rule(aten.leaky_relu.default)
def _leaky(ctx, node, x, negative_slope=0.01):
    out = _dt(node)
    c = opmath(out)
    return _ew([x], out, c, lambda e: _op("leaky_relu", c, e, params=(float(negative_slope),)),
               _shape(node))


@rule(aten.elu.default)
def _elu(ctx, node, x, alpha=1.0, scale=1.0, input_scale=1.0):
    out = _dt(node)
    c = opmath(out)
    p = (float(alpha), float(scale), float(input_scale))
    return _ew([x], out, c, lambda e: _op("elu", c, e, params=p), _shape(node))


@rule(aten.gelu.default)
def _gelu(ctx, node, x, approximate="none"):
    out = _dt(node)
    c = opmath(out)
    name = "gelu_tanh" if approximate == "tanh" else "gelu_erf"
    return _ew([x], out, c, lambda e: _op(name, c, e), _shape(node))


@rule(aten.silu.default)
def _silu(ctx, node, x):
    out = _dt(node)
    c = opmath(out)
    # eager CUDA: x / (1 + exp(-x))
    return _ew([x], out, c, lambda e: _op("div", c, e, _op(
        "add", c, Const(c, 1.0), _op("exp", c, _op("neg", c, e)))), _shape(node))


@rule(aten.mish.default)
def _mish(ctx, node, x):
    out = _dt(node)
    c = opmath(out)
    return _ew([x], out, c, lambda e: _op("mul", c, e, _op(
        "tanh", c, _op("log1p", c, _op("exp", c, e)))), _shape(node))


def _hsig(c, e):
    inner = _op("minimum", c, _op("maximum", c, _op("add", c, e, Const(c, 3.0)), Const(c, 0.0)),
                Const(c, 6.0))
    return _op("mul", c, inner, Const(c, float(torch.tensor(1.0 / 6.0, dtype=c).item())))


@rule(aten.hardsigmoid.default)
def _hardsigmoid(ctx, node, x):
    out = _dt(node)
    c = opmath(out)
    return _ew([x], out, c, lambda e: _hsig(c, e), _shape(node))


@rule(aten.hardswish.default)
def _hardswish(ctx, node, x):
    out = _dt(node)
    c = opmath(out)
    return _ew([x], out, c, lambda e: _op("mul", c, e, _hsig(c, e)), _shape(node))


@rule(aten.softplus.default)
def _softplus(ctx, node, x, beta=1.0, threshold=20.0):
    out = _dt(node)
    c = opmath(out)

    def fn(e):
        xb = _op("mul", c, e, Const(c, float(beta)))
        soft = _op("div", c, _op("log1p", c, _op("exp", c, xb)), Const(c, float(beta)))
        return _op("where", c, _op("gt", torch.bool, xb, Const(c, float(threshold))), e, soft)
    return _ew([x], out, c, fn, _shape(node))


@rule(aten.nan_to_num.default)
def _nan_to_num(ctx, node, x, nan=0.0, posinf=None, neginf=None):
    out = _dt(node)
    if not out.is_floating_point:
        return pointwise([x], lambda e: e, out, _shape(node))
    c = opmath(out)
    fi = torch.finfo(out)
    pos = fi.max if posinf is None else posinf
    neg = fi.min if neginf is None else neginf

    def fn(e):
        v = _op("where", c, _op("isnan", torch.bool, e), Const(c, float(nan)), e)
        v = _op("where", c, _op("eq", torch.bool, e, Const(c, math.inf)), Const(c, float(pos)), v)
        return _op("where", c, _op("eq", torch.bool, e, Const(c, -math.inf)), Const(c, float(neg)), v)
    return _ew([x], out, c, fn, _shape(node))


# ----------------------------------------------------------------------------- copies, casts


def _identity(ctx, node, x, *args, **kwargs):
    return x


for _t in (aten.clone.default, aten.alias.default, aten.detach.default,
           aten.lift_fresh_copy.default, _maybe("contiguous", "default")):
    if _t is not None:
        RULES[_t] = _identity


@rule(aten._to_copy.default, prims.convert_element_type.default)
def _to_copy(ctx, node, x, dtype=None, **kwargs):
    out = _dt(node)
    return pointwise([x], lambda e: cast(e, out), out, _shape(node))


@rule(aten.copy.default)
def _copy(ctx, node, dst, src, non_blocking=False):
    out = _dt(node)
    return pointwise([src], lambda e: cast(e, out), out, _shape(node))


# ----------------------------------------------------------------------------- factories


@rule(aten.scalar_tensor.default, aten.full.default, aten.zeros.default, aten.ones.default,
      aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.fill.Scalar,
      aten.new_full.default if hasattr(aten, "new_full") else None,
      aten.new_zeros.default if hasattr(aten, "new_zeros") else None,
      aten.new_ones.default if hasattr(aten, "new_ones") else None)
def _factory(ctx, node, *args, **kwargs):
    name = node.target.overloadpacket.__name__
    out = _dt(node)
    if name in ("zeros", "zeros_like", "new_zeros"):
        v = 0
    elif name in ("ones", "ones_like", "new_ones"):
        v = 1
    elif name == "scalar_tensor":
        v = args[0]
    else:
        v = args[1]
    if isinstance(v, LT):
        raise Unsupported(f"{node.target} with a tensor fill value")
    lt = _scalar_lt(v, out)
    return pointwise([lt], lambda e: cast(e, out), out, _shape(node))


@rule(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(ctx, node, *args, **kwargs):
    out = _dt(node)
    name = node.target._overloadname
    if name == "default":
        start, step = 0, 1
    elif name == "start":
        start, step = args[0], 1
    else:
        start, step = args[0], (args[2] if len(args) > 2 else kwargs.get("step", 1))
    for v in (start, step):
        if not isinstance(v, int) or isinstance(v, bool):
            raise Unsupported("arange with non-integer start/step")

    def fn(o):
        return cast(IndexVal(torch.int64, sympy.Integer(start) + o[0] * step)
                    if step >= 0 and start >= 0 else
                    _op("add", torch.int64, Const(torch.int64, start),
                        _op("mul", torch.int64, IndexVal(torch.int64, o[0]), Const(torch.int64, step))),
                    out)
    return LT(_shape(node), out, fn)


@rule(_maybe("empty_permuted", "default"), _maybe("empty", "memory_format"), _maybe("empty_like", "default"),
      _maybe("empty_strided", "default"))
def _empty(ctx, node, *args, **kwargs):
    """Uninitialised memory: fine as the destination of a copy, never as a value."""
    def fn(o):
        raise Unsupported(f"{node.target} is read: its contents are undefined")
    return LT(_shape(node), _dt(node), fn)



from . import lower_pooling, lower_reductions, lower_views  # noqa: E402,F401  (they register their rules)
