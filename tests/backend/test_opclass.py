"""The Planner's op classes: what the Coder can lower is fused, whatever torch's tags say."""

from __future__ import annotations

import operator

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
             aten.view_copy.default, aten.expand_copy.default,
             aten.index.Tensor}   # fused with one integer index tensor: its own test
FUSED = {OpClass.POINTWISE, OpClass.REDUCTION, OpClass.NORM, OpClass.FACTORY, OpClass.VIEW,
         OpClass.GATHER}


def _node(target, *args, x=None) -> torch.fx.Node:
    graph = torch.fx.Graph()
    ph = graph.placeholder("x")
    ph.meta["val"] = torch.empty(1, 2, 4, 4) if x is None else x
    node = graph.call_function(target, (ph, *args))
    # a max pooling's values only, as a graph that does not save its indices takes them
    graph.output(graph.call_function(operator.getitem, (node, 0))
                 if "max_pool" in str(target) else node)
    return node


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


def test_a_pooling_the_generated_kernel_cannot_run_stays_alone_on_aten():
    """Symbolic sizes or integer input: a fallback region of its own (fused, its
    lowering would fail and take its neighbours to ATen with it), and the report says
    why. Ceil mode is lowered (codegen.lower_pooling)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stitch_backend.opclass import fallback_reason

    pool = aten.avg_pool2d.default
    assert classify(_node(pool, [2, 2])) is OpClass.REDUCTION
    assert classify(_node(pool, [2, 2], [2, 2], [0, 0], True)) is OpClass.REDUCTION
    ints = _node(pool, [2, 2], x=torch.empty(1, 2, 4, 4, dtype=torch.int64))
    assert classify(ints) is OpClass.OTHER
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        sym = mode.shape_env.create_unbacked_symint()
        x = torch.empty(1, 2, sym, 4)
    node = _node(aten.max_pool2d_with_indices.default, [2, 2], x=x)
    assert classify(node) is OpClass.OTHER
    assert "symbolic" in fallback_reason(node, OpClass.OTHER)


def test_indexing_with_one_integer_tensor_is_a_gather_and_masks_stay_on_aten():
    """``x[idx]`` (a relative position bias table's lookup) is a gather of static shape;
    a boolean mask's result has a data-dependent shape, and two index tensors are left
    to ATen too."""
    from stitch_backend.opclass import fallback_reason

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(6, 4)
    idx = graph.placeholder("i")
    idx.meta["val"] = torch.empty(5, dtype=torch.int64)
    mask = graph.placeholder("m")
    mask.meta["val"] = torch.empty(6, dtype=torch.bool)
    one = graph.call_function(aten.index.Tensor, (x, [None, idx]))
    masked = graph.call_function(aten.index.Tensor, (x, [mask]))
    two = graph.call_function(aten.index.Tensor, (x, [idx, idx]))
    graph.output((one, masked, two))
    assert classify(one) is OpClass.GATHER
    assert classify(masked) is OpClass.OTHER
    assert "data-dependent output shape" in fallback_reason(masked, OpClass.OTHER)
    assert classify(two) is OpClass.OTHER
