"""Compile generated CUDA C++ (no torch headers) to cubins: NVRTC first, nvcc when
libnvrtc does not load (``compiler`` setting: "auto", "nvrtc" or "nvcc").

Why not ``torch.utils.cpp_extension``: on the H200 a one-line ``load_inline`` took 35 s
cold (the torch headers); ``nvcc -cubin`` of a small fused kernel took 0.7 s and NVRTC
0.5 s. So generated code is plain CUDA C++ that may include the headers in ``csrc/``
(always on the include path), compiled for one arch (``sm_90a`` on H200) and launched
with the driver API (see ``cuda_driver.py``).

Why NVRTC first: a kernel costs no nvcc process chain (preprocessor, cudafe, cicc, ptxas
as separate programs). A batch compiles in helper processes (``nvrtc_pool``: libnvrtc
13.0 serialises a process's threads on the H100 machine). On this project's CPU machine
(2026-12-07, 2 cores, kernels of the codegen case table for sm_90a, one a compile):
nvcc 0.63 s a kernel, NVRTC 0.12 s; 40 kernels took 3.84 s one after another through
NVRTC and 1.94 s in 4 threads, the cubins byte-identical to the serial ones (the
NVRTC guide's "Thread Safety" note allows concurrent calls). ResNet18's 18 kernels
(its traced layout, ``python3 -m stitch_backend.bench.compile_speed``): NVRTC 0.26 s a
kernel, nvcc 0.60 s; both layouts' 56 kernels had taken 7.7 s of nvcc on the H100.

Every compile is memoised in-process by sha256(source, arch, flags, include dirs,
compiler version, csrc headers), so compiling the same region twice costs nothing.
Nothing happens on import: nvcc and libnvrtc are looked up on first use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import glob
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from stitch_backend.compile_types import (LOG_LINES_IN_STR, CompiledKernel, CompileError,
                                          CompileJob, ToolchainError)

log = logging.getLogger("stitch_backend.toolchain")
output_code_log = logging.getLogger("stitch_backend.output_code")

__all__ = [
    "CompileError",
    "CompileJob",
    "CompiledKernel",
    "LOG_LINES_IN_STR",
    "ToolchainError",
    "arch_flag",
    "clear_memo",
    "compile_cubin",
    "compile_kernel",
    "compile_many",
    "compile_nvrtc",
    "COMPILERS",
    "csrc_dir",
    "cuda_include_dirs",
    "device_arch",
    "find_nvcc",
    "load_nvrtc",
    "nvcc_version",
    "nvrtc_version",
]

# Flags every nvcc compile gets. No --use_fast_math: results must stay within 1e-4 of
# eager, and fast-math swaps erff/expf/division for approximations.
NVCC_BASE_FLAGS: tuple[str, ...] = ("-cubin", "-O3", "-std=c++17", "-lineinfo")
NVRTC_BASE_FLAGS: tuple[str, ...] = ("-std=c++17", "-lineinfo")
# The ``compiler`` setting's values: "auto" is NVRTC when libnvrtc loads, else nvcc.
COMPILERS: tuple[str, ...] = ("auto", "nvrtc", "nvcc")

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")
# Where nvcc usually lives when neither $CUDA_HOME nor PATH names it.
FALLBACK_NVCC_PATHS: tuple[Path, ...] = (Path("/usr/local/cuda/bin/nvcc"),)


# --------------------------------------------------------------------------- discovery


def csrc_dir() -> Path:
    """The folder of the shipped CUDA headers (``common.cuh`` ...); always on the include path."""
    import stitch_backend.csrc as csrc_pkg  # a data package; importing it has no side effects

    return Path(csrc_pkg.__file__).resolve().parent


def _cuda_homes() -> list[Path]:
    """CUDA toolkit roots in priority order: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [Path(r) for r in roots if r]


def find_nvcc() -> Path | None:
    """Path of nvcc: $CUDA_HOME/bin, $CUDA_PATH/bin, then PATH, then /usr/local/cuda/bin; None if absent."""
    candidates: list[Path] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.extend(FALLBACK_NVCC_PATHS)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def _require_nvcc() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise ToolchainError("nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)")
    return nvcc


_version_cache: dict[str, str] = {}


def nvcc_version(nvcc: Path | None = None) -> str:
    """nvcc's release string, e.g. ``"13.0.88"`` (from ``nvcc --version``); cached per binary."""
    nvcc = nvcc or _require_nvcc()
    key = str(nvcc)
    if key not in _version_cache:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
        if m is None:
            raise ToolchainError(f"cannot parse the version from `{nvcc} --version`:\n{out}")
        _version_cache[key] = m.group(1)
    return _version_cache[key]


