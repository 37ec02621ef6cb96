"""Scalar expressions and index arithmetic as CUDA C++ (used by ``emit_cuda``).

``ExprEmitter.value`` prints an ``Expr`` as a C expression, declaring one ``const``
variable per distinct sub-expression in the outermost ``Scope`` (loop level) where all
the loop variables it reads are defined, so loop-invariant work is done once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch

from . import indexing as ix
from .kernel_ir import Cast, Const, Expr, IndexVal, Load, Op, RedRef, SizeVal, Unsupported

CTYPE = {
    torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16",
    torch.float64: "double", torch.int64: "long long", torch.int32: "int", torch.int16: "short",
    torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
}
SMALL_INTS = ("short", "signed char", "unsigned char", "bool")

_MATH = {  # IR op -> (float function, double function)
    "sqrt": ("sqrtf", "sqrt"), "rsqrt": ("rsqrtf", "rsqrt"), "exp": ("expf", "exp"),
    "exp2": ("exp2f", "exp2"), "expm1": ("expm1f", "expm1"), "log": ("logf", "log"),
    "log1p": ("log1pf", "log1p"), "log2": ("log2f", "log2"), "log10": ("log10f", "log10"),
    "sin": ("sinf", "sin"), "cos": ("cosf", "cos"), "tan": ("tanf", "tan"),
    "tanh": ("tanhf", "tanh"), "erf": ("erff", "erf"), "erfc": ("erfcf", "erfc"),
    "erfinv": ("erfinvf", "erfinv"), "asin": ("asinf", "asin"), "acos": ("acosf", "acos"),
    "atan": ("atanf", "atan"), "sinh": ("sinhf", "sinh"), "cosh": ("coshf", "cosh"),
    "asinh": ("asinhf", "asinh"), "acosh": ("acoshf", "acosh"), "atanh": ("atanhf", "atanh"),
    "floor": ("floorf", "floor"), "ceil": ("ceilf", "ceil"), "trunc": ("truncf", "trunc"),
    "round": ("nearbyintf", "nearbyint"),
}
_MATH2 = {"fmax": ("fmaxf", "fmax"), "fmin": ("fminf", "fmin"), "atan2": ("atan2f", "atan2"),
          "copysign": ("copysignf", "copysign"), "hypot": ("hypotf", "hypot")}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def compute_ctype(dtype: torch.dtype) -> str:
    """The C type a value of ``dtype`` is computed in (fp16/bf16 -> float)."""
    if dtype in (torch.float16, torch.bfloat16):
        return "float"
    return CTYPE[dtype]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class IssuedLoad:
    """One global load line of a chunk: ``const VT NAME = VALUE;``, or with ``fill`` the
    slot it also keeps the chunk in (``const VT NAME = (FILL = VALUE);``); a vector load
    (``emit_cuda._vector_chunk``) or one element's (``batched_loads.leading_loads``)."""

    line: str
    name: str
    vt: str
    value: str
    fill: str | None = None


class Scope:
    """One loop level: the variables it defines and the lines declared in it."""

    def __init__(self, parent: "Scope | None", defined, ind: str):
        self.parent = parent
        self.defined = set(defined)
        self.ind = ind
        self.pre: list[str] = []
        self.lines: list[str] = []
        self.names: dict = {}
        self.vector = False
        # the global loads a chunk issues (``emit_cuda._vector_chunk``, or
        # ``batched_loads.leading_loads`` for one element a step): their lines, to issue
        # ahead of their use (``batched_loads.batched_loop``)
        self.issued: list[IssuedLoad] = []
        # the innermost side of an ``if`` this scope is in (``ExprEmitter._branches``)
        self.branch: Scope | None = parent.branch if parent is not None else None
        # a vector chunk's loop over its lanes (``emit_cuda._vector_chunk``): how many,
        # and the lines it puts before and after that loop (a lane array, what reads it)
        self.lanes = 0
        self.before_lanes: list[str] = []
        self.after_lanes: list[str] = []

    def chain(self) -> list["Scope"]:
        out, s = [], self
        while s is not None:
            out.append(s)
            s = s.parent
        return list(reversed(out))

    def render(self) -> list[str]:
        return self.pre + self.lines


