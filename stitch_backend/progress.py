"""Progress bars for the backend's long steps: compiling a graph's candidates, the LLM
Coder's regions, verifying candidates at the first call.

A bar appears only on a terminal (tqdm's own check of stderr) and only once its step has
run ``DELAY_S`` seconds, so small graphs and logs stay quiet; it disappears when the step
ends. The ``progress`` setting (``STITCHCUDA_PROGRESS=0``) turns them off.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

DELAY_S = 2.0


class _Quiet:
    """What a step updates when no bar is shown."""

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def bar(total: int, desc: str, unit: str, *, enabled: bool = True) -> Iterator[Any]:
    """A bar over ``total`` items (``update(n)`` as they finish); a quiet stand-in when
    ``enabled`` is False, there is nothing to count, or tqdm cannot be loaded."""
    if not enabled or total <= 0:
        yield _Quiet()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Quiet()
        return
    try:
        shown = tqdm(total=total, desc=f"stitchcuda: {desc}", unit=unit, delay=DELAY_S,
                     leave=False, disable=None, file=sys.stderr, dynamic_ncols=True)
    except TypeError:        # a tqdm older than 4.60 (no ``delay``): no bar rather than noise
        yield _Quiet()
        return
    try:
        yield shown
    finally:
        shown.close()
