"""The LLM Coder's place in the loop: extra candidates beside the template's.

With ``coder="template+llm"`` and an endpoint and model configured, the regions whose
template candidate is one compiled kernel get the LLM Coder's loop (screen, compile in
a child process, repair), regions in parallel. It runs at the Program's first call, once
``agents.hotspots`` has timed every region on the real inputs: the slowest regions go
first, and those outside the hottest ``llm_hot_percent`` of the graph's time are left
out (said in the graph's notes), so model calls are spent where the time is. Before
the loop, one more run on ATen keeps the chosen regions' real values (``agents.samples``,
bounded in memory): a candidate that compiles is launched once on them in a child
process, so a wrong result or a fault goes back to the model as a repair prompt within
the loop, not only to the Verifier afterwards. What comes out is attached to the
template candidate as ``alternatives``; acceptance runs each first in a child process,
then through the Verifier, and the fastest verified candidate wins. Nothing here
replaces or delays a template candidate beyond the loop's budget, and a missing
``openai`` package or an unreachable endpoint only costs the extras (said in a warning).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from stitch_backend import progress
from stitch_backend.logs import warn_once

from .hotspots import Hotspots
from .samples import Sampler, Samples
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


def eligible(templates: dict[int, Candidate], subtasks: dict[int, Subtask]) -> list[int]:
    """Region ids whose template candidate is one compiled kernel (what the LLM Coder's
    candidates replace, launched by the template's launch rule), in graph order."""
    return [rid for rid, c in templates.items()
            if c.stages is None and c.kernel is not None and rid in subtasks]


def first_call_extras(task: Task, subtasks: dict[int, Subtask],
                      templates: dict[int, Candidate], *, arch: str, cfg: Any,
                      trajectory: Trajectory, notes: list[str],
                      client: Any = None,
                      ) -> Callable[[Hotspots | None, Sampler | None], None] | None:
    """The hook ``acceptance.verify_first_call`` calls with the measured hotspots and a
    sampler of regions' real values: the LLM Coder's candidates for the hottest eligible
    regions, slowest first, each candidate run on its region's sample where one was kept
    (once; a Program verified again for a new shape keeps what the first call added).
    None when the settings do not ask for LLM candidates or no region is eligible."""
    regions = eligible(templates, subtasks)
    if (client is None and not wanted(cfg)) or not regions:
        return None
    done: list[bool] = []

    def add(spots: Hotspots | None, sample: Sampler | None = None) -> None:
        if done:
            return
        done.append(True)
        chosen = regions if spots is None else spots.hottest(regions,
                                                             cfg.llm_hot_percent / 100)
        if len(chosen) < len(regions):
            notes.append(f"LLM Coder: {len(chosen)} of {len(regions)} region(s), the "
                         f"slowest first, covering {cfg.llm_hot_percent}% of their ATen "
                         "time at the first call; the others keep the template's kernel")
        try:
            samples = _samples(sample, chosen, notes)
            llm_candidates(task, subtasks, templates, arch=arch, cfg=cfg,
                           trajectory=trajectory, client=client, regions=chosen,
                           samples=samples)
        except Exception as err:  # noqa: BLE001 - the optional Coder must not break the model
            from stitch_backend.config import llm_api_key

            from .llm import redact

            log.warning("LLM Coder failed on %s: %s: %s", task.graph, type(err).__name__,
                        redact(str(err), llm_api_key()))

    return add


def _samples(sample: Sampler | None, chosen: list[int], notes: list[str]) -> Samples:
    """The chosen regions' real values (none without a sampler), with a note for those
    left out for their size."""
    if sample is None:
        return Samples()
    got = sample(chosen)
    if got.left_out:
        notes.append(f"LLM Coder: {len(got.left_out)} region(s) too large to keep their "
                     f"first-call values (e.g. region {got.left_out[0]}): their candidates "
                     "get compile feedback only before the Verifier runs them")
    return got


def llm_candidates(task: Task, subtasks: dict[int, Subtask], templates: dict[int, Candidate],
                   *, arch: str, cfg: Any, trajectory: Trajectory, client: Any = None,
                   regions: Sequence[int] | None = None, samples: Samples | None = None,
                   child: list[str] | None = None) -> dict[int, list[Candidate]]:
    """Compiled LLM candidates per region id, also attached to ``templates[rid]`` as
    ``alternatives``, for ``regions`` (in that order; default: every eligible one, in
    graph order). A region with a sample in ``samples`` gets its candidates run on it
    and timed against its template there (``llm_coder.screen_compile_and_run``). Empty
    when the settings do not ask for them or no client can be made. ``client`` and
    ``child`` (the sandbox's child command) override the defaults (tests)."""
    from .llm import LLMUnavailable, client_from_config
    from .llm_coder import Budget, LLMCoder, screen_compile_and_run

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
    evaluate = screen_compile_and_run(arch, (samples or Samples()).regions,
                                      timeout_s=float(cfg.llm_sandbox_timeout_s),
                                      templates=templates, child=child)
    allowed = set(eligible(templates, subtasks))
    order = [rid for rid in (regions if regions is not None else sorted(allowed))
             if rid in allowed]
    if not order:
        return {}

    def one(rid: int) -> tuple[int, list[Candidate]]:
        try:
            return rid, coder.run(subtasks[rid], templates[rid], evaluate)
        finally:
            shown.update()

    # submitted in ``order``: with more regions than workers, the first ones start first
    with progress.bar(len(order), f"LLM Coder on {task.graph}", "region",
                      enabled=cfg.progress) as shown, ThreadPoolExecutor(
            max_workers=min(MAX_PARALLEL_REGIONS, len(order)),
            thread_name_prefix="stitchcuda-llm") as pool:
        results = list(pool.map(one, order))
    extras = {rid: cands for rid, cands in results if cands}
    for rid, cands in extras.items():
        templates[rid].alternatives += list(cands)
    log.info("LLM Coder: %d extra candidate(s) for %d of %d region(s) of %s",
             sum(map(len, extras.values())), len(extras), len(order), task.graph)
    return extras
