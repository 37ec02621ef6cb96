"""The last line of "never slower than eager": the traced module as written, kept beside
its stitched Programs and timed against them once they have settled.

Every region is verified faster than its ATen ops, and a Program that loses in context
falls back to ATen (cudagraphs.py), but that ATen is the *decomposed* graph: softplus
there is four kernels where eager runs one, cross-entropy six, BatchNorm's backward
about ten. So for a Dynamo graph whose ATen graphs are on CUDA, the guard also times the
graph as Dynamo traced it (undecomposed, eager) on the user's first real inputs, once the
Programs are verified and their replay decided; when that is faster, the graph runs
as written from then on, said in each record's notes and regions. The timing calls
both ways more than once: the inputs a graph mutates (BatchNorm's running statistics)
are saved before and restored after them, so the user's call applies its update once;
graphs that draw random numbers (dropout) are timed with the random generators saved
before and put back after (``torch.random.fork_rng``), so a seeded run draws eager's
numbers whichever way the guard goes; graphs with symbolic sizes are left alone (one
shape's timing would decide for all). On an H100 (2026-12-05) KernelBench L2 66
(Linear, dropout, softmax: every region on ATen, no CUDA graph then for its random op)
ran 0.94x eager unguarded: the host time of the compiled call, before its first launch.

A training graph (forward and backward) is timed as a step: the forward, then
``torch.autograd.grad`` of its outputs (weighted by ones) with respect to the inputs that
require gradients (the parameters, as Dynamo passes them). That computes every gradient
the user's backward would and accumulates none: no ``.grad`` is touched (tensor hooks
registered on those inputs do see the timing's gradients). It waits for the backward
graph, which compiles at the user's first backward, and is decided on the first call
after it has settled. On the H200, L3 ResNet18's training step ran 0.61x eager's
(batch 2: BatchNorm's decomposed backward in four generated kernels per layer against
cuDNN's one, and the host time of ~170 more launches), with no guard to catch it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch

from . import cudagraphs
from .correctness import flatten_outputs
from .mutations import nbytes, restored

log = logging.getLogger("stitch_backend.eager_guard")

# Devices whose graphs are guarded (tests add "cpu" to exercise the guard on CPU).
DEVICES: tuple[str, ...] = ("cuda",)
# Eager must be this much faster (a fraction) before the graph runs as written. At 0,
# a tie goes to the stitched graph, any measured loss to eager (with a 3% margin, the
# H200 ran L3 ResNetBasicBlock and RegNet 8% slower than eager in the benchmark after the
# guard had measured them 2.4% and 2.5% slower and kept them).
MARGIN = 0.0
# Decide at the latest on this call, settled or not (a Program that never settles).
LATEST_CALL = 8


def ineligible(records: Sequence[Any]) -> str | None:
    """Why the Dynamo graph that produced ``records`` is not guarded (None: it is)."""
    if not records:
        return "no stitched graph"
    for rec in records:
        if rec.device not in DEVICES:
            return f"inputs are on {rec.device}"
        if rec.dynamic:
            return "symbolic sizes: one shape's timing would decide for every shape"
        if rec.program is None:
            return "no Program"
        # (a backward mutates nothing; AOTAutograd's metadata there is its forward's)
        if rec.stage != "backward" and rec.aot_mutations is None:
            return "AOTAutograd's input mutations are unknown: timing calls could repeat them"
        if rec.stage != "backward" and rec.aot_mutations != len(rec.program.writebacks):
            return ("AOTAutograd applies some input mutations outside the graph: timing calls "
                    "could not undo them")
    return None


def draws_random(records: Sequence[Any]) -> bool:
    """Whether a graph of ``records`` draws random numbers (dropout): its timing calls
    then run inside ``torch.random.fork_rng``, so the user's generators are where the
    user's own call left them."""
    return any(rec.gm is not None and cudagraphs.draws_random(rec.gm) for rec in records)


