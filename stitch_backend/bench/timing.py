"""Timing one callable: median and spread of many runs.

On CUDA: CUDA events around each run, L2 flushed before each (a 256 MB write, larger
than any current L2) and the device idle when the start event is recorded, so the time
includes the host's launch overhead (the part CUDA graphs and fusion remove) instead of
hiding it behind queued work. On CPU: ``time.perf_counter``; those numbers are marked
``clock="cpu"`` and are not what the product claims.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over ``runs`` timed runs (after ``warmup`` untimed ones)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    warmup: int
    clock: str              # "cuda-events" or "cpu"
    host_ms: float | None = None   # median time until a call returned (its work queued)


class L2Flusher:
    """Overwrites a 256 MB device buffer so the next run starts with a cold L2."""

    def __init__(self, device: torch.device):
        self._buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self._buf.zero_()


def gpu_state(device: torch.device) -> dict[str, float] | None:
    """The card as a backend's timed runs begin or end: temperature (C), SM clock (MHz)
    and power draw (W) from NVML where it can be read (records timed one after another
    show whether the card drifted: a backend timed after another's long compile may find
    it hotter and clocked lower), and the caching allocator's reserved and the device's
    free memory (GiB) with its count of allocations retried after freeing its cache
    (timed calls that each had to return cached memory to the driver); None off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    state = {"reserved_gib": round(torch.cuda.memory_reserved(device) / 2**30, 2),
             "free_gib": round(free / 2**30, 2),
             "alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))}
    try:
        state.update(temp_c=float(torch.cuda.temperature(device)),
                     sm_mhz=float(torch.cuda.clock_rate(device)),
                     power_w=round(torch.cuda.power_draw(device) / 1000.0, 1))
    except Exception:  # noqa: BLE001 - NVML absent or unreadable: memory only
        pass
    return state


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of a non-empty list."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_call(fn: Callable[[], Any], device: torch.device, *, runs: int, warmup: int,
              flusher: L2Flusher | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``runs`` timed ones; on CUDA each timed
    run is preceded by ``flusher()`` (when given) and a synchronize."""
    host: list[float] = []
    return summarize(run_times(fn, device, runs=runs, warmup=warmup, flusher=flusher, host=host),
                     warmup, device, host)


def run_times(fn: Callable[[], Any], device: torch.device, *, runs: int, warmup: int,
              flusher: L2Flusher | None = None, host: list[float] | None = None) -> list[float]:
    """The milliseconds of each of ``runs`` timed calls, as ``time_call`` takes them;
    ``host`` (when given) gets each call's host milliseconds, until it returned: on CUDA
    its work is then queued, not done, so this is the call's host path (guards,
    wrappers, launches), the part of the timing the GPU may wait for."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        for _ in range(runs):
            if flusher is not None:
                flusher()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            t0 = time.perf_counter()
            fn()
            returned = time.perf_counter()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if host is not None:
                host.append((returned - t0) * 1e3)
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if host is not None:
            host += times[-runs:]
    return times


def summarize(times: list[float], warmup: int, device: torch.device,
              host: list[float] | None = None) -> Timing:
    """Median and spread of ``times`` (milliseconds); the median of ``host``, if any."""
    return Timing(median_ms=statistics.median(times), p10_ms=percentile(times, 10),
                  p90_ms=percentile(times, 90), runs=len(times), warmup=warmup,
                  clock="cuda-events" if device.type == "cuda" else "cpu",
                  host_ms=statistics.median(host) if host else None)


def time_first_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds taken by one call of ``fn`` (device synchronized before and after) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, result
