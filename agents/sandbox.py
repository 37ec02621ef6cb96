"""Untrusted kernels are compiled and first run in a child process with a timeout.

A crash, an illegal address or a hang in an LLM-written kernel must be a rejection, not
a dead or wedged user process (DESIGN.md, Verification protocol: Isolation). The parent
writes a job folder: the source, the launch (grid, block, shared memory, signature and
every argument as a reference to an input, output or scratch tensor, or a value) and
the tensors as raw bytes beside JSON metas (no pickle). The child (``python -m
stitch_backend.agents.sandbox JOB``) compiles with ``toolchain.compile_cubin``, and in
``run`` mode launches through ``stitch_backend.cuda_driver`` on its own copies of the
tensors, synchronises and writes the outputs back; the parent compares them. The child
gets no API keys in its environment, runs in its own session, and is killed with its
whole process group (nvcc included) when the timeout passes.

A run may also be timed (``time_against``: a trusted cubin with the same entry, launched
the same way, i.e. the template's): after the checked first launch, the two kernels are
launched in turn, each launch timed by CUDA events, and the medians come back in
``SandboxResult.times``. Advice for the LLM Coder's loop ("slow" feedback); the
Verifier's timing is what decides.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("stitch_backend.agents.sandbox")

RESULT = "result.json"
_INT_POISON = -7777777  # as stitch_backend.kernels
JOB = "job.json"
# Environment variables the child never sees (it runs code nobody has reviewed).
_SECRET_ENV = re.compile(r"(?i)(API_?KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)")


@dataclass(frozen=True)
class ChildOutcome:
    """How the child process ended: ``returncode`` (negative: killed by that signal),
    ``timed_out`` when we killed it, and the tail of what it printed."""

    returncode: int | None
    timed_out: bool
    output: str
    seconds: float


@dataclass
class SandboxResult:
    """The child's verdict on an untrusted candidate. ``stage`` is where it stopped:
    "compile" (nvcc rejected it: ``log`` holds nvcc's output), "run" (the launch or the
    kernel failed), "timeout", "crash" (the child died), or "ok"."""

    ok: bool
    stage: str
    reason: str
    cubin: bytes | None = field(default=None, repr=False)
    log: str = field(default="", repr=False)
    compile_s: float | None = None
    seconds: float = 0.0
    outputs: list[Any] | None = field(default=None, repr=False)
    # With ``time_against``: median ms of a launch, {"candidate": .., "baseline": ..}.
    times: dict[str, float] | None = None


# --------------------------------------------------------------------------- the child process


def default_child() -> list[str]:
    """The command that runs a job folder (appended as its last argument)."""
    return [sys.executable, "-P", "-m", "stitch_backend.agents.sandbox"]


def child_env() -> dict[str, str]:
    """The parent's environment without anything that looks like a credential."""
    env = {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k)}
    env["PYTHONSAFEPATH"] = "1"
    return env


