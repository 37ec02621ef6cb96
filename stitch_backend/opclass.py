"""What kind of work each ATen op is, as the Planner sees it.

The classes follow the region kinds of DESIGN.md. Pointwise and random ops are read
off the op's own tags (``torch.Tag.pointwise``, ``torch.Tag.nondeterministic_seeded``)
so new ATen ops are classified without a table change; the rest are named here.
"""

from __future__ import annotations

import enum
import operator

import torch

aten = torch.ops.aten


class OpClass(enum.Enum):
    """The Planner's view of one FX node."""

    GEMM = "gemm"            # matrix products
    CONV = "conv"            # convolutions
    ATTENTION = "attention"  # fused scaled-dot-product attention ops
    POINTWISE = "pointwise"  # elementwise, tagged pointwise by ATen
    REDUCTION = "reduction"  # sum/mean/amax/var/...
    NORM = "norm"            # softmax and the normalisations (row reductions + pointwise)
    FACTORY = "factory"      # constants with no tensor input (full, scalar_tensor, ...)
    GATHER = "gather"        # each output element reads one input element at a loaded index
    VIEW = "view"            # free: no data moves (views, getitem of a multi-output op)
    RANDOM = "random"        # draws from the generator: stays on ATen, in eager's order
    SYMBOLIC = "symbolic"    # host-side size arithmetic on SymInts
    OTHER = "other"          # anything else: ATen fallback


def _ops(*packets_or_overloads) -> frozenset:
    found = set()
    for item in packets_or_overloads:
        if isinstance(item, torch._ops.OpOverloadPacket):
            for name in item.overloads():
                found.add(getattr(item, name))
        else:
            found.add(item)
    return frozenset(found)


