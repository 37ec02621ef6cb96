// csrc/common.cuh: helpers shared by stitchcuda's generated kernels.
//
// Header-only, no torch headers, compiles under nvcc and NVRTC (host-only parts are
// guarded by __CUDACC_RTC__). Every device helper is `__device__ __forceinline__` and
// named `sc_*`. Math helpers reproduce PyTorch's CUDA kernels in fp32 (the same formula
// and operation order, no fast-math), so a fused kernel stays within 1e-4 of eager.
// Reductions use fixed shuffle trees: the same input gives the same bits on every run
// (no float atomics). Block reductions assume a 1-D block whose size is a multiple of 32.
// tests/csrc/test_common_math.py checks every helper against torch on the GPU.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef __CUDACC_RTC__
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#endif

// ----------------------------------------------------------------------------- checks

#ifndef __CUDACC_RTC__
// SC_CUDA_CHECK(call): host; on a CUDA runtime error print it with file:line and exit (tests, tools).
#define SC_CUDA_CHECK(call)                                                                    \
  do {                                                                                         \
    cudaError_t sc_err_ = (call);                                                              \
    if (sc_err_ != cudaSuccess) {                                                              \
      fprintf(stderr, "[stitchcuda] CUDA error %s (%s) at %s:%d: %s\n", cudaGetErrorName(sc_err_), \
              cudaGetErrorString(sc_err_), __FILE__, __LINE__, #call);                         \
      exit(EXIT_FAILURE);                                                                      \
    }                                                                                          \
  } while (0)

// SC_CUDA_RETURN_IF_ERROR(call): host; return the cudaError_t of a failing call to our caller.
#define SC_CUDA_RETURN_IF_ERROR(call)              \
  do {                                             \
    cudaError_t sc_err_ = (call);                  \
    if (sc_err_ != cudaSuccess) return sc_err_;    \
  } while (0)
#endif

// SC_DEVICE_CHECK(cond): device; print the condition with file:line and trap (the launch fails).
#define SC_DEVICE_CHECK(cond)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      printf("[stitchcuda] device check failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      __trap();                                                                            \
    }                                                                                      \
  } while (0)

#define SC_WARP_SIZE 32
#define SC_FULL_MASK 0xffffffffu

// sc_ceil_div: ceil(a / b) for positive integers, usable on host and device.
template <typename T>
__host__ __device__ __forceinline__ constexpr T sc_ceil_div(T a, T b) { return (a + b - 1) / b; }

// ----------------------------------------------------------------------------- conversions

// sc_to_float: widen float / __half / __nv_bfloat16 to float (exact).
__device__ __forceinline__ float sc_to_float(float x) { return x; }
__device__ __forceinline__ float sc_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float sc_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// sc_from_float<T>: narrow float to T with round-to-nearest-even, as torch's .half()/.bfloat16().
template <typename T> __device__ __forceinline__ T sc_from_float(float x);
template <> __device__ __forceinline__ float sc_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half sc_from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 sc_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// sc_to_float2: widen a packed pair (__half2 / __nv_bfloat162) to float2.
__device__ __forceinline__ float2 sc_to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 sc_to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

// sc_float2_to_half2 / sc_float2_to_bf162: narrow a float2 to a packed pair, round-to-nearest-even.
__device__ __forceinline__ __half2 sc_float2_to_half2(float2 v) { return __float22half2_rn(v); }
__device__ __forceinline__ __nv_bfloat162 sc_float2_to_bf162(float2 v) { return __float22bfloat162_rn(v); }

// ----------------------------------------------------------------------------- vector access

// sc_is_aligned16: true when p may be used with the 16-byte loads/stores below.
__device__ __forceinline__ bool sc_is_aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0; }

