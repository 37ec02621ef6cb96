"""The result record: one JSON line per task and backend.

Records that share ``task_run`` were measured in the same child process, so their
times are side by side; the summary only forms ratios within one ``task_run``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

# status values
OK = "ok"             # ran; correctness is in correct_kernelbench / correct_design
ERROR = "error"       # a Python exception (compile, run, reference or loading): see error
TIMEOUT = "timeout"   # the task's child process ran past --timeout and was killed
CRASH = "crash"       # the child process died (signal, abort) before writing this record


@dataclass
class BenchRecord:
    """One backend on one task. Times in milliseconds, compile times in seconds."""

    task: str
    spec: str
    backend: str
    status: str
    device: str = ""
    mode: str = "train"                      # "train" (KernelBench's default), "eval" or
                                             # "train-step" (forward + backward a call)
    autocast: str = ""                       # "bf16"/"fp16": forwards under torch.autocast
    task_run: str = ""
    correct_kernelbench: bool | None = None  # every trial within atol=rtol of eager
    correct_design: bool | None = None       # DESIGN.md's rule (1e-4 of eager, or fp64 rule)
    max_abs: float | None = None
    norm_err: float | None = None
    eager_norm_err: float | None = None
    reason: str = ""
    trials: int = 0
    median_ms: float | None = None
    call_peak_mb: float | None = None   # device memory one call needs beyond its inputs
    gpu_before: dict[str, float] | None = None  # NVML temp/clock/power as timing began
    gpu_after: dict[str, float] | None = None   # ... and as it ended (timing.gpu_state)
    timing_rounds: int | None = None    # interleaved: its runs were split over this many rounds
    sequential_why: str = ""            # asked to interleave, timed one backend after another
    io_bytes: int | None = None         # inputs + parameters/buffers + outputs, each once
    p10_ms: float | None = None
    p90_ms: float | None = None
    host_ms: float | None = None        # median host time until a timed call returned
    runs: int = 0
    clock: str = ""                          # "cuda-events" or "cpu" (CPU: not a product claim)
    cold_first_call_s: float | None = None   # first call of a fresh compile, incl. compiling
    recompile_first_call_s: float | None = None  # first call after torch._dynamo.reset()
    recompile_backend_s: float | None = None  # the backend's own share of it (its records)
    recompile_cached: bool | None = None      # every graph of the recompile came from its cache
    wall_s: float | None = None              # this backend's whole share of the task's time
    references_s: float | None = None        # the task's eager/fp64 references (shared)
    eager_deterministic: bool | None = None  # eager twice on the same inputs gave equal outputs
    determinism_max_abs: float | None = None
    eager_output_varies: bool | None = None  # eager's output differs across the input trials
    caches: str = ""                         # "fresh" (per-task compile caches) or "keep"
    backend_source: str = ""                 # where the backend came from (entry point, import)
    backend_records: list[Any] | None = None # the backend's own report (stitchcuda's records)
    error: str = ""                          # tail of the traceback / child's stderr
    env: dict[str, Any] = field(default_factory=dict)
    time_unix: float = 0.0

    def to_json(self) -> str:
        """One JSON line (NaN and infinities written as null: strict JSON)."""
        return json.dumps(_finite(asdict(self)), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchRecord":
        """Build from a parsed line, ignoring keys this version does not know."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def timed(self) -> bool:
        return self.status == OK and self.median_ms is not None and self.median_ms > 0

    @property
    def gb_per_s(self) -> float | None:
        """``io_bytes`` per median call: the least traffic a call can have, so a floor on
        the bandwidth achieved (meaningful for memory-bound problems)."""
        if not self.timed or not self.io_bytes:
            return None
        return self.io_bytes / (self.median_ms * 1e-3) / 1e9


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def append_records(path: Path, records: Iterable[BenchRecord]) -> None:
    """Append records to a JSON-lines file, flushed so a killed run keeps what it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for rec in records:
            f.write(rec.to_json() + "\n")
        f.flush()


def read_records(path: Path) -> list[BenchRecord]:
    """Records from a JSON-lines file; [] if absent. A torn last line (killed writer) is
    skipped; any other unparsable line raises ``ValueError`` naming the line."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[BenchRecord] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(BenchRecord.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}:{i + 1}: not a bench record: {exc}") from exc
    return out
