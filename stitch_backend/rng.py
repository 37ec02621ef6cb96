"""The random generators around the runs the backend makes that a user's call would
not (a CUDA graph's capture run and first-replay reference run, timing runs, the
Verifier's re-runs, the first call's check against the graph as traced): saved and put
back, so a seeded run draws eager's numbers; and put back after a failed CUDA graph
capture, which leaves torch's CUDA generators in capturing mode."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

log = logging.getLogger("stitch_backend.cudagraphs")


@contextlib.contextmanager
def rng_kept(active: bool = True) -> Iterator[None]:
    """Puts the CUDA generators back as they were on entry: around the runs a replayed
    Program makes that the user's call would not (the capture's uncaptured run, the
    first replay's uncaptured reference run, the timing runs), so that a graph drawing
    random numbers leaves the generator where one eager call would have."""
    saved = rng_state(active)
    try:
        yield
    finally:
        rng_set(saved)


def rng_state(active: bool = True) -> list[torch.Tensor] | None:
    """The CUDA generators' states where ``active`` (None otherwise)."""
    return torch.cuda.get_rng_state_all() if active else None


def rng_set(state: list[torch.Tensor] | None) -> None:
    """Put back what ``rng_state`` saved (nothing for None)."""
    if state is not None:
        torch.cuda.set_rng_state_all(state)


class RngState:
    """The CPU generator's state and, once CUDA is initialised, the CUDA generators': put
    back with ``restore`` (the Verifier's re-runs, the first call's check against the
    graph as traced)."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def rng_restored_on_failure() -> Iterator[None]:
    """Around a CUDA graph capture: if the capture fails, put back the CUDA generators'
    states, which the capture had switched to capturing mode and torch leaves so (the
    next random op outside a capture would then raise)."""
    saved = []
    for gen in torch.cuda.default_generators:
        try:
            saved.append((gen, gen.clone_state()))
        except (AttributeError, RuntimeError):  # pragma: no cover - older torch
            pass
    try:
        yield
    except BaseException:
        for gen, state in saved:
            try:
                gen.graphsafe_set_state(state)
            except (AttributeError, RuntimeError) as err:  # pragma: no cover
                log.warning("could not restore the CUDA generator after a failed capture "
                            "(%s: %s)", type(err).__name__, err)
        raise


__all__ = ["RngState", "rng_kept", "rng_restored_on_failure", "rng_set", "rng_state"]
