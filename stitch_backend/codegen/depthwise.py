"""A depthwise convolution as a generated kernel (NCHW, one filter per channel).

ATen runs an NCHW depthwise convolution (``groups == C``, one input channel per group)
with a generic kernel: one thread an output, sizes read at run time (three integer
divisions an element), the filter re-read for every output. On the H200 that was
0.20 ms of L3 MobileNetV1's 0.71 ms of kernels and 0.25 of MobileNetV2's 1.05, against
0.07 and 0.10 for cuDNN's NHWC kernel under Inductor. The kernel here is written for
one shape (sizes, stride, padding and dilation are constants, so the index arithmetic
is multiplications), and each thread computes four neighbouring outputs of a row,
sharing each tap and the overlapping input loads between them; fp32 accumulation in
eager's order (bias first, then the taps row by row). The Coder offers
it as an alternative for convolution regions, and the Verifier keeps it only where it
is correct and faster than cuDNN/ATen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .conv_kernel import THREADS, ConvKernel, conv2d_operands, out_hw
from .emit_expr import CTYPE

# outputs a thread computes along a row
OUTPUTS_PER_THREAD = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DepthwiseSpec:
    """One depthwise convolution: NCHW contiguous input and output, (C, 1, KH, KW) filter."""

    n: int
    c: int
    h: int
    w: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    dtype: torch.dtype
    bias: bool

    @property
    def out_hw(self) -> tuple[int, int]:
        return out_hw(self)


def depthwise_spec(node: torch.fx.Node) -> DepthwiseSpec | None:
    """The spec of ``aten.convolution`` node ``node`` when it is a depthwise convolution
    this kernel runs (static sizes, NCHW contiguous, fp32/fp16/bf16), else None."""
    ops = conv2d_operands(node)
    if ops is None or ops.x.dtype not in DTYPES:
        return None
    x, w, b, out = ops.x, ops.w, ops.b, ops.out
    n, c, h, wd = x.shape
    if ops.groups != c or tuple(w.shape[:2]) != (c, 1):
        return None
    if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        return None
    if b is not None and tuple(b.shape) != (c,):
        return None
    spec = DepthwiseSpec(int(n), int(c), int(h), int(wd), int(w.shape[2]), int(w.shape[3]),
                         ops.stride, ops.padding, ops.dilation, x.dtype, b is not None)
    if spec.out_hw != tuple(out.shape[2:]) or min(spec.out_hw) < 1:
        return None
    if n * c * h * wd >= 2**30 or n * c * spec.out_hw[0] * spec.out_hw[1] >= 2**30:
        return None
    return spec


def _source(spec: DepthwiseSpec, name: str) -> str:
    t = CTYPE[spec.dtype]
    ho, wo = spec.out_hw
    vo = OUTPUTS_PER_THREAD
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    bias_param = f"    const {t}* __restrict__ b,\n" if spec.bias else ""
    init = "sfk_val(b[c])" if spec.bias else "0.0f"
    return f"""// {name}: depthwise convolution, {spec.c} channels, {spec.kh}x{spec.kw} taps, stride
// {spec.stride}, padding {spec.padding}, dilation {spec.dilation}, on ({spec.n}, {spec.c}, {spec.h}, {spec.w}) {t}
// -> ({spec.n}, {spec.c}, {ho}, {wo}); {vo} outputs of a row a thread, fp32 accumulation.
#include "fused_ops.cuh"

extern "C" __global__ void __launch_bounds__({THREADS}) {name}(
    const {t}* __restrict__ x,
    const {t}* __restrict__ w,
{bias_param}    {t}* __restrict__ y) {{
  constexpr int C = {spec.c}, H = {spec.h}, W = {spec.w}, HO = {ho}, WO = {wo};
  constexpr int KH = {spec.kh}, KW = {spec.kw}, SH = {sh}, SW = {sw}, PH = {ph}, PW = {pw};
  constexpr int DH = {dh}, DW = {dw}, VO = {vo}, WG = (WO + VO - 1) / VO, ITEMS = HO * WG;
  constexpr int PLANES = {spec.n * spec.c};
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < PLANES * ITEMS;
       idx += gridDim.x * blockDim.x) {{
    const int plane = idx / ITEMS, item = idx % ITEMS, c = plane % C;
    const int ho = item / WG, wo0 = (item % WG) * VO;
    const {t}* __restrict__ xp = x + (long long)plane * (H * W);
    const {t}* __restrict__ wp = w + c * (KH * KW);
    float acc[VO];
#pragma unroll
    for (int o = 0; o < VO; ++o) acc[o] = {init};
#pragma unroll
    for (int i = 0; i < KH; ++i) {{
      const int hi = ho * SH - PH + i * DH;
      if (hi < 0 || hi >= H) continue;
      const {t}* __restrict__ row = xp + hi * W;
#pragma unroll
      for (int j = 0; j < KW; ++j) {{
        const float tap = sfk_val(wp[i * KW + j]);
#pragma unroll
        for (int o = 0; o < VO; ++o) {{
          const int wi = (wo0 + o) * SW - PW + j * DW;
          if (wi >= 0 && wi < W) acc[o] += tap * sfk_val(row[wi]);
        }}
      }}
    }}
    {t}* __restrict__ yp = y + (long long)plane * (HO * WO) + ho * WO;
#pragma unroll
    for (int o = 0; o < VO; ++o)
      if (wo0 + o < WO) yp[wo0 + o] = sfk_cvt<{t}>(acc[o]);
  }}
}}
"""


class DepthwiseKernel(ConvKernel):
    """A generated depthwise convolution (see ``conv_kernel.ConvKernel``)."""

    render = staticmethod(_source)

    def expected(self):
        s = self.spec
        return [((s.n, s.c, s.h, s.w), None), ((s.c, 1, s.kh, s.kw), None)] + (
            [((s.c,), None)] if s.bias else [])

    def output(self):
        s = self.spec
        ho, wo = s.out_hw
        return (s.n, s.c, ho, wo), (s.c * ho * wo, ho * wo, wo, 1), s.dtype

    def items(self) -> int:
        s = self.spec
        ho, wo = s.out_hw
        return s.n * s.c * ho * -(-wo // OUTPUTS_PER_THREAD)

    def interpret(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The outputs by torch (the CPU testing aid's stand-in for the kernel)."""
        self.check(inputs)
        s = self.spec
        x, w = (inputs[p] for p in self.positions[:2])
        b = inputs[self.positions[2]] if s.bias else None
        y = torch.nn.functional.conv2d(x.float(), w.float(), None if b is None else b.float(),
                                       s.stride, s.padding, s.dilation, s.c)
        return [y.to(s.dtype).contiguous()]


def generate_depthwise(spec: DepthwiseSpec, name: str, positions: Sequence[int]) -> DepthwiseKernel:
    """The kernel for ``spec`` named ``name``; ``positions``: where x, w (and the bias)
    are among the region's inputs."""
    return DepthwiseKernel.build(spec, name, positions)


__all__ = ["DTYPES", "DepthwiseKernel", "DepthwiseSpec", "depthwise_spec", "generate_depthwise"]
