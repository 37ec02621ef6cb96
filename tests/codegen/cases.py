"""The table of small fused regions the codegen tests run: every op family of the fused
templates, fp32 plus some fp16/bf16, contiguous / broadcast / permuted / sliced inputs,
reductions over first / middle / last / all dims, keepdim or not, and dynamic shapes.

A ``Case`` traces ``fn`` with make_fx under the core ATen decompositions (as the backend
sees regions) and makes inputs on any device from a seeded CPU generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

f16, bf16, f32, f64, i64, i32, b8 = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                     torch.int64, torch.int32, torch.bool)


@dataclass(frozen=True)
class T:
    """How to make one tensor input: shape, dtype, value kind, then an optional view."""

    shape: tuple
    dtype: torch.dtype = f32
    kind: str = "normal"  # normal | pos | int:<lo>:<hi> | bool
    perm: tuple | None = None  # permute after making (a non-contiguous input)
    slice_last: int | None = None  # x[..., :n] (a strided input)

    def make(self, g: torch.Generator, device) -> torch.Tensor:
        shape = list(self.shape)
        if self.slice_last is not None:
            shape[-1] = shape[-1] + 3
        if self.kind.startswith("int"):
            _, lo, hi = self.kind.split(":")
            x = torch.randint(int(lo), int(hi), shape, generator=g).to(self.dtype)
        elif self.kind == "bool":
            x = torch.rand(shape, generator=g) > 0.5
        else:
            x = torch.randn(shape, generator=g, dtype=torch.float32)
            if self.kind == "pos":
                x = x.abs() + 0.5
            x = x.to(self.dtype)
        x = x.to(device)
        if self.slice_last is not None:
            x = x[..., : self.slice_last]
        if self.perm is not None:
            x = x.permute(*self.perm)
        return x


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    inputs: tuple
    symbolic: bool = False
    alt_inputs: tuple | None = None  # other shapes for a dynamic case (same kernel)
    atol: float = 1e-5
    # outputs to compare (None: all); eager CUDA leaves e.g. eval batch norm's saved
    # statistics uninitialised, so they carry no value to compare
    compare: tuple | None = None

    @property
    def half(self) -> bool:
        return any(isinstance(t, T) and t.dtype in (f16, bf16) for t in self.inputs) or self.atol > 1e-4

    def make_inputs(self, seed: int, device="cpu", alt: bool = False) -> list:
        g = torch.Generator().manual_seed(seed)
        specs = self.alt_inputs if alt and self.alt_inputs is not None else self.inputs
        return [t.make(g, device) if isinstance(t, T) else t for t in specs]

    def trace(self, device="cpu") -> torch.fx.GraphModule:
        example = self.make_inputs(0, device)
        mode = "symbolic" if self.symbolic else "fake"
        return make_fx(self.fn, decomposition_table=core_aten_decompositions(),
                       tracing_mode=mode)(*example)


def _c(name, fn, *inputs, **kw) -> Case:
    return Case(name, fn, tuple(inputs), **kw)


X = T((6, 40))
XH = T((6, 40), f16)
XB = T((6, 40), bf16)
X3 = T((3, 5, 12))
X4 = T((2, 6, 5, 7))
POS = T((6, 40), kind="pos")

POINTWISE = [
    _c("pw_add_bias_relu", lambda a, b: (a + b).relu(), X, T((40,))),
    _c("pw_sub_mul_div", lambda a, b: (a - 2.5 * b) / (b.abs() + 1.0), X, X),
    _c("pw_add_alpha", lambda a, b: torch.add(a, b, alpha=0.5) - torch.sub(a, b, alpha=2), X, X),
    _c("pw_neg_abs", lambda a: -a.abs() + a.neg(), X),
    _c("pw_sqrt_rsqrt", lambda a: a.sqrt() + a.rsqrt(), POS),
    _c("pw_exp_family", lambda a: a.exp() + a.exp2() + torch.expm1(a), X),
    _c("pw_log_family", lambda a: a.log() + a.log1p() + a.log2() + a.log10(), POS),
    _c("pw_trig", lambda a: a.sin() * a.cos() + a.tanh() + torch.atan(a), X),
    _c("pw_sigmoid_erf", lambda a: a.sigmoid() + torch.erf(a) + torch.erfc(a), X),
    _c("pw_relu_leaky_elu", lambda a: F.relu(a) + F.leaky_relu(a, 0.2) + F.elu(a, 0.7), X),
    _c("pw_gelu_erf", lambda a: F.gelu(a), X),
    _c("pw_gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), X),
    _c("pw_silu_mish", lambda a: F.silu(a) + F.mish(a), X),
    _c("pw_hardswish_hardsigmoid", lambda a: F.hardswish(a) * F.hardsigmoid(a) + F.relu6(a), T((6, 40), kind="normal")),
    _c("pw_hardtanh_softplus", lambda a: F.hardtanh(a, -0.5, 0.7) + F.softplus(a, beta=2.0, threshold=3.0), X),
    _c("pw_clamp_scalar", lambda a: a.clamp(-0.3, 0.4) + a.clamp_min(0.1) + a.clamp_max(-0.1), X),
    _c("pw_clamp_tensor", lambda a, lo, hi: torch.clamp(a, lo, hi) + torch.clamp(a, min=lo), X, T((40,)), X),
    _c("pw_where_cmp", lambda a, b: torch.where(a > b, a, b * 2) + (a == b).float() + (a != 0).float()
       + (a <= b).float() + (a >= 0.5).float() + (a < b).float(), X, X),
    _c("pw_logical_bitwise", lambda a, b: ((a > 0) & (b > 0)) | ((a < 0) ^ (b > 0.5)) | ~(a > 1)
       | torch.logical_and(a > 0, b < 0) | torch.logical_or(a > 2, b > 2) | torch.logical_not(a > -1), X, X),
    _c("pw_maximum_minimum", lambda a, b: torch.maximum(a, b) - torch.minimum(a, b * 0.5), X, X),
    _c("pw_sign_rounding", lambda a: torch.sign(a) + (a * 3).floor() + (a * 3).ceil() + (a * 3).round()
       + (a * 3).trunc(), X),
    _c("pw_reciprocal", lambda a: a.reciprocal(), POS),
    _c("pw_fmod_remainder", lambda a, b: torch.fmod(a * 5, b) + torch.remainder(a * 5, b)
       + torch.remainder(a, -1.5), X, POS),
    _c("pw_div_modes", lambda a, b: torch.div(a * 7, b, rounding_mode="floor")
       + torch.div(a * 7, b, rounding_mode="trunc"), X, T((6, 40), kind="pos")),
    _c("pw_pow_scalar", lambda a: a.pow(2) + a.abs().pow(0.5) + a.pow(3) + a.abs().pow(1.7)
       + (a.abs() + 1).pow(-1), X),
    _c("pw_pow_tensor", lambda a, b: torch.pow(a.abs() + 0.1, b) + torch.pow(2.0, b), X, X),
    _c("pw_casts", lambda a: a.half().float() + a.to(torch.bfloat16).float() + (a > 0).float()
       + (a * 10).to(torch.int32).float(), X),
    _c("pw_int_math", lambda a, b: (a * 3 + b - (a // 2) + a % 3).float() * 0.5, T((6, 40), i64, "int:-20:20"),
       T((6, 40), i64, "int:1:9")),
    _c("pw_int_to_float", lambda a: a.float() / 3 + a.sum(0, keepdim=True).float() * 0, T((6, 40), i32, "int:-5:5")),
    _c("pw_bool_input", lambda m, a: torch.where(m, a, -a) + m.float(), T((6, 40), b8, "bool"), X),
    _c("pw_constants", lambda a: a + torch.full_like(a, 2.0) * torch.ones_like(a) + torch.zeros_like(a)
       + torch.scalar_tensor(3.0), X),
    _c("pw_nan_to_num_isnan", lambda a: torch.nan_to_num(a.log()) + torch.isnan(a.log()).float()
       + torch.isinf(a / 0).float(), X),
    _c("pw_broadcast_outer", lambda a, b: a * b, T((6, 1)), T((1, 40))),
    _c("pw_expand", lambda a: a.expand(6, 40) * 2, T((1, 40))),
    _c("pw_permuted_input", lambda a, b: a + b, T((40, 6), perm=(1, 0)), X),
    _c("pw_sliced_input", lambda a: a * 3 + 1, T((6, 40), slice_last=40)),
    _c("pw_views", lambda a: (a.view(2, 3, 40).permute(2, 0, 1).reshape(40, 6).t() * 2).unsqueeze(0)
       .squeeze(0), X),
    _c("pw_slice_select", lambda a: a[:, 2:30:3] * 2 + a[1, 2:12].unsqueeze(0)[:, ::1][:, :1], X),
    # BatchNorms' num_batches_tracked + 1, merged into one region by the Planner
    _c("pw_scalar_counters", lambda *c: tuple(x + 1 for x in c), *([T((), i64, "int:0:100")] * 6)),
    _c("pw_scalar_mixed_dtypes", lambda a, b, c: (a + 1, b * 2.0, c + 1),
       T((), i64, "int:0:100"), T(()), T((), i32, "int:0:100")),
    _c("pw_multi_output", lambda a, b: (a + b, (a * b).sum(0, keepdim=True) * 0 + b[0], a.relu()), X, X),
    _c("pw_output_broadcast_smaller", lambda a, b: (a + b, b * 2), X, T((40,))),
    _c("pw_transpose_output", lambda a: (a * 2).t().contiguous(), X),
    # Layout conversions (channels-last pass): the tiled template, sizes not multiples of 32
    _c("pw_tiled_to_channels_last", lambda a: a.contiguous(memory_format=torch.channels_last),
       T((2, 40, 6, 7))),
    _c("pw_tiled_from_channels_last", lambda a, b: ((a + b.view(1, 40, 1, 1)).relu().contiguous(),
                                                    (a * 2).contiguous()),
       T((2, 6, 7, 40), perm=(0, 3, 1, 2)), T((40,))),
    # a concatenation of channels-last inputs into the NCHW output (DenseNet's last cat
    # after channels-last convolutions): read along channels, written along the rows
    _c("pw_tiled_cat_from_channels_last", lambda a, b: torch.cat([a, b], 1).contiguous(),
       T((2, 6, 40, 32), perm=(0, 3, 1, 2)), T((2, 6, 40, 48), perm=(0, 3, 1, 2))),
    # ... and with an NCHW input among them (DenseNet's block input): tiled by the majority
    _c("pw_tiled_cat_mixed_layouts", lambda x, a, b: torch.cat([x, a, b], 1).contiguous(),
       T((2, 32, 6, 40)), T((2, 6, 40, 32), perm=(0, 3, 1, 2)), T((2, 6, 40, 32), perm=(0, 3, 1, 2))),
    _c("pw_tiled_from_channels_last_f16", lambda a: (a * 3).contiguous(),
       T((2, 6, 7, 40), f16, perm=(0, 3, 1, 2)), atol=1e-2),
    _c("pw_4d_channels", lambda a, w: a * w.view(1, 6, 1, 1) + 1, X4, T((6,))),
    _c("pw_f16_chain", lambda a, b: (a * b + 1).relu() * 0.5, XH, XH, atol=1e-2),
    _c("pw_bf16_gelu", lambda a: F.gelu(a) + a.sigmoid(), XB, atol=1e-2),
    _c("pw_mixed_f16_f32", lambda a, b: a + b, XH, X, atol=1e-2),
    _c("pw_f16_vector8", lambda a: a * 2 + 1, T((16, 64), f16), atol=1e-2),
    _c("pw_f64", lambda a: (a.double() * 1.5).exp(), X),
    _c("pw_copy_clone", lambda a: a.clone() + torch.ops.aten.copy(torch.empty_like(a), a), X),
]

REDUCTIONS = [
    _c("red_sum_last", lambda a: a.sum(-1), X),
    _c("red_sum_first", lambda a: a.sum(0), X),
    _c("red_sum_middle", lambda a: a.sum(1), X3),
    _c("red_sum_all", lambda a: a.sum(), X3),
    _c("red_sum_keepdim", lambda a: a.sum((0, 2), keepdim=True), X3),
    _c("red_sum_two_last", lambda a: a.sum((1, 2)), X3),
    _c("red_mean", lambda a: a.mean(-1) + a.mean(-1, keepdim=True).squeeze(-1), X),
    _c("red_mean_first_keepdim", lambda a: a.mean(0, keepdim=True), X3),
    _c("red_amax_amin", lambda a: (a.amax(-1), a.amin(-1)), X),
    _c("red_amax_first", lambda a: a.amax(0), X3),
    _c("red_prod", lambda a: a.prod(-1), T((6, 10), kind="pos")),
    _c("red_var_std", lambda a: (a.var(-1), a.std(-1, correction=0), torch.var(a, -1, keepdim=True)), X),
    _c("red_var_mean", lambda a: torch.var_mean(a, dim=1, correction=1), X),
    _c("red_var_first", lambda a: a.var(0), X3),
    _c("red_argmax_argmin", lambda a: (a.argmax(-1), a.argmin(-1, keepdim=True)), X),
    _c("red_argmax_first", lambda a: a.argmax(0), X3),
    _c("red_argmax_flat", lambda a: a.argmax(), X3),
    _c("red_max_dim", lambda a: torch.max(a, 1), X),
    _c("red_min_dim_keepdim", lambda a: torch.min(a, 1, keepdim=True), X),
    _c("red_any_all", lambda a: (a > 1).any(-1) | (a > -2).all(-1), X),
    _c("red_sum_bool_int", lambda a, b: ((a > 0).sum(-1), b.sum(-1)), X, T((6, 40), i64, "int:-3:3")),
    _c("red_sum_permuted", lambda a: a.sum(-1), T((40, 6), perm=(1, 0))),
    _c("red_prologue_epilogue", lambda a, b: ((a * b).relu().sum(-1) + 1).sqrt(), X, T((40,))),
    _c("red_sum_dtype", lambda a: a.sum(-1, dtype=torch.float64), X),
    _c("red_f16_sum", lambda a: a.sum(-1), XH, atol=1e-2),
    _c("red_logsumexp", lambda a: torch.logsumexp(a, -1), X),
    # linalg_vector_norm (F.normalize, torch.norm): every order ATen special-cases, and p=3
    _c("red_vector_norm_l2", lambda a: F.normalize(a, dim=-1), X),
    _c("red_vector_norm_orders", lambda a: (torch.linalg.vector_norm(a, 1, -1),
                                            torch.linalg.vector_norm(a, float("-inf"), 1),
                                            torch.linalg.vector_norm(a.relu(), 0, -1),
                                            torch.linalg.vector_norm(a, 3, -1)), X),
    _c("red_vector_norm_inf_first", lambda a: torch.linalg.vector_norm(a, float("inf"), 0, keepdim=True), X3),
    _c("red_vector_norm_all_f16", lambda a: torch.linalg.vector_norm(a), XH, atol=1e-2),
    _c("red_logsumexp_middle", lambda a: torch.logsumexp(a, 1, keepdim=True), X3),
    _c("red_mean_4d_spatial", lambda a: a.mean((2, 3)), X4),
    # several reduced indices: vector chunks along the innermost when its extent allows
    _c("red_sum_outer_inner_vec", lambda a: a.sum((0, 2)), T((3, 5, 16))),
    _c("red_var_outer_inner_odd", lambda a: a.var((0, 2)), T((3, 5, 7))),
    # a view of a permuted (channels-last) input: loaded through its own strides
    _c("red_channels_last_columns", lambda a: a.permute(0, 2, 3, 1).reshape(-1, 6).sum(0),
       T((2, 5, 7, 6), perm=(0, 3, 1, 2))),
    # disjoint-window pooling of a channels-last input (the pooling rewrite's view): rows
    # (n, c, ho, wo) are contiguous along c, which the template then takes fastest
    _c("red_pool_channels_last", lambda a: a.view(2, 5, 3, 2, 4, 2).amax((3, 5)).tanh(),
       T((2, 6, 8, 5), perm=(0, 3, 1, 2))),
    _c("red_pool_channels_last_mean", lambda a: a.view(2, 5, 3, 2, 4, 2).mean((3, 5)) * 2,
       T((2, 6, 8, 5), f16, perm=(0, 3, 1, 2))),
    # overlapping windows (codegen.lower_pooling): padding, dilation, strides, 1-D as 2-D
    _c("pool_max1d_dilated", lambda a: F.max_pool1d(a, 8, 1, 4, 3), T((2, 3, 50))),
    _c("pool_max2d_pad", lambda a: F.max_pool2d(a, 4, 1, 1), T((2, 3, 17, 19))),
    _c("pool_max2d_stem", lambda a: F.max_pool2d(torch.relu(a), 3, 2, 1), T((2, 4, 16, 15))),
    # the same on a channels-last input (ResNet's stem, run NHWC): rows channel-fastest
    _c("pool_max2d_stem_channels_last", lambda a: F.max_pool2d(torch.relu(a), 3, 2, 1),
       T((2, 16, 15, 6), perm=(0, 3, 1, 2))),
    _c("pool_max2d_f16_rect", lambda a: F.max_pool2d(a, (2, 3), (1, 2), (1, 0), (2, 1)),
       T((2, 3, 9, 11), f16), atol=1e-3),
    _c("pool_max3d", lambda a: F.max_pool3d(a, 3, 2, 1, 3), T((2, 2, 9, 10, 11))),
    _c("pool_max2d_channels_last", lambda a: F.max_pool2d(a, 3, 2, 1),
       T((2, 7, 9, 8), perm=(0, 3, 1, 2))),
    _c("pool_avg1d", lambda a: F.avg_pool1d(a, 8, 1, 4), T((2, 3, 50))),
    _c("pool_avg2d_exclude_pad", lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=False),
       T((2, 3, 15, 16))),
    _c("pool_avg2d_divisor", lambda a: F.avg_pool2d(a, 3, 1, 1, divisor_override=5),
       T((2, 3, 8, 8))),
    _c("pool_avg3d", lambda a: F.avg_pool3d(a, 3, 2, 1), T((2, 2, 9, 10, 11))),
    _c("pool_avg2d_unbatched", lambda a: F.avg_pool2d(a, 2, 1), T((3, 6, 7))),
    # a ViT's patches: sliding windows as a last dim, then a copy
    _c("view_unfold_patches", lambda a: a.unfold(2, 4, 4).unfold(3, 4, 4).reshape(2, 3, -1, 16) * 2,
       T((2, 3, 8, 12))),
    _c("view_unfold_overlapping", lambda a: a.unfold(-1, 5, 2).exp(), T((3, 4, 17))),
    # F.pad: constant_pad_nd, padding and cropping (negative pads), then a pointwise op
    _c("pad_constant", lambda a: F.pad(a, (1, 2, 3, 0), value=-1.5) + 1, T((2, 3, 5, 6))),
    _c("pad_crop", lambda a: F.pad(a, (-1, 2, 0, -2)).tanh(), T((2, 3, 5, 6))),
    _c("pad_then_sum", lambda a: F.pad(a, (0, 3)).sum(-1), T((4, 7))),
    _c("flip_two_dims", lambda a: a.flip(0, -1) * 3, X4),
    # x[idx] with one integer index tensor (a relative position bias table's lookup),
    # negative indices counting from the end
    _c("gather_index_tensor", lambda a, i: a[i.view(-1) - 5].view(3, 4, 40) * 2,
       X, T((3, 4), i64, "int:0:6")),
    _c("gather_index_tensor_middle", lambda a, i: a[:, i].sum(-1), X, T((2, 5), i64, "int:0:40")),
    # ceil mode (SqueezeNet's and GoogLeNet's max pools): last windows past the input
    _c("pool_max2d_ceil", lambda a: F.max_pool2d(a, 3, 2, ceil_mode=True), T((2, 3, 14, 13))),
    _c("pool_max2d_ceil_pad", lambda a: F.max_pool2d(a, 3, 2, 1, ceil_mode=True), T((2, 3, 10, 9))),
    _c("pool_max3d_ceil", lambda a: F.max_pool3d(a, 2, 2, ceil_mode=True), T((2, 2, 5, 7, 6))),
    _c("pool_avg2d_ceil", lambda a: F.avg_pool2d(a, 3, 2, ceil_mode=True), T((2, 3, 14, 13))),
    _c("pool_avg2d_ceil_pad", lambda a: F.avg_pool2d(a, 3, 2, 1, ceil_mode=True), T((2, 3, 10, 9))),
    _c("pool_avg2d_ceil_exclude_pad", lambda a: F.avg_pool2d(
        a, 3, 2, 1, ceil_mode=True, count_include_pad=False), T((2, 3, 10, 9))),
    _c("pool_avg1d_ceil", lambda a: F.avg_pool1d(a, 4, 3, ceil_mode=True), T((2, 3, 50))),
    # concatenation: each element from the input its index falls in (codegen.lower_views)
    _c("cat_rows", lambda a, b: torch.cat([a, b], 0), T((3, 5)), T((4, 5))),
    _c("cat_three_then_relu", lambda a, b, c: torch.relu(torch.cat([a, b * 2, c], 1)),
       T((2, 3, 4)), T((2, 1, 4)), T((2, 5, 4))),
    _c("cat_promotes", lambda a, b: torch.cat([a, b], -1), T((3, 2), f16), T((3, 4)), atol=1e-3),
    _c("cat_class_token", lambda t, x: torch.cat([t.expand(x.shape[0], -1, -1), x], 1) + 1,
       T((1, 1, 8)), T((4, 6, 8))),
    _c("cat_then_sum", lambda a, b: torch.cat([a, b.permute(1, 0)], 1).sum(-1),
       T((6, 3)), T((5, 6))),
    # along channels, rows of a multiple of 4: a vector chunk loads the one input it is in
    _c("cat_channels_vec", lambda a, b, c: torch.relu(torch.cat([a, b, c], 1) * 2),
       T((2, 3, 4, 8)), T((2, 5, 4, 8)), T((2, 2, 4, 8))),
    _c("cat_channels_then_stats", lambda a, b: torch.cat([a, b], 1).sum((0, 2, 3)),
       T((2, 3, 8, 8)), T((2, 2, 8, 8))),
    # a size-1 dim kept by a reduction: its loop variable is 0 wherever it is read back
    _c("red_keeps_a_size_one_dim", lambda a: a.unsqueeze(2).sum(-1).squeeze(2) * 2,
       T((2, 3, 50))),
]

NORMS = [
    _c("norm_softmax", lambda a: torch.softmax(a, -1), X),
    _c("norm_softmax_dim0", lambda a: torch.softmax(a, 0), X),
    _c("norm_softmax_middle", lambda a: torch.softmax(a, 1), X3),
    _c("norm_softmax_scaled_masked", lambda a, m: torch.softmax(a.masked_fill(m, float("-inf")) * 0.125, -1),
       X, T((6, 40), b8, "bool")),
    _c("norm_log_softmax", lambda a: torch.log_softmax(a, -1), X),
    _c("norm_softmax_f16", lambda a: torch.softmax(a, -1), XH, atol=1e-2),
    _c("norm_softmax_f16_to_f32", lambda a: torch.softmax(a, -1, dtype=torch.float32), XH, atol=1e-2),
    _c("norm_softmax_bf16_long", lambda a: torch.softmax(a, -1), T((4, 1000), bf16), atol=1e-2),
    _c("norm_softmax_permuted", lambda a: torch.softmax(a, -1), T((40, 6), perm=(1, 0))),
    # rows long enough for the one-pass statistics (lower_reductions.ONLINE_SOFTMAX_MIN)
    _c("norm_softmax_one_pass", lambda a: torch.softmax(a, -1), T((3, 1 << 15))),
    _c("norm_log_softmax_one_pass", lambda a: torch.log_softmax(a, -1), T((2, 1 << 15))),
    _c("norm_layer_norm", lambda a, w, b: F.layer_norm(a, (40,), w, b), X, T((40,)), T((40,))),
    _c("norm_layer_norm_outputs", lambda a, w, b: torch.ops.aten.native_layer_norm(a, [40], w, b, 1e-5),
       X, T((40,)), T((40,))),
    _c("norm_layer_norm_2d", lambda a: F.layer_norm(a, (5, 12)), X3),
    _c("norm_layer_norm_f16", lambda a, w, b: F.layer_norm(a, (40,), w, b), XH, T((40,), f16), T((40,), f16),
       atol=1e-2),
    _c("norm_layer_norm_residual", lambda a, r, w, b: F.layer_norm(a + r, (40,), w, b) * 2, X, X,
       T((40,)), T((40,))),
    _c("norm_rms_norm", lambda a, w: F.rms_norm(a, (40,), w, 1e-6), X, T((40,))),
    _c("norm_rms_manual", lambda a, w: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w, X, T((40,))),
    _c("norm_batch_norm_eval", lambda a, w, b, m, v: torch.ops.aten._native_batch_norm_legit_no_training(
        a, w, b, m, v, 0.1, 1e-5), X4, T((6,)), T((6,)), T((6,)), T((6,), kind="pos"), compare=(0,)),
    _c("norm_batch_norm_train", lambda a, w, b, m, v: torch.ops.aten._native_batch_norm_legit_functional(
        a, w, b, m, v, True, 0.1, 1e-5), X4, T((6,)), T((6,)), T((6,)), T((6,), kind="pos")),
    _c("norm_batch_norm_no_stats", lambda a: torch.ops.aten._native_batch_norm_legit.no_stats(
        a, None, None, True, 0.1, 1e-5), X4),
    _c("norm_batch_norm_channels_last", lambda a, w, b, m, v: torch.ops.aten._native_batch_norm_legit_functional(
        a, w, b, m, v, True, 0.1, 1e-5), T((2, 5, 7, 6), perm=(0, 3, 1, 2)), T((6,)), T((6,)), T((6,)),
        T((6,), kind="pos")),
    # DenseNet after channels-last convolutions: the concatenation's batch norm + ReLU
    _c("norm_cat_batch_norm_channels_last", lambda a, b, w, bias, m, v: torch.relu(
        torch.ops.aten._native_batch_norm_legit_functional(
            torch.cat([a, b], 1), w, bias, m, v, True, 0.1, 1e-5)[0]),
       T((2, 5, 7, 32), perm=(0, 3, 1, 2)), T((2, 5, 7, 16), perm=(0, 3, 1, 2)), T((48,)),
       T((48,)), T((48,)), T((48,), kind="pos")),
    _c("norm_cat_batch_norm_mixed_layouts", lambda x, a, b, w, bias, m, v: torch.relu(
        torch.ops.aten._native_batch_norm_legit_functional(
            torch.cat([x, a, b], 1), w, bias, m, v, True, 0.1, 1e-5)[0]),
       T((2, 16, 5, 8)), T((2, 5, 8, 16), perm=(0, 3, 1, 2)), T((2, 5, 8, 16), perm=(0, 3, 1, 2)),
       T((48,)), T((48,)), T((48,)), T((48,), kind="pos")),
    _c("norm_group_norm", lambda a, w, b: F.group_norm(a, 3, w, b), X4, T((6,)), T((6,))),
    _c("norm_group_norm_outputs", lambda a, w, b: torch.ops.aten.native_group_norm(a, w, b, 2, 6, 35, 2, 1e-5),
       X4, T((6,)), T((6,))),
    # F.instance_norm as Dynamo hands it over (L2 17): batch norm over a (1, N*C, H, W)
    # view, its result viewed back and divided: one kernel, the divide in its stores
    _c("norm_instance_norm_viewed_back", lambda a: torch.ops.aten._native_batch_norm_legit.no_stats(
        a.view(1, 12, 5, 7), None, None, True, 0.1, 1e-5)[0].view(2, 6, 5, 7) / 2.0, X4),
    _c("norm_instance_norm_manual", lambda a: (a - a.mean((2, 3), keepdim=True))
       / torch.sqrt(a.var((2, 3), keepdim=True, correction=0) + 1e-5), X4),
    _c("norm_cross_entropy_mean", lambda a, t: F.cross_entropy(a, t), X, T((6,), i64, "int:0:40")),
    _c("norm_cross_entropy_sum_ignore", lambda a, t: F.cross_entropy(a, t, reduction="sum", ignore_index=3),
       X, T((6,), i64, "int:0:6")),
    _c("norm_cross_entropy_none", lambda a, t: F.cross_entropy(a, t, reduction="none"), X,
       T((6,), i64, "int:0:40")),
    _c("norm_nll_weight", lambda a, t, w: torch.ops.aten.nll_loss_forward(a.log_softmax(-1), t, w, 1, -100),
       X, T((6,), i64, "int:0:40"), T((40,), kind="pos")),
    _c("norm_softmax_then_sum_rows", lambda a: torch.softmax(a, -1).amax(-1).sum(), X),
]

DYNAMIC = [
    _c("dyn_pointwise_bias", lambda a, b: (a * 2 + b).relu(), T((6, 40)), T((40,)), symbolic=True,
       alt_inputs=(T((9, 24)), T((24,)))),
    _c("dyn_softmax", lambda a: torch.softmax(a, -1), T((6, 40)), symbolic=True, alt_inputs=(T((3, 33)),)),
    _c("dyn_layer_norm", lambda a, w, b: F.layer_norm(a, a.shape[-1:], w, b), T((2, 3, 40)), T((40,)),
       T((40,)), symbolic=True, alt_inputs=(T((4, 5, 24)), T((24,)), T((24,)))),
    _c("dyn_sum_first", lambda a: a.sum(0), T((6, 40)), symbolic=True, alt_inputs=(T((11, 7)),)),
    _c("dyn_mean_all", lambda a: a.mean(), T((6, 40)), symbolic=True, alt_inputs=(T((5, 9)),)),
    _c("dyn_cross_entropy", lambda a, t: F.cross_entropy(a, t), T((6, 40)), T((6,), i64, "int:0:20"),
       symbolic=True, alt_inputs=(T((9, 30)), T((9,), i64, "int:0:20"))),
]

CASES = POINTWISE + REDUCTIONS + NORMS + DYNAMIC

# Larger regions for the GPU tests only: many blocks, long rows, the vector paths and the
# cross-row last-block stage with hundreds of blocks.
BIG = [
    _c("big_softmax", lambda a: torch.softmax(a, -1), T((512, 4096))),
    # too long a row for the persistent variant: the streaming passes
    _c("big_softmax_long", lambda a: torch.softmax(a, -1), T((16, 16384))),
    _c("big_layer_norm_f16", lambda a, w, b: F.layer_norm(a, (768,), w, b), T((1024, 768), f16),
       T((768,), f16), T((768,), f16), atol=1e-2),
    _c("big_sum_first_column", lambda a: a.sum(0), T((4096, 512))),
    _c("big_mean_all", lambda a: a.mean(), T((1 << 20,))),
    _c("big_bias_gelu", lambda a, b: F.gelu(a + b), T((1024, 4096)), T((4096,))),
    _c("big_bias_gelu_f16", lambda a, b: F.gelu(a + b), T((1024, 4096), f16), T((4096,), f16), atol=1e-2),
    _c("big_cross_entropy", lambda a, t: F.cross_entropy(a, t), T((256, 32000)), T((256,), i64, "int:0:32000")),
    _c("big_batch_norm_train", lambda a, w, b, m, v: torch.ops.aten._native_batch_norm_legit_functional(
        a, w, b, m, v, True, 0.1, 1e-5), T((16, 64, 28, 28)), T((64,)), T((64,)), T((64,)), T((64,), kind="pos")),
    _c("big_rms_norm_bf16", lambda a, w: F.rms_norm(a, (4096,), w, 1e-6), T((512, 4096), bf16), T((4096,), bf16),
       atol=1e-2),
    _c("big_argmax", lambda a: a.argmax(-1), T((300, 5000))),
    _c("big_group_norm", lambda a, w, b: F.group_norm(a, 8, w, b), T((8, 64, 32, 32)), T((64,)), T((64,))),
    _c("big_softmax_odd", lambda a: torch.softmax(a, -1), T((257, 1001))),
    _c("big_softmax_one_pass", lambda a: torch.softmax(a, -1), T((64, 1 << 17))),
    _c("big_pool_max_stem", lambda a: F.max_pool2d(a, 3, 2, 1), T((10, 64, 112, 112))),
    _c("big_pool_max1d_dilated", lambda a: F.max_pool1d(a, 8, 1, 4, 3), T((4, 64, 8192))),
    _c("big_log_softmax_one_pass_f16", lambda a: torch.log_softmax(a, -1), T((8, 1 << 16), f16), atol=1e-2),
]
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "duplicate case names"
