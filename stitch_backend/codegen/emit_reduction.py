"""The reduction template of ``emit_cuda``: rows x reduce, one group of TK threads per row.

``inner`` layout when the reduced index is contiguous in memory (threads of a group are
consecutive lanes: shuffles), ``column`` layout when a row index is (consecutive threads
take consecutive rows: coalesced); ``cluster`` (an alternative the Coder proposes for long
rows): the inner layout with each row shared by the blocks of a cluster (``cluster``).
Each phase of reductions is one pass over the row, in chunks of VEC elements along the
innermost reduced index (16-byte loads where aligned); results are combined by
``sfk_group_reduce`` (fixed trees, no atomics); short rows of a
constant length (SERIAL_MAX_K) take one thread each, in a fully unrolled loop. Reductions
across rows (``outer``) write one value per row to a workspace that the last block to
finish reduces in a fixed order.
"""

from __future__ import annotations

import sympy

from . import batched_loads as bl
from . import indexing as ix
from .emit_cuda import Emitted, _emit_store, _Kernel, _store_lane, _vector_chunk
from .emit_expr import ExprEmitter, Scope, compute_ctype, eligible_vector_access
from .kernel_ir import KernelIR, Load, Reduction, Unsupported, walk
from .cluster import CLUSTER, cluster_rows_kept, kept_scalars
from .peel import (PEEL_SPAN, cluster_middle, edge_loop, middle_loop, peeled_access, row_bounds,
                   why_not_peeled)
from .persist import PERSIST_CHUNKS, PERSIST_THREADS, load_passes, value_passes

INIT = {
    "sum": lambda t: "0", "prod": lambda t: "1", "any": lambda t: "false", "all": lambda t: "true",
}


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
    if r.kind == "softmax":
        return f"sfk_mspair<{ct}>{{{small}, ({ct})0}}"
    return v


def _op_functor(r: Reduction, ct: str) -> str:
    return {
        "sum": f"sfk_op_sum<{ct}>()", "prod": f"sfk_op_prod<{ct}>()",
        "max": f"sfk_op_max<{ct}>()", "min": f"sfk_op_min<{ct}>()",
        "any": "sfk_op_any()", "all": "sfk_op_all()",
        "argmax": f"sfk_op_arg<{ct}, true>()", "argmin": f"sfk_op_arg<{ct}, false>()",
        "softmax": f"sfk_op_online<{ct}>()",
    }[r.kind]


def _acc_ctype(r: Reduction) -> str:
    ct = compute_ctype(r.dtype)
    if r.kind == "softmax":
        return f"sfk_mspair<{ct}>"
    return f"sfk_argpair<{ct}>" if r.kind in ("argmax", "argmin") else ct


def accumulate(em: ExprEmitter, r: Reduction, scope: Scope) -> None:
    """The line adding one element's value to reduction ``r``'s accumulator ``acc{rid}``."""
    ct = compute_ctype(r.dtype)
    val = em.value(r.body, scope)
    if r.kind in ("argmax", "argmin"):
        val = f"sfk_argpair<{ct}>{{{val}, (long long)({em.index(r.index, scope)})}}"
    elif r.kind == "softmax":
        if em.fast and scope.lanes:
            # fast_math: the chunk's lanes first, then one maximum and at most one rescale
            # a chunk (sfk_online_addv) instead of a compare and branch an element
            lanes = f"sfk_x{r.rid}"
            scope.before_lanes.append(f"{ct} {lanes}[{scope.lanes}];")
            scope.lines.append(f"{scope.ind}{lanes}[v] = {val};")
            scope.after_lanes.append(f"acc{r.rid} = sfk_online_addv(acc{r.rid}, {lanes});")
            return
        scope.lines.append(f"{scope.ind}acc{r.rid} = sfk_online_add(acc{r.rid}, {val});")
        return
    scope.lines.append(f"{scope.ind}acc{r.rid} = {_op_functor(r, ct)}(acc{r.rid}, {val});")


