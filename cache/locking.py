"""Cross-process build locks: ``fcntl.flock`` on a file under ``<root>/locks``.

flock locks belong to an open file description, so two processes (or two threads that
each open the file) exclude each other, and the kernel drops the lock when the holder
dies, so a crashed build never leaves the cache wedged. Lock files are never deleted:
removing one while another process waits on it would let a third process lock a new
file of the same name and build concurrently.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from .errors import CacheLockTimeout


class FileLock:
    """An exclusive lock on ``path`` (created 0o600 if absent), held inside ``with``.

    ``timeout=None`` waits for as long as the holder builds; a number raises
    CacheLockTimeout after that many seconds. Not reentrant: taking the same lock again
    in one process while holding it blocks.
    """

    def __init__(self, path: Path, timeout: float | None = None, poll: float = 0.05) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.poll = poll
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if self.timeout is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._wait(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _wait(self, fd: int) -> None:
        assert self.timeout is not None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CacheLockTimeout(self.path, self.timeout) from None
                time.sleep(self.poll)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
