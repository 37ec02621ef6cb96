"""Timing controls and interleaved timing: eager again after the compiled backends, the
``dynamo`` floor, and ``--interleave`` (compile every backend, then time in rotating
rounds)."""

from pathlib import Path

import pytest
import torch

from stitch_backend.bench.records import read_records
from stitch_backend.bench.worker import TaskConfig, run_task
from tests.bench.test_bench_run import EXAMPLES, _parse


def test_eager_again_is_timed_last_as_a_control(tmp_path):
    """eager-again: the baseline once more, after the compiled backends, in the same child
    process; identical outputs, so correct by both rules, and a ratio to read noise by."""
    from stitch_backend.bench.backends import validate_backends

    assert validate_backends(["eager-again", "aot_eager"]) == ["eager", "aot_eager", "eager-again"]
    out = tmp_path / "out"
    args = _parse(["bench", str(EXAMPLES["softmax_rows"]), "--backends", "eager-again,aot_eager",
                   "--device", "cpu", "--trials", "1", "--runs", "3", "--warmup", "1",
                   "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    records = read_records(out / "results.jsonl")
    assert [r.backend for r in records] == ["eager", "aot_eager", "eager-again"]
    again = records[-1]
    assert again.status == "ok" and again.correct_kernelbench and again.correct_design
    assert again.max_abs == 0.0 and again.median_ms > 0
    assert "timed again" in again.backend_source


def test_dynamo_backend_is_torch_compile_with_dynamos_eager_backend():
    """``dynamo``: the traced graph run as is, the per-call floor of any backend."""
    import torch._dynamo

    from stitch_backend.bench.backends import compiles_on_host, validate_backends, wrap

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    compiled = wrap("dynamo", model)
    assert validate_backends(["dynamo"]) == ["eager", "dynamo"]
    assert compiled.backend_obj == "eager" and "torch._dynamo" in compiled.source
    assert compiled.fn is not model and compiles_on_host("dynamo")
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled.fn(x), model(x), rtol=0, atol=0)


def test_interleaved_timing_compiles_all_then_rotates_the_backends(monkeypatch):
    """--interleave: Dynamo reset once, every backend compiled and checked, then timed in
    rounds whose order rotates (eager, aot_eager / aot_eager, eager), the runs split
    over them; each record carries all its runs and the round count."""
    import torch._dynamo

    from stitch_backend.bench import worker

    resets, calls = [], []
    real_reset, real_times = torch._dynamo.reset, worker.run_times

    def reset():
        resets.append(1)
        real_reset()

    def run_times(fn, device, *, runs, warmup, **kw):
        calls.append((fn, runs))
        return real_times(fn, device, runs=runs, warmup=warmup, **kw)

    monkeypatch.setattr(torch._dynamo, "reset", reset)
    monkeypatch.setattr(worker, "run_times", run_times)
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["mlp_gelu"]), name="mlp_gelu",
                     backends=["eager", "aot_eager"], device="cpu", trials=1, runs=7, warmup=1,
                     recompile=False, interleave=True)
    assert "--interleave" in cfg.to_argv(Path("x.jsonl"))
    run_task(cfg, records.append)
    assert [r.backend for r in records] == ["eager", "aot_eager"]
    assert all(r.status == "ok" and r.correct_design for r in records), records
    assert all(r.runs == 7 and r.timing_rounds == 2 and r.median_ms > 0 for r in records)
    assert all(0 < r.host_ms for r in records)       # on the CPU: the whole call
    assert len(resets) == 1
    eager, aot = calls[0][0], calls[1][0]
    assert eager is not aot
    assert [fn for fn, _ in calls] == [eager, aot, aot, eager]
    assert [runs for _, runs in calls] == [4, 4, 3, 3]


def test_interleave_flag_reaches_the_worker(tmp_path):
    common = ["bench", str(EXAMPLES["mlp_gelu"]), "--backends", "eager", "--device", "cpu",
              "--out", str(tmp_path)]
    assert _parse(common).interleave                      # the default
    assert _parse(common + ["--interleave"]).interleave
    assert not _parse(common + ["--no-interleave"]).interleave
    from stitch_backend.bench.worker import _parse as worker_parse
    cfg, _ = worker_parse(TaskConfig(spec="s.py", name="s", backends=["eager"],
                                     interleave=True).to_argv(tmp_path / "r.jsonl"))
    assert cfg.interleave


@pytest.mark.gpu
def test_interleaved_timing_of_eager_inductor_and_stitchcuda_on_the_gpu():
    """All three compiled in one process before any is timed (Dynamo keeps each backend's
    graph apart), timed in rotating rounds; each record has the card's state."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine with -m gpu)")
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["conv_bn_relu"]), name="conv_bn_relu",
                     backends=["eager", "inductor-reduce-overhead", "stitchcuda"], device="cuda",
                     trials=1, runs=12, warmup=2, recompile=False, interleave=True)
    run_task(cfg, records.append)
    assert all(r.status == "ok" for r in records), [(r.backend, r.error) for r in records]
    # Inductor's own accuracy is not this project's (on the H200 its conv + BN ran outside
    # the fp64 rule, 2026-12-04); eager's and stitchcuda's are.
    assert records[0].correct_design and records[2].correct_design, \
        [(r.backend, r.reason) for r in records]
    assert all(r.timing_rounds == 4 and r.runs == 12 for r in records)
    assert all(r.gpu_before and "free_gib" in r.gpu_after for r in records)
    # the host's part: until the call returned, its GPU work queued (within the call)
    assert all(0 < r.host_ms <= r.median_ms * 1.5 for r in records), \
        [(r.backend, r.host_ms, r.median_ms) for r in records]
    stitched = records[2].backend_records
    assert stitched and stitched[0]["counts"]["generated"] >= 1


def test_interleaved_timing_records_a_failing_backend_and_times_the_rest(monkeypatch):
    from stitch_backend.bench import worker

    real = worker.prepare_backend

    def prepare(name, *a, **k):
        if name == "aot_eager":
            raise RuntimeError("this backend always fails")
        return real(name, *a, **k)

    monkeypatch.setattr(worker, "prepare_backend", prepare)
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["mlp_gelu"]), name="mlp_gelu",
                     backends=["aot_eager", "eager"], device="cpu", trials=1, runs=3, warmup=1,
                     recompile=False, interleave=True)
    run_task(cfg, records.append)
    assert [r.backend for r in records] == ["aot_eager", "eager"]
    assert records[0].status == "error" and "always fails" in records[0].reason
    assert records[1].status == "ok" and records[1].runs == 3 and records[1].timing_rounds == 1
    cfg.backends = ["aot_eager"]
    records.clear()
    run_task(cfg, records.append)              # nothing left to time: no crash, one error
    assert len(records) == 1 and records[0].status == "error"

