"""KernelIR -> readable CUDA C++ (one ``extern "C" __global__`` kernel per region).

Two templates:
  * pointwise: a grid-stride loop over the output space; when every vectorisable tensor
    is aligned (checked at run time) the loop moves 16 bytes per tensor per step. When
    the stores are contiguous along one index and the loads along another (a layout
    conversion such as NHWC -> NCHW), the ``tiled`` variant moves 32 x 32 tiles through
    shared memory so that both the loads and the stores are coalesced;
  * reduction (``emit_reduction``): rows x reduce, a group of threads per row, results
    combined in fixed trees (no atomics); this module holds what both templates share.

Each thread walks its row in chunks of VEC elements in both the vector and the scalar
path, so the result never depends on the pointers' alignment: runs are bit-identical.
Expressions are emitted once (CSE) at the outermost loop level whose variables they use.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .emit_expr import CTYPE, ExprEmitter, IssuedLoad, Scope, VectorChunk, eligible_vector_access
from . import indexing as ix
from .kernel_ir import KernelIR, Load, Store, Unsupported


@dataclass(frozen=True)
class Emitted:
    """A kernel's source and what its launcher must know."""

    source: str
    entry: str
    signature: str
    kind: str  # "pointwise" or "reduction"
    layout: str  # "inner", "column", "staged", "tiled" or "" (pointwise)
    vec: int
    idx64: bool
    workspaces: tuple[tuple[str, torch.dtype], ...]  # (name, dtype) of per-row outer buffers
    arg_names: tuple[str, ...]
    max_threads: int = 1024   # its __launch_bounds__: the launch never exceeds it
    serial: bool = False      # a reduction whose rows take one thread each (short rows)
    cached_values: int = 0    # values its persistent rows keep in registers (cache_values)
    shared_mem: int = 0       # dynamic shared memory a block (the cluster layout's rows)


# The most rows a reduction's row loop steps at once: its grid (fused.MAX_ROW_BLOCKS at
# most) times the rows a block (1024 at most, one thread each).
ROW_STEP_MAX = 2 ** 30


