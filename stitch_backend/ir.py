"""The region IR: what the Planner hands the Coder and the Program runs.

A ``Plan`` is an ordered list of ``Region``s that together cover every compute node of
one ATen graph exactly once. Regions are executed in list order; each region's inputs
are graph inputs or outputs of earlier regions. Everything here is plain data that
round-trips through JSON (``Plan.to_json`` / ``Plan.from_json``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any


class RegionKind(str, enum.Enum):
    """The region kinds of DESIGN.md."""

    GEMM = "gemm"
    CONV = "conv"
    FUSED = "fused"
    ATTENTION = "attention"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, stride, dtype and device of a value; symbolic sizes are strings ('s0')."""

    shape: tuple[int | str, ...]
    stride: tuple[int | str, ...]
    dtype: str
    device: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TensorMeta":
        return cls(tuple(data["shape"]), tuple(data["stride"]), data["dtype"], data["device"])


@dataclass
class Region:
    """One unit of work: a connected group of nodes run by one kernel, library call or ATen.

    ``nodes`` are FX node names in graph order; ``ops`` the ATen op names of the compute
    nodes among them; ``inputs``/``outputs`` the values crossing the region boundary.
    A fallback region always has a ``reason``; so does any region the Coder or Verifier
    left on ATen (``backend == "aten"``).
    """

    id: int
    kind: RegionKind
    nodes: list[str]
    ops: list[str]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    reason: str | None = None
    # Filled in by the Coder/Verifier: "aten" until a verified kernel replaces it.
    backend: str = "aten"
    kernel: str | None = None
    speedup: float | None = None
    time_ms: float | None = None
    # The region's ATen time in the graph, measured at the first call (agents.hotspots).
    aten_ms: float | None = None

    @property
    def name(self) -> str:
        """A readable name used for generated kernels: 'fused_3', 'gemm_0'."""
        return f"{self.kind.value}_{self.id}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Region":
        data = dict(data)
        data["kind"] = RegionKind(data["kind"])
        return cls(**data)


@dataclass
class Plan:
    """The Planner's partition of one graph, in execution order."""

    graph_name: str
    regions: list[Region]
    node_count: int
    version: int = 1

    def region_of(self) -> dict[str, int]:
        """Map each node name to the index of its region."""
        return {n: i for i, r in enumerate(self.regions) for n in r.nodes}

    def counts(self) -> dict[str, int]:
        """How many regions of each kind, and how many run generated code."""
        out: dict[str, int] = {k.value: 0 for k in RegionKind}
        for r in self.regions:
            out[r.kind.value] += 1
        out["generated"] = sum(1 for r in self.regions if r.backend != "aten")
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"graph_name": self.graph_name, "node_count": self.node_count,
                           "version": self.version,
                           "regions": [r.to_dict() for r in self.regions]}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        return cls(graph_name=data["graph_name"], node_count=data["node_count"],
                   version=data.get("version", 1),
                   regions=[Region.from_dict(r) for r in data["regions"]])
