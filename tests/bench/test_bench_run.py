"""End to end: the CLI parser + run() on CPU, resume, crashes and timeouts costing one task."""

import argparse
import json
import stat
import textwrap
from pathlib import Path

import pytest
import torch

from stitch_backend.bench import cli, runner
from stitch_backend.bench.problems import ProblemRef
from stitch_backend.bench.records import read_records
from stitch_backend.bench.timing import percentile, time_call
from stitch_backend.bench.worker import TaskConfig, run_task
from stitch_backend.examples import list_examples

EXAMPLES = {p.stem: p for p in list_examples()}

FAILING_MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            raise RuntimeError("this model always fails")

    def get_inputs():
        return [torch.randn(2, 2)]

    def get_init_inputs():
        return []
""")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="stitchcuda")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One CPU run: 2 bundled examples and a model that raises, eager + aot_eager."""
    tmp = tmp_path_factory.mktemp("bench")
    failing = tmp / "99_Failing.py"
    failing.write_text(FAILING_MODEL)
    out = tmp / "out"
    args = _parse(["bench", str(EXAMPLES["softmax_rows"]), str(EXAMPLES["gru_cell"]), str(failing),
                   "--backends", "eager,aot_eager", "--device", "cpu", "--trials", "2",
                   "--runs", "3", "--warmup", "1", "--out", str(out), "--no-progress"])
    assert args.func is cli.run
    rc = args.func(args)
    return rc, out


def test_full_run_writes_records_and_summary(full_run, capsys):
    rc, out = full_run
    assert rc == 0
    records = read_records(out / "results.jsonl")
    by = {(r.task, r.backend): r for r in records}
    assert len(records) == 6
    for task in ("softmax_rows", "gru_cell"):
        for backend in ("eager", "aot_eager"):
            r = by[(task, backend)]
            assert r.status == "ok", r.error
            assert r.correct_kernelbench and r.correct_design, r.reason
            assert r.clock == "cpu" and r.median_ms > 0 and r.runs == 3
            # eager twice on the same inputs: the fields agree with each other; the GRU
            # cell's CPU GEMMs may not repeat bit for bit (3.9e-05 apart once in a
            # fresh-clone CI run), the softmax always does
            assert r.eager_deterministic is (r.determinism_max_abs == 0.0)
            assert r.eager_deterministic is True or task == "gru_cell", r.determinism_max_abs
            assert r.eager_output_varies is True
            assert r.mode == "train" and r.device == "cpu"
            assert r.wall_s >= r.median_ms * r.runs / 1e3 and r.references_s > 0
        assert by[(task, "aot_eager")].cold_first_call_s > 0
        assert by[(task, "aot_eager")].recompile_first_call_s > 0
        assert by[(task, "eager")].task_run == by[(task, "aot_eager")].task_run
    for backend in ("eager", "aot_eager"):                 # one task failed, only its rows
        r = by[("99_Failing", backend)]
        assert r.status == "error"
        assert "this model always fails" in r.reason and "Traceback" in r.error
    summary = (out / "summary.md").read_text()
    assert "## Summary" in summary and "| aot_eager | 3 | 2/3 | 2/3 |" in summary
    assert "99_Failing / eager: error" in summary
    assert "not the product's claim" in summary
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all("backend" in d and "median_ms" in d for d in lines)


def test_resume_skips_finished_tasks(full_run, monkeypatch, capsys):
    _, out = full_run
    before = (out / "results.jsonl").read_text()

    def no_child(*a, **k):
        raise AssertionError("--resume started a task that was already done")

    monkeypatch.setattr(runner, "run_task_process", no_child)
    args = _parse(["bench", str(EXAMPLES["softmax_rows"]), str(EXAMPLES["gru_cell"]),
                   "--backends", "eager,aot_eager", "--device", "cpu", "--out", str(out),
                   "--resume", "--no-progress"])
    assert cli.run(args) == 0
    printed = capsys.readouterr().out
    assert "2 task(s) already in results.jsonl, skipped" in printed
    assert printed.rstrip().splitlines()[-1].startswith("geomean vs eager")   # table printed last
    assert (out / "results.jsonl").read_text() == before
    assert "gru_cell" in (out / "summary.md").read_text()