def cuda_include_dirs() -> list[Path]:
    """Include dirs holding cuda_fp16.h etc.: the toolkit's and the pip ``nvidia`` packages'."""
    dirs: list[Path] = []
    nvcc = find_nvcc()
    roots = _cuda_homes() + ([nvcc.resolve().parent.parent] if nvcc else [])
    for root in roots:
        for inc in (root / "include", root / "targets" / "x86_64-linux" / "include"):
            if (inc / "cuda_fp16.h").is_file() and inc not in dirs:
                dirs.append(inc)
    for sp in _site_dirs():
        for inc in sorted(glob.glob(os.path.join(sp, "nvidia", "cu1*", "include"))) + [
            os.path.join(sp, "nvidia", "cuda_runtime", "include")
        ]:
            p = Path(inc)
            if (p / "cuda_fp16.h").is_file() and p not in dirs:
                dirs.append(p)
    return dirs


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]


# --------------------------------------------------------------------------- arch


def _parse_arch(arch: str) -> tuple[str, str]:
    m = _ARCH_RE.match(arch)
    if m is None:
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_80', got {arch!r}")
    return m.group(1), m.group(2)


def has_clusters(arch: str) -> bool:
    """Whether ``arch`` ("sm_90a", "sm_80", ...) has thread-block clusters (sm_90 on);
    False for what is not a CUDA arch (the backend's "cpu" for interpreted graphs)."""
    m = _ARCH_RE.match(arch)
    return m is not None and int(m.group(1)) >= 90


def arch_flag(arch: str) -> str:
    """The nvcc flag selecting ``arch``: "sm_90a" -> "-gencode=arch=compute_90a,code=sm_90a".

    Always -gencode: the ``-arch=sm_90a`` shorthand misbehaves on nvcc 13.0 for Hopper.
    """
    num, suffix = _parse_arch(arch)
    return f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}"


def device_arch(device: int | None = None) -> str:
    """The arch string of a CUDA device, e.g. "sm_90a" for capability (9, 0).

    The "a" suffix is added for 9.0 only: wgmma/setmaxnreg need sm_90a, and an
    arch-specific cubin runs only on exactly that arch, which (9, 0) is.
    """
    import torch  # lazy: importing the backend must not import torch.cuda state

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


# --------------------------------------------------------------------------- memo


_memo: dict[str, CompiledKernel] = {}
_memo_lock = threading.Lock()
_headers_digest: str | None = None


def clear_memo() -> None:
    """Forget every memoised compile and what "auto" resolved to (tests use this)."""
    global _auto_choice
    with _memo_lock:
        _memo.clear()
    _auto_choice = None


def _csrc_headers_digest() -> str:
    """Digest of the shipped headers, so an edited common.cuh is not served a stale cubin."""
    global _headers_digest
    if _headers_digest is None:
        h = hashlib.sha256()
        root = csrc_dir()
        for p in sorted(root.rglob("*")):
            if p.suffix in (".cuh", ".h") and p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
        _headers_digest = h.hexdigest()
    return _headers_digest


