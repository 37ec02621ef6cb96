"""Benchmark jobs sharing GPUs: tasks dealt to GPUs round robin, each shared GPU's turn
lock (checks and timing inside it, host compiles outside), and a task that ran out of
GPU memory beside others or with every backend held at once run again alone or one
backend after another."""

import queue
from dataclasses import replace

import pytest
import torch

from stitch_backend.bench import runner
from stitch_backend.bench.metrics import TaskResult
from stitch_backend.bench.problems import ProblemRef
from stitch_backend.bench.records import BenchRecord
from stitch_backend.bench.worker import TaskConfig, run_task
from stitch_backend.examples import list_examples

EXAMPLES = {p.stem: p for p in list_examples()}


def test_share_gpu_deals_jobs_round_robin_with_a_turn_lock_per_shared_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one = runner.BenchConfig(backends=["eager"], device="cuda", jobs=3, share_gpu=True, gpus=1)
    slots = runner.plan_slots(one, tmp_path)
    assert [s.gpu for s in slots] == ["0", "0", "0"] and {s.shared_by for s in slots} == {3}
    assert len({s.turn_lock for s in slots}) == 1 and slots[0].turn_lock.startswith(str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    two = runner.BenchConfig(backends=["eager"], device="cuda", jobs=3, share_gpu=True, gpus=2)
    slots = runner.plan_slots(two, tmp_path)
    assert [(s.gpu, s.shared_by, s.turn_lock is None) for s in slots] == [
        ("4", 2, False), ("6", 1, True), ("4", 2, False)]
    env = runner._child_env(two, tmp_path, slots[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "4" and env["STITCHCUDA_BENCH_GPU_SHARED"] == "2"
    assert env["STITCHCUDA_BENCH_GPU_TURN"] == slots[0].turn_lock
    assert "STITCHCUDA_BENCH_GPU_TURN" not in runner._child_env(two, tmp_path, slots[1])


def _lock_is_held(path) -> bool:
    import fcntl
    import os
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_gpu_turn_is_exclusive_and_released(tmp_path):
    from stitch_backend.bench.turns import GpuTurn

    lock = str(tmp_path / "gpu0.lock")
    turn = GpuTurn(lock)
    assert not _lock_is_held(lock)
    with turn:
        assert _lock_is_held(lock)
        with pytest.raises(RuntimeError, match="re-entrant"):
            turn.__enter__()
    assert not _lock_is_held(lock)
    with GpuTurn(None):                          # not shared: nothing to take
        pass


def test_a_turn_hands_cached_memory_back_before_the_next_task_takes_the_gpu(tmp_path, monkeypatch):
    from stitch_backend.bench.turns import GpuTurn

    lock = str(tmp_path / "gpu0.lock")
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: events.append(("empty", _lock_is_held(lock))))
    with GpuTurn(lock):
        assert events == []
    assert events == ["sync", ("empty", True)]   # inside the turn, before the unlock
    with GpuTurn(None):                           # not shared: nothing to hand back
        pass
    assert len(events) == 2


def test_a_shared_task_times_in_its_turn_and_compiles_on_the_host_outside_it(tmp_path, monkeypatch):
    """Checks and timing hold the GPU's lock; a host-compiled backend's first call (its
    compile) does not, so other tasks' turns can overlap it. The record says the GPU
    was shared."""
    from stitch_backend.bench import worker

    lock = str(tmp_path / "gpu0.lock")
    monkeypatch.setenv("STITCHCUDA_BENCH_GPU_TURN", lock)
    monkeypatch.setenv("STITCHCUDA_BENCH_GPU_SHARED", "3")
    seen: list[tuple[str, bool]] = []
    real_first, real_time = worker.time_first_call, worker.time_call

    def first_call(fn, device):
        seen.append(("first", _lock_is_held(lock)))
        return real_first(fn, device)

    def timed(*a, **k):
        seen.append(("time", _lock_is_held(lock)))
        return real_time(*a, **k)

    monkeypatch.setattr(worker, "time_first_call", first_call)
    monkeypatch.setattr(worker, "time_call", timed)
    records = []
    cfg = TaskConfig(spec=str(EXAMPLES["mlp_gelu"]), name="mlp_gelu", backends=["eager", "aot_eager"],
                     device="cpu", trials=1, runs=2, warmup=1, recompile=False)
    run_task(cfg, records.append)
    assert all(r.status == "ok" and r.env["gpu_shared_by"] == 3 for r in records), records
    assert seen == [("first", False), ("time", True), ("first", False), ("time", True)]
    assert not _lock_is_held(lock)


def test_a_task_out_of_memory_beside_others_runs_again_alone_after_them(monkeypatch, caplog):
    calls = []

    def fake(cfg, ref, task_run, slot=runner.Slot()):
        calls.append((ref.name, slot.shared_by, slot.turn_lock))
        short = ref.name == "big" and slot.shared_by > 1
        return [BenchRecord(task=ref.name, spec=ref.spec, backend="eager",
                            status="error" if short else "ok", task_run=task_run,
                            error="torch.OutOfMemoryError: CUDA out of memory" if short else "")]

    monkeypatch.setattr(runner, "run_task_process", fake)
    cfg = runner.BenchConfig(backends=["eager"], device="cuda", jobs=2, share_gpu=True)
    slots = queue.SimpleQueue()
    for _ in range(2):
        slots.put(runner.Slot(gpu="0", turn_lock="/tmp/lock", shared_by=2))
    done = []
    refs = [ProblemRef(n, f"{n}.py") for n in ("a", "big", "c")]
    runner._run_slots(cfg, refs, lambda ref, recs: done.append((ref.name, recs[0].status)), slots)
    assert done[-1] == ("big", "ok") and sorted(done[:-1]) == [("a", "ok"), ("c", "ok")]
    assert calls[-1] == ("big", 1, None)          # alone: its own GPU, no turns
    assert "big: out of GPU memory while sharing the GPU; it runs again alone" in caplog.text
    # the same error with the GPU not shared, timed sequentially, is the task's result
    calls.clear()
    done.clear()
    slots = queue.SimpleQueue()
    slots.put(runner.Slot(gpu="0"))
    monkeypatch.setattr(runner, "run_task_process", lambda cfg, ref, run, slot=runner.Slot(): [
        calls.append(ref.name), BenchRecord(task=ref.name, spec=ref.spec, backend="eager",
                                            status="error", error="torch.OutOfMemoryError")][1:])
    runner._run_slots(replace(cfg, interleave=False), refs[1:2],
                      lambda ref, recs: done.append(ref.name), slots)
    assert done == ["big"] and calls == ["big"]


def test_an_interleaved_task_out_of_memory_alone_is_timed_again_sequentially(monkeypatch, caplog):
    """--interleave (the default) holds every backend at once: a task out of GPU memory
    so, on a GPU of its own (or again alone after sharing one), is run once more with its
    backends one after another, and its records and the report say so."""
    from stitch_backend.bench.report import _notes

    calls = []

    def fake(cfg, ref, task_run, slot=runner.Slot()):
        calls.append((cfg.interleave, slot.shared_by))
        short = cfg.interleave
        return [BenchRecord(task=ref.name, spec=ref.spec, backend=b, task_run=task_run,
                            status="error" if short else "ok",
                            error="torch.OutOfMemoryError: CUDA out of memory" if short else "")
                for b in ("eager", "stitchcuda")]

    monkeypatch.setattr(runner, "run_task_process", fake)
    cfg = runner.BenchConfig(backends=["eager", "stitchcuda"], device="cuda")
    assert cfg.interleave
    for shared_by, expected in ((1, [(True, 1), (False, 1)]),
                                (2, [(True, 2), (True, 1), (False, 1)])):
        calls.clear()
        done = []
        slots = queue.SimpleQueue()
        slots.put(runner.Slot(gpu="0", turn_lock="/tmp/lock" if shared_by > 1 else None,
                              shared_by=shared_by))
        runner._run_slots(cfg, [ProblemRef("big", "big.py")],
                          lambda ref, recs: done.append(recs), slots)
        assert calls == expected
        (recs,) = done
        assert [r.status for r in recs] == ["ok", "ok"]
        assert all(r.sequential_why == runner.SEQUENTIAL_WHY for r in recs)
    assert "with every backend held at once; it runs again with its backends" in caplog.text
    result = TaskResult(task="big", task_run="x", records={r.backend: r for r in recs})
    assert runner.SEQUENTIAL_WHY in _notes(result)