def literal(value, dtype: torch.dtype) -> str:
    ct = compute_ctype(dtype)
    if dtype == torch.bool:
        return "true" if value else "false"
    if ct in ("float", "double"):
        v = float(value)
        suffix = "F" if ct == "float" else "D"
        if math.isnan(v):
            return f"SFK_NAN_{suffix}"
        if math.isinf(v):
            return f"SFK_INF_{suffix}" if v > 0 else f"(-SFK_INF_{suffix})"
        text = repr(v)
        return f"{text}f" if ct == "float" else text
    v = int(value)
    if ct == "long long":
        return f"({v + 1}LL - 1)" if v == -(2 ** 63) else f"{v}LL"
    return f"(({ct}){v})"


@dataclass
class VectorChunk:
    """The vector chunk being emitted: its scope, the variable along it, its width,
    its vector loads, and the wheres it picks loads by (-> each lane's value)."""

    scope: Scope
    var: sympy.Symbol
    vec: int
    loads: dict
    picked: dict = field(default_factory=dict)


class ExprEmitter:
    def __init__(self, kernel, ir):
        self.k = kernel
        self.IDX = kernel.IDX
        self.data = dict(ir.data_vars)
        self.fast = ir.fast_math
        self.extents = dict(ir.data_extents)
        self.red_names: dict = {}
        self.overrides: dict = {}
        self.override_deps: set = set()
        # persistent rows (persist.value_passes): values this pass reads from registers,
        # and values it computes and keeps there for a later pass (C lvalues)
        self.value_uses: dict = {}
        self.fills: dict = {}
        # a vector chunk's loads (``emit_cuda._vector_chunk``): a where that picks one of
        # them by a condition the chunk's lanes share loads only the one it picks
        self.chunk: VectorChunk | None = None
        self.count = 0

    # -- dependencies --------------------------------------------------------------------
    def _index_deps(self, e: sympy.Expr) -> set:
        out: set = set()
        for s in e.free_symbols:
            if ix.is_data_var(s):
                out |= self.deps(self.data[s])
            elif s.name.startswith(("i", "k0", "v")) or s.name.endswith("_0"):
                out.add(s)
        return out

    def deps(self, e: Expr) -> set:
        if self.value_uses and e in self.value_uses:   # (hashing a deep Expr is not free)
            return set(self.override_deps)
        if isinstance(e, Load):
            if e in self.overrides:
                return set(self.override_deps) | self._index_deps(e.offset)
            return self._index_deps(e.offset)
        if isinstance(e, IndexVal):
            return self._index_deps(e.expr)
        if isinstance(e, RedRef):
            return {sympy.Symbol(f"R{e.rid}")}
        if isinstance(e, (Op, Cast)):
            out: set = set()
            for c in (e.args if isinstance(e, Op) else (e.x,)):
                out |= self.deps(c)
            return out
        return set()

    def reduced(self, r, scope: Scope, name: str) -> None:
        """Reduction ``r``'s result is now ``name`` in ``scope``."""
        marker = sympy.Symbol(f"R{r.rid}")
        scope.defined.add(marker)
        if r.kind in ("argmax", "argmin"):
            self.red_names[(r.rid, 0)] = f"{name}.v"
            self.red_names[(r.rid, 1)] = f"{name}.i"
        elif r.kind == "softmax":
            self.red_names[(r.rid, 0)] = f"{name}.m"
            self.red_names[(r.rid, 1)] = f"{name}.s"
        else:
            self.red_names[(r.rid, 0)] = name

    def _target(self, deps: set, scope: Scope) -> Scope:
        cum: set = set()
        for s in scope.chain():
            cum |= s.defined
            if deps <= cum:
                return s
        raise AssertionError(f"variables {deps - cum} are not defined at this point")

    # -- index expressions ---------------------------------------------------------------
    def index(self, e: sympy.Expr, scope: Scope) -> str:
        names = {}
        for s in e.free_symbols:
            if ix.is_data_var(s):
                names[s] = self._data_var(s, scope)
        return self.print_index(e, self.IDX, names)

    def _data_var(self, g, scope: Scope) -> str:
        target = self._target(self.deps(self.data[g]), scope)
        for s in target.chain():
            if g in s.names:
                return s.names[g]
        val = self.value(self.data[g], target)
        name = f"{g}_{self.count}"
        self.count += 1
        target.lines.append(f"{target.ind}const {self.IDX} {name} = ({self.IDX})({val});")
        extent = self.extents.get(g)
        if extent is not None:   # ATen raises on an index out of range; so does the kernel
            bound = self.print_index(extent, self.IDX, {})
            target.lines.append(f"{target.ind}if ((unsigned long long){name} >= "
                                f"(unsigned long long)({bound})) __trap();  // index out of range")
        target.names[g] = name
        return name

    @staticmethod
    def print_index(e: sympy.Expr, IDX: str, names: dict) -> str:
        def p(x) -> str:
            if x.is_Integer:
                v = int(x)
                s = f"{v}LL" if abs(v) > 2 ** 31 - 1 and IDX == "long long" else str(v)
                return s if v >= 0 else f"({s})"
            if x.is_Symbol:
                return names.get(x, str(x))
            if x.is_Add:
                return "(" + " + ".join(p(a) for a in x.args) + ")"
            if x.is_Mul:
                return "(" + " * ".join(p(a) for a in x.args) + ")"
            if x.is_Pow and x.exp.is_Integer and x.exp > 0:
                return "(" + " * ".join([p(x.base)] * int(x.exp)) + ")"
            if isinstance(x, ix.FDiv):
                return f"({p(x.args[0])} / {p(x.args[1])})"
            if isinstance(x, ix.IMod):
                return f"({p(x.args[0])} % {p(x.args[1])})"
            name = type(x).__name__
            if name in ("FloorDiv", "CleanDiv", "IntTrueDiv") and len(x.args) == 2:
                return f"({p(x.args[0])} / {p(x.args[1])})"
            if name == "ModularIndexing":
                return f"(({p(x.args[0])} / {p(x.args[1])}) % {p(x.args[2])})"
            if name in ("Mod", "PythonMod") and len(x.args) == 2:
                return f"({p(x.args[0])} % {p(x.args[1])})"
            if name == "CeilDiv":
                a, b = p(x.args[0]), p(x.args[1])
                return f"(({a} + {b} - 1) / {b})"
            if name in ("Max", "Min"):
                fn = "max" if name == "Max" else "min"
                out = p(x.args[0])
                for a in x.args[1:]:
                    out = f"{fn}(({IDX}){out}, ({IDX}){p(a)})"
                return out
            raise Unsupported(f"cannot print the size expression {x} ({name}) as C")
        return p(sympy.sympify(e))

    # -- values --------------------------------------------------------------------------
    def value(self, e: Expr, scope: Scope) -> str:
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        if isinstance(e, SizeVal):
            return f"(({compute_ctype(e.dtype)})({self.print_index(e.expr, self.IDX, {})}))"
        if isinstance(e, RedRef):
            return f"(({compute_ctype(e.dtype)}){self.red_names[(e.rid, e.part)]})"
        if self.value_uses and e in self.value_uses:
            return self.value_uses[e]
        for s in scope.chain():
            if e in s.names:
                return s.names[e]
        if self.chunk is not None and isinstance(e, Op) and e.name == "where":
            picked = self._vector_pick(e)
            if picked is not None:
                return picked
        target = self._target(self.deps(e), scope)
        target = self._inside_branch(e, scope, target)
        if isinstance(e, Op) and e.name == "where" and self._lazy(e):
            return self._branches(e, target)
        text, trivial = self._c(e, target)
        if not trivial:
            name = f"t{self.count}"
            self.count += 1
            target.lines.append(f"{target.ind}const {compute_ctype(e.dtype)} {name} = {text};")
            target.names[e] = text = name
        if self.fills and e in self.fills:
            target.lines.append(f"{target.ind}{self.fills[e]} = {text};")
        return text

    # -- branches: a where on the position loads only the side it takes ---------------
    def _reads_memory(self, e: Expr) -> bool:
        """Whether evaluating ``e`` loads from memory (a load not already in a register)."""
        if isinstance(e, Load):
            return e not in self.overrides
        if isinstance(e, Op):
            return any(self._reads_memory(a) for a in e.args)
        if isinstance(e, Cast):
            return self._reads_memory(e.x)
        return False

    def _lazy(self, e: Op) -> bool:
        """A ``where`` is emitted as an ``if`` when its condition reads no memory (a
        position, as a concatenation's or a padding's) and a side does: only the side
        taken is loaded. Not in the persistent-row passes, whose register fills must run
        for every element."""
        if self.fills or self.value_uses:
            return False
        cond, a, b = e.args
        return not self._reads_memory(cond) and (self._reads_memory(a) or self._reads_memory(b))

    def _inside_branch(self, e: Expr, scope: Scope, target: Scope) -> Scope:
        """A value that reads memory stays inside the innermost branch it is asked for in
        (declared where its loop variables are, it would be loaded unconditionally)."""
        inner = scope.branch
        if inner is None or target not in inner.parent.chain() or not self._reads_memory(e):
            return target
        return inner

    def _branches(self, e: Op, target: Scope) -> str:
        """``if (c1) {..} else if (c2) {..} else {..}`` along a chain of lazy wheres (a
        concatenation of many inputs is one such chain); the conditions, which read no
        memory, are evaluated first."""
        chain, rest = [], e
        while isinstance(rest, Op) and rest.name == "where" and self._lazy(rest) and (
                not chain or not any(rest in s.names for s in target.chain())):
            chain.append((self.value(rest.args[0], target), rest.args[1]))
            rest = rest.args[2]
        name = f"t{self.count}"
        self.count += 1
        ind = target.ind
        lines = [f"{ind}{compute_ctype(e.dtype)} {name};"]
        for i, (cond, side) in enumerate(chain + [(None, rest)]):
            sc = Scope(target, (), ind + "  ")
            sc.branch = sc
            text = self.value(side, sc)
            head = "if" if i == 0 else "} else if" if cond is not None else "} else"
            lines.append(f"{ind}{head} ({cond}) {{" if cond is not None else f"{ind}{head} {{")
            lines += sc.render() + [f"{ind}  {name} = {text};"]
        target.lines += lines + [f"{ind}}}"]
        target.names[e] = name
        return name

    def _vector_pick(self, e: Op) -> str | None:
        """A chain of wheres over the chunk's vector loads (a concatenation along a dim
        other than the chunk's) whose conditions read no memory and are the same for
        every lane: the chunk loads the picked vector only, and each lane reads its
        element (None where the chain is not of that form)."""
        ch = self.chunk
        if e in ch.picked:
            return ch.picked[e]
        conds, loads, rest = [], [], e
        while isinstance(rest, Op) and rest.name == "where":
            conds.append(rest.args[0])
            loads.append(rest.args[1])
            rest = rest.args[2]
        loads.append(rest)
        if not all(isinstance(ld, Load) and ld in ch.loads for ld in loads):
            return None
        if len({self.k.ptr[ld.buf] for ld in loads}) != 1:
            return None
        lane_vars = {ch.var, sympy.Symbol("v")}
        if any(self._reads_memory(c) or self.deps(c) & lane_vars for c in conds):
            return None
        scope, ind, b0 = ch.scope, ch.scope.ind, sympy.Symbol(f"{ch.var}_0")
        saved, self.overrides = self.overrides, {}
        texts = [self.value(c, scope) for c in conds]
        name = f"vpick{self.count}"
        self.count += 1
        lines = [f"{ind}sfk_vec<{self.k.ptr[loads[0].buf]}, {ch.vec}> {name};"]
        for i, ld in enumerate(loads):
            off = self.index(ld.offset.xreplace({ch.var: b0}), scope)
            head = (f"if ({texts[i]})" if i == 0 else
                    f"else if ({texts[i]})" if i < len(conds) else "else")
            lines.append(f"{ind}{head} {name} = sfk_ldv<{ch.vec}>({ld.buf} + {off});")
        self.overrides = saved
        scope.lines += lines
        ch.picked[e] = f"sfk_val({name}.v[v])"
        return ch.picked[e]

    def _c(self, e: Expr, scope: Scope) -> tuple[str, bool]:
        if isinstance(e, Load):
            if e in self.overrides:
                return self.overrides[e], True
            return f"sfk_val({e.buf}[{self.index(e.offset, scope)}])", False
        if isinstance(e, IndexVal):
            return f"(({compute_ctype(e.dtype)})({self.index(e.expr, scope)}))", False
        if isinstance(e, Cast):
            return self._cast(e, scope)
        if isinstance(e, Op):
            args = [self.value(a, scope) for a in e.args]
            return self._op(e, args), False
        raise Unsupported(f"cannot emit {type(e).__name__}")

    def _cast(self, e: Cast, scope: Scope) -> tuple[str, bool]:
        a = self.value(e.x, scope)
        src, dst = e.x.dtype, e.dtype
        if dst == torch.float16:
            return f"sfk_round_f16({a if compute_ctype(src) == 'float' else f'(float)({a})'})", False
        if dst == torch.bfloat16:
            return f"sfk_round_bf16({a if compute_ctype(src) == 'float' else f'(float)({a})'})", False
        ct = compute_ctype(dst)
        if ct == compute_ctype(src):
            return a, True
        if dst == torch.bool:
            return f"(({a}) != 0)", False
        return f"(({ct})({a}))", False

    def _op(self, e: Op, a: list[str]) -> str:
        n, ct = e.name, compute_ctype(e.dtype)
        fp = ct in ("float", "double")
        dbl = ct == "double"
        wrap = (lambda s: f"(({ct}){s})") if ct in SMALL_INTS else (lambda s: s)
        if n in ("add", "sub", "mul"):
            op = {"add": "+", "sub": "-", "mul": "*"}[n]
            return wrap(f"({a[0]} {op} {a[1]})")
        if n == "div":
            return f"({a[0]} / {a[1]})"
        if n == "div_trunc":
            return (f"{'trunc' if dbl else 'truncf'}({a[0]} / {a[1]})" if fp else f"({a[0]} / {a[1]})")
        if n == "div_floor":
            return f"sfk_div_floor({a[0]}, {a[1]})"
        if n == "fmod":
            return f"{'fmod' if dbl else 'fmodf'}({a[0]}, {a[1]})" if fp else f"({a[0]} % {a[1]})"
        if n == "remainder":
            return f"sfk_remainder({a[0]}, {a[1]})"
        if n == "pow":
            return self._pow(e, a, ct)
        if n in ("maximum", "minimum"):
            return f"sfk_{n}({a[0]}, {a[1]})"
        if n in _MATH2:
            return f"{_MATH2[n][1 if dbl else 0]}({a[0]}, {a[1]})"
        if n in _CMP:
            return f"({a[0]} {_CMP[n]} {a[1]})"
        if n == "logical_and":
            return f"(({a[0]}) && ({a[1]}))"
        if n == "logical_or":
            return f"(({a[0]}) || ({a[1]}))"
        if n == "logical_xor":
            return f"((bool)({a[0]}) != (bool)({a[1]}))"
        if n in ("bitwise_and", "bitwise_or", "bitwise_xor"):
            op = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}[n]
            return f"(({ct})({a[0]} {op} {a[1]}))"
        if n == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if n == "exp" and self.fast and ct == "float":
            return f"__expf({a[0]})"   # codegen/fast_math.py
        if n in _MATH:
            return f"{_MATH[n][1 if dbl else 0]}({a[0]})"
        one = "1.0" if dbl else "1.0f"
        simple = {
            "neg": wrap(f"(-{a[0]})"), "abs": f"sfk_abs({a[0]})", "reciprocal": f"({one} / {a[0]})",
            "sigmoid": f"sfk_sigmoid({a[0]})", "relu": f"sfk_relu({a[0]})",
            "sign": f"sfk_sign({a[0]})", "gelu_erf": f"sfk_gelu_erf({a[0]})",
            "gelu_tanh": f"sfk_gelu_tanh({a[0]})",
            "frac": f"({a[0]} - {'trunc' if dbl else 'truncf'}({a[0]}))",
            "logical_not": f"(!({a[0]}))",
        }
        if n in simple:
            return simple[n]
        src = compute_ctype(e.args[0].dtype)
        if n == "isnan":
            return f"({a[0]} != {a[0]})" if src in ("float", "double") else "false"
        if n in ("isinf", "isfinite", "signbit"):
            if src in ("float", "double"):
                return f"{n}({a[0]})"
            return {"isinf": "false", "isfinite": "true", "signbit": f"({a[0]} < 0)"}[n]
        if n == "bitwise_not":
            return f"(!({a[0]}))" if ct == "bool" else f"(({ct})(~{a[0]}))"
        if n == "leaky_relu":
            s = literal(e.params[0], e.dtype)
            return f"({a[0]} > 0 ? {a[0]} : {a[0]} * {s})"
        if n == "elu":
            alpha, scale, iscale = e.params
            f32 = torch.float32 if not dbl else torch.float64
            neg = float(torch.tensor(alpha, dtype=f32) * torch.tensor(scale, dtype=f32))
            return (f"({a[0]} > 0 ? {a[0]} * {literal(scale, e.dtype)} : "
                    f"{'expm1' if dbl else 'expm1f'}({a[0]} * {literal(iscale, e.dtype)}) * "
                    f"{literal(neg, e.dtype)})")
        raise Unsupported(f"the CUDA emitter has no rule for op {n}")

    def _pow(self, e: Op, a, ct) -> str:
        dbl = ct == "double"
        exp = e.args[1]
        if isinstance(exp, Const):
            v = float(exp.value)
            one = "1.0" if dbl else "1.0f"
            special = {
                2.0: f"({a[0]} * {a[0]})", 3.0: f"({a[0]} * {a[0]} * {a[0]})",
                0.5: f"{'sqrt' if dbl else 'sqrtf'}({a[0]})",
                -0.5: f"{'rsqrt' if dbl else 'rsqrtf'}({a[0]})",
                -1.0: f"({one} / {a[0]})", -2.0: f"({one} / ({a[0]} * {a[0]}))",
                1.0: a[0], 0.0: one,
            }
            if v in special:
                return special[v]
        return f"{'pow' if dbl else 'powf'}({a[0]}, {a[1]})"