def test_report_only_summarises_merged_records(full_run, monkeypatch, tmp_path, capsys):
    _, out = full_run
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "results.jsonl").write_text((out / "results.jsonl").read_text())
    monkeypatch.setattr(runner, "run_task_process", lambda *a, **k: pytest.fail("ran a task"))
    args = _parse(["bench", "--report-only", "--out", str(merged), "--device", "cuda", "--no-progress"])
    assert cli.run(args) == 0                 # no GPU needed: nothing runs
    summary = (merged / "summary.md").read_text()
    assert "| task | eager | aot_eager | notes |" in summary
    assert summary.count("| softmax_rows |") == 2 and "99_Failing" in summary   # tasks + compile tables
    rows = [ln.split(" | ")[0] for ln in summary.split("## Summary")[1].splitlines() if ln.startswith("| ")]
    assert rows == ["| backend", "| eager", "| aot_eager"]     # the backends in the records only
    assert cli.run(_parse(["bench", "--report-only", "--out", str(tmp_path / "none")])) == 2


def test_a_run_resumed_on_another_machine_says_which_tasks_ran_where(full_run, monkeypatch, tmp_path):
    """Records of one task from another card (a --resume that went on elsewhere): the
    summary's header lists each machine with its tasks and says the geomeans mix cards,
    instead of naming the first task's GPU for all; one machine keeps the plain header."""
    _, out = full_run
    lines = (out / "results.jsonl").read_text().splitlines()
    recs = [json.loads(ln) for ln in lines]
    for r in recs:
        r["env"] = {**r.get("env", {}), "gpu": "Card A", "torch": "2.11.0"}
        if r["task"] == "gru_cell":
            r["env"]["gpu"] = "Card B"
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(runner, "run_task_process", lambda *a, **k: pytest.fail("ran a task"))
    assert cli.run(_parse(["bench", "--report-only", "--out", str(merged), "--no-progress"])) == 0
    head = (merged / "summary.md").read_text().split("## Tasks")[0]
    order = list(dict.fromkeys(r["task"] for r in recs))
    assert "gpu: several (below)" in head and "gpu: Card A" not in head
    assert "ran on more than one machine" in head
    described = [ln for ln in head.splitlines() if ln.startswith("- Card ")]
    # runs of consecutive tasks: Card B between two Card A tasks makes three
    assert len(described) == (3 if 0 < order.index("gru_cell") < len(order) - 1 else 2)
    assert any(ln.startswith("- Card B, torch 2.11.0: 1 task(s), gru_cell") for ln in described)

    for r in recs:
        r["env"]["gpu"] = "Card A"
    (merged / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli.run(_parse(["bench", "--report-only", "--out", str(merged), "--no-progress"])) == 0
    head = (merged / "summary.md").read_text().split("## Tasks")[0]
    assert "gpu: Card A" in head and "more than one machine" not in head


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_crashing_and_hanging_children_cost_only_their_rows(tmp_path):
    # The runner's side alone: a stand-in "python" that dies or hangs instead of the worker.
    cfg = runner.BenchConfig(backends=["eager", "aot_eager"], out_dir=tmp_path / "out",
                             timeout_s=2.0, progress=False, plot=False)
    cfg.python = _fake_python(tmp_path, "echo 'Segmentation fault (core dumped)' >&2; kill -SEGV $$")
    recs = runner.run_task_process(cfg, ProblemRef("crashy", "crashy.py"), "run1")
    assert [r.backend for r in recs] == ["eager", "aot_eager"]
    assert all(r.status == "crash" and "SIGSEGV" in r.reason for r in recs)
    assert "Segmentation fault" in recs[0].error

    cfg.python = _fake_python(tmp_path, "sleep 30")
    recs = runner.run_task_process(cfg, ProblemRef("hangs", "hangs.py"), "run2")
    assert all(r.status == "timeout" and "--timeout 2" in r.reason for r in recs)


def test_parallel_jobs_give_each_cuda_task_its_own_gpu(tmp_path, monkeypatch):
    # Stand-in children that report the GPU they were given, then exit: every task gets
    # its rows, and no two tasks running at once share a GPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    cfg = runner.BenchConfig(backends=["eager"], device="cuda", out_dir=tmp_path / "out",
                             timeout_s=30.0, progress=False, plot=False, jobs=2)
    cfg.python = _fake_python(tmp_path, 'echo "gpu=$CUDA_VISIBLE_DEVICES" >&2; sleep 0.3; exit 3')
    problems = [ProblemRef(f"t{i}", f"t{i}.py") for i in range(5)]
    result = runner.run_bench(cfg, problems)
    recs = read_records(result.results_path)
    assert sorted(r.task for r in recs) == [f"t{i}" for i in range(5)]
    assert all(r.status == "crash" for r in recs)
    gpus = {r.error.strip() for r in recs}
    assert gpus == {"gpu=5", "gpu=7"}


