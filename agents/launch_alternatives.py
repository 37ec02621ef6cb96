"""Alternatives of a Coder candidate that differ from it only in how a reduction kernel
is laid out, launched or summed (the Verifier races each against the candidate and keeps
the fastest): the column and staged layouts of a reduction that writes across its rows,
the narrow launch of a column reduction over few rows, the lean launch of one over
short rows, variances over long rows in one pass, long rows shared by the blocks of
a cluster, and rows of an odd length read in vectors after a scalar head. ``coder`` is the
TemplateCoder (its ``sm_count`` and ``_candidate``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import sympy

from stitch_backend.codegen.fused import Unsupported, generate
from stitch_backend.regions import region_module

from .state import Candidate, Stage, Subtask

log = logging.getLogger("stitch_backend.agents.coder")


def row_write_layouts(coder: Any, subtask: Subtask, stages: list[Stage]) -> list[Candidate]:
    """The candidate again with each of its reduction kernels that reads rows
    contiguously but writes along the rows (``emit_reduction.stores_across_rows``)
    in the ``column`` layout instead, and again in the ``staged`` layout
    (``emit_staged``, where its rows fit in shared memory); none where no kernel is
    such."""
    from stitch_backend.codegen.emit_reduction import stores_across_rows
    from stitch_backend.codegen.emit_staged import why_not_staged

    if not any(s.kernel is not None and stores_across_rows(s.kernel.ir) for s in stages):
        return []
    found = []
    for layout, suffix, applies in (
            ("column", "col", lambda k: stores_across_rows(k.ir)),
            ("staged", "stg", lambda k: why_not_staged(k.ir) is None)):
        cand = _swapped(coder, subtask, stages, applies, suffix, layout=layout)
        if cand is not None:
            found.append(cand)
    return found


def narrow_columns(coder: Any, subtask: Subtask, stages: list[Stage]) -> list[Candidate]:
    """The candidate again with each column-layout reduction over fewer static rows
    than eight a block gives the SMs (a channels-last BatchNorm of 128 channels: 16
    blocks) launched ``narrow`` (``FusedKernel.narrow``: one row a block there, 128
    blocks); none where no kernel is such. The Verifier keeps the faster launch."""
    def few_rows(kernel: Any) -> bool:
        if getattr(kernel, "ir", None) is None or getattr(kernel, "emitted", None) is None \
                or kernel.emitted.layout != "column":
            return False
        rows = sympy.Mul(*kernel.ir.domain.row_extents)
        return bool(rows.is_Integer) and int(rows) < 8 * coder.sm_count

    return _relaunched(coder, subtask, stages, [s for s in stages if s.kernel is not None
                                                and few_rows(s.kernel)], "nrw", narrow=True)


# The lean launch is offered for short rows in plenty: at most LEAN_MAX_K elements, and
# rows enough for 32 a block on every SM (a softmax or logsumexp over the channels of an
# NCHW value). Not for a BatchNorm's channels as rows (few rows: its launch was tuned
# with the narrow and split alternatives), nor for a split's partial sums (only a split's
# last stage, the reduction that normalises, is offered it).
LEAN_MAX_K = 256


def lean_columns(coder: Any, subtask: Subtask, stages: list[Stage], name: str | None = None,
                 outputs: list[str] | None = None, last_only: bool = False) -> list[Candidate]:
    """The candidate of ``stages`` (the template's, or, ``last_only``, a split-statistics
    alternative's named ``name`` with region outputs ``outputs``) again with each of its
    column-layout reductions over short rows in plenty (``LEAN_MAX_K``) launched ``lean``
    (``FusedKernel.lean``: LEAN_CHUNKS elements a thread and pass, fewer threads a row);
    none where no kernel is such. The kernels are the template's, renamed (``_ln``): only
    the launch differs, and the Verifier keeps the faster."""
    from stitch_backend.codegen.fused import column_shape

    def short_rows(kernel: Any) -> bool:
        ir, em = getattr(kernel, "ir", None), getattr(kernel, "emitted", None)
        if ir is None or em is None or em.layout != "column" or kernel.narrow or kernel.lean:
            return False
        rows, n = sympy.Mul(*ir.domain.row_extents), sympy.Mul(*ir.domain.red_extents)
        if not (rows.is_Integer and n.is_Integer and int(n) <= LEAN_MAX_K
                and int(rows) >= 32 * coder.sm_count):
            return False
        return (column_shape(int(rows), int(n), coder.sm_count)
                != column_shape(int(rows), int(n), coder.sm_count, lean=True))

    eligible = [s for s in (stages[-1:] if last_only else stages)
                if s.kernel is not None and short_rows(s.kernel)]
    return _relaunched(coder, subtask, stages, eligible, "ln", name, outputs, lean=True)


def _relaunched(coder: Any, subtask: Subtask, stages: list[Stage], eligible: list[Stage],
                suffix: str, name: str | None = None, outputs: list[str] | None = None,
                **launch: Any) -> list[Candidate]:
    """The candidate of ``stages`` (named ``name``, the region's by default, plus
    ``_suffix``) with the kernel of each ``eligible`` stage renamed ``_suffix`` and
    launched with ``launch`` (``FusedKernel``'s launch flags): the same source but its
    name, nothing generated again; none where no stage is eligible."""
    if not eligible:
        return []
    swapped = [Stage(s.region, module=s.module, kernel=dataclasses.replace(
                   s.kernel.renamed(f"{s.kernel.name}_{suffix}"), **launch))
               if any(s is e for e in eligible) else s for s in stages]
    return [coder._candidate(subtask, f"{name or subtask.region_name}_{suffix}", swapped,
                             list(outputs if outputs is not None else subtask.region.outputs))]


# Rows of at least this many elements get the single-pass statistics alternative: 64 KB
# of fp32 a row, more than stays in an SM's L1 between the template's passes while other
# rows stream through it (reasoned, not measured).
SINGLE_PASS_MIN_LEN = 16384


def single_pass_stats(coder: Any, subtask: Subtask, stages: list[Stage]) -> list[Candidate]:
    """The candidate again with each reduction kernel whose variance over long static
    rows (a norm's statistics) takes two passes, the mean and then the squared
    deviations, generated with one (``generate(single_pass_stats=True)``): the row is
    read twice instead of three times. None where no kernel is such."""
    def long_two_pass(kernel: Any) -> bool:
        ir = getattr(kernel, "ir", None)
        if ir is None or not ir.is_reduction or len({r.phase for r in ir.inner_reductions}) < 2:
            return False
        n = sympy.Mul(*ir.domain.red_extents)
        return bool(n.is_Integer) and int(n) >= SINGLE_PASS_MIN_LEN

    def fewer_phases(old: Any, new: Any) -> bool:   # a softmax's max-then-sum stays as it is
        return len({r.phase for r in new.ir.inner_reductions}) < len(
            {r.phase for r in old.ir.inner_reductions})

    cand = _swapped(coder, subtask, stages, long_two_pass, "sp", differs=fewer_phases,
                    single_pass_stats=True)
    return [] if cand is None else [cand]


# Rows of at least this many elements get the cluster alternative (reasoned from the
# L2's size, not measured: a block a row keeps about two rows an SM in flight, 17 MB of
# such rows on 132 SMs; shorter rows stay in L2 between the passes anyway).
CLUSTER_MIN_LEN = 16384


def cluster_rows(coder: Any, subtask: Subtask, stages: list[Stage]) -> list[Candidate]:
    """The candidate again (``_cl_r``) with each inner-layout reduction over long static
    rows (``CLUSTER_MIN_LEN``) that reads its rows more than once (several phases, or
    element stores after them: a softmax, a norm) in the ``cluster`` layout
    (``codegen.cluster``: a thread-block cluster a row, each block's share of the row kept
    in shared memory between the passes), launched resident, and again (``_clf_r``) with
    its fp32 exponentials and divisions by the row's values in their fast forms
    (``codegen.fast_math``: such a kernel is bound by its instructions, no longer by
    memory); none where the Coder's target has no
    clusters (before sm_90), no kernel is such, or no such kernel's share fits in shared
    memory (``codegen.cluster.cluster_rows_kept``). Rows with no aligned vector path (an
    odd length: L1 38/39's 65535) are peeled (``codegen.peel``: each block's share of the
    aligned middle in 16-byte chunks), where they can be: their cluster kernel of one
    element a thread and step lost to the peeled template (``_pl``) on an H100 (session
    39: L1 38 9.63 ms against 9.15, L1 39 9.74 against 9.17; the template 9.71, 9.81)."""
    if not getattr(coder, "clusters", False):
        return []
    from stitch_backend.codegen.emit_reduction import why_not_cluster
    from stitch_backend.codegen.peel import why_not_peeled

    def long_rows(kernel: Any) -> bool:
        ir, em = getattr(kernel, "ir", None), getattr(kernel, "emitted", None)
        if ir is None or em is None or em.layout != "inner" or em.serial:
            return False
        n = sympy.Mul(*ir.domain.red_extents)
        passes = len({r.phase for r in ir.inner_reductions}) + any(
            s.level == "element" for s in ir.stores)
        return (bool(n.is_Integer) and int(n) >= CLUSTER_MIN_LEN and passes > 1
                and why_not_cluster(ir) is None)

    def kept(old: Any, new: Any) -> bool:
        # only where the share stays in shared memory: re-reading the row through L2
        # lost L1 23's softmax and L1 38/39's norms on an H100 (codegen/cluster.py)
        return new.emitted.shared_mem > 0

    def odd_rows(kernel: Any) -> dict:   # each kernel's own: peel rows with no vector path
        return {"peel": kernel.emitted.vec == 1 and why_not_peeled(kernel.ir, "cluster") is None}

    peels = any(s.kernel is not None and long_rows(s.kernel) and odd_rows(s.kernel)["peel"]
                for s in stages)
    found = []
    for suffix, fast in (("cl", False), ("clf", True)):
        cand = _swapped(coder, subtask, stages, long_rows, suffix, differs=kept,
                        per_kernel=odd_rows, layout="cluster", fast_math=fast)
        if cand is None and peels:   # odd rows that peel refused: their unpeeled kernel
            cand = _swapped(coder, subtask, stages, long_rows, suffix, differs=kept,
                            layout="cluster", fast_math=fast)
        if cand is not None:
            found += _resident(coder, subtask, stages, cand, suffix)
    return found


def _resident(coder: Any, subtask: Subtask, stages: list[Stage], cand: Candidate,
              suffix: str) -> list[Candidate]:
    """``cand`` (``cluster_rows``'s) with its cluster kernels launched resident, renamed
    ``_r``."""
    # launched resident (``FusedKernel.resident``): as many clusters as fit at once, each
    # looping over rows, as the hand-written kernel of codegen/cluster.py's note is. Raced
    # beside the launch of a cluster a row on an H100 (session 39, KernelBench L1 23, 38,
    # 39): 8.07 ms against 8.52, 9.63 against 9.79, 9.74 against 9.79; that launch is no
    # longer offered
    cl_stages = cand.stages or [Stage(stages[0].region, kernel=cand.kernel,
                                      module=stages[0].module)]
    return _relaunched(coder, subtask, cl_stages, [
        s for s in cl_stages if s.kernel is not None and s.kernel.emitted.layout == "cluster"],
        "r", f"{subtask.region_name}_{suffix}", resident=True)


def peeled_rows(coder: Any, subtask: Subtask, stages: list[Stage]) -> list[Candidate]:
    """The candidate again with each inner-layout reduction whose rows have no aligned
    vector path (an odd row length: L1 38/39's 65535) and at least
    ``codegen.peel.PEEL_MIN_K`` elements generated with its rows peeled
    (``codegen.peel``: a scalar head to the first aligned element, 16-byte chunks over
    the rest); none where no kernel is such. Raced beside the template's one element a
    thread and step (whose loads ``batched_loads`` issues ahead); on an H100 (session 39)
    it won L1 38 (9.15 ms against 9.71) and 39 (9.17 against 9.81)."""
    from stitch_backend.codegen.peel import why_not_peeled

    def odd_rows(kernel: Any) -> bool:
        ir, em = getattr(kernel, "ir", None), getattr(kernel, "emitted", None)
        return (ir is not None and em is not None and em.vec == 1
                and why_not_peeled(ir, em.layout) is None)

    cand = _swapped(coder, subtask, stages, odd_rows, "pl", peel=True)
    return [] if cand is None else [cand]


def _swapped(coder: Any, subtask: Subtask, stages: list[Stage], applies: Callable[[Any], bool],
             suffix: str, differs: Callable[[Any, Any], bool] | None = None,
             per_kernel: Callable[[Any], dict] | None = None, **how: Any) -> Candidate | None:
    """The candidate named ``REGION_suffix`` whose kernels that ``applies`` to are
    generated again with ``how`` (``codegen.fused.generate``'s keywords; and each kernel's
    own from ``per_kernel``) under their name plus ``_suffix`` (kept only where
    ``differs(old, new)``, when given); None where no kernel changes or one of them cannot
    be generated so."""
    swapped, changed = [], False
    for stage in stages:
        kernel = stage.kernel
        if kernel is not None and applies(kernel):
            module = region_module(subtask.graph, stage.region)
            try:
                new = generate(module, f"{kernel.name}_{suffix}", sm_count=coder.sm_count,
                               **how, **(per_kernel(kernel) if per_kernel else {}))
            except Unsupported as err:
                log.debug("no %s candidate for %s (%s): %s", suffix, subtask.region_name,
                          how, err)
                return None
            if differs is None or differs(kernel, new):
                kernel, changed = new, True
        swapped.append(Stage(stage.region, kernel=kernel, module=stage.module))
    if not changed:
        return None
    return coder._candidate(subtask, f"{subtask.region_name}_{suffix}", swapped,
                            list(subtask.region.outputs))


__all__ = ["cluster_rows", "lean_columns", "narrow_columns", "row_write_layouts",
           "single_pass_stats"]
