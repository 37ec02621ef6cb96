"""The cuBLASLt alternatives of gemm regions (``stitch_backend.lt_ops``): the product
and what follows it (bias, relu, tanh-GELU, a residual as C) as one library call, the
rest of the epilogue as usual; a gemm with nothing to fuse as the call alone; a Linear's
weight and bias gradients as one BGRADB call. Proposed by the template Coder beside its
own candidate; the Verifier keeps what is correct and faster."""

from __future__ import annotations

import operator
from typing import Any

import torch

from stitch_backend.ir import Region
from stitch_backend.opclass import OpClass, classify
from stitch_backend.regions import region_module

from .state import Candidate, Stage, Subtask

aten = torch.ops.aten


def alternative(coder: Any, subtask: Subtask, head: Region, part: Region) -> Candidate | None:
    """cuBLASLt's fused epilogue (``stitch_backend.lt_ops``) for a 2-D addmm/mm whose
    only user opens the epilogue (directly, or through the one view a Linear on 3-D
    input adds) with a relu or tanh-gelu, or, after an mm, with the add of a bias row
    (a Linear on 3-D input: mm, view, add), itself perhaps followed by one of those
    activations; or whose value (or view) feeds tanh-gelu written out
    (``lt_ops.tanh_gelu_chain``); or the add of a residual (``lt_ops.residual_chain``,
    cuBLASLt's C): one library call for them, then the rest of the epilogue as usual.
    None where that does not apply."""
    from stitch_backend import lt_ops

    from .coder import sub_region

    gm = subtask.graph
    nodes = {n.name: n for n in gm.graph.nodes}
    mm = _anchor(coder, nodes, head.nodes)
    if mm is None:
        return None
    val = mm.meta["val"]
    views = (aten.view.default, aten._unsafe_view.default)
    view = None
    if len(mm.users) == 1 and next(iter(mm.users)).target in views:
        view = next(iter(mm.users))    # a Linear on 3-D input: (B*T, N) -> (B, T, N)
    compute = [n for n in part.nodes if classify(nodes[n]) is not OpClass.VIEW]
    chain, bias, activation = [], None, None
    first = lt_ops.only_user(view or mm)
    if first is not None:
        chain, bias = lt_ops.lt_chain(mm, view or mm, first, compute)
        activation = lt_ops.activation_epilogue(chain[-1]) if chain else None
    if not chain:     # tanh-GELU written out (GPT-2's NewGELU), cuBLASLt's GELU
        chain = lt_ops.tanh_gelu_chain(view or mm, compute)
        activation = "GELU" if chain else None
    residual = None
    if not chain:     # a residual added to the product: cuBLASLt's C
        chain, residual = lt_ops.residual_chain(view or mm, compute,
                                                set(subtask.region.inputs))
    if not chain:
        return None
    act = chain[-1]
    has_bias = mm.target is aten.addmm.default or bias is not None
    epilogue = lt_ops.epilogue_name(activation, has_bias)
    taken = [view.name] if view is not None else []
    sub = sub_region(gm, list(head.nodes) + taken + [n.name for n in chain],
                     subtask.region_id, 800)
    module = region_module(gm, sub)
    graph = module.graph
    local = {n.name: n for n in graph.nodes}
    l_mm, l_act = local[mm.name], local[act.name]
    with graph.inserting_before(l_act):
        call = lt_ops.lt_call(graph, l_mm, local[bias.name] if bias is not None else None,
                              epilogue,
                              local[residual.name] if residual is not None else None)
        result = call
        if view is not None:
            l_view = local[view.name]
            result = graph.call_function(l_view.target, (call, *l_view.args[1:]))
            result.meta = dict(l_act.meta)
    l_act.replace_all_uses_with(result)
    for n in reversed(chain):
        graph.erase_node(local[n.name])
    if view is not None:
        graph.erase_node(local[view.name])
    graph.erase_node(l_mm)
    graph.lint()
    stages = [Stage(sub, module=torch.fx.GraphModule(module, graph,
                                                     class_name=f"{subtask.region_name}_lt"))]
    stages += coder.rest_stages(subtask, part, set(taken) | {n.name for n in chain}, 801)
    header = (f"// {subtask.region_name}_lt: cuBLASLt {mm.target}"
              f"{' + bias' if has_bias else ''}"
              f"{' + residual (C, beta 1)' if residual is not None else ''} with epilogue {epilogue} "
              f"({', '.join(str(n.target) for n in chain)}), "
              f"{tuple(val.shape)} {val.dtype}\n")
    return coder.headed_candidate(subtask, f"{subtask.region_name}_lt", header, stages)


