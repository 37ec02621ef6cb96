"""KernelIR -> readable CUDA C++ (one ``extern "C" __global__`` kernel per region).

Two templates:
  * pointwise: a grid-stride loop over the output space; when every vectorisable tensor
    is aligned (checked at run time) the loop moves 16 bytes per tensor per step. When
    the stores are contiguous along one index and the loads along another (a layout
    conversion such as NHWC -> NCHW), the ``tiled`` variant moves 32 x 32 tiles through
    shared memory so that both the loads and the stores are coalesced;
  * reduction: rows x reduce. A group of TK threads (TK = 2^log2_tk, a launch
    argument) owns one row; ``inner`` layout when the reduced index is contiguous in
    memory (threads of a group are consecutive lanes: shuffles), ``column`` layout when a
    row index is (consecutive threads take consecutive rows: coalesced). Each phase of
    reductions is one pass over the row; results are combined by ``sfk_group_reduce``
    (fixed trees, no atomics) and used by later phases and by the stores. Reductions
    across rows (``outer``) write one value per row to a workspace; the last block to
    finish (an integer atomic ticket) reduces the workspace in a fixed order.

Each thread walks its row in chunks of VEC elements in both the vector and the scalar
path, so the result never depends on the pointers' alignment: runs are bit-identical.
Expressions are emitted once (CSE) at the outermost loop level whose variables they use.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .emit_expr import CTYPE, ExprEmitter, Scope, compute_ctype, eligible_vector_access
from . import indexing as ix
from .kernel_ir import KernelIR, Load, Reduction, Store, Unsupported, walk

INIT = {
    "sum": lambda t: "0", "prod": lambda t: "1", "any": lambda t: "false", "all": lambda t: "true",
}


@dataclass(frozen=True)
class Emitted:
    """A kernel's source and what its launcher must know."""

    source: str
    entry: str
    signature: str
    kind: str  # "pointwise" or "reduction"
    layout: str  # "inner", "column" or "" (pointwise)
    vec: int
    idx64: bool
    workspaces: tuple[tuple[str, torch.dtype], ...]  # (name, dtype) of per-row outer buffers
    arg_names: tuple[str, ...]


def _init_value(r: Reduction, ct: str) -> str:
    if r.kind in INIT:
        return INIT[r.kind](ct)
    big = {"float": "SFK_INF_F", "double": "SFK_INF_D"}.get(ct)
    if big is None:
        big = f"((({ct})~0ull) >> 1)" if ct in ("long long", "int", "short", "signed char") else \
            f"(({ct})~0ull)"
        small = f"(-{big} - 1)" if ct in ("long long", "int", "short", "signed char") else "0"
    else:
        small = f"(-{big})"
    if r.kind in ("max", "argmax"):
        v = small
    else:
        v = big
    if r.kind in ("argmax", "argmin"):
        return f"sfk_argpair<{ct}>{{{v}, 0x7fffffffffffffffLL}}"
    return v


def _op_functor(r: Reduction, ct: str) -> str:
    return {
        "sum": f"sfk_op_sum<{ct}>()", "prod": f"sfk_op_prod<{ct}>()",
        "max": f"sfk_op_max<{ct}>()", "min": f"sfk_op_min<{ct}>()",
        "any": "sfk_op_any()", "all": "sfk_op_all()",
        "argmax": f"sfk_op_arg<{ct}, true>()", "argmin": f"sfk_op_arg<{ct}, false>()",
    }[r.kind]


def _acc_ctype(r: Reduction) -> str:
    ct = compute_ctype(r.dtype)
    return f"sfk_argpair<{ct}>" if r.kind in ("argmax", "argmin") else ct


