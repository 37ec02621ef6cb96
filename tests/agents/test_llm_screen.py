"""The static screen: template kernels pass; each forbidden pattern is refused with why."""

from __future__ import annotations

import pytest
import torch

from stitch_backend.agents.screen import parse_entry, screen

BASE = '''#include "fused_ops.cuh"
#include <cuda_fp16.h>
// a comment may say cudaMalloc, printf("x") or asm: comments are not code
__device__ __forceinline__ float twice(float v) { return 2.0f * v; }
static __device__ inline float thrice(float v) { return 3.0f * v; }
template <typename T> __device__ T ident(T v) { return v; }
struct Pair { float a, b; };
extern "C" __global__ void __launch_bounds__(256) k(
    const float* __restrict__ in0, float* __restrict__ out0,
    unsigned int* __restrict__ ticket, int n) {
  __shared__ float buf[256];
  /*BODY*/
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out0[i] = ident(twice(thrice(in0[i])));
  }
  if (threadIdx.x == 0) atomicAdd(ticket, 1u);
}
'''
TEMPLATE = parse_entry(BASE)


def _with(body: str = "", top: str = "") -> str:
    return top + BASE.replace("/*BODY*/", body)


def test_the_base_kernel_passes_and_its_signature_reads():
    assert screen(BASE, TEMPLATE).ok, screen(BASE, TEMPLATE).reason
    assert TEMPLATE.name == "k"
    assert TEMPLATE.types == ("float*", "float*", "unsigned int*", "int")
    assert TEMPLATE.codes == "pppi" and TEMPLATE.launch_bounds == 256


@pytest.mark.parametrize("fn,inputs", [
    (lambda x, y: (torch.relu(x) * y + 1.0,), (torch.randn(4, 8), torch.randn(4, 8))),
    (lambda x: (torch.sum(x * x),), (torch.randn(512, 256),)),           # ticket + atomicAdd
    (lambda x: (torch.softmax(x, -1),), (torch.randn(64, 1024),)),
    (lambda x: (torch.nn.functional.layer_norm(x.half(), (64,)),), (torch.randn(8, 64),)),
], ids=["pointwise", "full_reduction", "softmax", "layer_norm_fp16"])
def test_template_kernels_pass_their_own_screen(fn, inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.codegen.fused import generate

    kernel = generate(make_fx(fn)(*inputs), "g_fused_0")
    entry = parse_entry(kernel.source)
    assert entry.codes == kernel.signature
    verdict = screen(kernel.source, entry)
    assert verdict.ok, verdict.reason


REJECTED = {
    "include": (_with(top='#include <cstdio>\n'), "#include"),
    "include_by_macro": (_with(top='#define H <cstdio>\n#include H\n'), "literally"),
    "torch": (_with("  torch::Tensor t;\n"), "torch"),
    "aten": (_with("  at::Tensor t;\n"), "at"),
    "cublas": (_with("  cublasSgemm(0);\n"), "cublasSgemm"),
    "cudaMalloc": (_with("  void* p; cudaMalloc(&p, 4);\n"), "cudaMalloc"),
    "malloc": (_with("  float* p = (float*)malloc(4);\n"), "malloc"),
    "stream": (_with("  cudaStream_t s; cudaStreamCreate(&s);\n"), "cudaStream"),
    "printf": (_with('  printf("%d", 1);\n'), "printf"),
    "string_literal": (_with('  const char* s = "x";\n'), "literal"),
    "fopen": (_with("  fopen(0, 0);\n"), "fopen"),
    "thread": (_with("  std::thread t;\n"), "std"),
    "asm": (_with('  asm volatile("membar.gl;");\n'), "asm"),
    "asm_no_string": (_with("  __asm__ volatile(0);\n"), "__asm__"),
    "host_function": (_with(top="void helper(float* p) { p[0] = 1; }\n"), "host function"),
    "host_main": (_with(top="int main() { return 0; }\n"), "main"),
    "device_global": (_with(top="__device__ float cache[1024];\n"), "file-scope variable"),
    "device_global_init": (_with(top="__device__ int calls = 0;\n"), "file-scope variable"),
    "managed": (_with(top="__managed__ float m;\n"), "__managed__"),
    "host_global": (_with(top="float host_state[4];\n"), "file-scope variable"),
    "static_local": (_with("  static float last[256];\n"), "static variable"),
    "function_pointer": (_with(top="__device__ float (*fp)(float);\n"), "function pointer"),
    "second_kernel": (_with(top="__global__ void other(float* p) { p[0] = 0; }\n"),
                      "second kernel"),
    "second_extern_c": (_with(top='extern "C" __global__ void k2(float* p) {}\n'),
                        "exactly one"),
    "dynamic_shared": (_with("  extern __shared__ float dyn[];\n"), "dynamic shared"),
    "float_atomic": (_with("  atomicAdd(out0, 1.0f);\n"), "floating-point"),
    "float_atomic_shared": (_with("  atomicAdd(&buf[0], 1.0f);\n"), "floating-point"),
    "float_atomic_cast": (_with("  atomicAdd((float*)ticket, 1.0f);\n"), "floating-point"),
    "atomic_on_auto": (_with("  auto* q = out0; atomicMax(q, 1);\n"), "atomicMax on auto"),
    "atomic_unknown": (_with("  atomicMax(undeclared, 1);\n"), "cannot read"),
    "token_pasting": (_with(top="#define C(a, b) a##b\n"), "token pasting"),
    "line_splice": (_with("  cuda\\\nMalloc(0, 0);\n"), "cudaMalloc"),
    "ucn": (_with("  int \\u0063udaMalloc;\n"), "universal character"),
    "clock": (_with("  long long t = clock64();\n"), "clock64"),
    "unterminated_comment": (_with("  /* open\n"), "unterminated"),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_each_forbidden_pattern_is_rejected(name):
    source, why = REJECTED[name]
    verdict = screen(source, TEMPLATE)
    assert not verdict.ok, name
    assert why in verdict.reason, verdict.reason


@pytest.mark.parametrize("change,why", [
    (("void __launch_bounds__(256) k(", "void __launch_bounds__(256) k_fast("), "named 'k_fast'"),
    (("int n)", "long long n)"), "parameters"),
    (("const float* __restrict__ in0", "const __half* __restrict__ in0"), "parameters"),
    (("float* __restrict__ out0,", "float* __restrict__ out0, float* extra,"), "parameters"),
    (("__launch_bounds__(256)", "__launch_bounds__(128)"), "below the template"),
])
def test_the_entry_must_match_the_template(change, why):
    verdict = screen(BASE.replace(*change), TEMPLATE)
    assert not verdict.ok and why in verdict.reason, verdict.reason


def test_abi_neutral_differences_are_accepted():
    src = BASE.replace("const float* __restrict__ in0", "const float * in0").replace(
        "__launch_bounds__(256)", "__launch_bounds__(512)")
    assert screen(src, TEMPLATE).ok, screen(src, TEMPLATE).reason
