"""Find and load benchmark problems.

A problem is either

- a KernelBench-format file: a ``.py`` defining ``class Model(nn.Module)``,
  ``get_inputs()`` and ``get_init_inputs()``; or
- ``package.module:factory`` where ``factory()`` returns ``(model, inputs)``.

Loading a problem EXECUTES the user's own model file or factory module (that is the
point: the file is the benchmark). The bench only does so in its child worker process,
never in the process that drives the run (``ProblemRef`` carries names and paths only).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

_TASK_NUMBER = re.compile(r"^(\d+)_")


class ProblemError(ValueError):
    """A problem spec that cannot be resolved or loaded; ``spec`` says which."""

    def __init__(self, spec: str, why: str):
        super().__init__(f"{spec}: {why}")
        self.spec = spec
        self.why = why


@dataclass(frozen=True)
class ProblemRef:
    """A problem named and located, not yet loaded (nothing of the user's has run)."""

    name: str
    spec: str            # a file path, or "package.module:factory"


@dataclass
class Problem:
    """A loaded problem.

    ``make_model()`` builds a fresh model instance (seed the RNG first to get the same
    weights every time); ``make_inputs()`` draws a fresh list of inputs (seed first).
    """

    name: str
    path: Path | None
    make_model: Callable[[], Any]
    make_inputs: Callable[[], list[Any]]
    init_inputs: list[Any] = field(default_factory=list)


def is_file_spec(spec: str) -> bool:
    """True when ``spec`` names a ``.py`` file (existing or not) rather than ``module:factory``."""
    return spec.endswith(".py") or Path(spec).is_file()


def ref_for(spec: str) -> ProblemRef:
    """A ``ProblemRef`` for a file path or ``module:factory`` spec, without loading it."""
    if is_file_spec(spec):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise ProblemError(spec, "no such file")
        return ProblemRef(name=path.stem, spec=str(path))
    if ":" not in spec:
        raise ProblemError(spec, "expected a .py file or 'package.module:factory'")
    return ProblemRef(name=spec, spec=spec)


def load_problem(spec: str) -> Problem:
    """Load a problem from a KernelBench-format file path or ``package.module:factory``.

    Executes the file (or imports the module) in this process. Raises ``ProblemError``
    when the file lacks ``Model``/``get_inputs``/``get_init_inputs`` or the factory is
    missing; errors raised by the user's own code propagate unchanged.
    """
    if is_file_spec(spec):
        return _load_file(Path(spec).expanduser().resolve(), spec)
    return _load_factory(spec)


def _load_file(path: Path, spec: str) -> Problem:
    if not path.is_file():
        raise ProblemError(spec, "no such file")
    # A unique module name per file: two tasks named model.py in different folders must
    # not share a module, and registering it lets inspect/Dynamo find the source.
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    mod_name = f"stitch_bench_problem_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ProblemError(spec, "cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(module, n)]
    if missing:
        raise ProblemError(spec, f"not in KernelBench format: missing {', '.join(missing)}")
    init_inputs = list(module.get_init_inputs())
    model_cls = module.Model

    return Problem(
        name=path.stem,
        path=path,
        make_model=lambda: model_cls(*init_inputs),
        make_inputs=lambda: list(module.get_inputs()),
        init_inputs=init_inputs,
    )


def _load_factory(spec: str) -> Problem:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ProblemError(spec, "expected 'package.module:factory'")
    module = importlib.import_module(mod_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ProblemError(spec, f"module {mod_name} has no callable {attr!r}")

    def call() -> tuple[Any, list[Any]]:
        result = factory()
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ProblemError(spec, "factory must return (model, inputs)")
        return result[0], list(result[1])

    path = getattr(module, "__file__", None)
    # The factory builds model and inputs together, so each is made by its own call
    # (under the bench's seed): weights and inputs then match KernelBench's seeding.
    return Problem(
        name=spec,
        path=Path(path) if path else None,
        make_model=lambda: call()[0],
        make_inputs=lambda: call()[1],
        init_inputs=[],
    )


def parse_task_numbers(text: str) -> set[int]:
    """Parse ``"1-20,25"`` into ``{1, ..., 20, 25}``; raises ``ValueError`` on bad syntax."""
    numbers: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)|(\d+)", part)
        if not m:
            raise ValueError(f"bad problem selection {part!r} (expected e.g. 1-20,25)")
        if m.group(3):
            numbers.add(int(m.group(3)))
        else:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"bad problem range {part!r}: {lo} > {hi}")
            numbers.update(range(lo, hi + 1))
    if not numbers:
        raise ValueError(f"empty problem selection {text!r}")
    return numbers


def kernelbench_level_dir(root: str | Path, level: int) -> Path:
    """``root/KernelBench/levelN`` (a KernelBench checkout), or ``root/levelN`` when ``root``
    is the inner ``KernelBench`` folder itself. Raises ``ProblemError`` naming both tries."""
    root = Path(root).expanduser().resolve()
    tries = [root / "KernelBench" / f"level{level}", root / f"level{level}"]
    for d in tries:
        if d.is_dir():
            return d
    raise ProblemError(str(root), "no KernelBench level folder: tried "
                       + ", ".join(str(t) for t in tries))


def select_kernelbench(root: str | Path, level: int, problems: str | None = None) -> list[ProblemRef]:
    """The level's task files sorted by their leading task number, filtered by ``problems``
    (``"1-20,25"``; None for all). Names look like ``level3/8_ResNetBasicBlock``."""
    level_dir = kernelbench_level_dir(root, level)
    wanted = parse_task_numbers(problems) if problems else None
    found: list[tuple[int, Path]] = []
    for path in level_dir.glob("*.py"):
        m = _TASK_NUMBER.match(path.name)
        if m is None:
            continue                       # __init__.py and helpers are not tasks
        number = int(m.group(1))
        if wanted is None or number in wanted:
            found.append((number, path))
    found.sort()
    return [ProblemRef(name=f"level{level}/{p.stem}", spec=str(p)) for _, p in found]
