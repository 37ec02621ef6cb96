"""Channels-last convolutions judged at the graph's outputs.

The layout pass (``layout.py``) first judges each convolution alone: channels-last, cuDNN
may pick a TF32 kernel where eager's NCHW run is exact fp32, and a convolution whose
NHWC result is less accurate than the traced layout's is run with TF32 off (exact, and
slower) or kept NCHW. That verdict is stricter than the correctness rule needs where
the graph reduces the convolution's output before returning it: a global average pool
or a sum over millions of positions averages TF32's rounding away. On an H100
(KernelBench L2, 2026-12-05), every 2-D convolution of L2 64-100 failed the check alone,
and three of those graphs (65 Conv2d_AvgPool_Sigmoid_Sum, 67 Conv2d_GELU_GlobalAvgPool,
92 Conv2d_GroupNorm_..._LogSumExp) ran 0.98-1.30x eager while Inductor, whose
channels-last TF32 convolutions met the rule at those graphs' outputs, ran 1.34-2.81x.

So where a convolution fails alone, the whole graph is judged once more with every
convolution channels-last in TF32: the graph as traced, rewritten, and in fp64
(``correctness.run_fp64``) on the same random inputs (the random draws of each run
seeded alike), and DESIGN.md's rule (``correctness.compare``) at the graph's outputs
decides. Where the outputs hold, the rewrite keeps TF32 everywhere; where not, the
per-convolution verdicts stand. The verdict is taken on random values, so it runs at
compile time and is kept as a note in the cache, keyed by the graph, the device, the
versions and cuDNN's flags: a warm start runs nothing.

Like every check of the Verifier, it is a check on random inputs of the traced sizes,
drawn twice: standard normal values, as the per-convolution check draws them, and
uniform values in [0, 1), the non-negative inputs of images and of layers after a ReLU
(KernelBench draws its inputs so); both draws must hold. A normalisation's running
variance is drawn in [0.5, 1.5) in both, as a variance is never negative. One draw was
not enough: on an H100 (2026-12-06) KernelBench L2 27 (Conv3d, HardSwish, GroupNorm, a
mean over the positions) held on standard normal values, ran its convolution in TF32,
and on the bench's uniform inputs missed the rule by 1000x (norm error 2.2e-4 against
eager's 2.3e-7): the group norm subtracts a mean that non-negative inputs make large
against the spread it divides by. The outputs may still depend on the user's values in
ways no draw shows, so the Program also judges its first call against the graph as
traced (``Program.judge_against``) and keeps the traced graph where that fails,
remembering it here (``remember_failure``). Where even so the fp64 run's outputs are not all finite,
the check judges nothing (a NaN in every run matches itself), and the graph is not held:
on an H100 (2026-12-05) the zoo's eval-mode residual blocks, their running variances
drawn standard normal, gave NaN everywhere, passed, and ran TF32 convolutions 1000x
further from fp64 than eager.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .correctness import compare, flatten_outputs, run_fp64
from .notes import read_note, write_note

log = logging.getLogger("stitch_backend.graph_precision")

NOTE_KIND = "layout-graph-precision-3"   # 3: a uniform draw too; 2: variances drawn positive
# The three runs (one after another) may hold this share of the device's free memory at
# most: the inputs drawn, a copy for the run and their fp64 copy (4x their bytes), the
# fp64 run's peak (twice ``memplan.graph_peak``, which counts outputs) and the two fp32
# runs' outputs kept meanwhile. Beyond it the graph is not judged, and the
# per-convolution verdicts stand: a check at compile time must not run the user's GPU
# out of memory.
MEMORY_SHARE = 0.5
# The random draws a graph is judged on, one after another; each must hold.
DRAWS = ("standard normal", "uniform [0, 1)")


@dataclass(frozen=True)
class GraphVerdict:
    """Whether the rewritten graph keeps the correctness rule at its outputs."""

    ok: bool
    why: str
    final: bool = True      # worth keeping in the cache (a check that could not run is not)


def outputs_hold(traced: torch.fx.GraphModule, rewritten: torch.fx.GraphModule,
                 notes: Any = None) -> GraphVerdict:
    """Judge ``rewritten`` against ``traced`` (and its fp64 run) at the graph's outputs,
    or read the verdict an earlier process stored in ``notes`` (a cache Store)."""
    key = graph_note_key(traced)
    stored = read_note(notes, NOTE_KIND, key, _valid)
    if stored is not None:
        return GraphVerdict(bool(stored["ok"]), stored["why"])
    verdict = _judge(traced, rewritten)
    if verdict.final:
        write_note(notes, NOTE_KIND, key, {"ok": verdict.ok, "why": verdict.why})
    return verdict


def _judge(traced: torch.fx.GraphModule, rewritten: torch.fx.GraphModule) -> GraphVerdict:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    metas = [n.meta.get("val") for n in traced.graph.find_nodes(op="placeholder")]
    odd = next((m for m in metas if not isinstance(m, torch.Tensor)), None)
    if odd is not None:
        return GraphVerdict(False, f"an input is not a tensor ({type(odd).__name__}): "
                                   "not judged at the graph's outputs")
    need, free = _bytes_needed(traced, metas), free_bytes(metas)
    if need is None or (free is not None and need > MEMORY_SHARE * free):
        size = "a data-dependent size" if need is None else (
            f"about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        return GraphVerdict(False, f"not judged at the graph's outputs: its three runs would "
                                   f"need {size}", final=False)
    variances = _variances(traced)
    with unset_fake_temporarily(), torch.no_grad():   # real tensors, not the graph's
        for kind in DRAWS:
            try:
                inputs = _draw(metas, variances, kind)
                want = _run(traced, inputs)
                got = _run(rewritten, inputs)
                ref = _run(traced, inputs, fp64=True)
            except Exception as err:  # noqa: BLE001 - no verdict: the per-convolution ones stand
                return GraphVerdict(False, f"the graph could not be run to judge it "
                                           f"({type(err).__name__}: {err})", final=False)
            ref = _tensors(ref)
            if not all(bool(t.isfinite().all()) for t in ref if t.is_floating_point()):
                return GraphVerdict(False, f"not judged at the graph's outputs: on {kind} "
                                           "random inputs its fp64 run gives values that are "
                                           "not finite")
            cmp = compare(_tensors(got), _tensors(want), ref)
            if not cmp.ok_design:
                return GraphVerdict(False, f"on {kind} random inputs: {cmp.reason}")
            inputs = want = got = ref = None
    return GraphVerdict(True, cmp.reason)


def remember_failure(notes: Any, traced: torch.fx.GraphModule, why: str) -> None:
    """Keep in ``notes`` (a cache Store, or None) that the rewrite of ``traced`` failed
    the rule on a user's real inputs, so a later compile keeps its traced layout."""
    write_note(notes, NOTE_KIND, graph_note_key(traced), {"ok": False, "why": why})