def _fits_int32(ir: KernelIR) -> bool:
    if ir.symbols:
        return False
    # headroom: grid-stride loops step past the end by up to grid * block * VEC (< 2^24)
    limit = 2 ** 31 - 2 ** 24
    total = 1
    for e in ir.domain.row_extents + ir.domain.red_extents:
        total *= int(e)
    if total >= limit:
        return False
    for arg in ir.inputs + ir.outputs:
        span = sum((int(s) - 1) * abs(int(st)) for s, st in zip(arg.shape, arg.stride))
        if span >= limit:
            return False
    return not ir.data_vars  # gathered indices come from 64-bit loads


class _Kernel:
    def __init__(self, ir: KernelIR):
        self.ir = ir
        self.idx64 = not _fits_int32(ir)
        self.IDX = "long long" if self.idx64 else "int"
        self.data = dict(ir.data_vars)
        self.ptr = {a.name: CTYPE[a.dtype] for a in ir.inputs + ir.outputs}
        self.out_names = {a.position: a.name for a in ir.outputs}
        self.lines: list[str] = []

    # -- header / signature -------------------------------------------------------------
    def signature(self, extra_ptrs, launch_args):
        params, sig, names = [], "", []
        for a in self.ir.inputs:
            params.append(f"const {CTYPE[a.dtype]}* __restrict__ {a.name}")
            sig += "p"
            names.append(a.name)
        for a in self.ir.outputs:
            params.append(f"{CTYPE[a.dtype]}* __restrict__ {a.name}")
            sig += "p"
            names.append(a.name)
        for decl, name in extra_ptrs:
            params.append(decl)
            sig += "p"
            names.append(name)
        for b in self.ir.symbols:
            params.append(f"long long arg_{b.symbol}")
            sig += "l"
            names.append(str(b.symbol))
        for decl, code, name in launch_args:
            params.append(decl)
            sig += code
            names.append(name)
        return params, sig, tuple(names)

    def header(self, strategy: str) -> list[str]:
        ops = []
        for o in self.ir.ops:
            if o not in ops:
                ops.append(o)
        d = self.ir.domain
        return [
            f"// Region {self.ir.name}: one fused kernel ({strategy}).",
            "// Fused ATen ops: " + ", ".join(ops) if ops else "// Fused ATen ops: (copies/views only)",
            f"// Iteration space: rows {list(map(str, d.row_extents))}"
            + (f" x reduce {list(map(str, d.red_extents))}" if d.red_vars else ""),
            "// Generated by stitch_backend.codegen.emit_cuda; fp32 math for fp16/bf16 values,",
            "// rounded wherever eager rounds.",
            '#include "fused_ops.cuh"',
            "#pragma nv_diag_suppress 177  // index variables of the generic loop nest may go unused",
            "",
        ]

    def symbol_prologue(self, ind: str) -> list[str]:
        return [f"{ind}const {self.IDX} {b.symbol} = ({self.IDX})arg_{b.symbol};" for b in self.ir.symbols]

    def c_size(self, e) -> str:
        return ExprEmitter.print_index(sympy.sympify(e), self.IDX, {})

    def delinearize(self, lin: str, vars_, extents, ind: str) -> list[str]:
        out = []
        if not vars_:
            return out
        if len(vars_) == 1:
            return [f"{ind}const {self.IDX} {vars_[0]} = {lin};"]
        cur = lin
        for j in range(len(vars_) - 1, 0, -1):
            e = self.c_size(extents[j])
            out.append(f"{ind}const {self.IDX} {vars_[j]} = {cur} % {e};")
            nxt = f"t_{vars_[j]}"
            out.append(f"{ind}const {self.IDX} {nxt} = {cur} / {e};")
            cur = nxt
        out.append(f"{ind}const {self.IDX} {vars_[0]} = {cur};")
        return out


# ============================================================================ pointwise


