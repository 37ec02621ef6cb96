"""What the Coder's generated convolutions share (``depthwise``, ``stem_conv``): a name
that is a C identifier, a spec with every size fixed, the region-input positions of
x, w (and the bias), launched like a ``FusedKernel`` (``prepare``), their launches
recorded the same way (``_layouts``), interpreted on the CPU by torch."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx

from .fused import Layout, LaunchPlan, launch_plan, layout_key

THREADS = 256
MAX_BLOCKS = 132 * 8       # a grid-stride loop beyond: 8 blocks of 256 per H200 SM
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ConvOperands:
    """A 2-D convolution node's fake values (``b`` None without a bias) and arguments."""

    x: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    out: torch.Tensor
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int


_ARGC = {torch.ops.aten.convolution.default: 9, torch.ops.aten._convolution.default: 13}


def conv2d_operands(node: torch.fx.Node, targets: Sequence[Any] = (
        torch.ops.aten.convolution.default,)) -> ConvOperands | None:
    """The operands of ``node`` when it is one of ``targets`` (``aten.convolution``, or
    ``aten._convolution``, whose cuDNN flags a generated kernel makes moot), not
    transposed, with no output padding, static sizes, 4-D tensors of one dtype; else
    None."""
    if node.op != "call_function" or node.target not in targets or node.kwargs:
        return None
    if len(node.args) != _ARGC.get(node.target):
        return None
    x_node, w_node, b_node, stride, padding, dilation, transposed, out_pad, groups = node.args[:9]
    x, w, b = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None
               for a in (x_node, w_node, b_node))
    out = node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (x, w, out)) or transposed:
        return None
    if b_node is not None and not isinstance(b, torch.Tensor):
        return None
    tensors = [v for v in (x, w, b, out) if isinstance(v, torch.Tensor)]
    if any(isinstance(s, torch.SymInt) for v in tensors for s in (*v.shape, *v.stride())):
        return None
    if x.dim() != 4 or w.dim() != 4 or any(v.dtype != x.dtype for v in tensors):
        return None
    if any(p != 0 for p in out_pad) or not len(stride) == len(padding) == len(dilation) == 2:
        return None
    return ConvOperands(x, w, b, out, tuple(int(s) for s in stride),
                        tuple(int(p) for p in padding), tuple(int(d) for d in dilation),
                        int(groups))


def out_hw(spec: Any) -> tuple[int, int]:
    """The output height and width of a 2-D convolution spec (h, w, kh, kw, stride,
    padding, dilation), as ATen computes them."""
    ho = (spec.h + 2 * spec.padding[0] - spec.dilation[0] * (spec.kh - 1) - 1) // spec.stride[0] + 1
    wo = (spec.w + 2 * spec.padding[1] - spec.dilation[1] * (spec.kw - 1) - 1) // spec.stride[1] + 1
    return ho, wo


@dataclass(frozen=True)
class ConvKernel:
    """A generated convolution kernel for one spec (which has ``bias`` and ``dtype``).
    Subclasses give ``render`` (the CUDA source), ``expected`` (what the inputs must be),
    ``output`` (shape, strides, dtype), ``items`` (threads' worth of work) and
    ``interpret``."""

    name: str
    spec: Any
    positions: tuple[int, ...]        # region-input positions of x, w (and bias)
    source: str = ""
    ops: tuple[str, ...] = ("aten.convolution.default",)
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def render(spec: Any, name: str) -> str:
        raise NotImplementedError

    def expected(self) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """(shape, strides) of x, w (and the bias); strides None: contiguous."""
        raise NotImplementedError

    def check(self, inputs: Sequence[Any]) -> None:
        """Refuse inputs other than those the kernel was generated for."""
        dtype = self.spec.dtype
        for pos, (shape, strides) in zip(self.positions, self.expected()):
            x = inputs[pos]
            if (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype
                    or (not x.is_contiguous() if strides is None
                        else tuple(x.stride()) != strides)):
                raise ValueError(f"{self.name}: input {pos} is not a {dtype} tensor of shape "
                                 f"{shape} and strides {strides or 'contiguous'}")

    def output(self) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
        raise NotImplementedError

    def items(self) -> int:
        raise NotImplementedError

    def interpret(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def build(cls, spec: Any, name: str, positions: Sequence[int]) -> "ConvKernel":
        """The kernel for ``spec`` named ``name``; ``positions``: where x, w (and the
        bias) are among the region's inputs."""
        if not _IDENT.match(name):
            raise ValueError(f"kernel name {name!r} is not a C identifier")
        want = 3 if spec.bias else 2
        if len(positions) != want:
            raise ValueError(f"{name}: {want} input positions expected, got {len(positions)}")
        return cls(name, spec, tuple(positions), cls.render(spec, name))

    @property
    def entry(self) -> str:
        return self.name

    @property
    def signature(self) -> str:
        return "p" * (len(self.positions) + 1)

    def renamed(self, name: str) -> "ConvKernel":
        if not _IDENT.match(name):
            raise ValueError(f"kernel name {name!r} is not a C identifier")
        return dataclasses.replace(self, name=name, source=self.render(self.spec, name),
                                   _layouts={})

    def prepare(self, inputs: Sequence[Any]) -> LaunchPlan:
        key = layout_key(inputs)
        layout = self._layouts.get(key)
        if layout is None:
            self.check(inputs)
            grid = (max(1, min(-(-self.items() // THREADS), MAX_BLOCKS)), 1, 1)
            layout = Layout((self.output(),), (), self.positions, (), grid, (THREADS, 1, 1))
            self._layouts[key] = layout
        return launch_plan(layout, inputs)


__all__ = ["ConvKernel", "ConvOperands", "MAX_BLOCKS", "THREADS", "conv2d_operands", "out_hw"]
