"""The Coder: proposes implementations (Candidates) for regions.

The template Coder is deterministic and offline: it lowers a fused region to the kernel
IR and emits CUDA C++ from it (``stitch_backend.codegen``). An LLM Coder may add
candidates later; it never replaces the template's, and its output is untrusted.
"""

from __future__ import annotations

import logging

from .state import Candidate, Subtask

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

        if subtask.kind != "fused":
            raise NoCandidate(f"no template for {subtask.kind} regions yet")
        try:
            kernel = generate(subtask.module, subtask.region_name, sm_count=self.sm_count)
        except Unsupported as err:
            raise NoCandidate(f"no template: {err}") from None
        return Candidate(region_id=subtask.region_id, origin=self.origin, name=kernel.entry,
                         source=kernel.source, signature=kernel.signature, kernel=kernel)