def run_child(argv: Sequence[str], timeout_s: float) -> ChildOutcome:
    """Run ``argv`` in a new session; past ``timeout_s`` kill its whole process group.
    Never raises for what the child does."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=child_env(),
                                    start_new_session=True)
        except OSError as err:
            return ChildOutcome(None, False, f"could not start the child: {err}", 0.0)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        out.seek(0)
        text = out.read()[-4000:].decode(errors="replace")
    return ChildOutcome(proc.returncode, timed_out, text, time.perf_counter() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created: the child and its nvcc
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _outcome_reason(outcome: ChildOutcome, timeout_s: float) -> tuple[str, str]:
    """(stage, reason) for a child that did not write its result."""
    tail = outcome.output.strip().splitlines()[-5:]
    said = ("; it printed: " + " | ".join(tail)) if tail else ""
    if outcome.timed_out:
        return "timeout", f"the child was killed after the {timeout_s:g} s timeout (a hang?)"
    code = outcome.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "crash", f"the child died of {name}{said}"
    return "crash", f"the child exited with status {code} and no result{said}"


# --------------------------------------------------------------------------- tensors as bytes


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a strided view reaches, from its first element."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def save_tensor(x: Any, path: Path, *, data: bool = True) -> dict[str, Any]:
    """Write the storage ``x`` reaches (strides kept) as raw bytes (``data=False``: the
    meta only); return its meta."""
    import torch

    span = _span(x.shape, x.stride())
    meta = {"file": None, "shape": list(x.shape), "stride": list(x.stride()),
            "dtype": str(x.dtype).removeprefix("torch."), "span": span}
    if data:
        flat = torch.as_strided(x.detach(), (span,), (1,)) if span else x.detach().reshape(0)
        path.write_bytes(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        meta["file"] = path.name
    return meta


def load_tensor(meta: dict[str, Any], folder: Path, device: Any) -> Any:
    """The tensor ``save_tensor`` wrote, on ``device``, with its shape and strides."""
    import torch

    dtype = getattr(torch, meta["dtype"])
    base = torch.empty(meta["span"], dtype=dtype, device=device)
    if meta["span"] and meta["file"]:
        data = bytearray((folder / meta["file"]).read_bytes())
        base.copy_(torch.frombuffer(data, dtype=torch.uint8).view(dtype))
    return torch.as_strided(base, meta["shape"], meta["stride"])


def launch_spec(plan: Any, inputs: Sequence[Any], signature: str) -> dict[str, Any]:
    """The launch of ``plan`` (a codegen LaunchPlan for ``inputs``) with every pointer
    argument replaced by a reference to the tensor it points at."""
    import torch

    tensors = {"input": [x for x in inputs], "output": list(plan.outputs),
               "scratch": list(plan.scratch)}
    args: list[list[Any]] = []
    for code, value in zip(signature, plan.args):
        if code != "p":
            args.append(["value", value])
            continue
        if value == 0:
            args.append(["null"])
            continue
        for kind in ("output", "scratch", "input"):
            hit = next((i for i, t in enumerate(tensors[kind])
                        if isinstance(t, torch.Tensor) and t.data_ptr() == value), None)
            if hit is not None:
                args.append([kind, hit])
                break
        else:
            raise ValueError(f"launch argument {value:#x} points at no input, output or scratch")
    return {"grid": list(plan.grid), "block": list(plan.block), "shared_mem": plan.shared_mem,
            "args": args}


# --------------------------------------------------------------------------- the parent side


def compile_in_child(source: str, entry: str, arch: str, *, timeout_s: float = 120.0,
                     child: Sequence[str] | None = None) -> SandboxResult:
    """Compile untrusted ``source`` in a child process; ``ok`` with the cubin, or the
    reason (nvcc's log for a compile error, the signal for a crash, the timeout)."""
    return _run_job({"mode": "compile", "entry": entry, "arch": arch}, source, timeout_s,
                    child=child)


def first_run_in_child(source: str, entry: str, signature: str, inputs: Sequence[Any],
                       plan: Any, *, arch: str, timeout_s: float = 120.0,
                       cubin: bytes | None = None, time_against: bytes | None = None,
                       timed_launches: int = 20,
                       child: Sequence[str] | None = None) -> SandboxResult:
    """Compile (unless ``cubin`` is given) and launch untrusted ``source`` once in a
    child process, with copies of ``inputs`` and the launch ``plan`` that the template
    kernel's launch rule made for them (``FusedKernel.prepare(inputs)``); ``outputs``
    come back on the inputs' device, NaN-poisoned before the launch. With
    ``time_against`` (a trusted cubin of the same entry), both are then timed over
    ``timed_launches`` launches each (``times``)."""
    import torch

    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)),
                  torch.device("cuda"))
    job: dict[str, Any] = {"mode": "run", "entry": entry, "arch": arch,
                           "signature": signature, "device": device.index or 0}
    job["launch"] = launch_spec(plan, inputs, signature)
    if time_against is not None:
        job["time"] = {"baseline": "baseline.cubin", "launches": int(timed_launches)}

    def write_tensors(folder: Path) -> None:
        if time_against is not None:
            (folder / "baseline.cubin").write_bytes(time_against)
        for kind, values in (("input", inputs), ("output", plan.outputs),
                             ("scratch", plan.scratch)):
            job[kind] = [save_tensor(x, folder / f"{kind}{i}.bin", data=kind != "output")
                         if isinstance(x, torch.Tensor) else None
                         for i, x in enumerate(values)]

    return _run_job(job, source, timeout_s, cubin=cubin, child=child, prepare=write_tensors,
                    device=device)


