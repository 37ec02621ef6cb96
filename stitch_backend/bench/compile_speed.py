"""Seconds a kernel for each compiler, on sources ``stitchcuda explain --emit-dir`` wrote.

    stitchcuda explain MODEL.py --arch sm_90a --emit-dir DIR
    python3 -P -m stitch_backend.bench.compile_speed DIR [--arch sm_90a] [--threads 0]

Compiles every ``.cu`` in DIR with each compiler (``toolchain.COMPILERS`` less "auto"),
first one after another, then through ``compile_many`` (``--threads`` 0: one per core;
NVRTC jobs go to at most ``nvrtc_pool.MAX_PROCESSES`` helper processes),
the in-process memo cleared before each pass, and prints one line per pass. No GPU
needed. What the backend pays for a graph's kernels is the ``compile_many`` line of the
compiler ``toolchain.resolve_compiler()`` picks here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from stitch_backend import nvrtc_pool, toolchain


def timed_passes(sources: dict[str, str], arch: str, threads: int) -> list[tuple[str, str, float]]:
    """(compiler, how, seconds) for each compiler that is present: serial, then parallel."""
    rows = []
    for compiler in ("nvrtc", "nvcc"):
        try:
            toolchain.resolve_compiler(compiler)
        except toolchain.ToolchainError as err:
            print(f"{compiler}: not available ({str(err).splitlines()[0]})")
            continue
        toolchain.clear_memo()
        t0 = time.perf_counter()
        for name, src in sources.items():
            try:
                toolchain.compile_kernel(src, name, arch, compiler=compiler)
            except toolchain.CompileError as err:
                raise SystemExit(f"{compiler}: {name} failed to compile:\n{err}") from None
        rows.append((compiler, "one after another", time.perf_counter() - t0))
        toolchain.clear_memo()
        jobs = [toolchain.CompileJob(src, name, arch, compiler=compiler)
                for name, src in sources.items()]
        t0 = time.perf_counter()
        results = toolchain.compile_many(jobs, max_workers=threads or None)
        workers = threads or os.cpu_count() or 1
        procs = nvrtc_pool.helpers(workers, len(jobs)) if compiler == "nvrtc" else 0
        how = f"{procs} helper processes" if procs else f"{workers} threads"
        rows.append((compiler, f"compile_many, {how}", time.perf_counter() - t0))
        failed = [r for r in results if isinstance(r, toolchain.CompileError)]
        if failed:
            raise SystemExit(f"{compiler}: {len(failed)} source(s) failed to compile:\n"
                             f"{failed[0]}")
    toolchain.clear_memo()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m stitch_backend.bench.compile_speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a folder of .cu files (explain --emit-dir)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--threads", type=int, default=0, help="compile_many's threads (0: cores)")
    args = p.parse_args(argv)
    files = sorted(args.dir.glob("*.cu"))
    if not files:
        print(f"no .cu files in {args.dir}", file=sys.stderr)
        return 2
    sources = {f.stem: f.read_text() for f in files}
    print(f"{len(sources)} kernel(s) from {args.dir}, {args.arch}, {os.cpu_count()} cores; "
          f"'auto' is {toolchain.resolve_compiler()} here")
    for compiler, how, seconds in timed_passes(sources, args.arch, args.threads):
        print(f"{compiler:5s} {how:28s} {seconds:7.2f} s  {seconds / len(sources):.3f} s a kernel")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
