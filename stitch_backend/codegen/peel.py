"""Vector loads for rows whose start is not aligned: the ``inner`` reduction layout's
peeled rows.

A row reduction reads each row along its innermost reduced index, VEC elements at a time
where every row starts on a multiple of VEC (``emit_expr.eligible_vector_access``). Rows
of an odd length (L1 38/39's 32768 rows of 65535 fp32) start anywhere, and were read one
element a thread and step: four-byte loads, where the ``batched_loads`` loop keeps a few
in flight. Peeled, a row is read as a head of scalar elements up to its first aligned
element (``sfk_lead``, computed per row: at most VEC - 1), whole vector chunks over the
aligned middle up to ``sfk_vend``, and a tail of fewer than VEC scalar elements after it;
the head and tail share one short loop (``edge_loop``). Every vector access of the row
must then have the same start, so that one head aligns them all: the loads and stores
whose offset is the row's start plus the reduced index, grouped by that start; the group
whose start moves with the row (the row's own data, not a weight every row reads alike)
takes the vector path, the larger first (``peeled_access``); the others stay scalar.

The ``inner`` layout, and the ``cluster`` layout (``cluster_middle``: each block of a
cluster takes a share of whole chunks of the aligned middle, and keeps them in its shared
memory as the aligned rows' shares are kept; the first block also takes the head and the
tail, which each pass reads from memory: fewer than 2 * VEC elements a row). One reduced
index, no persistent rows (their register arrays are indexed by chunk from the row's
start), and rows of at least PEEL_MIN_K elements (shorter rows are latency, not
bandwidth; rows of up to 32 go one thread a row).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .emit_expr import ExprEmitter, Scope, along, itemsize
from .kernel_ir import KernelIR, Load, Store

PEEL_MIN_K = 1024


@dataclass(frozen=True)
class PeelSpan:
    """Where a peeled row's vector chunks run: ``lo`` (a prefix) and ``hi`` in the row's
    elements (``k0``), ``q_lo`` and ``q_hi`` in its aligned middle (``q0``,
    ``middle_loop``), and ``base``, the element a block's kept share starts at (the
    cluster layout's shared-memory slots are indexed from it)."""

    lo: str
    hi: str
    q_lo: str
    q_hi: str
    base: str


# by layout: the inner layout's row (the whole middle), the cluster's share of it
PEEL_SPAN = {False: PeelSpan("sfk_lead + ", "sfk_vend", "", "sfk_mid", "sfk_lead"),
             True: PeelSpan("sfk_vb + ", "sfk_ve", "sfk_qb + ", "sfk_qe", "sfk_vb")}


@dataclass(frozen=True)
class Peel:
    """A peeled vector path: ``vec`` elements a chunk, the vector ``loads`` and ``stores``
    (by name, as ``eligible_vector_access`` names them), the runtime ``conds`` (the
    buffers' alignment) and the rows' start ``rest`` they share."""

    vec: int
    loads: dict[Load, str]
    stores: dict[Store, str]
    conds: list[str]
    rest: sympy.Expr


def why_not_peeled(ir: KernelIR, layout: str) -> str | None:
    """Why a row reduction in ``layout`` cannot be peeled (the layout, its reduced
    indices, its rows' length); None where it can, as far as these go (``peeled_access``
    then looks at its accesses). Rows of up to 32 go one thread a row; PEEL_MIN_K is
    above that."""
    d = ir.domain
    if layout not in ("inner", "cluster"):
        return f"the {layout} layout (only the inner and cluster ones are peeled)"
    if len(d.red_vars) != 1:
        return f"{len(d.red_vars)} reduced indices (one is peeled)"
    extent = sympy.sympify(d.red_extents[0])
    if extent.is_Integer and int(extent) < PEEL_MIN_K:
        return f"rows of {int(extent)} elements, fewer than {PEEL_MIN_K}"
    return None