def _memo_key(compiler: str, source: str, arch: str, flags: Sequence[str], include_dirs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for part in (compiler, arch, "\0".join(flags), "\0".join(include_dirs), _csrc_headers_digest(), source):
        h.update(part.encode())
        h.update(b"\x00\x01")
    return h.hexdigest()


def _memo_get(key: str, name: str) -> CompiledKernel | None:
    with _memo_lock:
        hit = _memo.get(key)
    if hit is None:
        return None
    log.debug("memo hit for %s (%s)", name, hit.arch)
    return hit if hit.name == name else dataclasses.replace(hit, name=name)


def _memo_put(key: str, kernel: CompiledKernel) -> None:
    with _memo_lock:
        _memo[key] = kernel


def _log_source(name: str, arch: str, source: str) -> None:
    if output_code_log.isEnabledFor(logging.DEBUG):
        output_code_log.debug("// kernel %s for %s\n%s", name, arch, source)


def _safe_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "kernel"


# --------------------------------------------------------------------------- nvcc


def compile_cubin(
    source: str,
    name: str,
    arch: str,
    *,
    include_dirs: Sequence[str | Path] = (),
    extra_flags: Sequence[str] = (),
    workdir: Path | None = None,
) -> CompiledKernel:
    """Compile ``source`` with ``nvcc -cubin -O3 -std=c++17 -lineinfo`` for ``arch``.

    ``csrc/`` is always on the include path (so ``#include "common.cuh"`` works).
    The result is memoised by content; a second call with the same inputs returns the
    same bytes without running nvcc. On failure raises ``CompileError`` whose
    ``source_path`` is a file that still exists (kept for debugging).
    ``workdir``: where the .cu and .cubin go (default: a temp dir, removed on success).
    """
    flag = arch_flag(arch)
    nvcc = _require_nvcc()
    incs = [str(csrc_dir())] + [str(d) for d in include_dirs]
    flags = [*NVCC_BASE_FLAGS, flag, *(f"-I{d}" for d in incs), *extra_flags]
    key = _memo_key(f"nvcc {nvcc_version(nvcc)}", source, arch, flags, incs)
    hit = _memo_get(key, name)
    if hit is not None:
        return hit
    _log_source(name, arch, source)

    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="stitchcuda-nvcc-")) if own_dir else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    stem = f"{_safe_stem(name)}_{key[:12]}"
    src_path, out_path = wd / f"{stem}.cu", wd / f"{stem}.cubin"
    src_path.write_text(source)
    cmd = [str(nvcc), *flags, "-o", str(out_path), str(src_path)]

    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    out_log = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or not out_path.is_file():
        log.info("nvcc failed for %s (%s) in %.2fs; source kept at %s", name, arch, seconds, src_path)
        raise CompileError(cmd, out_log or f"nvcc exited with {proc.returncode} and no output", src_path)
    cubin = out_path.read_bytes()
    if own_dir:
        shutil.rmtree(wd, ignore_errors=True)
    log.info("nvcc compiled %s for %s in %.2fs (%d bytes)", name, arch, seconds, len(cubin))
    kernel = CompiledKernel(name=name, arch=arch, cubin=cubin, log=out_log, seconds=seconds, cmd=cmd)
    _memo_put(key, kernel)
    return kernel


def compile_many(jobs: Sequence[CompileJob], max_workers: int | None = None,
                 on_done: Callable[[], None] | None = None) -> list[CompiledKernel | CompileError]:
    """Compile ``jobs`` in parallel (NVRTC in helper processes, ``nvrtc_pool``, or nvcc
    processes, as each job's ``compiler`` says), results in job order; ``on_done()`` is
    called as each job finishes (a progress bar). NVRTC jobs the helper processes could
    not take (they did not start: logged as a warning) compile in threads here.

    A job that fails to compile yields its ``CompileError`` in its slot instead of
    raising, so one bad candidate does not hide the others. Any other error (nvcc
    missing, a bad arch) is raised.
    """
    workers = max(1, min(max_workers or os.cpu_count() or 1, len(jobs) or 1))
    results: list[CompiledKernel | CompileError | None] = [None] * len(jobs)
    nvrtc = [i for i, job in enumerate(jobs) if resolve_compiler(job.compiler) == "nvrtc"]
    from stitch_backend import nvrtc_pool

    if nvrtc_pool.helpers(workers, len(nvrtc)):
        # NVRTC 13.0 serialises its threads (16 threads compiled 36 kernels no faster than
        # 2 on the H100 machine); helper processes compile them 4x faster there
        done = nvrtc_pool.compile_jobs([jobs[i] for i in nvrtc], workers, on_done)
        for i, res in zip(nvrtc, done):
            results[i] = res
    left = [i for i, res in enumerate(results) if res is None]

    def one(job: CompileJob) -> CompiledKernel | CompileError:
        try:
            return compile_kernel(
                job.source, job.name, job.arch, include_dirs=job.include_dirs,
                extra_flags=job.extra_flags, compiler=job.compiler,
            )
        except CompileError as e:
            return e
        finally:
            if on_done is not None:
                on_done()

    if left:
        with ThreadPoolExecutor(max_workers=min(workers, len(left)),
                                thread_name_prefix="stitchcuda-compile") as pool:
            for i, res in zip(left, pool.map(one, [jobs[i] for i in left])):
                results[i] = res
    return results   # type: ignore[return-value]  (every slot is filled by now)


def compile_kernel(
    source: str,
    name: str,
    arch: str,
    *,
    include_dirs: Sequence[str | Path] = (),
    extra_flags: Sequence[str] = (),
    compiler: str = "auto",
) -> CompiledKernel:
    """Compile with ``compiler`` (see ``COMPILERS``; ``resolve_compiler`` says which one
    "auto" is here); ToolchainError if it is not there.

    ``extra_flags`` go to whichever compiler runs; keep them to flags both accept
    (``-D...``, ``-maxrregcount=N``) or call ``compile_cubin``/``compile_nvrtc`` directly.
    """
    if resolve_compiler(compiler) == "nvrtc":
        return compile_nvrtc(source, name, arch, include_dirs=include_dirs, extra_flags=extra_flags)
    return compile_cubin(source, name, arch, include_dirs=include_dirs, extra_flags=extra_flags)


