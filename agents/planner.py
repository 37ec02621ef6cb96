"""The Planner: partitions one ATen graph into regions (DESIGN.md's region kinds).

The partition is deterministic and greedy, in graph order:

* a gemm / conv / attention node opens a region of its kind; the pointwise chain that
  follows a gemm or conv (same element count as the product, consuming it) is attached
  as its epilogue; a conv also takes a following batch norm and a pooling's amax/mean
  (then pointwise ops of the pooled size); a gemm's pointwise
  epilogue that one later fused region alone consumes moves into that region (no pass
  of its own over the product); a conv's training batch norm that one later conv region
  with a batch norm of the same shape alone consumes (a residual block's two branches)
  moves into that region;
* pointwise, reduction and normalisation nodes join the open fused region when they
  consume a value it produces; a pointwise node with no fused producer joins a fused
  region that reads the value it reads, of its size (``siblings.may_join``: the softmax
  of an attention's scores and its check of masked rows; without ``defer_roots``, a
  graph input read by both counts too); else it opens a new one;
* in backward, a Linear's bias gradient ``sum(g, [0])`` joins the gemm region of its
  weight gradient ``mm(t(g), x)`` (one cuBLASLt BGRADB call can compute both);
* views and ``getitem``s move no data: they join the region of their producer when that
  region is still open, else the region of their first consumer;
* a layout conversion the channels-last pass inserted is a fused region of its own;
* random ops, in-place ops and everything else are fallback regions (one per node,
  consecutive host-side size arithmetic grouped) with the reason in words.

A factory node with no inputs (``scalar_tensor``) waits for its first fused consumer
and joins that region, as a view does. With ``defer_roots`` (the ``fuse_roots`` option,
experimental), any pointwise or factory
node that reads only graph inputs (a "root": ``log(predictions)``, ``targets == 0``,
``scalar_tensor``) does not open a region of its own: like a view it waits for its first
fused consumer and joins that region (KLDiv's loss is then one region instead of six).
A root that a library call or a fallback consumes gets a fused region of its own first.

Because regions are built in graph order and a node only ever joins a region at or
after its inputs' regions, executing the regions in list order is valid, and random ops
keep eager's relative order (so a seeded run draws the same numbers).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from stitch_backend.ir import Plan, Region, RegionKind
from stitch_backend.layout import CONVERSION as LAYOUT_CONVERSION
from stitch_backend.pooling import POOLING
from stitch_backend.opclass import POOL_OPS, OpClass, classify, fallback_reason, op_name
from stitch_backend.regions import boundary, feeding

from stitch_backend.agents.prologue_moves import copies_into_products
from stitch_backend.agents.epilogue_moves import (absorb_split_epilogues, defer_epilogues,
                                                    move_to_sole_reader)
from stitch_backend.agents.siblings import bases, may_join, numel as _numel, same_numel

log = logging.getLogger("stitch_backend.agents.planner")

aten = torch.ops.aten

_FUSIBLE = {OpClass.POINTWISE, OpClass.REDUCTION, OpClass.NORM, OpClass.FACTORY,
            OpClass.GATHER}
_ANCHOR_KIND = {OpClass.GEMM: RegionKind.GEMM, OpClass.CONV: RegionKind.CONV,
                OpClass.ATTENTION: RegionKind.ATTENTION}
# Batch norms a convolution region may absorb (eval-mode folding, training epilogue).
_CONV_EPILOGUE_NORMS = {
    "aten._native_batch_norm_legit_no_training.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten._native_batch_norm_legit.default",
}


@dataclass
class _Open:
    kind: RegionKind
    nodes: list[torch.fx.Node] = field(default_factory=list)
    anchor_numel: object = None  # element count of a gemm/conv product
    reason: str | None = None
    symbolic: bool = False


def partition(gm: torch.fx.GraphModule, graph_name: str = "graph", *,
              defer_roots: bool = False) -> Plan:
    """Partition every compute node of ``gm`` into exactly one region, in execution order."""
    regions: list[_Open] = []
    region_of: dict[torch.fx.Node, int] = {}
    pending_free: list[torch.fx.Node] = []  # views (and deferred roots) awaiting a consumer
    deferred: set[torch.fx.Node] = set()    # the deferred roots among them
    current: _Open | None = None

    def open_region(kind: RegionKind, *, make_current: bool = True, **kw) -> _Open:
        nonlocal current
        region = _Open(kind=kind, **kw)
        regions.append(region)
        if make_current:
            current = region
        return region

    def add(node: torch.fx.Node, region: _Open) -> None:
        # Free nodes this node consumes travel with it (a strided load, or a view that
        # feeds the library call).
        for dep in _pending_deps(node):
            if dep in pending_free:   # not already taken by an earlier dep's own deps
                pending_free.remove(dep)
                add(dep, region)
        region.nodes.append(node)
        region_of[node] = regions.index(region)

    def _pending_deps(node: torch.fx.Node) -> list[torch.fx.Node]:
        return [d for d in node.all_input_nodes if d in pending_free]

    def flush_roots(node: torch.fx.Node) -> None:
        """Deferred roots ``node`` reads (through pending views) get fused regions of
        their own, so a library call or a fallback receives them computed."""
        stack = _pending_deps(node)
        while stack:
            dep = stack.pop()
            if dep not in pending_free:
                continue
            if dep in deferred:
                pending_free.remove(dep)
                add(dep, open_region(RegionKind.FUSED, make_current=False))
            else:
                stack.extend(_pending_deps(dep))

    def consumes_current(node: torch.fx.Node) -> bool:
        if current is None:
            return False
        idx = regions.index(current)
        for d in node.all_input_nodes:
            if region_of.get(d) == idx:
                return True
            if d in pending_free and any(region_of.get(x) == idx for x in d.all_input_nodes):
                return True
        return False

    def _producers(node: torch.fx.Node) -> list[int]:
        """Indices of the regions producing ``node``'s inputs (through pending views)."""
        found: list[int] = []
        stack = list(node.all_input_nodes)
        while stack:
            d = stack.pop()
            if d in pending_free:
                stack.extend(d.all_input_nodes)
            elif d in region_of:
                found.append(region_of[d])
        return found or [-1]

    def _fused_target(node: torch.fx.Node) -> int | None:
        """The latest fused region producing one of ``node``'s inputs, if every input of
        ``node`` is available there (so joining it keeps list order executable)."""
        producers = [p for p in _producers(node) if p >= 0]
        fused = [p for p in producers if regions[p].kind is RegionKind.FUSED]
        if not fused:
            return _sibling_target(node, producers)
        target = max(fused)
        if max(producers) > target:
            return None
        host = _root_host(node, producers, fused)
        return target if host is None else host

    def _root_host(node: torch.fx.Node, producers: list[int], fused: list[int]) -> int | None:
        """Where ``node`` reads the newest region, of ops on graph inputs alone (a
        cross entropy's ``target != ignore_index``), and an older fused region (its
        log_softmax): the newest folds into the older one, which ``node`` then joins.
        Its ops need nothing the older region lacks, so they may run there; without
        this, the log_softmax is stored whole for a gather to read one value a row."""
        last = len(regions) - 1
        if classify(node) is OpClass.VIEW or fused.count(last) == len(fused) \
                or max(fused) != last or not _reads_inputs_only(regions[last]):
            return None
        host = max(p for p in fused if p != last)
        if max(p for p in producers if p != last) > host:
            return None
        nonlocal current
        absorbed = regions.pop()
        for n in absorbed.nodes:
            region_of[n] = host
        regions[host].nodes += absorbed.nodes
        if current is absorbed:
            current = regions[host]
        return host

    def _sibling_target(node: torch.fx.Node, producers: list[int]) -> int | None:
        """The latest fused region that ``node`` can run beside (``siblings.may_join``):
        one that reads a value ``node`` reads, and comes after every region ``node`` reads
        from."""
        if classify(node) is not OpClass.POINTWISE:
            return None
        # roots (ops reading only graph inputs) share their graph inputs where they are
        # not deferred to their consumer instead (``siblings`` module docstring)
        inputs = not defer_roots
        mine = bases(node, inputs)
        for idx in range(len(regions) - 1, max(producers, default=0) - 1, -1):
            region = regions[idx]
            if region.kind is RegionKind.FUSED and may_join(node, region) and any(
                    mine & bases(n, inputs) for n in region.nodes):
                return idx
        return None

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        cls = classify(node)

        if cls is OpClass.VIEW:
            producers = [region_of[d] for d in node.all_input_nodes if d in region_of]
            if current is not None and producers and max(producers) == regions.index(current) \
                    and current.kind is not RegionKind.FALLBACK:
                add(node, current)
            elif producers and (node.target is operator.getitem
                                or all(u.op == "output" for u in node.users)):
                # getitem of a multi-output op always lives with its producer, and so
                # does a view that only the graph output reads.
                region = regions[max(producers)]
                region.nodes.append(node)
                region_of[node] = max(producers)
            else:
                pending_free.append(node)
            continue

        if cls in _ANCHOR_KIND:
            flush_roots(node)
            region = open_region(_ANCHOR_KIND[cls], anchor_numel=_numel(node))
            add(node, region)
            continue

        if cls in _FUSIBLE and node.meta.get(LAYOUT_CONVERSION):
            # A layout conversion is a region of its own (see stitch_backend.layout),
            # unless it ends a convolution whose epilogue is pointwise, or a fused region
            # of pointwise ops: the kernel then writes the traced layout itself through
            # the tiled template.
            if _pointwise_tail(node, current) and consumes_current(node) \
                    and max(_producers(node)) <= regions.index(current):
                add(node, current)
            else:
                add(node, open_region(RegionKind.FUSED, make_current=False))
            continue

        if cls in _FUSIBLE:
            if current is not None and current.kind in (RegionKind.GEMM, RegionKind.CONV) \
                    and _is_epilogue(node, cls, current) and consumes_current(node) \
                    and max(_producers(node)) <= regions.index(current):
                add(node, current)
                if cls is OpClass.REDUCTION:   # a pooling: what follows is of its size
                    val = node.meta.get("val")  # (values, indices) of a max pooling
                    current.anchor_numel = _numel(node) if not isinstance(val, tuple) else (
                        val[0].numel())
                continue
            target = _fused_target(node)
            if target is not None:
                add(node, regions[target])
                continue
            # A factory with no inputs at all (the ``scalar_tensor`` of a logsumexp's or
            # masked softmax's ``where``) always waits for its consumer: opening a region
            # of its own, it would cut the consumer off from the region it belongs to.
            if (defer_roots and cls in (OpClass.POINTWISE, OpClass.FACTORY)
                    and _producers(node) == [-1]) or (
                        cls is OpClass.FACTORY and not node.all_input_nodes):
                pending_free.append(node)
                deferred.add(node)
                continue
            # A fused op unrelated to an open gemm/conv (say the BatchNorm step counter
            # between a conv and its BatchNorm) must not cut that region's epilogue off.
            keep_anchor = current is not None and current.kind in (
                RegionKind.GEMM, RegionKind.CONV) and not consumes_current(node)
            add(node, open_region(RegionKind.FUSED, make_current=not keep_anchor))
            continue

        flush_roots(node)
        if cls is OpClass.SYMBOLIC and current is not None and current.symbolic:
            add(node, current)
            continue
        reason = fallback_reason(node, cls)
        add(node, open_region(RegionKind.FALLBACK, reason=reason,
                              symbolic=cls is OpClass.SYMBOLIC))

    # Views nobody consumed (graph outputs that are views) get a region of their own;
    # deferred roots the graph only returns, a fused one.
    for node in list(pending_free):
        if node not in pending_free:
            continue
        if node in deferred:
            pending_free.remove(node)
            add(node, open_region(RegionKind.FUSED))
            continue
        flush_roots(node)
        pending_free.remove(node)
        add(node, open_region(RegionKind.FALLBACK,
                              reason="view returned as a graph output (no data moves)"))

    defer_epilogues(gm, regions)
    absorb_split_epilogues(gm, regions)
    copies_into_products(gm, regions)
    _defer_norms(gm, regions)
    _merge_bias_grads(regions)
    _merge_input_only(regions)
    plan = _finish(gm, regions, graph_name)
    check_plan(gm, plan)
    return plan