def _emit_pointwise(ir: KernelIR) -> Emitted:
    k = _Kernel(ir)
    d = ir.domain
    vars_ = list(d.row_vars)
    tiled = transpose_axes(ir)
    if tiled is not None:
        return _emit_tiled(k, ir, *tiled)
    inner = vars_[-1] if vars_ else None
    loads = [n for n in ir.all_exprs() if isinstance(n, Load)]
    stores = [s for s in ir.stores]
    vec, vloads, vstores, conds = eligible_vector_access(
        k, inner, d.row_extents[-1] if vars_ else None, loads, stores)
    params, sig, names = k.signature([], [])
    L = k.lines
    L += k.header("pointwise" + (f", {vec}-wide vector path" if vec > 1 else ""))
    L.append(f'extern "C" __global__ void __launch_bounds__(256) {ir.name}(')
    L.append("    " + ",\n    ".join(params) + ") {")
    L += k.symbol_prologue("  ")
    total = " * ".join(f"({k.c_size(e)})" for e in d.row_extents) or "1"
    L.append(f"  const {k.IDX} n = {total};")
    L.append(f"  const {k.IDX} step = ({k.IDX})gridDim.x * blockDim.x;")
    L.append(f"  const {k.IDX} first = ({k.IDX})blockIdx.x * blockDim.x + threadIdx.x;")
    root = None
    if vec > 1:
        L.append(f"  const bool vec_ok = {' && '.join(conds) or 'true'};")
        L.append("  if (vec_ok) {")
        L += _pointwise_body(k, ir, vars_, vec, vloads, vstores, "    ", root)
        L.append("    return;")
        L.append("  }")
    L += _pointwise_body(k, ir, vars_, 1, {}, {}, "  ", root)
    L.append("}")
    return Emitted("\n".join(L) + "\n", ir.name, sig, "pointwise", "", vec, k.idx64, (), names)


# A transposing region is tiled when both of its tile axes are at least this long.
TILE = 32
TILE_ROWS = 8      # the block is TILE x TILE_ROWS threads: each moves TILE / TILE_ROWS


def transpose_axes(ir: KernelIR) -> tuple[sympy.Symbol, sympy.Symbol] | None:
    """(store axis, load axis) when ``ir`` is a pointwise region whose stores are all
    contiguous along its innermost index and whose loads are contiguous along another
    and none along the innermost (a layout conversion): read coalesced, write coalesced
    through a shared-memory tile. None where the plain template is as good."""
    d = ir.domain
    if ir.symbols or ir.data_vars or len(d.row_vars) < 2:
        return None
    ext = dict(zip(d.row_vars, d.row_extents))
    a = d.row_vars[-1]

    def stride(offset: sympy.Expr, var) -> int | None:
        if any(var in f.free_symbols for f in offset.atoms(ix.FDiv, ix.IMod)):
            return None
        c = sympy.expand(sympy.diff(offset, var))
        return int(c) if c.is_Integer else None

    if not ir.stores or any(st.guards or stride(st.offset, a) != 1 for st in ir.stores):
        return None
    loads = [n for n in dict.fromkeys(ir.all_exprs()) if isinstance(n, Load)]
    if not loads or any(stride(ld.offset, a) not in (0,) and abs(stride(ld.offset, a) or 1) <= 1
                        for ld in loads):
        return None                  # a load is contiguous (or unknown) along the stores'
    votes: dict = {}
    for ld in loads:
        for b in d.row_vars[:-1]:
            if stride(ld.offset, b) == 1:
                votes[b] = votes.get(b, 0) + 1
    if not votes:
        return None
    b = max(votes, key=lambda v: votes[v])
    if int(ext[a]) < TILE or int(ext[b]) < TILE:
        return None
    return a, b


