"""The typed state the agents pass along: Task -> Subtask -> Candidate -> Verdict.

As in the StitchCUDA paper, one task (a graph) is split into subtasks (regions); the
Coder proposes candidates for a subtask; the Verifier returns a verdict on each; every
attempt is kept in a Trajectory, saved as JSON lines (the training data for the paper's
two skills: task -> code, feedback -> improved code). Nothing here holds an API key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Task:
    """One ATen graph to compile."""

    graph: str            # e.g. "graph_0_forward"
    key: str              # GraphKey digest
    arch: str             # e.g. "sm_90a"
    device: str


@dataclass
class Subtask:
    """One region the Coder should implement."""

    region_id: int
    region_name: str
    kind: str
    ops: list[str]
    module: Any = field(default=None, repr=False, compare=False)  # the region's GraphModule
    graph: Any = field(default=None, repr=False, compare=False)   # the whole ATen graph
    region: Any = field(default=None, repr=False, compare=False)  # ir.Region

    def region_module(self) -> Any:
        """The region as a GraphModule of its own (built on first use)."""
        if self.module is None:
            from stitch_backend.regions import region_module

            self.module = region_module(self.graph, self.region)
        return self.module


@dataclass
class Stage:
    """One step of a multi-stage candidate: a generated kernel, or ATen for a piece the
    templates cannot express (the library call of a gemm/conv, or a replanned remainder).
    ``region`` is a sub-region whose boundary is computed against the whole graph."""

    region: Any                                              # ir.Region
    kernel: Any = field(default=None, repr=False)            # codegen.FusedKernel
    module: Any = field(default=None, repr=False)            # ATen GraphModule


def subtask_for(gm: Any, region: Any, name: str) -> Subtask:
    """The Subtask of ``region`` of graph ``gm``; its kernels are named from ``name``
    (``module`` is left for ``region_module()`` to build when someone needs it)."""
    return Subtask(region_id=region.id, region_name=name, kind=region.kind.value,
                   ops=region.ops, graph=gm, region=region)


@dataclass
class Candidate:
    """A proposed implementation of one subtask."""

    region_id: int
    origin: str                       # "template" (trusted) or "llm" (untrusted)
    name: str                         # kernel/entry name
    source: str
    signature: str = ""
    kernel: Any = field(default=None, repr=False, compare=False)   # codegen.FusedKernel
    cubin: bytes | None = field(default=None, repr=False, compare=False)
    compile_s: float | None = None
    compile_error: str | None = None
    # None: one kernel computes the whole region. Otherwise the stages, in order, and the
    # region's boundary they are stitched into.
    stages: list[Stage] | None = field(default=None, repr=False, compare=False)
    region_inputs: list[str] = field(default_factory=list, repr=False)
    region_outputs: list[str] = field(default_factory=list, repr=False)
    # On a template candidate: untrusted candidates for the same region (LLM-written,
    # launched by this candidate's launch rule), judged beside it at acceptance.
    alternatives: list["Candidate"] = field(default_factory=list, repr=False, compare=False)
    # A library call alone (no generated kernel), raced against ATen's library call:
    # accepted only with a margin (``acceptance.LIBRARY_MARGIN``).
    library: bool = False

    @property
    def kernels(self) -> list[Any]:
        """Every generated kernel of this candidate, in launch order."""
        if self.stages is None:
            return [self.kernel]
        return [s.kernel for s in self.stages if s.kernel is not None]

    @property
    def trusted(self) -> bool:
        return self.origin == "template"


@dataclass
class Verdict:
    """The Verifier's judgement, with the evidence."""

    ok: bool
    reason: str
    correct: bool = False
    max_abs: float | None = None
    norm_err: float | None = None
    eager_norm_err: float | None = None
    draws: int = 0
    degenerate: bool = False
    candidate_ms: float | None = None
    eager_ms: float | None = None
    clock: str = ""              # how the times were taken: "cuda-graph" or "cuda-events"

    @property
    def speedup(self) -> float | None:
        if self.candidate_ms and self.eager_ms:
            return self.eager_ms / self.candidate_ms
        return None


@dataclass
class Attempt:
    """One step of the loop: what was tried and what the Verifier said. LLM steps also
    keep the conversation sent, the reply, its cost and the feedback it got (the paper's
    two skills: task -> code, feedback -> improved code). Never an API key."""

    action: str                 # "generate", "repair", "optimise", "replan", "verify"
    candidate: Candidate
    verdict: Verdict | None
    feedback: str | None = None                 # what the step's result was told
    messages: list[dict[str, str]] | None = None
    reply: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_seconds: float | None = None


@dataclass
class Trajectory:
    """Every attempt made for one task, in order."""

    task: Task
    attempts: list[Attempt] = field(default_factory=list)

    def to_records(self) -> list[dict[str, Any]]:
        """One JSON-able record per attempt (sources included, binaries not)."""
        return [self.record_of(a) for a in self.attempts]

    def record_of(self, a: Attempt) -> dict[str, Any]:
        """The JSON-able record of one attempt."""
        cand = {k: getattr(a.candidate, k) for k in
                ("region_id", "origin", "name", "source", "signature", "compile_s",
                 "compile_error")}
        rec = {"task": asdict(self.task), "action": a.action, "candidate": cand,
               "verdict": asdict(a.verdict) if a.verdict else None}
        if a.messages is not None or a.reply is not None or a.feedback is not None:
            rec["llm"] = {"messages": a.messages, "reply": a.reply, "feedback": a.feedback,
                          "prompt_tokens": a.prompt_tokens,
                          "completion_tokens": a.completion_tokens,
                          "seconds": a.llm_seconds}
        return rec

    def save(self, path: Path) -> None:
        """Append this trajectory's records to a JSONL file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for rec in self.to_records():
                fh.write(json.dumps(rec, default=str) + "\n")

    def add(self, attempt: Attempt, path: Path | None = None) -> None:
        """Append ``attempt``; with ``path``, also append its record to that JSONL file
        at once (a crash later loses nothing)."""
        self.attempts.append(attempt)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as fh:
                fh.write(json.dumps(self.record_of(attempt), default=str) + "\n")
