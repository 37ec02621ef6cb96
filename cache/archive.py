"""Export entries to a .tar.gz and import them back, refusing anything unsafe.

An archive holds ``<key>/manifest.json`` and ``<key>/<artifact>`` members only. Import
never extracts with tarfile: it reads each member's bytes, checks the name, type,
manifest and checksums itself, and publishes accepted entries through the store's own
atomic publish, so nothing can land outside the cache and no file mode, owner or link
from the archive survives.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .errors import CacheImportError, CacheSecurityError, CorruptEntryError
from .integrity import MANIFEST, parse_manifest, sha256_bytes, valid_artifact_name
from .keys import HEX_KEY, CacheKey, key_hex

if TYPE_CHECKING:  # only for annotations: store.py imports this module
    from .store import KeyLike, Store

# A member larger than this is refused before it is read into memory.
MAX_MEMBER_BYTES = 1 << 30


@dataclass(frozen=True)
class Refusal:
    """Something not exported or not imported: a key or an archive member, and why."""

    name: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


@dataclass
class ExportReport:
    """Keys written to the archive, and entries skipped because they did not verify."""

    exported: list[str] = field(default_factory=list)
    skipped: list[Refusal] = field(default_factory=list)


@dataclass
class ImportReport:
    """What an import did: keys published, keys already present (kept as they were),
    and members or entries refused, each with the reason."""

    imported: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused

    def to_json(self) -> dict[str, Any]:
        return {"imported": self.imported, "present": self.present,
                "refused": [r.to_json() for r in self.refused]}


def export_entries(store: Store, keys: Iterable[KeyLike] | None,
                   file: Path | str | BinaryIO) -> ExportReport:
    """Write ``keys``' entries (every entry if None) to ``file`` as a .tar.gz (a path is
    created 0o600). Each entry is verified first; ones that fail are skipped, not sent."""
    wanted = store.keys() if keys is None else [key_hex(k) for k in keys]
    report = ExportReport()
    if isinstance(file, (str, Path)):
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as raw:
            _write_tar(store, wanted, raw, report)
    else:
        _write_tar(store, wanted, file, report)
    return report


def _write_tar(store: Store, wanted: list[str], raw: BinaryIO, report: ExportReport) -> None:
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for h in dict.fromkeys(wanted):
            try:
                entry = store.load(h)
            except (CorruptEntryError, CacheSecurityError) as exc:
                report.skipped.append(Refusal(h, f"{exc.path}: {exc.reason}"))
                continue
            if entry is None:
                report.skipped.append(Refusal(h, "no such entry"))
                continue
            files = {MANIFEST: json.dumps(entry.manifest, sort_keys=True, indent=1).encode()}
            try:
                files.update((name, entry.read(name)) for name in sorted(entry.checksums))
            except CorruptEntryError as exc:
                report.skipped.append(Refusal(h, exc.reason))
                continue
            for name, data in files.items():
                info = tarfile.TarInfo(f"{h}/{name}")
                info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                tar.addfile(info, io.BytesIO(data))
            report.exported.append(h)


def import_entries(store: Store, file: Path | str | BinaryIO) -> ImportReport:
    """Import every acceptable entry of the .tar.gz ``file`` into ``store``.

    Refused (and reported) are: members with absolute paths, ``..``, links, devices or
    any name other than ``<key>/<file>``; and whole entries with a refused member, no or
    a bad manifest, another CACHE_VERSION, key fields that do not hash to their key,
    files missing from or absent in the manifest, or a checksum mismatch. Entries
    already in the store are kept as they are. Raises CacheImportError only if the file
    is not a readable .tar.gz (then nothing is imported), CacheSecurityError if the
    store's root is not the user's own.
    """
    report = ImportReport()
    groups, bad = _read_members(file, report)
    store._ensure_root()
    for h in sorted(set(groups) | set(bad)):
        if h in bad:
            report.refused.append(Refusal(h, bad[h]))
            continue
        manifest, reason = _check_entry(h, groups[h])
        if reason:
            report.refused.append(Refusal(h, reason))
            continue
        assert manifest is not None
        if store.get(h) is not None:
            report.present.append(h)
            continue
        blobs = {name: data for name, data in groups[h].items() if name != MANIFEST}
        store._publish(h, manifest, blobs)
        report.imported.append(h)
    if store.max_bytes is not None and report.imported:
        store.evict(store.max_bytes, keep=report.imported)
    return report


def _read_members(file: Path | str | BinaryIO, report: ImportReport
                  ) -> tuple[dict[str, dict[str, bytes]], dict[str, str]]:
    """Bytes of every acceptable member, grouped by key, and keys refused whole."""
    groups: dict[str, dict[str, bytes]] = {}
    bad: dict[str, str] = {}
    name = file if isinstance(file, (str, Path)) else getattr(file, "name", "<stream>")
    try:
        if isinstance(file, (str, Path)):
            tar = tarfile.open(name=file, mode="r:gz")
        else:
            tar = tarfile.open(fileobj=file, mode="r:gz")
        with tar:
            for member in tar:
                reason, h = _member_problem(member)
                if reason:
                    report.refused.append(Refusal(member.name, reason))
                    if h:
                        bad.setdefault(h, f"member {member.name!r} refused: {reason}")
                    continue
                if member.isdir():
                    continue
                h, artifact = member.name.split("/")
                files = groups.setdefault(h, {})
                if artifact in files:
                    bad.setdefault(h, f"member {member.name!r} appears twice")
                    continue
                stream = tar.extractfile(member)
                assert stream is not None  # regular files always have one
                files[artifact] = stream.read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise CacheImportError(str(name), f"not a readable .tar.gz ({exc})") from None
    return groups, bad


def _member_problem(member: tarfile.TarInfo) -> tuple[str | None, str | None]:
    """(why ``member`` is refused or None, the key it belongs to if any)."""
    name = member.name
    head = name.split("/", 1)[0]
    h = head if HEX_KEY.fullmatch(head) else None
    parts = name.split("/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "absolute path", None
    if ".." in parts:
        return "path with a '..' component (would land outside the cache)", h
    if member.issym():
        return f"symbolic link (to {member.linkname!r})", h
    if member.islnk():
        return f"hard link (to {member.linkname!r})", h
    if member.ischr() or member.isblk() or member.isfifo():
        return "device or fifo", h
    if member.isdir():
        return (None, h) if h and name.rstrip("/") == h else ("unexpected folder", h)
    if not member.isreg():
        return f"not a regular file (tar type {member.type!r})", h
    if h is None or len(parts) != 2 or not (parts[1] == MANIFEST
                                            or valid_artifact_name(parts[1])):
        return "not of the form <key>/<file>", h
    if member.size > MAX_MEMBER_BYTES:
        return f"larger than {MAX_MEMBER_BYTES} bytes", h
    return None, h


def _check_entry(h: str, files: dict[str, bytes]) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) if ``files`` form a valid entry ``h``, else (None, reason)."""
    if MANIFEST not in files:
        return None, "no manifest.json"
    manifest, reason = parse_manifest(files[MANIFEST], h)
    if reason:
        return None, reason
    assert manifest is not None
    key_fields = manifest.get("key_fields")
    if key_fields is not None:
        try:
            if not isinstance(key_fields, dict) or CacheKey.from_fields(key_fields).hex != h:
                return None, "key fields do not hash to the entry's key"
        except (TypeError, ValueError) as exc:
            return None, f"malformed key fields ({exc})"
    checksums: dict[str, str] = manifest["checksums"]
    present = set(files) - {MANIFEST}
    if present - set(checksums):
        return None, f"file(s) not in the manifest: {sorted(present - set(checksums))}"
    if set(checksums) - present:
        return None, f"artifact(s) missing from the archive: {sorted(set(checksums) - present)}"
    for name, digest in sorted(checksums.items()):
        if sha256_bytes(files[name]) != digest:
            return None, f"checksum mismatch for artifact {name!r}"
    return manifest, None
