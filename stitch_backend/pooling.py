"""Pooling over disjoint windows as a reduction the Coder generates.

``max_pool2d_with_indices(x, k, stride=k)`` without padding, dilation or ceil mode,
whose indices nobody reads (inference, and training graphs that do not save them), is
``x.view(N, C, H/k, k, W/k, k).amax((3, 5))`` (of ``x.permute(0, 2, 3, 1)`` when ``x``
is channels-last): the same values (both propagate NaN),
and an ``amax`` the Planner can fuse with what produces and consumes it; likewise
``avg_pool2d`` (no padding, ceil mode or divisor override) is the ``mean`` of that
view. ATen's pooling op is a fallback region otherwise: on the H200, L3 RegNet's three
2x2 max poolings took 0.14 ms of a 1.4 ms call.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .regions import inherit_source, rewritable_copy

aten = torch.ops.aten
# meta key of the amax/mean a pooling became: the Planner lets a convolution region's
# epilogue take it (the pooled kernel reads the epilogue's values as it computes them)
POOLING = "stitch_pooling"
MAX_POOL = aten.max_pool2d_with_indices.default
AVG_POOL = aten.avg_pool2d.default
# the arguments after the input, in schema order
_ARGS = {MAX_POOL: ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
         AVG_POOL: ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                    "divisor_override")}


def _window(node: torch.fx.Node) -> tuple[int, int] | None:
    """(kh, kw) where ``node`` pools disjoint windows that tile its input exactly (and,
    for max pooling, only its values are used); None otherwise."""
    if node.op != "call_function" or node.target not in _ARGS:
        return None
    args = dict(zip(_ARGS[node.target], node.args[1:]))
    args.update(node.kwargs)
    pair = lambda v: [v, v] if isinstance(v, int) else (list(v) * 2 if len(v) == 1 else list(v))
    kernel = pair(args["kernel_size"])
    stride = pair(args.get("stride") or kernel)
    if (stride != kernel or pair(args.get("padding", 0)) != [0, 0]
            or pair(args.get("dilation", 1)) != [1, 1] or args.get("ceil_mode", False)
            or args.get("divisor_override") is not None):
        return None
    if node.target is MAX_POOL and any(
            u.op != "call_function" or u.target is not operator.getitem or u.args[1] != 0
            for u in node.users):
        return None
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        return None
    if not all(type(s) is int for s in x.shape):     # symbolic sizes: left to ATen
        return None
    h, w = x.shape[2], x.shape[3]
    if h % kernel[0] or w % kernel[1]:
        return None
    return kernel[0], kernel[1]


def pools_as_reductions(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with each eligible pooling rewritten as a view and an ``amax`` or ``mean``
    (a new module; ``gm`` is not changed), and how many; ``gm`` itself when none."""
    copied = rewritable_copy(gm, lambda n: _window(n) is not None)
    if copied is None:
        return gm, 0
    new, mode = copied
    graph = new.graph
    done = 0
    for node in list(graph.nodes):
        window = _window(node)
        if window is None:
            continue
        kh, kw = window
        x = node.args[0]
        xv = x.meta["val"]
        n, c, h, w = xv.shape
        reduce = aten.amax.default if node.target is MAX_POOL else aten.mean.dim
        # A channels-last input (the layout pass ran first) is pooled as (N, H, W, C):
        # the reduction reads and writes with C contiguous and the result keeps the
        # channels-last strides ATen's pooling would give it. Pooled as (N, C, H, W),
        # its result would be NCHW: a transposing write (on the H200, L2 35's pooling
        # region took 2.4 ms against Inductor's 0.32 ms).
        channels_last = not xv.is_contiguous() and xv.is_contiguous(
            memory_format=torch.channels_last)
        with graph.inserting_before(node):
            if channels_last:
                nhwc = graph.call_function(aten.permute.default, (x, [0, 2, 3, 1]))
                shape = [n, h // kh, kh, w // kw, kw, c]
                view = graph.call_function(aten.view.default, (nhwc, shape))
                reduced = graph.call_function(reduce, (view, [2, 4]))
                pooled = graph.call_function(aten.permute.default, (reduced, [0, 3, 1, 2]))
                new_nodes = [nhwc, view, reduced, pooled]
            else:
                shape = [n, c, h // kh, kh, w // kw, kw]
                view = graph.call_function(aten.view.default, (x, shape))
                pooled = graph.call_function(reduce, (view, [3, 5]))
                new_nodes = [view, pooled]
        with mode:
            val = xv
            for nd in new_nodes:
                val = nd.target(val, *nd.args[1:])
                nd.meta["val"] = val
                if nd.target is reduce:
                    nd.meta[POOLING] = True
        inherit_source(node, *new_nodes)
        if node.target is MAX_POOL:
            for user in list(node.users):
                user.replace_all_uses_with(pooled)
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(pooled)
        graph.erase_node(node)
        if channels_last:
            _before_the_permute(graph, reduced, pooled, mode)
        done += 1
    graph.lint()
    new.recompile()
    return new, done


def _before_the_permute(graph: torch.fx.Graph, reduced: torch.fx.Node, pooled: torch.fx.Node,
                        mode) -> None:
    """Pointwise ops that read nothing but the pooled value (and values computed only from
    it, a Mish say) run on its (N, H, W, C) form, before the permute back to (N, C, H, W):
    the same values with the same strides, and the pooling's kernel can then compute them
    on the rows it reduced (after the permute, a kernel would read the reduction at
    other rows than its own, which the fused template cannot)."""
    from .opclass import SHAPED_COPY_OPS, OpClass, classify

    cone: list[torch.fx.Node] = []
    members = {pooled}
    for nd in graph.nodes:
        if nd.op != "call_function" or nd.kwargs or nd in members:
            continue
        inputs = nd.all_input_nodes
        if inputs and all(i in members for i in inputs) and classify(nd) is OpClass.POINTWISE \
                and nd.target not in SHAPED_COPY_OPS:
            members.add(nd)
            cone.append(nd)
    if not cone:
        return
    nhwc = {pooled: reduced}
    for nd in cone:
        with graph.inserting_before(nd):
            moved = graph.node_copy(nd, lambda a: nhwc.get(a, a))
            back = graph.call_function(aten.permute.default, (moved, [0, 3, 1, 2]))
        with mode:
            moved.meta["val"] = moved.target(*torch.fx.node.map_arg(
                moved.args, lambda a: a.meta["val"]))
            back.meta["val"] = back.target(moved.meta["val"], [0, 3, 1, 2])
        inherit_source(nd, moved, back)
        nhwc[nd] = nhwc[back] = moved   # later members read ``back`` once ``nd`` is replaced
        nd.replace_all_uses_with(back)
    for nd in reversed(cone):       # the originals, and permutes only they read
        graph.erase_node(nd)
    moved_nodes = set(nhwc.values())
    for nd in list(graph.nodes):
        if nd.target is aten.permute.default and not nd.users and nd.args[0] in moved_nodes:
            graph.erase_node(nd)


__all__ = ["POOLING", "pools_as_reductions"]
