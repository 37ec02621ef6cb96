"""A Program's first call judged against the graph as traced, where a graph pass changed
more than rounding.

Candidates are verified against their region's ATen ops, and the whole Program against
its own graph on ATen (``agents.acceptance``). Both references are the graph *after* the
backend's graph passes. Every pass but one computes the traced values: the channels-last
rewrite may keep convolutions in cuDNN's TF32 kernels where the graph's outputs held
DESIGN.md's rule on random draws (``graph_precision``). Whether they hold can depend on
the user's values: on an H100 (2026-12-06) KernelBench L2 27 held on standard normal
draws and missed the rule by 1000x on its own uniform inputs, and the bench caught it,
not the backend.

So such a Program carries the traced graph (``TracedCheck``). Its first call runs as
usual (verification included); then the traced graph runs on the same inputs, with the
random generators put back between the two, and the Program's outputs are judged by
DESIGN.md's rule against it, with an fp64 run of the traced graph where 1e-4 is missed.
Where they fail, that call returns the traced graph's outputs, every later call runs the
traced graph (ATen, no replay), the reason is in the record's notes, and ``remember``
keeps the failure (in the cache's precision notes) so that a later compile does not
rewrite the graph that way again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import cudagraphs, rng
from .correctness import compare, run_fp64

log = logging.getLogger("stitch_backend.traced_check")


@dataclass
class TracedCheck:
    """The graph before a pass that changes values, what that pass did (for messages), and
    how to remember a failure (None: nothing kept)."""

    traced: torch.fx.GraphModule
    what: str
    remember: Callable[[str], None] | None = None


def judged(check: TracedCheck, inputs: Sequence[Any],
           run: Callable[[], Any]) -> tuple[Any, str | None]:
    """``run()`` (the Program's first call on ``inputs``, which it must not consume), then
    ``check.traced`` on the same inputs and the same random numbers; returns the outputs
    to hand the user and, where the Program's failed the rule, why (the traced graph's
    outputs are then returned)."""
    fork = cudagraphs.draws_random(check.traced)
    before = rng.RngState() if fork else None
    got = run()
    after = rng.RngState() if fork else None
    _restore(before)
    with torch.no_grad():
        try:
            want = check.traced(*inputs)
        except torch.OutOfMemoryError as err:
            # both results do not fit at once: the traced graph's alone, unjudged
            got = None
            torch.cuda.empty_cache()
            _restore(before)
            want = check.traced(*inputs)
            _restore(after)
            return want, _failed(check, f"could not be judged (the traced graph's run beside "
                                        f"the Program's outputs: {type(err).__name__})",
                                 remember=False)
        cmp = compare(got, want, None)
        if not cmp.ok_design:
            _restore(before)
            try:
                cmp = compare(got, want, run_fp64(check.traced, list(inputs)))
            except Exception as err:  # noqa: BLE001 - unjudged: the traced graph is safe
                _restore(after)
                return want, _failed(check, f"could not be judged (it missed 1e-4 of the "
                                            f"traced graph, and the fp64 run failed: "
                                            f"{type(err).__name__}: {err})", remember=False)
    _restore(after)
    if cmp.ok_design:
        return got, None
    return want, _failed(check, f"gave outputs that are not correct by the rule against "
                                f"the graph as traced ({cmp.reason})")


def _failed(check: TracedCheck, what: str, remember: bool = True) -> str:
    """The reason the graph runs as traced from now on (logged, and remembered where the
    check says how and ``remember``: a check that could not run is not a verdict)."""
    why = f"on the first call's inputs, {check.what} {what}"
    log.warning("stitchcuda: %s: the graph runs as traced from now on", why)
    if remember and check.remember is not None:
        check.remember(why)
    return why


def _restore(state: rng.RngState | None) -> None:
    if state is not None:
        state.restore()


__all__ = ["TracedCheck", "judged"]
