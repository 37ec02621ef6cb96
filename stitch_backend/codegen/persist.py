"""Persistent rows of the reduction template: which values a thread keeps in registers
between the passes over its row (``emit_reduction``), so that a later pass neither reads
the row from memory again nor recomputes what an earlier pass computed.

Two plans, each a list with one entry per pass (the reduction phases, then the element
stores):

- ``load_passes`` (the template's): the vector loads that later passes read again, kept
  as loaded. Declined where a pass calls a math function on each element (see below).
- ``value_passes`` (``generate(cache_values=True)``, not used by the Coder): the largest
  per-element values that a later pass needs and an earlier one computed, kept in the
  compute type. A softmax keeps its masked, scaled input after the maximum's pass and
  its exponentials after the sum's, so each element's ``exp`` is computed once and the
  last pass reads nothing: three loads and two exps an element become one and one.
  It lost on an H100 (session 26, ``kb/tune/rows512.py``, ms, L2 flushed): MiniGPT's
  masked softmax (128, 8, 512, 512) 1.112 against the streaming template's 0.919,
  softmax 524288x512 0.958 against 0.722, layer norm 65536x768 0.144 against 0.138
  (its template keeps the loads); fewer chunks a thread over more threads were slower
  still. The registers it holds (74 a thread at 256 threads a block for the masked
  softmax) cost more than the passes it saves, which L1 and L2 serve. So the Coder does
  not propose it; the option stays for tuning (``rows512.py``) and is tested.

Also measured slower on that softmax, and reverted (session 29, ``git log -S
sfk_ldv_unless``): loading a vector chunk of the scores only where one of its lanes takes
the branch of ``where(mask == 0, -inf, scores)`` that reads them, which skips about half
the reads of a causal mask. On the H200 (``kb/tune/skipbench.py``, one run, medians of
30): 0.945 ms with the load behind a branch, 0.968 as a predicated load, against 0.903
loading every chunk (eager 2.342). Each chunk's load then waits for its mask's; the
kernel is not limited by DRAM bandwidth here (2.4 TB/s of the H200's 4.8).
"""

from __future__ import annotations

import sympy

from .emit_expr import ExprEmitter, compute_ctype
from .kernel_ir import Expr, KernelIR, Load, Op, children, walk

# Persistent rows: where a row is read by more than one pass (softmax: its maximum, its
# sum of exponentials, its output; layer_norm: statistics, output), the vector path
# keeps each thread's chunks of the loads later passes read in registers, so the row
# is read from memory once. Only for rows of a static length that PERSIST_THREADS
# threads cover in PERSIST_CHUNKS chunks each (launch_shape gives a row ~4 a thread);
# such a kernel is bounded to PERSIST_THREADS threads a block, so that its registers
# are not capped at 64 (at 1024 threads, the cached softmax of L3 MiniGPT spilled), and
# caches at most PERSIST_REGS 32-bit registers of values a thread. Other rows take the
# streaming passes as before, and so do rows whose passes call a math function on each
# element (softmax's exp): on the H200 (kb/tune/rows.py, one run, one block per row
# group) the template's softmax streamed 524288x512 rows in 0.589 ms against 0.760
# persistent, 65536x1024 0.163 vs 0.205, 8192x4096 0.094 vs 0.116, while layer norm
# (no per-element math) kept its gain: 65536x768 0.112 persistent vs 0.117.
PERSIST_CHUNKS = 4
PERSIST_THREADS = 256
PERSIST_REGS = 64
_ELEMENT_MATH = frozenset({"exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh",
                           "erf", "erfc", "sin", "cos", "tan", "sinh", "cosh", "pow",
                           "sigmoid"})