def _emit_tiled(k: _Kernel, ir: KernelIR, a: sympy.Symbol, b: sympy.Symbol) -> Emitted:
    """The transposing pointwise template: each block takes TILE x TILE tiles of the
    (load axis, store axis) plane in a grid-stride loop; threads along the load axis
    compute the values into shared memory, threads along the store axis write them."""
    d = ir.domain
    ext = dict(zip(d.row_vars, d.row_extents))
    others = [v for v in d.row_vars if v not in (a, b)]
    params, sig, names = k.signature([], [])
    IDX = k.IDX
    L = k.lines
    L += k.header(f"pointwise, tiled {TILE}x{TILE} through shared memory: loads contiguous "
                  f"along {b}, stores along {a}")
    L.append(f'extern "C" __global__ void __launch_bounds__({TILE * TILE_ROWS}) {ir.name}(')
    L.append("    " + ",\n    ".join(params) + ") {")
    for i, st in enumerate(ir.stores):
        L.append(f"  __shared__ {k.ptr[k.out_names[st.out]]} tile{i}[{TILE}][{TILE + 1}];")
    L.append(f"  const {IDX} n_a = {k.c_size(ext[a])}, n_b = {k.c_size(ext[b])};")
    L.append(f"  const {IDX} tiles_a = (n_a + {TILE - 1}) / {TILE}, "
             f"tiles_b = (n_b + {TILE - 1}) / {TILE};")
    rest = " * ".join(f"({k.c_size(ext[v])})" for v in others) or "1"
    L.append(f"  const {IDX} tiles = tiles_a * tiles_b * {rest};")
    L.append(f"  const int tx = threadIdx.x % {TILE}, ty = threadIdx.x / {TILE};")
    L.append(f"  for ({IDX} t = blockIdx.x; t < tiles; t += gridDim.x) {{")
    L.append(f"    const {IDX} a0 = (t % tiles_a) * {TILE};")
    L.append(f"    const {IDX} t_a = t / tiles_a;")
    L.append(f"    const {IDX} b0 = (t_a % tiles_b) * {TILE};")
    L.append(f"    const {IDX} t_b = t_a / tiles_b;")
    tile = Scope(None, set(others), "    ")
    tile.pre += k.delinearize("t_b", others, [ext[v] for v in others], "    ")
    em = ExprEmitter(k, ir)
    load = Scope(tile, {a, b}, "      ")
    load.pre += [f"      const {IDX} {a} = a0 + j;", f"      const {IDX} {b} = b0 + tx;"]
    for i, st in enumerate(ir.stores):
        val = em.value(st.value, load)
        load.lines.append(f"      tile{i}[j][tx] = sfk_cvt<{k.ptr[k.out_names[st.out]]}>({val});")
    store = Scope(tile, {a, b}, "      ")
    store.pre += [f"      const {IDX} {a} = a0 + tx;", f"      const {IDX} {b} = b0 + j;"]
    for i, st in enumerate(ir.stores):
        off = em.index(st.offset, store)
        store.lines.append(f"      {k.out_names[st.out]}[{off}] = tile{i}[tx][j];")
    L += tile.render()
    for phase, guard in ((load, "a0 + j < n_a && b0 + tx < n_b"),
                         (store, "a0 + tx < n_a && b0 + j < n_b")):
        L.append(f"    for (int j = ty; j < {TILE}; j += {TILE_ROWS}) {{")
        L.append(f"      if (!({guard})) continue;")
        L += phase.render()
        L.append("    }")
        L.append("    __syncthreads();")
    L.append("  }")
    L.append("}")
    return Emitted("\n".join(L) + "\n", ir.name, sig, "pointwise", "tiled", 1, k.idx64, (),
                   names)


def _pointwise_body(k: _Kernel, ir, vars_, vec, vloads, vstores, ind, root) -> list[str]:
    lines = []
    IDX = k.IDX
    loop_var = "l0" if vec > 1 else "l"
    if vec > 1:
        lines.append(f"{ind}for ({IDX} l0 = first * {vec}; l0 < n; l0 += step * {vec}) {{")
    else:
        lines.append(f"{ind}for ({IDX} l = first; l < n; l += step) {{")
    body = Scope(root, set(vars_[:-1] if vec > 1 else vars_), ind + "  ")
    extents = list(ir.domain.row_extents)
    if vec > 1:
        base = vars_[-1]
        b0 = sympy.Symbol(f"{base}_0")
        body.defined |= {b0}
        body.pre += k.delinearize(loop_var, vars_[:-1] + [b0], extents, ind + "  ")
    else:
        body.pre += k.delinearize(loop_var, vars_, extents, ind + "  ")
    em = ExprEmitter(k, ir)
    if vec > 1:
        _vector_chunk(k, em, body, vars_[-1], vec, vloads, vstores, ir.stores, ind + "  ")
    else:
        for st in ir.stores:
            _emit_store(k, em, body, st)
    lines += body.render()
    lines.append(f"{ind}}}")
    return lines


