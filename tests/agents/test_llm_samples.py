"""Region samples at the first call, and the LLM Coder's loop fed by them: a candidate
that compiles is run once on its region's real values in the sandbox's child process,
so a wrong result or a fault goes back to the model as a repair prompt.

The child here is a stand-in (no GPU on CI): it "compiles" to a fake cubin, "runs" by
computing the region's result with torch, right or wrong as the source says, and
"times" the candidate against the template as the source says."""

from __future__ import annotations

import sys

import pytest
import torch

from stitch_backend.agents.samples import RegionSample, Samples, capture

PY = sys.executable

# The stand-in child: argv[1] is the job folder the sandbox wrote.
FAKE_CHILD = r"""
import json, os, sys, torch
from pathlib import Path
from stitch_backend.agents.sandbox import _write_result, load_tensor, save_tensor
folder = Path(sys.argv[1])
job = json.loads((folder / "job.json").read_text())
source = (folder / "source.cu").read_text()
if job["mode"] == "compile":
    (folder / "kernel.cubin").write_bytes(b"\x7fELF stand-in")
    _write_result(folder, ok=True, stage="ok", reason="compiled", compile_s=0.0)
    sys.exit(0)
if "// crash" in source:
    os.abort()
x, y = [load_tensor(m, folder, "cpu") for m in job["input"]]
right = "// fixed" in source or "// slow" in source
out = torch.relu(x) * y + 1.0 if right else torch.zeros_like(x)
times = None
if "time" in job:
    assert (folder / job["time"]["baseline"]).read_bytes() == b"template cubin"
    times = {"candidate": 2.0 if "// slow" in source else 0.9, "baseline": 1.0}
_write_result(folder, ok=True, stage="ok", reason="ran", times=times,
              outputs=[save_tensor(out, folder / "result0.bin")])
"""


