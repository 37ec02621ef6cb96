"""Channels-last convolutions: the memory layout of an inference graph's activations.

cuDNN's fast fp32/TF32 and half-precision convolution kernels on sm_80+ are NHWC. Fed
NCHW tensors, it wraps them in nchwToNhwc/nhwcToNchw transposes (measured on the H200:
L3 ResNetBasicBlock 1.80x faster on the GPU in channels-last, MobileNetV1 1.37x, RegNet
1.35x, EfficientNetB0 1.23x, ResNet18 1.16x; CUDA-graph replay of eager either way).

This pass rewrites a functional ATen graph so that every 2-D or 3-D convolution reads a
channels-last input: one ``clone(memory_format=channels_last)`` (``channels_last_3d`` for
3-D) where a value first needs it (usually the graph input), none between convolutions,
since convolutions and the pointwise/normalisation/pooling ops between them keep the
layout (the Planner fuses the conversions into the neighbouring regions). Every op's
result is recomputed under the graph's fake mode, so ``meta["val"]`` (which the Coder
generates for) tells the new strides. What depends on strides gets the traced layout back first:

- ``as_strided`` and ops outside ``aten`` (their inputs are restored),
- a ``view`` the new strides cannot express,
- the graph's outputs: the user sees eager's strides.

Values never change, only strides; anything the pass cannot restore (an input whose
traced layout was neither contiguous nor channels-last) leaves the graph as it was.

Precision can change: cuDNN chooses its algorithm per layout, and with
``torch.backends.cudnn.allow_tf32`` (on by default) it may pick a TF32 NHWC kernel for a
convolution that it runs in exact fp32 when the input is NCHW (seen on the H200 for the
test zoo's small convolutions: normalised error 4.4e-4 against eager's 2.5e-7). So before
the rewrite every distinct convolution runs once both ways on random inputs of its traced
sizes and strides, beside an fp64 run, and DESIGN.md's rule (``correctness.compare``)
judges the channels-last result against the traced layout's. One that fails is tried
once more channels-last with cuDNN's TF32 off for it alone (``aten._convolution`` with
``allow_tf32=False``: exact fp32, as eager's NCHW kernel was); if that passes, the graph
runs it so. One that still fails keeps its traced layout (its input converted back where
needed; the report says why), and where every one fails the graph stays as traced. But
first, where any convolution fails alone, the whole graph is judged with every
convolution channels-last in TF32 (``graph_precision.py``): a graph that reduces the
convolution's output (a global average pool) can keep the rule at its outputs, and then
runs so. The check depends on sizes, dtypes and cuDNN's
choices, not on the values, so it runs at compile time; each verdict is kept as a note
in the cache (keyed by the convolution, the GPU, the torch and cuDNN versions and the
precision flags), so a warm start runs no convolution.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .correctness import compare
from .graph_precision import cudnn_flags, outputs_hold
from .instance_norm import VIEWS as _VIEWS
from .instance_norm import unmerge_instance_norms
from .notes import read_note, write_note
from .regions import rewritable_copy

log = logging.getLogger("stitch_backend.layout")

aten = torch.ops.aten
CONV = aten.convolution.default
# A convolution with cuDNN's flags as arguments: the layout pass runs one with
# ``allow_tf32=False`` where cuDNN's TF32 NHWC kernel would be less accurate than eager.
CONV_FLAGGED = aten._convolution.default
# Results depend on the input's strides, not only its values.
_STRIDED = frozenset({aten.as_strided.default, aten.as_strided_scatter.default,
                      aten.as_strided_copy.default})
# ATen's CUDA kernels that check for a contiguous (NCHW) input instead of converting it:
# native_group_norm raised "Expected X.is_contiguous(memory_format)" for a channels-last
# input on the H200 (KernelBench L2 11, its region on ATen), while its CPU kernel and the
# meta function accept either layout. Their inputs get the traced layout back.
_CONTIGUOUS_ONLY = frozenset({aten.native_group_norm.default,
                              aten.native_group_norm_backward.default})
# The meta key marking the layout conversions this pass inserts. The Planner gives each
# its own region: fused into a neighbour, the kernel reads one layout and writes the
# other element by element. On the H200, the split-statistics candidate of an L3
# ResNetBasicBlock epilogue that ended in the NHWC -> NCHW output conversion took 1.36 ms
# against 0.59 ms for that region on ATen, while for one ending in NHWC it was 0.36 ms
# against 0.32 ms (one profile; the conversion's own cost was not measured apart).
CONVERSION = "stitch_layout_conversion"
# Set beside CONVERSION on a conversion of a convolution's weight (``_Rewrite._filter``).
FILTER = "stitch_layout_filter"
# Grouped convolutions with several input channels per group can be far slower in
# channels-last (Inductor's notes measured 31x for one shape); depthwise ones gain.
GROUPED_FLOPS_LIMIT = 0.5
class _Abort(Exception):
    """The pass cannot keep a stride-dependent use correct: the graph stays as traced."""


@dataclass
class LayoutResult:
    """What the pass did: ``applied`` with ``conversions`` clones inserted, or why not."""

    applied: bool
    why: str
    conversions: int = 0
    convolutions: int = 0
    filters: int = 0        # convolution weights converted (``_Rewrite._filter``), apart
    kept: int = 0           # convolutions left in the traced layout (precision)
    kept_why: str = ""      # the first one's reason
    exact: int = 0          # NHWC convolutions run with cuDNN's TF32 off (precision)
    # convolutions that failed the check alone but kept TF32 NHWC: the graph's outputs
    # held the correctness rule (graph_precision.py); else why they did not
    whole_graph: int = 0
    whole_why: str = ""
    instance_norms: int = 0  # computed over their own dims (``instance_norm.unmerge_instance_norms``)
    guess: bool = False      # declined by ``auto``'s positions rule (``layout_auto.few_positions``)
    remembered: str = ""     # the layout an earlier race kept, read from the cache (its note)

    def note(self) -> str:
        if self.applied:
            exact = (f" ({self.exact} with cuDNN's TF32 off: its TF32 NHWC kernel was less "
                     "accurate than the traced layout's)" if self.exact else "")
            kept = (f", {self.kept} kept in the traced layout ({self.kept_why})"
                    if self.kept else "")
            norms = (f", {self.instance_norms} instance norm(s) computed over their own "
                     "dims (no view of N*C channels)" if self.instance_norms else "")
            whole = (f" ({self.whole_graph} less accurate alone in cuDNN's TF32 NHWC kernel, "
                     "kept so: the graph's outputs meet the correctness rule)"
                     if self.whole_graph else "")
            filters = (f", {self.filters} convolution weight(s) converted" if self.filters
                       else "")
            return (f"channels-last: {self.convolutions} convolution(s) run NHWC{exact}{kept}"
                    f"{whole}, {self.conversions} layout conversion(s) in the graph{filters}"
                    f"{norms}"
                    + self._whole_why())
        return f"channels-last off: {self.why}" + self._whole_why()

    def _whole_why(self) -> str:
        return (f"; TF32 at the graph's outputs: {self.whole_why}" if self.whole_why
                else "")


def convolutions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's 2-D and 3-D convolutions on floating-point tensors, transposed ones
    too (Inductor's layout choice takes them as well; on the H200 its default mode ran
    KernelBench L2 2, 5 and 10, a transposed convolution each, 1.2-2.0x faster than
    stitchcuda, whose graphs stayed NCHW)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not CONV:
            continue
        x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() in (4, 5) and x.dtype.is_floating_point:
            found.append(node)
    return found


def ineligible(gm: torch.fx.GraphModule) -> str | None:
    """Why the pass should leave ``gm`` alone (None: apply it)."""
    convs = convolutions(gm)
    if not convs:
        return "no 2-D or 3-D convolution in the graph"
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
            return "symbolic sizes"
    total = grouped = 0.0
    for node in convs:
        w = node.args[1].meta["val"]
        out = node.meta["val"]
        flops = float(out.numel()) * w[0].numel()
        total += flops
        if node.args[8] > 1 and w.shape[1] > 1:
            grouped += flops
    if total and grouped / total > GROUPED_FLOPS_LIMIT:
        return (f"grouped convolutions ({grouped / total:.0%} of the convolution FLOPs) "
                "are often slower channels-last")
    return None


def to_channels_last(gm: torch.fx.GraphModule, notes: Any = None, partial: bool = False
                     ) -> tuple[torch.fx.GraphModule, LayoutResult]:
    """``gm`` rewritten so its 2-D and 3-D convolutions run channels-last (a new module; ``gm``
    is not changed), or ``gm`` itself with the reason when the pass does not apply.
    ``notes`` (a cache Store, optional) keeps the precision verdicts across processes.
    ``partial``: convolutions the precision check refuses keep their traced layout and
    the others still run NHWC (measured on the H200, one run: L3 ResNetBasicBlock 1.07 ms
    against 1.14 ms all NCHW, RegNet 1.76 against 1.55 ms, not yet profiled);
    without it (the ``auto`` setting), one refusal keeps the whole graph as traced, and
    so does a 3-D convolution accurate only with TF32 off: on the H200 (KernelBench L2 6,
    Conv3d + softmax + two max pools, one run) the graph stitched channels-last so took
    0.935 ms against 0.890 ms as traced, where its traced layout stitched took 0.811 ms
    in the session before."""
    why = ineligible(gm)
    if why is not None:
        return gm, LayoutResult(False, why)
    convs = convolutions(gm)
    refused, exact = precision_verdicts(convs, notes)
    whole_why = ""
    if refused or exact:
        # judged alone, some convolution loses precision in TF32 NHWC: the graph's
        # outputs may not (graph_precision.py); where they hold, TF32 everywhere
        new, result = _apply(gm, {}, set())
        if result.applied:
            verdict = outputs_hold(gm, new, notes)
            if verdict.ok:
                result.whole_graph = len(set(refused) | exact)
                return new, result
            whole_why = verdict.why
            log.debug("channels-last TF32 convolutions not kept: at the graph's outputs, %s",
                      verdict.why)
    if refused and (not partial or len(refused) == len(convs)):
        return gm, LayoutResult(False, next(iter(refused.values())), whole_why=whole_why)
    slow = [n.name for n in convs if n.name in exact and n.args[0].meta["val"].dim() == 5]
    if slow and not partial:
        return gm, LayoutResult(False, (
            f"{slow[0]}, a 3-D convolution, is as accurate channels-last only with cuDNN's "
            "TF32 off, slower than its traced layout's kernel (channels_last=True forces it)"),
            whole_why=whole_why)
    new, result = _apply(gm, refused, exact)
    result.whole_why = whole_why
    return new, result


def _apply(gm: torch.fx.GraphModule, refused: dict[str, str], exact: set[str]
           ) -> tuple[torch.fx.GraphModule, LayoutResult]:
    """The rewrite itself (a new module), the ``refused`` convolutions keeping their
    traced layout and the ``exact`` ones run with cuDNN's TF32 off; or ``gm`` and why
    not."""
    copied = rewritable_copy(gm, lambda n: True)
    if copied is None:
        return gm, LayoutResult(False, "the graph carries no fake values to recompute "
                                       "strides with")
    new, mode = copied
    # only a forced rewrite meets these: ``auto`` declines graphs with instance norms
    unmerged = unmerge_instance_norms(new, mode)
    try:
        result = _Rewrite(new, mode, exempt=set(refused), exact=exact).run()
    except _Abort as err:
        return gm, LayoutResult(False, str(err))
    result.instance_norms = unmerged
    if refused:
        result.kept = len(refused)
        result.kept_why = next(iter(refused.values()))
    new.graph.lint()
    new.recompile()
    return new, result


class _Rewrite:
    def __init__(self, gm: torch.fx.GraphModule, mode, exempt: set[str] = frozenset(),
                 exact: set[str] = frozenset()):
        self.gm = gm
        self.graph = gm.graph
        self.mode = mode
        # node -> its value as traced (the layout to restore)
        self.traced = {n: n.meta.get("val") for n in self.graph.nodes}
        # convolutions that run NHWC; the exempt ones (by name) keep the traced layout
        self.conv_nodes = {n for n in convolutions(gm) if n.name not in exempt}
        self.exempt = exempt
        self.exact = exact       # NHWC with cuDNN's TF32 off (by name)
        # (value, memory format) -> its conversion (a restored traced layout, a cat's input)
        self.converted: dict[tuple[torch.fx.Node, Any], torch.fx.Node] = {}
        self.filters: dict[tuple[torch.fx.Node, Any], torch.fx.Node] = {}
        self.conversions = 0
        self.convs = 0

    def run(self) -> LayoutResult:
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                node.args = (torch.fx.node.map_arg(node.args[0], self._restore_before(node)),)
                break
            if node in self.conv_nodes:
                self._to_channels_last_input(node)
                if node.name in self.exact:
                    node.target, node.args = CONV_FLAGGED, exact_args(node.args)
                self.convs += 1
            elif node.name in self.exempt or self._stride_dependent(node):
                self._restore_inputs(node)
            elif node.target is aten.cat.default:
                self._cat_channels_last(node)
            self._recompute(node)
        return LayoutResult(True, "", self.conversions, self.convs, filters=len(self.filters),
                            exact=len(self.exact & {n.name for n in self.conv_nodes}))

    @staticmethod
    def _stride_dependent(node: torch.fx.Node) -> bool:
        target = node.target
        if target is operator.getitem:
            return False
        if not isinstance(target, torch._ops.OpOverload):
            return True
        if target in _STRIDED or target in _CONTIGUOUS_ONLY or target.namespace not in (
                "aten", "prims"):
            return True
        tags = set(target.tags)
        return bool(tags & {getattr(torch.Tag, t) for t in
                            ("needs_fixed_stride_order", "needs_exact_strides")
                            if hasattr(torch.Tag, t)})

    def _to_channels_last_input(self, node: torch.fx.Node) -> None:
        x, w = node.args[0], node.args[1]
        fmt = channels_last_format(x.meta["val"])
        args = list(node.args)
        if not x.meta["val"].is_contiguous(memory_format=fmt):
            args[0] = self._clone(x, node, fmt)
        args[1] = self._filter(w, node, fmt, x.meta["val"].dim())
        node.args = tuple(args)

    def _filter(self, w: Any, conv: torch.fx.Node, fmt, dim: int) -> Any:
        """The convolution's weight channels-last. cuDNN's NHWC kernels read their filters
        so: left in the traced layout, ATen converts it inside every call with its generic
        strided copy (18 launches, 0.070 ms of ResNet18's 0.473 on the H200, profiled
        channels-last). As a conversion of the graph's own it is a region the Coder
        generates and the Verifier races against that same copy. One per weight, made
        before the first convolution that reads it (the pass walks the graph in order) and
        shared by the later ones; filters already so (1x1, depthwise) get none."""
        val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != dim \
                or val.is_contiguous(memory_format=fmt):
            return w
        if (w, fmt) not in self.filters:
            self.filters[(w, fmt)] = self._clone(w, conv, fmt, weight=True)
        return self.filters[(w, fmt)]

    def _cat_channels_last(self, node: torch.fx.Node) -> None:
        """A concatenation of channels-last values (convolutions' outputs) and others (a
        DenseNet's NCHW input, in every one of its concatenations): the others converted
        to channels-last, once each, so that the result is channels-last too. ATen makes
        a concatenation of mixed layouts contiguous, and the next convolution would then
        convert the whole concatenation back, once per layer. Only where the
        channels-last inputs hold at least half of the elements."""
        tensors = node.args[0]
        vals = [t.meta.get("val") if isinstance(t, torch.fx.Node) else None for t in tensors]
        if not vals or not all(isinstance(v, torch.Tensor) and v.dim() in (4, 5) for v in vals):
            return
        fmt = channels_last_format(vals[0])
        nhwc = sum(v.numel() for v in vals
                   if v.is_contiguous(memory_format=fmt) and not v.is_contiguous())
        rest = [t for t, v in zip(tensors, vals) if not v.is_contiguous(memory_format=fmt)]
        if not nhwc or not rest or 2 * nhwc < sum(v.numel() for v in vals):
            return
        new = [self._converted(t, node, fmt) if t in rest else t for t in tensors]
        node.args = (new,) + tuple(node.args[1:])

    def _converted(self, arg: torch.fx.Node, before: torch.fx.Node, fmt) -> torch.fx.Node:
        """``arg`` in ``fmt``: one conversion, made before its first user here and shared
        by the later ones (the pass walks the graph in order)."""
        if (arg, fmt) not in self.converted:
            self.converted[(arg, fmt)] = self._clone(arg, before, fmt)
        return self.converted[(arg, fmt)]

    def _restore_inputs(self, node: torch.fx.Node) -> None:
        restore = self._restore_before(node)
        node.args = torch.fx.node.map_arg(node.args, restore)
        node.kwargs = torch.fx.node.map_arg(node.kwargs, restore)

    def _restore_before(self, user: torch.fx.Node):
        def restore(arg: torch.fx.Node) -> torch.fx.Node:
            now, traced = arg.meta.get("val"), self.traced.get(arg)
            if not isinstance(now, torch.Tensor) or not isinstance(traced, torch.Tensor):
                return arg
            if same_layout(now, traced):
                return arg
            if traced.is_contiguous():
                fmt = torch.contiguous_format
            elif traced.dim() in (4, 5) and traced.is_contiguous(
                    memory_format=channels_last_format(traced)):
                fmt = channels_last_format(traced)
            else:
                raise _Abort(f"{arg.name} was traced with strides {traced.stride()} that a "
                             f"layout conversion cannot restore for {user.name}")
            return self._converted(arg, user, fmt)
        return restore

    def _clone(self, arg: torch.fx.Node, before: torch.fx.Node, fmt,
               weight: bool = False) -> torch.fx.Node:
        """A layout conversion of ``arg`` to ``fmt`` before ``before``; ``weight``: a
        convolution's filter (marked FILTER, counted apart from the activations')."""
        with self.graph.inserting_before(before):
            clone = self.graph.call_function(aten.clone.default, (arg,), {"memory_format": fmt})
        clone.meta[CONVERSION] = str(fmt)
        if weight:
            clone.meta[FILTER] = True
        self.traced[clone] = None
        self._recompute(clone)
        self.conversions += not weight
        return clone

    def _recompute(self, node: torch.fx.Node) -> None:
        """``meta["val"]`` of ``node`` from its inputs' current values; a view the new
        strides cannot express gets its input in the traced layout first."""
        try:
            node.meta["val"] = self._run(node)
        except Exception as err:  # noqa: BLE001 - fake kernels raise assorted types
            if node.target not in _VIEWS:
                raise _Abort(f"recomputing {node.name} under the new layout failed: "
                             f"{type(err).__name__}: {err}") from err
            self._restore_inputs(node)
            node.meta["val"] = self._run(node)
        node.meta.pop("tensor_meta", None)

    def _run(self, node: torch.fx.Node) -> Any:
        def val(a):
            return a.meta["val"] if isinstance(a, torch.fx.Node) else a
        args = torch.fx.node.map_aggregate(node.args, val)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
        with self.mode:
            return node.target(*args, **kwargs)


# "-2": verdicts carry ``exact`` (earlier notes, without it, are not read)
NOTE_KIND = "layout-precision-2"


@dataclass(frozen=True)
class Verdict:
    """The precision check's answer for one convolution."""

    why: str | None           # None: channels-last is as accurate as the traced layout
    exact: bool = False       # ... with cuDNN's TF32 off for this convolution
    final: bool = True        # worth keeping (a check that could not run is not)


