"""compile_many's NVRTC helper processes (stitch_backend.nvrtc_pool): same cubins as an
in-process compile, failures in their slots, and threads when the helpers cannot run."""

import logging
import re
import subprocess
import sys

import pytest

from stitch_backend import nvrtc_pool, toolchain

KERNEL = r"""
#include "common.cuh"
extern "C" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, int n) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = sc_gelu_erf(x[i]) * {k}.0f;
}}
"""
BAD = 'extern "C" __global__ void broken(float* y) { y[0] = undefined_symbol_here; }'


@pytest.fixture(autouse=True)
def _nvrtc(monkeypatch):
    try:
        toolchain.load_nvrtc()
    except toolchain.ToolchainError as e:
        pytest.skip(f"libnvrtc does not load here: {str(e).splitlines()[0]}")
    monkeypatch.setattr(nvrtc_pool, "_warned", False)
    toolchain.clear_memo()
    yield
    toolchain.clear_memo()


def _jobs(n):
    return [toolchain.CompileJob(KERNEL.format(name=f"k{i}", k=i), f"k{i}", "sm_90a", compiler="nvrtc")
            for i in range(n)]


def _in_process(jobs):
    toolchain.clear_memo()
    out = [toolchain.compile_nvrtc(j.source, j.name, j.arch) for j in jobs]
    toolchain.clear_memo()
    return out


def test_helpers_give_the_in_process_cubins_and_fill_the_memo(monkeypatch):
    jobs = _jobs(4)
    started = []
    real = nvrtc_pool.command
    monkeypatch.setattr(nvrtc_pool, "command", lambda lib: started.append(lib) or real(lib))
    ticks = []
    got = toolchain.compile_many(jobs, max_workers=2, on_done=lambda: ticks.append(1))
    assert len(started) == 2 and len(ticks) == 4
    want = _in_process(jobs)
    assert [k.name for k in got] == ["k0", "k1", "k2", "k3"]
    assert [k.cubin for k in got] == [k.cubin for k in want]      # byte for byte
    assert all(k.cmd == w.cmd for k, w in zip(got, want))
    # the parent's memo holds what the helpers compiled: no helper for a second batch
    toolchain.compile_many(jobs, max_workers=2)
    started.clear()
    again = toolchain.compile_many(jobs, max_workers=2)
    assert started == [] and [k.cubin for k in again] == [k.cubin for k in want]


def test_sources_are_logged_when_asked_as_in_process(caplog):
    with caplog.at_level(logging.DEBUG, logger="stitch_backend.output_code"):
        toolchain.compile_many(_jobs(2), max_workers=2)
    code = [r.getMessage() for r in caplog.records if r.name == "stitch_backend.output_code"]
    assert len(code) == 2 and all("sc_gelu_erf" in c for c in code)


def test_a_compile_error_stays_in_its_slot():
    jobs = [_jobs(1)[0], toolchain.CompileJob(BAD, "broken", "sm_90a", compiler="nvrtc"), _jobs(2)[1]]
    got = toolchain.compile_many(jobs, max_workers=3)
    assert isinstance(got[0], toolchain.CompiledKernel) and isinstance(got[2], toolchain.CompiledKernel)
    assert isinstance(got[1], toolchain.CompileError)
    assert "undefined_symbol_here" in got[1].log and got[1].cmd[0] == "nvrtc"
    assert got[1].source_path.read_text() == BAD


@pytest.mark.parametrize("helper, why", [
    (["/nonexistent/python3"], "could not start"),
    ([sys.executable, "-c", "import sys; sys.stderr.write('helper broke\\n'); sys.exit(3)"],
     "exited with 3 .*helper broke"),
])
def test_helpers_that_cannot_serve_leave_the_jobs_to_threads(monkeypatch, caplog, helper, why):
    monkeypatch.setattr(nvrtc_pool, "command", lambda lib: helper)
    jobs = _jobs(3)
    ticks = []
    with caplog.at_level(logging.WARNING, logger="stitch_backend.nvrtc_pool"):
        got = toolchain.compile_many(jobs, max_workers=2, on_done=lambda: ticks.append(1))
    assert [k.cubin for k in got] == [k.cubin for k in _in_process(jobs)]
    assert len(ticks) == 3
    warned = [r.getMessage() for r in caplog.records if "NVRTC helper process unavailable" in r.getMessage()]
    assert len(warned) == 1, warned                         # once, not once a helper
    assert re.search(why, warned[0]), warned[0]


def test_a_frozen_application_compiles_in_threads(monkeypatch, caplog):
    monkeypatch.setattr(sys, "frozen", True, raising=False)    # sys.executable: the app
    monkeypatch.setattr(nvrtc_pool, "command", lambda lib: pytest.fail("started a helper"))
    with caplog.at_level(logging.WARNING, logger="stitch_backend.nvrtc_pool"):
        got = toolchain.compile_many(_jobs(2), max_workers=2)
    assert all(isinstance(k, toolchain.CompiledKernel) for k in got)
    assert "frozen application" in caplog.text


def test_one_job_or_one_worker_compiles_here(monkeypatch):
    def refuse(lib):
        raise AssertionError("no helper for a single job or a single worker")
    monkeypatch.setattr(nvrtc_pool, "command", refuse)
    assert isinstance(toolchain.compile_many(_jobs(1), max_workers=4)[0], toolchain.CompiledKernel)
    assert all(isinstance(k, toolchain.CompiledKernel)
               for k in toolchain.compile_many(_jobs(3), max_workers=1))


def test_the_helper_imports_neither_torch_nor_the_working_directory(tmp_path):
    # a stitch_backend/ in the working directory must not shadow the installed package
    (tmp_path / "stitch_backend").mkdir()
    (tmp_path / "stitch_backend" / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    lib = toolchain.load_nvrtc()._name
    code = nvrtc_pool.command(lib)[2].replace(
        "from stitch_backend.nvrtc_pool import serve; serve(sys.argv[1])",
        "import stitch_backend.nvrtc_pool as m; print('torch' in sys.modules, m.__file__)")
    out = subprocess.run([sys.executable, "-c", code, lib], cwd=tmp_path, env=nvrtc_pool.helper_env(),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", nvrtc_pool.__file__]


def test_the_longest_sources_go_first(monkeypatch):
    order = []
    real = nvrtc_pool._Worker.compile

    def spy(self, source, name, arch, options):
        order.append(name)
        return real(self, source, name, arch, options)

    monkeypatch.setattr(nvrtc_pool._Worker, "compile", spy)
    monkeypatch.setattr(nvrtc_pool, "MAX_PROCESSES", 1)
    jobs = [toolchain.CompileJob(KERNEL.format(name=f"k{i}", k=i) + "//" + "x" * (100 * i), f"k{i}",
                                 "sm_90a", compiler="nvrtc") for i in (1, 3, 0, 2)]
    got = toolchain.compile_many(jobs, max_workers=4)
    assert order == ["k3", "k2", "k1", "k0"] and [k.name for k in got] == ["k1", "k3", "k0", "k2"]
