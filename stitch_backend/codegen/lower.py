"""Lowering of a fused region (an ATen ``torch.fx.GraphModule``) to ``KernelIR``.

Every graph value becomes a *lazy tensor* (``LT``): a shape, a dtype and a function from
a logical index (sympy expressions) to a scalar ``Expr``. Views only rewrite indices, so
reshape/permute/expand/slice/select/... cost nothing and compose freely. Reductions are
collected as specs; the one with the largest input fixes the kernel's iteration space
(``rows x reduce``). The others must share it (``inner``) or reduce row-level values
over all rows (``outer``); anything else raises ``Unsupported`` with the reason.

Op-specific rules live in ``lower_ops``; this module holds the machinery.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from ..regions import CONSTANT
from . import indexing as ix
from .kernel_ir import (
    HALF_TYPES, STORAGE_TYPES, Cast, Const, Domain, Expr, IndexVal, KernelIR, Load, Op,
    RedRef, Reduction, SizeVal, Store, SymbolBinding, TensorArg, Unsupported, map_expr, walk,
)

log = logging.getLogger("stitch_backend.codegen.lower")
aten = torch.ops.aten

Index = tuple  # tuple[sympy.Expr, ...]


# ----------------------------------------------------------------------------- lazy tensors


class LT:
    """A lazy tensor: ``at(index)`` gives the scalar Expr of one element."""

    __slots__ = ("shape", "dtype", "_fn", "_memo")

    def __init__(self, shape, dtype: torch.dtype, fn: Callable[[Index], Expr]):
        self.shape = tuple(ix.sympify_size(s) for s in shape)
        self.dtype = dtype
        self._fn = fn
        self._memo: dict = {}

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def at(self, index: Sequence) -> Expr:
        key = tuple(sympy.sympify(i) for i in index)
        if len(key) != len(self.shape):
            raise AssertionError(f"index {key} for shape {self.shape}")
        hit = self._memo.get(key)
        if hit is None:
            hit = self._fn(key)
            self._memo[key] = hit
        return hit


def cast(e: Expr, dtype: torch.dtype) -> Expr:
    """``e`` converted to ``dtype`` (constants are folded, rounding as torch does)."""
    if e.dtype == dtype:
        return e
    if isinstance(e, Const):
        return Const(dtype, _convert_scalar(e.value, dtype))
    return Cast(dtype, e)


def _convert_scalar(v, dtype: torch.dtype):
    if dtype == torch.bool:
        return bool(v)
    if dtype.is_floating_point:
        return float(torch.tensor(float(v), dtype=torch.float64).to(dtype).item())
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        raise Unsupported(f"cannot convert {v} to {dtype}")
    return int(torch.tensor(v).to(dtype).item())


def const_lt(value, dtype: torch.dtype) -> LT:
    c = Const(dtype, _convert_scalar(value, dtype))
    return LT((), dtype, lambda o: c)


def broadcast_shapes(*shapes) -> tuple:
    nd = max((len(s) for s in shapes), default=0)
    out = [sympy.Integer(1)] * nd
    for s in shapes:
        for j, d in enumerate(s):
            k = nd - len(s) + j
            if d != 1:
                if out[k] != 1 and not ix.known_equal(out[k], d):
                    raise Unsupported(f"shapes {shapes} do not broadcast")
                out[k] = d
    return tuple(out)


def bcast_index(src_shape, out_shape, o: Index) -> Index:
    off = len(out_shape) - len(src_shape)
    return tuple(sympy.Integer(0) if src_shape[j] == 1 else o[j + off] for j in range(len(src_shape)))


def pointwise(args: Sequence[LT], fn: Callable[..., Expr], dtype: torch.dtype, shape=None) -> LT:
    """An LT whose element is ``fn(*elements of args)`` (args broadcast to ``shape``)."""
    shape = broadcast_shapes(*(a.shape for a in args)) if shape is None else \
        tuple(ix.sympify_size(s) for s in shape)
    return LT(shape, dtype, lambda o: fn(*(a.at(bcast_index(a.shape, shape, o)) for a in args)))


# ----------------------------------------------------------------------------- reductions


@dataclass(eq=False)
class RedSpec:
    """A reduction as written in the graph, before it is placed in the domain."""

    kind: str
    x: LT
    dims: tuple[int, ...]
    dtype: torch.dtype  # accumulator / result type of the reduction
    flat_index: bool = False  # argmax over all dims returns the flat position
    what: str = ""

    @property
    def numel(self) -> sympy.Expr:
        return ix.prod(self.x.shape)


@dataclass
class _Placed:
    rid: int
    level: str
    row_map: tuple | None  # kept-dim index (in the spec's input) as a function of row vars


# ----------------------------------------------------------------------------- context


@dataclass
class Ctx:
    gm: torch.fx.GraphModule
    name: str
    env: dict = field(default_factory=dict)
    specs: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    data_vars: dict = field(default_factory=dict)  # Expr -> symbol
    data_ranges: dict = field(default_factory=dict)
    # set once the domain is fixed
    dom_shape: tuple = ()
    dom_vars: tuple = ()
    red_dims: tuple = ()
    placed: dict = field(default_factory=dict)
    reductions: list = field(default_factory=list)
    simp: ix.Simplifier | None = None
    # node -> (its input TensorArg, that input's storage offset): values that are views
    # of a region input, loaded through their own static strides (``_strided_view``)
    strided: dict = field(default_factory=dict)
    # variances in one pass over shifted values (``lower_reductions._shifted_moments``)
    single_pass_stats: bool = False

    # -- helpers used by op rules ------------------------------------------------------
    def reduce(self, kind: str, x: LT, dims, keepdim: bool, dtype: torch.dtype,
               flat_index: bool = False, part: int = 0, what: str = "") -> LT:
        """A reduction of ``x`` over ``dims`` (all dims when empty/None)."""
        nd = x.ndim
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = tuple(range(nd))
        elif isinstance(dims, int):
            dims = (dims,)
        dims = tuple(sorted({d % nd if nd else 0 for d in dims})) if nd else ()
        spec = self._spec(kind, x, dims, dtype, flat_index, what)
        out_shape = tuple(sympy.Integer(1) if j in dims else s for j, s in enumerate(x.shape)) \
            if keepdim else tuple(s for j, s in enumerate(x.shape) if j not in dims)
        res_dtype = torch.int64 if part == 1 and kind in ("argmax", "argmin") else dtype

        def fn(o: Index) -> Expr:
            if keepdim:
                full = o
            else:
                it = iter(o)
                full = tuple(sympy.Integer(0) if j in dims else next(it) for j in range(nd))
            return self.red_ref(spec, full, part, res_dtype)

        return LT(out_shape, res_dtype, fn)

    def _spec(self, kind, x, dims, dtype, flat_index, what) -> RedSpec:
        for s in self.specs:  # two identical reductions share one loop
            if s.x is x and s.kind == kind and s.dims == dims and s.dtype == dtype \
                    and s.flat_index == flat_index:
                return s
        spec = RedSpec(kind, x, dims, dtype, flat_index, what)
        self.specs.append(spec)
        return spec

    def data_index(self, value: Expr, extent: sympy.Expr) -> sympy.Symbol:
        """A symbol standing for a data-dependent index (gather); ``extent`` bounds it."""
        value = cast(value, torch.int64)
        sym = self.data_vars.get(value)
        if sym is None:
            sym = ix.data_var(len(self.data_vars))
            self.data_vars[value] = sym
            self.data_ranges[sym] = (sympy.Integer(0), ix.sympify_size(extent) - 1)
            if self.simp is not None:
                self.simp = ix.Simplifier({**self.simp.ranges, sym: self.data_ranges[sym]})
        return sym

    def simplify(self, e: sympy.Expr) -> sympy.Expr:
        return self.simp.simplify(e) if self.simp is not None else sympy.expand(e)

    # -- the domain -------------------------------------------------------------------
    def fix_domain(self, shape: tuple, red_dims: tuple) -> None:
        self.dom_shape = tuple(shape)
        self.dom_vars = tuple(ix.loop_var(j) for j in range(len(shape)))
        self.red_dims = tuple(red_dims)
        ranges = {v: (sympy.Integer(0), s - 1) for v, s in zip(self.dom_vars, shape)}
        ranges.update(self.data_ranges)
        self.simp = ix.Simplifier(ranges)

    @property
    def row_vars(self) -> tuple:
        return tuple(v for j, v in enumerate(self.dom_vars) if j not in self.red_dims)

    @property
    def red_vars(self) -> tuple:
        return tuple(v for j, v in enumerate(self.dom_vars) if j in self.red_dims)

    def _row_sizes(self) -> list:
        return [s for j, s in enumerate(self.dom_shape) if j not in self.red_dims]

    def _red_sizes(self) -> list:
        return [s for j, s in enumerate(self.dom_shape) if j in self.red_dims]

    def red_ref(self, spec: RedSpec, full: Index, part: int, dtype: torch.dtype) -> Expr:
        placed = self._place(spec)
        if placed.level == "inner":
            kept = [self.simplify(full[j]) for j in range(spec.x.ndim) if j not in spec.dims]
            for a, b in zip(kept, placed.row_map):
                if self.simplify(a - b) != 0:
                    raise Unsupported(
                        f"the result of {spec.what or spec.kind} is used at another row than "
                        f"the one it was reduced for ({tuple(kept)} vs {placed.row_map}); "
                        "the fused template keeps one row per thread group")
        return RedRef(dtype, placed.rid, part)

    def _place(self, spec: RedSpec) -> _Placed:
        hit = self.placed.get(id(spec))
        if hit is not None:
            if hit == "busy":
                raise Unsupported("a reduction depends on itself")
            return hit
        self.placed[id(spec)] = "busy"
        shape, dims = spec.x.shape, spec.dims
        kept_sizes = [s for j, s in enumerate(shape) if j not in dims]
        red_sizes = [s for j, s in enumerate(shape) if j in dims]
        rows, red = ix.prod(self._row_sizes()), ix.prod(self._red_sizes())
        same = len(shape) == len(self.dom_shape) and dims == self.red_dims and all(
            ix.known_equal(a, b) for a, b in zip(shape, self.dom_shape))
        if same:
            body_idx = list(self.dom_vars)
            level = "inner"
        elif ix.known_equal(ix.prod(kept_sizes), rows) and ix.known_equal(ix.prod(red_sizes), red):
            rlin = ix.linearize(list(self.row_vars), self._row_sizes())
            klin = ix.linearize(list(self.red_vars), self._red_sizes())
            kept_idx = iter(ix.delinearize(rlin, kept_sizes))
            red_idx = iter(ix.delinearize(klin, red_sizes))
            body_idx = [next(red_idx) if j in dims else next(kept_idx) for j in range(len(shape))]
            level = "inner"
        elif len(dims) == len(shape) and self.red_dims and ix.known_equal(ix.prod(shape), rows):
            rlin = ix.linearize(list(self.row_vars), self._row_sizes())
            body_idx = ix.delinearize(rlin, list(shape))
            level = "outer"
        else:
            raise Unsupported(
                f"{spec.what or spec.kind} over dims {dims} of shape {tuple(shape)} does not "
                f"share the region's iteration space (shape {self.dom_shape}, reduced dims "
                f"{self.red_dims}); split the region at this reduction")
        body_idx = tuple(self.simplify(e) for e in body_idx)
        body = spec.x.at(body_idx)
        body = cast(body, spec.dtype) if spec.kind not in ("any", "all") else cast(body, torch.bool)
        index = None
        if spec.kind in ("argmax", "argmin"):
            if spec.flat_index:
                index = ix.linearize(list(body_idx), list(shape))
            else:
                index = body_idx[dims[0]] if dims else sympy.Integer(0)
            index = self.simplify(index)
        free = expr_vars(body, self.data_exprs())
        reds_used = refs(body)
        if level == "outer":
            if free & set(self.red_vars):
                raise Unsupported(f"{spec.what or spec.kind} reduces element-level values over "
                                  "rows; only row-level values can be reduced across rows")
            if any(self.reductions[r].level == "outer" for r in reds_used):
                raise Unsupported("a cross-row reduction of a cross-row reduction")
            phase = 0
        else:
            if any(self.reductions[r].level == "outer" for r in reds_used):
                raise Unsupported("a per-row reduction uses a cross-row reduction")
            phase = 1 + max((self.reductions[r].phase for r in reds_used), default=-1)
        rid = len(self.reductions)
        self.reductions.append(Reduction(rid, spec.kind, body, spec.dtype, level, index, phase))
        row_map = tuple(self.simplify(body_idx[j]) for j in range(len(shape)) if j not in dims) \
            if level == "inner" else None
        placed = _Placed(rid, level, row_map)
        self.placed[id(spec)] = placed
        return placed

    def data_exprs(self) -> dict:
        return {s: e for e, s in self.data_vars.items()}


def refs(e: Expr) -> set[int]:
    return {n.rid for n in walk([e]) if isinstance(n, RedRef)}


def expr_vars(e: Expr, data: dict) -> set:
    """Loop variables ``e`` depends on (through loads, index values and gathers)."""
    out: set = set()
    seen_data: set = set()
    todo = [e]
    while todo:
        nodes = walk(todo)
        todo = []
        for n in nodes:
            for ie in _idx(n):
                for s in ie.free_symbols:
                    if ix.is_loop_var(s):
                        out.add(s)
                    elif ix.is_data_var(s) and s not in seen_data:
                        seen_data.add(s)
                        todo.append(data[s])
    return out


def _idx(n: Expr):
    if isinstance(n, Load):
        return (n.offset,)
    if isinstance(n, IndexVal):
        return (n.expr,)
    return ()


# ----------------------------------------------------------------------------- graph walk


def _meta(node: torch.fx.Node):
    val = node.meta.get("val")
    if val is None:
        raise Unsupported(f"node {node.name} ({node.target}) has no meta['val']")
    return val


def _sym_value(val) -> sympy.Expr:
    if isinstance(val, torch.SymFloat) or isinstance(val, float):
        raise Unsupported("float scalars computed on the host (SymFloat) are not supported")
    return ix.sympify_size(val)


def lower(gm: torch.fx.GraphModule, name: str, *, single_pass_stats: bool = False) -> KernelIR:
    """The KernelIR of region ``gm``; raises ``Unsupported`` with the reason.
    ``single_pass_stats``: variances (norms' included) in one pass over the row."""
    from . import lower_ops  # the op rules register themselves in RULES

    ctx = Ctx(gm, name, single_pass_stats=single_pass_stats)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    int_inputs = []
    constants = set()
    # A constant is inlined where the region has other tensor inputs (they place the
    # outputs); a CPU scalar beside CUDA tensors then costs the kernel nothing.
    others = any(CONSTANT not in n.meta and isinstance(_meta(n), torch.Tensor)
                 for n in placeholders)
    for pos, node in enumerate(placeholders):
        val = _meta(node)
        const = node.meta.get(CONSTANT)
        if isinstance(const, torch.Tensor) and const.dtype in STORAGE_TYPES and others:
            ctx.env[node] = _const_lt(const)    # a literal: the kernel never reads it
            constants.add(node)
            continue
        if isinstance(val, torch.Tensor):
            if val.dtype not in STORAGE_TYPES:
                raise Unsupported(f"input {node.name} has dtype {val.dtype}")
            if val.layout != torch.strided:
                raise Unsupported(f"input {node.name} is not a strided tensor")
            arg = TensorArg(f"in{len(ctx.inputs)}", pos, val.dtype,
                            tuple(ix.sympify_size(s) for s in val.shape),
                            tuple(ix.sympify_size(s) for s in val.stride()))
            ctx.inputs.append(arg)
            ctx.env[node] = _load_lt(arg)
            if _static_layout(val):
                ctx.strided[node] = (arg, val.storage_offset())
        elif isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            ctx.env[node] = _sym_value(val)
            if isinstance(val, int):
                int_inputs.append((pos, val))
        else:
            raise Unsupported(f"input {node.name} is a {type(val).__name__}; only tensors and ints")
    outputs = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = node.args[0]
            break
        if node.op == "get_attr":
            ctx.env[node] = _get_attr(gm, node)
            continue
        if node.op != "call_function":
            raise Unsupported(f"node {node.name}: {node.op} nodes are not supported")
        direct = _strided_view(ctx, node)
        if direct is not None:
            ctx.ops.append(str(node.target))
            ctx.env[node] = direct
            continue
        ctx.env[node] = _lower_node(ctx, node, lower_ops.RULES)
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    out_vals = []
    for o in outputs:
        if not isinstance(o, torch.fx.Node) or not isinstance(ctx.env.get(o), LT):
            raise Unsupported(f"region output {o} is not a tensor computed in the region")
        out_vals.append((o, ctx.env[o]))
    _one_device([p for p in placeholders if p not in constants], outputs)
    from .finalize import finalize

    return finalize(ctx, out_vals, int_inputs)


def _one_device(placeholders: list, outputs: Sequence) -> None:
    """A kernel reads and writes memory of one device: a region mixing, say, a CPU
    scalar tensor constant with CUDA tensors (which ATen allows) stays on ATen."""
    devices: dict[str, str] = {}
    for node in [*placeholders, *outputs]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            devices.setdefault(str(val.device), node.name)
    if len(devices) > 1:
        raise Unsupported("region mixes devices: " + ", ".join(
            f"{name} on {dev}" for dev, name in devices.items()))


_IGNORED = {"_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
            "_assert_async", "_assert_tensor_metadata"}


def _lower_node(ctx: Ctx, node: torch.fx.Node, rules: dict) -> Any:
    target = node.target
    if target is operator.getitem:
        base = ctx.env[node.args[0]]
        return base[node.args[1]]
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and \
            not isinstance(target, torch._ops.OpOverload) or \
            isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _sym_value(val)
    if not isinstance(target, torch._ops.OpOverload):
        name = getattr(target, "__name__", str(target))
        if name in _IGNORED:
            return None
        raise Unsupported(f"{name}: only ATen ops (OpOverload) can be fused")
    packet = target.overloadpacket.__name__
    if packet in _IGNORED:
        return None
    op_name = str(target)
    rule = rules.get(target) or rules.get(target.overloadpacket)
    if rule is None and packet.endswith("_") and not packet.startswith("_"):
        rule = _inplace_rule(ctx, node, rules)
    if rule is None:
        raise Unsupported(f"{op_name} has no fused-kernel rule")
    ctx.ops.append(op_name)
    args = torch.fx.node.map_arg(node.args, lambda n: ctx.env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: ctx.env[n])
    try:
        return rule(ctx, node, *args, **kwargs)
    except Unsupported:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AssertionError) as exc:
        raise Unsupported(f"{op_name}: cannot lower these arguments ({type(exc).__name__}: {exc})") \
            from exc


