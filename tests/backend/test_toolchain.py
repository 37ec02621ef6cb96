"""stitch_backend.toolchain: arch flags, compiler discovery, CompileError evidence, the memo, logging."""

import logging
import re
import stat
import subprocess
import sys
import time

import pytest

from stitch_backend import toolchain

GOOD = r"""
#include "common.cuh"
// y = gelu(x): a typical small generated kernel.
extern "C" __global__ void scale_gelu(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = sc_gelu_erf(x[i]);
}
"""

BAD = r"""
extern "C" __global__ void broken(float* y) {
  y[0] = undefined_symbol_here;
}
"""


@pytest.fixture(autouse=True)
def _fresh_memo():
    toolchain.clear_memo()
    yield
    toolchain.clear_memo()


def _fake_nvcc(folder, version_line="Cuda compilation tools, release 12.4, V12.4.131"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvcc"
    path.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{version_line}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --------------------------------------------------------------------------- arch


@pytest.mark.parametrize(
    "arch,flag",
    [
        ("sm_90a", "-gencode=arch=compute_90a,code=sm_90a"),
        ("sm_90", "-gencode=arch=compute_90,code=sm_90"),
        ("sm_80", "-gencode=arch=compute_80,code=sm_80"),
        ("sm_100a", "-gencode=arch=compute_100a,code=sm_100a"),
    ],
)
def test_arch_flag_uses_gencode(arch, flag):
    assert toolchain.arch_flag(arch) == flag


@pytest.mark.parametrize("bad", ["90", "sm90", "compute_90", "sm_9", "sm_90x", ""])
def test_arch_flag_rejects_malformed(bad):
    with pytest.raises(ValueError, match="arch must look like"):
        toolchain.arch_flag(bad)


@pytest.mark.parametrize("cap,arch", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((8, 9), "sm_89"), ((10, 0), "sm_100")])
def test_device_arch_suffix_only_for_hopper(monkeypatch, cap, arch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert toolchain.device_arch() == arch


# --------------------------------------------------------------------------- discovery


def test_find_nvcc_prefers_cuda_home(tmp_path, monkeypatch):
    fake = _fake_nvcc(tmp_path / "cuda" / "bin")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert toolchain.find_nvcc() == fake


def test_find_nvcc_uses_path(tmp_path, monkeypatch):
    fake = _fake_nvcc(tmp_path / "bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert toolchain.find_nvcc() == fake


def test_find_nvcc_none_when_absent(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(toolchain, "FALLBACK_NVCC_PATHS", (tmp_path / "nope" / "nvcc",))
    assert toolchain.find_nvcc() is None
    with pytest.raises(toolchain.ToolchainError, match="nvcc not found"):
        toolchain.compile_cubin(GOOD, "scale_gelu", "sm_90a")


def test_nvcc_version_parses_release_line(tmp_path):
    fake = _fake_nvcc(tmp_path / "bin")
    assert toolchain.nvcc_version(fake) == "12.4.131"


@pytest.mark.nvcc
def test_real_nvcc_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", toolchain.nvcc_version())


# --------------------------------------------------------------------------- compiling


@pytest.mark.nvcc
def test_compile_cubin_produces_an_elf_and_records_the_command():
    k = toolchain.compile_cubin(GOOD, "scale_gelu", "sm_90a")
    assert k.cubin[:4] == b"\x7fELF" and b"scale_gelu" in k.cubin
    assert k.name == "scale_gelu" and k.arch == "sm_90a" and k.seconds > 0
    for flag in ("-cubin", "-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a"):
        assert flag in k.cmd
    assert "--use_fast_math" not in k.cmd and "-use_fast_math" not in k.cmd
    assert f"-I{toolchain.csrc_dir()}" in k.cmd


@pytest.mark.nvcc
def test_compile_error_carries_command_log_and_source():
    with pytest.raises(toolchain.CompileError) as info:
        toolchain.compile_cubin(BAD, "broken", "sm_90a")
    err = info.value
    assert err.cmd[0].endswith("nvcc") and "-cubin" in err.cmd
    assert "undefined_symbol_here" in err.log and "error" in err.log
    assert err.source_path is not None and err.source_path.read_text() == BAD  # kept for debugging
    text = str(err)
    assert "command:" in text and "-cubin" in text and "undefined_symbol_here" in text


@pytest.mark.nvcc
def test_compile_error_str_shows_at_most_40_log_lines():
    many = "extern \"C\" __global__ void k(float* y) {\n" + "".join(
        f"  y[{i}] = missing_{i};\n" for i in range(60)) + "}\n"
    with pytest.raises(toolchain.CompileError) as info:
        toolchain.compile_cubin(many, "k", "sm_80")
    err = info.value
    assert len(err.log.splitlines()) > 40
    log_part = str(err).split("log:\n", 1)[1]
    assert len(log_part.splitlines()) <= toolchain.LOG_LINES_IN_STR + 1
    assert "more lines" in log_part


@pytest.mark.nvcc
def test_memo_returns_same_bytes_without_running_nvcc(monkeypatch):
    first = toolchain.compile_cubin(GOOD, "scale_gelu", "sm_90a")

    def no_nvcc(*a, **k):
        raise AssertionError("nvcc ran for a memoised source")

    monkeypatch.setattr(toolchain.subprocess, "run", no_nvcc)
    t0 = time.perf_counter()
    second = toolchain.compile_cubin(GOOD, "scale_gelu", "sm_90a")
    elapsed = time.perf_counter() - t0
    assert second.cubin == first.cubin and elapsed < 0.05
    renamed = toolchain.compile_cubin(GOOD, "other_name", "sm_90a")
    assert renamed.cubin == first.cubin and renamed.name == "other_name"
    # A different arch or flags is a different key: it must try to run nvcc.
    with pytest.raises(AssertionError, match="nvcc ran"):
        toolchain.compile_cubin(GOOD, "scale_gelu", "sm_80")
    with pytest.raises(AssertionError, match="nvcc ran"):
        toolchain.compile_cubin(GOOD, "scale_gelu", "sm_90a", extra_flags=("-DEXTRA=1",))


@pytest.mark.nvcc
def test_workdir_keeps_source_and_cubin(tmp_path):
    k = toolchain.compile_cubin(GOOD, "scale_gelu", "sm_80", workdir=tmp_path / "wd")
    cus = list((tmp_path / "wd").glob("*.cu"))
    cubins = list((tmp_path / "wd").glob("*.cubin"))
    assert len(cus) == 1 and cus[0].read_text() == GOOD
    assert len(cubins) == 1 and cubins[0].read_bytes() == k.cubin


@pytest.mark.nvcc
def test_generated_source_logged_only_when_asked(caplog):
    with caplog.at_level(logging.INFO, logger="stitch_backend.output_code"):
        toolchain.compile_cubin(GOOD, "scale_gelu", "sm_80")
    assert not [r for r in caplog.records if r.name == "stitch_backend.output_code"]
    toolchain.clear_memo()
    with caplog.at_level(logging.DEBUG, logger="stitch_backend.output_code"):
        toolchain.compile_cubin(GOOD, "scale_gelu", "sm_80")
    code = [r.getMessage() for r in caplog.records if r.name == "stitch_backend.output_code"]
    assert code and "sc_gelu_erf" in code[0]


# --------------------------------------------------------------------------- NVRTC


def _nvrtc_or_skip():
    try:
        return toolchain.nvrtc_version()
    except toolchain.ToolchainError as e:
        pytest.skip(f"libnvrtc does not load here: {str(e).splitlines()[0]}")


def test_nvrtc_compiles_and_memoises(monkeypatch):
    _nvrtc_or_skip()
    k = toolchain.compile_nvrtc(GOOD, "scale_gelu", "sm_90a")
    assert k.cubin[:4] == b"\x7fELF" and k.cmd[0] == "nvrtc" and "--gpu-architecture=sm_90a" in k.cmd
    again = toolchain.compile_nvrtc(GOOD, "scale_gelu", "sm_90a")
    assert again.cubin == k.cubin


def test_nvrtc_error_is_compile_error():
    _nvrtc_or_skip()
    with pytest.raises(toolchain.CompileError) as info:
        toolchain.compile_nvrtc(BAD, "broken", "sm_90a")
    assert "undefined_symbol_here" in info.value.log
    assert info.value.source_path.read_text() == BAD


def test_compile_kernel_uses_nvrtc_when_nvcc_is_missing(monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    k = toolchain.compile_kernel(GOOD, "scale_gelu", "sm_80")
    assert k.cmd[0] == "nvrtc" and k.cubin[:4] == b"\x7fELF"


def _no_nvrtc():
    raise toolchain.ToolchainError("libnvrtc could not be loaded; tried: (test)")


def test_compile_kernel_without_any_compiler_says_so(monkeypatch):
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    monkeypatch.setattr(toolchain, "load_nvrtc", _no_nvrtc)
    with pytest.raises(toolchain.ToolchainError, match="(?s)libnvrtc.*nvcc was not found"):
        toolchain.compile_kernel(GOOD, "scale_gelu", "sm_80")


def test_auto_prefers_nvrtc_and_each_compiler_can_be_named():
    _nvrtc_or_skip()
    if toolchain.find_nvcc() is None:
        pytest.skip("no nvcc here")
    auto = toolchain.compile_kernel(GOOD, "scale_gelu", "sm_90a")
    assert auto.cmd[0] == "nvrtc"
    nvcc = toolchain.compile_kernel(GOOD, "scale_gelu", "sm_90a", compiler="nvcc")
    assert nvcc.cmd[0] == str(toolchain.find_nvcc()) and nvcc.cubin[:4] == b"\x7fELF"
    (job,) = toolchain.compile_many([toolchain.CompileJob(GOOD, "scale_gelu", "sm_90a",
                                                          compiler="nvcc")])
    assert job.cmd == nvcc.cmd
    with pytest.raises(ValueError, match="unknown compiler 'clang'"):
        toolchain.compile_kernel(GOOD, "scale_gelu", "sm_90a", compiler="clang")


def test_auto_falls_back_to_nvcc_once_when_nvrtc_does_not_load(monkeypatch, caplog):
    if toolchain.find_nvcc() is None:
        pytest.skip("no nvcc here")
    calls = []

    def counted():
        calls.append(1)
        _no_nvrtc()

    monkeypatch.setattr(toolchain, "load_nvrtc", counted)
    with caplog.at_level(logging.INFO, logger="stitch_backend.toolchain"):
        first = toolchain.compile_kernel(GOOD, "scale_gelu", "sm_90a")
        toolchain.compile_kernel(GOOD + "// a second source\n", "scale_gelu", "sm_90a")
    assert first.cmd[0] != "nvrtc" and len(calls) == 1
    assert [r.message for r in caplog.records].count(
        "libnvrtc did not load, generated kernels compile with nvcc "
        "(libnvrtc could not be loaded; tried: (test))") == 1
    with pytest.raises(toolchain.ToolchainError, match="libnvrtc"):
        toolchain.compile_kernel(GOOD, "scale_gelu", "sm_90a", compiler="nvrtc")


def test_import_is_side_effect_free():
    code = (
        "import sys, logging\n"
        "import stitch_backend.toolchain, stitch_backend.cuda_driver, stitch_backend.runtime\n"
        "assert 'torch' not in sys.modules, 'importing the toolchain imported torch'\n"
        "assert stitch_backend.cuda_driver._driver is None\n"
        "assert stitch_backend.toolchain._nvrtc is None and stitch_backend.runtime._lib is None\n"
        "assert not logging.getLogger('stitch_backend.toolchain').handlers\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nvrtc_candidates_put_torchs_cuda_major_first(tmp_path, monkeypatch):
    import types

    for wheel, so in (("cu12", "libnvrtc.so.12"), ("cu13", "libnvrtc.so.13"),
                      ("cu13", "libnvrtc-builtins.so.13.0")):
        lib = tmp_path / "nvidia" / wheel / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        (lib / so).write_bytes(b"")
    monkeypatch.setattr(toolchain, "_site_dirs", lambda: [str(tmp_path)])
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    monkeypatch.setattr(toolchain, "_cuda_homes", lambda: [])
    ours = [n for n in toolchain._nvrtc_candidates() if n.startswith(str(tmp_path))]
    assert [n.split("/")[-3] for n in ours] == ["cu13", "cu12"]   # newest first, no builtins
    fake_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.8"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    names = toolchain._nvrtc_candidates()
    assert names[0].endswith("nvidia/cu12/lib/libnvrtc.so.12")
    assert names.index("libnvrtc.so.12") < names.index("libnvrtc.so.13")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        version=types.SimpleNamespace(cuda=None)))   # a CPU build: the order as found
    assert [n for n in toolchain._nvrtc_candidates() if n.startswith(str(tmp_path))] == ours
