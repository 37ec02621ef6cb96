"""A convolution over few input channels (a network's stem) as a generated kernel.

The first convolution of an image model reads 3 channels. With the graph channels-last,
cuDNN runs it NHWC; where its TF32 kernel costs precision the layout pass asks for exact
fp32 (``aten._convolution(..., allow_tf32=False)``), and cuDNN's fp32 NHWC kernel for
3 -> 64 channels took 0.146 ms on L3 ResNetBasicBlock's (10, 3, 224, 224) input on the
H200 (0.120 on RegNet's), against 0.055-0.068 for the TF32 kernels Inductor ran. Its
reduction is only CI * KH * KW long (27 for 3x3), so a direct kernel does it in fp32:
the filter in shared memory as [tap][output channel], each thread four neighbouring
outputs of a row times four output channels (one 16-byte store per output), the input
row segment the four outputs share loaded once per tap row. Sizes, strides, padding
and dilation are constants. Output channels-last (what the layout pass's graphs
carry); input of any strides. fp32 only. The Coder offers it as an alternative for
convolution regions, and the Verifier keeps it only where it is correct and faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .conv_kernel import THREADS, ConvKernel, conv2d_operands, out_hw

MAX_IN_CHANNELS = 4
OUTPUTS_PER_THREAD = 4          # along a row of the output
CHANNELS_PER_THREAD = 4         # one float4 of the NHWC output
SMEM_FLOATS = 12 * 1024         # the filter in static shared memory: at most 48 KB
_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten._convolution.default)


@dataclass(frozen=True)
class StemConvSpec:
    """One convolution: (N, CI, H, W) fp32 input of strides ``x_strides``, (CO, CI, KH,
    KW) filter of strides ``w_strides``, channels-last (N, CO, HO, WO) output."""

    n: int
    ci: int
    h: int
    w: int
    co: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    x_strides: tuple[int, int, int, int]
    w_strides: tuple[int, int, int, int]
    bias: bool
    dtype = torch.float32

    @property
    def out_hw(self) -> tuple[int, int]:
        return out_hw(self)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.co, *self.out_hw)

    @property
    def out_strides(self) -> tuple[int, int, int, int]:
        ho, wo = self.out_hw
        return (ho * wo * self.co, 1, wo * self.co, self.co)


def stem_spec(node: torch.fx.Node) -> StemConvSpec | None:
    """The spec of convolution ``node`` when this kernel runs it (static sizes, fp32, one
    group, at most MAX_IN_CHANNELS input channels, output channels a multiple of four,
    the filter fitting in shared memory, a channels-last output), else None."""
    ops = conv2d_operands(node, _CONVS)
    if ops is None or ops.groups != 1 or ops.x.dtype != torch.float32:
        return None
    x, w, b, out = ops.x, ops.w, ops.b, ops.out
    n, ci, h, wd = (int(s) for s in x.shape)
    co, wci, kh, kw = (int(s) for s in w.shape)
    if wci != ci or ci > MAX_IN_CHANNELS or co % CHANNELS_PER_THREAD or kh * kw * ci * co > SMEM_FLOATS:
        return None
    if b is not None and (tuple(b.shape) != (co,) or not b.is_contiguous()):
        return None
    if min(x.stride()) < 0 or min(w.stride()) < 0:
        return None
    spec = StemConvSpec(n, ci, h, wd, co, kh, kw, ops.stride, ops.padding, ops.dilation,
                        tuple(int(s) for s in x.stride()), tuple(int(s) for s in w.stride()),
                        b is not None)
    if min(spec.out_hw) < 1 or tuple(out.shape) != spec.out_shape:
        return None
    if tuple(out.stride()) != spec.out_strides:
        return None        # the output must be channels-last: the kernel stores NHWC rows
    reach = 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride()))
    if reach >= 2**31 or n * co * spec.out_hw[0] * spec.out_hw[1] >= 2**30:
        return None
    return spec


def _source(spec: StemConvSpec, name: str) -> str:
    ho, wo = spec.out_hw
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    xn, xc, xh, xw = spec.x_strides
    wco, wci, wkh, wkw = spec.w_strides
    p, q = OUTPUTS_PER_THREAD, CHANNELS_PER_THREAD
    bias_param = "    const float* __restrict__ b,\n" if spec.bias else ""
    init = ("const float init[4] = {b[cg * 4], b[cg * 4 + 1], b[cg * 4 + 2], b[cg * 4 + 3]};"
            if spec.bias else "const float init[4] = {0.0f, 0.0f, 0.0f, 0.0f};")
    return f"""// {name}: convolution of {spec.ci} input channel(s), {spec.kh}x{spec.kw} taps, stride
// {spec.stride}, padding {spec.padding}, dilation {spec.dilation}, on ({spec.n}, {spec.ci}, {spec.h}, {spec.w}) float
// -> ({spec.n}, {spec.co}, {ho}, {wo}) channels-last; {p} outputs of a row x {q} channels a thread,
// the filter in shared memory, fp32 throughout.
#include "fused_ops.cuh"

