"""The folded-BatchNorm alternative of a conv region (``stitch_backend.bn_fold``): an
eval-mode BatchNorm folded into the convolution's weight and bias in every call, the
ReLU after it (and a residual added before the ReLU) applied by cuDNN's fused call, then
the rest of the epilogue as usual. Proposed beside the template for CUDA graphs where
cuDNN runs convolutions; the Verifier keeps it only where it is correct and faster."""

from __future__ import annotations

from typing import Any

import torch

from stitch_backend import bn_fold
from stitch_backend.conv_bias import cudnn_runs_convolutions
from stitch_backend.ir import Region
from stitch_backend.regions import region_module

from .state import Candidate, Stage, Subtask


def propose(coder: Any, subtask: Subtask, head: Region, part: Region) -> Candidate | None:
    """The candidate ``REGION_bnf``, or None where the region's convolution is not followed
    by an eval-mode BatchNorm and a ReLU (``bn_fold.fold_chain``), or its values are not
    on a GPU whose convolutions cuDNN runs (the Coder's ``library_on_cpu``: tests)."""
    from .coder import sub_region

    gm = subtask.graph
    nodes = {n.name: n for n in gm.graph.nodes}
    if len(head.nodes) != 1:
        return None
    conv = nodes[head.nodes[0]]
    chain = bn_fold.fold_chain(conv, set(head.nodes) | set(part.nodes))
    if chain is None:
        return None
    out = conv.meta["val"]
    if out.device.type == "cuda":
        if not cudnn_runs_convolutions():
            return None
    elif not coder.library_on_cpu:
        return None
    names = [n.name for n in chain.nodes]
    sub = sub_region(gm, names, subtask.region_id, 830)
    module = region_module(gm, sub)
    bn_fold.rewrite(module.graph, chain)
    name = f"{subtask.region_name}_bnf"
    stages = [Stage(sub, module=torch.fx.GraphModule(module, module.graph, class_name=name))]
    stages += coder.rest_stages(subtask, part, set(names), 831)
    eps = chain.norm.args[6]
    header = (f"// {name}: eval-mode BatchNorm (eps {eps}) folded into the convolution's "
              f"weight and bias in each call, then aten.{chain.what}"
              f"{' (the residual added)' if chain.residual is not None else ''}, "
              f"{tuple(out.shape)} {out.dtype}, stride {tuple(out.stride())}\n")
    return coder.headed_candidate(subtask, name, header, stages,
                                  library=all(st.kernel is None for st in stages))


__all__ = ["propose"]
