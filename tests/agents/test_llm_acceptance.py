"""End to end on a GPU: an LLM candidate (here the scripted endpoint echoes the template
kernel back) is compiled in a child, run in a child on its region's first-call values
within the loop, first run in a child again at acceptance, verified, and timed against
the template; the fastest verified one runs, and the cache keeps template kernels only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("openai")


def _echo_template(llm_server):
    original = llm_server._next

    def echo(body, headers):
        item = original(body, headers)
        if item != "ECHO":
            return item
        user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        src = user.split("```cuda\n", 1)[1].split("```", 1)[0]
        return f"```cuda\n{src}```\n"

    llm_server._next = echo


@pytest.mark.gpu
def test_llm_candidates_are_sandboxed_verified_and_raced(llm_server, llm_secret, monkeypatch):
    from stitch_backend.backend import StitchBackend

    monkeypatch.setenv("STITCHCUDA_CODER", "template+llm")
    monkeypatch.setenv("STITCHCUDA_LLM_BASE_URL", llm_server.url)
    monkeypatch.setenv("STITCHCUDA_LLM_MODEL", "scripted")
    monkeypatch.setenv("STITCHCUDA_LLM_API_KEY", llm_secret)
    monkeypatch.setenv("STITCHCUDA_REQUIRE_SPEEDUP", "0")
    _echo_template(llm_server)
    llm_server.reply(*["ECHO"] * 8)

    def fn(x, y):
        return torch.relu(x) * y + 1.0

    x, y = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    backend = StitchBackend()
    compiled = torch.compile(fn, backend=backend)
    first = compiled(x, y)
    second = compiled(x, y)
    torch.testing.assert_close(first, fn(x, y))
    torch.testing.assert_close(second, fn(x, y))
    attempts = [a for t in backend.trajectories for a in t.attempts]
    llm_verdicts = [a.verdict for a in attempts
                    if a.action == "verify" and a.candidate.origin == "llm"]
    assert llm_verdicts and all(v.correct for v in llm_verdicts), llm_verdicts
    # within the loop, each compiled candidate already ran once on its region's real values
    evaluated = [a.feedback for a in attempts if a.action == "evaluate"]
    assert evaluated and all("real inputs matched ATen" in f for f in evaluated), evaluated
    regions = [r for rec in backend.records for r in rec.plan.regions if r.backend == "kernel"]
    assert regions and all(r.kernel for r in regions)