def row_stores(k: _Kernel, em: ExprEmitter, row: Scope, ir: KernelIR, cond: str) -> None:
    """``ir``'s stores of one value a row, by the thread ``cond`` names."""
    for st in ir.stores:
        if st.level == "row":
            _emit_store(k, em, row, st, cond)


def _smem_width(ir: KernelIR) -> int:
    """Bytes of the widest accumulator of ``ir``'s reductions (argmax pairs: 16)."""
    width = 4
    for r in ir.reductions:
        ct = _acc_ctype(r)
        width = max(width, 16 if ct.startswith(("sfk_argpair", "sfk_mspair<double")) else
                    8 if ct.startswith("sfk_mspair") else
                    4 if ct in ("float", "int", "short", "signed char", "unsigned char", "bool")
                    else 8)
    return width


def _layout(ir: KernelIR) -> str:
    """``column`` where more of the reductions' widest loads (those indexed by the most
    variables: not a per-channel weight) run along the rows' innermost index than along
    the reduced one, else ``inner``. Strides are taken where each load is read, without a
    concatenation's clamps (a cat of an NCHW input and channels-last convolutions'
    outputs, DenseNet's, votes by its inputs), keeping a pooling window's."""
    d = ir.domain
    if not d.red_vars:
        return "inner"
    loads = [n for r in ir.inner_reductions for n in walk([r.body]) if isinstance(n, Load)]
    if not loads:
        return "inner"
    widest = max(len(ld.offset.free_symbols) for ld in loads)
    inner = column = 0
    for ld in dict.fromkeys(ld for ld in loads if len(ld.offset.free_symbols) == widest):
        ref = ix.unclamped(ld.offset, keep=set(d.red_vars))
        if sympy.expand(sympy.diff(ref, d.red_vars[-1])) == 1:
            inner += 1
        elif d.row_vars and sympy.expand(sympy.diff(ref, d.row_vars[-1])) == 1:
            column += 1
    return "column" if column > inner else "inner"


def stores_across_rows(ir: KernelIR) -> bool:
    """Whether ``ir`` reads its rows contiguously (``inner`` layout) but writes each
    element store contiguously along the rows instead: a normalisation over the channels
    of a channels-last value whose result goes back to NCHW (L2 91's softmax after an
    NHWC transposed convolution: on an H100 its kernel moved 2.2 GB in 2.99 ms, about a
    quarter of the copy rate). There the ``column`` layout, whose consecutive threads
    take consecutive rows, writes coalesced and reads each row's sectors through L1;
    the Coder proposes it beside the ``inner`` kernel and the Verifier keeps the faster."""
    d = ir.domain
    if not ir.is_reduction or not d.red_vars or not d.row_vars or ir.outer_reductions:
        return False
    stores = [s for s in ir.stores if s.level == "element"]
    if not stores or _layout(ir) != "inner":
        return False
    last = d.row_vars[-1]
    for st in stores:
        if any(last in f.free_symbols for f in st.offset.atoms(ix.FDiv, ix.IMod)):
            return False
        if sympy.expand(sympy.diff(st.offset, last)) != 1:
            return False
    return True


# Rows of at most this many elements, a constant count and no vector path (a pooling
# window, a strided short row) are reduced by one thread each in a fully unrolled loop:
# the reduced indices become constants, so the window's index arithmetic folds. With a
# group of threads a row (TK = 4 for L1 42's 4x4 max pool), every element paid its own
# division, clamps and bounds checks, and the generated kernel took 15.27 ms on the
# H200 against ATen's 10.84 (which also writes int64 indices).
SERIAL_MAX_K = 32


def why_not_cluster(ir: KernelIR) -> str | None:
    """Why ``ir`` cannot take the ``cluster`` layout; None where it can."""
    if not ir.domain.red_vars:
        return "no reduced index"
    if ir.outer_reductions:
        return "a reduction across rows (its last-block stage is per block)"
    if _layout(ir) != "inner":
        return "its rows are not read along the reduced index"
    return None


