"""Cut a region out of its graph as a standalone ``torch.fx.GraphModule``.

The region module takes the region's inputs (in ``Region.inputs`` order) as
placeholders and returns its outputs (``Region.outputs`` order) as a tuple. Node
metadata (``meta["val"]``) is kept, so the Coder sees shapes, dtypes and symbolic
sizes. Running the module eagerly is the ATen implementation of the region.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .ir import Region, RegionKind


# meta key of a region-module placeholder that stands for a one-element tensor constant
# of the graph (e.g. ``torch.tensor(0.5)`` in a forward): its value, which generated
# code uses as a literal wherever the region has other tensor inputs (codegen.lower); a
# CPU scalar beside CUDA tensors then costs the kernel nothing.
CONSTANT = "stitch_constant"


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
        if src.op == "get_attr":
            value = getattr(gm, src.target)
            if "val" not in ph.meta:
                ph.meta["val"] = value
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                ph.meta[CONSTANT] = value     # the Coder may inline it
        env[src] = ph
    for name in region.nodes:
        src = nodes[name]
        if src.op == "get_attr":
            root.register_buffer(src.target.replace(".", "_"), getattr(gm, src.target))
        env[src] = graph.node_copy(src, lambda n: env[n])
    graph.output(tuple(env[nodes[name]] for name in region.outputs))
    graph.lint()
    return _lazy_module(root, graph, region.name)


def constant_inputs(module: Any) -> list[int]:
    """Positions of the inputs of a region module that are graph constants (CONSTANT);
    none for any other callable."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if CONSTANT in n.meta]


def _lazy_module(root: torch.nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated on its first call: the Coder builds
    hundreds of region modules it only reads the graph of."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
    except ImportError:  # pragma: no cover - older torch
        return torch.fx.GraphModule(root, graph, class_name=name)
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph, class_name=name)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` (nodes, metas and output), for passes that rewrite a copy."""
    out = torch.fx.Graph()
    env: dict = {}
    out.output(out.graph_copy(graph, env))
    return out


def rewritable_copy(gm: torch.fx.GraphModule, wanted):
    """(a copy of ``gm`` to rewrite, the fake mode its values were traced in), or None
    when no node is ``wanted`` or its inputs carry no fake values (new nodes'
    ``meta["val"]`` are computed in that mode)."""
    from torch._guards import detect_fake_mode

    if not any(wanted(n) for n in gm.graph.nodes):
        return None
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    if mode is None:
        return None
    return torch.fx.GraphModule(gm, copy_graph(gm.graph)), mode


def inherit_source(src: torch.fx.Node, *new: torch.fx.Node) -> None:
    """Nodes a rewrite made from ``src`` point back to its source lines and module."""
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            for node in new:
                node.meta[key] = src.meta[key]


def tensor_val(node: object) -> torch.Tensor | None:
    """``node``'s traced value (its ``meta["val"]``) where ``node`` is an FX node whose
    value is a tensor; else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def boundary(gm: torch.fx.GraphModule, names: list[str]) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of the node set ``names``: values read from outside it, and its
    values read outside it (by other nodes or the graph output), each in graph order."""
    nodes = {n.name: n for n in gm.graph.nodes}
    members = {nodes[n] for n in names}
    inputs: list[str] = []
    outputs: list[str] = []
    for name in names:
        node = nodes[name]
        for d in node.all_input_nodes:
            if d not in members and d.name not in inputs:
                inputs.append(d.name)
        if any(u not in members for u in node.users) and node.name not in outputs:
            outputs.append(node.name)
    return inputs, outputs


def feeding(anchor: torch.fx.Node, inside: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of ``inside`` that ``anchor`` reads, directly or through others of
    ``inside`` (the views feeding a library call); ``anchor`` excluded."""
    found: set[torch.fx.Node] = set()
    stack = [anchor]
    while stack:
        for d in stack.pop().all_input_nodes:
            if d in inside and d not in found:
                found.add(d)
                stack.append(d)
    return found


def split_anchor(gm: torch.fx.GraphModule, region: Region,
                 anchor_ops: frozenset) -> tuple[Region, Region] | None:
    """Cut a gemm/conv region into its library call (the anchor op and the views that
    feed it) and its epilogue (everything after), as two regions whose boundaries are
    computed against the whole graph. None when there is no epilogue."""
    nodes = {n.name: n for n in gm.graph.nodes}
    anchor = next((n for n in region.nodes if nodes[n].target in anchor_ops), None)
    if anchor is None:
        return None
    feeds = {d.name for d in feeding(nodes[anchor], {nodes[n] for n in region.nodes})}
    head = [n for n in region.nodes if n == anchor or n in feeds]
    tail = [n for n in region.nodes if n not in head]
    if not tail:
        return None
    parts = []
    for i, (names, kind) in enumerate(((head, region.kind), (tail, RegionKind.FUSED))):
        inputs, outputs = boundary(gm, names)
        parts.append(Region(id=region.id * 1000 + i, kind=kind, nodes=names,
                            ops=[str(nodes[n].target) for n in names], inputs=inputs,
                            outputs=outputs))
    return parts[0], parts[1]