def direct_forward(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s generated forward, to call without the module's ``__call__`` (FX's
    _WrappedCall, then nn.Module's hook handling: 1.2-3.0 us of a Dynamo call's 18-22 us
    on this project's CPU machine, the two timed interleaved, best of 9 rounds; paid by
    every call of a graph that runs as traced). Dynamo's graphs are lazy
    (``_LazyGraphModule``): their code is generated here, not at the first call."""
    generate = getattr(gm, "real_recompile", None)
    if callable(generate):
        generate()
    return gm.forward


class EagerGuard:
    """Called by Dynamo in place of the compiled graph: runs ``compiled`` until its
    Programs have settled, then times it against ``eager`` once and keeps the faster."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any],
                 records: Sequence[Any] | Callable[[], Sequence[Any]]):
        """``records``: the Dynamo graph's ATen graphs, or a function returning them as
        they are now (a training graph's backward record appears at its first backward)."""
        self.eager = eager
        self.compiled = compiled
        self._records = records if callable(records) else (lambda fixed=list(records): fixed)
        self.calls = 0
        self.choice: Callable[..., Any] | None = None

    @property
    def records(self) -> list[Any]:
        return list(self._records())

    @property
    def training(self) -> bool:
        return any(rec.stage != "inference" for rec in self.records)

    def __call__(self, *args: Any) -> Any:
        if self.choice is not None:
            return self.choice(*args)
        self.calls += 1
        if self.calls < LATEST_CALL and not self._settled():
            return self.compiled(*args)
        why = ineligible(self.records)
        if why is not None:   # a backward compiled since the forward was found eligible
            self._note(f"eager guard off: {why}")
            self.choice = self.compiled
            return self.compiled(*args)
        # This call's own run, watched for the inputs it mutates; then the timing.
        targets: list[torch.Tensor] = []
        self._watch(targets)
        try:
            out = self.compiled(*args)
        finally:
            self._watch(None)
        try:
            self.choice = self._plain_aten() or self._decide(args, targets)
        except Exception as err:  # noqa: BLE001 - the timing must not break the model
            self.choice = self.compiled
            self._note(f"eager guard: timing failed ({type(err).__name__}: {err}); the "
                       "stitched graph is kept")
        return out

    def _watch(self, targets: list[torch.Tensor] | None) -> None:
        for rec in self.records:
            rec.program.seen_targets = targets

    def _settled(self) -> bool:
        """Verification done and CUDA graph replay decided for every Program (a training
        graph's backward included)."""
        records = self.records
        if self.training and not any(rec.stage == "backward" for rec in records):
            return False
        if not all(rec.program.settled for rec in records):
            return False
        return self.calls > 1

    def _plain_aten(self) -> Callable[..., Any] | None:
        """The graph as traced, without timing, where every Program runs only ATen and
        is not replayed: decomposed ATen plus the Program's own steps cannot beat the
        same ops undecomposed (a single op over 6 GiB ran 1-2% slower that way)."""
        for rec in self.records:
            program = rec.program
            replay = program.replay
            if program.generated_steps() or (replay is not None and replay.disabled is None):
                return None
        self._run_as_traced("no region runs a generated kernel and the Program is not "
                            "replayed as a CUDA graph: the graph runs as Dynamo traced it "
                            "(eager, undecomposed), with nothing of the backend's in the way")
        return self.eager

    def _run_as_traced(self, why: str) -> None:
        log.info("stitchcuda: %s runs as written: %s",
                 ", ".join(r.name for r in self.records), why)
        for rec in self.records:
            rec.program.use_aten(why)   # the report shows no kernel in use
            for region in rec.plan.regions:
                if region.backend == "aten" and region.reason is None:
                    region.reason = why
            rec.runs_as_traced = True

    def _decide(self, args: Sequence[Any], targets: list[torch.Tensor]) -> Callable[..., Any]:
        """Time both ways on ``args`` and keep the faster; ``targets`` (the inputs the
        graph mutates, as the call before left them) are put back after the timing runs."""
        saved_bytes = nbytes(targets)
        if saved_bytes > cudagraphs.SNAPSHOT_LIMIT:
            self._note(f"eager guard: not timed, {saved_bytes / 2**20:.0f} MiB of mutated "
                       "inputs would have to be saved and restored; the stitched graph is kept")
            return self.compiled
        what, wrt = "wall clock", None
        if self.training:
            if not any(rec.stage == "backward" for rec in self.records):
                self._note("eager guard: not timed, no backward has run by call "
                           f"{self.calls}; the stitched graph is kept")
                return self.compiled
            wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if not wrt:
                self._note("eager guard: not timed, no input requires a gradient; the "
                           "stitched graph is kept")
                return self.compiled
            what = "a forward and backward each, wall clock"

        def call(fn: Callable[..., Any]) -> Callable[[], Any]:
            return (lambda: fn(*args)) if wrt is None else (lambda: _step(fn, args, wrt))

        stitched_ms, eager_ms = [], []
        with restored(targets), _generators_kept(self.records, args):
            for _ in range(2):  # interleaved, so a clock or load drift hits both
                stitched_ms.append(cudagraphs.wall_ms(call(self.compiled)))
                eager_ms.append(cudagraphs.wall_ms(call(self.eager)))
        stitched, eager = min(stitched_ms), min(eager_ms)
        timing = (f"{stitched:.3f} ms stitched vs {eager:.3f} ms for the graph as traced "
                  f"(eager, undecomposed; {what}, best of two medians of 5)")
        if eager < stitched * (1 - MARGIN):
            self._run_as_traced("the graph runs as Dynamo traced it (eager, undecomposed), "
                                f"which was faster than its stitched Program: {timing}")
            return self.eager
        self._note(f"eager guard: stitched kept, {timing}")
        return self.compiled

    def _note(self, text: str) -> None:
        for rec in self.records:
            rec.notes.append(text)


def _generators_kept(records: Sequence[Any], args: Sequence[Any]) -> Any:
    """Around the timing calls of a graph that draws random numbers: the CPU generator
    and those of the CUDA devices its inputs are on, put back afterwards (the timing
    calls draw as many numbers as a dozen user calls would)."""
    if not draws_random(records):
        return contextlib.nullcontext()
    cuda = sorted({a.device.index or 0 for a in args
                   if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    return torch.random.fork_rng(devices=cuda)


def _step(fn: Callable[..., Any], args: Sequence[Any], wrt: list[torch.Tensor]) -> None:
    """A training step's work without its side effects: ``fn``'s forward, then the
    gradients of its outputs (weighted by ones) with respect to ``wrt``, returned by
    ``torch.autograd.grad`` and dropped (nothing accumulates into ``.grad``)."""
    with torch.enable_grad():
        outs = [o for o in flatten_outputs(fn(*args))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs],
                                allow_unused=True)
