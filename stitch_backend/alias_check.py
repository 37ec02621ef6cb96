"""AOTAutograd's custom-op aliasing check set aside while a Program verifies itself.

AOTAutograd (torch 2.11 and later) runs a compiled graph's first call under a dispatch
mode that checks custom operators for outputs aliasing their inputs
(``_AnalyzeCustomOpInputOutputMode``, ``functorch.config.check_custom_op_aliasing``).
Every operator of that call goes through it in Python, pytree-flattening its arguments.
Our first call is the verification: the regions' ATen profile, every candidate judged
against eager and an fp64 run, and the comparisons. For ResNet18 that was 137,130
operators through the mode, 9.0 s of a 23 s cProfile of the cold first call (H100
machine, session 33).

The mode checks only operators outside aten/prim/prims. A graph without such an operator
gives it nothing to check, so there it is set aside for the verification and put back
after. A graph with a custom operator keeps it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx

# What AOTAutograd's mode skips as built in (torch._library.utils.is_builtin).
BUILTIN_NAMESPACES = frozenset({"aten", "prim", "prims"})
MODE_NAME = "_AnalyzeCustomOpInputOutputMode"


def has_custom_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls an operator the aliasing check would look at."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace not in BUILTIN_NAMESPACES for n in gm.graph.nodes)


@contextlib.contextmanager
def set_aside(allowed: bool) -> Iterator[None]:
    """AOTAutograd's first-call aliasing mode off for the block when ``allowed`` and it is
    the innermost dispatch mode; otherwise nothing changes."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if allowed and type(_get_current_dispatch_mode()).__name__ == MODE_NAME:
        with _pop_mode_temporarily():
            yield
    else:
        yield
