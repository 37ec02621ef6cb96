"""A minimal CUDA driver API over ctypes: load cubins, look up kernels, launch them fast.

Why ctypes on libcuda and not a compiled extension: nothing to build, and it works on
any image with a driver. Why not only ``cuda.bindings``: it may be missing, and launch
packing here is shaped for our one use (fixed signatures, raw ``data_ptr()`` values).

Kernels run in the context torch uses (the device's primary context), on
``torch.cuda.current_stream()`` unless a stream is given, so they order correctly with
ATen work and are captured by ``torch.cuda.CUDAGraph``. libcuda is loaded on first use,
never at import. Every driver call is checked and raises ``CudaDriverError``.

A launch packs its arguments with one ``struct.pack_into`` into a buffer whose slot
addresses were fixed when the function was created, so the per-launch host cost is a
pack, a lock and one foreign call (``measure_launch_overhead`` reports it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
import sys
import threading
import time
from typing import Sequence

log = logging.getLogger("stitch_backend.cuda_driver")

__all__ = [
    "CudaDriverError",
    "CudaFunction",
    "CudaModule",
    "capturing",
    "ensure_context",
    "measure_launch_overhead",
    "SIGNATURE_CODES",
]

# Signature letter -> (struct format, what it is). Native alignment ('@') gives the
# same offsets as the C ABI of kernel parameters.
SIGNATURE_CODES: dict[str, tuple[str, str]] = {
    "p": ("Q", "pointer (int address, e.g. tensor.data_ptr())"),
    "i": ("i", "int32"),
    "u": ("I", "uint32"),
    "l": ("q", "int64"),
    "f": ("f", "float32"),
    "d": ("d", "float64"),
}

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024  # what a kernel may use without opting in


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): a launch's shape, for ``cuOccupancyMaxActiveClusters``."""

    _fields_ = [(f, ctypes.c_uint) for f in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX",
                                            "blockDimY", "blockDimZ", "sharedMemBytes")] + [
        ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed: which call, the CUresult code, its name and message."""

    def __init__(self, call: str, code: int, name: str, message: str):
        self.call, self.code, self.name, self.message = call, code, name, message
        super().__init__(f"{call} failed: {name} ({code}): {message}")

    def __reduce__(self):
        return (CudaDriverError, (self.call, self.code, self.name, self.message))


# --------------------------------------------------------------------------- the library


class _Driver:
    """libcuda.so.1 with argtypes declared; one per process, made on first use."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaDriverError("dlopen(libcuda.so.1)", -1, "NOT_LOADED", str(e)) from e
        self.lib = lib
        vp, c_int, c_uint, pp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER
        sigs = {
            "cuInit": [c_uint],
            "cuDriverGetVersion": [pp(c_int)],
            "cuGetErrorName": [c_int, pp(ctypes.c_char_p)],
            "cuGetErrorString": [c_int, pp(ctypes.c_char_p)],
            "cuDeviceGet": [pp(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [pp(vp), c_int],
            "cuCtxGetCurrent": [pp(vp)],
            "cuCtxSetCurrent": [vp],
            "cuCtxGetDevice": [pp(c_int)],
            "cuModuleLoadData": [pp(vp), ctypes.c_char_p],
            "cuModuleGetFunction": [pp(vp), vp, ctypes.c_char_p],
            "cuModuleUnload": [vp],
            "cuFuncSetAttribute": [vp, c_int, c_int],
            "cuFuncGetAttribute": [pp(c_int), c_int, vp],
            "cuLaunchKernel": [vp, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, vp, pp(vp), pp(vp)],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int
        # CUDA 11.8 on (thread-block clusters): absent from older drivers, asked for by
        # cluster launches only (CudaFunction.max_active_clusters)
        self.occupancy_clusters = getattr(lib, "cuOccupancyMaxActiveClusters", None)
        if self.occupancy_clusters is not None:
            self.occupancy_clusters.argtypes = [pp(c_int), vp, pp(LaunchConfig)]
            self.occupancy_clusters.restype = c_int
        self.check(lib.cuInit(0), "cuInit")

    def error_text(self, code: int) -> tuple[str, str]:
        """(name, message) of a CUresult, e.g. ("CUDA_ERROR_NOT_FOUND", "named symbol not found")."""
        name, msg = ctypes.c_char_p(), ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {code}", "unknown error code"
        self.lib.cuGetErrorString(code, ctypes.byref(msg))
        return name.value.decode(), (msg.value or b"").decode()

    def check(self, code: int, call: str) -> None:
        if code != CUDA_SUCCESS:
            name, msg = self.error_text(code)
            raise CudaDriverError(call, code, name, msg)


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = _Driver()
    return _driver


def ensure_context(device: int | None = None) -> ctypes.c_void_p:
    """Make torch's context for ``device`` (default: torch's current device) current here; return it.

    torch's CUDA runtime uses each device's primary context; we retain that same
    context, so cubins we load and ATen's work share streams, memory and graphs.
    """
    import torch

    torch.cuda.init()
    dev_index = torch.cuda.current_device() if device is None else int(device)
    drv = _get_driver()
    ctx = ctypes.c_void_p()
    drv.check(drv.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        cur = ctypes.c_int()
        drv.check(drv.lib.cuCtxGetDevice(ctypes.byref(cur)), "cuCtxGetDevice")
        if cur.value == dev_index:
            return ctx
    cu_dev = ctypes.c_int()
    drv.check(drv.lib.cuDeviceGet(ctypes.byref(cu_dev), dev_index), "cuDeviceGet")
    # Retained for the life of the process, as torch's runtime does with the same context.
    drv.check(drv.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), cu_dev), "cuDevicePrimaryCtxRetain")
    drv.check(drv.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def _current_stream() -> int:
    """torch's current stream on the current device, as a raw handle.

    ``torch.cuda.current_stream()`` builds a Python Stream object (about 9 us on the
    H200 machine, as much as the launch itself); the private raw getter, which
    Inductor's generated code also uses, skips that. Falls back if a torch lacks it.
    """
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(torch._C._cuda_getDevice())
    return torch.cuda.current_stream().cuda_stream


# --------------------------------------------------------------------------- argument packing


class _ArgPacker:
    """Packs launch arguments for one signature into a fixed buffer (no GPU needed to build)."""

    def __init__(self, signature: str):
        bad = [c for c in signature if c not in SIGNATURE_CODES]
        if bad:
            raise ValueError(f"signature {signature!r} has unknown codes {bad}; known: {sorted(SIGNATURE_CODES)}")
        self.signature = signature
        fmt = "@" + "".join(SIGNATURE_CODES[c][0] for c in signature)
        self.struct = struct.Struct(fmt)
        # Offset of each argument under the C ABI: scalars aligned to their own size,
        # which is also where struct's native mode puts them.
        self.offsets: list[int] = []
        off = 0
        for c in signature:
            size = struct.calcsize("@" + SIGNATURE_CODES[c][0])
            off = (off + size - 1) // size * size
            self.offsets.append(off)
            off += size
        self.buffer = ctypes.create_string_buffer(max(self.struct.size, 8))
        base = ctypes.addressof(self.buffer)
        n = len(signature)
        self.params = (ctypes.c_void_p * max(n, 1))(*[base + off for off in self.offsets]) if n else None

    def pack(self, args: Sequence) -> None:
        """Write ``args`` into the buffer; raises ValueError naming the signature on a mismatch."""
        try:
            self.struct.pack_into(self.buffer, 0, *args)
        except struct.error as e:
            raise ValueError(f"arguments {tuple(args)!r} do not fit signature {self.signature!r}: {e}") from None


# --------------------------------------------------------------------------- unloads during capture

# cuModuleUnload is not permitted while a stream captures a CUDA graph: it fails and the
# capture ends in cudaErrorStreamCaptureInvalidated. A module's finaliser can run at any
# allocation (the GC collecting a rejected candidate's module), so one that runs during a
# capture would break it: on an H100 (2026-12-07) KernelBench L2 41's second capture
# failed that way and the Program ran uncaptured. Such unloads wait for the capture's end.
_captures = 0                      # stitchcuda's captures now running, on any thread
_captures_lock = threading.Lock()
_deferred: list[tuple["_Driver", ctypes.c_void_p]] = []   # appends are atomic: finaliser-safe


@contextlib.contextmanager
def capturing():
    """Around a CUDA graph capture: a module closed meanwhile is unloaded at its end."""
    global _captures
    with _captures_lock:
        _captures += 1
    try:
        yield
    finally:
        with _captures_lock:
            _captures -= 1
        unload_deferred()


def _unload_forbidden() -> bool:
    """Whether a module unload now would break a capture: one of ours is running, or
    torch's current stream is capturing (a user's ``torch.cuda.graph`` around a call)."""
    if _captures:
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no CUDA here: nothing can be capturing
        return False


def unload_deferred() -> int:
    """Unload the modules closed during captures, where none is running now; returns
    how many. A failure is logged, not raised: their owners are gone."""
    done = 0
    while _deferred and not _unload_forbidden():
        try:
            drv, handle = _deferred.pop()
        except IndexError:     # another thread took the last one
            break
        code = drv.lib.cuModuleUnload(handle)
        if code != CUDA_SUCCESS:
            log.warning("stitchcuda: deferred cuModuleUnload failed: %s", drv.error_text(code)[0])
        done += 1
    return done


# --------------------------------------------------------------------------- module and function


class CudaModule:
    """A cubin loaded into the current device's context (torch's primary context).

    The module belongs to the device current when it was created; launch its functions
    only on tensors of that device. ``close()`` (or garbage collection) unloads it.
    """

    def __init__(self, cubin: bytes):
        if not isinstance(cubin, (bytes, bytearray)) or not cubin:
            raise ValueError("CudaModule needs the non-empty bytes of a cubin")
        self._drv = _get_driver()
        self.context = ensure_context()
        self._image = bytes(cubin)  # the driver copies it, but keep it for inspection
        handle = ctypes.c_void_p()
        self._drv.check(self._drv.lib.cuModuleLoadData(ctypes.byref(handle), self._image), "cuModuleLoadData")
        self.handle: ctypes.c_void_p | None = handle
        self._functions: dict[tuple[str, str], CudaFunction] = {}

    def function(self, name: str, signature: str = "") -> "CudaFunction":
        """The extern "C" kernel ``name``, whose parameters are described by ``signature``.

        ``signature`` has one letter per kernel parameter: p pointer (u64), i int32,
        u uint32, l int64, f float32, d float64. Raises CudaDriverError
        (CUDA_ERROR_NOT_FOUND) when the cubin has no such kernel.
        """
        key = (name, signature)
        if key not in self._functions:
            if self.handle is None:
                raise RuntimeError("CudaModule is closed")
            fn = ctypes.c_void_p()
            self._drv.check(
                self._drv.lib.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()),
                f"cuModuleGetFunction({name!r})",
            )
            self._functions[key] = CudaFunction(self, name, fn, signature)
        return self._functions[key]

    def close(self) -> None:
        """Unload the module; its functions become unusable. During a CUDA graph
        capture the unload waits for the capture's end (``capturing``)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            if _unload_forbidden():
                _deferred.append((self._drv, handle))
                return
            self._drv.check(self._drv.lib.cuModuleUnload(handle), "cuModuleUnload")
            unload_deferred()

    def __enter__(self) -> "CudaModule":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # A finaliser must not raise; at interpreter exit the driver may be gone already.
        try:
            self.close()
        except Exception:
            pass


class CudaFunction:
    """One kernel of a CudaModule with a fixed argument signature; ``launch`` is the hot path."""

    def __init__(self, module: CudaModule, name: str, handle: ctypes.c_void_p, signature: str):
        self.module, self.name, self.handle, self.signature = module, name, handle, signature
        self._packer = _ArgPacker(signature)
        self._lock = threading.Lock()
        self._drv = module._drv
        self._launch_fn = self._drv.lib.cuLaunchKernel
        self._dyn_smem_limit = DEFAULT_DYNAMIC_SMEM_LIMIT - self.attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)

    def attribute(self, attr: int) -> int:
        """cuFuncGetAttribute(attr), e.g. CU_FUNC_ATTRIBUTE_NUM_REGS."""
        value = ctypes.c_int()
        self._drv.check(self._drv.lib.cuFuncGetAttribute(ctypes.byref(value), attr, self.handle),
                        f"cuFuncGetAttribute({self.name!r}, {attr})")
        return value.value

    @property
    def num_regs(self) -> int:
        """Registers per thread."""
        return self.attribute(CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def max_threads_per_block(self) -> int:
        """The largest block this kernel can launch with (registers permitting)."""
        return self.attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory (needed above 48 KiB)."""
        self._drv.check(
            self._drv.lib.cuFuncSetAttribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes)),
            f"cuFuncSetAttribute({self.name!r}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes})",
        )
        self._dyn_smem_limit = int(nbytes)

    def max_active_clusters(self, grid_x: int, block_x: int, shared_mem: int) -> int:
        """How many clusters of this kernel (its ``__cluster_dims__``) can be resident at
        once in a launch of ``grid_x`` x ``block_x`` threads with ``shared_mem`` bytes of
        dynamic shared memory a block (cuOccupancyMaxActiveClusters)."""
        call = (f"cuOccupancyMaxActiveClusters({self.name!r}, grid={grid_x}, block={block_x}, "
                f"smem={shared_mem})")
        if self._drv.occupancy_clusters is None:
            raise CudaDriverError(call, -1, "NOT_FOUND", "the driver has no "
                                  "cuOccupancyMaxActiveClusters (CUDA 11.8 or later has)")
        if shared_mem > self._dyn_smem_limit:
            self.set_max_dynamic_shared_memory(shared_mem)
        config = LaunchConfig(grid_x, 1, 1, block_x, 1, 1, shared_mem, None, None, 0)
        out = ctypes.c_int()
        self._drv.check(self._drv.occupancy_clusters(ctypes.byref(out), self.handle,
                                                     ctypes.byref(config)), call)
        return out.value

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence,
        shared_mem: int = 0,
        stream: int | None = None,
    ) -> None:
        """Launch on ``stream`` (default: torch's current stream) with ``args`` matching the signature.

        Asynchronous like any CUDA launch; errors in the launch itself (bad grid,
        too much shared memory, no context) raise CudaDriverError now, errors inside
        the kernel surface at the next synchronisation.
        """
        if stream is None:
            stream = _current_stream()
        if shared_mem > self._dyn_smem_limit:
            self.set_max_dynamic_shared_memory(shared_mem)
        packer = self._packer
        with self._lock:
            packer.pack(args)
            rc = self._launch_fn(self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                 shared_mem, stream, packer.params, None)
            if rc == CUDA_ERROR_INVALID_CONTEXT:
                # This thread has no context current yet (e.g. a fresh worker thread).
                self._drv.check(self._drv.lib.cuCtxSetCurrent(self.module.context), "cuCtxSetCurrent")
                rc = self._launch_fn(self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                     shared_mem, stream, packer.params, None)
        if rc != CUDA_SUCCESS:
            self._drv.check(rc, f"cuLaunchKernel({self.name!r}, grid={tuple(grid)}, block={tuple(block)}, "
                                f"smem={shared_mem})")

    def __repr__(self) -> str:
        return f"CudaFunction({self.name!r}, signature={self.signature!r})"