def emit_reduction(ir: KernelIR, layout: str | None = None, cache_values: bool = False,
                   peel: bool = False) -> Emitted:
    """The reduction kernel of ``ir``, in ``layout`` ("inner", "column", "cluster" or
    "staged" (``emit_staged``); by default the one its loads favour). ``cache_values``: persistent
    rows keep computed values between passes, not loads (``persist.value_passes``);
    ``peel``: rows without an aligned vector path read their aligned middle in vectors
    (``peel``; Unsupported where that does not apply)."""
    if layout not in (None, "inner", "column", "staged", "cluster"):
        raise ValueError(f"unknown reduction layout {layout!r}")
    if layout == "staged":
        from .emit_staged import emit_staged   # it builds on this module's helpers

        return emit_staged(ir)
    k = _Kernel(ir)
    d = ir.domain
    layout = layout or _layout(ir)
    cluster = layout == "cluster"
    if cluster and (why := why_not_cluster(ir)) is not None:
        raise Unsupported(why)
    rowwise = layout in ("inner", "cluster")   # a row's threads are consecutive lanes
    outer = ir.outer_reductions
    for r in outer:
        if r.kind in ("argmax", "argmin", "softmax"):
            raise Unsupported(f"{r.kind} across rows")
    workspaces = tuple((f"ws{r.rid}", r.dtype) for r in outer)
    extra = [(f"{compute_ctype(dt)}* __restrict__ {n}", n) for n, dt in workspaces]
    if outer:
        extra.append(("unsigned int* __restrict__ sfk_ticket", "sfk_ticket"))
    params, sig, names = k.signature(extra, [("int log2_tk", "i", "log2_tk")])
    # Vector chunks run along the innermost reduced index; with several reduced indices
    # (BatchNorm's N and H*W) a chunk stays inside one run of it when its extent is a
    # multiple of the vector width, which eligible_vector_access checks.
    vector_red = bool(d.red_vars) and rowwise
    elem_loads = [n for n in ir.all_exprs() if isinstance(n, Load)]
    elem_stores = [s for s in ir.stores if s.level == "element"]
    if vector_red:
        vec, vloads, vstores, conds = eligible_vector_access(
            k, d.red_vars[-1], d.red_extents[-1], elem_loads, elem_stores)
    else:
        vec, vloads, vstores, conds = 1, {}, {}, []
    # rows that start anywhere (odd lengths): a scalar head, the aligned middle in vectors
    peeled = None
    if peel:
        why = why_not_peeled(ir, layout) or ("rows with an aligned vector path"
                                             if vloads or vstores else None)
        peeled = None if why else peeled_access(k, ir, elem_loads, elem_stores)
        if peeled is None:
            raise Unsupported(f"no rows to peel: {why or 'no access steps with the reduced index'}")
        vec, vloads, vstores, conds = peeled.vec, peeled.loads, peeled.stores, peeled.conds
    L = k.lines
    L += k.header(f"row reduction, {layout} layout"
                  + (f" ({CLUSTER} blocks a row)" if cluster else "") + f", chunks of {vec}"
                  + (", vector path" if vloads or vstores else "")
                  + (" (rows peeled to alignment)" if peeled else "")
                  + (", cross-row reduction in the last block" if outer else ""))
    em = ExprEmitter(k, ir)
    phases = sorted({r.phase for r in ir.inner_reductions})
    values = None
    if vloads and layout == "inner" and peeled is None:
        if cache_values:
            values = value_passes(ir, em, vec, phases, elem_stores)
            persist = [{} for _ in values] if values else None
        else:
            persist = load_passes(k, ir, vec, vloads, phases, elem_stores)
    else:
        persist = None
    max_threads = PERSIST_THREADS if persist else 1024
    # the cluster layout keeps the row's share of the loads later passes read again in
    # shared memory (vector path): the row is then read from memory once
    kept = cluster_rows_kept(k, ir, vec, vloads, phases, elem_stores) if cluster else None
    serial = _serial_k(d, layout, vloads, vstores, persist)
    dims = f"__cluster_dims__({CLUSTER}, 1, 1) " if cluster else ""
    L.append(f'extern "C" __global__ void {dims}__launch_bounds__({max_threads}) {ir.name}(')
    L.append("    " + ",\n    ".join(params) + ") {")
    # sfk_group_reduce stages one accumulator per warp in the inner layout (the last
    # block's cross-row stage is inner too) and one per thread (up to 1024) in the column
    # layout: sized for the widest accumulator here, not for the widest of all (16 KB of
    # static shared memory cost fp32 reductions blocks per SM). A static array counts
    # against every resident block: 4 KB for each of 16 blocks of 128 threads takes 64 KB
    # of the SM's L1, where the passes after the first re-read their row.
    staged_values = 32 if rowwise else 1024
    L.append(f"  __shared__ __align__(16) unsigned char sfk_smem[{staged_values * _smem_width(ir)}];")
    if cluster:     # each reduction's part of this block, for the cluster's other blocks
        L += [f"  __shared__ {_acc_ctype(r)} sfk_cs{r.rid}[2];" for r in ir.inner_reductions]
    if kept:        # this block's share of each kept load, one after another
        L.append("  extern __shared__ __align__(16) unsigned char sfk_dyn[];")
        for n, (ld, offset) in enumerate(kept.buffers.items()):
            ct = compute_ctype(ld.dtype)
            L.append(f"  {ct}* const sfk_rs{n} = reinterpret_cast<{ct}*>(sfk_dyn + {offset});")
            if ld in vloads:
                vt = f"sfk_vec<{k.ptr[ld.buf]}, {vec}>"
                L.append(f"  {vt}* const sfk_rb_{vloads[ld]} = "
                         f"reinterpret_cast<{vt}*>(sfk_dyn + {offset});")
    L += k.symbol_prologue("  ")
    IDX = k.IDX
    rows = " * ".join(f"({k.c_size(e)})" for e in d.row_extents) or "1"
    red = " * ".join(f"({k.c_size(e)})" for e in d.red_extents) or "1"
    L.append(f"  const {IDX} rows = {rows};")
    L.append(f"  const {IDX} K = {red};")
    if serial is not None:
        # one thread a row whatever the launch (log2_tk unused): correct for any grid
        L.append("  const int TK = 1, RB = blockDim.x;  // one thread a row (short rows)")
        L.append("  const int tk = 0, tr = threadIdx.x;")
    elif rowwise:
        L.append("  const int TK = 1 << log2_tk, RB = blockDim.x >> log2_tk;")
        L.append("  const int tk = threadIdx.x & (TK - 1), tr = threadIdx.x >> log2_tk;")
    else:
        L.append("  const int TK = 1 << log2_tk, RB = blockDim.x >> log2_tk;")
        L.append("  const int tr = threadIdx.x % RB, tk = threadIdx.x / RB;")
    has_vec = bool(vloads or vstores)
    if has_vec:
        L.append(f"  const bool vec_ok = {' && '.join(conds) or 'true'};")
    if cluster:   # a cluster's blocks take the same rows (their ids differ in the rank only)
        L.append("  const unsigned sfk_rank = sfk_cluster_rank();")
        L.append("  int sfk_par = 0;  // which of the two cluster slots this row takes")
        L.append(f"  for ({IDX} row0 = ({IDX})(blockIdx.x / {CLUSTER}) * RB; row0 < rows; "
                 f"row0 += ({IDX})(gridDim.x / {CLUSTER}) * RB) {{")
    else:
        L.append(f"  for ({IDX} row0 = ({IDX})blockIdx.x * RB; row0 < rows; "
                 f"row0 += ({IDX})gridDim.x * RB) {{")
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
        row.pre.append(f"    const bool vec_row = vec_ok{'' if peeled else extra};")
    if peeled:
        row.pre += row_bounds(peeled, em, row, IDX, cluster)
    span = ("", "Kr")
    if cluster:   # this block's share of the row: whole vector chunks, in rank order
        row.pre += [f"    const {IDX} sfk_share = "
                    f"((Kr + {CLUSTER * vec - 1}) / {CLUSTER * vec}) * {vec};",
                    f"    const {IDX} kb = ({IDX})sfk_rank * sfk_share;",
                    f"    const {IDX} ke = Kr - kb < sfk_share ? Kr : kb + sfk_share;"]
        span = ("kb + ", "ke")
        if peeled:   # the vector path's share: whole chunks of the aligned middle
            row.pre += cluster_middle(IDX, vec, CLUSTER)
    inner_flag = "true" if rowwise else "false"
    # a peeled row's vector chunks: from the first aligned element to the middle's end,
    # or (cluster) this block's share of the middle (``peel.cluster_middle``)
    peel_span = None if peeled is None else PEEL_SPAN[cluster]
    # rows read one element a thread and step (no vector path: odd lengths, L1 38/39's
    # 65535) issue several steps' loads before using them (batched_loads.leading_loads)
    batch_rows = rowwise and serial is None
    if persist:
        row.pre.append(f"    const bool persist_row = vec_row && Kr <= ({IDX})TK * "
                       f"{vec * PERSIST_CHUNKS};")
        for ld, name in vloads.items():
            if any(name in modes for modes in persist):
                row.pre.append(f"    sfk_vec<{k.ptr[ld.buf]}, {vec}> c_{name}[{PERSIST_CHUNKS}];")
        for e, name in sorted({e: n for _, fills in values or [] for e, n in fills.items()}.items(),
                              key=lambda item: item[1]):
            row.pre.append(f"    {compute_ctype(e.dtype)} {name}[{PERSIST_CHUNKS * vec}];")
    passes = iter(persist or [])
    kept_passes = iter(zip(kept.vector, kept.scalar) if kept else [])
    value_plan = iter(values or [])
    for p in phases:
        reds = [r for r in ir.inner_reductions if r.phase == p]
        for r in reds:
            row.lines.append(f"    {_acc_ctype(r)} acc{r.rid} = {_init_value(r, compute_ctype(r.dtype))};")

        def body(scope, reds=reds):
            for r in reds:
                accumulate(em, r, scope)
        _k_loops(k, em, row, d, vec, vloads if has_vec else {}, {}, conds, body, has_vec, [],
                 next(passes, None), serial, next(value_plan, None), span,
                 next(kept_passes, None), batch_rows, peel_span)
        for r in reds:
            if serial is None:    # a row's threads combine their parts (serial: one thread)
                row.lines.append(
                    f"    acc{r.rid} = sfk_group_reduce(acc{r.rid}, "
                    f"{_op_functor(r, compute_ctype(r.dtype))}, log2_tk, {inner_flag}, "
                    f"reinterpret_cast<{_acc_ctype(r)}*>(sfk_smem));")
            if cluster:
                row.lines.append(
                    f"    acc{r.rid} = sfk_cluster_reduce<{CLUSTER}>(acc{r.rid}, "
                    f"{_op_functor(r, compute_ctype(r.dtype))}, sfk_cs{r.rid}, sfk_par);")
            em.reduced(r, row, f"acc{r.rid}")
    row_stores(k, em, row, ir, "row_ok && tk == 0" + (" && sfk_rank == 0" if cluster else ""))
    if elem_stores:
        _k_loops(k, em, row, d, vec, vloads if has_vec else {}, vstores if has_vec else {}, conds,
                 lambda scope: [_emit_store(k, em, scope, st) for st in elem_stores if st not in
                                (vstores if scope.vector else {})], has_vec, elem_stores,
                 next(passes, None), serial, next(value_plan, None), span,
                 next(kept_passes, None), batch_rows, peel_span)
    for r in outer:
        val = em.value(r.body, row)
        row.lines.append(f"    if (row_ok && tk == 0) ws{r.rid}[r] = {val};")
    if cluster:
        row.lines.append("    sfk_par ^= 1;")
    L += row.render()
    L.append("  }")
    if cluster:   # no block leaves while another may still read its slots
        L.append("  sfk_cluster_sync();")
    if outer:
        L += _outer_stage(k, ir, em)
    L.append("}")
    return Emitted("\n".join(L) + "\n", ir.name, sig, "reduction", layout, vec, k.idx64,
                   workspaces, names, max_threads, serial=serial is not None,
                   cached_values=len({e for _, fills in values or [] for e in fills}),
                   shared_mem=kept.nbytes if kept else 0)


