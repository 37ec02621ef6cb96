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

from .fused import Layout, LaunchPlan, launch_plan, layout_key

THREADS = 256
MAX_BLOCKS = 132 * 8       # a grid-stride loop beyond: 8 blocks of 256 per H200 SM
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


__all__ = ["ConvKernel", "MAX_BLOCKS", "THREADS", "out_hw"]
