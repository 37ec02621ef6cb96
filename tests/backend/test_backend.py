"""The backend as a user meets it: registration, options, dynamic shapes, dtypes, RNG."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from stitch_backend import config
from stitch_backend.backend import StitchBackend, compiled_graphs
from stitch_backend.exc import InvalidOptionError
from tests.zoo import MLP, DropoutModel, TransformerBlock


def test_registered_through_entry_point_in_fresh_interpreter():
    code = ("import torch._dynamo as d, sys; "
            "print('stitchcuda' in d.list_backends()); "
            "print(any(m.startswith('stitch_backend') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # Listed without importing any of our modules: discovery reads the entry point only.
    assert out == ["True", "False"]


def test_string_backend_runs_and_records():
    model = MLP().eval()
    x = torch.randn(3, 32)
    before = len(compiled_graphs())
    with torch.no_grad():
        got = torch.compile(model, backend="stitchcuda")(x)
    torch.testing.assert_close(got, model(x))
    assert len(compiled_graphs()) == before + 1


def test_unknown_option_names_valid_ones():
    model = MLP()
    compiled = torch.compile(model, backend="stitchcuda", options={"cuda_graphs": True})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 32))
    text = str(info.value)
    assert "unknown stitchcuda option 'cuda_graphs'" in text
    assert "Did you mean 'cudagraphs'" in text
    assert "codegen" in text  # the list of valid options


def test_option_types_checked_and_env_read_in_config(monkeypatch):
    with pytest.raises(InvalidOptionError, match="expected a boolean"):
        StitchBackend(options={"codegen": "maybe"})
    with pytest.raises(InvalidOptionError, match="unknown torch.compile mode"):
        StitchBackend(mode="fastest")
    monkeypatch.setenv("STITCHCUDA_MAX_ATTEMPTS", "7")
    assert config.Config.from_env().max_attempts == 7
    assert StitchBackend(options={"max_attempts": 2}).config.max_attempts == 2
    with config.patch(cudagraphs=False):
        assert StitchBackend().config.cudagraphs is False
    assert "cache_dir" not in config.Config().code_options()
    assert "codegen" in config.Config().code_options()
    # three-way options: 'auto' is None, from the environment or per compile
    assert config.Config().layout_race is None
    monkeypatch.setenv("STITCHCUDA_LAYOUT_RACE", "off")
    assert config.Config.from_env().layout_race is False
    monkeypatch.setenv("STITCHCUDA_LAYOUT_RACE", "auto")
    assert config.Config.from_env().layout_race is None
    assert StitchBackend(options={"layout_race": True}).config.layout_race is True
    with pytest.raises(InvalidOptionError, match="expected a boolean"):
        StitchBackend(options={"layout_race": "sometimes"})
    # the kernel compiler: NVRTC first by default, in the key (the cubins differ)
    assert config.Config().compiler == "auto" and "compiler" in config.Config().code_options()
    monkeypatch.setenv("STITCHCUDA_COMPILER", "nvcc")
    assert config.Config.from_env().compiler == "nvcc"
    with pytest.raises(InvalidOptionError, match="expected one of 'auto', 'nvrtc', 'nvcc'"):
        StitchBackend(options={"compiler": "clang"})


def test_dynamic_shapes_three_batch_sizes():
    torch.manual_seed(0)
    model = TransformerBlock().eval()
    backend = StitchBackend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for b in (2, 3, 5):
            x = torch.randn(b, 8, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    # The first size compiles a static graph; the shape change brings a symbolic one,
    # which serves every later size without another compile.
    assert len(backend.records) == 2
    assert backend.records[-1].dynamic
    assert "2 ATen graph(s) compiled" in backend.report()


def test_mark_dynamic_graph_is_symbolic():
    model = MLP().eval()
    backend = StitchBackend()
    x = torch.randn(6, 32)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    assert backend.records[0].dynamic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_graphs(dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype).eval()
    x = torch.randn(4, 32, dtype=dtype)
    with torch.no_grad():
        got = torch.compile(model, backend=StitchBackend())(x)
        want = model(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_autocast_graph():
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(model, backend=StitchBackend())(x)
        want = model(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_seeded_random_ops_match_eager():
    torch.manual_seed(0)
    model = DropoutModel().train()
    x = torch.randn(8, 32)
    compiled = torch.compile(model, backend=StitchBackend())
    with torch.no_grad():
        torch.manual_seed(123)
        got = compiled(x)
        torch.manual_seed(123)
        want = model(x)
        torch.manual_seed(124)
        other = model(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got, other)  # the seed really matters


def test_cpu_inputs_log_one_line_why(caplog):
    model = MLP().eval()
    with caplog.at_level(logging.INFO, logger="stitch_backend"):
        with torch.no_grad():
            torch.compile(model, backend=StitchBackend())(torch.randn(2, 32))
    messages = [r.getMessage() for r in caplog.records if "generates CUDA kernels only" in r.getMessage()]
    assert messages and "cpu" in messages[0]


def test_codegen_off_keeps_aten_with_reason():
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(lambda x: F.gelu(x) * 2, backend=backend)(torch.randn(4))
    (rec,) = backend.records
    assert all(r.backend == "aten" and r.reason for r in rec.plan.regions)


def test_no_side_effects_on_import(tmp_path):
    code = ("import logging, stitch_backend, stitch_backend.backend, stitch_backend.cli, "
            "stitch_backend.config; "
            "print(len(logging.getLogger('stitch_backend').handlers))")
    env = {"STITCHCUDA_CACHE_DIR": str(tmp_path / "never"), "PATH": "/usr/bin:/bin",
           "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout.strip()
    assert out == "0"
    assert not (tmp_path / "never").exists()


def test_internal_error_keeps_the_model_running_and_is_reported(monkeypatch, caplog):
    import stitch_backend.agents.planner as planner

    def broken(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(planner, "partition", broken)
    model = MLP().eval()
    x = torch.randn(2, 32)
    backend = StitchBackend()
    with caplog.at_level(logging.WARNING, logger="stitch_backend"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    assert backend.failures and "planner bug" in backend.failures[0]
    assert "planner bug" in backend.report()
    assert any("runs on ATen as traced" in r.getMessage() for r in caplog.records)


def test_verification_machinery_failure_keeps_eager_results(monkeypatch):
    import stitch_backend.agents.acceptance as acceptance

    def broken(*args, **kwargs):
        raise RuntimeError("verifier bug")

    monkeypatch.setattr(acceptance, "verify_first_call", broken)
    backend = StitchBackend(options={"cpu_interpret": True, "require_speedup": False})
    fn = lambda x: torch.softmax(x * 2.0, -1)
    compiled = torch.compile(fn, backend=backend)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), fn(x))
        torch.testing.assert_close(compiled(x), fn(x))
    (region,) = [r for rec in backend.records for r in rec.plan.regions if r.kind.value == "fused"]
    assert region.backend == "aten" and "verifier bug" in region.reason
