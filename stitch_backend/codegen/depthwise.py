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

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .emit_expr import CTYPE
from .fused import Layout, LaunchPlan, launch_plan, layout_key

# outputs a thread computes along a row; threads a block
OUTPUTS_PER_THREAD = 4
THREADS = 256
MAX_BLOCKS = 132 * 8       # a grid-stride loop beyond: 8 blocks of 256 per H200 SM
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
        ho = (self.h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1
        wo = (self.w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1
        return ho, wo


def depthwise_spec(node: torch.fx.Node) -> DepthwiseSpec | None:
    """The spec of ``aten.convolution`` node ``node`` when it is a depthwise convolution
    this kernel runs (static sizes, NCHW contiguous, fp32/fp16/bf16), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.convolution.default:
        return None
    if len(node.args) != 9 or node.kwargs:
        return None
    x_node, w_node, b_node, stride, padding, dilation, transposed, out_pad, groups = node.args
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None
            for a in (x_node, w_node, b_node)]
    x, w, b = vals
    out = node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (x, w, out)) or transposed:
        return None
    if b_node is not None and not isinstance(b, torch.Tensor):
        return None
    tensors = [v for v in (x, w, b, out) if isinstance(v, torch.Tensor)]
    if any(isinstance(s, torch.SymInt) for v in tensors for s in (*v.shape, *v.stride())):
        return None
    if x.dim() != 4 or w.dim() != 4 or x.dtype not in DTYPES or any(v.dtype != x.dtype for v in tensors):
        return None
    n, c, h, wd = x.shape
    if groups != c or tuple(w.shape[:2]) != (c, 1) or any(p != 0 for p in out_pad):
        return None
    if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        return None
    if b is not None and tuple(b.shape) != (c,):
        return None
    spec = DepthwiseSpec(int(n), int(c), int(h), int(wd), int(w.shape[2]), int(w.shape[3]),
                         tuple(int(s) for s in stride), tuple(int(p) for p in padding),
                         tuple(int(d) for d in dilation), x.dtype, b is not None)
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


@dataclass(frozen=True)
class DepthwiseKernel:
    """A generated depthwise convolution; launched like a ``FusedKernel`` (``prepare``),
    its launches recorded the same way (``_layouts``), interpreted on the CPU by torch."""

    name: str
    spec: DepthwiseSpec
    positions: tuple[int, ...]        # region-input positions of x, w (and bias)
    source: str = ""
    ops: tuple[str, ...] = ("aten.convolution.default",)
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def entry(self) -> str:
        return self.name

    @property
    def signature(self) -> str:
        return "p" * (len(self.positions) + 1)

    def renamed(self, name: str) -> "DepthwiseKernel":
        if not _IDENT.match(name):
            raise ValueError(f"kernel name {name!r} is not a C identifier")
        return dataclasses.replace(self, name=name, source=_source(self.spec, name), _layouts={})

    def _check(self, inputs: Sequence[Any]) -> None:
        s = self.spec
        want = [(s.n, s.c, s.h, s.w), (s.c, 1, s.kh, s.kw)] + ([(s.c,)] if s.bias else [])
        for pos, shape in zip(self.positions, want):
            x = inputs[pos]
            if (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape
                    or x.dtype != s.dtype or not x.is_contiguous()):
                raise ValueError(f"{self.name}: input {pos} is not a contiguous {s.dtype} "
                                 f"tensor of shape {shape}")

    def prepare(self, inputs: Sequence[Any]) -> LaunchPlan:
        key = layout_key(inputs)
        layout = self._layouts.get(key)
        if layout is None:
            self._check(inputs)
            s = self.spec
            ho, wo = s.out_hw
            out = (s.n, s.c, ho, wo)
            stride = (s.c * ho * wo, ho * wo, wo, 1)
            items = s.n * s.c * ho * -(-wo // OUTPUTS_PER_THREAD)
            grid = (max(1, min(-(-items // THREADS), MAX_BLOCKS)), 1, 1)
            layout = Layout(((out, stride, s.dtype),), (), self.positions, (), grid,
                            (THREADS, 1, 1))
            self._layouts[key] = layout
        return launch_plan(layout, inputs)

    def interpret(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The outputs by torch (the CPU testing aid's stand-in for the kernel)."""
        self._check(inputs)
        s = self.spec
        x, w = (inputs[p] for p in self.positions[:2])
        b = inputs[self.positions[2]] if s.bias else None
        y = torch.nn.functional.conv2d(x.float(), w.float(), None if b is None else b.float(),
                                       s.stride, s.padding, s.dilation, s.c)
        return [y.to(s.dtype).contiguous()]


def generate_depthwise(spec: DepthwiseSpec, name: str, positions: Sequence[int]) -> DepthwiseKernel:
    """The kernel for ``spec`` named ``name``; ``positions``: where x, w (and the bias)
    are among the region's inputs."""
    if not _IDENT.match(name):
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    want = 3 if spec.bias else 2
    if len(positions) != want:
        raise ValueError(f"{name}: {want} input positions expected, got {len(positions)}")
    return DepthwiseKernel(name, spec, tuple(positions), _source(spec, name))


__all__ = ["DTYPES", "DepthwiseKernel", "DepthwiseSpec", "depthwise_spec", "generate_depthwise"]
