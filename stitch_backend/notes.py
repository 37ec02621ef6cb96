"""Small computed facts kept in the cache beside its entries (``cache.Store``'s notes):
read and written here so that a cache problem only costs recomputing the fact.

The layout pass keeps its precision verdicts this way, ``lt_ops`` its cuBLASLt
algorithm choices. A stored value is data from disk: the reader says what is valid.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("stitch_backend.notes")


def read_note(store: Any, kind: str, key: Any, valid: Callable[[Any], bool]) -> Any | None:
    """The value stored under (``kind``, ``key``) when ``valid(value)``; None for no
    store, an absent or unreadable note, or an invalid value."""
    if store is None or key is None:
        return None
    try:
        value = store.read_note(kind, key)
    except Exception:  # noqa: BLE001 - a cache problem only costs recomputing it
        return None
    return value if value is not None and valid(value) else None


def write_note(store: Any, kind: str, key: Any, value: Any) -> None:
    """Store ``value``; a failure is logged (the value holds for this process anyway)."""
    if store is None or key is None:
        return
    try:
        store.write_note(kind, key, value)
    except Exception as err:  # noqa: BLE001 - only a later process loses the fact
        log.debug("note %s not stored: %s", kind, err)


__all__ = ["read_note", "write_note"]