def resolve_compiler(compiler: str = "auto") -> str:
    """"nvrtc" or "nvcc": the compiler ``compiler`` names, "auto" being NVRTC when libnvrtc
    loads and nvcc otherwise (decided once a process, said at INFO). ToolchainError when the
    one named (for "auto", either) is missing; ValueError for a name not in COMPILERS."""
    global _auto_choice
    if compiler not in COMPILERS:
        raise ValueError(f"unknown compiler {compiler!r}; valid: {', '.join(COMPILERS)}")
    if compiler == "nvcc":
        _require_nvcc()
        return "nvcc"
    if compiler == "nvrtc":
        load_nvrtc()
        return "nvrtc"
    if _auto_choice is None:
        try:
            load_nvrtc()
            _auto_choice = "nvrtc"
        except ToolchainError as err:
            if find_nvcc() is None:
                raise ToolchainError(f"{err}\nand nvcc was not found either (looked in "
                                     "$CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)"
                                     ) from None
            log.info("libnvrtc did not load, generated kernels compile with nvcc (%s)",
                     str(err).splitlines()[0])
            _auto_choice = "nvcc"
    return _auto_choice


_auto_choice: str | None = None


# --------------------------------------------------------------------------- NVRTC

_nvrtc: ctypes.CDLL | None = None
_nvrtc_lock = threading.Lock()


