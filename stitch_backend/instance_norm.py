"""Instance norm as the layout pass meets it, and its rewrite over the value's own dims.

Instance norm reaches the graph as BatchNorm over a (1, N*C, ...) view of a value of
sizes (N, C, ...). That view cannot be expressed over channels-last strides, so the
layout pass (``layout``) would give it the traced layout first. Where the norm is an
inference one whose result alone is read back through one view, ``unmerge_instance_norms``
computes it instead as ``var_mean`` over the value's trailing dims plus its affine map,
which any layout expresses.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .regions import inherit_source

aten = torch.ops.aten

VIEWS = frozenset({aten.view.default, aten._unsafe_view.default})


def merges_batch_into_channels(x: torch.fx.Node) -> bool:
    """Whether ``x`` is a view of a value of sizes (N, C, ...) as (1, N*C, ...), as
    instance norm runs BatchNorm. That view cannot be expressed over channels-last
    strides, so the pass gives it the traced layout first: one more pass over the
    convolution's output. On the H200 (KernelBench L2 17, Conv2d then InstanceNorm2d over
    126x126 positions, one bench run each) the Program ran 4.069 ms kept NCHW and 4.557
    ms NHWC (its convolution region, conversion included, 2.72 ms against 2.36), so
    ``auto`` declines such graphs. A forced rewrite now removes that conversion where
    ``unmerge_instance_norms`` applies; that form has not been timed on the GPU."""
    if x.op != "call_function" or x.target not in VIEWS or not isinstance(x.args[0], torch.fx.Node):
        return False
    src, out = x.args[0].meta.get("val"), x.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.dim() == out.dim() and out.shape[0] == 1
            and src.shape[0] * src.shape[1] == out.shape[1] and src.shape[2:] == out.shape[2:])


def instance_norm_parts(bn: torch.fx.Node) -> tuple | None:
    """(source, back view, weight, bias, eps) where the training BatchNorm ``bn`` is an
    inference instance norm that can be computed over its source's own dims: BatchNorm
    over a (1, N*C, ...) view of a float32/float64 value, no running statistics, only
    its result read, and that only through one view back to the source's sizes; weight
    and bias absent or ``repeat``s of (C,) parameters. None where any of that fails."""
    if bn.target is aten._native_batch_norm_legit.no_stats:
        view, w, b, _, _, eps = bn.args
    elif bn.target is aten.native_batch_norm.default and bn.args[3] is None and bn.args[4] is None:
        view, w, b, eps = bn.args[0], bn.args[1], bn.args[2], bn.args[7]
    else:
        return None
    if not isinstance(view, torch.fx.Node) or not merges_batch_into_channels(view):
        return None
    src = view.args[0]
    x = src.meta["val"]
    if x.dtype not in (torch.float32, torch.float64) or len(view.users) != 1:
        return None
    items = list(bn.users)
    if not all(u.target is operator.getitem for u in items):
        return None
    used = [u for u in items if u.users]
    if len(used) != 1 or used[0].args[1] != 0 or len(used[0].users) != 1:
        return None
    (back,) = used[0].users
    if back.target not in VIEWS or tuple(back.meta["val"].shape) != tuple(x.shape):
        return None
    params = []
    for p in (w, b):
        if p is None:
            params.append(None)
        elif (isinstance(p, torch.fx.Node) and p.target is aten.repeat.default
                and tuple(p.args[1]) == (x.shape[0],)
                and tuple(p.args[0].meta["val"].shape) == (x.shape[1],)):
            params.append(p.args[0])
        else:
            return None
    return src, back, params[0], params[1], float(eps)


def unmerge_instance_norms(gm: torch.fx.GraphModule, mode) -> int:
    """Rewrite every instance norm of ``instance_norm_parts`` as statistics over its
    source's trailing dims (``var_mean``, then the normalisation and affine map), which
    any layout can express: the (1, N*C, ...) view needed the traced one, so a
    channels-last graph converted the convolution's output before it. New nodes get
    their ``meta["val"]`` under ``mode``. Returns how many were rewritten."""
    graph = gm.graph
    count = 0
    for bn in list(graph.nodes):
        if bn.op != "call_function":
            continue
        parts = instance_norm_parts(bn)
        if parts is None:
            continue
        src, back, w, b, eps = parts
        x = src.meta["val"]
        dims = list(range(2, x.dim()))
        channel = [1, x.shape[1]] + [1] * (x.dim() - 2)

        def call(target, *args, **kwargs):
            node = graph.call_function(target, args, kwargs)
            vals = torch.fx.node.map_aggregate(
                (args, kwargs), lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a)
            with mode:
                node.meta["val"] = target(*vals[0], **vals[1])
            inherit_source(bn, node)
            return node

        with graph.inserting_before(bn):
            stats = call(aten.var_mean.correction, src, dims, correction=0, keepdim=True)
            var, mean = call(operator.getitem, stats, 0), call(operator.getitem, stats, 1)
            rstd = call(aten.rsqrt.default, call(aten.add.Tensor, var, eps))
            y = call(aten.mul.Tensor, call(aten.sub.Tensor, src, mean), rstd)
            if w is not None:
                y = call(aten.mul.Tensor, y, call(aten.view.default, w, channel))
            if b is not None:
                y = call(aten.add.Tensor, y, call(aten.view.default, b, channel))
        back.replace_all_uses_with(y)
        view = bn.args[0]
        repeats = [a for a in bn.args[1:3] if isinstance(a, torch.fx.Node)]
        for node in [back, *[g for g in bn.users if g is not back], bn, view, *repeats]:
            if not node.users:
                graph.erase_node(node)
        count += 1
    return count
