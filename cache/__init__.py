"""The artifact store (installed as ``stitch_backend.cache``).

A small library of its own: it imports nothing from ``stitch_backend`` or
``stitch_backend.agents``; keys and manifests come in as plain values. Importing it
creates nothing on disk and reads no environment variable.

Typical use by the backend::

    store = Store()                                   # $STITCHCUDA_CACHE_DIR or ~/.cache/stitchcuda
    key = CacheKey(graph_text, metas, options, "sm_90a", versions)
    entry = store.get_or_build(key, build)            # build() -> (manifest, {name: bytes})
    cubin = entry.read("region0.cubin")               # checksum-verified bytes
"""

from .archive import ExportReport, ImportReport, Refusal
from .errors import (CacheError, CacheImportError, CacheLockTimeout, CacheSecurityError,
                     CorruptEntryError, KeyLookupError)
from .integrity import MANIFEST, Problem
from .keys import CACHE_VERSION, ENV_CACHE_DIR, CacheKey, cache_root, key_hex
from .locking import FileLock
from .store import RESERVED_FIELDS, Entry, EntryInfo, Store

__all__ = [
    "CACHE_VERSION", "ENV_CACHE_DIR", "MANIFEST", "RESERVED_FIELDS",
    "CacheError", "CacheImportError", "CacheKey", "CacheLockTimeout", "CacheSecurityError",
    "CorruptEntryError", "Entry", "EntryInfo", "ExportReport", "FileLock", "ImportReport",
    "KeyLookupError", "Problem", "Refusal", "Store", "cache_root", "key_hex",
]
