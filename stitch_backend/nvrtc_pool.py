"""NVRTC compiles in helper processes, for ``toolchain.compile_many``.

libnvrtc 13.0 serialises the threads of one process: on the H100 machine (16 cores) 36 of
ResNet18's kernels took 1.9 s whether 2 or 16 threads compiled them, against 0.5 s in 8
processes (``kb`` scratch measurement, session 33). So a batch of NVRTC jobs goes to a few
short-lived Python processes that import only ``stitch_backend.toolchain`` (no torch, no
CUDA context, never the user's ``__main__``) and load the same libnvrtc as this process.

Each process serves one job at a time over its stdin/stdout: a length-prefixed pickle of
``(source, name, arch, options)`` in, ``("ok", CompiledKernel)``, ``("compile_error",
CompileError)`` or ``("failed", "Type: message")`` out. Only this module's own processes
are on the other end of those pipes.

If the processes cannot start or one dies, the jobs not done come back as ``None`` and
``compile_many`` compiles them in threads; the reason is logged as a warning (once per
process).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from stitch_backend import toolchain

log = logging.getLogger(__name__)

# Each NVRTC instance holds a few hundred MB while it runs; 8 processes compiled 36
# kernels as fast as 16 on the H100 machine.
MAX_PROCESSES = 8
_HEADER = struct.Struct(">Q")
_warned = False


class WorkerError(RuntimeError):
    """A helper process did not start, or stopped answering (its stderr in the message)."""


def helpers(workers: int, jobs: int) -> int:
    """How many helper processes ``compile_many`` gives ``jobs`` NVRTC jobs with
    ``workers`` workers (0: it compiles them in this process)."""
    return min(workers, MAX_PROCESSES, jobs) if workers > 1 and jobs > 1 else 0


def compile_jobs(jobs: Sequence[toolchain.CompileJob], workers: int,
                 on_done: Callable[[], None] | None = None) -> list[Any]:
    """Compile NVRTC ``jobs`` in up to ``min(workers, MAX_PROCESSES)`` helper processes;
    results in job order (memo hits served here). ``None`` marks a job the processes
    could not do; a ``ToolchainError`` from NVRTC itself is raised, as in-process."""
    results: list[Any] = [None] * len(jobs)
    todo: list[tuple[int, str, str, list[str]]] = []
    for i, job in enumerate(jobs):
        hit, options, key = toolchain.nvrtc_prepare(job.source, job.name, job.arch,
                                                    job.include_dirs, job.extra_flags)
        if hit is not None:
            results[i] = hit
            _tick(on_done)
        else:
            todo.append((i, key, job.name, options))
    if not todo:
        return results
    lib_path = toolchain.load_nvrtc()._name
    lock = threading.Lock()
    # longest sources first (popped from the end): a long kernel started last would
    # finish alone while the other processes sit idle
    queue = sorted(todo, key=lambda item: len(jobs[item[0]].source))
    errors: list[BaseException] = []

    def take() -> tuple[int, str, str, list[str]] | None:
        with lock:
            return queue.pop() if queue and not errors else None

    def drive() -> None:
        try:
            with _Worker(lib_path) as worker:
                while (item := take()) is not None:
                    i, key, name, options = item
                    try:
                        res = worker.compile(jobs[i].source, name, jobs[i].arch, options)
                    except WorkerError:
                        with lock:
                            queue.append(item)      # back for another process, or threads
                        raise
                    if isinstance(res, toolchain.CompiledKernel):
                        toolchain.nvrtc_remember(key, res)
                    results[i] = res
                    _tick(on_done)
        except WorkerError as err:
            _warn(err)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the caller
            with lock:
                errors.append(err)

    n = max(1, helpers(workers, len(todo)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="stitchcuda-nvrtc-pool") as pool:
        for fut in [pool.submit(drive) for _ in range(n)]:
            fut.result()
    if errors:
        raise errors[0]
    return results


def _tick(on_done: Callable[[], None] | None) -> None:
    if on_done is not None:
        on_done()


def _warn(err: WorkerError) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("NVRTC helper process unavailable (%s): compiling in threads of this "
                    "process instead (slower with libnvrtc 13.0)", err)


def command(lib_path: str) -> list[str]:
    """The helper process's command line (a test may point it elsewhere)."""
    # the working directory leaves the import path (it is this process's, which NVRTC's
    # line tables record: the cubins match those compiled here byte for byte)
    return [sys.executable, "-c",
            "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
            "from stitch_backend.nvrtc_pool import serve; serve(sys.argv[1])", lib_path]


def helper_env() -> dict[str, str]:
    """The helper's environment: this one, with the folder holding this stitch_backend
    first on PYTHONPATH (so a source checkout on ``sys.path`` works too)."""
    root = str(Path(toolchain.__file__).resolve().parent.parent)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root] + rest))


class _Worker:
    """One helper process, for the duration of a ``with`` block."""

    def __init__(self, lib_path: str):
        self.lib_path = lib_path

    def __enter__(self) -> "_Worker":
        if not sys.executable or getattr(sys, "frozen", False):
            raise WorkerError("no Python interpreter to start (sys.executable is empty, or "
                              "this is a frozen application)")
        self.stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(command(self.lib_path), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, env=helper_env())
        except OSError as err:
            self.stderr.close()
            raise WorkerError(f"could not start {sys.executable}: {err}") from err
        return self

    def compile(self, source: str, name: str, arch: str, options: list[str]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _send(self.proc.stdin, (source, name, arch, options))
            kind, payload = _recv(self.proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            raise WorkerError(self._died(err)) from err
        if kind == "failed":
            raise toolchain.ToolchainError(f"NVRTC (in a helper process): {payload}")
        return payload

    def _died(self, err: BaseException) -> str:
        self.proc.kill()
        self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        return (f"helper exited with {self.proc.returncode} ({type(err).__name__})"
                + (": " + " | ".join(tail) if tail else ""))

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.stderr.close()


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the helper closed its output")
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the helper's answer was cut short")
    return pickle.loads(data)


def serve(lib_path: str) -> None:
    """The helper process: answer compile requests on stdin until it closes."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr            # nothing else may write to the answers' pipe
    lib = toolchain.load_nvrtc(lib_path)
    inp = sys.stdin.buffer
    while True:
        try:
            source, name, arch, options = _recv(inp)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", toolchain.nvrtc_compile(lib, source, name, arch, options))
        except toolchain.CompileError as err:
            answer = ("compile_error", err)
        except Exception as err:  # noqa: BLE001 - told to the parent, which raises it
            answer = ("failed", f"{type(err).__name__}: {err}")
        _send(out, answer)
