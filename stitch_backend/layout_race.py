"""Both layouts of an inference convolution graph, timed on the user's inputs, the faster
kept (the ``layout_race`` option).

``auto``'s rule for channels-last is a guess from the graph: on an H100 (session 24)
forcing NHWC made L3 ResNet18 0.575 ms against the traced layout's 0.768 and MobileNetV1
0.831 against 0.889, while MobileNetV2 lost (1.181 against 1.099) and EfficientNetB0 too
(1.075 against 1.052), and no rule of the graph separates them. So the backend may build
the graph's Program in both layouts and race them: until both have settled (verified,
their CUDA graph replay decided), each call returns the first Program's outputs and also
runs the second on the same inputs, with the inputs the graph mutates (BatchNorm's
running statistics) put back afterwards and the random generators kept; then both are
timed, interleaved, and every later call runs the faster. Each Program has its own
record, and the notes of both say what was raced and kept. It costs a second compile
and the second Program's work in the first calls; the loser's CUDA graph (its memory
pool) is released once the race is decided, its kernels stay loaded. The verdict is kept
in the cache's notes (``LayoutRace`` writes it, ``remembered_layout`` reads it): a later
process compiling the same graph on the same GPU, versions and options builds the
winner's layout alone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from . import cudagraphs, rng
from .graph_precision import free_bytes, graph_note_key
from .mutations import restored
from .notes import read_note, write_note
from .program import unboxed

log = logging.getLogger("stitch_backend.layout_race")

# Decide at the latest on this call, settled or not (a Program that never settles).
LATEST_CALL = 8
NOTE_KIND = "layout-race-1"
# Until it is decided, the race holds both Programs (their CUDA graphs' static buffers,
# their intermediates): it runs only where the traced graph's peak op by op fits this
# share of the GPU's free memory.
MEMORY_SHARE = 0.25


def races(option: bool | None, result: Any) -> bool:
    """Whether ``layout_race`` (``option``) races both layouts of a graph whose layout
    pass did ``result`` (a ``layout.LayoutResult``): never where an earlier race's verdict
    decided it. 'auto' (None): where ``auto``
    declined on its positions rule, a guess; or where the rewrite runs a convolution
    with cuDNN's TF32 off, which the traced layout runs as eager does (on an H100,
    KernelBench L2 92's convolution took 1.41 ms so, session 26, and its whole graph
    3.25 ms against Inductor's 1.54; raced, 1.97)."""
    if result.remembered:
        return False          # an earlier race decided (``layout_choice.decide``)
    if option is None:
        return result.guess or (result.applied and result.exact > 0)
    return option


def too_large(traced: torch.fx.GraphModule) -> str | None:
    """Why holding a second Program of ``traced`` could run its GPU out of memory, or
    None (CPU graphs: no limit here)."""
    from .memplan import graph_peak

    metas = [n.meta.get("val") for n in traced.graph.find_nodes(op="placeholder")]
    free = free_bytes(metas)
    if free is None:
        return None
    peak = graph_peak(traced)
    if peak is None:
        return "the graph's peak memory has no number (data-dependent sizes)"
    if peak > MEMORY_SHARE * free:
        return (f"the graph's peak ({peak / 2**20:.0f} MiB) is above {MEMORY_SHARE:.0%} of "
                f"the GPU's free memory ({free / 2**20:.0f} MiB), and the race holds both "
                "Programs until it is decided")
    return None


def race_key(traced: torch.fx.GraphModule, options: dict[str, Any], arch: str) -> dict:
    """What a race's verdict depends on: the graph as traced and its inputs, the GPU, the
    versions, cuDNN's flags (``graph_precision.graph_note_key``), the arch and the options
    that change the generated code."""
    return {**graph_note_key(traced), "arch": arch, "options": options}


