"""A CPU interpreter of ``KernelIR`` built from torch ops.

It evaluates every expression over the whole iteration space at once (loop variables
become broadcast ``arange`` tensors), reduces over the reduction axes, and scatters each
store through the output's real strides. It shares nothing with the CUDA emitter except
the IR, so comparing it with the eager GraphModule tests the lowering (index maps, type
promotion, op semantics, output placement) without a GPU.

Outputs are pre-filled with a poison value (NaN, or the dtype's max for integers) so an
element the kernel would not write shows up as a mismatch.
"""

from __future__ import annotations

from typing import Sequence

import sympy
import torch
import torch.nn.functional as F

from . import indexing as ix
from .binding import bind, evaluate, output_layout
from .kernel_ir import (
    HALF_TYPES, Cast, Const, Expr, IndexVal, KernelIR, Load, Op, RedRef, SizeVal,
)


def repr_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype holding values of ``dtype`` (fp16/bf16 live in fp32)."""
    return torch.float32 if dtype in HALF_TYPES else dtype


def poison(dtype: torch.dtype):
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log,
    "log1p": torch.log1p, "log2": torch.log2, "log10": torch.log10, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "erf": torch.erf, "erfc": torch.erfc, "erfinv": torch.erfinv, "asin": torch.asin,
    "acos": torch.acos, "atan": torch.atan, "sinh": torch.sinh, "cosh": torch.cosh,
    "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh,
    "reciprocal": torch.reciprocal, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "trunc": torch.trunc, "frac": torch.frac, "sign": torch.sign,
    "relu": torch.relu, "gelu_erf": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "signbit": torch.signbit,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "fmod": torch.fmod, "remainder": torch.remainder, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "atan2": torch.atan2, "copysign": torch.copysign, "hypot": torch.hypot,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
}


def _extreme(dtype, lowest: bool):
    if dtype.is_floating_point:
        return float("-inf") if lowest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if lowest else info.max


_IDENTITY = {
    "sum": lambda dt: 0, "prod": lambda dt: 1, "any": lambda dt: False, "all": lambda dt: True,
    "max": lambda dt: _extreme(dt, True), "min": lambda dt: _extreme(dt, False),
}


class _Run:
    def __init__(self, ir: KernelIR, inputs: Sequence, values: dict):
        self.ir, self.inputs, self.values = ir, inputs, values
        d = ir.domain
        self.vars = list(d.row_vars) + list(d.red_vars)
        self.grid = [evaluate(e, values) for e in list(d.row_extents) + list(d.red_extents)]
        self.n_row = len(d.row_vars)
        self.var_t = {}
        for a, (v, n) in enumerate(zip(self.vars, self.grid)):
            shape = [1] * len(self.grid)
            shape[a] = n
            self.var_t[v] = torch.arange(n, dtype=torch.int64).reshape(shape)
        self.data = dict(ir.data_vars)
        self.extents = dict(ir.data_extents)
        self.data_t: dict = {}
        self.flat = {}
        for arg in ir.inputs:
            x = inputs[arg.position]
            span = 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride())) if x.numel() else 0
            self.flat[arg.name] = torch.as_strided(x, (span,), (1,), x.storage_offset())
        self.red: dict = {}
        self.memo: dict = {}

    # -- index expressions
    def index(self, e: sympy.Expr):
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            if ix.is_loop_var(e):
                return self.var_t[e]
            if ix.is_data_var(e):
                if e not in self.data_t:
                    t = self.expr(self.data[e]).to(torch.int64)
                    extent = self.index(self.extents[e]) if e in self.extents else None
                    if extent is not None and t.numel() and bool(((t < 0) | (t >= extent)).any()):
                        raise IndexError(f"index out of range: a gathered index outside "
                                         f"[0, {extent}) (the kernel traps here)")
                    self.data_t[e] = t
                return self.data_t[e]
            return self.values[e]
        if not any(ix.is_loop_var(s) or ix.is_data_var(s) for s in e.free_symbols):
            return evaluate(e, self.values)
        if e.is_Add:
            out = 0
            for a in e.args:
                out = out + self.index(a)
            return out
        if e.is_Mul:
            out = 1
            for a in e.args:
                out = out * self.index(a)
            return out
        if e.is_Pow and e.exp.is_Integer and e.exp > 0:
            return self.index(e.base) ** int(e.exp)
        if isinstance(e, (sympy.Min, sympy.Max)):
            fn = torch.minimum if isinstance(e, sympy.Min) else torch.maximum
            out = torch.as_tensor(self.index(e.args[0]))
            for a in e.args[1:]:
                out = fn(out, torch.as_tensor(self.index(a)))
            return out
        if isinstance(e, ix.FDiv):
            return torch.div(torch.as_tensor(self.index(e.args[0])), self.index(e.args[1]),
                             rounding_mode="floor")
        if isinstance(e, ix.IMod):
            return torch.remainder(torch.as_tensor(self.index(e.args[0])), self.index(e.args[1]))
        raise NotImplementedError(f"index expression {e}")

    # -- scalar expressions
    def expr(self, e: Expr) -> torch.Tensor:
        hit = self.memo.get(e)
        if hit is not None:
            return hit
        out = self._expr(e)
        self.memo[e] = out
        return out

    def _expr(self, e: Expr) -> torch.Tensor:
        rd = repr_dtype(e.dtype)
        if isinstance(e, Load):
            off = torch.as_tensor(self.index(e.offset))
            if self.ir.domain.red_limit is not None:  # the short last row reads past its end
                off = off.clamp(0, max(self.flat[e.buf].numel() - 1, 0))
            return self.flat[e.buf][off].to(rd)
        if isinstance(e, Const):
            return torch.tensor(e.value, dtype=rd)
        if isinstance(e, SizeVal):
            return torch.tensor(evaluate(e.expr, self.values), dtype=torch.int64).to(rd)
        if isinstance(e, IndexVal):
            return torch.as_tensor(self.index(e.expr)).to(rd)
        if isinstance(e, Cast):
            x = self.expr(e.x)
            if e.dtype in HALF_TYPES:
                return x.to(e.dtype).to(torch.float32)
            return x.to(rd)
        if isinstance(e, RedRef):
            return self.red[(e.rid, e.part)].to(rd)
        if isinstance(e, Op):
            args = [self.expr(a) for a in e.args]
            if e.name in _UNARY:
                out = _UNARY[e.name](args[0])
            elif e.name in _BINARY:
                out = _BINARY[e.name](args[0], args[1])
            elif e.name == "where":
                out = torch.where(args[0], args[1], args[2])
            elif e.name == "leaky_relu":
                out = F.leaky_relu(args[0], e.params[0])
            elif e.name == "elu":
                out = torch.ops.aten.elu(args[0], *e.params)
            else:
                raise NotImplementedError(f"op {e.name}")
            return out.to(rd)
        raise NotImplementedError(f"expression {type(e).__name__}")

    # -- reductions
    def reduce(self, r) -> None:
        body = self.expr(r.body)
        limit = self.ir.domain.red_limit
        if r.level == "inner" and limit is not None:
            lin = 0
            for v in self.ir.domain.red_vars:
                lin = lin * self.var_t[v].shape[self.vars.index(v)] + self.var_t[v]
            body = torch.where(lin < torch.as_tensor(self.index(limit)), body,
                               torch.tensor(_IDENTITY[r.kind](body.dtype), dtype=body.dtype))
        if r.level == "inner":
            full = body.expand(self.grid) if body.dim() else body.expand(self.grid)
            row_shape = self.grid[: self.n_row]
            flat = full.reshape(row_shape + [-1])
            keep = row_shape + [1] * (len(self.grid) - self.n_row)
        else:
            row_grid = self.grid[: self.n_row] + [1] * (len(self.grid) - self.n_row)
            flat = body.expand(row_grid).reshape(1, -1)
            keep = [1] * len(self.grid)
        acc = repr_dtype(r.dtype)
        if r.kind == "sum":
            val = flat.to(acc).sum(-1)
        elif r.kind == "prod":
            val = flat.to(acc).prod(-1)
        elif r.kind == "max":
            val = flat.amax(-1)
        elif r.kind == "min":
            val = flat.amin(-1)
        elif r.kind == "any":
            val = flat.bool().any(-1)
        elif r.kind == "all":
            val = flat.bool().all(-1)
        elif r.kind == "softmax":      # (max, sum of exp(x - max)), as eager computes them
            val = flat.to(acc).amax(-1, keepdim=True)
            self.red[(r.rid, 1)] = (flat.to(acc) - val).exp().sum(-1).reshape(keep)
            val = val.squeeze(-1)
        elif r.kind in ("argmax", "argmin"):
            pos = flat.argmax(-1, keepdim=True) if r.kind == "argmax" else flat.argmin(-1, keepdim=True)
            idx = torch.as_tensor(self.index(r.index)).expand(self.grid).reshape(flat.shape)
            self.red[(r.rid, 1)] = idx.gather(-1, pos).reshape(keep)
            val = flat.gather(-1, pos)
        else:
            raise NotImplementedError(r.kind)
        self.red[(r.rid, 0)] = val.reshape(keep)


def interpret(ir: KernelIR, inputs: Sequence) -> list[torch.Tensor]:
    """Run ``ir`` on CPU tensors ``inputs``; returns the region's outputs."""
    values = bind(ir, inputs)
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    outs = []
    for arg, (shape, stride) in zip(ir.outputs, output_layout(ir, values)):
        t = torch.empty_strided(shape, stride, dtype=arg.dtype, device=device)
        t.fill_(poison(arg.dtype))
        outs.append(t)
    run = _Run(ir, inputs, values)
    for r in sorted(ir.inner_reductions, key=lambda r: r.phase):
        run.reduce(r)
    for r in ir.outer_reductions:
        run.reduce(r)
    for st in ir.stores:
        out = outs[st.out]
        val = run.expr(st.value)
        off = torch.as_tensor(run.index(st.offset))
        mask = torch.ones((), dtype=torch.bool)
        for g in st.guards:
            mask = mask & (torch.as_tensor(run.index(g)) == 0)
        if st.level == "element":
            shape = run.grid
        elif st.level == "row":
            shape = run.grid[: run.n_row] + [1] * (len(run.grid) - run.n_row)
        else:
            shape = [1] * len(run.grid)
        val, off, mask = (t.expand(shape) for t in (val, off, mask))
        span = 1 + sum((s - 1) * st_ for s, st_ in zip(out.shape, out.stride())) if out.numel() else 0
        flat = torch.as_strided(out, (span,), (1,), out.storage_offset())
        flat[off[mask]] = val[mask].to(out.dtype)
    return outs