def _vector_chunk(k, em, scope, var, vec, vloads, vstores, stores, ind):
    """One VEC-wide chunk: vector loads, VEC unrolled element bodies, vector stores."""
    b0 = sympy.Symbol(f"{var}_0")
    for load, name in vloads.items():
        off = em.index(load.offset.xreplace({var: b0}), scope)
        scope.lines.append(f"{ind}const sfk_vec<{k.ptr[load.buf]}, {vec}> {name} = "
                           f"sfk_ldv<{vec}>({load.buf} + {off});")
    for st, name in vstores.items():
        scope.lines.append(f"{ind}sfk_vec<{k.ptr[k.out_names[st.out]]}, {vec}> {name};")
    inner = Scope(scope, {var, sympy.Symbol("v")}, ind + "  ")
    inner.pre.append(f"{ind}  const {k.IDX} {var} = {var}_0 + v;")
    em.overrides = {ld: f"sfk_val({name}.v[v])" for ld, name in vloads.items()}
    em.override_deps = {var, sympy.Symbol("v")}
    for st in stores:
        if st in vstores:
            val = em.value(st.value, inner)
            inner.lines.append(f"{inner.ind}{vstores[st]}.v[v] = sfk_cvt<{k.ptr[k.out_names[st.out]]}>({val});")
        else:
            _emit_store(k, em, inner, st)
    scope.lines += [f"{ind}#pragma unroll", f"{ind}for (int v = 0; v < {vec}; ++v) {{"]
    scope.lines += inner.render()
    scope.lines.append(f"{ind}}}")
    em.overrides, em.override_deps = {}, set()
    for st, name in vstores.items():
        off = em.index(st.offset.xreplace({var: b0}), scope)
        scope.lines.append(f"{ind}sfk_stv<{vec}>({k.out_names[st.out]} + {off}, {name});")


def _emit_store(k, em, scope, st: Store, cond: str = "") -> None:
    val = em.value(st.value, scope)
    off = em.index(st.offset, scope)
    guards = [f"({em.index(g, scope)}) == 0" for g in st.guards]
    if cond:
        guards.insert(0, cond)
    name = k.out_names[st.out]
    stmt = f"{name}[{off}] = sfk_cvt<{k.ptr[name]}>({val});"
    if guards:
        stmt = f"if ({' && '.join(guards)}) {stmt}"
    scope.lines.append(scope.ind + stmt)


# ============================================================================ reductions


def _layout(ir: KernelIR) -> str:
    d = ir.domain
    if not d.red_vars:
        return "inner"
    ref = None
    for r in ir.inner_reductions:
        for n in walk([r.body]):
            if isinstance(n, Load):
                if ref is None or len(n.offset.free_symbols) > len(ref.free_symbols):
                    ref = n.offset
    if ref is None:
        return "inner"
    kin = sympy.expand(sympy.diff(ref, d.red_vars[-1]))
    if kin == 1:
        return "inner"
    if d.row_vars and sympy.expand(sympy.diff(ref, d.row_vars[-1])) == 1:
        return "column"
    return "inner"


