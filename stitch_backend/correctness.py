"""The correctness rule: a candidate's output against eager's and against an fp64 run.

Two verdicts from one comparison:

- KernelBench's: every output has eager's shape and dtype and
  ``torch.allclose(out, eager, atol, rtol)`` (fp32: 1e-4; fp16/bf16: 1e-2; NaN anywhere
  fails, as ``allclose`` without ``equal_nan`` does in KernelBench).
- DESIGN.md's: per output, within the same tolerance of eager, or a normalised max error
  against the fp64 reference at most ``factor`` (2) times eager's own; NaN/Inf only
  where eager has them; shapes, dtypes and strides (of dimensions longer than 1) as
  eager's. Normalised max error = max|x - fp64| / max|fp64| (plain max|x - fp64| when the
  reference is all zero).

One rule for the whole project: the Verifier judges candidates with it, the bench judges
backends, the demo judges its example. Torch only: it imports nothing from the backend.

The fp64 run of an ATen graph (``run_fp64``) upcasts the floating-point inputs and, while
it runs, turns every cast to a floating type, and every floating dtype an op is told to
produce, into float64: a graph traced under autocast converts its inputs to bf16 itself,
and without this its "fp64" run would round exactly where eager rounds, so eager's own
error would read as 0 and any other rounding as wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
_DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Comparison:
    """One candidate output judged against eager (and fp64); ``reason`` says why."""

    ok_kernelbench: bool
    ok_design: bool
    max_abs: float          # max |out - eager| over all outputs (inf on shape/NaN mismatch)
    norm_err: float         # max over outputs of out's normalised error vs fp64 (nan: no fp64)
    eager_norm_err: float   # the same for eager (nan: no fp64)
    reason: str


def flatten_outputs(x: Any) -> list[Any]:
    """Leaves of a model output in a fixed order (tuples, lists, dicts by insertion order)."""
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in flatten_outputs(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in flatten_outputs(item)]
    return [x]


def tolerance_for(dtype: torch.dtype) -> float:
    """atol = rtol used for outputs of ``dtype`` (fp32/fp64: 1e-4, fp16/bf16: 1e-2)."""
    return _TOLERANCE.get(dtype, _DEFAULT_TOLERANCE)


def upcast(inputs: Any) -> list[Any]:
    """Floating-point tensors as float64 (the reference run), everything else as is."""
    return [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in inputs]


def run_fp64(fn: Any, inputs: Any) -> Any:
    """``fn`` (ATen ops) on ``inputs`` upcast to float64, its own casts to floating types
    made to float64 too (see the module's notes)."""
    with _Float64Casts():
        return fn(*upcast(inputs))


class _Float64Casts(TorchDispatchMode):
    """Every floating dtype an ATen op is asked to produce becomes float64 (integer and
    bool ones, bit reinterpretations such as ``view.dtype``, and random draws, which
    would give other numbers in float64, stay as they are)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded in func.tags:
            return func(*args, **kwargs)   # random draws: eager's numbers, not fp64 ones
        if _lowered(kwargs.get("dtype")):
            kwargs["dtype"] = torch.float64
        if func is torch.ops.prims.convert_element_type.default and _lowered(args[1]):
            args = (args[0], torch.float64, *args[2:])
        elif func in _HALF_TO_FLOAT and len(args) > 2 and args[2] and (
                args[0].dtype == torch.float64):
            args = (args[0], args[1], False, *args[3:])   # its input is no longer half
        return func(*args, **kwargs)


_HALF_TO_FLOAT = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


def _lowered(dtype: Any) -> bool:
    return (isinstance(dtype, torch.dtype) and dtype.is_floating_point
            and dtype != torch.float64)


def compare(out: Any, ref_eager: Any, ref_fp64: Any | None, *, factor: float = 2.0,
            tol: float | None = None) -> Comparison:
    """Judge ``out`` (a tensor or nested tuple/list/dict of them) against eager's output and
    the fp64 run's (``None`` when there is none: the DESIGN rule then needs 1e-4 of eager).

    ``tol`` overrides the per-dtype tolerance. Never raises on mismatched outputs: the
    mismatch is the verdict's reason.
    """
    outs, eagers = flatten_outputs(out), flatten_outputs(ref_eager)
    fp64s = flatten_outputs(ref_fp64) if ref_fp64 is not None else None
    if len(outs) != len(eagers):
        return Comparison(False, False, math.inf, math.nan, math.nan,
                          f"{len(outs)} outputs, eager returns {len(eagers)}")
    if fp64s is not None and len(fp64s) != len(eagers):
        fp64s = None                    # judged as "no fp64 reference" below, with the why
        no_fp64_why = f"fp64 run returned {len(flatten_outputs(ref_fp64))} outputs"
    else:
        no_fp64_why = "no fp64 reference"

    ok_kb = ok_design = True
    max_abs = 0.0
    norm_err = eager_norm_err = math.nan if fp64s is None else 0.0
    failures: list[str] = []
    kb_only: list[str] = []     # beyond KernelBench's tolerance, within DESIGN.md's rule
    passes: list[str] = []
    for i, (o, e) in enumerate(zip(outs, eagers)):
        r = fp64s[i] if fp64s is not None else None
        leaf = _compare_leaf(o, e, r, factor=factor, tol=tol, no_fp64_why=no_fp64_why)
        ok_kb &= leaf.ok_kernelbench
        ok_design &= leaf.ok_design
        max_abs = _nanmax(max_abs, leaf.max_abs)
        if fp64s is not None:
            norm_err = _nanmax(norm_err, leaf.norm_err)
            eager_norm_err = _nanmax(eager_norm_err, leaf.eager_norm_err)
        label = f"output {i}: " if len(outs) > 1 else ""
        (passes if leaf.ok_kernelbench and leaf.ok_design else
         kb_only if leaf.ok_design else failures).append(label + leaf.reason)
    # the outputs that fail DESIGN.md's rule first: they are what a reader looks for
    failures += kb_only
    reason = "; ".join(failures[:3]) + (f"; ... {len(failures) - 3} more" if len(failures) > 3 else "")
    if not failures:
        reason = passes[0] if len(passes) == 1 else f"all {len(passes)} outputs: " + "; ".join(
            sorted(set(p.split(": ", 1)[-1] for p in passes)))
    return Comparison(ok_kb, ok_design, max_abs, norm_err, eager_norm_err, reason)


def _compare_leaf(o: Any, e: Any, r: Any, *, factor: float, tol: float | None,
                  no_fp64_why: str) -> Comparison:
    nan = math.nan
    if not isinstance(e, torch.Tensor) or not isinstance(o, torch.Tensor):
        if isinstance(e, torch.Tensor) != isinstance(o, torch.Tensor):
            return Comparison(False, False, math.inf, nan, nan,
                              f"{type(o).__name__} where eager returns {type(e).__name__}")
        same = o == e or (isinstance(o, float) and isinstance(e, float)
                          and math.isclose(o, e, rel_tol=_DEFAULT_TOLERANCE,
                                           abs_tol=_DEFAULT_TOLERANCE))
        return Comparison(bool(same), bool(same), 0.0 if same else math.inf, 0.0, 0.0,
                          "equal non-tensor output" if same else f"{o!r} != eager's {e!r}")
    if o.shape != e.shape:
        return Comparison(False, False, math.inf, nan, nan,
                          f"shape {tuple(o.shape)} != eager's {tuple(e.shape)}")
    if o.dtype != e.dtype:
        return Comparison(False, False, math.inf, nan, nan, f"dtype {o.dtype} != eager's {e.dtype}")
    t = tol if tol is not None else tolerance_for(e.dtype)
    o_, e_ = o.detach(), e.detach().to(o.device)

    if not (e_.is_floating_point() or e_.is_complex()):
        equal = torch.equal(o_, e_)
        return Comparison(equal, equal, 0.0 if equal else math.inf, 0.0, 0.0,
                          "equal" if equal else "integer/bool output differs from eager")

    stride_why = _stride_mismatch(o_, e_)
    acc = _Accumulator()
    ro = r.detach() if isinstance(r, torch.Tensor) and r.shape == o_.shape else None
    # In chunks, in fp64: KernelBench's level-1 outputs reach several GB, and the
    # fp64 temporaries of a whole-tensor comparison would not fit beside them.
    fo, fe = o_.reshape(-1), e_.reshape(-1)
    fr = ro.reshape(-1) if ro is not None else None
    for lo in range(0, fo.numel(), _CHUNK):
        hi = min(lo + _CHUNK, fo.numel())
        acc.add(fo[lo:hi], fe[lo:hi], fr[lo:hi].to(fo.device) if fr is not None else None, t)
    acc.finish()
    ok_kb = acc.allclose
    max_abs = acc.max_abs
    norm, enorm = acc.norm_errors(usable=ro is not None)
    if acc.n_bad or stride_why:
        why = (f"{acc.n_bad} NaN/Inf where eager has none" if acc.n_bad else stride_why)
        return Comparison(ok_kb and not acc.n_bad, False, max_abs, norm, enorm, why)
    if acc.within:
        return Comparison(ok_kb, True, max_abs, norm, enorm, f"within {t:g} of eager")
    if r is None or math.isnan(norm):
        why = no_fp64_why if r is None else "fp64 reference unusable (shape/values)"
        return Comparison(ok_kb, False, max_abs, norm, enorm,
                          f"max |diff| {max_abs:.3g} beyond {t:g} of eager and {why}")
    if norm <= factor * enorm:
        return Comparison(ok_kb, True, max_abs, norm, enorm,
                          f"beyond {t:g} of eager (max |diff| {max_abs:.3g}) but as close to fp64 "
                          f"as eager: norm err {norm:.3g} <= {factor:g} x eager's {enorm:.3g}")
    return Comparison(ok_kb, False, max_abs, norm, enorm,
                      f"max |diff| {max_abs:.3g} beyond {t:g} of eager; norm err vs fp64 "
                      f"{norm:.3g} > {factor:g} x eager's {enorm:.3g}")


_CHUNK = 1 << 24


class _Accumulator:
    """The comparison's statistics gathered chunk by chunk (same results as whole-tensor).

    Each chunk's statistics stay on the tensors' device until ``finish()``, which reads
    them all back at once: one device synchronisation a leaf, not several a chunk (a
    graph's verification compares thousands of leaves)."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self.allclose = True
        self.max_abs = 0.0
        self.n_bad = 0
        self.within = True
        self.out_err = 0.0      # max |out - fp64| where eager, fp64 and out are finite
        self.eager_err = 0.0
        self.scale = 0.0        # max |fp64| there
        self.any_masked = False

    def add(self, o: torch.Tensor, e: torch.Tensor, r: torch.Tensor | None, t: float) -> None:
        od, ed = o.double(), e.double()
        o_fin, e_fin = torch.isfinite(od), torch.isfinite(ed)
        same_nonfinite = (torch.isnan(od) & torch.isnan(ed)) | (torch.isinf(od) & (od == ed))
        both_fin = o_fin & e_fin
        absdiff = (od - ed).abs()
        diff = torch.where(both_fin, absdiff, 0.0)
        diff = torch.where(~both_fin & ~same_nonfinite, math.inf, diff)
        stats = [
            torch.isclose(o, e, rtol=t, atol=t).all(),          # torch.allclose, unsynced
            _amax(diff),
            (~o_fin & ~same_nonfinite).sum(),
            torch.where(e_fin, absdiff <= t + t * ed.abs(), True).all(),
        ]
        if r is not None:
            rd = r.double()
            mask = e_fin & torch.isfinite(rd) & o_fin
            stats += [mask.any(), _amax(torch.where(mask, rd.abs(), 0.0)),
                      _amax(torch.where(mask, (od - rd).abs(), 0.0)),
                      _amax(torch.where(mask, (ed - rd).abs(), 0.0))]
        self._parts.append(torch.stack([s.double() for s in stats]))

    def finish(self) -> None:
        """Fold the chunks' statistics into the attributes (one read from the device)."""
        if not self._parts:
            return
        rows = torch.stack(self._parts).cpu().tolist()
        self._parts = []
        cols = list(zip(*rows))
        self.allclose &= all(cols[0])
        self.max_abs = max(self.max_abs, *cols[1])
        self.n_bad += int(sum(cols[2]))
        self.within &= all(cols[3])
        if len(cols) > 4:
            self.any_masked |= any(cols[4])
            self.scale = max(self.scale, *cols[5])
            self.out_err = max(self.out_err, *cols[6])
            self.eager_err = max(self.eager_err, *cols[7])

    def norm_errors(self, usable: bool) -> tuple[float, float]:
        if not usable:
            return math.nan, math.nan
        if not self.any_masked:
            return 0.0, 0.0
        scale = self.scale if self.scale > 0 else 1.0
        return self.out_err / scale, self.eager_err / scale


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max of ``x`` (0 for an empty chunk), left on its device."""
    return x.amax() if x.numel() else x.new_zeros(())


def _stride_mismatch(o: torch.Tensor, e: torch.Tensor) -> str:
    """Why strides differ (ignoring dimensions of size 1, whose stride means nothing), or ''."""
    if o.layout != torch.strided or e.layout != torch.strided:
        return ""
    so = [s for s, n in zip(o.stride(), o.shape) if n > 1]
    se = [s for s, n in zip(e.stride(), e.shape) if n > 1]
    return "" if so == se else f"strides {tuple(o.stride())} != eager's {tuple(e.stride())}"


def _nanmax(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)
