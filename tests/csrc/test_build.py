"""Building without a GPU: the runtime library, parallel kernel compiles, compile errors.

CI has nvcc but no GPU, so everything here must pass on a CPU machine. The runtime
build also needs cuBLASLt's header and library (toolkit or ``pip install nvidia-cublas``);
where they are missing the build test is skipped with the paths searched.
"""

import ctypes
import threading
import time

import pytest

from stitch_backend import runtime, toolchain

KERNEL = r"""
#include "common.cuh"
// out = {op}(x): one small generated kernel per job.
extern "C" __global__ void {name}(const float* __restrict__ x, float* __restrict__ out, int n) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = {op}(x[i]);
}}
"""


def _cublaslt_or_skip():
    found = runtime.find_cublaslt()
    if found is None:
        pytest.skip(f"cuBLASLt header/library not found (pip install nvidia-cublas); searched: {runtime._searched()}")
    return found


@pytest.fixture(autouse=True)
def _fresh_memo():
    toolchain.clear_memo()
    yield


@pytest.fixture(scope="module")
def built_runtime(tmp_path_factory):
    """One real build of the runtime for this module (8 s on 2 cores), into its own cache dir."""
    if toolchain.find_nvcc() is None:
        pytest.skip("needs nvcc on PATH")
    _cublaslt_or_skip()
    cache = tmp_path_factory.mktemp("runtime-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STITCHCUDA_CACHE_DIR", str(cache))
        yield runtime.build_runtime("sm_90a"), cache


# --------------------------------------------------------------------------- runtime library


@pytest.mark.nvcc
def test_runtime_builds_without_gpu_and_exports_its_abi(built_runtime, monkeypatch, capsys):
    first, cache = built_runtime
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(cache))
    assert first.path.is_file() and first.path.name == "libstitch_runtime.so"
    assert not first.cached and first.seconds > 0
    assert first.path.read_bytes()[:4] == b"\x7fELF"
    assert "-shared" in first.cmd and "-gencode=arch=compute_90a,code=sm_90a" in first.cmd
    assert not list(first.path.parent.glob(".*.tmp")), "a temp file was left behind"
    with capsys.disabled():
        print(f"\n[runtime build] {first.seconds:.1f}s -> {first.path}")

    t0 = time.perf_counter()
    again = runtime.build_runtime("sm_90a")
    assert again.cached and again.path == first.path and time.perf_counter() - t0 < 1.0

    lib = ctypes.CDLL(str(first.path))
    runtime._declare(lib)
    assert lib.sc_lt_abi_version() == runtime.ABI_VERSION
    assert lib.sc_lt_params_size() == ctypes.sizeof(runtime._Params) == 208
    assert lib.sc_lt_status_string(15).decode().startswith("CUBLAS_STATUS_NOT_SUPPORTED")
    assert lib.sc_lt_status_string(12345).decode() == "unknown cublasStatus_t"
    assert lib.sc_lt_cublaslt_version() > 0
    # Argument checks run before any GPU work, so they are testable here.
    params = runtime._Params()
    assert lib.sc_lt_matmul(None, ctypes.byref(params)) == 7  # CUBLAS_STATUS_INVALID_VALUE
    assert "handle is NULL" in lib.sc_lt_last_error().decode()


@pytest.mark.nvcc
def test_runtime_create_without_gpu_reports_why(built_runtime):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; this checks the no-GPU error path")
    lib = ctypes.CDLL(str(built_runtime[0].path))
    runtime._declare(lib)
    handle = ctypes.c_void_p()
    status = lib.sc_lt_create(ctypes.byref(handle))
    assert status != 0 and handle.value is None
    assert "cublasLtCreate" in lib.sc_lt_last_error().decode()


@pytest.mark.nvcc
def test_runtime_key_changes_with_arch():
    _cublaslt_or_skip()
    key90, _, dir90 = runtime._build_plan("sm_90a")
    key80, _, dir80 = runtime._build_plan("sm_80")
    assert key90 != key80 and dir90 != dir80
    assert dir90.parent.parent == runtime._cache_root()


@pytest.mark.nvcc
def test_runtime_build_failure_raises_with_log(tmp_path, monkeypatch):
    _cublaslt_or_skip()
    bad = tmp_path / "broken.cu"
    bad.write_text("int this is not C++;\n")
    monkeypatch.setattr(runtime, "runtime_sources", lambda: [bad])
    with pytest.raises(runtime.RuntimeBuildError) as info:
        runtime.build_runtime("sm_90a")
    assert "broken.cu" in info.value.log and "nvcc" in info.value.cmd[0]
    key, _, out_dir = runtime._build_plan("sm_90a")
    assert not (out_dir / runtime.LIB_NAME).exists() and not list(out_dir.glob(".*.tmp"))


