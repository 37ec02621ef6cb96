"""``implement(background=True)``: a graph's kernels compile on a background thread, and
``Implementation.finish()`` waits for them (the backend's first call does, before it
verifies), giving each candidate its cubin or dropping it with the reason."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from stitch_backend import toolchain
from stitch_backend.agents.loop import implement
from stitch_backend.agents.state import Task
from stitch_backend.backend import StitchBackend

TASK = Task("g", "k", "sm_90a", "cuda")


class TwoRegions(nn.Module):
    """A softmax, then a reduction of its sum with the input: fused regions the template
    Coder writes kernels for."""

    def forward(self, x):
        y = torch.softmax(x * 2.0, dim=-1)
        return (y + x).sum(dim=-1)


def _graph():
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(TwoRegions(), backend=backend)(torch.randn(8, 64))
    (rec,) = backend.records
    return rec


def _kernel(job, seconds):
    return toolchain.CompiledKernel(job.name, job.arch, b"\x7fELF", "", seconds, ["nvrtc"])


def test_the_compile_runs_behind_and_finish_waits_for_it(monkeypatch):
    rec = _graph()
    release, started = threading.Event(), threading.Event()
    threads = []

    def slow_compile_many(jobs, max_workers=None, on_done=None):
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30), "the test never released the compile"
        return [_kernel(job, 0.5) for job in jobs]

    monkeypatch.setattr(toolchain, "compile_many", slow_compile_many)
    impl = implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True)
    assert started.wait(30)
    # returned while the kernels compile: every proposal is a candidate, none has a cubin
    assert impl.candidates and all(c.cubin is None for c in impl.candidates.values())
    assert threads == [threads[0]] and threads[0] != threading.current_thread().name
    release.set()
    impl.finish()
    assert all(c.cubin == b"\x7fELF" for c in impl.candidates.values())
    n = sum(impl.compiled)
    assert n >= len(impl.candidates)
    assert impl.compile_note().startswith(f"{n} kernel(s) ")
    assert impl.compiler_s == (pytest.approx(0.5 * n), 0.5)
    impl.finish()     # once settled, finishing again changes nothing
    assert all(c.cubin == b"\x7fELF" for c in impl.candidates.values())


def test_a_candidate_that_does_not_compile_leaves_at_finish(monkeypatch):
    rec = _graph()

    def one_fails(jobs, max_workers=None, on_done=None):
        return [toolchain.CompileError(["nvrtc"], "error: broken", None) if i == 0
                else _kernel(job, 0.1) for i, job in enumerate(jobs)]

    monkeypatch.setattr(toolchain, "compile_many", one_fails)
    impl = implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True)
    before = dict(impl.candidates)
    impl.finish()
    (gone,) = set(before) - set(impl.candidates)
    assert rec.plan.regions[gone].reason.startswith("compile error: ")
    assert "error: broken" in before[gone].compile_error
    assert all(c.cubin == b"\x7fELF" for c in impl.candidates.values())


def test_a_compile_that_raises_leaves_every_region_on_aten_with_the_reason(monkeypatch):
    rec = _graph()

    def no_compiler(jobs, max_workers=None, on_done=None):
        raise toolchain.ToolchainError("libnvrtc could not be loaded")

    monkeypatch.setattr(toolchain, "compile_many", no_compiler)
    impl = implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True)
    ids = list(impl.candidates)
    assert ids
    impl.finish()
    assert impl.candidates == {}
    why = "compile failed: ToolchainError: libnvrtc could not be loaded"
    assert [rec.plan.regions[i].reason for i in ids] == [why] * len(ids)
    assert impl.notes == [f"{why}; every region runs on ATen"]


def test_a_forked_child_compiles_in_the_background_too(monkeypatch):
    """A child forked after the background thread started has no copy of it: its own
    compiles must not wait forever on the copied executor."""
    import os
    import time

    rec = _graph()
    monkeypatch.setattr(toolchain, "compile_many",
                        lambda jobs, max_workers=None, on_done=None: [_kernel(j, 0.1) for j in jobs])
    implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True).finish()  # thread up
    pid = os.fork()
    if pid == 0:                                   # the child: exit 0 once its compile is done
        try:
            impl = implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True)
            impl.finish()
            code = 0 if all(c.cubin for c in impl.candidates.values()) else 1
        except BaseException:
            code = 2
        os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's compile never finished")


def test_the_first_calls_verification_waits_then_sees_only_what_compiled(monkeypatch):
    """``CompileWait.before(verify)``, as the backend hands it to a Program: the wait
    comes first and is not counted as verification, a candidate that did not compile is
    no longer pending, and the compile is reported once."""
    from types import SimpleNamespace

    from stitch_backend.agents.loop import CompileWait

    rec = _graph()
    release = threading.Event()

    def one_fails_late(jobs, max_workers=None, on_done=None):
        assert release.wait(30)
        return [toolchain.CompileError(["nvrtc"], "error: broken", None) if i == 0
                else _kernel(job, 0.1) for i, job in enumerate(jobs)]

    monkeypatch.setattr(toolchain, "compile_many", one_fails_late)
    impl = implement(TASK, rec.gm, rec.plan, arch="sm_90a", background=True)
    notes: list[str] = []
    wait = CompileWait(impl, notes, report=True, background=True)
    program = SimpleNamespace(verify_s=0.0, pending=dict(impl.candidates))
    proposed = len(program.pending)
    seen = []

    def verify(prog, inputs):
        seen.append(sorted(prog.pending))
        return "verified"

    threading.Timer(0.3, release.set).start()
    assert wait.before(verify)(program, []) == "verified"
    assert seen == [sorted(impl.candidates)] and len(seen[0]) == proposed - 1
    assert program.verify_s <= -0.25          # the wait, taken off the verification's time
    (note,) = [n for n in notes if "compiled in" in n]
    assert note.startswith(impl.compile_note()) and "; the first call waited " in note
    wait.before(verify)(program, [])          # a second verification (a new shape): no wait,
    assert len([n for n in notes if "compiled in" in n]) == 1    # no second report
