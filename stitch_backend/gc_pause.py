"""Python's cyclic garbage collector paused while the backend compiles or verifies.

Compiling a graph allocates many short-lived container objects (FX nodes, sympy
expressions, kernel IR), so the collector's generation thresholds trip over and over and
each full pass walks everything the process holds (torch, the model, Dynamo's caches).
For a ResNet-50-sized graph warm-starting from the cache that was about a third of the
backend's time on this project's CPU (~670 -> ~440 ms with the collector off, cpu_interpret).
What the block leaves in reference cycles is collected after it, as usual.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block, back on after it if it was on before (nested
    blocks and a user who turned it off themselves are left as they were)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