# --------------------------------------------------------------------------- measurement

_NOOP_SOURCE = r"""
// Does nothing: measures the host cost of one launch with a typical signature.
extern "C" __global__ void sc_noop(const float* a, float* b, int n, int m, float s) {
  if (n < 0 && threadIdx.x == 0) b[0] = a[0] * s + m;  // never true; keeps the params live
}
"""


def measure_launch_overhead(n: int = 1000, *, with_stream_lookup: bool = False) -> float:
    """Mean host time of one ``CudaFunction.launch`` in microseconds (signature "ppiif", 1x1 grid).

    Times ``n`` back-to-back launches of an empty kernel on the current stream after a
    warm-up; with ``with_stream_lookup`` the stream is left to ``launch`` to look up
    (the default call path), else it is passed in (how a Program launches).
    """
    import torch

    from . import toolchain

    kernel = toolchain.compile_kernel(_NOOP_SOURCE, "sc_noop", toolchain.device_arch())
    module = CudaModule(kernel.cubin)
    fn = module.function("sc_noop", "ppiif")
    buf = torch.zeros(4, device="cuda")
    ptr = buf.data_ptr()
    stream = None if with_stream_lookup else torch.cuda.current_stream().cuda_stream
    args = (ptr, ptr, 1, 2, 0.5)
    for _ in range(20):
        fn.launch((1, 1, 1), (32, 1, 1), args, stream=stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn.launch((1, 1, 1), (32, 1, 1), args, stream=stream)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    module.close()
    per_launch_us = elapsed / n * 1e6
    log.info("launch overhead: %.2f us per launch (%d launches, stream lookup=%s)", per_launch_us, n,
             with_stream_lookup)
    return per_launch_us