def _inplace_rule(ctx: Ctx, node: torch.fx.Node, rules: dict):
    """An in-place op on a value made inside the region, used nowhere else, is its
    functional twin (make_fx can leave e.g. ``add_`` in decompositions)."""
    target = node.target
    packet = target.overloadpacket.__name__
    functional = getattr(torch.ops.aten, packet[:-1], None)
    if functional is None:
        return None
    over = getattr(functional, target._overloadname, None)
    rule = rules.get(over) or rules.get(functional)
    if rule is None:
        return None
    mutated = node.args[0]
    if not isinstance(mutated, torch.fx.Node) or mutated.op == "placeholder":
        raise Unsupported(f"{target} mutates a region input")
    later = [u for u in mutated.users if u is not node]
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if any(order[u] > order[node] for u in later):
        raise Unsupported(f"{target} mutates {mutated.name}, which is read again afterwards")
    return rule


def _get_attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> LT:
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.dtype not in STORAGE_TYPES:
        raise Unsupported(f"constant {node.target}: only one-element tensor constants are inlined")
    return _const_lt(value)


def _const_lt(value: torch.Tensor) -> LT:
    """A one-element tensor constant as a literal of its shape and dtype."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():      # the Coder may run inside AOTAutograd's fake mode
        c = Const(value.dtype, value.item())
    return LT(tuple(value.shape), value.dtype, lambda o: c)


def _load_lt(arg: TensorArg, shape=None, stride=None, offset: int = 0) -> LT:
    """Loads of input ``arg``, or of a view of it with ``shape``/``stride`` starting
    ``offset`` elements into it."""
    shape = arg.shape if shape is None else shape
    stride = arg.stride if stride is None else stride

    def fn(o: Index) -> Expr:
        off = sympy.Integer(offset)
        for i, s, st in zip(o, shape, stride):
            if s != 1:
                off = off + i * st
        return Load(arg.dtype, arg.name, sympy.expand(off))

    return LT(shape, arg.dtype, fn)


# Ops whose result is always a view of their input's storage (``reshape`` may copy and
# ``_unsafe_view`` follows one that did: they go through the index-rewriting rules).
_DIRECT_VIEWS = frozenset({
    aten.view.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.expand.default})


def _static_layout(val: Any) -> bool:
    return (isinstance(val, torch.Tensor)
            and all(type(v) is int for v in (*val.shape, *val.stride(), val.storage_offset())))


def _strided_view(ctx: Ctx, node: torch.fx.Node) -> LT | None:
    """A view of a region input, loaded through the view's own strides (its fake value
    has them): a reshape of a permuted input indexes memory linearly where the generic
    rules would split and merge its indices with divisions and remainders. None where
    that does not apply (symbolic sizes, not a view of an input, ...)."""
    if node.target not in _DIRECT_VIEWS or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or src not in ctx.strided:
        return None
    val = node.meta.get("val")
    if not _static_layout(val) or val.dtype != src.meta["val"].dtype:
        return None
    arg, base = ctx.strided[src]
    ctx.strided[node] = (arg, base)
    return _load_lt(arg, tuple(val.shape), tuple(val.stride()), val.storage_offset() - base)


def round_to(e: Expr, dtype: torch.dtype) -> Expr:
    """The value eager would write for an op result of ``dtype``."""
    return cast(e, dtype)


__all__ = ["LT", "Ctx", "RedSpec", "lower", "cast", "const_lt", "pointwise", "broadcast_shapes",
           "bcast_index", "round_to", "HALF_TYPES", "Op", "Const", "SizeVal", "IndexVal",
           "Domain", "Store", "SymbolBinding", "map_expr", "Unsupported"]
