"""Typed errors of the artifact store, raised where the caller has to act.

Corruption found by ``Store.get`` is not an error: it is logged and reported as a miss,
so the caller rebuilds. These errors are for what a rebuild cannot fix: a cache folder
that is not safe to load native code from, an archive that cannot be imported, a lock
that was not acquired in time, a key prefix that names no single entry.
"""

from __future__ import annotations

from pathlib import Path


class CacheError(Exception):
    """Base class of every error the cache raises on purpose."""


class CacheSecurityError(CacheError):
    """A path in the cache is not private to the user (or is a link) and was refused."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(
            f"refusing {self.path}: {reason} (only a cache you trust may be opened with "
            f"trusted_shared=True)"
        )


class CorruptEntryError(CacheError):
    """An entry on disk does not match its manifest (or has no valid manifest)."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"corrupt cache entry {self.path}: {reason}")


class CacheImportError(CacheError):
    """An archive given to ``Store.import_`` could not be read at all."""

    def __init__(self, file: Path | str, reason: str) -> None:
        self.file = Path(file)
        self.reason = reason
        super().__init__(f"cannot import {self.file}: {reason}")


class CacheLockTimeout(CacheError):
    """Another process held a build lock longer than the caller was willing to wait."""

    def __init__(self, path: Path | str, timeout: float) -> None:
        self.path = Path(path)
        self.timeout = timeout
        super().__init__(f"lock {self.path} still held by another process after {timeout:g} s")


class KeyLookupError(CacheError, LookupError):
    """A key prefix matched no entry, or more than one."""

    def __init__(self, prefix: str, matches: list[str], reason: str | None = None) -> None:
        self.prefix = prefix
        self.matches = list(matches)
        if reason is None:
            if not matches:
                reason = f"no cache entry matches {prefix!r}"
            else:
                shown = ", ".join(m[:16] for m in matches[:5])
                more = "" if len(matches) <= 5 else f", ... ({len(matches) - 5} more)"
                reason = (
                    f"{prefix!r} is ambiguous: it matches {len(matches)} entries "
                    f"({shown}{more}); give more characters"
                )
        self.reason = reason
        super().__init__(reason)