# ----------------------------------------------------------------------------- vectors


def _term_coeff(term: sympy.Expr) -> sympy.Expr | None:
    """The factor of ``term`` that holds no loop/data variable (its 'stride')."""
    coeff = sympy.Integer(1)
    for f in sympy.Mul.make_args(term):
        syms = f.free_symbols
        if not any(ix.is_loop_var(s) or ix.is_data_var(s) for s in syms):
            coeff = coeff * f
    return coeff


def along(offset: sympy.Expr, var) -> bool:
    """Whether ``offset`` steps by one element with ``var`` (and reads no data), so that
    consecutive ``var`` are consecutive addresses: a vector access may cover them."""
    if any(ix.is_data_var(s) for s in offset.free_symbols):
        return False
    for f in offset.atoms(ix.FDiv, ix.IMod):
        if var in f.free_symbols:
            return False
    return sympy.expand(sympy.diff(offset, var)) == 1


def eligible_vector_access(k, var, extent, loads, stores):
    """(VEC, {Load: name}, {Store: name}, runtime conditions) for a vector path over ``var``."""
    if var is None:
        return 1, {}, {}, []
    cand_loads = [ld for ld in dict.fromkeys(loads) if along(ld.offset, var)]
    cand_stores = [st for st in stores if not st.guards and along(st.offset, var)]
    while True:
        sizes = [itemsize(ld.dtype) for ld in cand_loads]
        sizes += [itemsize(k.ir.outputs[st.out].dtype) for st in cand_stores]
        if not sizes:
            return 1, {}, {}, []
        vec = max(1, 16 // max(sizes))
        if vec == 1:
            return 1, {}, {}, []
        conds: list[str] = []

        def divisible(offset) -> bool:
            rest = sympy.expand(offset - var)
            for t in sympy.Add.make_args(rest):
                c = _term_coeff(t)
                if c.is_Integer:
                    if int(c) % vec:
                        return False
                elif c.free_symbols:
                    conds.append(f"(({ExprEmitter.print_index(c, k.IDX, {})}) % {vec} == 0)")
                else:
                    return False
            return True
        keep_l = [ld for ld in cand_loads if divisible(ld.offset)]
        keep_s = [st for st in cand_stores if divisible(st.offset)]
        if len(keep_l) == len(cand_loads) and len(keep_s) == len(cand_stores):
            break
        cand_loads, cand_stores = keep_l, keep_s
    ext = sympy.sympify(extent)
    if ext.is_Integer:
        if int(ext) % vec:
            return 1, {}, {}, []
    else:
        conds.append(f"(({ExprEmitter.print_index(ext, k.IDX, {})}) % {vec} == 0)")
    vloads, vstores = {}, {}
    for j, ld in enumerate(cand_loads):
        vloads[ld] = f"v{ld.buf}_{j}"
    for j, st in enumerate(cand_stores):
        vstores[st] = f"vout{st.out}_{j}"
    bufs = {ld.buf: itemsize(ld.dtype) for ld in cand_loads}
    bufs.update({k.out_names[st.out]: itemsize(k.ir.outputs[st.out].dtype) for st in cand_stores})
    for name, size in bufs.items():
        conds.append(f"sfk_aligned({name}, {vec * size})")
    return vec, vloads, vstores, list(dict.fromkeys(conds))