def _bytes_needed(gm: torch.fx.GraphModule, metas: list[torch.Tensor]) -> int | None:
    """A bound on what the three runs hold at once (see MEMORY_SHARE); None where the
    graph's peak has no number."""
    from .memplan import graph_peak

    peak = graph_peak(gm)
    if peak is None:
        return None
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts  # noqa: E731
                          if isinstance(t, torch.Tensor))
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = []
    torch.fx.node.map_arg(out.args[0], lambda n: outputs.append(n.meta.get("val")))
    return 4 * size(metas) + 2 * peak + 2 * size(outputs)


def free_bytes(metas: list[torch.Tensor]) -> int | None:
    """Free memory of the first CUDA device among the inputs' (None: no CUDA input)."""
    device = next((m.device for m in metas if m.device.type == "cuda"), None)
    if device is None:
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free


# Normalisations whose argument 4 is a running variance (read in inference, updated in
# training).
_RUNNING_VAR_ARG = 4
_NORMS = frozenset({"_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
                    "_native_batch_norm_legit_functional", "native_batch_norm",
                    "batch_norm", "cudnn_batch_norm", "instance_norm"})


def _variances(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the placeholders that a normalisation reads as its running variance."""
    places = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out = set()
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if (node.op == "call_function" and packet is not None
                and packet.__name__ in _NORMS and len(node.args) > _RUNNING_VAR_ARG
                and node.args[_RUNNING_VAR_ARG] in places):
            out.add(places[node.args[_RUNNING_VAR_ARG]])
    return out


def _draw(metas: list[torch.Tensor], variances: set[int] = frozenset(),
          kind: str = "standard normal") -> list[torch.Tensor]:
    """Values of ``kind`` (one of ``DRAWS``) with each input's sizes, strides, dtype and
    device (a generator of their own: the user's random state is not touched), uniform in
    [0.5, 1.5) at the positions ``variances``; integer and bool inputs (BatchNorm's
    ``num_batches_tracked``) zeros, a valid count and index."""
    gens: dict[str, torch.Generator] = {}
    out = []
    for i, m in enumerate(metas):
        t = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device)
        if not m.is_floating_point():
            out.append(t.zero_())
            continue
        gen = gens.setdefault(str(m.device), torch.Generator(m.device).manual_seed(0))
        if i in variances:
            values = torch.rand(m.shape, generator=gen, device=m.device) + 0.5
        elif kind == "uniform [0, 1)":
            values = torch.rand(m.shape, generator=gen, device=m.device)
        else:
            values = torch.randn(m.shape, generator=gen, device=m.device)
        out.append(t.copy_(values))
    return out


def _run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], fp64: bool = False) -> Any:
    """``gm`` on copies of ``inputs`` (a graph may write into its inputs: BatchNorm's
    running statistics), its random draws seeded alike on every run."""
    copies = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
              .copy_(x) for x in inputs]
    cuda = sorted({x.device.index or 0 for x in inputs if x.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        return run_fp64(gm, copies) if fp64 else gm(*copies)


def _tensors(outputs: Any) -> list[torch.Tensor]:
    return [t for t in flatten_outputs(outputs) if isinstance(t, torch.Tensor)]


def graph_note_key(gm: torch.fx.GraphModule) -> dict:
    """What a stored verdict depends on: the graph, the devices, the versions and every
    flag that steers cuDNN's choice of kernel."""
    from .graph import canonical_graph

    metas = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    devices = sorted({str(m.device) for m in metas if isinstance(m, torch.Tensor)})
    gpus = [torch.cuda.get_device_name(torch.device(d)) for d in devices if d.startswith("cuda")]
    cudnn = torch.backends.cudnn
    return {"graph": hashlib.sha256(canonical_graph(gm).encode()).hexdigest(),
            "devices": devices, "gpus": gpus, "torch": torch.__version__,
            "cudnn": cudnn.version() if cudnn.is_available() else None,
            "flags": cudnn_flags() + [torch.backends.cuda.matmul.allow_tf32]}


def cudnn_flags() -> list:
    """Every flag that steers cuDNN's choice of convolution kernel (part of the keys of
    this module's and ``layout``'s precision verdicts)."""
    cudnn = torch.backends.cudnn
    return [cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled()]


def _valid(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("ok"), bool)
            and isinstance(value.get("why"), str))


__all__ = ["DRAWS", "GraphVerdict", "NOTE_KIND", "cudnn_flags", "free_bytes", "graph_note_key",
           "outputs_hold", "remember_failure"]
