"""The small native runtime: build ``csrc/runtime/*.cu`` once per machine, load it, wrap cuBLASLt.

The runtime is one shared library, ``libstitch_runtime.so``, compiled by nvcc alone
(no torch headers, so a CPU-only CI machine builds it too) and linked against the
cuBLASLt that torch itself loads (the pip ``nvidia`` package) or the toolkit's. It is
built into ``$STITCHCUDA_CACHE_DIR/runtime/<key>/`` where the key hashes the sources,
nvcc's version, the arch, the flags and the cuBLASLt found, and is published with an
atomic rename, so concurrent builders and crashed builds never leave a half-written
library behind. Building and loading happen on first use, never at import.

``LtMatmul`` runs torch-facing matmuls (row-major, 2-D or batched 3-D) with cuBLASLt's
fused epilogues on the current stream; see ``csrc/runtime/gemm_lt.h`` for the mapping of
a row-major product onto cuBLASLt's column-major one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import toolchain

if TYPE_CHECKING:
    import torch

log = logging.getLogger("stitch_backend.runtime")

__all__ = [
    "ABI_VERSION",
    "CublasLtPaths",
    "EPILOGUES",
    "LtMatmul",
    "LtMatmulError",
    "RuntimeBuild",
    "RuntimeBuildError",
    "build_runtime",
    "find_cublaslt",
    "load_runtime",
    "runtime_sources",
]

ABI_VERSION = 1  # SC_LT_ABI_VERSION in gemm_lt.h
LIB_NAME = "libstitch_runtime.so"
BUILD_FLAGS: tuple[str, ...] = ("-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-lineinfo")
DEFAULT_RUNTIME_ARCH = "sm_90a"  # the H200; used when no GPU is visible (CI builds)

# Epilogue names (as in gemm_lt.h / cuBLASLt) -> sc_lt_epilogue value.
EPILOGUES: dict[str, int] = {
    "DEFAULT": 0, "BIAS": 1, "RELU": 2, "RELU_BIAS": 3, "GELU": 4, "GELU_BIAS": 5,
    "RELU_AUX": 6, "RELU_AUX_BIAS": 7, "GELU_AUX": 8, "GELU_AUX_BIAS": 9,
    "DRELU": 10, "DRELU_BGRAD": 11, "DGELU": 12, "DGELU_BGRAD": 13, "BGRADA": 14, "BGRADB": 15,
}
_BIAS_IN = {"BIAS", "RELU_BIAS", "GELU_BIAS", "RELU_AUX_BIAS", "GELU_AUX_BIAS"}
_BIAS_OUT = {"DRELU_BGRAD", "DGELU_BGRAD", "BGRADA", "BGRADB"}
_RELU_MASK_AUX = {"RELU_AUX", "RELU_AUX_BIAS", "DRELU", "DRELU_BGRAD"}
_GELU_AUX = {"GELU_AUX", "GELU_AUX_BIAS", "DGELU", "DGELU_BGRAD"}


# --------------------------------------------------------------------------- errors


class RuntimeBuildError(RuntimeError):
    """Building libstitch_runtime.so failed (or could not start): the command and the log."""

    def __init__(self, cmd: Sequence[str], log: str):
        self.cmd, self.log = list(cmd), log
        lines = log.splitlines()
        shown = "\n".join(lines[:40]) + (f"\n... ({len(lines) - 40} more lines)" if len(lines) > 40 else "")
        super().__init__(f"runtime build failed\n  command: {' '.join(self.cmd)}\n  log:\n{shown}")

    def __reduce__(self):
        return (RuntimeBuildError, (self.cmd, self.log))


class LtMatmulError(RuntimeError):
    """A cuBLASLt call failed: the cublasStatus_t, its text and what the runtime was doing."""

    def __init__(self, status: int, status_text: str, detail: str):
        self.status, self.status_text, self.detail = status, status_text, detail
        super().__init__(f"cuBLASLt matmul failed: {status_text} ({status}); {detail}")


# --------------------------------------------------------------------------- locating cuBLASLt


@dataclasses.dataclass(frozen=True)
class CublasLtPaths:
    """Where cublasLt.h and the library were found."""

    include_dir: Path
    lib_file: Path

    @property
    def lib_dir(self) -> Path:
        return self.lib_file.parent


def _cublaslt_roots() -> list[tuple[Path, Path]]:
    """(include dir, lib dir) pairs to search, pip packages first (the copy torch loads)."""
    pairs: list[tuple[Path, Path]] = []
    for sp in sys.path:
        nv = Path(sp or ".") / "nvidia"
        if not nv.is_dir():
            continue
        for sub in sorted(glob.glob(str(nv / "cu1*")), reverse=True) + [str(nv / "cublas")]:
            pairs.append((Path(sub) / "include", Path(sub) / "lib"))
    nvcc = toolchain.find_nvcc()
    roots = toolchain._cuda_homes() + ([nvcc.resolve().parent.parent] if nvcc else [])
    for root in roots:
        pairs.append((root / "include", root / "lib64"))
        pairs.append((root / "targets" / "x86_64-linux" / "include", root / "targets" / "x86_64-linux" / "lib"))
    return list(dict.fromkeys(pairs))


def _lib_in(d: Path) -> Path | None:
    plain = d / "libcublasLt.so"
    if plain.exists():
        return plain
    versioned = sorted(d.glob("libcublasLt.so.*"), key=lambda p: len(p.name))  # .so.13 before .so.13.1.0.3
    return versioned[0] if versioned else None


def find_cublaslt() -> CublasLtPaths | None:
    """cublasLt.h and libcublasLt.so*: a root holding both first, else the first of each; None if either is absent."""
    pairs = _cublaslt_roots()
    for inc, lib in pairs:
        lib_file = _lib_in(lib) if lib.is_dir() else None
        if (inc / "cublasLt.h").is_file() and lib_file:
            return CublasLtPaths(inc, lib_file)
    incs = [inc for inc, _ in pairs if (inc / "cublasLt.h").is_file()]
    libs = [f for _, lib in pairs if lib.is_dir() and (f := _lib_in(lib))]
    if incs and libs:
        return CublasLtPaths(incs[0], libs[0])
    return None


def _searched() -> str:
    return ", ".join(f"{i} + {l}" for i, l in _cublaslt_roots())


# --------------------------------------------------------------------------- building


def runtime_sources() -> list[Path]:
    """The .cu files compiled into the runtime library (csrc/runtime/*.cu)."""
    return sorted((toolchain.csrc_dir() / "runtime").glob("*.cu"))


def _cache_root() -> Path:
    # TODO(lead): read through stitch_backend.config once it exists; same variable and default.
    return Path(os.environ.get("STITCHCUDA_CACHE_DIR") or Path.home() / ".cache" / "stitchcuda")


@dataclasses.dataclass(frozen=True)
class RuntimeBuild:
    """A built (or already present) runtime library."""

    path: Path
    key: str
    cmd: list[str]
    seconds: float  # 0.0 when it was already built
    cached: bool


def _build_plan(arch: str) -> tuple[str, list[str], Path]:
    """(key, nvcc command without -o, output dir) for ``arch``; raises RuntimeBuildError when a piece is missing."""
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        raise RuntimeBuildError(["nvcc"], "nvcc not found ($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)")
    lt = find_cublaslt()
    if lt is None:
        raise RuntimeBuildError(
            ["nvcc"],
            "cuBLASLt not found: need cublasLt.h and libcublasLt.so* (pip install nvidia-cublas, or a CUDA toolkit "
            f"with cuBLAS). Searched: {_searched()}",
        )
    sources = runtime_sources()
    if not sources:
        raise RuntimeBuildError(["nvcc"], f"no sources in {toolchain.csrc_dir() / 'runtime'}")
    csrc = toolchain.csrc_dir()
    cmd = [
        str(nvcc), *BUILD_FLAGS, toolchain.arch_flag(arch),
        f"-I{csrc / 'runtime'}", f"-I{csrc}", f"-I{lt.include_dir}",
        *map(str, sources),
        f"-L{lt.lib_dir}", "-Xlinker", f"-l:{lt.lib_file.name}", "-Xlinker", f"-rpath={lt.lib_dir}",
    ]
    h = hashlib.sha256()
    h.update(f"abi {ABI_VERSION}\nnvcc {toolchain.nvcc_version(nvcc)}\narch {arch}\n".encode())
    h.update("\0".join(cmd[1:]).encode())
    for f in sources + sorted((csrc / "runtime").glob("*.h")) + sorted(csrc.glob("*.cuh")) + [lt.include_dir / "cublasLt.h"]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    key = h.hexdigest()[:20]
    return key, cmd, _cache_root() / "runtime" / key


def build_runtime(arch: str | None = None, *, force: bool = False) -> RuntimeBuild:
    """Build libstitch_runtime.so for ``arch`` (default: this GPU's, else sm_90a) unless already built.

    Idempotent and safe under concurrency: each builder writes a private temp file and
    renames it into place. Raises RuntimeBuildError with nvcc's log on failure.
    """
    arch = arch or (_visible_arch() or DEFAULT_RUNTIME_ARCH)
    key, cmd, out_dir = _build_plan(arch)
    final = out_dir / LIB_NAME
    if final.is_file() and not force:
        return RuntimeBuild(final, key, cmd + ["-o", str(final)], 0.0, True)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{LIB_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    full = cmd + ["-o", str(tmp)]
    log.info("building the stitchcuda runtime for %s into %s", arch, out_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeBuildError(full, (proc.stdout + proc.stderr).strip() or f"nvcc exited with {proc.returncode}")
    os.replace(tmp, final)
    meta_tmp = out_dir / f".build.json.{os.getpid()}.tmp"
    meta_tmp.write_text(json.dumps({"cmd": full, "seconds": seconds, "arch": arch, "key": key}, indent=1))
    os.replace(meta_tmp, out_dir / "build.json")
    log.info("built %s in %.1fs", final, seconds)
    return RuntimeBuild(final, key, full, seconds, False)


def _visible_arch() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return toolchain.device_arch() if torch.cuda.is_available() else None


# --------------------------------------------------------------------------- loading


class _Params(ctypes.Structure):
    """Mirror of sc_lt_params (gemm_lt.h); its size is checked against the library's."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("m", "n", "k", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c",
                                        "stride_bias", "ld_aux", "stride_aux")],
        *[(n, ctypes.c_void_p) for n in ("a", "b", "c", "d", "bias", "aux", "workspace")],
        ("workspace_size", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
        ("alpha", ctypes.c_float),
        ("beta", ctypes.c_float),
        *[(n, ctypes.c_int32) for n in ("batch_count", "trans_a", "trans_b", "dtype", "compute", "epilogue",
                                        "algo_index", "reserved")],
    ]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _declare(lib: ctypes.CDLL) -> None:
    vp, pp = ctypes.c_void_p, ctypes.POINTER
    lib.sc_lt_create.argtypes = [pp(vp)]
    lib.sc_lt_destroy.argtypes = [vp]
    lib.sc_lt_matmul.argtypes = [vp, pp(_Params)]
    lib.sc_lt_heuristics.argtypes = [vp, pp(_Params), ctypes.c_int, pp(ctypes.c_int)]
    lib.sc_lt_clear_cache.argtypes = [vp]
    for fn in ("sc_lt_create", "sc_lt_destroy", "sc_lt_matmul", "sc_lt_heuristics", "sc_lt_clear_cache",
               "sc_lt_abi_version"):
        getattr(lib, fn).restype = ctypes.c_int
    lib.sc_lt_status_string.argtypes = [ctypes.c_int]
    lib.sc_lt_status_string.restype = ctypes.c_char_p
    lib.sc_lt_last_error.argtypes = []
    lib.sc_lt_last_error.restype = ctypes.c_char_p
    lib.sc_lt_params_size.restype = ctypes.c_size_t
    lib.sc_lt_cublaslt_version.restype = ctypes.c_size_t


def load_runtime(arch: str | None = None) -> ctypes.CDLL:
    """Build (if needed) and load libstitch_runtime.so once per process; checks its ABI against this module."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        build = build_runtime(arch)
        lib = ctypes.CDLL(str(build.path))
        _declare(lib)
        if lib.sc_lt_abi_version() != ABI_VERSION or lib.sc_lt_params_size() != ctypes.sizeof(_Params):
            raise RuntimeBuildError(
                build.cmd,
                f"ABI mismatch: library abi={lib.sc_lt_abi_version()} params={lib.sc_lt_params_size()} bytes, "
                f"python abi={ABI_VERSION} params={ctypes.sizeof(_Params)} bytes",
            )
        log.info("loaded %s (cuBLASLt %d)", build.path, lib.sc_lt_cublaslt_version())
        _lib = lib
        return lib


def prebuild(arch: str | None = None) -> threading.Thread:
    """Build and load the runtime in a background thread (a daemon), so that its nvcc
    run (3.6 s on the CPU machine, 2026-12-07) overlaps a graph's kernel compiles
    instead of following them at the first cuBLASLt call. A failure here is only logged
    (DEBUG): the first real use builds again and raises it where it matters. Built
    already: the thread only loads it."""

    def build() -> None:
        try:
            load_runtime(arch)
        except Exception as err:  # noqa: BLE001 - said again by the first real use
            log.debug("background runtime build failed: %s: %s", type(err).__name__, err)

    thread = threading.Thread(target=build, name="stitchcuda-runtime-build", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- the matmul wrapper

_DTYPES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}


def _colmajor_operand(x: "torch.Tensor", what: str) -> tuple[int, int]:
    """(trans, ld) presenting the row-major (R, C) matrix ``x`` to cuBLASLt as its transpose (C x R).

    Rows-contiguous storage already is that transpose (op N, ld = row stride); columns-
    contiguous storage is the matrix itself, so op T with ld = column stride.
    """
    r, c = x.shape[-2], x.shape[-1]
    s0, s1 = x.stride(-2), x.stride(-1)
    if (s1 == 1 or c == 1) and (r == 1 or s0 >= max(c, 1)):
        return 0, (s0 if r > 1 else max(c, 1))
    if (s0 == 1 or r == 1) and (c == 1 or s1 >= max(r, 1)):
        return 1, (s1 if c > 1 else max(r, 1))
    raise ValueError(f"{what} with shape {tuple(x.shape)} and strides {tuple(x.stride())} has neither unit row nor "
                     "unit column stride; pass a contiguous tensor or a transposed view of one")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class LtMatmul:
    """cuBLASLt matmuls with fused epilogues on torch CUDA tensors.

    ``matmul(a, b)`` computes ``epilogue(alpha * op(a) @ op(b) + beta * c [+ bias])`` for
    row-major a (M,K) and b (K,N), 2-D or batched (B,M,K) @ (B,K,N) (either side may be
    2-D and is then shared by every batch). Results match torch within fp32 tolerance
    (strict fp32 unless ``allow_tf32``). One handle and one workspace per device and
    stream; call once outside a CUDA graph capture before capturing, so the workspace
    is not allocated inside the capture.
    """

    def __init__(self, workspace_bytes: int = 32 << 20):
        self.workspace_bytes = int(workspace_bytes)
        self._handles: dict[int, ctypes.c_void_p] = {}
        self._workspaces: dict[tuple[int, int], "torch.Tensor"] = {}
        self._lock = threading.Lock()

    # -- resources

    def _handle(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            h = self._handles.get(device)
            if h is None:
                import torch

                lib = load_runtime()
                h = ctypes.c_void_p()
                with torch.cuda.device(device):
                    self._check(lib, lib.sc_lt_create(ctypes.byref(h)))
                self._handles[device] = h
            return h

    def _workspace(self, device: int, stream: int) -> "torch.Tensor":
        import torch

        key = (device, stream)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=f"cuda:{device}")
            self._workspaces[key] = ws
        return ws

    @staticmethod
    def _check(lib: ctypes.CDLL, status: int) -> None:
        if status != 0:
            raise LtMatmulError(status, lib.sc_lt_status_string(status).decode(), lib.sc_lt_last_error().decode())

    def close(self) -> None:
        """Destroy the cuBLASLt handles and drop the workspaces."""
        with self._lock:
            if self._handles:
                lib = load_runtime()
                for h in self._handles.values():
                    lib.sc_lt_destroy(h)
            self._handles.clear()
            self._workspaces.clear()

    # -- aux buffers

    @staticmethod
    def empty_aux(epilogue: str, out_shape: Sequence[int], dtype: "torch.dtype", device) -> "torch.Tensor":
        """An aux buffer for ``epilogue`` and an output of ``out_shape`` (…, M, N).

        ReLU epilogues: a bit mask, uint8 (…, M, ceil(N/128)*16). GELU epilogues: the
        pre-activation in ``dtype``, (…, M, ceil(N/8)*8); its [..., :N] slice is gelu's input.
        """
        import torch

        *lead, m, n = out_shape
        if epilogue in _RELU_MASK_AUX:
            return torch.empty(*lead, m, _round_up(n, 128) // 8, dtype=torch.uint8, device=device)
        if epilogue in _GELU_AUX:
            return torch.empty(*lead, m, _round_up(n, 8), dtype=dtype, device=device)
        raise ValueError(f"epilogue {epilogue!r} takes no aux buffer")

    # -- the call

    def _params(self, a, b, *, bias, epilogue, out, aux, allow_tf32, trans_a, trans_b, alpha, beta, c, algo_index):
        import torch

        if trans_a:
            a = a.mT
        if trans_b:
            b = b.mT
        if epilogue is None:
            epilogue = "BIAS" if bias is not None else "DEFAULT"
        if epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {epilogue!r}; known: {sorted(EPILOGUES)}")
        if a.dim() not in (2, 3) or b.dim() not in (2, 3):
            raise ValueError(f"a and b must be 2-D or 3-D, got {a.dim()}-D and {b.dim()}-D")
        if a.dtype != b.dtype or str(a.dtype) not in _DTYPES:
            raise ValueError(f"a and b must share one of float32/float16/bfloat16, got {a.dtype} and {b.dtype}")
        if not (a.is_cuda and b.is_cuda) or a.device != b.device:
            raise ValueError(f"a and b must be CUDA tensors on one device, got {a.device} and {b.device}")
        if allow_tf32 and a.dtype != torch.float32:
            raise ValueError("allow_tf32 applies to float32 inputs only")
        M, K = a.shape[-2], a.shape[-1]
        K2, N = b.shape[-2], b.shape[-1]
        if K != K2:
            raise ValueError(f"inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
        batch = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
        for x, name in ((a, "a"), (b, "b")):
            if x.dim() == 3 and x.shape[0] != batch:
                raise ValueError(f"{name} has batch {x.shape[0]}, expected {batch}")
        batched = a.dim() == 3 or b.dim() == 3
        out_shape = (batch, M, N) if batched else (M, N)
        if out is None:
            out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
        if tuple(out.shape) != out_shape or out.dtype != a.dtype or out.device != a.device:
            raise ValueError(f"out must be {out_shape} {a.dtype} on {a.device}, got {tuple(out.shape)} {out.dtype}")
        if out.stride(-1) != 1 or (M > 1 and out.stride(-2) < N):
            raise ValueError(f"out must have contiguous rows, got strides {tuple(out.stride())}")

        p = _Params()
        p.m, p.n, p.k = N, M, K
        p.trans_a, p.lda = _colmajor_operand(b, "b")  # cuBLASLt's A is torch's b (see gemm_lt.h)
        p.trans_b, p.ldb = _colmajor_operand(a, "a")
        p.ldc = out.stride(-2) if M > 1 else N
        p.stride_a = b.stride(0) if b.dim() == 3 else 0
        p.stride_b = a.stride(0) if a.dim() == 3 else 0
        p.stride_c = out.stride(0) if batched else 0
        p.batch_count = batch
        p.a, p.b, p.d = b.data_ptr(), a.data_ptr(), out.data_ptr()
        p.alpha, p.beta = float(alpha), float(beta)
        if beta != 0.0:
            if c is None:
                raise ValueError("beta != 0 needs c")
            if tuple(c.shape) != out_shape or c.dtype != a.dtype or c.stride() != out.stride():
                raise ValueError(f"c must match out: {out_shape} {a.dtype} strides {tuple(out.stride())}")
            p.c = c.data_ptr()
        p.dtype = _DTYPES[str(a.dtype)]
        p.compute = 1 if allow_tf32 else 0
        p.epilogue = EPILOGUES[epilogue]
        p.algo_index = int(algo_index)

        if epilogue in _BIAS_IN or epilogue in _BIAS_OUT:
            want = M if epilogue == "BGRADB" else N
            if bias is None:
                raise ValueError(f"epilogue {epilogue} needs bias (length {want})")
            if bias.dtype != a.dtype or bias.device != a.device or not bias.is_contiguous():
                raise ValueError(f"bias must be a contiguous {a.dtype} tensor on {a.device}")
            if bias.shape[-1] != want or bias.dim() not in (1, 2) or (bias.dim() == 2 and bias.shape[0] != batch):
                raise ValueError(f"bias must be ({want},) or ({batch}, {want}), got {tuple(bias.shape)}")
            p.bias = bias.data_ptr()
            p.stride_bias = want if bias.dim() == 2 else 0
        elif bias is not None:
            raise ValueError(f"epilogue {epilogue} takes no bias")

        if epilogue in _RELU_MASK_AUX or epilogue in _GELU_AUX:
            if aux is None:
                raise ValueError(f"epilogue {epilogue} needs aux (allocate it with LtMatmul.empty_aux)")
            mask = epilogue in _RELU_MASK_AUX
            want_dtype = torch.uint8 if mask else a.dtype
            if aux.dtype != want_dtype or aux.device != a.device or not aux.is_contiguous():
                raise ValueError(f"aux must be a contiguous {want_dtype} tensor on {a.device}")
            if tuple(aux.shape[:-1]) != out_shape[:-1]:
                raise ValueError(f"aux must be (…, {M}, ld), got {tuple(aux.shape)}")
            p.ld_aux = aux.shape[-1] * 8 if mask else aux.shape[-1]
            p.stride_aux = M * p.ld_aux if batched else 0
            p.aux = aux.data_ptr()
        elif aux is not None:
            raise ValueError(f"epilogue {epilogue} takes no aux")
        return p, out

    def matmul(
        self,
        a: "torch.Tensor",
        b: "torch.Tensor",
        *,
        bias: "torch.Tensor | None" = None,
        epilogue: str | None = None,
        out: "torch.Tensor | None" = None,
        aux: "torch.Tensor | None" = None,
        allow_tf32: bool = False,
        trans_a: bool = False,
        trans_b: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
        c: "torch.Tensor | None" = None,
        algo_index: int = 0,
    ) -> "torch.Tensor":
        """``epilogue(alpha * op(a) @ op(b) + beta * c)`` into ``out`` (allocated if None), on the current stream.

        ``op(x)`` is ``x.mT`` when ``trans_x``. ``epilogue`` is a name of ``EPILOGUES``
        (default: "BIAS" when ``bias`` is given, else "DEFAULT"). Bias epilogues read
        ``bias`` (N,); gradient epilogues write it (N,) for D*_BGRAD / BGRADA and (M,)
        for BGRADB (= a.sum(-1), e.g. grad.sum(0) for a = grad.T). *_AUX epilogues write
        ``aux`` and DRELU/DGELU read it (see ``empty_aux``). GELU is the tanh form.
        ``algo_index`` picks the n-th of cuBLASLt's ranked algorithms. Raises
        ValueError for bad arguments and LtMatmulError when cuBLASLt refuses.
        """
        import torch

        p, out = self._params(a, b, bias=bias, epilogue=epilogue, out=out, aux=aux, allow_tf32=allow_tf32,
                              trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, c=c, algo_index=algo_index)
        device = a.device.index if a.device.index is not None else torch.cuda.current_device()
        lib = load_runtime()
        handle = self._handle(device)
        stream = torch.cuda.current_stream(device).cuda_stream
        ws = self._workspace(device, stream)
        p.workspace, p.workspace_size, p.stream = ws.data_ptr(), ws.numel(), stream
        self._check(lib, lib.sc_lt_matmul(handle, ctypes.byref(p)))
        return out

    def heuristics(self, a: "torch.Tensor", b: "torch.Tensor", *, max_algos: int = 8, **kwargs) -> int:
        """How many algorithms (at most ``max_algos``) cuBLASLt offers for ``matmul(a, b, **kwargs)``."""
        import torch

        p, _ = self._params(a, b, **{**dict(bias=None, epilogue=None, out=None, aux=None, allow_tf32=False,
                                            trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None,
                                            algo_index=0), **kwargs})
        device = a.device.index if a.device.index is not None else torch.cuda.current_device()
        lib = load_runtime()
        ws = self._workspace(device, torch.cuda.current_stream(device).cuda_stream)
        p.workspace, p.workspace_size = ws.data_ptr(), ws.numel()
        count = ctypes.c_int()
        self._check(lib, lib.sc_lt_heuristics(self._handle(device), ctypes.byref(p), int(max_algos), ctypes.byref(count)))
        return count.value

    def tune(self, a: "torch.Tensor", b: "torch.Tensor", *, max_algos: int = 4, iters: int = 20, **kwargs) -> int:
        """The ``algo_index`` (among the first ``max_algos``) with the lowest median CUDA-event time for this call."""
        import torch

        count = self.heuristics(a, b, max_algos=max_algos, **kwargs)
        best, best_ms = 0, float("inf")
        for idx in range(count):
            for _ in range(3):
                self.matmul(a, b, algo_index=idx, **kwargs)
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.matmul(a, b, algo_index=idx, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            med = sorted(times)[len(times) // 2]
            log.debug("algo %d: %.4f ms", idx, med)
            if med < best_ms:
                best, best_ms = idx, med
        return best
