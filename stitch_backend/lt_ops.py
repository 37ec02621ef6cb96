"""Library epilogues: a matrix product and the activation after it as one cuBLASLt call.

``addmm(bias, a, b)`` followed by ``relu`` (or tanh-``gelu``: cuBLASLt's GELU is the tanh
form, so exact GELU never maps here) is ``LtMatmul.matmul(a, b, bias=bias,
epilogue="RELU_BIAS")``: the product is written once, already activated, instead of
written, read and written again by an epilogue kernel. The Coder proposes it as an
alternative candidate for gemm regions (``agents.coder``); the Verifier judges and times
it like any other, so it is used only where it is correct and faster.

A gemm region with nothing to fuse (a Linear whose output goes straight to the next
layer) gets the library call alone as its candidate: cuBLASLt with the algorithm the
first call times fastest (``_matmul``), raced against ATen's call the same way.

The functions here are what the candidate's stage module calls (an FX graph with the
product and activation replaced by one call). The runtime is built and loaded on first
use (``stitch_backend.runtime``), never at import.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

aten = torch.ops.aten

_lock = threading.Lock()
_lt: Any = None


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
            epilogue: str) -> torch.Tensor:
    global _lt
    if _lt is None:
        with _lock:
            if _lt is None:
                from .runtime import LtMatmul

                _lt = LtMatmul()
    # torch's own setting for fp32 products (eager's addmm follows it too)
    tf32 = a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    key = _problem(a, b, bias, epilogue, tf32)
    algo = _algos.get(key)
    if algo is None:
        if torch.cuda.is_current_stream_capturing():
            algo = 0   # no timing inside a capture: cuBLASLt's first choice, not remembered
        else:
            algo = _algos[key] = _lt.tune(a, b, bias=bias, epilogue=epilogue, allow_tf32=tf32,
                                          max_algos=TUNE_ALGOS, iters=TUNE_ITERS)
    return _lt.matmul(a, b, bias=bias, epilogue=epilogue, allow_tf32=tf32, algo_index=algo)


# cuBLASLt's heuristics rank algorithms by a model, not by a clock: the first call of each
# problem times the first TUNE_ALGOS of them (median of TUNE_ITERS runs each) and the
# process keeps the fastest for that problem (sizes, strides, dtype, epilogue, TF32, the
# operands' alignment: whatever changes the ranked list).
TUNE_ALGOS = 4
TUNE_ITERS = 10
_algos: dict[tuple, int] = {}


def _alignment(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    ptr = t.data_ptr()
    return min(ptr & -ptr, 256) if ptr else 256


def _problem(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
             tf32: bool) -> tuple:
    return (a.device.index, a.dtype, tuple(a.shape), a.stride(), tuple(b.shape), b.stride(),
            epilogue, bias is not None, tf32, _alignment(a), _alignment(b), _alignment(bias))


def lt_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``act(bias + a @ b)`` for a ``*_BIAS`` epilogue, in one cuBLASLt call."""
    return _matmul(a, b, bias, epilogue)


def lt_mm(a: torch.Tensor, b: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``act(a @ b)``, in one cuBLASLt call."""
    return _matmul(a, b, None, epilogue)


def activation_epilogue(node: torch.fx.Node) -> str | None:
    """The cuBLASLt epilogue name of an activation node ("RELU", "GELU"), or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.relu.default:
        return "RELU"
    if node.target is aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "GELU" if approximate == "tanh" else None
    return None


DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["DTYPES", "activation_epilogue", "lt_addmm", "lt_mm"]
