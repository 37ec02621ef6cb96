"""The ``staged`` reduction layout: rows read contiguously, results written across them.

A reduction over the channels of a channels-last value whose result goes back to NCHW
(``emit_reduction.stores_across_rows``: KernelBench L2 91's softmax after an NHWC
transposed convolution) reads each row contiguously but writes each element
``H * W`` apart from its row's next one. The ``inner`` layout then writes one element per
32-byte sector; the ``column`` layout writes coalesced but reads one row's elements
across many sectors, a pass at a time. On an H100 (2026-12-05) L2 91's region, 2.2 GB
moved, took 3.09 ms, under a third of the copy rate.

Here a block takes STAGE_ROWS consecutive rows through shared memory, in three phases:

1. copy: the block's threads copy the rows' elements of each staged load (one that is
   contiguous along the reduced index and varies with the rows) into shared memory,
   consecutive threads reading consecutive elements: the rows of a channels-last value
   follow one another, so the block reads one run of memory;
2. reduce: a warp a row reduces from shared memory (the reductions' phases in order,
   combined by ``sfk_group_reduce``'s fixed shuffle tree: deterministic), and keeps each
   row's results in shared memory;
3. write: consecutive threads take consecutive rows of one reduced index, so each
   element store, contiguous along the rows, is coalesced.

Global memory is read once and written once. Rows are padded to an odd length in shared
memory, so that phase 3's reads of one column hit distinct banks. Only for one reduced
index of a static length up to STAGE_MAX_K whose tiles fit in STAGE_SMEM bytes; the Coder
proposes this layout beside the ``inner`` one, and the Verifier keeps the faster.
"""

from __future__ import annotations

import sympy

from . import indexing as ix
from .emit_cuda import Emitted, _emit_store, _Kernel
from .emit_expr import CTYPE, ExprEmitter, Scope, compute_ctype
from .emit_reduction import (_acc_ctype, _init_value, _op_functor, _smem_width,
                             accumulate, row_stores, stores_across_rows)
from .kernel_ir import KernelIR, Load, Unsupported
from .persist import BYTES as _BYTES

STAGE_ROWS = 32
STAGE_THREADS = 256
STAGE_MAX_K = 1024
# static shared memory for the tiles and the rows' results (48 KB is the static limit)
STAGE_SMEM = 44 * 1024


def staged_loads(ir: KernelIR) -> list[Load]:
    """The loads the staged layout copies into shared memory: contiguous along the
    reduced index, varying with the rows, no gathered index."""
    d = ir.domain
    if len(d.red_vars) != 1:
        return []
    red = d.red_vars[0]
    rows = set(d.row_vars)
    found: list[Load] = []
    for n in ir.all_exprs():
        if not isinstance(n, Load) or n in found:
            continue
        free = n.offset.free_symbols
        if any(ix.is_data_var(s) for s in free) or not (free & rows):
            continue
        if sympy.expand(sympy.diff(n.offset, red)) == 1:
            found.append(n)
    return found


def why_not_staged(ir: KernelIR) -> str | None:
    """Why ``ir`` cannot take the staged layout (None: it can)."""
    if not stores_across_rows(ir):
        return "its element stores are not contiguous along the rows of an inner-layout reduction"
    d = ir.domain
    if len(d.red_vars) != 1 or d.red_limit is not None:
        return "more than one reduced index, or rows of varying length"
    extent = sympy.sympify(d.red_extents[0])
    if not extent.is_Integer or not 1 <= int(extent) <= STAGE_MAX_K:
        return f"a reduced length of {extent}, not static and at most {STAGE_MAX_K}"
    loads = staged_loads(ir)
    if not loads:
        return "no load contiguous along the reduced index"
    ptr = {a.name: CTYPE[a.dtype] for a in ir.inputs + ir.outputs}
    if _smem_bytes(ptr, loads, int(extent), _smem_width(ir),
                   len(ir.inner_reductions)) > STAGE_SMEM:
        return f"its tiles need more than {STAGE_SMEM} bytes of shared memory"
    return None