def _transposed_source(a: object) -> torch.fx.Node | None:
    """``x`` where ``a`` is ``t(x)`` or ``permute(x, [1, 0])``, else None."""
    if not isinstance(a, torch.fx.Node) or not (
            a.target is aten.t.default or (a.target is aten.permute.default
                                           and list(a.args[1]) == [1, 0])):
        return None
    return a.args[0] if isinstance(a.args[0], torch.fx.Node) else None


def bias_grad_pair(nodes) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(mm, the sum, g) when ``nodes`` compute a Linear's weight and bias gradients from
    one output gradient ``g`` (2-D): ``mm(t(g), x)`` and ``sum(g, [0])``, besides views;
    None otherwise."""
    mms = [n for n in nodes if n.target is aten.mm.default]
    sums = [n for n in nodes if n.target is aten.sum.dim_IntList]
    others = [n for n in nodes if n not in mms and n not in sums
              and classify(n) is not OpClass.VIEW]
    if len(mms) != 1 or len(sums) != 1 or others:
        return None
    (mm,), (total,) = mms, sums
    g = _transposed_source(mm.args[0])
    dims = total.args[1] if len(total.args) > 1 else None   # None: every dim
    if (g is None or total.args[0] is not g or dims is None or list(dims) not in ([0], [-2])
            or total.kwargs.get("dtype") is not None):
        return None
    val = g.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    return mm, total, g


def _merge_bias_grads(regions: list[_Open]) -> None:
    """A Linear's backward reads its output gradient ``g`` twice: ``mm(t(g), x)`` for the
    weight gradient (a gemm region) and ``sum(g, [0])`` for the bias gradient (a fused
    region of its own, with its view). Where that fused region comes after the gemm and
    holds nothing else, it joins the gemm region, so that the Coder can offer cuBLASLt's
    BGRADB epilogue: the product and the column sums of ``g`` in one call (its
    consumers run later than the gemm region either way)."""
    # fused regions that are one sum over dim 0 (and views), by the summed node
    sums: dict[torch.fx.Node, int] = {}
    for j, region in enumerate(regions):
        if region.kind is RegionKind.FUSED:
            compute = [n for n in region.nodes if classify(n) is not OpClass.VIEW]
            if len(compute) == 1 and compute[0].target is aten.sum.dim_IntList:
                sums.setdefault(compute[0].args[0], j)
    merged = False
    for i, region in enumerate(regions):
        if region.kind is not RegionKind.GEMM:
            continue
        mms = [n for n in region.nodes if n.target is aten.mm.default]
        g = _transposed_source(mms[0].args[0]) if len(mms) == 1 else None
        j = sums.get(g, -1) if g is not None else -1
        if j > i and regions[j].nodes and bias_grad_pair(region.nodes + regions[j].nodes):
            region.nodes += regions[j].nodes
            regions[j].nodes = []
            merged = True
    if merged:
        regions[:] = [r for r in regions if r.nodes]


_BN_TRAIN = "aten._native_batch_norm_legit_functional.default"


def _defer_norms(gm: torch.fx.GraphModule, regions: list[_Open]) -> None:
    """Move a convolution's training BatchNorm into the one later convolution region
    that reads its result, where that region has a training BatchNorm of an input of
    the same shape and strides: a residual block's main branch (conv, BatchNorm) and
    its shortcut (conv, BatchNorm, the sum, relu).

    Left in its own region, the BatchNorm's split statistics end in a pass that writes
    the normalised tensor, which the shortcut's last pass reads back (two passes over
    the block's output, 0.062 + 0.141 ms on the L3 ResNetBasicBlock on the H200, where
    Inductor's one kernel took 0.093). Moved, the region's last pass normalises both
    from the two convolutions' outputs (``agents.split_stats`` splits every BatchNorm
    of a region). Only a BatchNorm of the convolution's own output, with nothing else
    in the epilogue, moves; the running statistics stay graph outputs."""

    def movable(conv: torch.fx.Node, epi: list[torch.fx.Node], target: _Open,
                shared: bool = False) -> bool:
        bns = [n for n in epi if op_name(n) == _BN_TRAIN]
        if (target.kind is not RegionKind.CONV or len(bns) != 1 or bns[0].args[0] is not conv
                or len(conv.users) != 1):
            return False
        if any(n is not bns[0] and not (n.target is operator.getitem and n.args[0] is bns[0])
               for n in epi):
            return False
        theirs = [n for n in target.nodes if op_name(n) == _BN_TRAIN]
        anchors = [n for n in target.nodes if classify(n) is OpClass.CONV]
        if len(theirs) != 1 or len(anchors) != 1 or not _same_layout(theirs[0].args[0], conv):
            return False
        # read by the target's epilogue, not by its convolution (or what feeds it): the
        # BatchNorm would otherwise run before the library call, on ATen
        head = feeding(anchors[0], set(target.nodes)) | {anchors[0]}
        return not any(u in head for n in epi for u in n.users)

    move_to_sole_reader(gm, regions, RegionKind.CONV, OpClass.CONV, movable, returned_ok=True)


def _same_layout(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.stride() == vb.stride() and va.dtype == vb.dtype)


# Regions merged into one kernel by _merge_input_only, at most (two pointers each).
MERGE_LIMIT = 64


def _reads_inputs_only(region: _Open,
                       classes: tuple[OpClass, ...] = (OpClass.POINTWISE, OpClass.FACTORY,
                                                       OpClass.VIEW)) -> bool:
    """Whether ``region`` is fused work of ``classes`` (default: pointwise, views and
    factories) on graph inputs and its own values alone."""
    members = set(region.nodes)
    return region.kind is RegionKind.FUSED and bool(region.nodes) and all(
        classify(n) in classes
        and all(a in members or a.op in ("placeholder", "get_attr") for a in n.all_input_nodes)
        for n in region.nodes)


def _merge_input_only(regions: list[_Open]) -> None:
    """Merge the pointwise regions that read only graph inputs and that only the graph
    returns, of one shape and device, into the first of them (up to MERGE_LIMIT each).

    A training BatchNorm's ``num_batches_tracked + 1`` is such a region: one launch of a
    one-element kernel per BatchNorm (52 in MobileNetV2) where one kernel can do them all.
    Nothing reads their values before the graph returns, and all they read exists when
    the graph starts, so the merged region may run where the first one ran."""
    first: dict[tuple, _Open] = {}
    merged: dict[int, int] = {}
    keep = []
    for region in regions:
        key = _input_only_key(region)
        host = first.get(key) if key is not None else None
        if host is not None and merged.get(id(host), 1) < MERGE_LIMIT:
            host.nodes += region.nodes
            merged[id(host)] = merged.get(id(host), 1) + 1
            continue
        if key is not None:
            first[key] = region
        keep.append(region)
    regions[:] = keep


def _input_only_key(region: _Open) -> tuple | None:
    """(shape, device) of a region ``_merge_input_only`` may merge, else None."""
    if not _reads_inputs_only(region, (OpClass.POINTWISE,)):
        return None
    members = set(region.nodes)
    shapes = set()
    for node in region.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        if any(u not in members and u.op != "output" for u in node.users):
            return None
        shapes.add((str(tuple(val.shape)), str(val.device)))
    return shapes.pop() if len(shapes) == 1 else None


def _pointwise_tail(node: torch.fx.Node, region: _Open | None) -> bool:
    """Whether the layout conversion ``node`` may end convolution ``region``: back to the
    contiguous layout, of the region's last value and its only use, after an epilogue
    of pointwise ops, views and BatchNorms (a pooling's kernel could not tile the store).
    After a BatchNorm the one-kernel template writes its result and the conversion is a
    stage of its own (as a region of its own did before); split statistics normalise in
    a pointwise stage, which writes the traced layout through the tiled template.
    Also the end of a fused region of pointwise ops and views alone (a DenseNet's last
    concatenation, channels-last, as the graph's NCHW output): its kernel writes the
    traced layout, instead of a second pass over the value."""
    if region is None or not region.nodes:
        return False
    if region.kind is RegionKind.FUSED:
        if not all(classify(n) in (OpClass.POINTWISE, OpClass.VIEW) for n in region.nodes):
            return False
    elif region.kind is not RegionKind.CONV:
        return False
    if node.kwargs.get("memory_format") is not torch.contiguous_format:
        return False
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or src is not region.nodes[-1] or len(src.users) != 1:
        return False
    return all(classify(n) in (OpClass.CONV, OpClass.POINTWISE, OpClass.VIEW, OpClass.NORM)
               for n in region.nodes)


def _is_epilogue(node: torch.fx.Node, cls: OpClass, region: _Open) -> bool:
    """Whether ``node`` can be fused after the gemm/conv product of ``region``: a
    pointwise op of the product's size (or of a pooling's, after one), a convolution's
    BatchNorm, or a pooling: the amax/mean a disjoint-window pooling became
    (stitch_backend.pooling) or a pooling op over overlapping windows, which then reads
    the epilogue's values as its kernel computes them instead of a written copy (the
    BatchNorm's normalisation, say, when its statistics are split)."""
    if cls is OpClass.POINTWISE:
        return same_numel(_numel(node), region.anchor_numel)
    if region.kind is RegionKind.CONV and cls is OpClass.NORM:
        return op_name(node) in _CONV_EPILOGUE_NORMS
    if region.kind is RegionKind.CONV and cls is OpClass.REDUCTION:
        # a pooling over overlapping windows (codegen.lower_pooling) reads each epilogue
        # value for every window it falls in: recomputed, not stored and read back
        return (bool(node.meta.get(POOLING)) or node.target in POOL_OPS
                or _global_pool(node, region))
    return False


_GLOBAL_POOLS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default,
                           aten.amin.default})