// sc_ld_f4 / sc_st_f4: one 16-byte access of 4 floats; p must be 16-byte aligned.
__device__ __forceinline__ float4 sc_ld_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void sc_st_f4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// sc_ldg_f4: sc_ld_f4 through the read-only cache, for inputs that no thread writes.
__device__ __forceinline__ float4 sc_ldg_f4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// sc_ld_u4 / sc_st_u4: one raw 16-byte access (8 halves, 8 bf16s, 4 floats); p 16-byte aligned.
__device__ __forceinline__ uint4 sc_ld_u4(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void sc_st_u4(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// sc_ld_h2 / sc_st_h2: one 4-byte access of 2 halves; p 4-byte aligned.
__device__ __forceinline__ __half2 sc_ld_h2(const __half* p) { return *reinterpret_cast<const __half2*>(p); }
__device__ __forceinline__ void sc_st_h2(__half* p, __half2 v) { *reinterpret_cast<__half2*>(p) = v; }

// sc_ld_bf2 / sc_st_bf2: one 4-byte access of 2 bf16s; p 4-byte aligned.
__device__ __forceinline__ __nv_bfloat162 sc_ld_bf2(const __nv_bfloat16* p) { return *reinterpret_cast<const __nv_bfloat162*>(p); }
__device__ __forceinline__ void sc_st_bf2(__nv_bfloat16* p, __nv_bfloat162 v) { *reinterpret_cast<__nv_bfloat162*>(p) = v; }

// sc_unpack_half8: the 8 halves in a 16-byte word to 8 floats (element order kept).
__device__ __forceinline__ void sc_unpack_half8(uint4 v, float out[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}

// sc_pack_half8: 8 floats to a 16-byte word of halves (round-to-nearest-even).
__device__ __forceinline__ uint4 sc_pack_half8(const float in[8]) {
  uint4 v;
  __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __float22half2_rn(make_float2(in[2 * i], in[2 * i + 1]));
  return v;
}

// sc_unpack_bf16x8: the 8 bf16s in a 16-byte word to 8 floats (element order kept).
__device__ __forceinline__ void sc_unpack_bf16x8(uint4 v, float out[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}

// sc_pack_bf16x8: 8 floats to a 16-byte word of bf16s (round-to-nearest-even).
__device__ __forceinline__ uint4 sc_pack_bf16x8(const float in[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __float22bfloat162_rn(make_float2(in[2 * i], in[2 * i + 1]));
  return v;
}

// ----------------------------------------------------------------------------- comparisons

// sc_isnan: NaN test that needs no math header (works the same under NVRTC).
__device__ __forceinline__ bool sc_isnan(float x) { return x != x; }

// sc_std_max / sc_std_min: std::max / std::min exactly ((a<b)?b:a), as ATen's kernels use them.
__device__ __forceinline__ float sc_std_max(float a, float b) { return (a < b) ? b : a; }
__device__ __forceinline__ float sc_std_min(float a, float b) { return (b < a) ? b : a; }

// sc_maxf / sc_minf: NaN-propagating max/min, as torch.maximum/amax and torch.minimum/amin.
// On sm_80 and later PTX's max.NaN / min.NaN, one FMNMX.NAN: the portable form compiled to
// two compares and two branches an element (nvcc 13, sm_90a, the generated online
// softmax's pass over L1 23's rows: most of its instructions there).
__device__ __forceinline__ float sc_maxf(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return sc_isnan(a) ? a : (sc_isnan(b) ? b : fmaxf(a, b));
#endif
}
__device__ __forceinline__ float sc_minf(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return sc_isnan(a) ? a : (sc_isnan(b) ? b : fminf(a, b));
#endif
}

// sc_clamp: torch.clamp(x, lo, hi) (NaN stays NaN; min(max(x, lo), hi)).
__device__ __forceinline__ float sc_clamp(float x, float lo, float hi) { return sc_isnan(x) ? x : fminf(fmaxf(x, lo), hi); }

// ----------------------------------------------------------------------------- activations

// Constants as ATen computes them (double products rounded once to float).
#define SC_SQRT1_2 0.70710678118654752440f           // M_SQRT1_2
#define SC_GELU_TANH_BETA 0.79788456080286535588f    // M_SQRT2 * M_2_SQRTPI * 0.5 = sqrt(2/pi)
#define SC_GELU_TANH_KAPPA 0.044715f
#define SC_INV_SQRT_2PI 0.39894228040143267794f      // M_2_SQRTPI * M_SQRT1_2 * 0.5
#define SC_SELU_ALPHA 1.6732632423543772848170429916717f
#define SC_SELU_SCALE 1.0507009873554804934193349852946f

// sc_relu: torch.relu (NaN stays NaN).
__device__ __forceinline__ float sc_relu(float x) { return (x <= 0.f) ? 0.f : x; }

// sc_relu6: torch.nn.functional.relu6 = hardtanh(x, 0, 6).
__device__ __forceinline__ float sc_relu6(float x) { return sc_clamp(x, 0.f, 6.f); }

// sc_hardtanh: torch.nn.functional.hardtanh(x, lo, hi).
__device__ __forceinline__ float sc_hardtanh(float x, float lo, float hi) { return sc_clamp(x, lo, hi); }

// sc_sigmoid: torch.sigmoid = 1 / (1 + exp(-x)).
__device__ __forceinline__ float sc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// sc_silu: torch.nn.functional.silu = x / (1 + exp(-x)).
__device__ __forceinline__ float sc_silu(float x) { return x / (1.f + expf(-x)); }

// sc_gelu_erf: torch.nn.functional.gelu(x) (exact, approximate='none') = x * 0.5 * (1 + erf(x / sqrt 2)).
__device__ __forceinline__ float sc_gelu_erf(float x) { return x * 0.5f * (1.f + erff(x * SC_SQRT1_2)); }

// sc_gelu_tanh: torch.nn.functional.gelu(x, approximate='tanh').
__device__ __forceinline__ float sc_gelu_tanh(float x) {
  const float x_cube = x * x * x;
  const float inner = SC_GELU_TANH_BETA * (x + SC_GELU_TANH_KAPPA * x_cube);
  return 0.5f * x * (1.f + tanhf(inner));
}

// sc_gelu_erf_grad: d/dx gelu_erf(x) times dy, as aten::gelu_backward(approximate='none').
__device__ __forceinline__ float sc_gelu_erf_grad(float dy, float x) {
  const float cdf = 0.5f * (1.f + erff(x * SC_SQRT1_2));
  const float pdf = expf(-0.5f * x * x) * SC_INV_SQRT_2PI;
  return dy * (cdf + x * pdf);
}

// sc_gelu_tanh_grad: d/dx gelu_tanh(x) times dy, as aten::gelu_backward(approximate='tanh').
__device__ __forceinline__ float sc_gelu_tanh_grad(float dy, float x) {
  const float x_sq = x * x;
  const float x_cube = x_sq * x;
  const float inner = SC_GELU_TANH_BETA * (x + SC_GELU_TANH_KAPPA * x_cube);
  const float tanh_inner = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float right_derivative = 1.f - tanh_inner * tanh_inner;
  const float inner_derivative = SC_GELU_TANH_BETA * (1.f + 3.f * SC_GELU_TANH_KAPPA * x_sq);
  return dy * (left_derivative + left * right_derivative * inner_derivative);
}

// sc_softplus: torch.nn.functional.softplus(x, beta, threshold): x when x*beta > threshold.
__device__ __forceinline__ float sc_softplus(float x, float beta = 1.f, float threshold = 20.f) {
  return (x * beta) > threshold ? x : log1pf(expf(x * beta)) / beta;
}

// sc_mish: torch.nn.functional.mish = x * tanh(log1p(exp(x))).
__device__ __forceinline__ float sc_mish(float x) { return x * tanhf(log1pf(expf(x))); }

// sc_hardswish: torch.nn.functional.hardswish = x * min(max(x + 3, 0), 6) * (1/6).
__device__ __forceinline__ float sc_hardswish(float x) {
  return x * sc_std_min(sc_std_max(x + 3.f, 0.f), 6.f) * (1.f / 6.f);
}

// sc_hardsigmoid: torch.nn.functional.hardsigmoid = min(max(x + 3, 0), 6) * (1/6).
__device__ __forceinline__ float sc_hardsigmoid(float x) {
  return sc_std_min(sc_std_max(x + 3.f, 0.f), 6.f) * (1.f / 6.f);
}

// sc_elu: torch.nn.functional.elu(x, alpha) (with ATen's scale/input_scale): x>0 ? x*scale : expm1(x*input_scale)*alpha*scale.
__device__ __forceinline__ float sc_elu(float x, float alpha = 1.f, float scale = 1.f, float input_scale = 1.f) {
  const float negcoef = alpha * scale;
  return x > 0.f ? x * scale : expm1f(x * input_scale) * negcoef;
}

// sc_selu: torch.selu = elu with SELU's alpha and scale.
__device__ __forceinline__ float sc_selu(float x) { return sc_elu(x, SC_SELU_ALPHA, SC_SELU_SCALE, 1.f); }

// sc_celu: torch.celu(x, alpha) = elu with input_scale 1/alpha.
__device__ __forceinline__ float sc_celu(float x, float alpha = 1.f) { return sc_elu(x, alpha, 1.f, 1.f / alpha); }

// sc_leaky_relu: torch.nn.functional.leaky_relu(x, slope) = x > 0 ? x : x * slope.
__device__ __forceinline__ float sc_leaky_relu(float x, float slope = 0.01f) { return x > 0.f ? x : x * slope; }

// ----------------------------------------------------------------------------- reductions

// Binary ops for the reductions below; each carries its identity.
struct sc_op_sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static __device__ __forceinline__ float identity() { return 0.f; }
};
struct sc_op_max {
  __device__ __forceinline__ float operator()(float a, float b) const { return sc_maxf(a, b); }
  static __device__ __forceinline__ float identity() { return -__int_as_float(0x7f800000); }  // -inf
};
struct sc_op_min {
  __device__ __forceinline__ float operator()(float a, float b) const { return sc_minf(a, b); }
  static __device__ __forceinline__ float identity() { return __int_as_float(0x7f800000); }  // +inf
};

// sc_warp_reduce<Op>: butterfly reduction over the 32 lanes; every lane gets the same result.
template <typename Op>
__device__ __forceinline__ float sc_warp_reduce(float v, Op op = Op()) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(SC_FULL_MASK, v, offset));
  return v;
}

// sc_warp_sum / sc_warp_max / sc_warp_min: warp-wide sum, NaN-propagating max, min (all lanes get it).
__device__ __forceinline__ float sc_warp_sum(float v) { return sc_warp_reduce<sc_op_sum>(v); }
__device__ __forceinline__ float sc_warp_max(float v) { return sc_warp_reduce<sc_op_max>(v); }
__device__ __forceinline__ float sc_warp_min(float v) { return sc_warp_reduce<sc_op_min>(v); }

// sc_block_reduce<Op>: 1-D block reduction through `scratch` (>= 32 floats of shared memory); all threads get the result.
// Safe to call repeatedly with the same scratch (it synchronises before reuse).
template <typename Op>
__device__ __forceinline__ float sc_block_reduce(float v, float* scratch, Op op = Op()) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = sc_warp_reduce(v, op);
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  // Every warp reduces the partials in the same order, so all threads hold identical bits.
  v = lane < nwarps ? scratch[lane] : Op::identity();
  return sc_warp_reduce(v, op);
}

// sc_block_sum / sc_block_max / sc_block_min: block-wide sum, NaN-propagating max, min.
__device__ __forceinline__ float sc_block_sum(float v, float* scratch) { return sc_block_reduce<sc_op_sum>(v, scratch); }
__device__ __forceinline__ float sc_block_max(float v, float* scratch) { return sc_block_reduce<sc_op_max>(v, scratch); }
__device__ __forceinline__ float sc_block_min(float v, float* scratch) { return sc_block_reduce<sc_op_min>(v, scratch); }

// sc_welford: running (count, mean, sum of squared deviations) for mean/var in one pass.
// The count is a float (exact to 2^24 elements per partial), as ATen's WelfordOps' nf.
struct sc_welford { float mean; float m2; float n; };

// sc_welford_init: the empty accumulator.
__device__ __forceinline__ sc_welford sc_welford_init() { return sc_welford{0.f, 0.f, 0.f}; }

// sc_welford_update: add one sample x.
__device__ __forceinline__ sc_welford sc_welford_update(sc_welford w, float x) {
  w.n += 1.f;
  const float delta = x - w.mean;
  w.mean += delta / w.n;
  w.m2 += delta * (x - w.mean);
  return w;
}

// sc_welford_combine: merge two partials (Chan et al.), as ATen's WelfordOps::combine.
__device__ __forceinline__ sc_welford sc_welford_combine(sc_welford a, sc_welford b) {
  if (a.n == 0.f) return b;
  if (b.n == 0.f) return a;
  const float n = a.n + b.n;
  const float nb_over_n = b.n / n;
  const float delta = b.mean - a.mean;
  return sc_welford{a.mean + delta * nb_over_n, a.m2 + b.m2 + delta * delta * a.n * nb_over_n, n};
}

// sc_welford_shfl_down: one lane's accumulator moved `offset` lanes down.
__device__ __forceinline__ sc_welford sc_welford_shfl_down(sc_welford w, int offset) {
  return sc_welford{__shfl_down_sync(SC_FULL_MASK, w.mean, offset), __shfl_down_sync(SC_FULL_MASK, w.m2, offset),
                    __shfl_down_sync(SC_FULL_MASK, w.n, offset)};
}

// sc_welford_shfl_idx: lane `src`'s accumulator, to every lane.
__device__ __forceinline__ sc_welford sc_welford_shfl_idx(sc_welford w, int src) {
  return sc_welford{__shfl_sync(SC_FULL_MASK, w.mean, src), __shfl_sync(SC_FULL_MASK, w.m2, src),
                    __shfl_sync(SC_FULL_MASK, w.n, src)};
}

// sc_warp_welford: warp-wide Welford merge (tree to lane 0, then broadcast); all lanes get lane 0's bits.
// (combine is not bitwise commutative, so a butterfly would leave lanes with different bits.)
__device__ __forceinline__ sc_welford sc_warp_welford(sc_welford w) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) w = sc_welford_combine(w, sc_welford_shfl_down(w, offset));
  return sc_welford_shfl_idx(w, 0);
}

// sc_block_welford: 1-D block Welford merge through `scratch` (>= 32 sc_welford in shared memory); all threads get it.
__device__ __forceinline__ sc_welford sc_block_welford(sc_welford w, sc_welford* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  w = sc_warp_welford(w);
  __syncthreads();
  if (lane == 0) scratch[warp] = w;
  __syncthreads();
  w = lane < nwarps ? scratch[lane] : sc_welford_init();
  return sc_warp_welford(w);
}

// sc_welford_var: variance with Bessel-style `correction` (torch.var's); NaN/inf when n <= correction, as torch.
__device__ __forceinline__ float sc_welford_var(sc_welford w, float correction = 1.f) {
  const float divisor = w.n > correction ? w.n - correction : 0.f;
  return w.m2 / divisor;
}