def _smem_bytes(ptr: dict[str, str], loads: list[Load], K: int, width: int,
                n_results: int) -> int:
    """The tiles of ``loads`` (``ptr``: each buffer's C type), then ``n_results`` arrays
    of one ``width``-byte accumulator a row."""
    tiles = sum(_round16(STAGE_ROWS * _pitch(K) * _BYTES.get(ptr[ld.buf], 8)) for ld in loads)
    return tiles + n_results * STAGE_ROWS * width


def _pitch(K: int) -> int:
    """A tile row's length in elements: odd, so that 32 rows' elements of one reduced
    index (phase 3) fall in 32 distinct banks."""
    return K if K % 2 else K + 1


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def emit_staged(ir: KernelIR) -> Emitted:
    """The staged-layout kernel of ``ir`` (raises Unsupported where it does not apply)."""
    why = why_not_staged(ir)
    if why is not None:
        raise Unsupported(f"no staged layout: {why}")
    k = _Kernel(ir)
    d = ir.domain
    (red,) = d.red_vars
    K = int(sympy.sympify(d.red_extents[0]))
    pitch = _pitch(K)
    loads = staged_loads(ir)
    reds = list(ir.inner_reductions)
    width = _smem_width(ir)    # bytes of the widest accumulator: each row's result slot
    IDX = k.IDX
    params, sig, names = k.signature([], [("int log2_tk", "i", "log2_tk")])
    L = k.lines
    L += k.header(f"row reduction, staged layout: {STAGE_ROWS} rows a block through "
                  "shared memory (copy, a warp a row, write across the rows)")
    em = ExprEmitter(k, ir)
    L.append(f'extern "C" __global__ void __launch_bounds__({STAGE_THREADS}) {ir.name}(')
    L.append("    " + ",\n    ".join(params) + ") {")
    L.append(f"  __shared__ __align__(16) unsigned char sfk_stage"
             f"[{_smem_bytes(k.ptr, loads, K, width, len(reds))}];")
    offset = 0
    tile = {}
    for j, ld in enumerate(loads):
        ct = k.ptr[ld.buf]
        L.append(f"  {ct}* sfk_st{j} = reinterpret_cast<{ct}*>(sfk_stage + {offset});")
        tile[ld] = f"sfk_st{j}"
        offset += _round16(STAGE_ROWS * pitch * _BYTES.get(ct, 8))
    for r in reds:
        L.append(f"  {_acc_ctype(r)}* sfk_res{r.rid} = reinterpret_cast<{_acc_ctype(r)}*>"
                 f"(sfk_stage + {offset});")
        offset += STAGE_ROWS * width
    L += k.symbol_prologue("  ")
    rows = " * ".join(f"({k.c_size(e)})" for e in d.row_extents) or "1"
    L.append(f"  const {IDX} rows = {rows};")
    L.append("  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;")
    L.append(f"  for ({IDX} row0 = ({IDX})blockIdx.x * {STAGE_ROWS}; row0 < rows; "
             f"row0 += ({IDX})gridDim.x * {STAGE_ROWS}) {{")
    L += _copy_phase(k, em, d, red, K, pitch, tile)
    L.append("    __syncthreads();")
    em.overrides = {ld: f"sfk_val({name}[lr * {pitch} + kk])" for ld, name in tile.items()}
    L += _reduce_phase(k, em, ir, d, red, K, reds)
    L.append("    __syncthreads();")
    L += _write_phase(k, em, ir, d, red, K, reds)
    L.append("    __syncthreads();  // the next rows overwrite the tiles")
    L.append("  }")
    L.append("}")
    return Emitted("\n".join(L) + "\n", ir.name, sig, "reduction", "staged", 1, k.idx64,
                   (), names, STAGE_THREADS)


