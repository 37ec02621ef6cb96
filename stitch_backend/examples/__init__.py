"""A bundled suite of small models in KernelBench format, written for this project.

Each ``<name>.py`` defines ``class Model(nn.Module)``, ``get_inputs()`` and
``get_init_inputs()``. Sizes are small (about a second for everything on a CPU) but
shaped like real workloads: MLP and transformer blocks, convolutions with batch norm,
a recurrent cell, normalisations. ``stitchcuda bench --suite examples`` runs them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stitch_backend.bench.problems import Problem

_HERE = Path(__file__).resolve().parent


def list_examples() -> list[Path]:
    """Paths of the bundled example files, sorted by name."""
    return sorted(p for p in _HERE.glob("*.py") if not p.name.startswith("_"))


def load_example(name: str) -> "Problem":
    """Load example ``name`` (``"mlp_gelu"`` or ``"mlp_gelu.py"``) as a bench ``Problem``.
    Raises ``KeyError`` listing the available names when there is no such example."""
    from stitch_backend.bench.problems import load_problem

    stem = name[:-3] if name.endswith(".py") else name
    by_stem = {p.stem: p for p in list_examples()}
    if stem not in by_stem:
        raise KeyError(f"no example {name!r}; available: {', '.join(sorted(by_stem))}")
    return load_problem(str(by_stem[stem]))
