"""Warm start without the Coder: a verified kernel's launches, stored beside its cubin.

A kernel's launch for one input layout (output shapes and strides, workspaces, grid,
block, size arguments) is derived once and memoised (``codegen.fused.Layout``); the
layouts a kernel had when it was verified go into the cache manifest with the candidate's
stage structure. On a cache hit of a static-shape graph, ``RecordedKernel`` launches
from those layouts, so nothing is regenerated. An input layout that was not recorded
(which Dynamo's guards make unexpected for a static graph) regenerates the kernel through
the Coder and launches from its IR, as a cold start would.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from .codegen.fused import Layout, LaunchPlan, key_from_json, key_to_json, launch_plan, layout_key

log = logging.getLogger("stitch_backend.recorded")

FORMAT = 1  # bump when the record's fields change; other formats fall back to regeneration


def kernel_record(kernel: Any) -> dict[str, Any]:
    """What the manifest keeps of one generated kernel (a ``FusedKernel``)."""
    layouts = getattr(kernel, "_layouts", {}) or {}
    return {"entry": kernel.entry, "signature": kernel.signature,
            "resident": bool(getattr(kernel, "resident", False)),
            "layouts": [{"key": key_to_json(k), "layout": v.to_json()} for k, v in layouts.items()]}


class RecordedKernel:
    """Stands in for a ``FusedKernel`` in a ``KernelRunner``: ``entry``, ``signature``,
    ``name``, ``resident`` (its launch flag; absent from records before it, where no
    kernel had it) and ``prepare``; ``regenerate()`` gives the real kernel when needed."""

    def __init__(self, record: dict[str, Any], regenerate: Callable[[], Any]):
        self.entry = self.name = str(record["entry"])
        self.signature = str(record["signature"])
        self.resident = bool(record.get("resident", False))
        self._layouts = {key_from_json(item["key"]): Layout.from_json(item["layout"])
                         for item in record["layouts"]}
        if not self._layouts:
            raise ValueError(f"kernel {self.entry}: no recorded launch")
        self._regenerate = regenerate
        self._kernel: Any = None
        self._lock = threading.Lock()

    def prepare(self, inputs: Sequence[torch.Tensor | int]) -> LaunchPlan:
        layout = self._layouts.get(layout_key(inputs))
        if layout is not None:
            return launch_plan(layout, inputs)
        return self.regenerated().prepare(inputs)

    def regenerated(self) -> Any:
        """The kernel as the Coder makes it now (once); its entry must be the stored one."""
        with self._lock:
            if self._kernel is None:
                kernel = self._regenerate()
                if kernel.entry != self.entry or kernel.signature != self.signature:
                    raise ValueError(f"kernel {self.entry}: regenerated as {kernel.entry} "
                                     f"({kernel.signature}), stored {self.signature}")
                log.info("kernel %s: input layout not recorded, regenerated", self.entry)
                self._kernel = kernel
        return self._kernel


__all__ = ["FORMAT", "RecordedKernel", "kernel_record"]
