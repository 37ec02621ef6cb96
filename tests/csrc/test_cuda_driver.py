"""stitch_backend.cuda_driver: argument packing (no GPU), loading and launching cubins (GPU)."""

import ctypes
import struct
import threading

import pytest

from stitch_backend import cuda_driver, toolchain
from stitch_backend.cuda_driver import CudaDriverError, CudaModule, _ArgPacker

SOURCE = r"""
// y = a * x + y over n floats.
extern "C" __global__ void saxpy(const float* __restrict__ x, float* __restrict__ y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

// Writes each argument back so the packing of every signature code is visible.
extern "C" __global__ void echo(double* out, int i, unsigned int u, long long l, float f, double d, char* p) {
  out[0] = i; out[1] = u; out[2] = (double)l; out[3] = f; out[4] = d; out[5] = (double)(unsigned long long)p;
}

// Sums n floats through `nbytes` of dynamic shared memory (exercises > 48 KiB opt-in).
extern "C" __global__ void smem_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  extern __shared__ float buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += buf[i];
    out[0] = s;
  }
}
"""


# --------------------------------------------------------------------------- no GPU


def test_packer_offsets_follow_c_alignment():
    p = _ArgPacker("pipfld")
    assert p.offsets == [0, 8, 16, 24, 32, 40]
    p = _ArgPacker("iif")
    assert p.offsets == [0, 4, 8]
    p.pack((1, -2, 0.5))
    assert struct.unpack_from("<iif", p.buffer, 0) == (1, -2, 0.5)
    base = ctypes.addressof(p.buffer)
    assert [v - base for v in p.params] == [0, 4, 8]
    assert _ArgPacker("").params is None


def test_packer_rejects_bad_signatures_and_args():
    with pytest.raises(ValueError, match="unknown codes"):
        _ArgPacker("px")
    p = _ArgPacker("pi")
    with pytest.raises(ValueError, match="do not fit signature 'pi'"):
        p.pack((1,))
    with pytest.raises(ValueError, match="do not fit signature 'pi'"):
        p.pack((1, 2**40))  # int32 overflow is an error, not a silent wrap


def test_driver_error_message():
    e = CudaDriverError("cuModuleGetFunction('k')", 500, "CUDA_ERROR_NOT_FOUND", "named symbol not found")
    assert str(e) == "cuModuleGetFunction('k') failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"


class _FakeLib:
    def __init__(self):
        self.unloaded = []

    def cuModuleUnload(self, handle):
        self.unloaded.append(handle.value)
        return 0


class _FakeDriver:
    def __init__(self):
        self.lib = _FakeLib()

    def check(self, code, call):
        assert code == 0, call


def _fake_module(drv, handle):
    mod = object.__new__(CudaModule)       # no cubin, no GPU: only close() is exercised
    mod._drv, mod.handle, mod._functions = drv, ctypes.c_void_p(handle), {}
    return mod


def test_a_module_closed_during_a_capture_is_unloaded_when_it_ends():
    drv = _FakeDriver()
    first, second = _fake_module(drv, 11), _fake_module(drv, 12)
    with cuda_driver.capturing():
        first.close()
        with cuda_driver.capturing():        # nested: only the outermost end unloads
            second.close()
        assert drv.lib.unloaded == []
        assert first.handle is None and second.handle is None
    assert sorted(drv.lib.unloaded) == [11, 12]
    third = _fake_module(drv, 13)
    third.close()                              # no capture: unloaded at once
    assert drv.lib.unloaded[-1] == 13 and not cuda_driver._deferred


def test_a_finaliser_during_a_capture_defers_too():
    drv = _FakeDriver()
    with cuda_driver.capturing():
        mod = _fake_module(drv, 21)
        del mod                                # CPython: __del__ runs here, mid-capture
        assert drv.lib.unloaded == [] and len(cuda_driver._deferred) == 1
    assert drv.lib.unloaded == [21] and not cuda_driver._deferred


# --------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def module():
    kernel = toolchain.compile_kernel(SOURCE, "saxpy", toolchain.device_arch())
    mod = CudaModule(kernel.cubin)
    yield mod
    mod.close()


