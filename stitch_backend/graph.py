"""Canonical graph text and the ``GraphKey`` that names a compiled graph in the cache.

The canonical text depends only on what the graph computes: node names are replaced by
positions and symbolic sizes by the order in which they first appear among the inputs,
so two processes (or two traces with renamed nodes) produce the same text. The key adds
the input metas, the code-changing options, the GPU arch and the versions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from .ir import TensorMeta
from .opclass import op_name
from .version import __version__

class _Symbols:
    """Renames sympy symbols to s0, s1, ... in order of first appearance."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _expr(self, value: Any):
        node = getattr(value, "node", None)
        return getattr(node, "expr", None)

    def visit(self, value: Any) -> None:
        expr = self._expr(value)
        if expr is None:
            return
        for sym in sorted(expr.free_symbols, key=str):
            self.names.setdefault(str(sym), f"s{len(self.names)}")

    def text(self, value: Any) -> int | str:
        """An int for a concrete size, else the canonical expression text."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        expr = self._expr(value)
        if expr is None:
            return repr(value)
        if expr.is_number:
            return int(expr) if expr.is_integer else str(expr)
        self.visit(value)
        import sympy

        mapping = {s: sympy.Symbol(self.names[str(s)]) for s in expr.free_symbols}
        return str(expr.xreplace(mapping))


def value_meta(val: Any, symbols: _Symbols | None = None) -> dict[str, Any]:
    """A JSON-able description of an example value (tensor, SymInt or Python scalar)."""
    symbols = symbols or _Symbols()
    if isinstance(val, torch.Tensor):
        return {"tensor": tensor_meta(val, symbols).__dict__ | {"requires_grad": val.requires_grad}}
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"sym": symbols.text(val)}
    if isinstance(val, (int, float, bool)) or val is None:
        return {"scalar": repr(val)}
    return {"other": type(val).__name__}


def tensor_meta(t: torch.Tensor, symbols: _Symbols | None = None) -> TensorMeta:
    """TensorMeta of a (real or fake) tensor, with symbolic sizes canonicalised."""
    symbols = symbols or _Symbols()
    for s in list(t.shape) + list(t.stride()):
        symbols.visit(s)
    return TensorMeta(
        shape=tuple(symbols.text(s) for s in t.shape),
        stride=tuple(symbols.text(s) for s in t.stride()),
        dtype=str(t.dtype).removeprefix("torch."),
        device=t.device.type,
    )


def canonical_graph(gm: torch.fx.GraphModule) -> str:
    """Text that identifies what ``gm`` computes, independent of node names."""
    symbols = _Symbols()
    index: dict[torch.fx.Node, int] = {}
    lines: list[str] = []

    def arg(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}: {arg(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return str(symbols.text(a))
        if isinstance(a, float):
            return repr(a)
        if isinstance(a, torch.device):
            return f"device({a.type})"
        return repr(a)

    # Inputs first, so symbols are numbered by where they appear among the inputs.
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            symbols_meta = value_meta(node.meta.get("val"), symbols)
            index[node] = len(index)
            lines.append(f"%{index[node]} = input {json.dumps(symbols_meta, sort_keys=True)}")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"return {arg(node.args[0])}")
            continue
        index[node] = len(index)
        if node.op == "get_attr":
            val = getattr(gm, node.target, None)
            desc = value_meta(val, symbols)
            if isinstance(val, torch.Tensor):
                # one-element constants are inlined into generated code: the key must
                # change with the value, not only with its shape and dtype
                desc["digest"] = tensor_digest(val)
            lines.append(f"%{index[node]} = constant {json.dumps(desc, sort_keys=True)}")
            continue
        target = "operator.getitem" if node.target is operator.getitem else op_name(node)
        args = ", ".join(arg(a) for a in node.args)
        kwargs = ", ".join(f"{k}={arg(v)}" for k, v in sorted(node.kwargs.items()))
        lines.append(f"%{index[node]} = {target}({args}{', ' if kwargs else ''}{kwargs})")
    return "\n".join(lines)


def tensor_digest(t: torch.Tensor) -> str:
    """A short hash of a tensor's values (with its dtype and shape)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    if t.numel():
        with unset_fake_temporarily():      # backends are called inside AOT's fake mode
            data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy()
        h.update(data.tobytes())
    return h.hexdigest()[:16]


def input_metas(example_inputs: list[Any]) -> list[dict[str, Any]]:
    """JSON-able metas of a graph's example inputs (symbols canonicalised)."""
    symbols = _Symbols()
    return [value_meta(v, symbols) for v in example_inputs]


def versions() -> dict[str, str]:
    """Versions folded into every key (a change of any of them invalidates the cache)."""
    from .toolchain import ToolchainError, nvcc_version, nvrtc_version

    try:
        nvcc = nvcc_version()
    except (ToolchainError, OSError, subprocess.SubprocessError):
        nvcc = "none"
    try:   # the default compiler of generated kernels (toolchain.resolve_compiler)
        nvrtc = nvrtc_version()
    except (ToolchainError, OSError):
        nvrtc = "none"
    return {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nvcc": nvcc,
        "nvrtc": nvrtc,
        "stitchcuda": __version__,
        "code": code_digest(),
    }


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of the sources that decide generated code (codegen, the Coder, the CUDA
    headers): a cached kernel never outlives the code that wrote it, version bump or not."""
    digest = hashlib.sha256()
    for f in code_files():
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def code_files() -> list[Path]:
    """The files ``code_digest`` covers, found through the import system (an editable
    install maps ``agents/`` and ``csrc/`` from elsewhere)."""
    import importlib.util

    files: list[Path] = []
    for name, pattern in (("stitch_backend.codegen", "*.py"), ("stitch_backend.csrc", "*.cuh")):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files += sorted(Path(folder).glob(pattern))
    for name in ("stitch_backend.agents.coder", "stitch_backend.agents.split_stats"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(Path(spec.origin))
    return [f for f in files if f.is_file()]


@dataclass(frozen=True)
class GraphKey:
    """The cache key of one compiled graph: a sha256 over the fields it records."""

    digest: str
    fields: dict[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def short(self) -> str:
        return self.digest[:12]

    def __str__(self) -> str:
        return self.digest


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
              options: dict[str, Any], arch: str,
              version_info: dict[str, str] | None = None) -> GraphKey:
    """Key of ``gm`` for these inputs, options, arch and versions (all in ``fields``)."""
    from stitch_backend.cache import CacheKey

    key = CacheKey(graph=canonical_graph(gm), input_metas=input_metas(example_inputs),
                   options=json.loads(json.dumps(options, default=str)), arch=arch,
                   versions=version_info if version_info is not None else versions())
    return GraphKey(key.hex, key.fields())