extern "C" __global__ void __launch_bounds__({THREADS}) {name}(
    const float* __restrict__ x,
    const float* __restrict__ w,
{bias_param}    float* __restrict__ y) {{
  constexpr int N = {spec.n}, CI = {spec.ci}, H = {spec.h}, W = {spec.w}, CO = {spec.co};
  constexpr int HO = {ho}, WO = {wo}, KH = {spec.kh}, KW = {spec.kw};
  constexpr int SH = {sh}, SW = {sw}, PH = {ph}, PW = {pw}, DH = {dh}, DW = {dw};
  constexpr int XN = {xn}, XC = {xc}, XH = {xh}, XW = {xw};
  constexpr int WCO = {wco}, WCI = {wci}, WKH = {wkh}, WKW = {wkw};
  constexpr int P = {p}, CG = CO / {q}, WG = (WO + P - 1) / P, SEG = (P - 1) * SW + (KW - 1) * DW + 1;
  constexpr int TAPS = KH * KW * CI, ITEMS = N * HO * WG * CG;
  // the filter as [kh][kw][ci][co]: a thread's four output channels of a tap are one float4
  __shared__ __align__(16) float ws[TAPS * CO];
  for (int i = threadIdx.x; i < TAPS * CO; i += blockDim.x) {{
    const int co = i % CO, t = i / CO, ci = t % CI, k = t / CI;
    ws[i] = w[co * WCO + ci * WCI + (k / KW) * WKH + (k % KW) * WKW];
  }}
  __syncthreads();
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < ITEMS; idx += gridDim.x * blockDim.x) {{
    const int cg = idx % CG, item = idx / CG;
    const int wo0 = (item % WG) * P, row = item / WG, ho = row % HO, n = row / HO;
    {init}
    float acc[P][4];
#pragma unroll
    for (int o = 0; o < P; ++o) {{
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[o][c] = init[c];
    }}
    const float* __restrict__ xn = x + n * XN;
#pragma unroll
    for (int i = 0; i < KH; ++i) {{
      const int hi = ho * SH - PH + i * DH;
      if (hi < 0 || hi >= H) continue;
#pragma unroll
      for (int ci = 0; ci < CI; ++ci) {{
        // the input this row of taps reads for the thread's P outputs (zero outside)
        const float* __restrict__ xr = xn + hi * XH + ci * XC;
        float seg[SEG];
#pragma unroll
        for (int s = 0; s < SEG; ++s) {{
          const int wi = wo0 * SW - PW + s;
          seg[s] = (wi >= 0 && wi < W) ? __ldg(xr + wi * XW) : 0.0f;
        }}
#pragma unroll
        for (int j = 0; j < KW; ++j) {{
          const float4 f = *reinterpret_cast<const float4*>(&ws[((i * KW + j) * CI + ci) * CO + cg * 4]);
#pragma unroll
          for (int o = 0; o < P; ++o) {{
            const float v = seg[o * SW + j * DW];
            acc[o][0] = fmaf(v, f.x, acc[o][0]);
            acc[o][1] = fmaf(v, f.y, acc[o][1]);
            acc[o][2] = fmaf(v, f.z, acc[o][2]);
            acc[o][3] = fmaf(v, f.w, acc[o][3]);
          }}
        }}
      }}
    }}
    float* __restrict__ yr = y + (row * WO + wo0) * CO + cg * 4;
#pragma unroll
    for (int o = 0; o < P; ++o)
      if (wo0 + o < WO)
        *reinterpret_cast<float4*>(yr + o * CO) = make_float4(acc[o][0], acc[o][1], acc[o][2], acc[o][3]);
  }}
}}
"""


class StemConvKernel(ConvKernel):
    """A generated few-input-channel convolution (see ``conv_kernel.ConvKernel``)."""

    render = staticmethod(_source)

    def expected(self):
        s = self.spec
        return [((s.n, s.ci, s.h, s.w), s.x_strides), ((s.co, s.ci, s.kh, s.kw), s.w_strides)] + (
            [((s.co,), (1,))] if s.bias else [])

    def output(self):
        return self.spec.out_shape, self.spec.out_strides, torch.float32

    def items(self) -> int:
        s = self.spec
        ho, wo = s.out_hw
        return s.n * ho * -(-wo // OUTPUTS_PER_THREAD) * (s.co // CHANNELS_PER_THREAD)

    def interpret(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The outputs by torch (the CPU testing aid's stand-in for the kernel)."""
        self.check(inputs)
        s = self.spec
        x, w = (inputs[p] for p in self.positions[:2])
        b = inputs[self.positions[2]] if s.bias else None
        y = torch.nn.functional.conv2d(x, w, b, s.stride, s.padding, s.dilation)
        out = torch.empty_strided(s.out_shape, s.out_strides, dtype=torch.float32, device=y.device)
        return [out.copy_(y)]


def generate_stem_conv(spec: StemConvSpec, name: str, positions: Sequence[int]) -> StemConvKernel:
    """The kernel for ``spec`` named ``name``; ``positions``: where x, w (and the bias)
    are among the region's inputs."""
    return StemConvKernel.build(spec, name, positions)


__all__ = ["StemConvKernel", "StemConvSpec", "generate_stem_conv", "stem_spec"]