@pytest.mark.gpu
def test_saxpy_on_current_stream(module):
    import torch

    n = 10_000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expect = (2.5 * x.double() + y.double()).float()  # nvcc contracts a*x+y into one FMA: one rounding
    module.function("saxpy", "ppfi").launch(((n + 255) // 256, 1, 1), (256, 1, 1), (x.data_ptr(), y.data_ptr(), 2.5, n))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_every_signature_code(module):
    import torch

    out = torch.zeros(6, dtype=torch.float64, device="cuda")
    ptr = 0x12345678
    module.function("echo", "piulfdp").launch((1, 1, 1), (1, 1, 1),
                                               (out.data_ptr(), -7, 4_000_000_000, -(2**40), 1.5, 2.25, ptr))
    torch.cuda.synchronize()
    assert out.tolist() == [-7.0, 4_000_000_000.0, float(-(2**40)), 1.5, 2.25, float(ptr)]


@pytest.mark.gpu
def test_side_stream_and_cuda_graph(module):
    import torch

    n = 4096
    x = torch.ones(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    fn = module.function("saxpy", "ppfi")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn.launch((n // 256, 1, 1), (256, 1, 1), (x.data_ptr(), y.data_ptr(), 1.0, n))  # current = side
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.all(y == 1.0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        z = x * 2  # an ATen op and a raw launch in one capture
        fn.launch((n // 256, 1, 1), (256, 1, 1), (z.data_ptr(), y.data_ptr(), 1.0, n))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.all(y == 1.0 + 3 * 2.0)  # the capture itself does not run the kernel


@pytest.mark.gpu
def test_large_dynamic_shared_memory(module):
    import torch

    n = 100 * 1024 // 4  # 100 KiB of floats: needs the opt-in above 48 KiB
    x = torch.rand(n, device="cuda")
    out = torch.zeros(1, device="cuda")
    module.function("smem_sum", "ppi").launch((1, 1, 1), (256, 1, 1), (x.data_ptr(), out.data_ptr(), n),
                                              shared_mem=n * 4)
    torch.cuda.synchronize()
    torch.testing.assert_close(out[0], x.double().sum().float(), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_launch_from_a_fresh_thread(module):
    import torch

    n = 1024
    x = torch.ones(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    fn = module.function("saxpy", "ppfi")
    stream = torch.cuda.current_stream().cuda_stream
    errors = []

    def worker():
        try:
            fn.launch((n // 256, 1, 1), (256, 1, 1), (x.data_ptr(), y.data_ptr(), 3.0, n), stream=stream)
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert torch.all(y == 3.0)


@pytest.mark.gpu
def test_driver_errors_are_typed(module):
    with pytest.raises(CudaDriverError) as info:
        module.function("no_such_kernel", "")
    assert info.value.name == "CUDA_ERROR_NOT_FOUND" and "no_such_kernel" in info.value.call
    fn = module.function("saxpy", "ppfi")
    with pytest.raises(CudaDriverError) as info:
        fn.launch((1, 1, 1), (4096, 1, 1), (0, 0, 1.0, 0))  # more threads than a block may have
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert fn.num_regs > 0 and fn.max_threads_per_block >= 256
    with pytest.raises(ValueError):
        CudaModule(b"")


@pytest.mark.gpu
@pytest.mark.serial    # host time: beside seven other test processes it read 50.8 us (H100)
def test_launch_overhead_is_small(capsys):
    explicit = cuda_driver.measure_launch_overhead(2000)
    lookup = cuda_driver.measure_launch_overhead(2000, with_stream_lookup=True)
    with capsys.disabled():
        print(f"\n[launch overhead] {explicit:.2f} us/launch with the stream given, "
              f"{lookup:.2f} us/launch looking up torch's current stream")
    assert 0 < explicit < 50 and 0 < lookup < 80


@pytest.mark.gpu
def test_a_module_dropped_inside_a_capture_does_not_break_it(module):
    """The GC collecting a module during a capture (L2 41 on an H100: the second capture
    failed with cudaErrorStreamCaptureInvalidated) leaves the capture whole."""
    import torch

    from stitch_backend.cudagraphs import capture

    kernel = toolchain.compile_kernel(SOURCE, "saxpy", toolchain.device_arch())
    doomed = [CudaModule(kernel.cubin)]
    n = 1024
    x = torch.ones(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    fn = module.function("saxpy", "ppfi")

    def run():
        fn.launch((n // 256, 1, 1), (256, 1, 1), (x.data_ptr(), y.data_ptr(), 1.0, n))
        if torch.cuda.is_current_stream_capturing():
            doomed.clear()                      # its finaliser runs inside the capture
        return y

    graph, _ = capture(run)
    assert not doomed and not cuda_driver._deferred
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(y == 1.0)
