"""Whole-Program CUDA graph replay for static-shape graphs (DESIGN.md "Execution").

After its first (verifying) call, an eligible Program runs once more uncaptured (warm-up),
is then captured into one CUDA graph — generated kernels, library calls and ATen
fallbacks alike — and replayed from then on. The first replay is compared, bit for bit,
with an uncaptured run on the same inputs; any difference, or any error while capturing,
turns capture off for that Program, with the reason in its report. Except where the
Program is not bit-for-bit repeatable itself (cuDNN's convolution backward adds in a
varying order: a second uncaptured run differs from the first): there the replay must
agree with the uncaptured run by the correctness rule (``correctness.compare``, the
tolerance a kernel is verified to), since no bitwise answer exists. Seen on the H200 with
``cudagraphs_training``: L3 ResNet18's backward replay was turned off as "differed".

Inputs: parameters and buffers (AOTAutograd's static inputs) are read in place; if one
moves, the graph is captured again. Other inputs are copied into buffers the graph owns
when they are not already those buffers. Mutated parameters and buffers (BatchNorm's
running statistics) are written inside the graph; other mutated inputs after it. A
training graph may return inputs (a forward saves its batch and weights for the
backward): those outputs are handed over as views of the caller's own inputs, never of
the graph's copies, which the next replay overwrites (inference graphs that return an
input are not captured).

Random ops (dropout, rand_like) on torch's default CUDA generator are captured: every
capture registers that generator, and each replay reads its seed and offset as they are
then and advances the offset by what the captured ops draw, as uncaptured calls would.
The runs a user's call would not make (the capture's uncaptured run, the first replay's
reference run, the timing runs) put the generator back (``rng_kept``), so a seeded run
draws eager's numbers call for call. On an H100 (2026-12-05), KernelBench L2 66 (Linear,
dropout, softmax) ran 0.94x eager uncaptured. A random op given a generator of its own
keeps the graph uncaptured.

Outputs are handed over without a copy: the user gets aliases of the graph's output
buffers, and the next call first looks whether anyone still holds them (the storage's
reference count against the graph's own references). Dropped (a loop that discards
each result, KernelBench's timing): the graph overwrites them. Still held: each held
output is moved to memory of its own (copied, and the user's tensor pointed at the copy,
``Tensor.set_``) before the graph runs, so a later call never overwrites what the user
holds. Where something else also holds the buffer (a view of an output), it cannot be
moved: the graph and its buffers are left to the user and the Program is captured
again; after ABANDON_LIMIT such recaptures each replay's outputs are cloned instead, as
they were before (0.066 ms of the L3 ResNetBasicBlock's 0.77 ms call on the H200 was
that clone). What this cannot see: a Python storage object of an output
(``out.untyped_storage()``) kept after every tensor of it is dropped; torch's storage
reference count does not include those (Inductor's CUDA graphs read the same count).

The tensor-level work on outputs (views of inputs, aliases, moving kept outputs out,
bitwise comparison) is in ``replay_outputs``.

Inputs are read where the caller keeps them, as parameters are, while each call passes
them at the address the capture read (a loop feeding one input buffer, KernelBench's
timing; a new tensor the allocator puts where the last one was): a caller's in-place
change is what the next replay reads. No reference to them is kept: the graph reads
that memory only on a call that passes a tensor there, whose sizes and strides Dynamo's
guards fixed, so holding the capture's tensor would only keep its memory from being
freed (and, where it is another graph's output, make that graph copy it out). The
first call that passes one elsewhere (a new tensor each call) makes the graph capture
again and copy every such input into buffers of its own before each replay (that
capture's first replay checked and timed against running uncaptured again), as
Inductor's CUDA graphs do on every call (L3 MiniGPTBlock's input is 201 MB, read and
written by that copy each call). Once the inputs stay at one address again for
STABLE_CALLS calls in a row (a bench's correctness trials on fresh tensors, then its
timed loop on one), they are read in place again, at most DIRECT_RETURNS times. Inputs
the graph mutates are always copied in.

The input copies make a replay slower than an uncaptured run for a few kernels over
large tensors; the first replay is therefore timed against an uncaptured run, and replay
stays on unless running uncaptured is faster by more than REPLAY_MARGIN.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx

from . import cuda_driver, rng
from .exc import brief
from .mutations import nbytes, restored, split_outputs, write_back
from .opclass import OpClass, classify
from .replay_outputs import (_alias, _clone, _identical, _move_out, _tensors, _use_count,
                             _with_input_views, input_views)

log = logging.getLogger("stitch_backend.cudagraphs")

# Mutated inputs larger than this together are not copied to time the first replay.
SNAPSHOT_LIMIT = 256 * 2**20
# Above this many bytes of non-static inputs (copied in before each replay), a Program is
# not captured: the copy (0.5 ms for 1 GiB at the H200's ~4.3 TB/s) outweighs the launch
# time a replay saves, as the first-replay timing found for each of the six KernelBench
# L1 tasks with inputs of 2 GiB or more in the 2026-12-04 run (LeakyReLU 6.77 ms
# replayed against 3.41 uncaptured).
COPY_LIMIT = 2**30
# Recaptures (a caller kept views of earlier outputs) before outputs are always cloned.
ABANDON_LIMIT = 2
# Inputs copied in since one moved are read in place again once they have stayed at one
# address for this many calls in a row (a benchmark's or server's input buffer after a
# few calls on other tensors), at most DIRECT_RETURNS times.
STABLE_CALLS = 3
DIRECT_RETURNS = 2
# Replay goes off only where running uncaptured is faster by more than this fraction:
# within it the two timings are a coin toss (L3 MiniGPTBlock on the H200: 23.913 ms
# replayed vs 23.985 uncaptured in one process, replay kept; in the next run's bench the
# Program ran uncaptured, 24.55 ms a call, against 23.9-24.4 replayed in profiles).
REPLAY_MARGIN = 0.02


def ineligible(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, device: str,
               dynamic: bool, stage: str, allow_training: bool) -> str | None:
    """Why this graph cannot be captured (None: it can)."""
    if device != "cuda":
        return f"inputs are on {device}"
    if dynamic:
        return "symbolic shapes: each new shape would need its own capture"
    if stage != "inference" and not allow_training:
        return "training graphs run uncaptured by default (option cudagraphs_training)"
    for node in gm.graph.nodes:
        if node.op == "call_function" and classify(node) is OpClass.RANDOM:
            why = _random_ineligible(node)
            if why:
                return why
        if node.op == "call_function" and classify(node) is OpClass.SYMBOLIC:
            return "host-side size arithmetic"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    returned: list[torch.fx.Node] = []
    torch.fx.node.map_arg(out.args[0], returned.append)
    for value in returned:
        # A training forward returns inputs it saves for the backward (the batch, the
        # weights): handed over as views of the caller's own inputs (``input_views``).
        if stage == "inference" and _aliases_input(value):
            return "an output is a graph input or a view of one"
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            return "a non-tensor input (size or scalar) may change between calls"
        if x.device.type != "cuda":
            return f"an input lives on {x.device.type}"
    static = static_input_indices() or set()
    copied = sum(x.numel() * x.element_size() for i, x in enumerate(example_inputs)
                 if i not in static)
    if copied > COPY_LIMIT:
        return (f"{copied / 2**30:.1f} GiB of inputs would be copied into the graph's own "
                f"buffers before every replay, more than the launches a replay saves (and "
                "a second copy of them in memory)")
    return None


def _random_ineligible(node: torch.fx.Node) -> str | None:
    """Why a graph drawing random numbers at ``node`` cannot be captured (None: it can).
    Ops on torch's default CUDA generator can: it is graph-safe (every capture registers
    it; each replay reads the generator's seed and offset as they are then and advances
    the offset as the captured ops would have, so a replay draws what an uncaptured call
    from the same state draws). A generator passed explicitly is another matter."""
    if node.kwargs.get("generator") is not None:
        return f"random op {node.target} with a generator of its own (not graph-safe)"
    if not hasattr(torch.Generator, "graphsafe_get_state"):   # pragma: no cover - torch < 2.4
        return f"random op {node.target}: this torch's CUDA graphs have no graph-safe generators"
    return None


def draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` draws random numbers (dropout, rand_like, ...)."""
    return any(n.op == "call_function" and classify(n) is OpClass.RANDOM
               for n in gm.graph.nodes)


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured into a CUDA graph: (the graph, the outputs of the captured call,
    which live in the graph's private pool). ``fn`` runs once on a side stream first, as
    capture requires; a failed capture leaves the CUDA generators as they were."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with cuda_driver.capturing(), rng.rng_restored_on_failure(), torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def _aliases_input(node: torch.fx.Node) -> bool:
    while node.op == "call_function" and classify(node) is OpClass.VIEW and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.op == "placeholder"


def static_input_indices() -> set[int] | None:
    """AOTAutograd's static inputs (parameters, buffers) of the graph being compiled."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        if ctx is not None and ctx.fw_metadata is not None:
            return set(ctx.fw_metadata.static_input_indices)
    except AttributeError:
        pass
    return None


# (inputs, pointers by input index, indices) -> whether all those inputs' data pointers
# are the given ones; in torch's CUDA builds (absent from CPU builds).
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class GraphReplay:
    """Owns the capture of one Program; ``__call__`` returns its outputs, or raises
    ``NotCaptured`` when the Program should run uncaptured this time."""

    def __init__(self, program: Any, static_indices: set[int] | None, *,
                 random: bool = False):
        """``random``: the Program draws random numbers (``draws_random``); the runs a
        user's call would not make then leave the CUDA generators as they found them."""
        self.program = program
        self.random = random
        self.static_indices = static_indices or set()
        # The caller's inputs read in place (no copy) while they stay where the capture
        # read them: decided at a capture, emptied when one moves (``_stop_direct_reads``),
        # None again when they settle (``_inputs_settled``).
        self.direct: set[int] | None = None
        self._candidates: list[int] | None = None   # the inputs that may be read in place
        self._stable: tuple[int, tuple[int, ...]] = (0, ())   # calls in a row, their addresses
        self.direct_returns = 0
        self._static_order = sorted(self.static_indices)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[torch.Tensor | None] = []   # None: read in place
        self.static_outputs: Any = None
        # Fixed at each capture: the outputs handed over (cloned), the non-static mutated
        # inputs' (index, new value), the indices of inputs copied in.
        self._own: Any = None
        self._outside: list[tuple[int, Any]] = []
        self._copied: list[int] = []
        self.captured_ptrs: list[int] = []
        # Outputs handed over without a copy: the graph's output tensors (flattened),
        # weak references to the aliases the last call handed over, and the reference
        # counts of those tensors' storages before it did, in the same order (what
        # "nobody else holds them" reads).
        self._flat_own: list[torch.Tensor] = []
        # Outputs that are (views of) inputs: flat position -> (input index, sizes,
        # strides, element offset from the input's own), handed over as views of the
        # caller's input, never of the graph's copy of it.
        self._input_views: dict[int, tuple[int, tuple, tuple, int]] = {}
        self._handed: list[weakref.ref] = []
        self._baseline: list[int] = []
        self.clone_outputs = False
        self.abandoned = 0
        self.reused = 0       # replays into buffers nobody held any more
        self.moved = 0        # kept outputs moved to memory of their own
        self.warm = False
        self.checked = False
        self.disabled: str | None = None
        self.captures = 0

    def __call__(self, inputs: list[torch.Tensor]) -> Any:
        if self.disabled:
            raise NotCaptured(self.disabled)
        if not self.warm:
            self.warm = True  # one uncaptured run first: lazy initialisation stays out
            raise NotCaptured("warm-up")
        if self.graph is None or self._params_moved(inputs):
            if self.graph is not None:
                self._stop_direct_reads(inputs)
            self._capture(inputs)
        elif self._inputs_settled(inputs):
            self._capture(inputs)
        if not self.checked:
            self.checked = True
            return self._first_replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: list[torch.Tensor]) -> Any:
        """One replay: the last call's outputs moved out of the way where the user still
        holds them, inputs copied in (where they are not the graph's own), the graph,
        the mutations of non-static inputs written back, the outputs handed over. What
        each of these touches was worked out once, at capture (this runs every call)."""
        if self._handed and not self._release_outputs():
            self._abandon(inputs)
        for i in self._copied:
            x, static = inputs[i], self.static_inputs[i]
            if x.data_ptr() != static.data_ptr():
                static.copy_(x)
        self.graph.replay()
        if self._outside:
            write_back([inputs[i] for i, _ in self._outside], [v for _, v in self._outside])
        return self._hand_over(inputs)

    def _hand_over(self, inputs: Sequence[torch.Tensor] = ()) -> Any:
        """The outputs for the user: aliases of the graph's buffers (clones after
        ABANDON_LIMIT recaptures), remembered for the next call's look; outputs that
        are inputs, views of the caller's inputs."""
        if self.clone_outputs:
            return _with_input_views(_clone(self._own), self._input_views, inputs)
        self._baseline = [_use_count(t) for t in self._flat_own]
        handed: list[torch.Tensor] = []
        out = _alias(self._own, handed)
        if self._input_views:
            out = _with_input_views(out, self._input_views, inputs)
            handed = [t for j, t in enumerate(handed) if j not in self._input_views]
        self._handed = [weakref.ref(t) for t in handed]
        return out

    def _release_outputs(self) -> bool:
        """Whether the graph may overwrite its output buffers: nobody holds the aliases
        the last call handed over, or those held were moved to memory of their own and
        nothing else holds the buffers (False: a view of one is held)."""
        handed, self._handed = self._handed, []
        own, baseline = self._flat_own, self._baseline
        busy = [i for i, t in enumerate(own) if _use_count(t) > baseline[i]]
        if not busy:
            self.reused += 1
            return True
        for ref in handed:
            alias = ref()
            if alias is not None:
                if not _move_out(alias):
                    return False
                self.moved += 1
            del alias
        return all(_use_count(own[i]) <= baseline[i] for i in busy)

    def _abandon(self, inputs: list[torch.Tensor]) -> None:
        """Leave the graph and its output buffers to whoever still holds them (they are
        freed with the last reference) and capture the Program again; after
        ABANDON_LIMIT times, clone each replay's outputs instead."""
        self.abandoned += 1
        self.graph = self.static_outputs = self._own = None
        self._flat_own = []
        why = ("an earlier call's outputs are still held through a view (or could not be "
               "moved to memory of their own), so the graph's buffers were left to them")
        log.info("stitchcuda: %s captured again: %s", self.program.plan.graph_name, why)
        self.program.notes_sink.append(f"CUDA graph captured again ({self.abandoned} of "
                                       f"{ABANDON_LIMIT}): {why}")
        if self.abandoned >= ABANDON_LIMIT and not self.clone_outputs:
            self.clone_outputs = True
            self.program.notes_sink.append(
                f"replayed outputs cloned from now on: {self.abandoned} times a call found views "
                "of an earlier call's outputs still held (the graph's buffers were left to "
                "them and the Program captured again)")
        self.captures = max(0, self.captures - 1)   # not a moved parameter
        self._capture(inputs)

    def _direct_candidates(self, inputs: list[torch.Tensor]) -> set[int]:
        """The inputs the graph may read where the caller keeps them: every tensor input
        but the parameters and buffers (read in place anyway) and those the graph
        mutates (copied in and written back after the graph, as before)."""
        mutated = {w.input_index for w in self.program.writebacks}
        return {i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
                and i not in self.static_indices and i not in mutated}

    def _stop_direct_reads(self, inputs: list[torch.Tensor]) -> None:
        """Where an input the graph read in place has moved (a new tensor each call), copy
        every such input into the graph's own buffers until they settle; the capture this
        calls for does not count as a moved parameter's, and its first replay is checked
        and timed against running uncaptured again (the copies now cost each replay)."""
        moved = sorted(i for i in self.direct or () if inputs[i].data_ptr() != self.captured_ptrs[i])
        if not moved:
            return
        self.direct = set()
        self._stable = (0, ())
        self._input_mode_changed(
            f"CUDA graph inputs copied in: input {moved[0]} was read in place until a call "
            "passed it at another address (captured again)")

    def _input_mode_changed(self, note: str) -> None:
        """The inputs switch between read in place and copied in: the capture this calls
        for does not count as a moved parameter's, and its first replay is checked and
        timed against running uncaptured again."""
        self.checked = False
        self.captures = max(0, self.captures - 1)
        self.program.notes_sink.append(note)

    def _inputs_settled(self, inputs: list[torch.Tensor]) -> bool:
        """Whether inputs copied in since one moved have now stayed at one address for
        STABLE_CALLS calls in a row, so the graph should capture again reading them in
        place (at most DIRECT_RETURNS times; that capture's first replay is checked and
        timed again)."""
        if self.direct or self.direct_returns >= DIRECT_RETURNS or not self._candidates:
            return False
        ptrs = tuple(inputs[i].data_ptr() for i in self._candidates)
        count, last = self._stable
        self._stable = (count + 1 if ptrs == last else 1, ptrs)
        if self._stable[0] < STABLE_CALLS:
            return False
        self.direct = None          # decided again at the capture
        self.direct_returns += 1
        self._input_mode_changed(
            f"CUDA graph inputs read in place again: they stayed at one address for "
            f"{STABLE_CALLS} calls in a row (captured again; {self.direct_returns} of "
            f"{DIRECT_RETURNS})")
        return True

    def _by_place(self, values: Sequence[Any]) -> tuple[list[tuple[int, Any]],
                                                         list[tuple[int, Any]]]:
        """(input index, new value) of each writeback, split into those of parameters
        and buffers (written inside the graph) and the rest (written after it)."""
        pairs = [(w.input_index, v) for w, v in zip(self.program.writebacks, values)]
        return ([p for p in pairs if p[0] in self.static_indices],
                [p for p in pairs if p[0] not in self.static_indices])

    def _captured_run(self) -> Any:
        """What is captured: the Program on the static inputs, then the new values of
        mutated parameters and buffers written into them (only while capturing: the
        capture's uncaptured first run must not mutate anything)."""
        outputs = self.program.run_inputs(self.static_inputs)
        if self.program.writebacks and torch.cuda.is_current_stream_capturing():
            inside, _ = self._by_place(split_outputs(outputs, self.program.writebacks)[1])
            write_back([self.static_inputs[i] for i, _ in inside], [v for _, v in inside])
        return outputs

    def _first_replay(self, inputs: list[torch.Tensor]) -> Any:
        """The first replay, compared bit for bit with an uncaptured run on the same inputs
        (run first: it mutates nothing, so both see the inputs as they were), then timed
        against running uncaptured: replay stays on only where it is not slower."""
        writebacks = self.program.writebacks
        targets = [inputs[w.input_index] for w in writebacks]
        # random draws: the reference run and the replay start from the same generator
        # state, and the replay's draws are the ones this call keeps
        before = rng.rng_state(self.random)
        try:
            expected, values = split_outputs(self.program.run_inputs(inputs), writebacks)
        except torch.OutOfMemoryError as err:   # no room beside the graph's buffers:
            rng.rng_set(before)                   # no replay, this call runs uncaptured
            self.disable("out of GPU memory for the first replay's check (an uncaptured "
                         f"run beside the captured graph's buffers: {brief(err)})")
            torch.cuda.empty_cache()
            raise NotCaptured(self.disabled) from None
        rng.rng_set(before)
        outputs = self._replay(inputs)
        if not (_identical(outputs, expected) and _identical(list(targets), values)):
            # with writebacks, the targets now hold the replay's values: no rerun
            rerun = None
            if not writebacks:
                after = rng.rng_state(self.random)
                rng.rng_set(before)
                rerun = self.program.run_inputs(inputs)
                rng.rng_set(after)
            why = replay_disagrees(outputs, expected, rerun)
            if why:
                write_back(targets, values)
                self.disable(why)
                return expected
            self.program.notes_sink.append(
                "CUDA graph replay: the Program is not bit-for-bit repeatable (two "
                "uncaptured runs differ), so its first replay was checked by the "
                "correctness rule against an uncaptured run, and agreed")
        del expected, values
        try:
            why = self._slower_than_uncaptured(inputs, targets)
        except torch.OutOfMemoryError as err:   # the replay was checked: it stays
            why = None
            torch.cuda.empty_cache()
            self.program.notes_sink.append(
                "replay kept without timing it against running uncaptured: out of GPU memory "
                f"for the timing runs beside the captured graph's buffers ({brief(err)})")
        if why:
            self.disable(why)
        return outputs

    def _slower_than_uncaptured(self, inputs: list[torch.Tensor],
                                targets: list[torch.Tensor]) -> str | None:
        """Why replaying is the slower way to run this Program, if it is: a replay also
        copies the inputs in, which for a few kernels over large tensors costs more than
        the launches it saves, and cuDNN may choose other algorithms while capturing (a
        graph of large convolutions replayed 10% slower, seen on the H200). Whichever is faster is kept (replay, within REPLAY_MARGIN);
        where that is running uncaptured, the Program is also timed with every region on
        ATen, and where that is faster still, its generated kernels are set aside (a
        kernel faster alone can lose in context). Timed here, on the user's inputs; the
        timing runs' mutations are undone (not timed, replay kept, where the mutated
        inputs are too large to save a copy of: a KV cache, say)."""
        saved_bytes = nbytes(targets)
        if saved_bytes > SNAPSHOT_LIMIT:
            self.program.notes_sink.append(
                f"replay kept without timing it: {saved_bytes / 2**20:.0f} MiB of mutated inputs "
                "would have to be saved and restored around the timing runs")
            return None
        program = self.program
        aten_ms = None
        with restored(targets), rng.rng_kept(self.random):
            # interleaved, best of two medians each: one pass alone was seen to put replay
            # 20% behind on a GPU-bound graph that replayed at par in another process
            replay_ms = plain_ms = float("inf")
            for _ in range(2):
                replay_ms = min(replay_ms, wall_ms(lambda: self._replay(inputs)))
                plain_ms = min(plain_ms, wall_ms(
                    lambda: program.finish_call(program.run_inputs(inputs), targets)))
            if uncaptured_wins(replay_ms, plain_ms) and program.generated_steps():
                # Uncaptured it is; are the generated kernels still worth it in context?
                aten_ms = wall_ms(lambda: program.finish_call(
                    program.run_inputs(inputs, on_aten=True), targets))
        on_aten = "" if aten_ms is None else f", {aten_ms:.3f} ms uncaptured on ATen alone"
        program.notes_sink.append(
            f"one call: {replay_ms:.3f} ms replayed, {plain_ms:.3f} ms uncaptured{on_aten} "
            "(wall clock, best of two medians of 5, on the first replay)")
        if aten_ms is not None and aten_ms < plain_ms:
            program.use_aten(f"the whole graph ran faster on ATen alone ({aten_ms:.3f} ms vs "
                             f"{plain_ms:.3f} ms a call, uncaptured), so its verified kernels "
                             "are not used")
        if uncaptured_wins(replay_ms, plain_ms):
            return (f"slower than running uncaptured ({replay_ms:.3f} ms vs {plain_ms:.3f} ms "
                    "a call)")
        return None

    def _params_moved(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a parameter or buffer is no longer where the capture read it (every
        call: one C++ loop where torch has it, as Inductor's CUDA graphs use it; ~300
        ``data_ptr()`` calls from Python cost a MobileNetV2 call tens of microseconds)."""
        if _PTRS_EQUAL is not None:
            return not _PTRS_EQUAL(inputs, self.captured_ptrs, self._static_order)
        return any(inputs[i].data_ptr() != self.captured_ptrs[i] for i in self._static_order)

    def _capture(self, inputs: list[torch.Tensor]) -> None:
        if self.captures >= 3:
            self.disable("parameters kept moving: captured 3 times")
            raise NotCaptured(self.disabled)
        try:
            if self._candidates is None:
                self._candidates = sorted(self._direct_candidates(inputs))
            if self.direct is None:
                self.direct = set(self._candidates)
            kept = self.static_indices | self.direct
            # Owned copies with the inputs' exact strides: the kernels were generated for them.
            self.static_inputs = [x if i in kept else
                                  torch.empty_strided(x.size(), x.stride(), dtype=x.dtype,
                                                      device=x.device).copy_(x)
                                  for i, x in enumerate(inputs)]
            self.captured_ptrs = [x.data_ptr() for x in inputs]
            self._static_order = sorted(kept)
            with rng.rng_kept(self.random):   # capture's uncaptured run draws nothing the user sees
                self.graph, self.static_outputs = capture(self._captured_run)
            self._own, values = split_outputs(self.static_outputs, self.program.writebacks)
            flat = _tensors(self._own)
            self._input_views = input_views(flat, self.static_inputs)
            self._flat_own = [t for j, t in enumerate(flat) if j not in self._input_views]
            self._handed = []
            self._outside = self._by_place(values)[1]
            self._copied = [i for i in range(len(inputs)) if i not in kept]
            for i in self.direct:     # read where a call passes them: no reference kept
                self.static_inputs[i] = None
            self.captures += 1
        except Exception as err:  # noqa: BLE001 - capture failure: run uncaptured, say why
            self.graph = None
            self.disable(f"capture failed: {type(err).__name__}: {err}")
            raise NotCaptured(self.disabled) from None

    def disable(self, why: str) -> None:
        self.disabled = why
        self.graph = None
        self.static_outputs = self._own = None   # the graph's pool is freed with these
        self._flat_own, self._handed = [], []
        self._input_views = {}
        self._outside = []
        self.static_inputs = []
        log.warning("stitchcuda: CUDA graph replay off for %s: %s",
                    self.program.plan.graph_name, why)
        self.program.notes_sink.append(f"CUDA graph replay off: {why}")


def replay_disagrees(replayed: Any, expected: Any, rerun: Any | None) -> str | None:
    """Why a first replay that is not bitwise ``expected`` (an uncaptured run's outputs)
    does not stand, or None where it does: only where ``rerun`` (a second uncaptured
    run) also differs from ``expected``, so that the Program itself is not repeatable,
    and the replay is within the correctness rule's tolerance of ``expected`` or no
    further from it than twice the rerun is (the Program's own spread)."""
    from .correctness import compare

    if rerun is None or _identical(rerun, expected):
        return "the first replay differed from the uncaptured run"
    cmp = compare(replayed, expected, None)
    spread = compare(rerun, expected, None).max_abs
    if cmp.ok_kernelbench or cmp.max_abs <= 2 * spread:
        return None
    return ("the first replay differed from the uncaptured run beyond the correctness "
            f"rule ({cmp.reason}) and beyond twice the {spread:.3g} two uncaptured runs "
            "differ by")


def uncaptured_wins(replay_ms: float, plain_ms: float) -> bool:
    """Whether running uncaptured beats replaying by more than REPLAY_MARGIN."""
    return plain_ms * (1.0 + REPLAY_MARGIN) < replay_ms


def wall_ms(fn: Callable[[], Any], runs: int = 5) -> float:
    """Median wall-clock milliseconds of ``fn()`` from the host's call to the GPU's finish
    (launch cost included, which is what replay saves), after one untimed run."""
    import statistics
    import time

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class NotCaptured(Exception):
    """This call runs uncaptured (the reason is the message)."""
