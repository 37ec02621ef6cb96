"""The Coder: proposes implementations (Candidates) for regions.

The template Coder is deterministic and offline: it lowers a fused region to the kernel
IR and emits CUDA C++ from it (``stitch_backend.codegen``). An LLM Coder may add
candidates later; it never replaces the template's, and its output is untrusted.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from stitch_backend.codegen.fused import Unsupported, generate
from stitch_backend.graph import canonical_graph, tensor_digest
from stitch_backend.ir import Region, RegionKind
from stitch_backend.opclass import CONV_OPS, GEMM_OPS, OpClass, classify
from stitch_backend.regions import CONSTANT, region_module, split_anchor

from . import conv_fold, gemm_prologue, launch_alternatives, lt_alternatives
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
                plain = lt_alternatives.plain(self, subtask) if subtask.kind == "gemm" else None
                if plain is None:
                    raise
                return plain
            lead = [Stage(head, module=region_module(subtask.graph, head))]
            if subtask.kind == "gemm":
                library = (lt_alternatives.alternative(self, subtask, head, part)
                           or lt_alternatives.bias_grad(self, subtask))
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
        cand.alternatives += launch_alternatives.peeled_rows(self, subtask, stages)
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

    def _graph_candidate(self, subtask: Subtask, name: str, header: str, sub: Region,
                         module: torch.fx.GraphModule, graph: torch.fx.Graph,
                         library: bool = False) -> Candidate:
        """A candidate whose one stage is ``graph`` (rewritten from ``module``, the
        region's sub-module ``sub``): library calls, no generated kernel."""
        stage = Stage(sub, module=torch.fx.GraphModule(module, graph, class_name=name))
        return self.headed_candidate(subtask, name, header, [stage], library)

    def headed_candidate(self, subtask: Subtask, name: str, header: str, stages: list[Stage],
                         library: bool = False) -> Candidate:
        """A candidate of ``stages`` that open with library calls: its source is ``header``
        (what runs: the cache finds a stored winner by its hash) and the sources of its
        generated kernels, if any."""
        kernels = [st.kernel for st in stages if st.kernel is not None]
        return Candidate(region_id=subtask.region_id, origin=self.origin, name=name,
                         source=header + "\n".join(k.source for k in kernels),
                         kernel=kernels[0] if kernels else None,
                         signature=kernels[0].signature if kernels else "", stages=stages,
                         region_inputs=list(subtask.region.inputs),
                         region_outputs=list(subtask.region.outputs), library=library)

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