def test_ctrl_c_with_parallel_jobs_kills_every_child_and_records_nothing(tmp_path, request):
    """SIGINT reaches only the main thread; the children the worker threads wait on are
    killed too, no further task starts, and no crash rows are written (--resume reruns)."""
    import os
    import signal
    import threading
    import time

    pids = tmp_path / "pids"
    cfg = runner.BenchConfig(backends=["eager"], device="cpu", out_dir=tmp_path / "out",
                             timeout_s=60.0, progress=False, plot=False, jobs=2)
    cfg.python = _fake_python(tmp_path, f'echo $$ >> "{pids}"; exec sleep 30')
    problems = [ProblemRef(f"t{i}", f"t{i}.py") for i in range(4)]

    def interrupt_once_both_run():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                not pids.exists() or len(pids.read_text().split()) < 2):
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever an earlier test in this worker installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    timer = threading.Thread(target=interrupt_once_both_run, daemon=True)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runner.run_bench(cfg, problems)
    assert time.monotonic() - t0 < 15
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 2                       # the two running; nothing started after
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    results = tmp_path / "out" / "results.jsonl"
    assert not results.exists() or not read_records(results)


def test_usage_errors_return_2(tmp_path, capsys):
    assert cli.run(_parse(["bench", "--out", str(tmp_path)])) == 2
    assert "no problems" in capsys.readouterr().err
    assert cli.run(_parse(["bench", "--level", "3", "--out", str(tmp_path)])) == 2
    assert cli.run(_parse(["bench", "--suite", "examples", "--backends", "eager,nope",
                           "--out", str(tmp_path)])) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
    assert cli.run(_parse(["bench", "--suite", "examples", "--jobs", "0",
                           "--out", str(tmp_path)])) == 2
    assert "--jobs must be positive" in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()


def test_timing_on_cpu():
    t = time_call(lambda: torch.ones(8).sum(), torch.device("cpu"), runs=5, warmup=1)
    assert t.clock == "cpu" and t.runs == 5 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 3.0], 25) == 1.5


def _stitchcuda_usable() -> bool:
    import torch._dynamo
    if "stitchcuda" not in torch._dynamo.list_backends():
        return False
    try:
        torch._dynamo.lookup_backend("stitchcuda")
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _stitchcuda_usable(), reason="stitchcuda backend not registered/importable")
def test_stitchcuda_backend_in_process():
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["mlp_gelu"]), name="mlp_gelu", backends=["eager", "stitchcuda"],
                     device="cpu", trials=2, runs=2, warmup=1, recompile=False)
    run_task(cfg, records.append)
    r = {x.backend: x for x in records}["stitchcuda"]
    assert r.status == "ok", r.error
    assert r.correct_kernelbench and r.correct_design, r.reason


DROPOUT_MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.lin(x))

    def get_inputs():
        return [torch.randn(8, 16)]

    def get_init_inputs():
        return []
""")

CONSTANT_MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.zeros_like(x) * x

    def get_inputs():
        return [torch.randn(4, 4)]

    def get_init_inputs():
        return []
""")


def _run_in_process(path, mode="train", backends=("eager",)):
    records = []
    cfg = TaskConfig(spec=str(path), name=path.stem, backends=list(backends), device="cpu",
                     mode=mode, trials=3, runs=2, warmup=0, recompile=False)
    run_task(cfg, records.append)
    return records


def test_determinism_control_reports_dropout_and_eval_removes_it(tmp_path):
    path = tmp_path / "dropout.py"
    path.write_text(DROPOUT_MODEL)
    (train,) = _run_in_process(path)
    assert train.status == "ok" and train.mode == "train"
    assert train.eager_deterministic is False and train.determinism_max_abs > 0
    # the backend rows are still judged (same seed before every call), not hidden
    assert train.correct_kernelbench is True
    (ev,) = _run_in_process(path, mode="eval")
    assert ev.eager_deterministic is True and ev.mode == "eval"