def precision_verdicts(convs: list[torch.fx.Node], notes: Any = None
                       ) -> tuple[dict[str, str], set[str]]:
    """(name -> why, for each of ``convs`` that channels-last would make less accurate
    than its traced layout (those keep it); the names of those that are as accurate
    channels-last only with cuDNN's TF32 off). Each distinct convolution (sizes,
    strides, arguments) runs as traced, with a channels-last input and in fp64, on
    random inputs, unless ``notes`` (a cache Store) holds its verdict from an earlier
    run."""
    verdicts: dict[tuple, Verdict] = {}
    refused, exact = {}, set()
    for node in convs:
        key = _conv_key(node)
        if key not in verdicts:
            note_key = _note_key(key, node)
            stored = read_note(notes, NOTE_KIND, note_key, _valid_verdict)
            if stored is not None:
                verdicts[key] = Verdict(stored["why"], bool(stored.get("exact")))
            else:
                verdicts[key] = _judge(node)
                if verdicts[key].final:
                    write_note(notes, NOTE_KIND, note_key,
                               {"why": verdicts[key].why, "exact": verdicts[key].exact})
        verdict = verdicts[key]
        if verdict.why is not None:
            refused[node.name] = verdict.why
        elif verdict.exact:
            exact.add(node.name)
    return refused, exact


