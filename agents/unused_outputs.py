"""Graph outputs that hold no value of the computation, left out of the end-to-end check.

A training forward returns what its backward needs, and for fused attention that
includes the random-number bookkeeping of dropout: ``philox_seed`` and ``philox_offset``
(flash attention: ``rng_state`` and ``unused``) of
``_scaled_dot_product_{cudnn,flash,efficient}_attention``. At ``dropout_p == 0`` no
random number is drawn and the backward reads neither; what ATen leaves in them is then
not a result (on the H200, under bf16 autocast, the cuDNN attention's seed differed
between two runs of the same ATen op on the same inputs and random state, and the
end-to-end check failed a transformer block's whole forward on it: "output 12:
integer/bool output differs from eager").

Such outputs are found by the op's schema (the return's name) and its ``dropout_p``
argument, never by their values; with dropout on, they are compared as every output is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .ties import output_nodes

# flash attention names them rng_state and unused
_RNG_RETURNS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused"})


def unused_rng_outputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions among ``gm``'s flattened outputs that are an attention op's dropout
    seed or offset while its ``dropout_p`` is 0."""
    return [i for i, node in enumerate(output_nodes(gm))
            if isinstance(node, torch.fx.Node) and _is_unused_rng(node)]


def _is_unused_rng(node: torch.fx.Node) -> bool:
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    src, index = node.args[0], node.args[1]
    if not (isinstance(src, torch.fx.Node) and src.op == "call_function"
            and isinstance(src.target, torch._ops.OpOverload) and isinstance(index, int)):
        return False
    schema = src.target._schema
    if not 0 <= index < len(schema.returns) or schema.returns[index].name not in _RNG_RETURNS:
        return False
    return _argument(src, schema, "dropout_p", default=None) == 0


def _argument(node: torch.fx.Node, schema: Any, name: str, *, default: Any) -> Any:
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if arg.kwarg_only or i >= len(node.args):
                return node.kwargs.get(name, arg.default_value if arg.has_default_value()
                                       else default)
            return node.args[i]
    return default
