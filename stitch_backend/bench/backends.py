"""The backends a bench run can compare, and how each wraps a model.

``eager`` is the model itself; the others go through ``torch.compile``. ``stitchcuda`` is
looked up through Dynamo's registry (the ``torch_dynamo_backends`` entry point); when the
package is not installed with its entry point, it is imported from
``stitch_backend.backend`` instead and the record says so (``source``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: name -> (torch.compile backend, torch.compile mode)
BUILTIN: dict[str, tuple[str | None, str | None]] = {
    "eager": (None, None),
    # eager again, timed after the other backends in the same child process: the A/A
    # control, how far a ratio near 1 can be noise (process state, allocator, clocks)
    "eager-again": (None, None),
    # Dynamo alone (its "eager" backend runs the traced graph as is): the per-call cost
    # of any torch.compile backend, the floor under a graph a backend leaves unchanged
    "dynamo": ("eager", None),
    "aot_eager": ("aot_eager", None),
    "inductor": ("inductor", None),
    "inductor-reduce-overhead": ("inductor", "reduce-overhead"),
    "inductor-max-autotune": ("inductor", "max-autotune"),
    "stitchcuda": ("stitchcuda", None),
}
DEFAULT_BACKENDS = ("eager", "inductor", "stitchcuda")
#: backends whose compile is host work only (no GPU timing while compiling): under
#: --share-gpu their first call runs outside the task's GPU turn
HOST_COMPILED = frozenset({"eager", "eager-again", "dynamo", "aot_eager", "inductor", "inductor-reduce-overhead"})


def compiles_on_host(name: str) -> bool:
    """Whether ``name``'s compile leaves the GPU alone (see HOST_COMPILED); unknown and
    autotuning backends are assumed to time things on the GPU."""
    return split_options(name)[0] in HOST_COMPILED


class UnknownBackendError(ValueError):
    """A backend name that is neither built into the bench nor registered with Dynamo."""


@dataclass
class Compiled:
    """A model wrapped for one backend: call ``fn``; ``backend_obj`` is what Dynamo got."""

    name: str
    fn: Callable[..., Any]
    backend_obj: Any
    source: str            # where the backend came from, for the record


def validate_backends(names: list[str]) -> list[str]:
    """The names, de-duplicated, with ``eager`` first (it is the baseline every ratio
    needs). Unknown names raise ``UnknownBackendError`` listing the valid ones."""
    import torch._dynamo

    registered = set(torch._dynamo.list_backends(exclude_tags=()))
    out: list[str] = ["eager"]
    for n in names:
        n = n.strip()
        if not n or n in out or n == "eager-again":
            continue
        base, options = split_options(n)
        if options and BUILTIN.get(base, (base, None))[0] is None:
            raise UnknownBackendError(f"{n!r}: eager takes no options")
        if options and base == "stitchcuda":
            _check_stitchcuda_options(n, options)
        if base not in BUILTIN and base not in registered:
            raise UnknownBackendError(
                f"unknown backend {n!r}; valid: {', '.join(BUILTIN)} or a Dynamo backend "
                f"({', '.join(sorted(registered))})")
        out.append(n)
    if "eager-again" in (n.strip() for n in names):
        out.append("eager-again")      # last, after every compiled backend
    return out


def _check_stitchcuda_options(name: str, options: dict[str, Any]) -> None:
    """An unknown or mistyped stitchcuda option is a usage error before any task runs."""
    from ..config import Config, InvalidOptionError

    try:
        Config().with_options(options)
    except InvalidOptionError as exc:
        raise UnknownBackendError(f"{name!r}: {exc}") from None


def resolve_dynamo_backend(name: str) -> tuple[Any, str]:
    """(backend callable or name for ``torch.compile``, where it came from)."""
    import torch._dynamo

    if name != "stitchcuda":
        return name, "torch._dynamo registry"
    try:
        return torch._dynamo.lookup_backend("stitchcuda"), "entry point torch_dynamo_backends"
    except Exception as exc:   # not registered, or its module failed to import
        lookup_error = f"{type(exc).__name__}: {exc}"
    try:
        module = importlib.import_module("stitch_backend.backend")
    except Exception as exc:
        raise RuntimeError(f"stitchcuda backend unavailable: lookup failed ({lookup_error}); "
                           f"import stitch_backend.backend failed ({type(exc).__name__}: {exc})") from exc
    return module.stitchcuda, f"stitch_backend.backend:stitchcuda (lookup failed: {lookup_error})"


def wrap(name: str, model: torch.nn.Module) -> Compiled:
    """Wrap ``model`` for backend ``name`` (compilation itself happens on the first call)."""
    base, options = split_options(name)
    backend, mode = BUILTIN.get(base, (base, None))
    if backend is None:
        return Compiled(name, model, None, "eager (no compile)" if base == "eager" else
                        "eager (no compile), timed again after the other backends")
    obj, source = resolve_dynamo_backend(backend)
    kwargs: dict[str, Any] = {"backend": obj}
    if mode is not None:
        kwargs["mode"] = mode
    if options:
        kwargs["options"] = options
    return Compiled(name, torch.compile(model, **kwargs), obj, source)


def split_options(name: str) -> tuple[str, dict[str, Any]]:
    """``"stitchcuda:split_stats=1+verify=0"`` -> ("stitchcuda", {"split_stats": "1",
    "verify": "0"}): one backend under two settings, side by side in one run. stitchcuda's
    values stay strings, parsed by its own Config by each option's type (so
    ``cache_dir=1`` is a folder named 1); other backends' values parse as bool
    (1/0/true/false), int, float, else string."""
    base, _, rest = name.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split("+"))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UnknownBackendError(f"{name!r}: options are KEY=VALUE pairs, got {item!r}")
        value = value.strip()
        options[key.strip()] = value if base == "stitchcuda" else _option_value(value)
    return base, options


def _option_value(text: str) -> Any:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def graph_count_marker(compiled: Compiled) -> int:
    """How many process-wide records the backend's module holds now (see ``backend_records``)."""
    fn = _module_records_fn(compiled.backend_obj)
    return len(fn()) if fn is not None else 0


def backend_records(compiled: Compiled, since: int = 0) -> list[Any] | None:
    """The backend's own report as JSON-able values, or None if it keeps none.

    Uses ``backend_obj.records`` when the backend object has it; otherwise the
    process-wide ``compiled_graphs()`` of the backend's module (records made after
    marker ``since``). Each record is ``to_dict()``-ed when it offers that, else ``repr``-ed.
    """
    records = getattr(compiled.backend_obj, "records", None)
    if records is None:
        fn = _module_records_fn(compiled.backend_obj)
        if fn is None:
            return None
        records = fn()[since:]
    out: list[Any] = []
    for rec in records:
        to_dict = getattr(rec, "to_dict", None)
        try:
            out.append(to_dict() if callable(to_dict) else repr(rec))
        except Exception as exc:           # a report must never cost the measurement
            out.append(f"<unreportable record: {type(exc).__name__}: {exc}>")
    return out


def _module_records_fn(obj: Any) -> Callable[[], list[Any]] | None:
    if obj is None or isinstance(obj, str):
        return None
    module = inspect.getmodule(obj)
    fn = getattr(module, "compiled_graphs", None) if module is not None else None
    return fn if callable(fn) else None
