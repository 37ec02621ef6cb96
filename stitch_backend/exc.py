"""Typed errors. Each carries the evidence a user needs to act on it."""

from __future__ import annotations


class StitchError(Exception):
    """Base class of every error stitchcuda raises on purpose."""


class InvalidOptionError(StitchError, ValueError):
    """An unknown option name or a value of the wrong type."""


class UnsupportedDeviceError(StitchError):
    """A request for a device or architecture stitchcuda cannot target."""


class ProblemLoadError(StitchError):
    """A model file or factory given on the command line could not be loaded."""


def brief(err: BaseException) -> str:
    """``err``'s type and the first two sentences of its first line, for a note (torch's
    out-of-memory message goes on for lines about the allocator)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {'. '.join(text.split('. ')[:2])}"
