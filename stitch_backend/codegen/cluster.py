"""The ``cluster`` reduction layout's constants and shared-memory rows (sm_90 and later):
``emit_reduction`` emits the layout, this module says what it keeps of each row in a
block's shared memory between the passes, and how the passes read it."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import sympy

from .emit_expr import ExprEmitter, compute_ctype
from .kernel_ir import KernelIR, Load, walk
from .persist import BYTES, fill_or_use, pass_bodies, read_again

# The ``cluster`` layout (sm_90 and later): the CLUSTER blocks of a thread-block cluster
# share each row, a contiguous share each, and combine their parts in rank order through
# distributed shared memory (``sfk_cluster_reduce``: deterministic, no atomics). The
# ``inner`` layout's block a row keeps about 2 rows an SM in flight, 400 MB for the 1.5 MB
# rows of a softmax over 393216 elements, so each later pass reads the row from DRAM
# again; a cluster's share of a row fits in its blocks' shared memory (CLUSTER_SMEM):
# the vector path keeps its chunks as loaded, the scalar path (unaligned rows) each
# element's value. Without that (shares too large, lengths not static) the later passes
# re-read the row, perhaps from L2: on an H100 (session 31) that form lost L1 23's softmax
# (8.58 ms against the template's 6.65) and won an instance norm over rows of 262144
# (8.92 against 10.17). The Coder proposes it for long rows beside the template
# (``launch_alternatives.cluster_rows``); the Verifier keeps the faster.
CLUSTER = 8
# Where the row's share of the loads that later passes read again fits in this much
# dynamic shared memory a block, the first pass keeps it there and the later passes read
# it from there: the row is read from memory once. (On an H100, kb/tune/cluster_softmax.py:
# a softmax over 4096 rows of 393216 fp32, 8 blocks of 1024 threads a row, took 4.67 ms
# so, 6.10 re-reading the row through L2, against the template's 6.65 and eager's 8.65.)
CLUSTER_SMEM = 200 * 1024


def _share(ir: KernelIR, vec: int) -> int:
    """Elements of a static row that one block of a cluster takes (whole vector chunks)."""
    n = int(sympy.Mul(*ir.domain.red_extents))
    return -(-n // (CLUSTER * vec)) * vec


@dataclass
class RowsKept:
    """The cluster layout's shared-memory rows: per pass over a row (the phases, then the
    element stores), the loads it keeps there ("fill") or reads from there ("use"):
    ``vector`` by vector name (the vector path keeps the chunks as loaded), ``scalar`` by
    load, with its slot's name ``sfk_rsN`` (the scalar path keeps each element's value in
    its compute type); ``buffers``:
    each kept load's byte offset in the block's dynamic shared memory, ``nbytes`` in all.
    A row takes one path or the other, so both views of a load share its bytes."""

    vector: list[dict[str, str]]
    scalar: list[dict[Load, tuple[str, str]]]
    buffers: dict[Load, int]
    nbytes: int


def cluster_rows_kept(k, ir: KernelIR, vec: int, vloads: dict, phases: list[int],
                      elem_stores: list) -> RowsKept | None:
    """What the ``cluster`` layout keeps of each row in shared memory: the per-element
    loads (along the innermost reduced index) that two passes read; None where there are
    none, the row's length is not static, or a block's share does not fit CLUSTER_SMEM."""
    d = ir.domain
    if not sympy.Mul(*d.red_extents).is_Integer or d.red_limit is not None:
        return None
    last = d.red_vars[-1]
    used = [{n for n in walk(b) if isinstance(n, Load) and last in n.offset.free_symbols}
            for b in pass_bodies(ir, phases, elem_stores)]
    again = sorted(read_again(used), key=repr)
    if not again:
        return None
    share = _share(ir, vec)
    buffers, nbytes = {}, 0
    for ld in again:
        buffers[ld] = nbytes
        width = max(BYTES[k.ptr[ld.buf]], BYTES[compute_ctype(ld.dtype)])
        nbytes += -(-share * width // 16) * 16
    if nbytes > CLUSTER_SMEM:
        return None
    slots = {ld: f"sfk_rs{n}" for n, ld in enumerate(buffers)}
    plan = fill_or_use(used, buffers)
    return RowsKept([{vloads[ld]: m for ld, m in modes.items() if ld in vloads} for modes in plan],
                    [{ld: (m, slots[ld]) for ld, m in modes.items()} for modes in plan],
                    buffers, nbytes)


@contextmanager
def kept_scalars(em: ExprEmitter, kept, index: str, deps: set) -> Iterator[None]:
    """While the scalar path emits one pass: its kept loads' values read from, or also
    written to, ``slot[index]`` (the element's place in the block's share); the emitter
    forgets them after."""
    if kept:
        em.fills = {ld: f"{slot}[{index}]" for ld, (m, slot) in kept[1].items() if m == "fill"}
        em.value_uses = {ld: f"{slot}[{index}]" for ld, (m, slot) in kept[1].items()
                         if m == "use"}
        em.override_deps = set(deps)
    try:
        yield
    finally:
        em.value_uses, em.fills = {}, {}
        if kept:
            em.override_deps = set()


__all__ = ["CLUSTER", "CLUSTER_SMEM", "RowsKept", "cluster_rows_kept", "kept_scalars"]
