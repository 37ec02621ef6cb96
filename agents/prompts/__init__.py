"""Prompt templates of the LLM Coder, as text files beside this module.

``render(name, **values)`` fills ``<name>.txt`` (``string.Template`` syntax: ``$var``,
``$$`` for a literal dollar) and is strict: a placeholder without a value, a value
without a placeholder, or a malformed placeholder raises ``PromptError``. Values are
inserted verbatim (CUDA source full of ``$`` or braces is safe).
"""

from __future__ import annotations

import functools
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent


class PromptError(ValueError):
    """A prompt template and the values given to it do not match."""


@functools.lru_cache(maxsize=None)
def _load(name: str) -> string.Template:
    path = HERE / f"{name}.txt"
    if not path.is_file():
        raise PromptError(f"no prompt template {name!r} (looked for {path})")
    return string.Template(path.read_text())


def placeholders(name: str) -> set[str]:
    """The variables template ``name`` needs."""
    return set(_load(name).get_identifiers())


def render(name: str, **values: object) -> str:
    """Template ``name`` with every placeholder filled from ``values`` (all of them
    used, none missing), else ``PromptError`` naming the mismatch."""
    tmpl = _load(name)
    if not tmpl.is_valid():
        raise PromptError(f"prompt {name!r} has a malformed placeholder (use $$ for '$')")
    need = set(tmpl.get_identifiers())
    missing = sorted(need - set(values))
    if missing:
        raise PromptError(f"prompt {name!r} is missing values for: {', '.join(missing)}")
    unused = sorted(set(values) - need)
    if unused:
        raise PromptError(f"prompt {name!r} has no placeholder for: {', '.join(unused)}")
    return tmpl.substitute({k: str(v) for k, v in values.items()})