def _program():
    """A Program (on ATen) of three regions: a pointwise one, a matmul, a reduction."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.agents.planner import partition
    from stitch_backend.program import Program

    def fn(a, b):
        x = torch.relu(a) * b + 1.0
        y = torch.mm(x, b)
        return (torch.tanh(y).sum(0),)

    inputs = [torch.randn(64, 64), torch.randn(64, 64)]
    gm = make_fx(fn)(*inputs)
    plan = partition(gm, "g")
    return Program(gm, plan), plan, inputs


def test_capture_keeps_each_chosen_regions_values_as_aten_computes_them():
    program, plan, inputs = _program()
    ids = [r.id for r in plan.regions]
    assert len(ids) >= 2
    got = capture(program, inputs, ids, max_bytes=None)
    assert set(got.regions) == set(ids) and got.left_out == []
    first = got.regions[ids[0]]
    assert any(x is inputs[0] for x in first.inputs)       # held, not copied
    for rid, sample in got.regions.items():
        again = program.step_of(rid).aten(*sample.inputs)
        for want, have in zip(again, sample.outputs):
            torch.testing.assert_close(have, want)
    # the last region's output is the graph's
    (want,) = (torch.tanh(torch.mm(torch.relu(inputs[0]) * inputs[1] + 1.0, inputs[1]))
               .sum(0),)
    torch.testing.assert_close(got.regions[ids[-1]].outputs[0], want)


def test_capture_drops_the_least_wanted_regions_beyond_the_byte_bound():
    program, plan, inputs = _program()
    ids = [r.id for r in plan.regions]
    full = capture(program, inputs, ids, max_bytes=None)
    wanted = list(reversed(ids))                 # the last region is the most wanted
    bound = full.regions[wanted[0]].nbytes
    got = capture(program, inputs, wanted, max_bytes=bound)
    assert list(got.regions) == [wanted[0]]
    assert got.left_out == wanted[1:]            # most wanted first
    assert sum(s.nbytes for s in got.regions.values()) <= bound
    nothing = capture(program, inputs, wanted, max_bytes=0)
    assert nothing.regions == {} and nothing.left_out == wanted


def test_the_first_call_sampler_puts_the_generators_back():
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.agents.acceptance import _sampler
    from stitch_backend.agents.planner import partition
    from stitch_backend.program import Program

    gm = make_fx(lambda x: (torch.rand_like(x) + x,))(torch.randn(16))
    program = Program(gm, partition(gm, "g"))
    x = torch.randn(16)
    before = torch.get_rng_state()
    got = _sampler(program, [x])([r.id for r in program.plan.regions])
    assert got.regions
    assert torch.equal(torch.get_rng_state(), before)
    capture(program, [x], [r.id for r in program.plan.regions], max_bytes=None)
    assert not torch.equal(torch.get_rng_state(), before)   # capture alone draws


def test_the_hook_hands_its_samples_to_the_coder_and_notes_those_left_out(monkeypatch):
    from types import SimpleNamespace

    from stitch_backend import config as config_mod
    from stitch_backend.agents import llm_extras
    from stitch_backend.agents.hotspots import Hotspots
    from stitch_backend.agents.state import Task, Trajectory

    cfg = config_mod.Config().with_options({"coder": "template+llm",
                                            "llm_base_url": "http://127.0.0.1:9",
                                            "llm_model": "m", "llm_hot_percent": 100})
    templates = {rid: SimpleNamespace(stages=None, kernel=object(), alternatives=[])
                 for rid in (0, 1, 2)}
    subtasks = {rid: object() for rid in templates}
    handed, asked = [], []
    monkeypatch.setattr(llm_extras, "llm_candidates",
                        lambda *a, samples, **k: handed.append(samples) or {})
    kept = Samples(regions={2: RegionSample([], [])}, left_out=[1])

    def sampler(ids):
        asked.append(list(ids))
        return kept

    notes: list[str] = []
    task = Task(graph="g", key="k" * 64, arch="sm_90a", device="cuda")
    hook = llm_extras.first_call_extras(task, subtasks, templates, arch="sm_90a", cfg=cfg,
                                        trajectory=Trajectory(task=task), notes=notes)
    hook(Hotspots(clock="cuda-events", ms={0: 1.0, 1: 5.0, 2: 9.0}), sampler)
    assert asked == [[2, 1, 0]] and handed == [kept]
    assert len(notes) == 1 and "1 region(s) too large" in notes[0] and "region 1" in notes[0]


# --------------------------------------------------------------------------- the loop


def _sample(template):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return RegionSample([x, y], [torch.relu(x) * y + 1.0])


def _fenced(source: str) -> str:
    return f"Here it is.\n```cuda\n{source}```\n"


def _loop(llm_client, llm_server, template, *replies: str, samples: dict,
          templates: dict | None = None):
    """The LLM Coder's loop on the pointwise region, the model answering the template with
    each of ``replies`` appended, evaluated by ``screen_compile_and_run`` and the stand-in
    child: (accepted candidates, each evaluation's feedback line)."""
    from stitch_backend.agents.llm_coder import Budget, LLMCoder, screen_compile_and_run
    from stitch_backend.agents.state import Task, Trajectory

    sub, template = template
    llm_server.reply(*[_fenced(template.source + r) for r in replies])
    evaluate = screen_compile_and_run("sm_90a", samples, timeout_s=60, templates=templates,
                                      child=[PY, "-c", FAKE_CHILD])
    task = Task(graph="g", key="0" * 64, arch="sm_90a", device="cuda")
    coder = LLMCoder(llm_client, Budget(iterations=3), trajectory=Trajectory(task))
    got = coder.run(sub, template, evaluate)
    return got, [a.feedback for a in coder.trajectory.attempts if a.action == "evaluate"]


@pytest.mark.parametrize("first,kind,said", [
    ("// first\n", "wrong:", "wrong result"),      # ran, result not ATen's
    ("// crash\n", "run:", "failed"),              # the child died in its first run
])
def test_a_wrong_or_crashing_first_run_on_the_real_inputs_goes_back_to_the_model(
        llm_server, llm_client, pointwise_region, first, kind, said):
    sub, template = pointwise_region
    got, feedback = _loop(llm_client, llm_server, pointwise_region, first, "// fixed\n",
                          samples={sub.region_id: _sample(template)})
    assert len(llm_server.requests) == 2
    repair = llm_server.prompts[1]
    assert said in repair and "real inputs" in repair
    assert feedback[0].startswith(kind) and feedback[1].startswith("ok:")
    (fixed,) = got
    assert fixed.source == template.source + "// fixed\n"
    assert fixed.cubin == b"\x7fELF stand-in"


def test_without_a_sample_the_loop_gets_compile_feedback_only(llm_server, llm_client,
                                                              pointwise_region):
    _, template = pointwise_region
    got, feedback = _loop(llm_client, llm_server, pointwise_region, "// first\n", samples={})
    assert len(llm_server.requests) == 1 and feedback == ["ok: compiled"]
    assert [c.source for c in got] == [template.source + "// first\n"]


def test_a_correct_but_clearly_slower_candidate_is_asked_to_optimise(llm_server, llm_client,
                                                                     pointwise_region):
    import dataclasses

    sub, template = pointwise_region
    sample = _sample(template)
    sample.aten_ms = 1.5
    compiled = {sub.region_id: dataclasses.replace(template, cubin=b"template cubin")}
    got, feedback = _loop(llm_client, llm_server, pointwise_region, "// slow\n",
                          "// fixed\n", samples={sub.region_id: sample}, templates=compiled)
    assert feedback[0].startswith("slow:") and "2.0000 ms against 1.0000 ms" in feedback[0]
    optimise = llm_server.prompts[1]
    assert all(ms in optimise for ms in ("1.5000", "1.0000", "2.0000")), optimise
    assert feedback[1].startswith("ok:") and "0.9000 ms a launch" in feedback[1]
    assert [c.source for c in got] == [template.source + "// fixed\n"]