def remembered_layout(store: Any, traced: torch.fx.GraphModule, options: dict[str, Any],
                      arch: str) -> tuple[bool | None, str | None]:
    """Whether an earlier race of ``traced`` kept channels-last (``store``: a cache Store,
    or None), and the note saying so; (None, None) where none is stored."""
    found = (None if store is None else
             read_note(store, NOTE_KIND, race_key(traced, options, arch), _valid))
    if found is None:
        return None, None
    kept = "channels-last" if found["channels_last"] else "the traced layout"
    return found["channels_last"], ("layout race: decided by an earlier process (the "
                                    f"cache's notes): {found['timing']}; {kept} runs")


def _valid(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("channels_last"), bool)
            and isinstance(value.get("timing"), str))


class LayoutRace:
    """Called by AOTAutograd in place of one inference Program: runs ``first`` and, until
    the race is decided, ``second`` beside it; then the faster alone. ``records`` are the
    two Programs' GraphRecords (for their notes); ``names`` say which layout each runs."""

    def __init__(self, first: Any, second: Any, records: Sequence[Any], names: Sequence[str],
                 draws_random: bool, store: Any = None, key: dict | None = None):
        self.programs = [first, second]
        self.records = list(records)
        self.names = list(names)
        self.draws_random = draws_random
        self.store, self.key = store, key     # where the verdict is kept (None: nowhere)
        self.calls = 0
        self.choice: Any = None
        self._boxed_call = True     # AOTAutograd calls with one list, as it does a Program

    def __call__(self, *call_args: Any) -> Any:
        inputs = unboxed(call_args)
        if self.choice is not None:
            return self.choice(inputs)
        self.calls += 1
        first, second = self.programs
        ready = self.calls > 1 and all(p.settled for p in self.programs)
        out = first(list(inputs))
        try:
            targets = [inputs[w.input_index] for w in first.writebacks]
            if ready or self.calls >= LATEST_CALL:
                self.choice = self._decide(inputs, targets)
            else:
                with restored(targets), self._generators():
                    second(list(inputs))      # its own first calls: verification, capture
        except Exception as err:  # noqa: BLE001 - the race must not break the model
            self.choice = first
            why = (f"layout race: stopped ({type(err).__name__}: {err}); "
                   f"{self.names[0]} kept")
            log.warning("stitchcuda: %s: %s", ", ".join(r.name for r in self.records), why)
            self._note(why)
        return out

    @contextlib.contextmanager
    def _generators(self) -> Iterator[None]:
        """The random generators put back after a run that is not the user's."""
        state = rng.RngState() if self.draws_random else None
        try:
            yield
        finally:
            if state is not None:
                state.restore()

    def _decide(self, inputs: list[Any], targets: list[torch.Tensor]) -> Any:
        """Time both Programs on ``inputs`` (interleaved, best of two) and keep the faster;
        the mutated ``targets`` and the generators are put back."""
        times: list[list[float]] = [[], []]
        with restored(targets), self._generators():
            for _ in range(2):
                for i, program in enumerate(self.programs):
                    times[i].append(cudagraphs.wall_ms(lambda p=program: p(list(inputs))))
        best = [min(t) for t in times]
        win = 0 if best[0] <= best[1] else 1
        timing = (f"{self.names[0]} {best[0]:.3f} ms vs {self.names[1]} {best[1]:.3f} ms "
                  "(wall clock, best of two medians of 5)")
        for i, rec in enumerate(self.records):
            rec.notes.append(f"layout race: {timing}: "
                             + ("this Program runs" if i == win else "the other Program runs"))
        log.info("stitchcuda: layout race of %s: %s; %s kept",
                 ", ".join(r.name for r in self.records), timing, self.names[win])
        write_note(self.store, NOTE_KIND, self.key,
                   {"channels_last": self.names[win] == "channels-last", "timing": timing})
        loser = self.programs[1 - win]
        if loser.replay is not None:
            loser.replay = None     # its CUDA graph and static buffers go with it
            self.records[1 - win].notes.append("layout race: its CUDA graph released")
        self.programs = [self.programs[win]]
        return self.programs[0]

    def _note(self, text: str) -> None:
        for rec in self.records:
            rec.notes.append(text)


__all__ = ["LATEST_CALL", "LayoutRace", "MEMORY_SHARE", "NOTE_KIND", "race_key", "races",
           "remembered_layout", "too_large"]
