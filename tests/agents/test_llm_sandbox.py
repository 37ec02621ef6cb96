"""The sandbox: a child that hangs, crashes or is killed is a rejection with the reason;
untrusted source compiles in the child; the launch in the child needs a GPU."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from stitch_backend.agents.sandbox import (compile_in_child, first_run_in_child, launch_spec,
                                           load_tensor, run_child, save_tensor)

PY = sys.executable


def _child(code: str) -> list[str]:
    return [PY, "-c", code]  # the job folder is appended and ignored


def test_a_hanging_child_is_killed_with_its_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.perf_counter()
    res = compile_in_child("// src", "k", "sm_90a", timeout_s=1.5, child=_child(code))
    assert time.perf_counter() - t0 < 10
    assert not res.ok and res.stage == "timeout" and "1.5 s timeout" in res.reason
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after the group is killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child's own child survived the timeout")


@pytest.mark.parametrize("code,why", [
    ("import os; os.abort()", "SIGABRT"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ("import ctypes; ctypes.string_at(0)", "SIGSEGV"),
    ("import sys; print('bad things'); sys.exit(7)", "status 7"),
], ids=["abort", "killed", "segfault", "exit_without_result"])
def test_a_child_that_dies_is_a_rejection_with_the_reason(code, why):
    res = compile_in_child("// src", "k", "sm_90a", timeout_s=30, child=_child(code))
    assert not res.ok and res.stage == "crash" and why in res.reason, res.reason


def test_the_child_gets_no_api_keys(monkeypatch):
    monkeypatch.setenv("STITCHCUDA_LLM_API_KEY", "sk-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    code = "import os, sys; sys.exit(3 if 'sk-secret' in str(os.environ) else 0)"
    out = run_child(_child(code), timeout_s=30)
    assert out.returncode == 0 and not out.timed_out


def test_tensors_round_trip_as_bytes_with_strides_and_offset(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    view = base[1:5, 2:9:2]                       # offset, non-contiguous
    for i, x in enumerate([view, view.to(torch.bfloat16), base > 30, torch.tensor(3.5),
                           torch.empty(0, 4)]):
        meta = save_tensor(x, tmp_path / f"t{i}.bin")
        y = load_tensor(meta, tmp_path, "cpu")
        assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
        assert torch.equal(y, x)


def test_launch_spec_maps_every_pointer_to_its_tensor(reduction_region):
    _, template = reduction_region
    kernel = template.kernel
    inputs = [torch.randn(512, 256)]
    plan = kernel.prepare(inputs)
    spec = launch_spec(plan, inputs, kernel.signature)
    assert spec["grid"] == list(plan.grid) and spec["block"] == list(plan.block)
    kinds = [ref[0] for ref in spec["args"]]
    assert kinds == ["input", "output", "scratch", "scratch", "value"], spec["args"]
    assert spec["args"][-1] == ["value", plan.args[-1]]


@pytest.mark.nvcc
def test_untrusted_source_compiles_in_the_child(pointwise_region):
    _, template = pointwise_region
    res = compile_in_child(template.source + "// v2\n", template.name, "sm_90a", timeout_s=120)
    assert res.ok and res.stage == "ok", res.reason
    assert res.cubin[:4] == b"\x7fELF" and res.compile_s > 0


@pytest.mark.nvcc
def test_a_compile_error_in_the_child_carries_the_nvcc_log(pointwise_region):
    _, template = pointwise_region
    res = compile_in_child(template.source.replace("sfk_relu", "no_such_fn"), template.name,
                           "sm_90a", timeout_s=120)
    assert not res.ok and res.stage == "compile"
    assert "no_such_fn" in res.log and "error" in res.log


@pytest.mark.nvcc
def test_a_compile_past_the_timeout_is_a_rejection(pointwise_region):
    _, template = pointwise_region
    res = compile_in_child(template.source + "// slow\n", template.name, "sm_90a",
                           timeout_s=0.05)
    assert not res.ok and res.stage == "timeout"


# --------------------------------------------------------------------------- on a GPU


def _gpu_case(region):
    _, template = region
    from stitch_backend.toolchain import device_arch

    inputs = [torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")]
    return template, inputs, device_arch()


@pytest.mark.gpu
def test_first_run_in_the_child_matches_eager(pointwise_region):
    template, inputs, arch = _gpu_case(pointwise_region)
    plan = template.kernel.prepare(inputs)
    res = first_run_in_child(template.source + "// v2\n", template.kernel.entry,
                             template.kernel.signature, inputs, plan, arch=arch)
    assert res.ok, res.reason
    want = torch.relu(inputs[0]) * inputs[1] + 1.0
    torch.testing.assert_close(res.outputs[0], want)


@pytest.mark.gpu
def test_the_child_times_the_candidate_against_a_baseline_cubin(pointwise_region):
    from stitch_backend.toolchain import compile_cubin

    template, inputs, arch = _gpu_case(pointwise_region)
    baseline = compile_cubin(template.source, template.kernel.entry, arch).cubin
    plan = template.kernel.prepare(inputs)
    res = first_run_in_child(template.source + "// v2\n", template.kernel.entry,
                             template.kernel.signature, inputs, plan, arch=arch,
                             time_against=baseline, timed_launches=5)
    assert res.ok, res.reason
    assert set(res.times) == {"candidate", "baseline"} and all(
        0 < ms < 100 for ms in res.times.values()), res.times
    torch.testing.assert_close(res.outputs[0], torch.relu(inputs[0]) * inputs[1] + 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("body,stage", [
    ("  if (threadIdx.x == 0) out0[1 << 30] = 1.0f;\n", "run"),          # illegal address
    ("  while (true) { __threadfence(); }\n", "timeout"),                 # a hang
])
def test_a_faulting_or_hanging_kernel_is_a_rejection_and_we_survive(pointwise_region, body,
                                                                    stage):
    template, inputs, arch = _gpu_case(pointwise_region)
    src = template.source.replace("float* __restrict__ out0) {",
                                  "float* __restrict__ out0) {\n" + body, 1)
    plan = template.kernel.prepare(inputs)
    res = first_run_in_child(src, template.kernel.entry, template.kernel.signature, inputs,
                             plan, arch=arch, timeout_s=30)
    assert not res.ok and res.stage == stage, res.reason
    assert torch.ones(1, device="cuda").item() == 1.0  # this process's CUDA is unharmed
