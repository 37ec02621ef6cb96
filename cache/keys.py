"""Cache keys: a sha256 over plain values, and where the cache lives.

The backend canonicalises the graph and collects metas, options and versions; this
module only turns those plain values into a deterministic digest (sorted, compact
JSON), so the same inputs give the same key in every process and on every machine.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Bump when the entry layout or the meaning of a manifest changes: every old entry then
# misses (the version is part of the key) and import refuses archives of other versions.
CACHE_VERSION = 1

ENV_CACHE_DIR = "STITCHCUDA_CACHE_DIR"

HEX_KEY = re.compile(r"[0-9a-f]{64}")


def cache_root() -> Path:
    """Return the cache root: ``$STITCHCUDA_CACHE_DIR`` if set and non-empty, else
    ``~/.cache/stitchcuda``. Reads the environment on every call; creates nothing."""
    raw = os.environ.get(ENV_CACHE_DIR, "")
    if raw:
        return Path(raw).expanduser().absolute()
    return Path.home() / ".cache" / "stitchcuda"


def canonical_json(value: Any) -> str:
    """Return the one JSON text of ``value`` used for hashing (sorted keys, no spaces,
    ASCII). Raises TypeError/ValueError for values JSON cannot hold (objects, NaN)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


@dataclass(frozen=True, eq=False)
class CacheKey:
    """The identity of one compiled graph. ``hex`` is the sha256 of all fields plus
    ``CACHE_VERSION``; two keys are equal exactly when their ``hex`` is.

    ``input_metas``, ``options`` and ``versions`` are copied through JSON on
    construction, so later changes to the caller's objects cannot change the key, and
    tuples become lists (a tuple and a list of the same items give the same key).
    """

    graph: str
    input_metas: Any
    options: Mapping[str, Any]
    arch: str
    versions: Mapping[str, Any]
    hex: str = field(init=False)

    def __post_init__(self) -> None:
        for name, kind in (("graph", str), ("arch", str), ("options", Mapping),
                           ("versions", Mapping)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"cache key field {name!r} must be a {kind.__name__}, "
                                f"got {type(getattr(self, name)).__name__}")
        for name in ("input_metas", "options", "versions"):
            try:
                text = canonical_json(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"cache key field {name!r} is not plain JSON: {exc}") from None
            object.__setattr__(self, name, json.loads(text))
        digest = hashlib.sha256(canonical_json(self._payload()).encode("ascii")).hexdigest()
        object.__setattr__(self, "hex", digest)

    def _payload(self) -> dict[str, Any]:
        return {
            "cache_version": CACHE_VERSION,
            "graph": self.graph,
            "input_metas": self.input_metas,
            "options": self.options,
            "arch": self.arch,
            "versions": self.versions,
        }

    def fields(self) -> dict[str, Any]:
        """Return a fresh JSON-ready dict of everything hashed (for the manifest)."""
        return copy.deepcopy(self._payload())

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> CacheKey:
        """Rebuild a key from ``fields()`` output; raises ValueError if the fields are
        incomplete or were written by another CACHE_VERSION."""
        version = fields.get("cache_version")
        if type(version) is not int or version != CACHE_VERSION:
            raise ValueError(f"key fields are of cache version {version!r}, "
                             f"not {CACHE_VERSION}")
        missing = {"graph", "input_metas", "options", "arch", "versions"} - set(fields)
        if missing:
            raise ValueError(f"key fields lack {sorted(missing)}")
        return cls(graph=fields["graph"], input_metas=fields["input_metas"],
                   options=fields["options"], arch=fields["arch"],
                   versions=fields["versions"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and other.hex == self.hex

    def __hash__(self) -> int:
        return hash(self.hex)

    def __repr__(self) -> str:
        # The graph text can be thousands of lines; the digest identifies the key.
        return f"CacheKey({self.hex[:16]}..., arch={self.arch!r})"


def key_hex(key: CacheKey | str) -> str:
    """Return the 64-char hex digest of ``key`` (a CacheKey or its hex string). Raises
    ValueError for anything else, so no caller-made string can become a path."""
    if isinstance(key, CacheKey):
        return key.hex
    if isinstance(key, str) and HEX_KEY.fullmatch(key):
        return key
    raise ValueError(f"not a cache key (CacheKey or 64 lowercase hex chars): {key!r}")
