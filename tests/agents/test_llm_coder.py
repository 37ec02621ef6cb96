"""The LLM Coder's loop against a scripted endpoint through the real openai client:
format errors, screen rejections, compile errors and slow kernels are routed back to the
model; the budget ends the loop; the trajectory holds every step and never the key."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from stitch_backend.agents.llm import LLMError
from stitch_backend.agents.llm_coder import (Budget, Feedback, FormatError, LimitsExceeded,
                                             LLMCoder, extract_cuda, screen_and_compile)
from stitch_backend.agents.screen import parse_entry, screen
from stitch_backend.agents.state import Task, Trajectory

pytest.importorskip("openai")

TASK = Task(graph="g", key="0" * 64, arch="sm_90a", device="cuda")


def _fenced(source: str, note: str = "Here it is.") -> str:
    return f"{note}\n```cuda\n{source}```\n"


def _coder(client, tmp_path=None, **budget) -> LLMCoder:
    return LLMCoder(client, Budget(**budget), trajectory=Trajectory(TASK),
                    trajectory_path=tmp_path / "traj.jsonl" if tmp_path else None)


def _always(*feedbacks: Feedback):
    seen = []

    def evaluate(cand):
        seen.append(cand)
        return feedbacks[min(len(seen), len(feedbacks)) - 1]

    evaluate.seen = seen
    return evaluate


def _screen_only(cand):
    verdict = screen(cand.source, parse_entry(cand.kernel.source))
    return Feedback("ok", "passed") if verdict.ok else Feedback(
        "screen", f"the static screen refused it: {verdict.reason}")


def test_extract_cuda_wants_exactly_one_block():
    assert extract_cuda("x\n```cuda\nint a;\n```\n") == "int a;\n"
    with pytest.raises(FormatError, match="found 0"):
        extract_cuda("no code at all")
    with pytest.raises(FormatError, match="found 2"):
        extract_cuda("```cuda\na\n```\n```cuda\nb\n```")
    with pytest.raises(FormatError, match="found 0"):
        extract_cuda("```python\nprint()\n```")


def test_a_reply_without_a_cuda_block_is_repaired(llm_server, llm_client, pointwise_region):
    sub, template = pointwise_region
    llm_server.reply("I would rather explain it in words.", _fenced(template.source))
    coder = _coder(llm_client)
    got = coder.run(sub, template, _always(Feedback("ok", "fine")))
    assert len(got) == 1 and got[0].source == template.source and got[0].origin == "llm"
    assert got[0].kernel is template.kernel and got[0].signature == template.signature
    first, second = llm_server.prompts
    assert template.source.strip() in first and "aten.relu.default" in first
    assert "exactly one ```cuda" in second
    actions = [(a.action, (a.feedback or "")[:6]) for a in coder.trajectory.attempts]
    assert actions == [("generate", "format"), ("repair", ""), ("evaluate", "ok: fi")]


def test_propose_raises_format_error_itself(llm_server, llm_client, pointwise_region):
    sub, template = pointwise_region
    llm_server.reply("```cuda\na\n```\n```cuda\nb\n```")
    with pytest.raises(FormatError):
        _coder(llm_client).propose(sub, template)


def test_a_screen_rejection_goes_back_to_the_model(llm_server, llm_client, pointwise_region):
    sub, template = pointwise_region
    bad = template.source.replace("const int n = (32);", 'const int n = (32); printf("hi");')
    llm_server.reply(_fenced(bad), _fenced(template.source))
    got = _coder(llm_client).run(sub, template, _screen_only)
    assert len(got) == 1
    assert "printf" in llm_server.prompts[1] and "rejected" in llm_server.prompts[1]


@pytest.mark.nvcc
def test_a_compile_error_leads_to_a_repair_prompt_with_the_nvcc_log(llm_server, llm_client,
                                                                    pointwise_region):
    sub, template = pointwise_region
    broken = template.source.replace("sfk_relu", "sfk_reluu")
    llm_server.reply(_fenced(broken), _fenced(template.source))
    got = _coder(llm_client).run(sub, template, screen_and_compile("sm_90a"))
    assert len(got) == 1 and got[0].cubin[:4] == b"\x7fELF"
    repair = llm_server.prompts[1]
    assert 'identifier "sfk_reluu" is undefined' in repair and "nvcc" in repair


def test_correct_but_slow_asks_to_optimise_with_the_times(llm_server, llm_client,
                                                         pointwise_region):
    sub, template = pointwise_region
    llm_server.reply(_fenced(template.source), _fenced(template.source + "// faster\n"))
    slow = Feedback("slow", "not faster", eager_ms=1.0, template_ms=0.5, candidate_ms=0.8)
    got = _coder(llm_client).run(sub, template, _always(slow, Feedback("ok", "fast")))
    assert got and got[0].source.endswith("// faster\n")
    prompt = llm_server.prompts[1]
    assert "not fast enough" in prompt
    assert "1.0000" in prompt and "0.5000" in prompt and "0.8000" in prompt


def test_the_budget_ends_the_loop(llm_server, llm_client, pointwise_region):
    sub, template = pointwise_region
    llm_server.reply(*[_fenced(template.source)] * 10)
    wrong = Feedback("wrong", "wrong result: max abs 3")
    evaluate = _always(wrong)
    coder = _coder(llm_client, iterations=3)
    assert coder.run(sub, template, evaluate) == []
    assert len(llm_server.requests) == 3 and len(evaluate.seen) == 3
    assert "wrong result: max abs 3" in llm_server.prompts[1]
    with pytest.raises(LimitsExceeded, match="3 model calls"):
        coder.repair(evaluate.seen[-1], wrong)
    assert len(llm_server.requests) == 3

    tokens = _coder(llm_client, tokens=1)
    assert tokens.run(sub, template, evaluate) == [] and len(llm_server.requests) == 4
    clock = _coder(llm_client, seconds=0)
    assert clock.run(sub, template, evaluate) == [] and len(llm_server.requests) == 4


def test_an_endpoint_failure_ends_the_loop_with_a_warning(llm_server, llm_client,
                                                         pointwise_region, caplog):
    sub, template = pointwise_region
    llm_server.reply((400, "model not found"))
    assert _coder(llm_client).run(sub, template, _always(Feedback("ok", ""))) == []
    assert llm_server.url in caplog.text and "400" in caplog.text


def test_the_key_is_in_no_trajectory_log_or_exception(llm_server, llm_client, llm_secret,
                                                      pointwise_region, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    sub, template = pointwise_region
    llm_server.reply("no block", _fenced(template.source), _fenced(template.source))
    coder = _coder(llm_client, tmp_path)
    wrong = Feedback("wrong", "wrong result")
    got = coder.run(sub, template, _always(wrong, Feedback("ok", "")))
    assert got
    llm_server.reply((401, f"Incorrect API key provided: {llm_secret}"))
    with pytest.raises(LLMError) as info:
        coder.propose(sub, template)
    coder.trajectory.save(tmp_path / "saved.jsonl")
    lines = (tmp_path / "traj.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["action"] for r in records] == ["generate", "repair", "evaluate", "repair",
                                              "evaluate"]
    gen = records[0]["llm"]
    assert gen["messages"][0]["role"] == "system" and gen["reply"] == "no block"
    assert gen["prompt_tokens"] > 0 and records[1]["candidate"]["source"] == template.source
    for text in ((tmp_path / "traj.jsonl").read_text(), (tmp_path / "saved.jsonl").read_text(),
                 caplog.text, str(info.value), repr(info.value), repr(coder.client)):
        assert llm_secret not in text
    assert llm_server.requests[0]["headers"]["authorization"].endswith(llm_secret)


@pytest.mark.nvcc
def test_first_call_adds_compiled_llm_candidates_beside_the_template(llm_server, llm_secret,
                                                                   tmp_path, monkeypatch):
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend import config as config_mod
    from stitch_backend.agents.llm_extras import first_call_extras
    from stitch_backend.agents.loop import implement
    from stitch_backend.agents.planner import partition

    monkeypatch.setenv("STITCHCUDA_LLM_API_KEY", llm_secret)
    gm = make_fx(lambda x, y: (torch.relu(x) * y + 1.0,))(torch.randn(4, 8), torch.randn(4, 8))
    plan = partition(gm, "g")
    cfg = config_mod.Config().with_options({
        "coder": "template+llm", "llm_base_url": llm_server.url, "llm_model": "scripted",
        "llm_trajectory_dir": str(tmp_path / "traj")})
    template_source = []

    # The scripted server answers strings; let it answer the template it was sent.
    original = llm_server._next

    def echo_next(body, headers):
        item = original(body, headers)
        if item == "ECHO":
            src = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
            template_source.append(src.split("```cuda\n", 1)[1].split("```", 1)[0])
            return _fenced(template_source[-1])
        return item

    llm_server._next = echo_next
    llm_server.reply("ECHO")
    impl = implement(TASK, gm, plan, arch="sm_90a", config=cfg)
    (rid,) = impl.candidates
    template = impl.candidates[rid]
    assert template.origin == "template" and template.cubin is not None
    # the model is asked at the first call, once the regions are timed on real inputs
    assert template.alternatives == [] and llm_server.requests == []
    hook = first_call_extras(TASK, impl.subtasks, impl.candidates, arch="sm_90a", cfg=cfg,
                             trajectory=impl.trajectory, notes=[])
    hook(None)
    (extra,) = template.alternatives
    assert extra.origin == "llm" and not extra.trusted and extra.cubin[:4] == b"\x7fELF"
    assert extra.source.strip() == template.source.strip() == template_source[0].strip()
    assert extra.kernel is template.kernel
    files = list((tmp_path / "traj").glob("*.jsonl"))
    assert len(files) == 1 and llm_secret not in files[0].read_text()
    assert [a.action for a in impl.trajectory.attempts] == ["generate", "generate", "evaluate"]


def test_llm_candidates_only_when_coder_endpoint_and_model_are_set():
    from stitch_backend import config as config_mod
    from stitch_backend.agents import llm_extras

    assert not llm_extras.wanted(config_mod.Config())
    assert not llm_extras.wanted(config_mod.Config(coder="template+llm"))  # no endpoint
    assert llm_extras.wanted(config_mod.Config(coder="template+llm", llm_base_url="http://x",
                                               llm_model="m"))


def test_acceptance_runs_no_untrusted_kernel_without_the_sandbox(pointwise_region):
    import dataclasses

    from stitch_backend.agents.acceptance import _judge
    from stitch_backend.agents.verifier import Verifier

    _, template = pointwise_region
    llm = dataclasses.replace(template, origin="llm", cubin=b"\x7fELF...", alternatives=[])
    ran = []

    class Step:
        aten = staticmethod(lambda *xs: ran.append("aten"))
        region = type("R", (), {"id": 0})()

    runner, verdict = _judge(llm, Step, [torch.randn(4, 8), torch.randn(4, 8)], [],
                             Verifier(), lambda c: ran.append("loaded"))
    assert runner is None and not verdict.ok and "only on CUDA" in verdict.reason
    assert ran == []
    no_cubin = dataclasses.replace(llm, cubin=None)
    assert "single compiled kernel" in _judge(no_cubin, Step, [], [], Verifier(),
                                              lambda c: None)[1].reason