def _emit_reduction(ir: KernelIR) -> Emitted:
    k = _Kernel(ir)
    d = ir.domain
    layout = _layout(ir)
    outer = ir.outer_reductions
    for r in outer:
        if r.kind in ("argmax", "argmin"):
            raise Unsupported("argmax/argmin across rows")
    workspaces = tuple((f"ws{r.rid}", r.dtype) for r in outer)
    extra = [(f"{compute_ctype(dt)}* __restrict__ {n}", n) for n, dt in workspaces]
    if outer:
        extra.append(("unsigned int* __restrict__ sfk_ticket", "sfk_ticket"))
    params, sig, names = k.signature(extra, [("int log2_tk", "i", "log2_tk")])
    # Vector chunks run along the innermost reduced index; with several reduced indices
    # (BatchNorm's N and H*W) a chunk stays inside one run of it when its extent is a
    # multiple of the vector width, which eligible_vector_access checks.
    vector_red = bool(d.red_vars) and layout == "inner"
    elem_loads = [n for n in ir.all_exprs() if isinstance(n, Load)]
    elem_stores = [s for s in ir.stores if s.level == "element"]
    if vector_red:
        vec, vloads, vstores, conds = eligible_vector_access(
            k, d.red_vars[-1], d.red_extents[-1], elem_loads, elem_stores)
    else:
        vec, vloads, vstores, conds = 1, {}, {}, []
    L = k.lines
    L += k.header(f"row reduction, {layout} layout, chunks of {vec}"
                  + (", vector path" if vloads or vstores else "")
                  + (", cross-row reduction in the last block" if outer else ""))
    L.append(f'extern "C" __global__ void __launch_bounds__(1024) {ir.name}(')
    L.append("    " + ",\n    ".join(params) + ") {")
    L.append("  __shared__ __align__(16) unsigned char sfk_smem[16384];")
    L += k.symbol_prologue("  ")
    IDX = k.IDX
    rows = " * ".join(f"({k.c_size(e)})" for e in d.row_extents) or "1"
    red = " * ".join(f"({k.c_size(e)})" for e in d.red_extents) or "1"
    L.append(f"  const {IDX} rows = {rows};")
    L.append(f"  const {IDX} K = {red};")
    L.append("  const int TK = 1 << log2_tk, RB = blockDim.x >> log2_tk;")
    if layout == "inner":
        L.append("  const int tk = threadIdx.x & (TK - 1), tr = threadIdx.x >> log2_tk;")
    else:
        L.append("  const int tr = threadIdx.x % RB, tk = threadIdx.x / RB;")
    has_vec = bool(vloads or vstores)
    if has_vec:
        L.append(f"  const bool vec_ok = {' && '.join(conds) or 'true'};")
    L.append(f"  for ({IDX} row0 = ({IDX})blockIdx.x * RB; row0 < rows; row0 += ({IDX})gridDim.x * RB) {{")
    L.append("    const bool row_ok = row0 + tr < rows;")
    L.append(f"    const {IDX} r = row_ok ? row0 + tr : rows - 1;  // spare threads redo the last row")
    row = Scope(None, set(d.row_vars), "    ")
    row.pre += k.delinearize("r", list(d.row_vars), list(d.row_extents), "    ")
    if d.red_limit is not None:
        limit = ExprEmitter.print_index(d.red_limit, IDX, {})
        row.pre.append(f"    const {IDX} Kr = {limit};  // this row's share of the elements")
    else:
        row.pre.append(f"    const {IDX} Kr = K;")
    if has_vec:
        extra = f" && (Kr % {vec} == 0)" if d.red_limit is not None else ""
        row.pre.append(f"    const bool vec_row = vec_ok{extra};")
    em = ExprEmitter(k, ir)
    inner_flag = "true" if layout == "inner" else "false"
    phases = sorted({r.phase for r in ir.inner_reductions})
    for p in phases:
        reds = [r for r in ir.inner_reductions if r.phase == p]
        for r in reds:
            row.lines.append(f"    {_acc_ctype(r)} acc{r.rid} = {_init_value(r, compute_ctype(r.dtype))};")

        def body(scope, reds=reds):
            for r in reds:
                ct = compute_ctype(r.dtype)
                val = em.value(r.body, scope)
                if r.kind in ("argmax", "argmin"):
                    idx = em.index(r.index, scope)
                    val = f"sfk_argpair<{ct}>{{{val}, (long long)({idx})}}"
                scope.lines.append(f"{scope.ind}acc{r.rid} = {_op_functor(r, ct)}(acc{r.rid}, {val});")
        _k_loops(k, em, row, d, vec, vloads if has_vec else {}, {}, conds, body, has_vec, [])
        for r in reds:
            ct = compute_ctype(r.dtype)
            row.lines.append(f"    acc{r.rid} = sfk_group_reduce(acc{r.rid}, {_op_functor(r, ct)}, "
                             f"log2_tk, {inner_flag}, reinterpret_cast<{_acc_ctype(r)}*>(sfk_smem));")
            em.reduced(r, row, f"acc{r.rid}")
    for st in ir.stores:
        if st.level == "row":
            _emit_store(k, em, row, st, "row_ok && tk == 0")
    if elem_stores:
        _k_loops(k, em, row, d, vec, vloads if has_vec else {}, vstores if has_vec else {}, conds,
                 lambda scope: [_emit_store(k, em, scope, st) for st in elem_stores if st not in
                                (vstores if scope.vector else {})], has_vec, elem_stores)
    for r in outer:
        val = em.value(r.body, row)
        row.lines.append(f"    if (row_ok && tk == 0) ws{r.rid}[r] = {val};")
    L += row.render()
    L.append("  }")
    if outer:
        L += _outer_stage(k, ir, em)
    L.append("}")
    return Emitted("\n".join(L) + "\n", ir.name, sig, "reduction", layout, vec, k.idx64,
                   workspaces, names)