def _row_scope(k: _Kernel, d, red, extra: set, ind: str, with_red: bool) -> Scope:
    scope = Scope(None, set(d.row_vars) | extra | ({red} if with_red else set()), ind)
    scope.pre += k.delinearize("r", list(d.row_vars), list(d.row_extents), ind)
    if with_red:
        scope.pre.append(f"{ind}const {k.IDX} {red} = kk;")
    return scope


def _copy_phase(k, em, d, red, K: int, pitch: int, tile: dict) -> list[str]:
    ind = "        "
    out = [f"    for (int e = threadIdx.x; e < {STAGE_ROWS * K}; e += {STAGE_THREADS}) {{",
           f"      const int lr = e / {K}, kk = e % {K};",
           f"      const {k.IDX} r = row0 + lr;",
           "      if (r < rows) {"]
    scope = _row_scope(k, d, red, set(), ind, with_red=True)
    for ld, name in tile.items():
        scope.lines.append(f"{ind}{name}[lr * {pitch} + kk] = {ld.buf}"
                           f"[{em.index(ld.offset, scope)}];")
    return out + scope.render() + ["      }", "    }"]


def _reduce_phase(k, em, ir: KernelIR, d, red, K: int, reds) -> list[str]:
    ind = "      "
    out = [f"    for (int lr = warp; lr < {STAGE_ROWS}; lr += {STAGE_THREADS // 32}) {{",
           f"      const {k.IDX} r = row0 + lr;",
           "      if (r >= rows) break;  // the block's last rows (warp-uniform)"]
    row = _row_scope(k, d, red, {sympy.Symbol("lr")}, ind, with_red=False)
    for p in sorted({r.phase for r in reds}):
        phase = [r for r in reds if r.phase == p]
        for r in phase:
            row.lines.append(f"{ind}{_acc_ctype(r)} acc{r.rid} = "
                             f"{_init_value(r, compute_ctype(r.dtype))};")
        inner = Scope(row, {red, sympy.Symbol("kk")}, ind + "  ")
        inner.pre.append(f"{ind}  const {k.IDX} {red} = kk;")
        for r in phase:
            accumulate(em, r, inner)
        # the loop's text goes in after what its body hoisted into the row's scope
        row.lines += [f"{ind}for (int kk = lane; kk < {K}; kk += 32) {{"] + inner.render() \
            + [f"{ind}}}"]
        for r in phase:
            row.lines.append(f"{ind}acc{r.rid} = sfk_group_reduce(acc{r.rid}, "
                             f"{_op_functor(r, compute_ctype(r.dtype))}, 5, true, "
                             f"sfk_res{r.rid});  // a warp: shuffles only")
            em.reduced(r, row, f"acc{r.rid}")
    row_stores(k, em, row, ir, "lane == 0")
    for r in reds:
        row.lines.append(f"{ind}if (lane == 0) sfk_res{r.rid}[lr] = acc{r.rid};")
    return out + row.render() + ["    }"]


def _write_phase(k, em, ir: KernelIR, d, red, K: int, reds) -> list[str]:
    ind = "        "
    out = [f"    for (int e = threadIdx.x; e < {STAGE_ROWS * K}; e += {STAGE_THREADS}) {{",
           f"      const int lr = e % {STAGE_ROWS}, kk = e / {STAGE_ROWS};",
           f"      const {k.IDX} r = row0 + lr;",
           "      if (r < rows) {"]
    scope = _row_scope(k, d, red, {sympy.Symbol("lr"), sympy.Symbol("kk")}, ind, with_red=True)
    for r in reds:
        em.reduced(r, scope, f"sfk_res{r.rid}[lr]")
    for st in ir.stores:
        if st.level == "element":
            _emit_store(k, em, scope, st)
    return out + scope.render() + ["      }", "    }"]


__all__ = ["STAGE_ROWS", "STAGE_THREADS", "emit_staged", "staged_loads", "why_not_staged"]
