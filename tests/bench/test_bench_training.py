"""The bench's training-step and autocast modes, on CPU."""

import textwrap

import pytest
import torch

from stitch_backend.bench import cli
from stitch_backend.bench.worker import TaskConfig, run_task
from tests.bench.test_bench_run import _parse, _run_in_process, _stitchcuda_usable


BATCHNORM_MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.bn = nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(x)))
            return self.fc(y.mean((2, 3))), y

    def get_inputs():
        return [torch.randn(4, 3, 10, 10)]

    def get_init_inputs():
        return []
""")


def test_training_step_checks_every_gradient(tmp_path):
    from stitch_backend.bench.steps import LossWeights, training_step

    path = tmp_path / "bn.py"
    path.write_text(BATCHNORM_MODEL)
    records = _run_in_process(path, mode="train-step", backends=("eager", "aot_eager"))
    assert [r.mode for r in records] == ["train-step"] * 2
    for r in records:
        assert r.status == "ok", r.error
        assert r.correct_kernelbench and r.correct_design, r.reason
        assert r.median_ms is not None and r.runs == 2
    # what a step returns: the outputs, then one gradient per parameter
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    weights = LossWeights(7)
    outs, grads = training_step(model, model, [x], weights)
    assert len(outs) == 1 and not outs[0].requires_grad
    assert len(grads) == 4 and all(g is not None for g in grads)
    again = training_step(model, model, [x], weights)        # grads cleared, not summed
    for g, h in zip(grads, again[1]):
        torch.testing.assert_close(g, h)
    # a wrong gradient is caught: the loss weights are the same for every model
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    wrong.load_state_dict(model.state_dict())
    from stitch_backend.correctness import compare
    scaled = training_step(lambda x: wrong(x) * 1.01, wrong, [x], weights)
    assert not compare(scaled, (outs, grads), None).ok_design


@pytest.mark.skipif(not _stitchcuda_usable(), reason="stitchcuda backend not registered/importable")
def test_stitchcuda_training_step_in_process(tmp_path):
    path = tmp_path / "bn.py"
    path.write_text(BATCHNORM_MODEL)
    records = _run_in_process(path, mode="train-step", backends=("eager", "stitchcuda"))
    r = {x.backend: x for x in records}["stitchcuda"]
    assert r.status == "ok", r.error
    assert r.correct_design, r.reason


def test_training_and_eval_exclude_each_other(tmp_path, capsys):
    assert cli.run(_parse(["bench", "--suite", "examples", "--eval", "--training",
                           "--out", str(tmp_path)])) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_autocast_runs_the_forwards_in_bf16_and_the_fp64_model_without(tmp_path):
    path = tmp_path / "bn.py"
    path.write_text(BATCHNORM_MODEL)
    for mode in ("train", "train-step"):
        records = []
        cfg = TaskConfig(spec=str(path), name="bn", backends=["eager", "aot_eager"],
                         device="cpu", mode=mode, trials=2, runs=2, warmup=0,
                         recompile=False, autocast="bf16")
        assert cfg.to_argv(tmp_path / "r.jsonl")[-2:] == ["--autocast", "bf16"]
        run_task(cfg, records.append)
        for r in records:
            assert r.status == "ok" and r.autocast == "bf16", r.error
            assert r.correct_design, r.reason
        # eager itself is judged against a real fp64 run: bf16's error shows
        eager = {r.backend: r for r in records}["eager"]
        assert eager.eager_norm_err is not None and eager.eager_norm_err > 1e-4, mode