def _fits_int32(ir: KernelIR) -> bool:
    if ir.symbols:
        return False
    # headroom: grid-stride loops step past the end by up to grid * block * VEC (< 2^24)
    limit = 2 ** 31 - 2 ** 24
    # The templates index rows and reduced elements separately (a row's delinearised
    # variables, then k), never by row * K + k, so each count must fit, not their product:
    # a pooling's rows times its window (L1's 805M rows of 8) no longer makes every index
    # 64-bit. What the offsets reach is bounded by the spans below. A reduction's row
    # loop steps by up to ROW_STEP_MAX rows (fused.MAX_ROW_BLOCKS blocks of up to 1024).
    row_limit = 2 ** 31 - ROW_STEP_MAX if ir.domain.red_extents else limit
    for extents, most in ((ir.domain.row_extents, row_limit), (ir.domain.red_extents, limit)):
        total = 1
        for e in extents:
            total *= int(e)
        if total >= most:
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
            *(["#define SFK_FAST_EXP 1  // fp32 exp as __expf (codegen/fast_math.py)"]
              if self.ir.fast_math else []),
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
    contiguous along its innermost index and whose loads are contiguous along another,
    more of them than along the innermost (a layout conversion): read coalesced, write
    coalesced through a shared-memory tile. None where the plain template is as good."""
    d = ir.domain
    if ir.symbols or ir.data_vars or len(d.row_vars) < 2:
        return None
    ext = dict(zip(d.row_vars, d.row_extents))
    a = d.row_vars[-1]

    def stride(offset: sympy.Expr, var) -> int | None:
        offset = ix.unclamped(offset)
        if any(var in f.free_symbols for f in offset.atoms(ix.FDiv, ix.IMod)):
            return None
        c = sympy.expand(sympy.diff(offset, var))
        return int(c) if c.is_Integer else None

    if not ir.stores or any(st.guards or stride(st.offset, a) != 1 for st in ir.stores):
        return None
    loads = [n for n in dict.fromkeys(ir.all_exprs()) if isinstance(n, Load)]
    # loads contiguous (or unknown) along the stores' axis; broadcast ones (0) are neither
    along_a = sum(1 for ld in loads
                  if stride(ld.offset, a) != 0 and abs(stride(ld.offset, a) or 1) <= 1)
    votes: dict = {}
    for ld in loads:
        for b in d.row_vars[:-1]:
            if stride(ld.offset, b) == 1:
                votes[b] = votes.get(b, 0) + 1
    if not votes:
        return None
    b = max(votes, key=lambda v: votes[v])
    # tiled where most loads run along another axis than the stores (a concatenation of
    # channels-last convolutions' outputs and the NCHW input, DenseNet's: the input's
    # reads stay uncoalesced, the rest become so)
    if votes[b] <= along_a or int(ext[a]) < TILE or int(ext[b]) < TILE:
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
    # a constant trip count, unrolled: a thread's TILE / TILE_ROWS loads are in flight
    # together instead of one after the other
    for phase, guard in ((load, "a0 + j < n_a && b0 + tx < n_b"),
                         (store, "a0 + tx < n_a && b0 + j < n_b")):
        L.append("    #pragma unroll")
        L.append(f"    for (int jj = 0; jj < {TILE // TILE_ROWS}; ++jj) {{")
        L.append(f"      const int j = ty + jj * {TILE_ROWS};")
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
        def element(inner):
            for st in ir.stores:
                if st in vstores:
                    _store_lane(k, em, inner, st, vstores[st])
                else:
                    _emit_store(k, em, inner, st)
        _vector_chunk(k, em, body, vars_[-1], vec, vloads, vstores, element, ind + "  ")
    else:
        for st in ir.stores:
            _emit_store(k, em, body, st)
    lines += body.render()
    lines.append(f"{ind}}}")
    return lines


def _vector_chunk(k, em, scope, var, vec, vloads, vstores, body, ind, cached=None,
                  slot="c_{name}[j]"):
    """One VEC-wide chunk along ``var``: vector loads, ``body(inner)`` for each of the
    VEC elements (it fills the ``vstores`` lanes through ``_store_lane``), vector stores.
    Both templates use it. ``cached`` (the reduction template's persistent rows): load
    name -> "fill" (load, and keep in the register array ``c_NAME[j]``) or "use" (read
    ``c_NAME[j]``, loaded by an earlier pass over the row); ``slot`` names where a kept
    chunk lives instead (the cluster layout's shared-memory rows)."""
    b0 = sympy.Symbol(f"{var}_0")
    cached = cached or {}
    loaded: dict[str, int] = {}      # vector name -> its line, dropped if this pass never reads it
    for load, name in vloads.items():
        vt = f"sfk_vec<{k.ptr[load.buf]}, {vec}>"
        if cached.get(name) == "use":
            scope.lines.append(f"{ind}const {vt} {name} = {slot.format(name=name)};")
            continue
        off = em.index(load.offset.xreplace({var: b0}), scope)
        value = raw = f"sfk_ldv<{vec}>({load.buf} + {off})"
        fill = None
        if cached.get(name) == "fill":
            fill = slot.format(name=name)
            value = f"({fill} = {value})"
        else:
            loaded[name] = len(scope.lines)
        scope.lines.append(f"{ind}const {vt} {name} = {value};")
        scope.issued.append(IssuedLoad(scope.lines[-1], name, vt, raw, fill))
    for st, name in vstores.items():
        scope.lines.append(f"{ind}sfk_vec<{k.ptr[k.out_names[st.out]]}, {vec}> {name};")
    inner = Scope(scope, {var, sympy.Symbol("v")}, ind + "  ")
    inner.vector = True
    inner.lanes = vec
    inner.pre.append(f"{ind}  const {k.IDX} {var} = {var}_0 + v;")
    em.overrides = {ld: f"sfk_val({name}.v[v])" for ld, name in vloads.items()}
    em.override_deps = {var, sympy.Symbol("v")}
    if not cached:   # (a persistent pass keeps every load's registers as they are)
        em.chunk = VectorChunk(scope, var, vec, dict(vloads))
    body(inner)
    em.chunk = None
    text = "\n".join(inner.render())
    unread = {loaded[n] for n in loaded if f"{n}.v[" not in text}
    scope.lines[:] = [line for i, line in enumerate(scope.lines) if i not in unread]
    scope.issued = [ld for ld in scope.issued if ld.line in scope.lines]
    scope.lines += [ind + line for line in inner.before_lanes]
    scope.lines += [f"{ind}#pragma unroll", f"{ind}for (int v = 0; v < {vec}; ++v) {{"]
    scope.lines += inner.render()
    scope.lines.append(f"{ind}}}")
    scope.lines += [ind + line for line in inner.after_lanes]
    em.overrides, em.override_deps = {}, set()
    for st, name in vstores.items():
        off = em.index(st.offset.xreplace({var: b0}), scope)
        scope.lines.append(f"{ind}sfk_stv<{vec}>({k.out_names[st.out]} + {off}, {name});")


def _store_lane(k, em, inner, st: Store, name: str) -> None:
    """Lane ``v`` of vector store ``name``: the value of ``st`` for this element."""
    val = em.value(st.value, inner)
    inner.lines.append(f"{inner.ind}{name}.v[v] = sfk_cvt<{k.ptr[k.out_names[st.out]]}>({val});")


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


def emit(ir: KernelIR, layout: str | None = None, cache_values: bool = False,
         peel: bool = False) -> Emitted:
    """CUDA source for ``ir``; raises ``Unsupported`` for what the templates lack.
    ``layout`` forces a reduction's thread layout ("inner", "column" or "staged");
    ``cache_values`` its persistent rows' register arrays of values, not loads (a
    pointwise kernel, one pass, has nothing to keep); ``peel`` a row reduction's vector
    path over rows that start anywhere (``peel``)."""
    if ir.is_reduction:
        from .emit_reduction import emit_reduction   # it builds on this module's _Kernel

        return emit_reduction(ir, layout, cache_values, peel)
    if layout is not None:
        raise ValueError(f"a pointwise region has no reduction layout ({layout!r})")
    if peel:
        raise Unsupported("a pointwise kernel has no rows to peel")
    return _emit_pointwise(ir)


__all__ = ["Emitted", "emit"]
