"""Metrics on crafted records: geomean, KernelBench's fast_p, latest run per task."""

import math

import pytest

from stitch_backend.bench.metrics import fast_p, geomean, latest_runs, summarise
from stitch_backend.bench.records import BenchRecord, read_records, append_records


def rec(task, backend, ms, kb=True, design=True, status="ok", run="r1"):
    return BenchRecord(task=task, spec=f"{task}.py", backend=backend, status=status,
                       task_run=run, median_ms=ms if status == "ok" else None,
                       correct_kernelbench=kb if status == "ok" else None,
                       correct_design=design if status == "ok" else None)


RECORDS = [
    # an older run of A that must be ignored
    rec("A", "eager", 10.0, run="old"), rec("A", "inductor", 1.0, run="old"), rec("A", "x", 1.0, run="old"),
    rec("A", "eager", 10.0), rec("A", "inductor", 5.0), rec("A", "x", 2.0),
    rec("B", "eager", 10.0), rec("B", "inductor", 10.0), rec("B", "x", 20.0),
    rec("C", "eager", 10.0), rec("C", "inductor", 8.0, kb=False), rec("C", "x", None, status="error"),
]


def test_geomean_and_fast_p_basics():
    assert geomean([]) is None
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])
    correct = [True, True, False, True]
    speedups = [2.0, 0.5, 3.0, None]
    assert fast_p(correct, speedups, 0) == 0.5           # correct and timed
    assert fast_p(correct, speedups, 1) == 0.25          # the incorrect 3.0x does not count
    assert fast_p([], [], 1) == 0.0
    with pytest.raises(ValueError):
        fast_p([True], [], 1)


def test_latest_runs_uses_last_task_run():
    results = latest_runs(RECORDS)
    assert [r.task for r in results] == ["A", "B", "C"]
    assert results[0].task_run == "r1"
    assert results[0].speedup("x") == pytest.approx(5.0)
    assert results[0].speedup("x", over="inductor") == pytest.approx(2.5)
    assert results[2].speedup("x") is None


def test_summarise():
    s = {b.backend: b for b in summarise(latest_runs(RECORDS), ["eager", "inductor", "x"])}
    x, ind, eager = s["x"], s["inductor"], s["eager"]
    assert x.tasks == 3 and x.timed == 2 and x.errors == 1
    assert x.correct_kernelbench == 2
    assert x.geomean_vs_eager == pytest.approx(math.sqrt(5.0 * 0.5))
    assert x.fast_p == {0.0: pytest.approx(2 / 3), 1.0: pytest.approx(1 / 3),
                        1.5: pytest.approx(1 / 3), 2.0: pytest.approx(1 / 3)}
    assert x.geomean_vs_inductor == pytest.approx(math.sqrt(2.5 * 0.5))
    assert x.vs_inductor_tasks == 2
    assert ind.correct_kernelbench == 2 and ind.correct_design == 3
    assert ind.geomean_vs_eager == pytest.approx(math.sqrt(2.0))
    assert ind.geomean_vs_eager_design == pytest.approx((2.0 * 1.0 * 1.25) ** (1 / 3))
    assert ind.fast_p[1.0] == pytest.approx(1 / 3)       # 1.0x is not > 1
    assert ind.geomean_vs_inductor is None
    assert eager.geomean_vs_eager == pytest.approx(1.0) and eager.fast_p[1.0] == 0.0


def test_records_roundtrip_nan_as_null_and_torn_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    r = rec("A", "x", 1.5)
    r.norm_err = float("nan")
    r.max_abs = float("inf")
    append_records(path, [r, rec("B", "x", 2.0)])
    with path.open("a") as f:
        f.write('{"task": "C", "back')                   # a writer killed mid-line
    back = read_records(path)
    assert [b.task for b in back] == ["A", "B"]
    assert back[0].norm_err is None and back[0].max_abs is None and back[0].median_ms == 1.5
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_bandwidth_table_for_cuda_records():
    from stitch_backend.bench.report import render_markdown

    recs = []
    for b, ms in (("eager", 2.0), ("x", 1.0)):
        r = rec("copy", b, ms)
        r.device, r.io_bytes = "cuda", 4_000_000_000   # 4 GB in and out
        recs.append(r)
    assert recs[1].gb_per_s == pytest.approx(4000.0)
    results = latest_runs(recs)
    md = render_markdown(results, summarise(results, ["eager", "x"]), ["eager", "x"], {})
    table = md.split("## Bandwidth")[1].split("##")[0]
    assert "| copy | 2000 | 4000 |" in table
    for r in recs:
        r.device = "cpu"          # CPU times are no bandwidth claim: no table
    md = render_markdown(results, summarise(results, ["eager", "x"]), ["eager", "x"], {})
    assert "## Bandwidth" not in md
    assert BenchRecord.from_dict({**recs[0].__dict__, "io_bytes": None}).gb_per_s is None


