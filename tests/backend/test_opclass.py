"""The Planner's op classes: what the Coder can lower is fused, whatever torch's tags say."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from stitch_backend.codegen.lower_ops import RULES
from stitch_backend.opclass import OpClass, classify

aten = torch.ops.aten

# Lowered ops the Planner still leaves alone: factories and copies it never sees in a
# functional graph (or sees as other ops), and the gathers.
NOT_FUSED = {aten.contiguous.default, aten.fill.Scalar, aten.new_full.default,
             aten.new_zeros.default, aten.new_ones.default, aten.empty_permuted.default,
             aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
             aten.view_copy.default, aten.expand_copy.default, aten.gather.default,
             aten.index_select.default, aten.embedding.default}
FUSED = {OpClass.POINTWISE, OpClass.REDUCTION, OpClass.NORM, OpClass.FACTORY, OpClass.VIEW}


def _node(target) -> torch.fx.Node:
    graph = torch.fx.Graph()
    return graph.call_function(target, (graph.placeholder("x"),))


def _takes_tensors(op: torch._ops.OpOverload) -> bool:
    return any(isinstance(a.type, torch.TensorType) for a in op._schema.arguments)


# Also among the GPU tests: the device's torch (2.11) tags ops differently from CI's.
@pytest.mark.parametrize("where", ["ci", pytest.param("device", marks=pytest.mark.gpu)])
def test_every_lowered_op_on_tensors_is_fused(where):
    """torch 2.11 tagged leaky_relu no pointwise op, so L1 LeakyReLU was a fallback
    ("no template covers") though the Coder lowers it."""
    lowered = [t for t in RULES if isinstance(t, torch._ops.OpOverload) and _takes_tensors(t)]
    assert aten.leaky_relu.default in lowered and aten.hardswish.default in lowered
    wrong = {str(t): classify(_node(t)) for t in lowered
             if t not in NOT_FUSED and classify(_node(t)) not in FUSED}
    assert not wrong, wrong


def test_out_variants_of_the_untagged_elementwise_ops_are_not_pointwise():
    assert classify(_node(aten.leaky_relu.default)) is OpClass.POINTWISE
    assert classify(_node(aten.leaky_relu.out)) is OpClass.OTHER
    assert classify(_node(aten.max.default)) is OpClass.REDUCTION