def _run_job(job: dict[str, Any], source: str, timeout_s: float, *,
             cubin: bytes | None = None, child: Sequence[str] | None = None,
             prepare: Any = None, device: Any = None) -> SandboxResult:
    folder = Path(tempfile.mkdtemp(prefix="stitchcuda-sandbox-"))
    try:
        (folder / "source.cu").write_text(source)
        if cubin is not None:
            (folder / "kernel.cubin").write_bytes(cubin)
            job["cubin"] = "kernel.cubin"
        if prepare is not None:
            prepare(folder)
        (folder / JOB).write_text(json.dumps(job))
        outcome = run_child([*(child or default_child()), str(folder)], timeout_s)
        result_path = folder / RESULT
        if not result_path.is_file():
            stage, reason = _outcome_reason(outcome, timeout_s)
            log.info("sandbox: %s", reason)
            return SandboxResult(False, stage, reason, log=outcome.output,
                                 seconds=outcome.seconds)
        res = json.loads(result_path.read_text())
        out = SandboxResult(bool(res["ok"]), res["stage"], res["reason"],
                            log=res.get("log", ""), compile_s=res.get("compile_s"),
                            seconds=outcome.seconds, times=res.get("times"))
        if (folder / "kernel.cubin").is_file():
            out.cubin = (folder / "kernel.cubin").read_bytes()
        if out.ok and job["mode"] == "run":
            out.outputs = [load_tensor(m, folder, device) for m in res["outputs"]]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- the child side


def _write_result(folder: Path, **result: Any) -> None:
    tmp = folder / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, folder / RESULT)


def child_main(folder: Path) -> int:
    """Do the job in ``folder`` and write ``result.json``. Runs in the child process."""
    job = json.loads((folder / JOB).read_text())
    compile_s = None
    if job.get("cubin"):
        cubin = (folder / job["cubin"]).read_bytes()
    else:
        from stitch_backend.toolchain import CompileError, compile_cubin

        try:
            kernel = compile_cubin((folder / "source.cu").read_text(), job["entry"], job["arch"])
        except CompileError as err:
            _write_result(folder, ok=False, stage="compile", reason="nvcc rejected the source",
                          log=err.log)
            return 0
        cubin, compile_s = kernel.cubin, kernel.seconds
        (folder / "kernel.cubin").write_bytes(cubin)
    if job["mode"] == "compile":
        _write_result(folder, ok=True, stage="ok", reason="compiled", compile_s=compile_s)
        return 0
    try:
        outputs, times = _launch(folder, job, cubin)
    except Exception as err:  # noqa: BLE001 - whatever the kernel did is the verdict
        _write_result(folder, ok=False, stage="run", compile_s=compile_s,
                      reason=f"first run failed: {type(err).__name__}: {err}")
        return 0
    _write_result(folder, ok=True, stage="ok", reason="ran", compile_s=compile_s,
                  outputs=outputs, times=times)
    return 0


def _launch(folder: Path, job: dict[str, Any],
            cubin: bytes) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    import torch

    from stitch_backend.cuda_driver import CudaModule

    torch.cuda.set_device(job["device"])
    device = torch.device("cuda", job["device"])
    tensors = {kind: [load_tensor(m, folder, device) if m is not None else None
                      for m in job[kind]] for kind in ("input", "output", "scratch")}
    for out in tensors["output"]:  # poisoned: an element the kernel forgets cannot pass
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.dtype == torch.bool:
            out.fill_(True)
        else:
            out.fill_(_INT_POISON)
    launch = job["launch"]
    args = []
    for ref in launch["args"]:
        if ref[0] == "value":
            args.append(ref[1])
        elif ref[0] == "null":
            args.append(0)
        else:
            args.append(tensors[ref[0]][ref[1]].data_ptr())
    shape = (tuple(launch["grid"]), tuple(launch["block"]), args, launch["shared_mem"])
    fn = CudaModule(cubin).function(job["entry"], job["signature"])
    fn.launch(*shape)
    torch.cuda.synchronize()
    outputs = [save_tensor(x, folder / f"result{i}.bin") for i, x in enumerate(tensors["output"])]
    if "time" not in job:
        return outputs, None
    baseline = CudaModule((folder / job["time"]["baseline"]).read_bytes()).function(
        job["entry"], job["signature"])
    return outputs, _time({"candidate": fn, "baseline": baseline}, shape,
                          job["time"]["launches"])


def _time(fns: dict[str, Any], shape: tuple, launches: int) -> dict[str, float]:
    """Median ms of one launch of each of ``fns``, launched in turn (two warm-ups each)."""
    import statistics

    import torch

    for fn in fns.values():
        for _ in range(2):
            fn.launch(*shape)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(launches):
        for name, fn in fns.items():
            start.record()
            fn.launch(*shape)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(ts) for name, ts in times.items()}


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1])))