def peeled_access(k, ir: KernelIR, loads: list[Load], stores: list[Store]) -> Peel | None:
    """The peeled vector path of a row reduction that ``why_not_peeled`` allows and that
    has no aligned one; None where no access steps with the reduced index."""
    d = ir.domain
    var = d.red_vars[0]
    groups: dict[sympy.Expr, tuple[list[Load], list[Store]]] = {}
    for ld in dict.fromkeys(loads):
        if along(ld.offset, var):
            groups.setdefault(sympy.expand(ld.offset - var), ([], []))[0].append(ld)
    for st in stores:
        if not st.guards and along(st.offset, var):
            groups.setdefault(sympy.expand(st.offset - var), ([], []))[1].append(st)
    if not groups:
        return None
    # the rows' own data (a start that moves with the row) before what every row reads
    # alike (a LayerNorm's weight), then the largest group; the first found on a tie
    rows = set(d.row_vars)
    rest, (g_loads, g_stores) = max(groups.items(), key=lambda kv: (
        bool(kv[0].free_symbols & rows), len(kv[1][0]) + len(kv[1][1])))
    sizes = [itemsize(ld.dtype) for ld in g_loads]
    sizes += [itemsize(ir.outputs[st.out].dtype) for st in g_stores]
    vec = 16 // max(sizes)
    if vec < 2:
        return None
    vloads = {ld: f"v{ld.buf}_{j}" for j, ld in enumerate(g_loads)}
    vstores = {st: f"vout{st.out}_{j}" for j, st in enumerate(g_stores)}
    bufs = {ld.buf: itemsize(ld.dtype) for ld in g_loads}
    bufs.update({k.out_names[st.out]: itemsize(ir.outputs[st.out].dtype) for st in g_stores})
    conds = [f"sfk_aligned({name}, {vec * size})" for name, size in bufs.items()]
    return Peel(vec, vloads, vstores, conds, rest)


def row_bounds(peel: Peel, em: ExprEmitter, row: Scope, IDX: str,
               cluster: bool = False) -> list[str]:
    """The row's head length ``sfk_lead`` (elements before the first aligned one; the
    ``%`` is C's, so a negative start also gives 0..VEC-1), the length of its aligned
    middle ``sfk_mid`` and its end ``sfk_vend``, and ``sfk_edge``, the head's and tail's
    elements together (``cluster``: the first block's only)."""
    v = peel.vec
    start = em.index(peel.rest, row)
    edge = "sfk_lead + (Kr - sfk_vend)"
    return [f"    const {IDX} sfk_lead0 = ({IDX})(({v} - ({start}) % {v}) % {v});",
            f"    const {IDX} sfk_lead = Kr < sfk_lead0 ? Kr : sfk_lead0;",
            f"    const {IDX} sfk_mid = ((Kr - sfk_lead) / {v}) * {v};",
            f"    const {IDX} sfk_vend = sfk_lead + sfk_mid;",
            f"    const {IDX} sfk_edge = " + (f"sfk_rank == 0u ? {edge} : 0;" if cluster
                                             else f"{edge};")]


def cluster_middle(IDX: str, vec: int, blocks: int) -> list[str]:
    """A cluster block's share of a peeled row's aligned middle (``PEEL_SPAN[True]``):
    whole chunks, in rank order, from ``sfk_qb`` to ``sfk_qe`` of the middle, which are
    the row's elements ``sfk_vb`` to ``sfk_ve``."""
    return [f"    const {IDX} sfk_qshare = ((sfk_mid + {blocks * vec - 1}) / {blocks * vec}) * {vec};",
            f"    const {IDX} sfk_qb = ({IDX})sfk_rank * sfk_qshare;",
            f"    const {IDX} sfk_qe = sfk_mid - sfk_qb < sfk_qshare ? sfk_mid : sfk_qb + sfk_qshare;",
            f"    const {IDX} sfk_vb = sfk_lead + sfk_qb;",
            f"    const {IDX} sfk_ve = sfk_lead + sfk_qe;"]


def middle_loop(IDX: str, vec: int, ind: str, span: PeelSpan) -> list[str]:
    """The head of the loop over the aligned middle's chunks (``span``'s): counted in the
    middle and offset by ``sfk_lead`` inside, rather than from ``sfk_lead`` to
    ``sfk_vend`` (nvcc 13, sm_90a, L1 38's kernel: 4 vector loads a pass unrolled as in
    the aligned template and 42 registers, against 7 and 56)."""
    return [f"{ind}#pragma unroll 4",
            f"{ind}for ({IDX} q0 = {span.q_lo}({IDX})tk * {vec}; q0 < {span.q_hi}; "
            f"q0 += ({IDX})TK * {vec}) {{",
            f"{ind}  const {IDX} k0 = sfk_lead + q0;"]


def edge_loop(k, row: Scope, red_vars: list, red_extents: list, body, ind: str) -> list[str]:
    """The head's and tail's elements of a peeled row, one a thread: ``body`` for element
    ``kk`` of each (as the scalar pass emits it: every store its own)."""
    IDX = k.IDX
    edge = Scope(row, {sympy.Symbol("e"), sympy.Symbol("kk")}, ind + "  ")
    el = Scope(edge, set(red_vars), ind + "  ")
    el.pre += k.delinearize("kk", list(red_vars), list(red_extents), ind + "  ")
    body(el)
    return ([f"{ind}for ({IDX} e = tk; e < sfk_edge; e += TK) {{",
             f"{ind}  const {IDX} kk = e < sfk_lead ? e : sfk_vend + (e - sfk_lead);"]
            + edge.render() + el.render() + [f"{ind}}}"])
