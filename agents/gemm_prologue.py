"""The Coder's candidates for a bmm region that opens with copies of its operands (the
Planner moved them there: ``prologue_moves.copies_into_products``).

The template: a generated kernel for the copies (the prologue), ATen's bmm, the
epilogue's kernels, which costs what the copies' own region did before the move. The
alternative (``heads_alternative``): per-head cuBLASLt calls that read the operands
where the copies read them and write the result in its final layout
(``stitch_backend.lt_heads``), no copy at all; the Verifier races the two.
"""

from __future__ import annotations

from typing import Any

import torch

from stitch_backend.opclass import GEMM_OPS, OpClass, classify
from stitch_backend.regions import feeding, region_module, split_anchor

from .state import Candidate, Stage, Subtask

aten = torch.ops.aten


def prologue_names(gm: torch.fx.GraphModule, region: Any) -> list[str]:
    """The region's copies that feed its one bmm, and the nodes of the region that feed
    them, in region order; [] where there are none."""
    nodes = {n.name: n for n in gm.graph.nodes}
    anchors = [nodes[n] for n in region.nodes if nodes[n].target is aten.bmm.default]
    if len(anchors) != 1:
        return []
    members = {nodes[n] for n in region.nodes}
    clones = [n for n in feeding(anchors[0], members) if n.target is aten.clone.default]
    pro: set = set(clones)
    for c in clones:
        pro |= feeding(c, members)
    return [n for n in region.nodes if nodes[n] in pro]


def propose(coder: Any, subtask: Subtask, pro: list[str]) -> Candidate:
    """The template candidate (prologue kernel, library call, epilogue kernels), with the
    per-head cuBLASLt alternative where it applies. NoCandidate where the copies do not
    generate."""
    from .coder import NoCandidate, sub_region

    gm, region = subtask.graph, subtask.region
    nodes = {n.name: n for n in gm.graph.nodes}
    stages = coder._kernel_stages(subtask, pro, "prologue", prefix=f"{subtask.region_name}_in",
                                  id_base=600)
    taken = set(pro)
    rest = [n for n in region.nodes if n not in taken]
    parts = split_anchor(gm, sub_region(gm, rest, subtask.region_id, 650), GEMM_OPS)
    if parts is None or all(classify(nodes[n]) is OpClass.VIEW for n in parts[1].nodes):
        library = sub_region(gm, rest, subtask.region_id, 660)
        stages.append(Stage(library, module=region_module(gm, library)))
    else:
        head = sub_region(gm, parts[0].nodes, subtask.region_id, 660)
        stages.append(Stage(head, module=region_module(gm, head)))
        stages += coder._epilogue_stages(subtask, parts[1])
    if not any(s.kernel is not None for s in stages):
        raise NoCandidate("the copies before the bmm do not generate: ATen runs the region")
    cand = coder._candidate(subtask, subtask.region_name, stages, list(region.outputs))
    alt = heads_alternative(coder, subtask)
    if alt is not None:
        cand.alternatives.append(alt)
    return cand


def heads_alternative(coder: Any, subtask: Subtask) -> Candidate | None:
    """The region as one ``lt_bmm_heads`` call on its inputs (``lt_heads.heads_pattern``);
    None where the pattern does not hold or cuBLASLt cannot run it (not CUDA, unless the
    Coder builds library candidates on CPU for tests)."""
    from stitch_backend.lt_heads import heads_pattern, lt_bmm_heads

    from .coder import sub_region

    gm, region = subtask.graph, subtask.region
    nodes = {n.name: n for n in gm.graph.nodes}
    members = {nodes[n] for n in region.nodes}
    anchors = [n for n in members if n.target is aten.bmm.default]
    if len(anchors) != 1:
        return None
    pat = heads_pattern(anchors[0], members, set(region.inputs), list(region.outputs))
    val = anchors[0].meta.get("val")
    if pat is None or not isinstance(val, torch.Tensor) or (
            val.device.type != "cuda" and not coder.library_on_cpu):
        return None
    sub = sub_region(gm, list(region.nodes), subtask.region_id, 800)
    module = region_module(gm, sub)
    graph = module.graph
    local = {n.name: n for n in graph.nodes}
    out = graph.output_node()
    with graph.inserting_before(out):
        call = graph.call_function(lt_bmm_heads, (local[pat.a.name], local[pat.b.name],
                                                  list(pat.perm), list(pat.shape)))
    call.meta = dict(local[pat.output.name].meta)
    out.args = ((call,),)
    graph.eliminate_dead_code()
    graph.lint()
    p, q = pat.a.meta["val"].shape[:2]
    name = f"{subtask.region_name}_lt"
    header = (f"// {name}: bmm as {min(p, q)} cuBLASLt calls batched over {max(p, q)}, "
              f"reading {pat.a.name} and {pat.b.name} in place, writing the result "
              f"permuted {tuple(pat.perm)} as {tuple(pat.shape)} {val.dtype}\n")
    return coder._graph_candidate(subtask, name, header, sub, module, graph, library=True)


__all__ = ["heads_alternative", "prologue_names", "propose"]
