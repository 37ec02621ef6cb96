"""Integrity and ownership checks: the cache holds native code, so it is guarded like code.

An entry is loaded only if every file listed in its manifest is a regular file whose
sha256 matches, nothing else is in the folder, and (unless the store trusts a shared
cache) every path on the way is owned by the user and not writable by group or others.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CacheSecurityError, CorruptEntryError
from .keys import CACHE_VERSION, HEX_KEY

MANIFEST = "manifest.json"

# Flat, portable names: no separators, no leading dot, so an artifact name can never
# leave its entry folder nor hide in it.
_ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One broken or refused entry (``key`` is the folder name) and why."""

    key: str
    path: Path
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "path": str(self.path), "reason": self.reason}


def valid_artifact_name(name: object) -> bool:
    """True if ``name`` may name an artifact: a plain file name, not the manifest."""
    return isinstance(name, str) and name != MANIFEST and bool(_ARTIFACT_NAME.fullmatch(name))


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in chunks, not following a final link."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def ownership_problem(path: Path, *, follow: bool = False) -> str | None:
    """Why ``path`` is not private to the current user, or None if it is: a link (when
    not following), owned by another uid, or writable by group/others."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def manifest_problem(manifest: Any, key: str) -> str | None:
    """Why ``manifest`` is not a valid manifest of entry ``key``, or None."""
    if not isinstance(manifest, dict):
        return "manifest is not a JSON object"
    version = manifest.get("cache_version")
    if type(version) is not int or version != CACHE_VERSION:
        return f"cache version {version!r} differs from this stitchcuda's {CACHE_VERSION}"
    if manifest.get("key") != key:
        return f"manifest names key {manifest.get('key')!r}, not its folder's {key}"
    checksums = manifest.get("checksums")
    if not isinstance(checksums, dict):
        return "manifest has no 'checksums' object"
    for name, digest in checksums.items():
        if not valid_artifact_name(name):
            return f"manifest lists an invalid artifact name {name!r}"
        if not isinstance(digest, str) or not HEX_KEY.fullmatch(digest):
            return f"manifest has a malformed checksum for {name!r}"
    return None


def parse_manifest(data: bytes, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """Parse manifest bytes of entry ``key``: (manifest, None) or (None, reason)."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"manifest.json is not valid JSON ({exc})"
    problem = manifest_problem(manifest, key)
    return (None, problem) if problem else (manifest, None)


def read_manifest(entry_dir: Path, key: str, *, trusted: bool) -> dict[str, Any]:
    """Read and validate ``entry_dir/manifest.json``; raises CorruptEntryError or, for an
    untrusted store, CacheSecurityError if the file is not the user's own."""
    path = entry_dir / MANIFEST
    _regular_file(path, entry_dir, "manifest.json", trusted)
    manifest, problem = parse_manifest(path.read_bytes(), key)
    if problem:
        raise CorruptEntryError(entry_dir, problem)
    assert manifest is not None
    return manifest


def check_artifacts(entry_dir: Path, manifest: dict[str, Any], *, trusted: bool) -> None:
    """Raise CorruptEntryError unless the folder holds exactly the manifest's artifacts,
    each a regular file with the recorded sha256 (CacheSecurityError for foreign files
    in an untrusted store)."""
    checksums: dict[str, str] = manifest["checksums"]
    on_disk = set(os.listdir(entry_dir)) - {MANIFEST}
    extra = sorted(on_disk - set(checksums))
    if extra:
        raise CorruptEntryError(entry_dir, f"unexpected file(s) not in the manifest: {extra}")
    for name, digest in sorted(checksums.items()):
        path = entry_dir / name
        _regular_file(path, entry_dir, f"artifact {name!r}", trusted)
        if sha256_file(path) != digest:
            raise CorruptEntryError(
                entry_dir, f"checksum mismatch for artifact {name!r} (changed or truncated)")


def _regular_file(path: Path, entry_dir: Path, what: str, trusted: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CorruptEntryError(entry_dir, f"{what} is missing") from None
    if stat.S_ISLNK(st.st_mode):
        # A link could point anywhere; a trusted shared cache gets no exception here.
        raise CacheSecurityError(path, "a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise CorruptEntryError(entry_dir, f"{what} is not a regular file")
    if not trusted:
        problem = ownership_problem(path)
        if problem:
            raise CacheSecurityError(path, problem)