def _k_loops(k, em, row, d, vec, vloads, vstores, conds, body, has_vec, stores):
    """The pass over one row: chunks of ``vec`` per thread, vector and scalar variants.

    The loop text is collected apart and appended last, so row-level values that the
    body hoists into ``row`` land before the loop."""
    IDX = k.IDX
    variants = [True, False] if has_vec else [False]
    text: list[str] = []
    for vector in variants:
        ind = "      " if has_vec else "    "
        if has_vec:
            text.append("    if (vec_row) {" if vector else "    } else {")
        # unrolled so that several chunks' loads are in flight before the first is used
        text.append(f"{ind}#pragma unroll 4")
        text.append(f"{ind}for ({IDX} k0 = ({IDX})tk * {vec}; k0 < Kr; k0 += ({IDX})TK * {vec}) {{")
        chunk = Scope(row, {sympy.Symbol("k0")}, ind + "  ")
        chunk.vector = vector
        var = d.red_vars[-1] if d.red_vars else None
        if vector:
            # the chunk's outer reduced indices and the start of its innermost one
            b0 = sympy.Symbol(f"{var}_0")
            outer_vars = list(d.red_vars[:-1])
            chunk.defined |= {b0} | set(outer_vars)
            chunk.pre += k.delinearize("k0", outer_vars + [b0], list(d.red_extents), ind + "  ")
            _vector_chunk_red(k, em, chunk, var, vec, vloads, vstores, body, ind + "  ")
        else:
            cind = ind + "  "
            if vec > 1:
                el = Scope(chunk, set(d.red_vars) | {sympy.Symbol("v")}, cind + "    ")
                el.pre += k.delinearize("kk", list(d.red_vars), list(d.red_extents), cind + "    ")
                body(el)
                chunk.lines += [f"{cind}#pragma unroll", f"{cind}for (int v = 0; v < {vec}; ++v) {{",
                                f"{cind}  const {IDX} kk = k0 + v;", f"{cind}  if (kk < Kr) {{"]
                chunk.lines += el.render()
                chunk.lines += [f"{cind}  }}", f"{cind}}}"]
            else:
                el = Scope(chunk, set(d.red_vars), cind)
                el.pre += k.delinearize("k0", list(d.red_vars), list(d.red_extents), cind)
                body(el)
                chunk.lines += el.render()
        text += chunk.render()
        text.append(f"{ind}}}")
    if has_vec:
        text.append("    }")
    row.lines += text