def _nvrtc_candidates() -> list[str]:
    names: list[str] = []
    for sp in _site_dirs():
        names += sorted(glob.glob(os.path.join(sp, "nvidia", "cu1*", "lib", "libnvrtc.so*")), reverse=True)
        names += sorted(glob.glob(os.path.join(sp, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")), reverse=True)
    nvcc = find_nvcc()
    roots = _cuda_homes() + ([nvcc.resolve().parent.parent] if nvcc else [])
    for root in roots:
        names += sorted(glob.glob(str(root / "lib64" / "libnvrtc.so*")), reverse=True)
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    # builtins libraries are loaded by libnvrtc itself, never directly.
    names = [n for n in dict.fromkeys(names) if "builtins" not in n and "alt" not in os.path.basename(n)]
    # torch's own CUDA major first: its cubins then need no newer driver than torch does
    # (a cu13 NVRTC wheel beside a CUDA 12 torch would otherwise be tried first).
    major = _torch_cuda_major()
    if major is not None:
        names.sort(key=lambda n: not re.search(rf"libnvrtc\.so\.{major}(\.|$)", os.path.basename(n)))
    return names


def _torch_cuda_major() -> str | None:
    """The CUDA major version torch was built with, when torch is already imported (this
    module never imports it): "13" for torch's cu13 builds; None for a CPU build."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    return str(cuda).split(".")[0] if cuda else None


def load_nvrtc(path: str | None = None) -> ctypes.CDLL:
    """Load libnvrtc (pip ``nvidia`` packages, the toolkit, then the loader path; ``path``:
    that library only) once; ToolchainError if none loads."""
    global _nvrtc
    with _nvrtc_lock:
        if _nvrtc is not None:
            return _nvrtc
        errors = []
        for cand in [path] if path else _nvrtc_candidates():
            try:
                lib = ctypes.CDLL(cand)
            except OSError as e:
                errors.append(f"{cand}: {e}")
                continue
            _declare_nvrtc(lib)
            _nvrtc = lib
            log.debug("loaded NVRTC from %s", cand)
            return lib
        raise ToolchainError("libnvrtc could not be loaded; tried:\n  " + "\n  ".join(errors or ["(no candidates)"]))


def _declare_nvrtc(lib: ctypes.CDLL) -> None:
    c_int, c_char_p, c_size_t, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p
    pp = ctypes.POINTER
    lib.nvrtcVersion.argtypes = [pp(c_int), pp(c_int)]
    lib.nvrtcGetErrorString.restype = c_char_p
    lib.nvrtcGetErrorString.argtypes = [c_int]
    lib.nvrtcCreateProgram.argtypes = [pp(c_void_p), c_char_p, c_char_p, c_int, pp(c_char_p), pp(c_char_p)]
    lib.nvrtcCompileProgram.argtypes = [c_void_p, c_int, pp(c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [c_void_p, pp(c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [c_void_p, c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [c_void_p, pp(c_size_t)]
    lib.nvrtcGetCUBIN.argtypes = [c_void_p, c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [pp(c_void_p)]
    for fn in ("nvrtcVersion", "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize",
               "nvrtcGetProgramLog", "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcDestroyProgram"):
        getattr(lib, fn).restype = c_int


def nvrtc_version() -> str:
    """NVRTC's version as "major.minor" (loads libnvrtc)."""
    lib = load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def _nvrtc_check(lib: ctypes.CDLL, code: int, call: str) -> None:
    if code != 0:
        raise ToolchainError(f"{call} failed: {lib.nvrtcGetErrorString(code).decode()} ({code})")


def compile_nvrtc(
    source: str,
    name: str,
    arch: str,
    *,
    include_dirs: Sequence[str | Path] = (),
    extra_flags: Sequence[str] = (),
) -> CompiledKernel:
    """Compile ``source`` with NVRTC (ctypes on libnvrtc) straight to a cubin for ``arch``.

    Same include path (csrc/ plus the CUDA headers found), same memo and the same
    ``CompileError`` on failure as ``compile_cubin``; ``cmd`` reads ``["nvrtc", *options]``
    and ``source_path`` is a kept copy of the source.
    """
    hit, options, key = nvrtc_prepare(source, name, arch, include_dirs, extra_flags)
    if hit is not None:
        return hit
    kernel = nvrtc_compile(load_nvrtc(), source, name, arch, options)
    nvrtc_remember(key, kernel)
    return kernel


def nvrtc_prepare(source: str, name: str, arch: str, include_dirs: Sequence[str | Path] = (),
                  extra_flags: Sequence[str] = ()) -> tuple[CompiledKernel | None, list[str], str]:
    """(the memo's kernel or None, NVRTC's options, the memo key) for compiling
    ``source`` for ``arch``; a miss logs the source (output_code), as a compile does.
    ``compile_nvrtc`` and the helper processes' parent (``nvrtc_pool``) both start here
    and give a new kernel to ``nvrtc_remember``."""
    _parse_arch(arch)
    incs = [str(csrc_dir())] + [str(d) for d in include_dirs] + [str(d) for d in cuda_include_dirs()]
    options = [*NVRTC_BASE_FLAGS, f"--gpu-architecture={arch}", *(f"--include-path={d}" for d in incs), *extra_flags]
    key = _memo_key(f"nvrtc {nvrtc_version()}", source, arch, options, incs)
    hit = _memo_get(key, name)
    if hit is None:
        _log_source(name, arch, source)
    return hit, options, key


def nvrtc_remember(key: str, kernel: CompiledKernel) -> None:
    """Keep ``kernel`` in the memo under ``key`` (from ``nvrtc_prepare``)."""
    _memo_put(key, kernel)


def nvrtc_compile(lib: ctypes.CDLL, source: str, name: str, arch: str,
                  options: Sequence[str]) -> CompiledKernel:
    """One NVRTC compile with ``options`` as given (no memo): what ``compile_nvrtc`` and
    the helper processes of ``stitch_backend.nvrtc_pool`` run."""
    cmd = ["nvrtc", *options]
    t0 = time.perf_counter()
    prog = ctypes.c_void_p()
    fname = f"{_safe_stem(name)}.cu".encode()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), fname, 0, None, None),
                 "nvrtcCreateProgram")
    try:
        opt_arr = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = lib.nvrtcCompileProgram(prog, len(options), opt_arr)
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        out_log = buf.value.decode(errors="replace").strip()
        if rc != 0:
            src_path = Path(tempfile.mkdtemp(prefix="stitchcuda-nvrtc-")) / fname.decode()
            src_path.write_text(source)
            err = lib.nvrtcGetErrorString(rc).decode()
            raise CompileError(cmd, f"{err}\n{out_log}".strip(), src_path)
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        if size.value == 0:
            raise ToolchainError(f"NVRTC produced no cubin for {arch} (is it a real sm_ arch?)")
        cub = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cub), "nvrtcGetCUBIN")
        cubin = cub.raw[: size.value]
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    seconds = time.perf_counter() - t0
    log.info("NVRTC compiled %s for %s in %.2fs (%d bytes)", name, arch, seconds, len(cubin))
    return CompiledKernel(name=name, arch=arch, cubin=cubin, log=out_log, seconds=seconds, cmd=cmd)
