"""File-system primitives of the store: private folders, files written once without
following links, last-used times, sizes, removal."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("stitch_backend.cache")


def _mkdir_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)
    except FileExistsError:
        pass


def _write_file(path: Path, data: bytes) -> None:
    # O_EXCL + O_NOFOLLOW: never write through something planted at this name.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError as exc:  # a shared cache's entry owned by someone else
        log.debug("could not update last-used time of %s: %s", path, exc)


def _tree_size(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for item in it:
                total += item.stat(follow_symlinks=False).st_size
    except (FileNotFoundError, NotADirectoryError):
        pass
    return total


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


__all__ = ["_mkdir_private", "_remove", "_touch", "_tree_size", "_write_file"]