def test_runtime_build_without_cublaslt_says_where_it_looked(monkeypatch):
    monkeypatch.setattr(runtime, "find_cublaslt", lambda: None)
    if toolchain.find_nvcc() is None:
        pytest.skip("needs nvcc to get past the first check")
    with pytest.raises(runtime.RuntimeBuildError, match="cuBLASLt not found"):
        runtime.build_runtime("sm_90a")


def test_colmajor_operand_mapping():
    import torch

    x = torch.empty(6, 4)
    assert runtime._colmajor_operand(x, "x") == (0, 4)  # row-major: op N, ld = row stride
    assert runtime._colmajor_operand(x.t(), "x") == (1, 4)  # transposed view: op T, ld = column stride
    wide = torch.empty(6, 10)[:, :4]
    assert runtime._colmajor_operand(wide, "x") == (0, 10)  # padded rows keep their stride
    assert runtime._colmajor_operand(torch.empty(1, 4), "x") == (0, 4)
    assert runtime._colmajor_operand(torch.empty(3, 5, 4), "x") == (0, 4)  # batched: last two dims
    with pytest.raises(ValueError, match="neither unit row nor unit column stride"):
        runtime._colmajor_operand(torch.empty(6, 8)[:, ::2], "x")


def test_empty_aux_shapes():
    import torch

    relu = runtime.LtMatmul.empty_aux("RELU_AUX_BIAS", (5, 130), torch.float16, "cpu")
    assert relu.dtype == torch.uint8 and tuple(relu.shape) == (5, 256 // 8)
    gelu = runtime.LtMatmul.empty_aux("GELU_AUX", (2, 5, 13), torch.float32, "cpu")
    assert gelu.dtype == torch.float32 and tuple(gelu.shape) == (2, 5, 16)
    with pytest.raises(ValueError, match="takes no aux"):
        runtime.LtMatmul.empty_aux("BIAS", (5, 13), torch.float32, "cpu")


# --------------------------------------------------------------------------- kernels in parallel


@pytest.mark.nvcc
def test_compile_many_runs_in_parallel_and_keeps_errors_in_place(monkeypatch):
    real_run = toolchain.subprocess.run
    active, peak, lock = [0], [0], threading.Lock()

    def counting_run(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real_run(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(toolchain.subprocess, "run", counting_run)
    ops = ["sc_relu", "sc_sigmoid", "sc_mish", "no_such_helper"]
    jobs = [toolchain.CompileJob(KERNEL.format(name=f"k_{i}", op=op), f"k_{i}", "sm_90a", compiler="nvcc")
            for i, op in enumerate(ops)]
    t0 = time.perf_counter()
    results = toolchain.compile_many(jobs, max_workers=4)
    wall = time.perf_counter() - t0
    assert [type(r).__name__ for r in results] == ["CompiledKernel"] * 3 + ["CompileError"]
    assert [r.name for r in results[:3]] == ["k_0", "k_1", "k_2"]
    assert "no_such_helper" in results[3].log
    assert peak[0] >= 2, "compile_many never ran two nvcc processes at once"
    serial = sum(r.seconds for r in results[:3])
    print(f"compile_many: 4 jobs in {wall:.2f}s wall, {serial:.2f}s of nvcc for the 3 good ones")


@pytest.mark.nvcc
def test_compile_many_empty_and_memoised():
    assert toolchain.compile_many([]) == []
    job = toolchain.CompileJob(KERNEL.format(name="k", op="sc_relu"), "k", "sm_80")
    a, b = toolchain.compile_many([job, job], max_workers=1)
    assert a.cubin == b.cubin


@pytest.mark.nvcc
def test_prebuild_loads_the_built_runtime_in_the_background(built_runtime, monkeypatch):
    """agents.loop starts it beside a graph's kernel compiles; later uses find it loaded."""
    _, cache = built_runtime
    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(cache))
    monkeypatch.setattr(runtime, "_lib", None)
    thread = runtime.prebuild("sm_90a")
    thread.join(timeout=60)
    assert not thread.is_alive() and thread.daemon
    lib = runtime._lib
    assert lib is not None and lib.sc_lt_abi_version() == runtime.ABI_VERSION
    assert runtime.load_runtime("sm_90a") is lib


def test_prebuild_failure_is_only_logged_and_raised_at_first_use(monkeypatch, caplog):
    def broken(arch=None, *, force=False):
        raise runtime.RuntimeBuildError(["nvcc"], "no cuBLASLt here (test)")

    monkeypatch.setattr(runtime, "_lib", None)
    monkeypatch.setattr(runtime, "build_runtime", broken)
    with caplog.at_level("DEBUG", logger="stitch_backend.runtime"):
        runtime.prebuild("sm_90a").join(timeout=10)
    assert any("background runtime build failed" in r.message for r in caplog.records)
    with pytest.raises(runtime.RuntimeBuildError, match="no cuBLASLt here"):
        runtime.load_runtime("sm_90a")
