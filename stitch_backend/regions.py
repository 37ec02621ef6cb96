"""Cut a region out of its graph as a standalone ``torch.fx.GraphModule``.

The region module takes the region's inputs (in ``Region.inputs`` order) as
placeholders and returns its outputs (``Region.outputs`` order) as a tuple. Node
metadata (``meta["val"]``) is kept, so the Coder sees shapes, dtypes and symbolic
sizes. Running the module eagerly is the ATen implementation of the region.
"""

from __future__ import annotations

import torch
import torch.fx

from .ir import Region


def region_module(gm: torch.fx.GraphModule, region: Region) -> torch.fx.GraphModule:
    """A GraphModule computing ``region`` on its own (ATen, eager)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root = torch.nn.Module()
    for name in region.inputs:
        src = nodes[name]
        ph = graph.placeholder(name)
        ph.meta = dict(src.meta)
        if src.op == "get_attr" and "val" not in ph.meta:
            value = getattr(gm, src.target)
            ph.meta["val"] = value
        env[src] = ph
    for name in region.nodes:
        src = nodes[name]
        if src.op == "get_attr":
            root.register_buffer(src.target.replace(".", "_"), getattr(gm, src.target))
        env[src] = graph.node_copy(src, lambda n: env[n])
    graph.output(tuple(env[nodes[name]] for name in region.outputs))
    graph.lint()
    return torch.fx.GraphModule(root, graph, class_name=region.name)
