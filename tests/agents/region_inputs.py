"""Random inputs for one planned region, with the strides its graph gives them."""

from __future__ import annotations

import torch


def region_inputs(gm: torch.fx.GraphModule, region, seed: int = 1) -> list[torch.Tensor]:
    """A tensor for each of ``region``'s inputs, shaped and strided as in ``gm``: normal
    draws for floating point, ones otherwise (a mask that keeps every element)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for name in region.inputs:
        v = nodes[name].meta["val"]
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
        out.append(t.copy_(torch.randn(v.shape, generator=gen) if v.dtype.is_floating_point
                           else torch.ones(v.shape, dtype=v.dtype)))
    return out