def _judge(node: torch.fx.Node) -> Verdict:
    """Whether ``node`` keeps eager's precision channels-last: as it is, or else with
    cuDNN's TF32 off for it (where TF32 is allowed and cuDNN runs it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    retry = tf32_may_apply(node)
    with unset_fake_temporarily(), torch.no_grad():   # real tensors, not the graph's
        try:
            traced, nhwc, fp64 = conv_outputs(node, exact=False)
            cmp = compare(nhwc, traced, fp64)
            if cmp.ok_design:
                return Verdict(None)
            if retry:
                traced, nhwc, fp64 = conv_outputs(node, exact=True)
                if compare(nhwc, traced, fp64).ok_design:
                    return Verdict(None, exact=True)
        except Exception as err:  # noqa: BLE001 - no verdict: no rewrite
            return Verdict(f"the precision check of {node.name} could not run "
                           f"({type(err).__name__}: {err})", final=False)
    return Verdict(f"{node.name} ({_describe(node)}) is less accurate with a channels-last "
                   f"input ({cmp.reason}; cuDNN's kernel choice differs by layout, e.g. "
                   "TF32 in NHWC where NCHW is exact fp32)")


def tf32_may_apply(node: torch.fx.Node) -> bool:
    """Whether cuDNN may run ``node`` in TF32 (so that turning it off can restore the
    precision): a CUDA convolution with TF32 allowed, its arguments all positional."""
    x = node.args[0].meta["val"]
    return (x.device.type == "cuda" and torch.backends.cudnn.allow_tf32
            and len(node.args) == 9 and not node.kwargs)


def exact_args(args: tuple) -> tuple:
    """``aten._convolution``'s arguments for ``aten.convolution``'s ``args``: cuDNN's
    flags as ATen passes them, with TF32 off."""
    cudnn = torch.backends.cudnn
    deterministic = cudnn.deterministic or torch.are_deterministic_algorithms_enabled()
    return tuple(args) + (cudnn.benchmark, deterministic, cudnn.enabled, False)


def _note_key(key: tuple, node: torch.fx.Node) -> dict:
    """What a stored verdict depends on: the convolution, the device, the versions and
    every flag that steers cuDNN's choice of kernel."""
    dev = node.args[0].meta["val"].device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    cudnn = torch.backends.cudnn
    return {"conv": repr(key), "gpu": gpu, "torch": torch.__version__,
            "cudnn": cudnn.version() if cudnn.is_available() else None,
            "flags": cudnn_flags()}