def _serial_k(d, layout: str, vloads, vstores, persist) -> int | None:
    """The constant row length when rows are reduced one thread each (SERIAL_MAX_K)."""
    if layout != "inner" or vloads or vstores or persist or d.red_limit is not None:
        return None
    if not d.red_extents or not all(isinstance(e, sympy.Integer) for e in d.red_extents):
        return None
    n = int(sympy.prod(d.red_extents))
    return n if 1 <= n <= SERIAL_MAX_K else None


def _k_loops(k, em, row, d, vec, vloads, vstores, conds, body, has_vec, stores, cached=None,
             serial=None, values=None, span=("", "Kr"), kept=None, batch_rows=False,
             peeled=None):
    """The pass over one row: chunks of ``vec`` per thread, vector and scalar variants;
    with ``cached`` (this pass's entry of ``_persistent_passes``), first a persistent
    variant: the thread's chunks j = 0..PERSIST_CHUNKS-1, unrolled, so that the register
    arrays of cached loads are indexed by constants; ``values`` (this pass's entry of
    ``persist.value_passes``): the computed values it reads from, and keeps in, the
    register arrays ``cvN[j * VEC + v]`` there.

    ``span``: the loop's start offset and limit (the ``cluster`` layout's share of the row);
    ``kept``: this pass's part of ``cluster_rows_kept``'s plan, (vector modes by name,
    scalar slots by load and mode): the loads it keeps in, or reads from, the block's
    shared-memory share of the row; ``batch_rows`` (a row's threads are a group, each
    thread many steps): a pass of one element a thread and step issues the loads that
    lead its body for several steps at once (``batched_loads``), and so does a vector pass
    where ``batched_loads.BATCH_INNER_VECTOR`` is set; ``peeled`` (``peel``): the vector
    variant covers the row's aligned middle (``peel.PeelSpan``: in the cluster layout,
    this block's share of it), then its head and tail (``edge_loop``).

    The loop text is collected apart and appended last, so row-level values that the
    body hoists into ``row`` land before the loop."""
    IDX = k.IDX
    variants = ([None] if cached is not None else []) + ([True, False] if has_vec else [False])
    text: list[str] = []
    for vector in variants:
        persistent = vector is None
        vector = vector is not False
        lo, hi = (peeled.lo, peeled.hi) if peeled and vector else span
        ind = "      " if has_vec else "    "
        if persistent:
            text.append("    if (persist_row) {")
            text.append(f"{ind}#pragma unroll")
            text.append(f"{ind}for (int j = 0; j < {PERSIST_CHUNKS}; ++j) {{")
            text.append(f"{ind}  const {IDX} k0 = (({IDX})tk + ({IDX})j * TK) * {vec};")
            text.append(f"{ind}  if (k0 < Kr) {{")
            chunk = Scope(row, {sympy.Symbol("k0"), sympy.Symbol("j")}, ind + "    ")
        else:
            if has_vec:
                opening = "    } else if (vec_row) {" if cached is not None else "    if (vec_row) {"
                text.append(opening if vector else "    } else {")
            if serial is not None:     # one thread a row: constant indices once unrolled
                text.append(f"{ind}#pragma unroll")
                text.append(f"{ind}for ({IDX} k0 = 0; k0 < {serial}; ++k0) {{")
            else:
                # unrolled so that several chunks' loads are in flight before the first is
                # used, where the body lets the compiler move them (see batched_loads)
                header = middle_loop(IDX, vec, ind, peeled) if peeled and vector else [
                    f"{ind}#pragma unroll 4",
                    f"{ind}for ({IDX} k0 = {lo}({IDX})tk * {vec}; k0 < {hi}; "
                    f"k0 += ({IDX})TK * {vec}) {{"]
            chunk = Scope(row, {sympy.Symbol("k0")}, ind + "  ")
        chunk.vector = vector
        var = d.red_vars[-1] if d.red_vars else None
        if vector:
            # the chunk's outer reduced indices and the start of its innermost one
            b0 = sympy.Symbol(f"{var}_0")
            outer_vars = list(d.red_vars[:-1])
            chunk.defined |= {b0} | set(outer_vars)
            chunk.pre += k.delinearize("k0", outer_vars + [b0], list(d.red_extents), ind + "  ")
            def element(inner):
                body(inner)
                for st, name in vstores.items():
                    _store_lane(k, em, inner, st, name)
            if persistent and values is not None:
                em.value_uses = {e: f"{n}[j * {vec} + v]" for e, n in values[0].items()}
                em.fills = {e: f"{n}[j * {vec} + v]" for e, n in values[1].items()}
            if persistent:
                _vector_chunk(k, em, chunk, var, vec, vloads, vstores, element, chunk.ind, cached)
            else:
                _vector_chunk(k, em, chunk, var, vec, vloads, vstores, element, chunk.ind,
                              kept[0] if kept else None,
                              slot="sfk_rb_{name}[(k0 - %s) / %d]" % (
                                  peeled.base if peeled else "kb", vec))
            em.value_uses, em.fills = {}, {}
        else:
            cind = ind + "  "
            if vec > 1:
                el = Scope(chunk, set(d.red_vars) | {sympy.Symbol("v")}, cind + "    ")
                el.pre += k.delinearize("kk", list(d.red_vars), list(d.red_extents), cind + "    ")
                with kept_scalars(em, kept, "kk - kb", set(d.red_vars)):
                    body(el)
                chunk.lines += [f"{cind}#pragma unroll", f"{cind}for (int v = 0; v < {vec}; ++v) {{",
                                f"{cind}  const {IDX} kk = k0 + v;", f"{cind}  if (kk < {span[1]}) {{"]
                chunk.lines += el.render()
                chunk.lines += [f"{cind}  }}", f"{cind}}}"]
            else:
                el = Scope(chunk, set(d.red_vars), cind)
                el.pre += k.delinearize("k0", list(d.red_vars), list(d.red_extents), cind)
                with kept_scalars(em, kept, "k0 - kb", set(d.red_vars)):
                    body(el)
                chunk.lines += el.render()
                if batch_rows:
                    chunk.issued = bl.leading_loads(el)
        if persistent or serial is not None:
            text += chunk.render()
            if persistent:
                text.append(f"{ind}  }}")
            text.append(f"{ind}}}")
        elif bl.batches(vector, kept, batch_rows) and (batched := bl.batched_loop(
                IDX, chunk, vec, (lo, hi), ind, bl.batched_width(chunk.issued))):
            text += batched
        else:
            text += header + chunk.render() + [f"{ind}}}"]
        if peeled and vector:
            text += edge_loop(k, row, d.red_vars, d.red_extents, body, ind)
    if has_vec:
        text.append("    }")
    row.lines += text


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


__all__ = ["CLUSTER", "emit_reduction", "why_not_cluster"]
