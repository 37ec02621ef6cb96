"""The channels-last decision for one graph (``layout`` rewrites, ``layout_auto`` holds
``auto``'s rules, ``layout_race`` races both layouts): whether the pass considers the
graph at all, the layout an earlier process's race kept (the cache's notes), a forced
choice (the race's second Program), or ``auto``'s rules."""

from __future__ import annotations

from typing import Any

import torch.fx

from . import layout
from .layout_auto import auto_declines, few_positions
from .layout_race import remembered_layout


def considered(config: Any, gm: torch.fx.GraphModule, stage: str, runs_kernels: bool,
               dynamic: bool) -> bool:
    """Whether the layout pass looks at ``gm``: an inference graph with convolutions and
    static sizes whose kernels run (CUDA, or the CPU interpreter), the option not off."""
    return (config.channels_last is not False and stage == "inference" and runs_kernels
            and not dynamic and bool(layout.convolutions(gm)))


def decide(config: Any, notes: Any, gm: torch.fx.GraphModule, forced: bool | None,
           arch: str) -> tuple[torch.fx.GraphModule, layout.LayoutResult]:
    """``gm`` with its convolutions channels-last where that applies, and what was done.
    ``forced``: the layout race's other choice (True: the rewrite as ``channels_last=True``
    makes it; False: the traced layout). Under ``auto`` with the race allowed, a verdict
    an earlier race stored in ``notes`` (the cache's Store, or None) is such a choice,
    and the result's ``remembered`` says so (no race then)."""
    if forced is None and config.channels_last is None and config.layout_race is not False:
        kept, why = remembered_layout(notes, gm, config.code_options(), arch)
        if kept is not None:
            new, result = decide(config, notes, gm, kept, arch)
            result.remembered = why
            return new, result
    if forced is False:
        return gm, layout.LayoutResult(False, "layout race: the traced layout")
    if forced:
        return layout.to_channels_last(gm, notes, partial=True)
    if config.channels_last is None:
        why = auto_declines(gm)
        if why is not None:
            return gm, layout.LayoutResult(False, why, guess=why == few_positions(gm))
    return layout.to_channels_last(gm, notes, partial=config.channels_last is True)


__all__ = ["considered", "decide"]