def test_host_table_for_cuda_records():
    """The host's part of a timed call (until it returned) gets a table of its own on
    CUDA; a backend without it shows a dash; CPU records (all host) get none."""
    from stitch_backend.bench.report import render_markdown

    recs = [rec("gemm", b, ms) for b, ms in (("eager", 2.8), ("dynamo", 2.9), ("x", 2.85))]
    for r, host in zip(recs, (0.021, 0.094, None)):
        r.device, r.host_ms = "cuda", host
    results = latest_runs(recs)
    names = ["eager", "dynamo", "x"]
    md = render_markdown(results, summarise(results, names), names, {})
    table = md.split("## Host")[1].split("\n## ")[0]
    assert "| gemm | 0.021 | 0.094 | — |" in table
    for r in recs:
        r.device = "cpu"
    assert "## Host" not in render_markdown(results, summarise(results, names), names, {})


def test_graphs_run_as_traced_are_named_in_the_task_notes():
    from stitch_backend.bench.report import render_markdown

    recs = [rec("kl", "eager", 2.0), rec("kl", "stitchcuda", 2.0), rec("mlp", "eager", 2.0),
            rec("mlp", "stitchcuda", 1.0)]
    recs[1].backend_records = [{"index": 0, "runs_as_traced": True},
                               {"index": 1, "runs_as_traced": False}]
    recs[3].backend_records = [{"index": 0, "runs_as_traced": False}]
    results = latest_runs(recs)
    md = render_markdown(results, summarise(results, ["eager", "stitchcuda"]),
                         ["eager", "stitchcuda"], {})
    tasks = md.split("## Tasks")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in tasks.splitlines()
            if line.startswith(("| kl ", "| mlp "))}
    assert "stitchcuda: 1/2 graph(s) run as traced (eager guard)" in rows["kl"]
    assert "as traced" not in rows["mlp"]


def test_gpu_state_table_shows_drift_between_backends_and_survives_a_roundtrip(tmp_path):
    from stitch_backend.bench.report import render_markdown
    from stitch_backend.bench.timing import gpu_state

    import torch
    assert gpu_state(torch.device("cpu")) is None
    recs = [rec("relu", "eager", 3.0), rec("relu", "x", 3.4)]
    recs[0].gpu_before = {"temp_c": 34.0, "sm_mhz": 1980.0, "power_w": 120.0,
                          "free_gib": 100.0, "alloc_retries": 0.0}
    recs[0].gpu_after = {"temp_c": 41.0, "sm_mhz": 1980.0, "power_w": 610.0,
                         "free_gib": 99.6, "alloc_retries": 0.0}
    recs[1].gpu_before = {"free_gib": 20.0, "alloc_retries": 3.0}       # no NVML
    recs[1].gpu_after = {"free_gib": 6.2, "alloc_retries": 13.0}
    path = tmp_path / "r.jsonl"
    append_records(path, recs)
    back = read_records(path)
    assert back[1].gpu_after == recs[1].gpu_after
    results = latest_runs(back)
    md = render_markdown(results, summarise(results, ["eager", "x"]), ["eager", "x"], {})
    table = md.split("## GPU while timing")[1].split("##")[0]
    assert ("| relu | 34 -> 41 C, 1980 -> 1980 MHz, 120 -> 610 W, 100 GiB free | "
            "6 GiB free, 10 allocation retries |") in table
    for r in back:
        r.gpu_before = r.gpu_after = None       # no NVML: no table
    results = latest_runs(back)
    assert "## GPU while timing" not in render_markdown(
        results, summarise(results, ["eager", "x"]), ["eager", "x"], {})


def test_a_backend_timed_on_a_much_hotter_card_is_named_in_the_task_notes():
    from stitch_backend.bench.report import HOTTER_C, render_markdown

    recs = [rec("gemm", "eager", 2.8), rec("gemm", "inductor", 3.0), rec("gemm", "x", 2.9)]
    for r, temp in zip(recs, (46.0, 46.0 + HOTTER_C - 1, 46.0 + HOTTER_C)):
        r.gpu_before = r.gpu_after = {"temp_c": temp, "free_gib": 50.0}

    def notes(records):
        results = latest_runs(records)
        md = render_markdown(results, summarise(results, ["eager", "inductor", "x"]),
                             ["eager", "inductor", "x"], {})
        (row,) = [line for line in md.split("## Tasks")[1].split("\n## ")[0].splitlines()
                  if line.startswith("| gemm ")]
        return row.rsplit(" | ", 1)[1]

    assert "x timed on a card 10 C hotter than eager's" in notes(recs)
    assert "inductor timed" not in notes(recs)         # 9 C: below the threshold
    for r in recs:
        r.timing_rounds = 4                           # interleaved: no order to blame
    assert "hotter" not in notes(recs)