def _vector_chunk_red(k, em, scope, var, vec, vloads, vstores, body, ind):
    b0 = sympy.Symbol(f"{var}_0")
    for load, name in vloads.items():
        off = em.index(load.offset.xreplace({var: b0}), scope)
        scope.lines.append(f"{ind}const sfk_vec<{k.ptr[load.buf]}, {vec}> {name} = "
                           f"sfk_ldv<{vec}>({load.buf} + {off});")
    for st, name in vstores.items():
        scope.lines.append(f"{ind}sfk_vec<{k.ptr[k.out_names[st.out]]}, {vec}> {name};")
    inner = Scope(scope, {var, sympy.Symbol("v")}, ind + "  ")
    inner.vector = True
    inner.pre.append(f"{ind}  const {k.IDX} {var} = {var}_0 + v;")
    em.overrides = {ld: f"sfk_val({name}.v[v])" for ld, name in vloads.items()}
    em.override_deps = {var, sympy.Symbol("v")}
    body(inner)
    for st, name in vstores.items():
        val = em.value(st.value, inner)
        inner.lines.append(f"{inner.ind}{name}.v[v] = sfk_cvt<{k.ptr[k.out_names[st.out]]}>({val});")
    scope.lines += [f"{ind}#pragma unroll", f"{ind}for (int v = 0; v < {vec}; ++v) {{"]
    scope.lines += inner.render()
    scope.lines.append(f"{ind}}}")
    em.overrides, em.override_deps = {}, set()
    for st, name in vstores.items():
        off = em.index(st.offset.xreplace({var: b0}), scope)
        scope.lines.append(f"{ind}sfk_stv<{vec}>({k.out_names[st.out]} + {off}, {name});")


def _outer_stage(k: _Kernel, ir: KernelIR, em) -> list[str]:
    L = ["  // Cross-row reductions: the last block to finish combines the per-row values",
         "  // in a fixed order (deterministic), then resets the ticket for the next launch.",
         "  __shared__ bool sfk_last;",
         "  __threadfence();",
         "  __syncthreads();",
         "  if (threadIdx.x == 0) sfk_last = atomicAdd(sfk_ticket, 1u) == gridDim.x - 1u;",
         "  __syncthreads();",
         "  if (!sfk_last) return;",
         "  __threadfence();",
         "  const int log2_bs = 31 - __clz((int)blockDim.x);",
         f"  const {k.IDX} rows_all = {' * '.join(f'({k.c_size(e)})' for e in ir.domain.row_extents) or '1'};"]
    scope = Scope(None, set(), "  ")
    for r in ir.outer_reductions:
        ct = compute_ctype(r.dtype)
        L.append(f"  {ct} oacc{r.rid} = {_init_value(r, ct)};")
        L.append(f"  for ({k.IDX} q = threadIdx.x; q < rows_all; q += blockDim.x) "
                 f"oacc{r.rid} = {_op_functor(r, ct)}(oacc{r.rid}, "
                 f"static_cast<const volatile {ct}*>(ws{r.rid})[q]);")
        L.append(f"  oacc{r.rid} = sfk_group_reduce(oacc{r.rid}, {_op_functor(r, ct)}, log2_bs, true, "
                 f"reinterpret_cast<{ct}*>(sfk_smem));")
        em.reduced(r, scope, f"oacc{r.rid}")
    body = Scope(scope, set(), "    ")
    for st in ir.stores:
        if st.level == "outer":
            _emit_store(k, em, body, st)
    L += scope.render()
    L.append("  if (threadIdx.x == 0) {")
    L += body.render()
    L.append("    *sfk_ticket = 0u;")
    L.append("  }")
    return L


def emit(ir: KernelIR) -> Emitted:
    """CUDA source for ``ir``; raises ``Unsupported`` for what the templates lack."""
    if ir.is_reduction:
        return _emit_reduction(ir)
    return _emit_pointwise(ir)


__all__ = ["Emitted", "emit"]
