"""The ATen op set the backend works on.

Graphs are decomposed with PyTorch's core ATen decompositions
(``torch._decomp.core_aten_decompositions()``), with these exceptions kept whole:

* random ops (``native_dropout``, ``bernoulli``, ``rand*``, ...): decomposing them would
  draw from the generator differently from eager, so a seeded run would differ;
* fused attention (``_scaled_dot_product_*``): kept as one op for the attention region;
* ops that a region template implements better whole (softmax, layer/group/batch norm
  are already core ops and stay whole).
"""

from __future__ import annotations

import functools

import torch


def _keep_whole() -> set:
    aten = torch.ops.aten
    keep = set()
    for packet in (aten.native_dropout, aten.bernoulli, aten.rand, aten.rand_like,
                   aten.randn, aten.randn_like, aten.randint, aten.randint_like,
                   aten.randperm, aten.normal, aten.uniform, aten.exponential,
                   aten.multinomial, aten.poisson):
        for name in packet.overloads():
            keep.add(getattr(packet, name))
    for name in dir(aten):
        if name.startswith("_scaled_dot_product") or name in ("scaled_dot_product_attention",):
            packet = getattr(aten, name)
            for ov in packet.overloads():
                keep.add(getattr(packet, ov))
    return keep


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    """The decomposition table handed to AOTAutograd."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    for op in _keep_whole():
        table.pop(op, None)
    return table