def test_constant_output_is_flagged(tmp_path):
    path = tmp_path / "constant.py"
    path.write_text(CONSTANT_MODEL)
    (rec,) = _run_in_process(path)
    assert rec.eager_output_varies is False


def test_backend_error_reason_names_the_real_error():
    from stitch_backend.bench.worker import _error_fields

    try:
        raise RuntimeError("backend='stitchcuda' raised:\nModuleNotFoundError: No module named 'x'\n\n"
                           "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    except RuntimeError as exc:
        fields = _error_fields(exc)
    assert fields["status"] == "error"
    assert "No module named 'x'" in fields["reason"] and "VERBOSE" not in fields["reason"]


def test_plot_skipped_with_a_note_without_matplotlib(full_run, monkeypatch):
    import sys
    from stitch_backend.bench.metrics import latest_runs
    from stitch_backend.bench.report import write_plot

    _, out = full_run
    results = latest_runs(read_records(out / "results.jsonl"))
    with monkeypatch.context() as m:
        for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
            m.setitem(sys.modules, name, None)                # import now fails
        note = write_plot(results, ["eager", "aot_eager"], out / "p.png")
    assert note.startswith("note: matplotlib is not installed") and not (out / "p.png").exists()
    pytest.importorskip("matplotlib")
    assert write_plot(results, ["eager", "aot_eager"], out / "p.png").startswith("plot:")
    assert (out / "p.png").stat().st_size > 1000


def test_trial_inputs_are_drawn_on_the_device(tmp_path):
    # Meta stands in for CUDA: the problem's torch.randn must create its tensor there
    # directly, not on the CPU first (GBs of level-1 inputs, every trial).
    from stitch_backend.bench.problems import load_problem
    from stitch_backend.bench.worker import References

    source = textwrap.dedent("""
        import torch, torch.nn as nn
        class Model(nn.Module):
            def forward(self, x):
                return x * 2
        def get_inputs():
            x = torch.randn(4, 8)
            assert x.device.type == DEVICE, x.device
            return [x]
        def get_init_inputs():
            return []
    """)
    for device in ("cpu", "meta"):
        spec = tmp_path / f"1_Scale_{device}.py"
        spec.write_text(source.replace("DEVICE", repr(device)))
        problem = load_problem(str(spec))
        cfg = TaskConfig(spec=str(spec), name="scale", backends=["eager"], device=device)
        (x,) = References(problem, cfg, torch.device(device)).inputs(0)
        assert x.device.type == device and x.shape == (4, 8)


@pytest.mark.skipif(not _stitchcuda_usable(), reason="stitchcuda backend not registered/importable")
def test_recompile_reports_the_backends_own_warm_start(tmp_path, monkeypatch):
    """After torch._dynamo.reset() the second compile loads from stitchcuda's cache; the
    record separates the backend's share of that first call."""
    from stitch_backend.bench.metrics import TaskResult
    from stitch_backend.bench.report import _compile_cell

    monkeypatch.setenv("STITCHCUDA_CACHE_DIR", str(tmp_path / "cache"))
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["mlp_gelu"]), name="mlp_gelu",
                     backends=["eager", "stitchcuda:cpu_interpret=1"], device="cpu",
                     trials=1, runs=2, warmup=1, recompile=True)
    run_task(cfg, records.append)
    r = {x.backend: x for x in records}["stitchcuda:cpu_interpret=1"]
    assert r.status == "ok", r.error
    assert r.recompile_cached is True
    assert 0 < r.recompile_backend_s < r.recompile_first_call_s
    # the records are the timed graph's, not the recompile's as well (which loaded from
    # the cache: none of the listed ones did)
    assert r.backend_records and not any(g["cached"] for g in r.backend_records), \
        [(g["index"], g["cached"]) for g in r.backend_records]
    result = TaskResult(task="mlp_gelu", task_run=r.task_run, records={r.backend: r})
    assert _compile_cell(result, r.backend).endswith(
        f"(backend {r.recompile_backend_s:.2f}, cache hit)")


def test_ctrl_c_ends_the_cli_with_a_resume_hint_not_a_traceback(tmp_path, monkeypatch, capsys):
    def interrupted(cfg, problems):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_bench", interrupted)
    assert cli.run(_parse(["bench", "--suite", "examples", "--out", str(tmp_path)])) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume" in err and str(tmp_path / "results.jsonl") in err
