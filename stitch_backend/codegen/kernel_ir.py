"""The kernel IR of a fused region: loads, pointwise expressions, reductions, stores.

A region becomes one ``KernelIR``. Its iteration space (``Domain``) is
``rows x reduce`` (row variables, then reduction variables; a pure pointwise region has
no reduction variables). Every value is a scalar ``Expr`` in terms of the domain's loop
variables; index arithmetic lives in sympy (see ``indexing``).

Reductions come in two levels:
  * ``inner``: reduce the element-level body over the reduction variables, one result
    per row (softmax max/sum, layer-norm mean/var, ...). They run in phases: a phase's
    bodies may use the results of earlier phases (max, then sum of exp(x - max)).
  * ``outer``: reduce a row-level body over ALL rows to one value (the mean of
    cross-entropy's per-row losses). The emitter runs them in the last block to finish.

Precision (documented choice): every value of a float dtype is carried in fp32 (fp64
for float64), as PyTorch's CUDA kernels do with their ``opmath`` type. A ``Cast`` to
fp16/bf16 rounds the fp32 value to that type; the lowering inserts one after every ATen
op whose eager output is fp16/bf16, so a fused chain rounds exactly where eager rounds
(eager writes each op's result to memory in fp16). Ops that are one ATen node in eager
(softmax, layer norm, ...) keep fp32 inside and round once, as eager does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import sympy
import torch

from ..exc import StitchError


class Unsupported(StitchError):
    """The region cannot be expressed by the fused-kernel templates; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_TYPES = (torch.float16, torch.bfloat16)
INT_TYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
STORAGE_TYPES = FLOAT_TYPES + INT_TYPES + (torch.bool,)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The type eager computes in for ``dtype`` (fp32 for fp16/bf16)."""
    return torch.float32 if dtype in HALF_TYPES else dtype


def acc_type(dtype: torch.dtype) -> torch.dtype:
    """The accumulator of a sum/prod over ``dtype`` values."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    if dtype == torch.float64:
        return torch.float64
    return torch.int64


# ----------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Expr:
    """A scalar value in the kernel; ``dtype`` is its logical (eager) dtype."""

    dtype: torch.dtype


@dataclass(frozen=True)
class Load(Expr):
    """Element ``offset`` (in elements) of buffer ``buf`` ("in3", "ws0")."""

    buf: str
    offset: sympy.Expr


@dataclass(frozen=True)
class Const(Expr):
    value: float | int | bool


@dataclass(frozen=True)
class SizeVal(Expr):
    """The value of a symbolic (or constant) size expression."""

    expr: sympy.Expr


@dataclass(frozen=True)
class IndexVal(Expr):
    """The value of an index expression of loop variables (argmax positions)."""

    expr: sympy.Expr


@dataclass(frozen=True)
class Cast(Expr):
    """Conversion to ``dtype`` (rounds when ``dtype`` is fp16/bf16)."""

    x: Expr


@dataclass(frozen=True)
class Op(Expr):
    """Pointwise op ``name`` (see ``OPS``) on ``args``, with scalar ``params``."""

    name: str
    args: tuple[Expr, ...]
    params: tuple = ()


@dataclass(frozen=True)
class RedRef(Expr):
    """Result of reduction ``rid`` for the current row; ``part`` 1 = argmax position."""

    rid: int
    part: int = 0


# The pointwise op vocabulary shared by the interpreter and the CUDA emitter:
# name -> arity. Semantics are PyTorch's (CUDA) for the op of the same name.
OPS: dict[str, int] = {
    **{n: 1 for n in (
        "neg", "abs", "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log1p", "log2",
        "log10", "sin", "cos", "tan", "tanh", "sigmoid", "erf", "erfc", "erfinv", "asin",
        "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "reciprocal", "floor",
        "ceil", "round", "trunc", "frac", "sign", "relu", "gelu_erf", "gelu_tanh", "isnan",
        "isinf", "isfinite", "logical_not", "bitwise_not", "signbit")},
    **{n: 2 for n in (
        "add", "sub", "mul", "div", "div_trunc", "div_floor", "fmod", "remainder", "pow",
        "maximum", "minimum", "fmax", "fmin", "atan2", "copysign", "eq", "ne", "lt", "le",
        "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and",
        "bitwise_or", "bitwise_xor", "hypot")},
    "where": 3,
    # params: (slope,)
    "leaky_relu": 1,
    # params: (alpha, scale, input_scale)
    "elu": 1,
}


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Op):
        return e.args
    if isinstance(e, Cast):
        return (e.x,)
    return ()


def index_exprs(e: Expr) -> tuple[sympy.Expr, ...]:
    if isinstance(e, Load):
        return (e.offset,)
    if isinstance(e, (SizeVal, IndexVal)):
        return (e.expr,)
    return ()


def walk(roots) -> list[Expr]:
    """Every distinct sub-expression of ``roots``, children before parents."""
    seen: set = set()
    order: list[Expr] = []
    stack = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for c in reversed(children(node)):
            if c not in seen:
                stack.append((c, False))
    return order