BYTES = {"double": 8, "long long": 8, "float": 4, "int": 4, "__half": 2,
         "__nv_bfloat16": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def _short_row(ir: KernelIR, vec: int) -> bool:
    """A static row that PERSIST_THREADS threads cover in PERSIST_CHUNKS chunks each."""
    length = sympy.Integer(1)
    for e in ir.domain.red_extents:
        length *= sympy.sympify(e)
    return bool(length.is_Integer) and int(length) <= PERSIST_THREADS * vec * PERSIST_CHUNKS


def pass_bodies(ir: KernelIR, phases: list[int], elem_stores: list) -> list[list[Expr]]:
    bodies = [[r.body for r in ir.inner_reductions if r.phase == p] for p in phases]
    if elem_stores:
        bodies.append([st.value for st in elem_stores])
    return bodies


def load_passes(k, ir: KernelIR, vec: int, vloads: dict, phases: list[int],
                elem_stores: list) -> list[dict[str, str]] | None:
    """For each pass over a row (the reduction phases, then the element stores), which
    vector loads it fills into registers ("fill") or reads from them ("use"); None
    where no load is read by two passes, the row's length is not static or is too
    long, or the cached chunks would not fit."""
    if not _short_row(ir, vec):
        return None
    bodies = pass_bodies(ir, phases, elem_stores)
    if any(isinstance(n, Op) and n.name in _ELEMENT_MATH and any(
            isinstance(m, Load) for m in walk([n])) for b in bodies for n in walk(b)):
        return None
    used = [{n for n in walk(b) if isinstance(n, Load) and n in vloads} for b in bodies]
    again = read_again(used)
    if not again:
        return None
    regs = sum(max(1, vec * BYTES.get(k.ptr[ld.buf], 8) // 4) for ld in again) * PERSIST_CHUNKS
    if regs > PERSIST_REGS:
        return None
    return [{vloads[ld]: m for ld, m in modes.items()} for modes in fill_or_use(used, again)]


def read_again(used: list[set]) -> set:
    """The loads of ``used`` (each pass's loads) that a later pass reads again."""
    return {ld for i, u in enumerate(used) for ld in u
            if any(ld in later for later in used[i + 1:])}


def fill_or_use(used: list[set], kept) -> list[dict]:
    """Per pass, each of its ``kept`` loads: "fill" where it is first read (and kept),
    "use" where an earlier pass kept it."""
    plan, filled = [], set()
    for u in used:
        plan.append({ld: "use" if ld in filled else "fill" for ld in u if ld in kept})
        filled |= {ld for ld in u if ld in kept}
    return plan


def value_passes(ir: KernelIR, em: ExprEmitter, vec: int, phases: list[int],
                 elem_stores: list) -> list[tuple[dict[Expr, str], dict[Expr, str]]] | None:
    """For each pass over a row, (uses, fills): the per-element values it reads from a
    register array instead of computing them, and those it computes and keeps in one
    for a later pass, each mapped to its array's name (``cv0``, ``cv1``, ...). A value
    is per element where it depends on the innermost reduced index; each is the largest
    such sub-expression of a later pass that an earlier pass computed. None where the
    row is not short and static, no pass needs an earlier one's value, or the arrays
    live at once would take more than PERSIST_REGS registers."""
    if not ir.domain.red_vars or not _short_row(ir, vec):
        return None
    last = ir.domain.red_vars[-1]
    per_element: dict[Expr, bool] = {}

    def element(e: Expr) -> bool:
        if e not in per_element:
            per_element[e] = last in em.deps(e)
        return per_element[e]

    bodies = pass_bodies(ir, phases, elem_stores)
    computed: dict[Expr, int] = {}        # value -> the pass that computes it
    uses: list[set] = []
    for i, roots in enumerate(bodies):
        used: set = set()
        stack = list(roots)
        seen: set = set()
        while stack:
            e = stack.pop()
            if e in seen:
                continue
            seen.add(e)
            if e in computed and element(e):
                used.add(e)         # the largest: its parts are not computed here
                continue
            stack.extend(children(e))
            if element(e):
                computed.setdefault(e, i)
        uses.append(used)
    kept = sorted({e for u in uses for e in u}, key=lambda e: (computed[e], repr(e)))
    if not kept:
        return None
    name = {e: f"cv{n}" for n, e in enumerate(kept)}
    last_use = {e: max(i for i, u in enumerate(uses) if e in u) for e in kept}
    for boundary in range(len(bodies) - 1):
        live = [e for e in kept if computed[e] <= boundary < last_use[e]]
        regs = sum(vec * PERSIST_CHUNKS * max(1, BYTES.get(compute_ctype(e.dtype), 8) // 4)
                   for e in live)
        if regs > PERSIST_REGS:
            return None
    return [({e: name[e] for e in uses[i]},
             {e: name[e] for e in kept if computed[e] == i}) for i in range(len(bodies))]


__all__ = ["BYTES", "PERSIST_CHUNKS", "PERSIST_REGS", "PERSIST_THREADS", "fill_or_use",
           "load_passes", "pass_bodies", "read_again", "value_passes"]