def bias_grad(coder: Any, subtask: Subtask) -> Candidate | None:
    """A Linear's weight and bias gradients (``mm(t(g), x)`` and ``sum(g, [0])``, which
    the Planner puts in one region: ``planner.bias_grad_pair``) as one cuBLASLt call
    with the BGRADB epilogue (``lt_ops.lt_mm_bgrad``): ``g`` is read once. Both
    operands row-major; None where that does not apply."""
    from stitch_backend import lt_ops

    from .coder import sub_region

    from .planner import bias_grad_pair

    gm = subtask.graph
    nodes = {n.name: n for n in gm.graph.nodes}
    pair = bias_grad_pair([nodes[n] for n in subtask.region.nodes])
    if pair is None or not can_run(coder, pair[0]):
        return None
    mm, total, g = pair
    x = mm.args[1]
    gv = g.meta.get("val")
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if (not isinstance(xv, torch.Tensor) or xv.dim() != 2 or xv.dtype != gv.dtype
            or not gv.is_contiguous() or not xv.is_contiguous()):
        return None
    name = f"{subtask.region_name}_bg"
    sub = sub_region(gm, list(subtask.region.nodes), subtask.region_id, 820)
    module = region_module(gm, sub)
    graph = module.graph
    local = {n.name: n for n in graph.nodes}
    l_mm, l_sum = local[mm.name], local[total.name]
    first = next(n for n in graph.nodes if n in (l_mm, l_sum))
    if first is l_sum and local[x.name].op != "placeholder":
        return None     # x computed in the region after the sum: no place for the call
    with graph.inserting_before(first):
        call = graph.call_function(lt_ops.lt_mm_bgrad, (local[g.name], local[x.name]))
        product = graph.call_function(operator.getitem, (call, 0))
        product.meta = dict(l_mm.meta)
        db = graph.call_function(operator.getitem, (call, 1))
        sums = graph.call_function(aten.view.default,
                                   (db, list(total.meta["val"].shape)))
        sums.meta = dict(l_sum.meta)
    l_mm.replace_all_uses_with(product)
    l_sum.replace_all_uses_with(sums)
    graph.erase_node(l_mm)
    graph.erase_node(l_sum)
    graph.eliminate_dead_code()
    graph.lint()
    header = (f"// {name}: cuBLASLt mm with epilogue BGRADB (the weight gradient and "
              f"sum(g, 0), the bias gradient, in one call), "
              f"{tuple(mm.meta['val'].shape)} {mm.meta['val'].dtype}\n")
    return coder._graph_candidate(subtask, name, header, sub, module, graph)


def can_run(coder: Any, mm: torch.fx.Node) -> bool:
    """Whether cuBLASLt can compute 2-D ``mm`` (an addmm's bias a row of N)."""
    from stitch_backend import lt_ops

    val = mm.meta.get("val")
    if (not isinstance(val, torch.Tensor) or val.dim() != 2 or val.dtype not in lt_ops.DTYPES
            or (val.device.type != "cuda" and not coder.library_on_cpu) or mm.kwargs
            or any(isinstance(s, torch.SymInt) for s in val.shape)):
        return False
    if mm.target is aten.addmm.default:
        bias = mm.args[0].meta.get("val") if isinstance(mm.args[0], torch.fx.Node) else None
        return (len(mm.args) == 3 and isinstance(bias, torch.Tensor) and bias.dim() == 1
                and bias.shape[0] == val.shape[1])
    return True

def _anchor(coder: Any, nodes: dict[str, torch.fx.Node], names: list[str]
               ) -> torch.fx.Node | None:
    """The one addmm/mm among ``names`` when cuBLASLt can run it, else None."""
    anchors = [nodes[n] for n in names
               if nodes[n].target in (aten.addmm.default, aten.mm.default)]
    if len(anchors) != 1 or not can_run(coder, anchors[0]):
        return None
    return anchors[0]

def plain(coder: Any, subtask: Subtask) -> Candidate | None:
    """A gemm region with no epilogue (or views alone after it) as one cuBLASLt call
    (``lt_ops``; an addmm's bias in its BIAS epilogue), whose algorithm the first call
    times among the heuristics' best: raced against ATen's call by the Verifier. None
    where cuBLASLt cannot run it (then ATen's library call is the implementation)."""
    from stitch_backend import lt_ops

    from .coder import sub_region

    gm = subtask.graph
    mm = _anchor(coder, {n.name: n for n in gm.graph.nodes}, subtask.region.nodes)
    if mm is None:
        return None
    epilogue = lt_ops.epilogue_name(None, mm.target is aten.addmm.default)
    sub = sub_region(gm, list(subtask.region.nodes), subtask.region_id, 800)
    module = region_module(gm, sub)
    graph = module.graph
    l_mm = next(n for n in graph.nodes if n.name == mm.name)
    with graph.inserting_before(l_mm):
        call = lt_ops.lt_call(graph, l_mm, None, epilogue)
    l_mm.replace_all_uses_with(call)
    graph.erase_node(l_mm)
    graph.lint()
    name = f"{subtask.region_name}_lt"
    header = (f"// {name}: cuBLASLt {mm.target}{' + bias' if epilogue == 'BIAS' else ''} "
              f"with epilogue {epilogue}, algorithm timed at the first "
              f"call, {tuple(mm.meta['val'].shape)} {mm.meta['val'].dtype}\n")
    return coder._graph_candidate(subtask, name, header, sub, module, graph, library=True)


__all__ = ["alternative", "bias_grad", "can_run", "plain"]
