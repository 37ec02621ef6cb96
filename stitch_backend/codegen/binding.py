"""Runtime values of a kernel's size symbols, read off the actual region inputs.

Used by both the launch plan and the interpreter: ``bind`` checks that the inputs have
the shapes, strides and dtypes the kernel was generated for (evaluated with the bound
symbols) and raises ``ValueError`` saying which input differs otherwise.
"""

from __future__ import annotations

from typing import Sequence

import sympy
import torch

from . import indexing as ix
from .kernel_ir import KernelIR

# torch's sympy helpers that may occur in sizes (FloorDiv(s0, 2), ...)
try:  # pragma: no cover - depends on the torch version
    from torch.utils._sympy import functions as _tfn
except ImportError:  # pragma: no cover
    _tfn = None


def evaluate(expr: sympy.Expr, values: dict) -> int:
    """An integer size expression with every symbol given a value."""
    if isinstance(expr, int):
        return expr
    out = expr.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    out = out.doit() if not out.is_Number else out
    if not out.is_Number:
        raise ValueError(f"cannot evaluate size {expr} with {values}")
    return int(out)


def bind(ir: KernelIR, inputs: Sequence) -> dict:
    """{symbol: int} for every size symbol of ``ir``; validates the inputs."""
    if len(inputs) != ir.n_region_inputs:
        raise ValueError(f"{ir.name}: expected {ir.n_region_inputs} inputs, got {len(inputs)}")
    values: dict = {}
    for b in ir.symbols:
        x = inputs[b.position]
        if b.kind == "int":
            values[b.symbol] = int(x)
        elif b.kind == "size":
            values[b.symbol] = int(x.shape[b.dim])
        else:
            values[b.symbol] = int(x.stride(b.dim))
    for pos, v in ir.int_inputs:
        if int(inputs[pos]) != v:
            raise ValueError(f"{ir.name}: input {pos} must be {v} (specialised), got {inputs[pos]}")
    device = None
    for arg in ir.inputs:
        x = inputs[arg.position]
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{ir.name}: input {arg.position} must be a tensor")
        if device is not None and x.device != device:
            raise ValueError(f"{ir.name}: input {arg.position} is on {x.device}, the others "
                             f"on {device}; a kernel reads one device's memory")
        device = x.device
        if x.dtype != arg.dtype:
            raise ValueError(f"{ir.name}: input {arg.position} has dtype {x.dtype}, kernel "
                             f"was generated for {arg.dtype}")
        shape = [evaluate(s, values) for s in arg.shape]
        if list(x.shape) != shape:
            raise ValueError(f"{ir.name}: input {arg.position} has shape {tuple(x.shape)}, "
                             f"expected {tuple(shape)}")
        for d, (size, st) in enumerate(zip(shape, arg.stride)):
            if size > 1 and x.stride(d) != evaluate(st, values):
                raise ValueError(f"{ir.name}: input {arg.position} has strides {x.stride()}, "
                                 f"kernel was generated for {arg.stride}")
    return values


def output_layout(ir: KernelIR, values: dict) -> list[tuple[list[int], list[int]]]:
    """(shape, stride) of each output."""
    return [([evaluate(s, values) for s in o.shape], [evaluate(s, values) for s in o.stride])
            for o in ir.outputs]


def extents(ir: KernelIR, values: dict) -> tuple[int, int]:
    """(rows, reduce length) of the domain."""
    return evaluate(sympy.expand(ir.domain.rows), values), \
        evaluate(sympy.expand(ir.domain.reduce_len), values)


__all__ = ["bind", "evaluate", "output_layout", "extents", "ix"]