def _valid_verdict(value: Any) -> bool:
    return isinstance(value, dict) and "why" in value and (
        value["why"] is None or isinstance(value["why"], str))


def conv_outputs(node: torch.fx.Node, exact: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(traced-layout, channels-last-input, fp64) results of the convolution ``node`` on
    random inputs with its traced sizes and strides, all returned contiguous (call it
    outside any fake mode); ``exact``: the channels-last run with cuDNN's TF32 off."""
    gen: dict[torch.device, torch.Generator] = {}

    def real(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        v = a.meta["val"]
        g = gen.setdefault(v.device, torch.Generator(v.device).manual_seed(0))
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        return t.copy_(torch.randn(v.shape, dtype=v.dtype, device=v.device, generator=g))

    args = [real(a) for a in node.args]
    traced = CONV(*args)
    x_cl = args[0].contiguous(memory_format=channels_last_format(args[0]))
    nhwc = (CONV_FLAGGED(*exact_args((x_cl, *args[1:]))) if exact
            else CONV(x_cl, *args[1:]))
    up = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    fp64 = CONV(*up)
    return traced.contiguous(), nhwc.contiguous(), fp64.contiguous()


def _conv_key(node: torch.fx.Node) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            return (tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device))
        return tuple(a) if isinstance(a, (list, tuple)) else a
    return tuple(one(a) for a in node.args)


def _describe(node: torch.fx.Node) -> str:
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    return (f"{'x'.join(map(str, w.shape[2:]))} convolution, {x.shape[1]}->{w.shape[0]} "
            f"channels on {'x'.join(map(str, x.shape[2:]))}, "
            f"{str(x.dtype).replace('torch.', '')}")


def channels_last_format(t: torch.Tensor) -> torch.memory_format:
    """The channels-last memory format of a 4-D (NHWC) or 5-D (NDHWC) tensor."""
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same strides wherever a dimension has more than one element."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


__all__ = ["CONVERSION", "CONV_FLAGGED", "FILTER", "LayoutResult", "Verdict",
           "channels_last_format", "conv_outputs", "convolutions", "exact_args", "ineligible",
           "precision_verdicts", "same_layout", "to_channels_last"]
