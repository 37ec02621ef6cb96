"""The artifact store: one folder per compiled graph, published atomically.

Layout under the root (all folders 0o700, all files 0o600)::

    entries/<key[:2]>/<key>/manifest.json   key fields, plan, verdicts, timings, checksums
    entries/<key[:2]>/<key>/<artifact>      cubin, .so, .cu sources: any bytes
    locks/<key>.lock                        flock files serialising builds of one key
    tmp/                                    entries being written, and entries being removed
    notes/<kind>/<sha256>.json              small JSON facts measured once per machine and
                                            versions (``write_note``/``read_note``), such as
                                            the channels-last precision verdicts

An entry is written into ``tmp/`` and renamed into place, so readers see all of it or
none of it; once published it is never modified. Its folder's mtime is its last-used
time (``get`` touches it), which drives LRU eviction without rewriting any file.
Removal renames the folder into ``tmp/`` before deleting it, so no reader ever sees a
half-deleted entry.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from . import archive
from .errors import CacheError, CacheSecurityError, CorruptEntryError, KeyLookupError
from .files import _mkdir_private, _remove, _touch, _tree_size, _write_file
from .integrity import (MANIFEST, Problem, check_artifacts, ownership_problem, read_manifest,
                        sha256_bytes, valid_artifact_name)
from .keys import CACHE_VERSION, HEX_KEY, CacheKey, cache_root, canonical_json, key_hex
from .locking import FileLock

log = logging.getLogger("stitch_backend.cache")

KeyLike = CacheKey | str

# Fields the store writes into every manifest; a caller's manifest may not set them.
RESERVED_FIELDS = frozenset({"cache_version", "key", "key_fields", "created", "size",
                             "checksums"})

_SHARD = re.compile(r"[0-9a-f]{2}")
_NOTE_KIND = re.compile(r"[a-z0-9-]+")

# A temp folder this old belongs to a process that died mid-write.
STALE_TMP_SECONDS = 3600.0


@dataclass(frozen=True)
class Entry:
    """A published, verified entry. ``manifest`` is what ``put`` recorded."""

    key: str
    path: Path
    manifest: dict[str, Any]

    @property
    def checksums(self) -> dict[str, str]:
        """Artifact name -> sha256, as recorded at publish time."""
        return dict(self.manifest["checksums"])

    def artifact_path(self, name: str) -> Path:
        """Path of artifact ``name`` (for loaders that need a file); KeyError if the
        entry has no such artifact."""
        if name not in self.manifest["checksums"]:
            raise KeyError(f"cache entry {self.key[:16]} has no artifact {name!r}; it has "
                           f"{sorted(self.manifest['checksums'])}")
        return self.path / name

    def read(self, name: str) -> bytes:
        """Bytes of artifact ``name``, checked against the manifest's sha256 again;
        raises CorruptEntryError if the file changed or vanished since ``get``."""
        path = self.artifact_path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CorruptEntryError(self.path, f"artifact {name!r} vanished") from None
        if sha256_bytes(data) != self.manifest["checksums"][name]:
            raise CorruptEntryError(self.path, f"checksum mismatch for artifact {name!r}")
        return data


@dataclass(frozen=True)
class EntryInfo:
    """One line of ``Store.ls``: what the entry is and what it costs. ``problem`` is set
    when its manifest cannot be read (the entry would be rebuilt on next use)."""

    key: str
    path: Path
    size: int
    created: float | None
    last_used: float
    arch: str | None
    summary: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.path), "size": self.size,
                "created": self.created, "last_used": self.last_used, "arch": self.arch,
                "summary": self.summary, "problem": self.problem}


class Store:
    """The artifact store at ``root`` (default: ``cache_root()`` at construction time).

    Nothing is created until something is written. ``max_bytes`` caps the total size:
    after each ``put`` the least recently used entries are evicted. Unless
    ``trusted_shared`` is set (a shared cache the user named explicitly), entries and
    the root must be owned by the user and not writable by group or others.
    """

    def __init__(self, root: Path | str | None = None, *, max_bytes: int | None = None,
                 trusted_shared: bool = False) -> None:
        self.root = Path(root).expanduser().absolute() if root is not None else cache_root()
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.trusted_shared = trusted_shared

    def __repr__(self) -> str:
        return (f"Store({str(self.root)!r}, max_bytes={self.max_bytes}, "
                f"trusted_shared={self.trusted_shared})")

    # ------------------------------------------------------------------ layout, checks

    def entry_dir(self, key: KeyLike) -> Path:
        """Where entry ``key`` lives (whether or not it exists)."""
        h = key_hex(key)
        return self.root / "entries" / h[:2] / h

    def check_root(self) -> str | None:
        """Why the root may not be used, or None (also None when it does not exist yet)."""
        if self.trusted_shared or not os.path.lexists(self.root):
            return None
        if not self.root.is_dir():
            return "not a directory"
        return ownership_problem(self.root, follow=True)

    def _check_chain(self, entry: Path) -> None:
        """Raise CacheSecurityError/CorruptEntryError unless every folder from the root to
        ``entry`` may be trusted and ``entry`` is a real folder."""
        problem = self.check_root()
        if problem:
            raise CacheSecurityError(self.root, problem)
        if not self.trusted_shared:
            for folder in (entry.parent.parent, entry.parent):
                problem = ownership_problem(folder)
                if problem:
                    raise CacheSecurityError(folder, problem)
        st = os.lstat(entry)
        if stat.S_ISLNK(st.st_mode):
            raise CacheSecurityError(entry, "a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptEntryError(entry, "not a directory")
        if not self.trusted_shared:
            problem = ownership_problem(entry)
            if problem:
                raise CacheSecurityError(entry, problem)

    def _ensure_root(self) -> None:
        """Create the root and its folders (0o700) if needed; CacheSecurityError if the
        root is not safe to write native code into."""
        try:
            os.makedirs(self.root, mode=0o700)
            os.chmod(self.root, 0o700)  # makedirs' mode is filtered by the umask
        except FileExistsError:
            pass
        problem = self.check_root()
        if problem:
            raise CacheSecurityError(self.root, problem)
        for sub in ("entries", "locks", "tmp"):
            _mkdir_private(self.root / sub)

    def _iter_entry_dirs(self) -> Iterator[tuple[str, Path]]:
        """(key, folder) of every entry-shaped name under entries/, in key order."""
        entries = self.root / "entries"
        try:
            shards = sorted(os.listdir(entries))
        except (FileNotFoundError, NotADirectoryError):
            return
        for shard in shards:
            try:
                names = sorted(os.listdir(entries / shard))
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                if HEX_KEY.fullmatch(name) and name[:2] == shard:
                    yield name, entries / shard / name

    def _strays(self) -> list[Path]:
        """Names under entries/ that are not ``<key[:2]>/<key>`` (verify reports them)."""
        entries = self.root / "entries"
        try:
            shards = sorted(os.listdir(entries))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for shard in shards:
            folder = entries / shard
            if not _SHARD.fullmatch(shard) or not folder.is_dir():
                out.append(folder)
                continue
            out.extend(folder / name for name in sorted(os.listdir(folder))
                       if not (HEX_KEY.fullmatch(name) and name[:2] == shard))
        return out

    def keys(self) -> list[str]:
        """Hex keys of every entry folder present (checked or not)."""
        return [h for h, _ in self._iter_entry_dirs()]

    def resolve(self, prefix: str) -> str:
        """The one key starting with ``prefix``; KeyLookupError if none or several."""
        p = prefix.strip().lower()
        if not p or len(p) > 64 or any(c not in "0123456789abcdef" for c in p):
            raise KeyLookupError(prefix, [], f"{prefix!r} is not a hex key prefix")
        matches = [h for h in self.keys() if h.startswith(p)]
        if len(matches) != 1:
            raise KeyLookupError(prefix, matches)
        return matches[0]

    # ------------------------------------------------------------------ read

    def load(self, key: KeyLike) -> Entry | None:
        """The verified entry for ``key``, or None if there is none. Raises
        CorruptEntryError or CacheSecurityError instead of repairing anything; changes
        nothing on disk (not even the last-used time)."""
        h = key_hex(key)
        path = self.entry_dir(h)
        if not os.path.lexists(path):
            return None
        self._check_chain(path)
        manifest = read_manifest(path, h, trusted=self.trusted_shared)
        check_artifacts(path, manifest, trusted=self.trusted_shared)
        return Entry(h, path, manifest)

    def get(self, key: KeyLike) -> Entry | None:
        """The verified entry for ``key`` (its last-used time updated), or None: when
        absent, when refused for its ownership or mode (warning, left in place), or when
        corrupt (warning, removed so the caller's rebuild can publish). Never raises for
        what it finds on disk."""
        h = key_hex(key)
        path = self.entry_dir(h)
        try:
            inode = os.lstat(path).st_ino
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. the root is a file, or not readable by us
            log.warning("cannot read cache entry %s (%s); treating it as a miss", path, exc)
            return None
        try:
            entry = self.load(h)
        except CacheSecurityError as exc:
            log.warning("refusing cache entry %s: %s: %s; it was not loaded (open the "
                        "cache with trusted_shared=True only if you trust every writer)",
                        h[:16], exc.path, exc.reason)
            return None
        except CorruptEntryError as exc:
            log.warning("cache entry %s is corrupt (%s); removing it so it is rebuilt",
                        exc.path, exc.reason)
            self._discard(path, expect_inode=inode)
            return None
        except OSError as exc:
            log.warning("cannot read cache entry %s (%s); treating it as a miss", path, exc)
            return None
        if entry is not None:
            _touch(entry.path)
        return entry

    def info(self, key: KeyLike) -> EntryInfo | None:
        """Size, times and summary of ``key``'s entry without verifying checksums; None
        if absent. Raises CacheSecurityError for a refused entry."""
        h = key_hex(key)
        path = self.entry_dir(h)
        if not os.path.lexists(path):
            return None
        self._check_chain(path)
        problem, manifest = None, {}
        try:
            manifest = read_manifest(path, h, trusted=self.trusted_shared)
        except CorruptEntryError as exc:
            problem = exc.reason
        key_fields = manifest.get("key_fields")
        arch = key_fields.get("arch") if isinstance(key_fields, dict) else None
        summary = manifest.get("summary")
        created = manifest.get("created")
        return EntryInfo(
            key=h, path=path, size=_tree_size(path),
            created=float(created) if isinstance(created, (int, float)) else None,
            last_used=os.lstat(path).st_mtime, arch=arch if isinstance(arch, str) else None,
            summary=summary if isinstance(summary, dict) else {}, problem=problem)

    def ls(self) -> list[EntryInfo]:
        """Every entry, most recently used first. Entries refused for ownership or mode
        are left out with a warning naming the path; the whole cache if the root is."""
        problem = self.check_root()
        if problem:
            log.warning("refusing cache root %s: %s", self.root, problem)
            return []
        out = []
        for h, _ in self._iter_entry_dirs():
            try:
                item = self.info(h)
            except CacheSecurityError as exc:
                log.warning("refusing cache entry %s: %s: %s", h[:16], exc.path, exc.reason)
                continue
            except (CorruptEntryError, FileNotFoundError):
                continue  # removed concurrently, or not a folder: verify reports it
            except OSError as exc:
                log.warning("cannot read cache entry %s: %s", h[:16], exc)
                continue
            if item is not None:
                out.append(item)
        return sorted(out, key=lambda e: e.last_used, reverse=True)

    def verify(self) -> list[Problem]:
        """Every broken or refused entry with the reason, checksums included. Reports
        only: it repairs nothing (``get`` removes corrupt entries when they are used)."""
        problem = self.check_root()
        if problem:
            return [Problem("", self.root, f"cache root {problem}")]
        problems = [Problem(path.name, path, "unexpected name in the entries folder")
                    for path in self._strays()]
        for h, path in self._iter_entry_dirs():
            try:
                self.load(h)
            except (CorruptEntryError, CacheSecurityError) as exc:
                problems.append(Problem(h, path, f"{exc.path}: {exc.reason}"
                                        if exc.path != path else exc.reason))
            except OSError as exc:
                problems.append(Problem(h, path, f"unreadable: {exc}"))
        return problems

    # ------------------------------------------------------------------ write

    def put(self, key: KeyLike, manifest: Mapping[str, Any],
            artifacts: Mapping[str, bytes]) -> Entry:
        """Publish an entry atomically and return it. Checksums, size, creation time and
        (for a CacheKey) the key fields are added to ``manifest``. If the entry already
        exists (another process won the race) the existing one is kept and returned.
        Raises ValueError/TypeError for bad names or non-JSON manifests,
        CacheSecurityError if the root is not the user's own."""
        h = key_hex(key)
        clash = RESERVED_FIELDS & set(manifest)
        if clash:
            raise ValueError(f"manifest may not set the store's fields {sorted(clash)}")
        blobs: dict[str, bytes] = {}
        for name, data in artifacts.items():
            if not valid_artifact_name(name):
                raise ValueError(f"invalid artifact name {name!r}: use a plain file name "
                                 f"(letters, digits, ._+-) other than {MANIFEST}")
            blobs[name] = bytes(data)
        full = dict(manifest)
        full.update(
            cache_version=CACHE_VERSION, key=h,
            key_fields=key.fields() if isinstance(key, CacheKey) else None,
            created=time.time(), size=sum(len(b) for b in blobs.values()),
            checksums={name: sha256_bytes(b) for name, b in sorted(blobs.items())})
        entry = self._publish(h, full, blobs)
        if self.max_bytes is not None:
            self.evict(self.max_bytes, keep=(h,))
        return entry

    def _publish(self, h: str, manifest: dict[str, Any], blobs: Mapping[str, bytes]) -> Entry:
        """Write a complete entry into tmp/ and rename it into place. ``manifest`` must
        already be complete and match ``blobs`` (put and import guarantee it)."""
        try:
            text = json.dumps(manifest, sort_keys=True, indent=1, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"manifest is not plain JSON: {exc}") from None
        self._ensure_root()
        existing = self.get(h)
        if existing is not None:
            return existing
        final = self.entry_dir(h)
        _mkdir_private(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f"{h}.", dir=self.root / "tmp"))
        try:
            for name, data in blobs.items():
                _write_file(tmp / name, data)
            _write_file(tmp / MANIFEST, text.encode("utf-8"))
            for _ in range(2):
                try:
                    os.replace(tmp, final)
                    return Entry(h, final, manifest)
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                existing = self.get(h)  # a corrupt one is removed here; then retry
                if existing is not None:
                    _remove(tmp)
                    return existing
            raise CacheError(f"could not publish {final}: an unusable entry is in the way "
                             f"and could not be removed")
        except BaseException:
            _remove(tmp)
            raise

    def lock(self, key: KeyLike, timeout: float | None = None) -> FileLock:
        """A cross-process lock for building ``key`` (use with ``with``). Creates the
        root if needed; CacheSecurityError if the root is not the user's own."""
        h = key_hex(key)
        self._ensure_root()
        return FileLock(self.root / "locks" / f"{h}.lock", timeout=timeout)

    def get_or_build(self, key: KeyLike,
                     build: Callable[[], tuple[Mapping[str, Any], Mapping[str, bytes]]],
                     *, timeout: float | None = None) -> Entry:
        """The entry for ``key``, built by ``build() -> (manifest, artifacts)`` if missing.
        Concurrent callers in any process build it once: the first builds under the
        key's lock, the others wait and then load what it published."""
        entry = self.get(key)
        if entry is not None:
            return entry
        with self.lock(key, timeout=timeout):
            entry = self.get(key)
            if entry is not None:
                return entry
            manifest, artifacts = build()
            return self.put(key, manifest, artifacts)

    # ------------------------------------------------------------------ remove

    def rm(self, key: KeyLike) -> bool:
        """Remove ``key``'s entry; True if there was one."""
        path = self.entry_dir(key)
        if not os.path.lexists(path):
            return False
        self._discard(path)
        return True

    def clear(self) -> int:
        """Remove every entry, every note and every temp folder; returns how many entries
        went. Lock files stay (see locking.py)."""
        count = 0
        for _, path in self._iter_entry_dirs():
            self._discard(path)
            count += 1
        if os.path.lexists(self.root / "notes"):
            self._discard(self.root / "notes")
        self._clean_tmp(max_age=None)
        return count

    # -- notes: small JSON facts keyed by a JSON value ---------------------------------
    def _note_path(self, kind: str, key: Any) -> Path:
        if not _NOTE_KIND.fullmatch(kind):
            raise ValueError(f"note kind {kind!r} is not [a-z0-9-]+")
        return self.root / "notes" / kind / f"{sha256_bytes(canonical_json(key).encode())}.json"

    def read_note(self, kind: str, key: Any) -> Any:
        """The value ``write_note(kind, key, value)`` stored, or None (absent, unreadable,
        not private to this user, or written for another key)."""
        path = self._note_path(kind, key)
        try:
            if self.check_root():
                return None
            if not self.trusted_shared:
                for folder in (path.parent.parent, path.parent, path):
                    if ownership_problem(folder):
                        return None
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("key") != canonical_json(key):
            return None
        return doc.get("value")

    def write_note(self, kind: str, key: Any, value: Any) -> None:
        """Store ``value`` (JSON) under (``kind``, ``key``), replacing an older one
        atomically: readers see the old file or the new one, never a part."""
        path = self._note_path(kind, key)
        self._ensure_root()
        _mkdir_private(self.root / "notes")
        _mkdir_private(path.parent)
        data = json.dumps({"key": canonical_json(key), "value": value}).encode()
        tmp = self.root / "tmp" / f"note-{secrets.token_hex(8)}"
        _write_file(tmp, data)
        os.replace(tmp, path)

    def note_counts(self) -> dict[str, int]:
        """How many notes each kind holds (``stitchcuda cache ls`` shows them: the
        cuBLASLt algorithms, layout races and precision verdicts this machine measured)."""
        counts: dict[str, int] = {}
        try:
            kinds = sorted(p for p in (self.root / "notes").iterdir() if p.is_dir())
        except OSError:
            return counts
        for kind in kinds:
            if _NOTE_KIND.fullmatch(kind.name):
                counts[kind.name] = sum(1 for f in kind.iterdir() if f.suffix == ".json")
        return counts

    def evict(self, max_bytes: int, *, keep: Iterable[str] = ()) -> list[str]:
        """Remove least recently used entries until the total size is at most
        ``max_bytes`` (keys in ``keep`` are spared); returns the evicted keys, oldest
        first. Also removes temp folders left by processes that died mid-write."""
        self._clean_tmp(max_age=STALE_TMP_SECONDS)
        spared = set(keep)
        sized = []
        for h, path in self._iter_entry_dirs():
            try:
                sized.append((os.lstat(path).st_mtime, h, path, _tree_size(path)))
            except OSError:
                continue
        total = sum(size for *_, size in sized)
        evicted = []
        for _, h, path, size in sorted(sized):
            if total <= max_bytes:
                break
            if h in spared:
                continue
            self._discard(path)
            total -= size
            evicted.append(h)
        if evicted:
            log.info("evicted %d cache entries to stay under %d bytes", len(evicted), max_bytes)
        return evicted

    def total_bytes(self) -> int:
        """Total size of all entries' files."""
        return sum(_tree_size(path) for _, path in self._iter_entry_dirs())

    def _discard(self, path: Path, expect_inode: int | None = None) -> None:
        """Rename ``path`` into tmp/ (atomic: readers see it whole or gone), then delete.
        With ``expect_inode``, do nothing if ``path`` was replaced meanwhile by a fresh
        entry from another process."""
        try:
            if expect_inode is not None and os.lstat(path).st_ino != expect_inode:
                return
            _mkdir_private(self.root / "tmp")
            grave = self.root / "tmp" / f"discard.{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
            os.replace(path, grave)
        except FileNotFoundError:
            return  # someone else removed it first
        _remove(grave)

    def _clean_tmp(self, max_age: float | None) -> None:
        tmp = self.root / "tmp"
        try:
            names = os.listdir(tmp)
        except (FileNotFoundError, NotADirectoryError):
            return
        now = time.time()
        for name in names:
            try:
                if max_age is None or now - os.lstat(tmp / name).st_mtime > max_age:
                    _remove(tmp / name)
            except FileNotFoundError:
                continue

    # ------------------------------------------------------------------ archives

    def export(self, keys: Iterable[KeyLike] | None, file: Path | str | BinaryIO
               ) -> archive.ExportReport:
        """Write the given entries (all if None) as a .tar.gz; see archive.export_entries."""
        return archive.export_entries(self, keys, file)

    def import_(self, file: Path | str | BinaryIO) -> archive.ImportReport:
        """Import entries from a .tar.gz; see archive.import_entries."""
        return archive.import_entries(self, file)
