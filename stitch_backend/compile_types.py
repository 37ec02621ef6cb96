"""What goes into a compile and what comes out: ``CompileJob``, ``CompiledKernel`` and the
two errors (``stitch_backend.toolchain`` runs the compilers; ``nvrtc_pool`` pickles these
across its helper processes). Nothing here imports torch or touches a compiler."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

LOG_LINES_IN_STR = 40     # compiler log lines a CompileError's message shows


class ToolchainError(RuntimeError):
    """No compiler could be found or loaded (the message says where we looked)."""


class CompileError(RuntimeError):
    """A compile failed. Carries the command, the full compiler log and the source file."""

    def __init__(self, cmd: Sequence[str], log: str, source_path: Path | str | None):
        self.cmd = list(cmd)
        self.log = log
        self.source_path = Path(source_path) if source_path is not None else None
        super().__init__(self._render())

    def _render(self) -> str:
        lines = self.log.splitlines()
        shown = "\n".join(lines[:LOG_LINES_IN_STR])
        more = f"\n... ({len(lines) - LOG_LINES_IN_STR} more lines)" if len(lines) > LOG_LINES_IN_STR else ""
        return (
            f"CUDA compile failed\n  command: {' '.join(self.cmd)}\n  source: {self.source_path}\n"
            f"  log:\n{shown}{more}"
        )

    def __reduce__(self):  # picklable across process pools
        return (CompileError, (self.cmd, self.log, self.source_path))


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """A cubin for one arch. ``name`` is the extern "C" kernel to look up in it."""

    name: str
    arch: str
    cubin: bytes
    log: str
    seconds: float
    cmd: list[str]


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One unit of work for ``compile_many``."""

    source: str
    name: str
    arch: str
    include_dirs: tuple[str | Path, ...] = ()
    extra_flags: tuple[str, ...] = ()
    compiler: str = "auto"   # one of toolchain.COMPILERS
