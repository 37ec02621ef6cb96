"""bench.compile_speed: each available compiler's seconds a kernel on emitted sources."""

import pytest

from stitch_backend import toolchain
from stitch_backend.bench import compile_speed

KERNEL = r"""
#include "common.cuh"
extern "C" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, int n) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = sc_gelu_erf(x[i]) * {scale}.0f;
}}
"""


@pytest.mark.nvcc
def test_every_available_compiler_gets_a_serial_and_a_parallel_line(tmp_path, capsys):
    if toolchain.find_nvcc() is None:
        pytest.skip("needs nvcc")
    for i in range(3):
        (tmp_path / f"k{i}.cu").write_text(KERNEL.format(name=f"k{i}", scale=i + 1))
    assert compile_speed.main([str(tmp_path), "--threads", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"3 kernel(s) from {tmp_path}, sm_90a")
    lines = [line.split() for line in out[1:] if "s a kernel" in line]
    present = ["nvcc"]
    try:
        toolchain.load_nvrtc()
        present.insert(0, "nvrtc")
    except toolchain.ToolchainError:
        pass
    assert [(w[0], w[1]) for w in lines] == [(c, h) for c in present
                                             for h in ("one", "compile_many,")]
    assert all(float(w[-4]) > 0 for w in lines)


def test_an_empty_folder_is_a_usage_error(tmp_path, capsys):
    assert compile_speed.main([str(tmp_path)]) == 2
    assert "no .cu files" in capsys.readouterr().err


def test_a_source_that_does_not_compile_stops_with_its_log(tmp_path):
    if toolchain.find_nvcc() is None:
        pytest.skip("needs nvcc")
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void bad() { undefined_here; }\n')
    with pytest.raises(SystemExit, match="undefined_here"):
        compile_speed.main([str(tmp_path)])
