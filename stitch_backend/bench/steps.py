"""What one benchmark call is beyond a forward: a training step (forward, the outputs
weighted by fixed random tensors and summed, backward) and the autocast around forwards.
The bench's worker and the CPU sweep share them."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..correctness import flatten_outputs


class LossWeights:
    """The fixed random weights a training step sums its outputs with: one tensor per
    floating output, drawn from ``seed`` on the first step (from the first outputs'
    shapes) and kept, per dtype, so every backend and the fp64 model get the same loss."""

    def __init__(self, seed: int):
        self.seed = seed
        self._base: list[torch.Tensor | None] | None = None
        self._by_dtype: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def loss(self, out: Any) -> torch.Tensor | None:
        leaves = flatten_outputs(out)
        if self._base is None:
            gen = torch.Generator().manual_seed(self.seed)
            self._base = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)
                          if _is_float(t) else None for t in leaves]
        total = None
        for i, t in enumerate(leaves):
            if i >= len(self._base) or self._base[i] is None or not _is_float(t):
                continue
            key = (i, t.dtype)
            if key not in self._by_dtype:
                self._by_dtype[key] = self._base[i].to(t.dtype)
            term = (t * self._by_dtype[key]).sum()
            total = term if total is None else total + term
        return total


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, name: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to the dtype ``name`` ("bf16"/"fp16") on ``device``; nothing
    for ""."""
    if not name:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST[name])


def training_step(fn: Callable[..., Any], model: torch.nn.Module, inputs: list[Any],
                  weights: LossWeights,
                  amp: contextlib.AbstractContextManager | None = None
                  ) -> tuple[Any, list[torch.Tensor | None]]:
    """One training step of ``fn`` (``model`` or its compiled form): gradients cleared,
    forward (inside ``amp``, an autocast, when given), ``weights``' loss, backward; the
    outputs (detached) and every parameter's gradient (None where it gets none)."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    with torch.enable_grad():
        with amp or contextlib.nullcontext():
            out = fn(*inputs)
        loss = weights.loss(out)
        if loss is not None and loss.requires_grad:
            loss.backward()
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in flatten_outputs(out)]
    return detached, [p.grad for p in params]