def _global_pool(node: torch.fx.Node, region: _Open) -> bool:
    """A mean, sum, amax or amin over exactly the spatial dims of a 4-D or 5-D value of
    the product's size: a global pooling (``adaptive_avg_pool2d(x, 1)``,
    ``x.mean((2, 3))``). In the epilogue, its kernel reduces the epilogue's values as it
    computes them. Left to a region of its own, the epilogue kernel wrote its whole
    output for the pooling to read back: on an H100 (KernelBench L2 67, Conv2d + GELU +
    global average pool, 2.1 GB of convolution output) the epilogue took its pass and
    the pooling another 0.69 ms on ATen."""
    if node.target not in _GLOBAL_POOLS or node.kwargs.get("dtype") is not None:
        return False
    src = node.args[0]
    x = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5) or not dims:
        return False
    if not same_numel(x.numel(), region.anchor_numel):
        return False
    return sorted(int(d) % x.dim() for d in dims) == list(range(2, x.dim()))


def _finish(gm: torch.fx.GraphModule, regions: list[_Open], graph_name: str) -> Plan:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner: dict[torch.fx.Node, int] = {}
    for i, r in enumerate(regions):
        r.nodes.sort(key=order.__getitem__)
        for n in r.nodes:
            owner[n] = i
    result: list[Region] = []
    compute = 0
    for i, r in enumerate(regions):
        inputs, outputs = boundary(gm, [n.name for n in r.nodes])
        ops = [op_name(n) for n in r.nodes if classify(n) is not OpClass.VIEW]
        compute += len(r.nodes)
        reason = r.reason
        if r.kind is RegionKind.FALLBACK and not reason:
            reason = "no template"
        result.append(Region(id=i, kind=r.kind, nodes=[n.name for n in r.nodes], ops=ops,
                             inputs=inputs, outputs=outputs, reason=reason))
    return Plan(graph_name=graph_name, regions=result, node_count=compute)


def check_plan(gm: torch.fx.GraphModule, plan: Plan) -> None:
    """Assert the Plan's invariants: every compute node in exactly one region, and every
    region's inputs produced by graph inputs or by earlier regions."""
    nodes = {n.name: n for n in gm.graph.nodes}
    seen: dict[str, int] = {}
    for idx, region in enumerate(plan.regions):
        for name in region.nodes:
            if name in seen:
                raise AssertionError(f"node {name} is in regions {seen[name]} and {idx}")
            seen[name] = idx
    compute = {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}
    missing = compute - set(seen)
    if missing:
        raise AssertionError(f"nodes in no region: {sorted(missing)}")
    for idx, region in enumerate(plan.regions):
        for name in region.inputs:
            node = nodes[name]
            if node.op in ("placeholder", "get_attr"):
                continue
            if seen[name] >= idx:
                raise AssertionError(
                    f"region {idx} reads {name} from region {seen[name]}, which runs later")
        if region.kind is RegionKind.FALLBACK and not region.reason:
            raise AssertionError(f"fallback region {idx} has no reason")
