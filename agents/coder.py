"""The Coder: proposes implementations (Candidates) for regions.

The template Coder is deterministic and offline: it lowers a fused region to the kernel
IR and emits CUDA C++ from it (``stitch_backend.codegen``). An LLM Coder may add
candidates later; it never replaces the template's, and its output is untrusted.
"""

from __future__ import annotations

import logging

from stitch_backend.regions import region_module, split_anchor

from .state import Candidate, Prologue, Subtask

log = logging.getLogger("stitch_backend.agents.coder")


class NoCandidate(Exception):
    """The Coder has nothing for this subtask; ``str(err)`` says why."""


class TemplateCoder:
    """Writes one candidate per fused region from the built-in templates."""

    origin = "template"

    def __init__(self, sm_count: int = 132):
        self.sm_count = sm_count

    def propose(self, subtask: Subtask) -> Candidate:
        """A candidate kernel for ``subtask``, or NoCandidate with the reason."""
        from stitch_backend.codegen.fused import generate
        from stitch_backend.codegen.fused import Unsupported

        prologue = None
        module = subtask.module
        if subtask.kind in ("gemm", "conv"):
            prologue = self._split(subtask)
            module = region_module(subtask.graph, prologue.tail)
        elif subtask.kind != "fused":
            raise NoCandidate(f"no template for {subtask.kind} regions yet: ATen runs it")
        try:
            kernel = generate(module, subtask.region_name, sm_count=self.sm_count)
        except Unsupported as err:
            what = "epilogue" if prologue else "region"
            raise NoCandidate(f"no template for this {what}: {err}") from None
        return Candidate(region_id=subtask.region_id, origin=self.origin, name=kernel.entry,
                         source=kernel.source, signature=kernel.signature, kernel=kernel,
                         prologue=prologue)

    @staticmethod
    def _split(subtask: Subtask) -> Prologue:
        """Library call (cuBLAS/cuDNN through ATen) + one fused kernel for the epilogue."""
        from stitch_backend.opclass import CONV_OPS, GEMM_OPS

        region = subtask.region
        parts = split_anchor(subtask.graph, region, GEMM_OPS | CONV_OPS)
        if parts is None:
            raise NoCandidate(f"a {subtask.kind} with no epilogue: the library call (ATen) "
                              "is the implementation")
        head, tail = parts
        from stitch_backend.opclass import OpClass, classify

        nodes = {n.name: n for n in subtask.graph.graph.nodes}
        if all(classify(nodes[n]) is OpClass.VIEW for n in tail.nodes):
            raise NoCandidate(f"a {subtask.kind} followed only by views: the library call "
                              "(ATen) is the implementation")
        return Prologue(head=head, tail=tail, head_module=region_module(subtask.graph, head),
                        region_inputs=list(region.inputs), region_outputs=list(region.outputs))
