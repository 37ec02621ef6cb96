"""The LLM Coder's place in the loop: extra candidates beside the template's.

With ``coder="template+llm"`` and an endpoint and model configured, every region whose
template candidate is one compiled kernel gets the LLM Coder's loop (screen, compile in
a child process, repair), regions in parallel. What comes out is attached to the
template candidate as ``alternatives``; acceptance runs each first in a child process,
then through the Verifier, and the fastest verified candidate wins. Nothing here
replaces or delays a template candidate beyond the loop's budget, and a missing
``openai`` package or an unreachable endpoint only costs the extras (said in a warning).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stitch_backend.logs import warn_once

from .state import Candidate, Subtask, Task, Trajectory

log = logging.getLogger("stitch_backend.agents.llm_extras")

MAX_PARALLEL_REGIONS = 4


def wanted(cfg: Any) -> bool:
    """Whether the settings ask for LLM candidates (and say where to get them)."""
    return cfg.coder == "template+llm" and bool(cfg.llm_base_url) and bool(cfg.llm_model)


def trajectory_path(cfg: Any, task: Task) -> Path | None:
    """Where this graph's LLM trajectory is appended, or None (memory only)."""
    if not cfg.llm_trajectory_dir:
        return None
    return Path(cfg.llm_trajectory_dir).expanduser() / f"{task.graph}_{task.key[:12]}.jsonl"


def llm_candidates(task: Task, subtasks: dict[int, Subtask], templates: dict[int, Candidate],
                   *, arch: str, cfg: Any, trajectory: Trajectory,
                   client: Any = None) -> dict[int, list[Candidate]]:
    """Compiled LLM candidates per region id, also attached to ``templates[rid]`` as
    ``alternatives``. Empty when the settings do not ask for them or no client can be
    made. ``client`` overrides the one the settings describe (tests)."""
    from .llm import LLMUnavailable, client_from_config
    from .llm_coder import Budget, LLMCoder, screen_and_compile

    if client is None:
        if not wanted(cfg):
            return {}
        try:
            client = client_from_config(cfg)
        except LLMUnavailable as err:
            warn_once(log, "llm-unavailable", f"stitchcuda: no LLM candidates: {err}")
            return {}
    budget = Budget(iterations=cfg.llm_iterations, tokens=cfg.llm_budget_tokens,
                    seconds=float(cfg.llm_budget_s))
    coder = LLMCoder(client, budget, arch=arch, trajectory=trajectory,
                     trajectory_path=trajectory_path(cfg, task))
    evaluate = screen_and_compile(arch, timeout_s=float(cfg.llm_sandbox_timeout_s))
    eligible = [rid for rid, c in templates.items()
                if c.stages is None and c.kernel is not None and rid in subtasks]
    if not eligible:
        return {}

    def one(rid: int) -> tuple[int, list[Candidate]]:
        return rid, coder.run(subtasks[rid], templates[rid], evaluate)

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_REGIONS, len(eligible)),
                            thread_name_prefix="stitchcuda-llm") as pool:
        results = list(pool.map(one, eligible))
    extras = {rid: cands for rid, cands in results if cands}
    for rid, cands in extras.items():
        templates[rid].alternatives += list(cands)
    log.info("LLM Coder: %d extra candidate(s) for %d of %d region(s) of %s",
             sum(map(len, extras.values())), len(extras), len(eligible), task.graph)
    return extras
