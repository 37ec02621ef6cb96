"""The stitchcuda command line: doctor, explain (text, JSON, emit-dir), errors, help."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from stitch_backend.cli import main

MODEL_FILE = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Model(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)
            self.ln = nn.LayerNorm(d)

        def forward(self, x):
            y = F.gelu(self.fc(x)) * 2.0
            y = F.dropout(y, 0.1, training=True)
            return torch.softmax(self.ln(y), dim=-1) + x.sort(dim=-1).values

    def get_inputs():
        return [torch.randn(4, 16)]

    def get_init_inputs():
        return [16]
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_doctor_healthy_without_gpu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend registered" in out and "cache dir" in out and "healthy" in out


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"] is True
    names = {c["name"] for c in data["checks"]}
    assert {"torch", "GPU", "nvcc", "cache dir", "LLM endpoint"} <= names
    assert "torch" in data["facts"]


def test_doctor_never_prints_api_key(capsys, monkeypatch):
    monkeypatch.setenv("STITCHCUDA_LLM_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("STITCHCUDA_LLM_API_KEY", "sk-secret-value-123")
    assert main(["doctor", "--json"]) == 0
    out = capsys.readouterr().out
    assert "127.0.0.1:9" in out and "sk-secret-value-123" not in out


def test_explain_text(model_file, capsys):
    assert main(["explain", str(model_file)]) == 0
    out = capsys.readouterr().out
    assert "gemm" in out and "fused" in out
    assert "fallback: aten.native_dropout.default draws random numbers" in out
    assert "sort" in out


def test_explain_json_regions(model_file, capsys):
    assert main(["explain", str(model_file), "--json", "--arch", "sm_90a"]) == 0
    data = json.loads(capsys.readouterr().out)
    regions = data["regions"]
    assert regions and all({"kind", "ops", "reason"} <= set(r) for r in regions)
    kinds = {r["kind"] for r in regions}
    assert {"gemm", "fused", "fallback"} <= kinds
    assert all(r["reason"] for r in regions if r["kind"] == "fallback")
    ops = {op for r in regions for op in r["ops"]}
    assert "aten.addmm.default" in ops and "aten.sort.default" in ops


def test_explain_training_has_backward(model_file, capsys):
    assert main(["explain", str(model_file), "--json", "--training"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {g["stage"] for g in data["graphs"]} == {"forward", "backward"}


def test_explain_factory_spec(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_factory.py").write_text(textwrap.dedent("""
        import torch
        def build():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
            return model, [torch.randn(2, 8)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "my_factory:build", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["regions"][0]["kind"] == "gemm"


def test_explain_missing_file_is_clear_error(tmp_path, capsys):
    code = main(["explain", str(tmp_path / "nope.py")])
    assert code == 2
    assert "nope.py" in capsys.readouterr().err


def test_unknown_command_and_help():
    proc = subprocess.run([sys.executable, "-m", "stitch_backend.cli", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    for cmd in ("doctor", "explain", "demo", "cache"):
        assert cmd in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "stitch_backend.cli", "frobnicate"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_console_script_installed():
    proc = subprocess.run(["stitchcuda", "doctor", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["facts"]["stitchcuda"]


def test_warmup_without_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from stitch_backend.examples import list_examples

    assert main(["warmup", str(list_examples()[0])]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "explain" in err


def test_warmup_table_on_cpu(capsys):
    from stitch_backend.examples import list_examples

    files = [str(p) for p in list_examples()[:2]]
    assert main(["warmup", "--device", "cpu", *files]) == 0
    out = capsys.readouterr().out
    assert "| model | graphs |" in out and out.count("\n| ") >= 2


def test_cache_subcommand_wired(capsys):
    assert main(["cache", "ls", "--json"]) == 0
    assert capsys.readouterr().out.strip().startswith("[")


def test_training_warmup_makes_the_graphs_a_training_loop_looks_up(tmp_path):
    """Parameters require gradients, inputs do not: an input that did would change the
    forward and backward graphs, and the loop would miss every entry warmup stored."""
    import torch

    from stitch_backend.backend import StitchBackend
    from stitch_backend.bench.problems import load_problem
    from stitch_backend.examples import list_examples
    from stitch_backend.warmup import warm_one

    spec = str(list_examples()[0])
    options = {"cpu_interpret": True, "require_speedup": False,
               "cache_dir": str(tmp_path / "cache")}
    for amp in ("", "bf16"):
        torch._dynamo.reset()
        row = warm_one(spec, training=True, device="cpu", autocast=amp, options=options)
        assert row.error is None and row.graphs >= 2 and row.cached == 0
        torch._dynamo.reset()
        problem = load_problem(spec)
        model = problem.make_model().train()
        backend = StitchBackend(options=options)
        compiled = torch.compile(model, backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(amp)):
            out = compiled(*problem.make_inputs())
        outs = out if isinstance(out, (tuple, list)) else (out,)
        sum(o.float().sum() for o in outs).backward()
        stages = [rec.stage for rec in backend.records]
        assert stages == ["forward", "backward"], stages
        assert all(rec.cached for rec in backend.records), (amp, backend.report())