def _maybe(*names: str) -> list:
    """ATen packets that may not exist in every supported torch version."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def _mutates(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


GEMM_OPS = _ops(aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul,
                aten._addmm_activation)
CONV_OPS = _ops(aten.convolution, aten.convolution_backward, aten._convolution,
                aten.conv2d, aten.conv1d, aten.conv3d, aten.conv_transpose1d,
                aten.conv_transpose2d, aten.conv_transpose3d)
ATTENTION_OPS = _ops(
    aten.scaled_dot_product_attention,
    *_maybe("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_flash_attention_forward", "_efficient_attention_forward"),
)
REDUCTION_OPS = _ops(aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var,
                     aten.var_mean, aten.std, aten.std_mean, aten.argmax, aten.argmin,
                     aten.any, aten.all, aten.max.dim, aten.min.dim, aten.max.default,
                     aten.min.default, aten.logsumexp,
                     aten.norm, aten.linalg_vector_norm)
NORM_OPS = _ops(aten._softmax, aten._log_softmax, aten.native_layer_norm,
                aten.native_group_norm, aten._native_batch_norm_legit,
                aten._native_batch_norm_legit_no_training,
                aten._native_batch_norm_legit_functional, aten.native_batch_norm,
                aten._softmax_backward_data, aten._log_softmax_backward_data,
                aten.native_layer_norm_backward, aten.native_group_norm_backward,
                aten.native_batch_norm_backward, aten.nll_loss_forward,
                aten.nll_loss_backward, *_maybe("_fused_rms_norm"))
FACTORY_OPS = _ops(aten.full, aten.scalar_tensor, aten.zeros, aten.ones, aten.full_like,
                   aten.zeros_like, aten.ones_like, aten.arange,
                   *_maybe("iota"), torch.ops.prims.iota)
VIEW_OPS = _ops(aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.expand,
                aten.t, aten.transpose, aten.unsqueeze, aten.squeeze, aten.slice,
                aten.select, aten.alias, aten.as_strided, aten.split, aten.split_with_sizes,
                aten.unbind, aten.chunk, aten.narrow, aten.view_as, aten.expand_as,
                aten.detach, aten.lift_fresh_copy, aten.unfold.default)
# Pooling: a reduction over each window (``codegen.lower_pooling``), where max pooling's
# indices are not read (then it stays on ATen, which computes them).
MAX_POOL_OPS = _ops(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
POOL_OPS = MAX_POOL_OPS | _ops(aten.avg_pool2d.default, aten.avg_pool3d.default)
# Copy-like ops that are pointwise in effect though not tagged so (cat: each element
# copied from one input, codegen.lower_views), and elementwise ops
# the Coder lowers that some torch versions leave untagged (torch 2.11 on the H200 made
# L1's leaky_relu a fallback "no template covers"; hardswish, rsub, fmod, remainder,
# floor_divide, copysign and fix carry no pointwise tag in 2.13); their out= overloads
# (which write an argument) stay out.
POINTWISE_EXTRA = _ops(aten.clone, aten._to_copy, aten.where, aten.copy,
                       torch.ops.prims.convert_element_type, aten.cat.default,
                       aten.constant_pad_nd.default, aten.flip.default) | frozenset(
    op for op in _ops(aten.leaky_relu, aten.hardswish, aten.rsub, aten.fmod, aten.remainder,
                      aten.floor_divide, aten.copysign, aten.fix) if not _mutates(op))


# Copies whose element positions depend on the layout's dim order (a concatenation's or
# a pad's dims): pointwise for the Planner, but never moved to another layout's form.
SHAPED_COPY_OPS = _ops(aten.cat.default, aten.constant_pad_nd.default, aten.flip.default)
# Reads at data-dependent indices (cross entropy's gather of the target's log
# probability, embeddings): fused into regions (codegen.lower_views, every index checked
# against its extent in the kernel, as ATen's checks it), never into a gemm/conv
# epilogue, and never moved between layouts as a pointwise op would be.
GATHER_OPS = _ops(aten.gather.default, aten.index_select.default, aten.embedding.default)
# (and aten.index.Tensor with one integer index tensor: ``classify``)


def classify(node: torch.fx.Node) -> OpClass:
    """The OpClass of one call_function node (placeholders and outputs are not asked)."""
    target = node.target
    if target is operator.getitem:
        return OpClass.VIEW
    if not isinstance(target, torch._ops.OpOverload):
        # Python operators on SymInts (operator.mul, sym_size, ...) are host-side.
        return OpClass.SYMBOLIC if _is_symbolic(node) else OpClass.OTHER
    if _is_symbolic(node):
        return OpClass.SYMBOLIC
    tags = set(target.tags)
    # Fused attention ops carry the seeded tag for their dropout; they stay attention
    # regions (run by ATen's SDPA, in graph order, unless a verified kernel without
    # dropout replaces them).
    if target in ATTENTION_OPS:
        return OpClass.ATTENTION
    if target in POOL_OPS:
        return OpClass.OTHER if pool_unsupported(node) else OpClass.REDUCTION
    if torch.Tag.nondeterministic_seeded in tags:
        return OpClass.RANDOM
    if target is aten.index.Tensor:   # a gather with one integer index, else data-dependent
        return OpClass.GATHER if _one_integer_index(node) else OpClass.OTHER
    for ops, cls in ((GEMM_OPS, OpClass.GEMM), (CONV_OPS, OpClass.CONV),
                     (ATTENTION_OPS, OpClass.ATTENTION), (VIEW_OPS, OpClass.VIEW),
                     (NORM_OPS, OpClass.NORM), (REDUCTION_OPS, OpClass.REDUCTION),
                     (FACTORY_OPS, OpClass.FACTORY), (POINTWISE_EXTRA, OpClass.POINTWISE),
                     (GATHER_OPS, OpClass.GATHER)):
        if target in ops:
            return cls
    if torch.Tag.pointwise in tags and not _mutates(target):
        return OpClass.POINTWISE
    return OpClass.OTHER


def _one_integer_index(node: torch.fx.Node) -> bool:
    """Whether ``aten.index.Tensor`` ``node`` indexes with one integer tensor (the rest
    None): a gather of static shape (boolean masks give data-dependent shapes)."""
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices") or ()
    given = [i for i in indices if i is not None]
    if len(given) != 1 or not isinstance(given[0], torch.fx.Node):
        return False
    val = given[0].meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.int64, torch.int32)


def pool_unsupported(node: torch.fx.Node) -> str | None:
    """Why the generated pooling (codegen.lower_pooling) cannot run pooling ``node``
    (None: it can), so the Planner leaves it to ATen in a region of its own instead of
    fusing it with neighbours it would then drag to ATen too."""
    name = op_name(node)
    if node.target in MAX_POOL_OPS and reads_indices(node):
        return (f"{name}'s indices are read (by a backward, say): the generated pooling "
                "computes only the values")
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return f"{name} of a non-floating-point input"
    if any(isinstance(s, torch.SymInt) for s in x.shape):
        return f"{name} over symbolic sizes"
    return None


def reads_indices(node: torch.fx.Node) -> bool:
    """Whether anything reads output 1 (the indices) of multi-output ``node`` (a max
    pooling) on its way to the graph's outputs, or takes the whole tuple."""
    return any(u.target is not operator.getitem or (u.args[1] != 0 and _live(u))
               for u in node.users)


def _live(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches the graph's output (a traced graph keeps the
    getitem of an output nobody uses, and views of it)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "output":
            return True
        if n not in seen:
            seen.add(n)
            todo += n.users
    return False


def fallback_reason(node: torch.fx.Node, cls: OpClass) -> str:
    """Why a node of this class stays on ATen, in words for the report."""
    name = op_name(node)
    if cls is OpClass.RANDOM:
        return f"{name} draws random numbers: kept on ATen so the generator is used in eager's order"
    if cls is OpClass.SYMBOLIC:
        return "host-side size arithmetic on symbolic shapes"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        tags = set(target.tags)
        if _mutates(target):
            return f"{name} mutates its input: in-place ops stay on ATen"
        if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
            return f"{name} has a data-dependent output shape"
        if target in POOL_OPS and (why := pool_unsupported(node)):
            return why
    return f"no stitchcuda template covers {name}"


def op_name(node: torch.fx.Node) -> str:
    """A stable, readable name for a node's op: 'aten.mm.default', 'operator.getitem'."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # e.g. aten.mm.default
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", repr(target))
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{name}" if module else name




def _is_symbolic(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and \
        not isinstance(val, torch.Tensor)