def map_expr(e: Expr, f_index: Callable[[sympy.Expr], sympy.Expr], memo: dict | None = None) -> Expr:
    """``e`` with every index expression rewritten by ``f_index``."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    if isinstance(e, Load):
        out = replace(e, offset=f_index(e.offset))
    elif isinstance(e, SizeVal):
        out = e
    elif isinstance(e, IndexVal):
        out = replace(e, expr=f_index(e.expr))
    elif isinstance(e, Cast):
        out = replace(e, x=map_expr(e.x, f_index, memo))
    elif isinstance(e, Op):
        out = replace(e, args=tuple(map_expr(a, f_index, memo) for a in e.args))
    else:
        out = e
    memo[e] = out
    return out


# ----------------------------------------------------------------------------- kernel


@dataclass(frozen=True)
class Reduction:
    """One reduction; ``kind`` in sum, prod, max, min, argmax, argmin, any, all, softmax.

    ``body`` is reduced in ``dtype`` (the accumulator type). For argmax/argmin,
    ``index`` is the position that is returned (``RedRef(part=1)``), ties and NaN as
    eager (first maximum; NaN counts as the maximum). ``softmax`` is softmax's two
    statistics in one pass: the maximum (part 0) and the sum of exp(x - maximum)
    (part 1), partial sums rescaled as partial maxima combine.
    """

    rid: int
    kind: str
    body: Expr
    dtype: torch.dtype
    level: str = "inner"  # or "outer"
    index: sympy.Expr | None = None
    phase: int = 0


@dataclass(frozen=True)
class Store:
    """``out[offset] = value`` for every point of the domain where all ``guards`` == 0.

    ``level`` "element": inside the reduction loop (or the pointwise loop); "row": once
    per row (no reduction variable occurs); "outer": once, after the outer reductions.
    """

    out: int
    offset: sympy.Expr
    value: Expr
    guards: tuple[sympy.Expr, ...] = ()
    level: str = "element"


@dataclass(frozen=True)
class TensorArg:
    """A tensor the kernel reads ("in<k>") or writes ("out<k>")."""

    name: str
    position: int  # index among the region's inputs (or outputs)
    dtype: torch.dtype
    shape: tuple[sympy.Expr, ...]
    stride: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class SymbolBinding:
    """Where the runtime value of a size symbol comes from: input ``position``, ``dim``
    (``dim`` None: the input is itself the int)."""

    symbol: sympy.Symbol
    position: int
    dim: int | None
    kind: str = "size"  # "size", "stride" or "int"


@dataclass(frozen=True)
class Domain:
    row_vars: tuple[sympy.Symbol, ...]
    row_extents: tuple[sympy.Expr, ...]
    red_vars: tuple[sympy.Symbol, ...] = ()
    red_extents: tuple[sympy.Expr, ...] = ()
    # When set, a row reduces only its first ``red_limit`` elements (an expression of the
    # row variables; used by split whole-tensor reductions whose last row is short).
    red_limit: sympy.Expr | None = None

    @property
    def rows(self) -> sympy.Expr:
        out = sympy.Integer(1)
        for e in self.row_extents:
            out = out * e
        return out

    @property
    def reduce_len(self) -> sympy.Expr:
        out = sympy.Integer(1)
        for e in self.red_extents:
            out = out * e
        return out

    def extents(self) -> dict[sympy.Symbol, sympy.Expr]:
        return dict(zip(self.row_vars + self.red_vars, self.row_extents + self.red_extents))


@dataclass(frozen=True)
class KernelIR:
    """Everything the emitter and the interpreter need to run one fused region."""

    name: str
    ops: tuple[str, ...]
    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    n_region_inputs: int
    symbols: tuple[SymbolBinding, ...]
    domain: Domain
    reductions: tuple[Reduction, ...]
    stores: tuple[Store, ...]
    data_vars: tuple[tuple[sympy.Symbol, Expr], ...] = ()
    # each data var's extent: an index outside [0, extent) is an error, as in ATen
    data_extents: tuple[tuple[sympy.Symbol, sympy.Expr], ...] = ()
    int_inputs: tuple[tuple[int, int], ...] = ()  # (position, value) of static int inputs
    notes: tuple[str, ...] = field(default=())
    # fp32 exp and the online softmax in their fast forms (``fast_math``)
    fast_math: bool = False

    @property
    def is_reduction(self) -> bool:
        return bool(self.reductions)

    @property
    def outer_reductions(self) -> tuple[Reduction, ...]:
        return tuple(r for r in self.reductions if r.level == "outer")

    @property
    def inner_reductions(self) -> tuple[Reduction, ...]:
        return tuple(r for r in self.reductions if r.level == "inner")

    def all_exprs(self) -> list[Expr]:
        roots = [s.value for s in self.stores] + [r.body for r in self.reductions]
        roots += [e for _, e in self.data_vars]
        return walk(roots)


def describe(ir: KernelIR) -> str:
    """A short, readable listing of the IR (for logs and test failures)."""
    lines = [f"kernel {ir.name}: rows={ir.domain.row_vars}:{ir.domain.row_extents} "
             f"reduce={ir.domain.red_vars}:{ir.domain.red_extents}"]
    for r in ir.reductions:
        lines.append(f"  red{r.rid} [{r.level}, phase {r.phase}] {r.kind}<{r.dtype}> {r.body}")
    for s in ir.stores:
        lines.append(f"  out{s.out}[{s.offset}] ({s.level}, guards={s.guards}) = {s.value}")
    return "\n".join(lines)
