"""Logging setup. Nothing happens on import: ``configure`` runs when a backend is made.

Loggers: ``stitch_backend.*`` for the backend's own messages; generated code goes to
``stitch_backend.output_code`` and is shown only when that logger is enabled (for example
``STITCHCUDA_LOG=DEBUG``).
"""

from __future__ import annotations

import logging

ROOT = "stitch_backend"
OUTPUT_CODE = "stitch_backend.output_code"
_configured_level: str | None = None
_warned: set[str] = set()


def configure(level: str) -> None:
    """Apply ``STITCHCUDA_LOG`` (a level name) once: a stderr handler on the
    ``stitch_backend`` logger only when the user asked for a level."""
    global _configured_level
    if not level or level == _configured_level:
        return
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        from .exc import InvalidOptionError

        raise InvalidOptionError(
            f"STITCHCUDA_LOG={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    logger = logging.getLogger(ROOT)
    logger.setLevel(numeric)
    if not any(getattr(h, "_stitchcuda", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[stitchcuda %(levelname)s] %(name)s: %(message)s"))
        handler._stitchcuda = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    _configured_level = level


def warn_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned:
        logger.info(message)
        return
    _warned.add(key)
    logger.warning(message)
