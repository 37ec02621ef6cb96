"""Taking turns on a GPU that several bench tasks share (``--jobs N --share-gpu``).

Each task's child holds an exclusive lock on its GPU's lock file while it uses the GPU
for anything measured or measuring: references, correctness checks, timing, and the
compile of backends that time things on the GPU while compiling (stitchcuda's Verifier).
Only the compile of backends that compile on the host (Inductor's default and
reduce-overhead modes) runs outside the lock, overlapping other tasks' turns, which is
where a shared run saves its time. Without the environment variable every turn is free.

A turn ends by handing the memory torch's caching allocator holds but does not use back
to the driver (``torch.cuda.empty_cache``): the tasks share the GPU's memory too, and
blocks one task cached in its turn made the next task's checks run out of memory (a
shared L2 run on an H100, 2026-12-06: four tasks holding 7 to 27 GiB each, 1.3 GiB free,
so one task's precision check and CUDA-graph capture failed with OutOfMemoryError).
What a task still uses stays: its model, its references, its CUDA graphs' pools.
"""

from __future__ import annotations

import fcntl
import os
from types import TracebackType

GPU_TURN_ENV = "STITCHCUDA_BENCH_GPU_TURN"      # the lock file of a shared GPU
GPU_SHARED_ENV = "STITCHCUDA_BENCH_GPU_SHARED"  # how many tasks share it


class GpuTurn:
    """``with turn:`` holds the GPU for this process (blocking until it is free); not
    re-entrant. A no-op when ``path`` is None."""

    def __init__(self, path: str | None):
        self.path = path
        self._fd: int | None = None

    @classmethod
    def from_env(cls) -> "GpuTurn":
        return cls(os.environ.get(GPU_TURN_ENV) or None)

    @property
    def shared_by(self) -> int | None:
        """Tasks sharing this GPU (None when it is not shared)."""
        if self.path is None:
            return None
        return int(os.environ.get(GPU_SHARED_ENV, "2"))

    def __enter__(self) -> "GpuTurn":
        if self.path is not None:
            if self._fd is not None:
                raise RuntimeError("GpuTurn is not re-entrant")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            _release_cached_memory()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _release_cached_memory() -> None:
    """Return the caching allocator's unused blocks to the driver, where this process
    has initialised CUDA (a host-only task has nothing cached)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
