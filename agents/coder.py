"""The Coder: proposes implementations (Candidates) for regions.

The template Coder is deterministic and offline: it lowers a fused region to the kernel
IR and emits CUDA C++ from it (``stitch_backend.codegen``). An LLM Coder may add
candidates later; it never replaces the template's, and its output is untrusted.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from typing import Any

import torch

from stitch_backend.codegen.fused import Unsupported, generate
from stitch_backend.graph import canonical_graph, tensor_digest
from stitch_backend.ir import Region, RegionKind
from stitch_backend.opclass import CONV_OPS, GEMM_OPS, OpClass, classify
from stitch_backend.regions import CONSTANT, region_module, split_anchor

from . import conv_fold, gemm_prologue, launch_alternatives
from .state import Candidate, Stage, Subtask

log = logging.getLogger("stitch_backend.agents.coder")
aten = torch.ops.aten


class NoCandidate(Exception):
    """The Coder has nothing for this subtask; ``str(err)`` says why."""


class TemplateCoder:
    """Writes one candidate per region from the built-in templates.

    A fused region becomes one kernel. When the templates cannot express the whole
    region, the Coder replans it (the paper's "stuck -> replan"): the longest runs of
    nodes that do generate become kernels and the rest stays on ATen, as stages of one
    candidate that the Verifier judges as a whole. A gemm/conv region becomes its library
    call (ATen: cuBLAS/cuDNN) followed by kernels for its epilogue chain.
    """

    origin = "template"
    # Generation attempts allowed while replanning one region (each costs milliseconds).
    max_attempts = 48

    # Library (cuBLASLt) alternatives run on CUDA only; tests of their construction and
    # of the pipeline around them ask for them on CPU graphs too.
    library_on_cpu = False

    # A norm's split statistics come in one form: the single-pass variance, or the
    # two-pass one only where that does not generate. On an H100 (session 34: KernelBench
    # L2 11-92 and ResNet18's two layouts) the single-pass form was faster in each of the
    # 29 regions where both raced, the two-pass one never kept. Tests of the two-pass
    # form ask for both.
    two_pass_splits = False

    # Column reductions over short static rows also get the lean launch (fewer threads a
    # row; ``launch_alternatives.lean_columns``), the template's kernel renamed: raced by
    # the Verifier, kept where faster. Not yet measured on a GPU (session 35).
    lean_columns = True

    def __init__(self, sm_count: int = 132, split_stats: bool = True,
                 library_on_cpu: bool | None = None, clusters: bool = False):
        self.sm_count = sm_count
        # The target has thread-block clusters (sm_90 and later): long rows also get the
        # cluster layout (``launch_alternatives.cluster_rows``), raced by the Verifier.
        self.clusters = clusters
        if library_on_cpu is not None:
            self.library_on_cpu = library_on_cpu
        # Also propose the split-statistics alternative for training BatchNorm over few
        # channels of a contiguous (NCHW) input and for layer norm over few rows
        # (``agents.split_stats``; channels-last inputs always get it); the Verifier
        # keeps the faster one.
        self.split_stats = split_stats
        # structure key -> kernel or Unsupported: repeated blocks (ResNet stages,
        # transformer layers) and replanning retries generate once per structure
        self._generated: dict[str, Any] = {}

    def propose(self, subtask: Subtask) -> Candidate:
        """A candidate for ``subtask``, or NoCandidate with the reason."""
        region = subtask.region
        lead: list[Stage] = []
        part = region
        library = folded = None
        conv_tag = None    # the generated convolution's tag, where it is the alternative
        if subtask.kind == "gemm":
            pro = gemm_prologue.prologue_names(subtask.graph, region)
            if pro:       # copies before a bmm (prologue_moves): their own template
                return gemm_prologue.propose(self, subtask, pro)
        if subtask.kind in ("gemm", "conv"):
            try:
                head, part = self._split_anchor(subtask)
            except NoCandidate:
                plain = self._lt_plain(subtask) if subtask.kind == "gemm" else None
                if plain is None:
                    raise
                return plain
            lead = [Stage(head, module=region_module(subtask.graph, head))]
            if subtask.kind == "gemm":
                library = (self._lt_alternative(subtask, head, part)
                           or self._lt_bias_grad(subtask))
            stages = lead + self._epilogue_stages(subtask, part)
            if subtask.kind == "conv":
                library, conv_tag = self._conv_kernel_alternative(subtask, head,
                                                                  stages[len(lead):])
                folded = conv_fold.propose(self, subtask, head, part)
        elif subtask.kind == "fused":
            stages = self._kernel_stages(subtask, region.nodes, "region")
        else:
            raise NoCandidate(f"no template for {subtask.kind} regions yet: ATen runs it")
        cand = self._candidate(subtask, subtask.region_name, stages, list(region.outputs))
        splits = self._stats_splits(subtask, lead, part)
        cand.alternatives += launch_alternatives.row_write_layouts(self, subtask, stages)
        if not splits:
            # where the statistics split, the narrow launch of the column kernel lost
            # each of its 15 races on an H100 (session 34: L2 11-77 by 1.5-7x, ResNet18's
            # channels-last BatchNorms by 3.5-100%); without a split it stays (8 races:
            # 1 won by 1.6%, 7 lost by 1-6%)
            cand.alternatives += launch_alternatives.narrow_columns(self, subtask, stages)
        cand.alternatives += launch_alternatives.single_pass_stats(self, subtask, stages)
        cand.alternatives += launch_alternatives.cluster_rows(self, subtask, stages)
        cand.alternatives += splits
        if self.lean_columns:
            cand.alternatives += launch_alternatives.lean_columns(self, subtask, stages)
            for split in splits:   # its last stage, where that is the reduction that normalises
                cand.alternatives += launch_alternatives.lean_columns(
                    self, subtask, split.stages, split.name, split.region_outputs, last_only=True)
        if folded is not None:
            cand.alternatives.append(folded)
        if library is not None:
            cand.alternatives.append(library)
            if conv_tag is not None:   # a generated convolution: split statistics after it too
                cand.alternatives += self._stats_splits(subtask, library.stages[:1], part,
                                                        tag=f"{conv_tag}_")
        return cand

    def _lt_alternative(self, subtask: Subtask, head: Region, part: Region) -> Candidate | None:
        """cuBLASLt's fused epilogue (``stitch_backend.lt_ops``) for a 2-D addmm/mm whose
        only user opens the epilogue (directly, or through the one view a Linear on 3-D
        input adds) with a relu or tanh-gelu, or, after an mm, with the add of a bias row
        (a Linear on 3-D input: mm, view, add), itself perhaps followed by one of those
        activations; or whose value (or view) feeds tanh-gelu written out
        (``lt_ops.tanh_gelu_chain``); or the add of a residual (``lt_ops.residual_chain``,
        cuBLASLt's C): one library call for them, then the rest of the epilogue as usual.
        None where that does not apply."""
        from stitch_backend import lt_ops

        gm = subtask.graph
        nodes = {n.name: n for n in gm.graph.nodes}
        mm = self._lt_anchor(nodes, head.nodes)
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
        stages += self.rest_stages(subtask, part, set(taken) | {n.name for n in chain}, 801)
        kernels = [st.kernel for st in stages if st.kernel is not None]
        # The source names what runs (the cache finds a stored winner by its hash) and
        # compiles as the epilogue's kernels, if any.
        header = (f"// {subtask.region_name}_lt: cuBLASLt {mm.target}"
                  f"{' + bias' if has_bias else ''}"
                  f"{' + residual (C, beta 1)' if residual is not None else ''} with epilogue {epilogue} "
                  f"({', '.join(str(n.target) for n in chain)}), "
                  f"{tuple(val.shape)} {val.dtype}\n")
        return Candidate(region_id=subtask.region_id, origin=self.origin,
                         name=f"{subtask.region_name}_lt",
                         source=header + "\n".join(k.source for k in kernels),
                         kernel=kernels[0] if kernels else None,
                         signature=kernels[0].signature if kernels else "", stages=stages,
                         region_inputs=list(subtask.region.inputs),
                         region_outputs=list(subtask.region.outputs))

    def rest_stages(self, subtask: Subtask, part: Region, done: set[str], index: int
                    ) -> list[Stage]:
        """Stages for the nodes of epilogue ``part`` not in ``done`` (a library call took
        those): kernels where they generate, else ATen (sub-region ``index``); [] if none."""
        gm = subtask.graph
        nodes = {n.name: n for n in gm.graph.nodes}
        rest = [n for n in part.nodes if n not in done]
        if not rest:
            return []
        if any(classify(nodes[n]) is not OpClass.VIEW for n in rest):
            try:
                return self._kernel_stages(subtask, rest, "epilogue")
            except NoCandidate:
                pass
        rest_sub = sub_region(gm, rest, subtask.region_id, index)   # views alone, or ATen
        return [Stage(rest_sub, module=region_module(gm, rest_sub))]

    def _lt_bias_grad(self, subtask: Subtask) -> Candidate | None:
        """A Linear's weight and bias gradients (``mm(t(g), x)`` and ``sum(g, [0])``, which
        the Planner puts in one region: ``planner.bias_grad_pair``) as one cuBLASLt call
        with the BGRADB epilogue (``lt_ops.lt_mm_bgrad``): ``g`` is read once. Both
        operands row-major; None where that does not apply."""
        from stitch_backend import lt_ops

        from .planner import bias_grad_pair

        gm = subtask.graph
        nodes = {n.name: n for n in gm.graph.nodes}
        pair = bias_grad_pair([nodes[n] for n in subtask.region.nodes])
        if pair is None or not self._lt_can_run(pair[0]):
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
        return self._graph_candidate(subtask, name, header, sub, module, graph)

    def _graph_candidate(self, subtask: Subtask, name: str, header: str, sub: Region,
                         module: torch.fx.GraphModule, graph: torch.fx.Graph,
                         library: bool = False) -> Candidate:
        """A candidate whose one stage is ``graph`` (rewritten from ``module``, the
        region's sub-module ``sub``): library calls, no generated kernel."""
        return Candidate(region_id=subtask.region_id, origin=self.origin, name=name,
                         source=header, stages=[Stage(sub, module=torch.fx.GraphModule(
                             module, graph, class_name=name))],
                         region_inputs=list(subtask.region.inputs),
                         region_outputs=list(subtask.region.outputs), library=library)

    def _lt_can_run(self, mm: torch.fx.Node) -> bool:
        """Whether cuBLASLt can compute 2-D ``mm`` (an addmm's bias a row of N)."""
        from stitch_backend import lt_ops

        val = mm.meta.get("val")
        if (not isinstance(val, torch.Tensor) or val.dim() != 2 or val.dtype not in lt_ops.DTYPES
                or (val.device.type != "cuda" and not self.library_on_cpu) or mm.kwargs
                or any(isinstance(s, torch.SymInt) for s in val.shape)):
            return False
        if mm.target is aten.addmm.default:
            bias = mm.args[0].meta.get("val") if isinstance(mm.args[0], torch.fx.Node) else None
            return (len(mm.args) == 3 and isinstance(bias, torch.Tensor) and bias.dim() == 1
                    and bias.shape[0] == val.shape[1])
        return True

    def _lt_anchor(self, nodes: dict[str, torch.fx.Node], names: list[str]
                   ) -> torch.fx.Node | None:
        """The one addmm/mm among ``names`` when cuBLASLt can run it, else None."""
        anchors = [nodes[n] for n in names
                   if nodes[n].target in (aten.addmm.default, aten.mm.default)]
        if len(anchors) != 1 or not self._lt_can_run(anchors[0]):
            return None
        return anchors[0]

    def _lt_plain(self, subtask: Subtask) -> Candidate | None:
        """A gemm region with no epilogue (or views alone after it) as one cuBLASLt call
        (``lt_ops``; an addmm's bias in its BIAS epilogue), whose algorithm the first call
        times among the heuristics' best: raced against ATen's call by the Verifier. None
        where cuBLASLt cannot run it (then ATen's library call is the implementation)."""
        from stitch_backend import lt_ops

        gm = subtask.graph
        mm = self._lt_anchor({n.name: n for n in gm.graph.nodes}, subtask.region.nodes)
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
        return self._graph_candidate(subtask, name, header, sub, module, graph, library=True)

    def _conv_kernel_alternative(self, subtask: Subtask, head: Region, epilogue: list[Stage]
                                 ) -> tuple[Candidate | None, str | None]:
        """A generated convolution in place of the library call, then the same epilogue
        stages, and its tag: ``codegen.depthwise`` (``dw``, the candidate named ``_dw``)
        for one filter per channel (NCHW), ``codegen.stem_conv`` (``sc``) for a few input
        channels into a channels-last output; (None, None) where the region's convolution
        is neither (or sizes are symbolic)."""
        from stitch_backend.codegen import depthwise, stem_conv

        gm = subtask.graph
        nodes = {n.name: n for n in gm.graph.nodes}
        if len(head.nodes) != 1 or not epilogue:
            return None, None
        conv = nodes[head.nodes[0]]
        x = conv.args[0].meta.get("val") if isinstance(conv.args[0], torch.fx.Node) else None
        if not isinstance(x, torch.Tensor) or x.device.type not in ("cuda", "cpu"):
            return None, None
        for tag, spec_of, make in (("dw", depthwise.depthwise_spec, depthwise.generate_depthwise),
                                   ("sc", stem_conv.stem_spec, stem_conv.generate_stem_conv)):
            spec = spec_of(conv)
            if spec is not None:
                break
        else:
            return None, None
        sub = sub_region(gm, [conv.name], subtask.region_id, 810)
        operands = [a.name for a in conv.args[:3] if isinstance(a, torch.fx.Node)]
        if sorted(operands) != sorted(sub.inputs) or len(set(operands)) != len(operands):
            return None, None  # an operand used twice, or a boundary that is not (x, w, b)
        kernel = make(spec, f"{subtask.region_name}_{tag}", [sub.inputs.index(n) for n in operands])
        stages = [Stage(sub, kernel=kernel)] + list(epilogue)
        kernels = [st.kernel for st in stages if st.kernel is not None]
        return Candidate(region_id=subtask.region_id, origin=self.origin,
                         name=f"{subtask.region_name}_{tag}",
                         source="\n".join(k.source for k in kernels), kernel=kernel,
                         signature=kernel.signature, stages=stages,
                         region_inputs=list(subtask.region.inputs),
                         region_outputs=list(subtask.region.outputs)), tag

    def _candidate(self, subtask: Subtask, name: str, stages: list[Stage],
                   outputs: list[str]) -> Candidate:
        kernels = [s.kernel for s in stages if s.kernel is not None]
        if len(stages) == 1:
            k = kernels[0]
            return Candidate(region_id=subtask.region_id, origin=self.origin, name=k.entry,
                             source=k.source, signature=k.signature, kernel=k)
        return Candidate(region_id=subtask.region_id, origin=self.origin, name=name,
                         source="\n".join(k.source for k in kernels), kernel=kernels[0],
                         signature=kernels[0].signature, stages=stages,
                         region_inputs=list(subtask.region.inputs), region_outputs=outputs)

    def _stats_splits(self, subtask: Subtask, lead: list[Stage], part: Region,
                      tag: str = "") -> list[Candidate]:
        """The split-statistics alternatives (two-pass and single-pass variance) of a region
        whose (epilogue) part is a training BatchNorm over few channels; a layer, group or
        instance norm over few rows; a group or instance norm only reduced further; or
        that reduces to few rows (``split_reduce``: one alternative). None where that does
        not apply or generate. ``tag`` prefixes their names (another lead stage)."""
        from .split_reduce import REDUCE_TARGETS
        from .split_stats import SPLIT_TARGETS

        names = set(part.nodes)
        targets = {n.target for n in subtask.graph.graph.nodes if n.name in names}
        if not targets & set(SPLIT_TARGETS + REDUCE_TARGETS):
            return []
        module = region_module(subtask.graph, part)
        found = []
        # the single-pass variance differs only where a norm splits (two_pass_splits)
        if not targets & set(SPLIT_TARGETS):
            passes = (False,)
        else:
            passes = (False, True) if self.two_pass_splits else (True, False)
        for single_pass in passes:
            suffix = f"{tag}split1p" if single_pass else f"{tag}split"
            alt = self._stats_split(subtask, lead, part, module, single_pass, suffix)
            if alt is not None:
                found.append(alt)
                if not self.two_pass_splits:
                    break
        return found

    def _stats_split(self, subtask: Subtask, lead: list[Stage], part: Region, module,
                     single_pass: bool, suffix: str) -> Candidate | None:
        from .split_stats import split_norms

        split = split_norms(module, self.sm_count, contiguous=self.split_stats,
                                single_pass=single_pass)
        if split is None:
            return None
        new = split.module
        stages = list(lead)
        name = f"{subtask.region_name}_{suffix}"
        last = len(split.stages) - 1
        for i, names in enumerate(split.stages):
            sub = sub_region(new, names, subtask.region_id, 500 + i)
            try:
                kernel = self._generate(region_module(new, sub), f"{name}{i}")
            except Unsupported as err:
                if i == last:
                    # the normalisation and the rest of the region (a pooling, say) in
                    # more than one kernel, where one does not generate
                    try:
                        stages += self._kernel_stages(subtask, names, "split stage", gm=new,
                                                      prefix=f"{name}{i}", id_base=600)
                        continue
                    except NoCandidate:
                        pass
                log.debug("no split-statistics candidate for %s: stage %d: %s",
                          subtask.region_name, i, err)
                return None
            stages.append(Stage(sub, kernel=kernel))
        out = next(nd for nd in new.graph.nodes if nd.op == "output").args[0]
        renamed = dict(zip(part.outputs, (a.name for a in out)))
        return self._candidate(subtask, name, stages,
                               [renamed.get(n, n) for n in subtask.region.outputs])

    def _epilogue_stages(self, subtask: Subtask, part: Region) -> list[Stage]:
        """The epilogue's stages. A layout conversion that ends an epilogue with a
        BatchNorm is a stage of its own: in the BatchNorm's one-kernel template (a column
        reduction) it would be a store of one element a thread across the other layout
        (the split-statistics alternatives keep it in their pointwise last stage, which
        writes it through the tiled template)."""
        from stitch_backend.layout import CONVERSION

        nodes = {n.name: n for n in subtask.graph.graph.nodes}
        last = nodes[part.nodes[-1]]
        if not (last.meta.get(CONVERSION) and len(part.nodes) > 1
                and any(classify(nodes[n]) is OpClass.NORM for n in part.nodes)):
            return self._kernel_stages(subtask, part.nodes, "epilogue")
        return (self._kernel_stages(subtask, part.nodes[:-1], "epilogue")
                + self._kernel_stages(subtask, [last.name], "layout conversion",
                                      prefix=f"{subtask.region_name}_out", id_base=700))

    def _kernel_stages(self, subtask: Subtask, names: list[str], what: str, gm=None,
                       prefix: str | None = None, id_base: int = 0) -> list[Stage]:
        """Stages covering ``names`` (nodes of ``gm``, the subtask's graph by default) in
        order: kernels for the longest runs that generate, ATen for nodes no run can start
        with; kernels named ``prefix`` (the region's name) and a stage suffix. NoCandidate
        if no kernel at all."""
        gm = subtask.graph if gm is None else gm
        prefix = subtask.region_name if prefix is None else prefix
        nodes = {n.name: n for n in gm.graph.nodes}
        compute = lambda run: any(classify(nodes[n]) is not OpClass.VIEW for n in run)
        attempts = 0
        first_error: Exception | None = None

        def generate_run(run: list[str], index: int):
            nonlocal attempts, first_error
            attempts += 1
            sub = sub_region(gm, run, subtask.region_id, index if index < 0 else id_base + index)
            name = prefix if index < 0 else f"{prefix}_s{index}"
            try:
                return sub, self._generate(region_module(gm, sub), name)
            except Unsupported as err:
                first_error = first_error or err
                return sub, None

        sub, kernel = generate_run(names, -1)
        if kernel is not None:
            return [Stage(sub, kernel=kernel)]
        stages: list[Stage] = []
        aten_run: list[str] = []
        i = 0
        while i < len(names):
            found = None
            for cut in range(len(names), i, -1):
                run = names[i:cut]
                if not compute(run) or (i == 0 and cut == len(names)):
                    continue
                if attempts >= self.max_attempts:
                    break
                sub, kernel = generate_run(run, len(stages) + bool(aten_run))
                if kernel is not None:
                    found = (cut, sub, kernel)
                    break
            if found is None:
                aten_run.append(names[i])
                i += 1
                continue
            if aten_run:
                stages.append(self._aten_stage(gm, aten_run, subtask.region_id,
                                               id_base + len(stages)))
                aten_run = []
            cut, sub, kernel = found
            sub.id = subtask.region_id * 1000 + id_base + len(stages)
            # named for its final stage position (names must be unique)
            kernel = kernel.renamed(f"{prefix}_s{len(stages)}")
            stages.append(Stage(sub, kernel=kernel))
            i = cut
        if aten_run:
            stages.append(self._aten_stage(gm, aten_run, subtask.region_id, id_base + len(stages)))
        if not any(s.kernel is not None for s in stages):
            raise NoCandidate(f"no template for this {what}: {first_error}")
        return stages

    def _generate(self, module, name: str):
        """``generate(module, name)``, once per region structure (Unsupported too)."""
        key = structure_key(module)
        if key is None:
            return generate(module, name, sm_count=self.sm_count)
        hit = self._generated.get(key)
        if hit is None:
            try:
                hit = generate(module, name, sm_count=self.sm_count)
            except Unsupported as err:
                hit = err
            self._generated[key] = hit
        if isinstance(hit, Exception):
            raise hit
        return hit.renamed(name)

    @staticmethod
    def _aten_stage(gm, run: list[str], region_id: int, index: int) -> Stage:
        sub = sub_region(gm, run, region_id, index)
        return Stage(sub, module=region_module(gm, sub))

    @staticmethod
    def _split_anchor(subtask: Subtask) -> tuple[Region, Region]:
        """The library call and its epilogue; NoCandidate when there is nothing to fuse."""
        parts = split_anchor(subtask.graph, subtask.region, GEMM_OPS | CONV_OPS)
        if parts is None:
            raise NoCandidate(f"a {subtask.kind} with no epilogue: the library call (ATen) "
                              "is the implementation")
        head, tail = parts
        nodes = {n.name: n for n in subtask.graph.graph.nodes}
        if all(classify(nodes[n]) is OpClass.VIEW for n in tail.nodes):
            raise NoCandidate(f"a {subtask.kind} followed only by views: the library call "
                              "(ATen) is the implementation")
        return head, tail


def sub_region(gm, names: list[str], region_id: int, index: int) -> Region:
    """A piece of a region as a Region of its own (boundary against the whole graph)."""
    from stitch_backend.regions import boundary

    inputs, outputs = boundary(gm, names)
    return Region(id=region_id * 1000 + max(index, 0), kind=RegionKind.FUSED, nodes=list(names),
                  ops=[], inputs=inputs, outputs=outputs)


def structure_key(module: torch.fx.GraphModule) -> str | None:
    """What generation depends on: the graph up to node names, its input metas and its
    constants' values. None for symbolic shapes (their symbols' names reach the source)."""
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and (
                isinstance(val, torch.SymInt) or isinstance(val, torch.Tensor) and any(
                    isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))):
            return None
    # the canonical graph carries the digest of every tensor constant (get_attr); the
    # values of constants that came in as inputs, and of non-tensor ones, are added here
    digest = hashlib.sha256(canonical_graph(module).encode())
    for node in module.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get(CONSTANT), torch.Tensor):
            digest.update(tensor_digest(node.meta[CONSTANT]).encode())   # may be inlined
        elif node.op == "get_attr":
            value = getattr(module, node.target, None)
            if not isinstance(value, torch.Tensor):
                digest.update(repr(value).encode())
    return digest.hexdigest()
