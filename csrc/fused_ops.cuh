// csrc/fused_ops.cuh: device helpers for the generated fused-region kernels
// (stitch_backend/codegen/emit_cuda.py). Header-only, no torch headers, nvcc and NVRTC.
//
// Everything here is `sfk_*` and generic over the value type (float, double, integers,
// bool), which the generated code needs and common.cuh (fp32-only helpers, `sc_*`) does
// not provide. Semantics follow PyTorch's CUDA kernels; reductions are deterministic
// (fixed shuffle / shared-memory trees, no atomics on floating-point values).
#pragma once

#include "common.cuh"

// ----------------------------------------------------------------------------- conversions

// sfk_val: a stored element as the value the kernel computes with (halves widen to float).
__device__ __forceinline__ float sfk_val(__half x) { return __half2float(x); }
__device__ __forceinline__ float sfk_val(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T sfk_val(T x) { return x; }

// sfk_cvt<S>: a computed value as the stored type S (halves round to nearest even).
template <typename S, typename V> __device__ __forceinline__ S sfk_cvt(V v) { return static_cast<S>(v); }
template <> __device__ __forceinline__ __half sfk_cvt<__half, float>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 sfk_cvt<__nv_bfloat16, float>(float v) { return __float2bfloat16_rn(v); }

// sfk_round_f16 / sfk_round_bf16: the float eager would get back after storing x as fp16/bf16.
__device__ __forceinline__ float sfk_round_f16(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float sfk_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

#define SFK_INF_F __int_as_float(0x7f800000)
#define SFK_NAN_F __int_as_float(0x7fffffff)
#define SFK_INF_D __longlong_as_double(0x7ff0000000000000LL)
#define SFK_NAN_D __longlong_as_double(0x7fffffffffffffffLL)

// ----------------------------------------------------------------------------- pointwise math

template <typename T> __device__ __forceinline__ bool sfk_isnan(T x) { return x != x; }

// NaN-propagating maximum/minimum (torch.maximum / amax): fp32 as common.cuh's sc_maxf /
// sc_minf (one FMNMX.NAN on sm_80 and later); integers: plain.
__device__ __forceinline__ float sfk_maximum(float a, float b) { return sc_maxf(a, b); }
__device__ __forceinline__ float sfk_minimum(float a, float b) { return sc_minf(a, b); }
__device__ __forceinline__ double sfk_maximum(double a, double b) { return a != a ? a : (b != b ? b : fmax(a, b)); }
__device__ __forceinline__ double sfk_minimum(double a, double b) { return a != a ? a : (b != b ? b : fmin(a, b)); }
template <typename T> __device__ __forceinline__ T sfk_maximum(T a, T b) { return a < b ? b : a; }
template <typename T> __device__ __forceinline__ T sfk_minimum(T a, T b) { return b < a ? b : a; }

// torch.div(a, b, rounding_mode='floor') (ATen's div_floor_floating for floats).
template <typename T> __device__ __forceinline__ T sfk_div_floor_fp(T a, T b) {
  if (b == T(0)) return a / b;
  T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != T(0) && ((b < T(0)) != (mod < T(0)))) div -= T(1);
  T floordiv;
  if (div != T(0)) {
    floordiv = floor(div);
    if (div - floordiv > T(0.5)) floordiv += T(1);
  } else {
    floordiv = copysign(T(0), a / b);
  }
  return floordiv;
}
__device__ __forceinline__ float sfk_div_floor(float a, float b) { return sfk_div_floor_fp<float>(a, b); }
__device__ __forceinline__ double sfk_div_floor(double a, double b) { return sfk_div_floor_fp<double>(a, b); }
template <typename T> __device__ __forceinline__ T sfk_div_floor(T a, T b) {
  T q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? T(q - 1) : q;
}

// torch.remainder (Python's modulo: the result has the sign of b).
__device__ __forceinline__ float sfk_remainder(float a, float b) {
  float m = fmodf(a, b);
  return (m != 0.f && ((b < 0.f) != (m < 0.f))) ? m + b : m;
}
__device__ __forceinline__ double sfk_remainder(double a, double b) {
  double m = fmod(a, b);
  return (m != 0.0 && ((b < 0.0) != (m < 0.0))) ? m + b : m;
}
template <typename T> __device__ __forceinline__ T sfk_remainder(T a, T b) {
  T m = a % b;
  return (m != 0 && ((b < 0) != (m < 0))) ? T(m + b) : m;
}

template <typename T> __device__ __forceinline__ T sfk_sign(T a) { return T((T(0) < a) - (a < T(0))); }
template <typename T> __device__ __forceinline__ T sfk_abs(T a) { return a < T(0) ? T(-a) : a; }
__device__ __forceinline__ float sfk_abs(float a) { return fabsf(a); }
__device__ __forceinline__ double sfk_abs(double a) { return fabs(a); }
template <typename T> __device__ __forceinline__ T sfk_relu(T a) { return a <= T(0) ? T(0) : a; }

__device__ __forceinline__ double sfk_gelu_erf(double x) { return x * 0.5 * (1.0 + erf(x * 0.70710678118654752440)); }
__device__ __forceinline__ float sfk_gelu_erf(float x) { return sc_gelu_erf(x); }
__device__ __forceinline__ double sfk_gelu_tanh(double x) {
  const double beta = 0.79788456080286535588, kappa = 0.044715;
  return 0.5 * x * (1.0 + tanh(beta * (x + kappa * x * x * x)));
}
__device__ __forceinline__ float sfk_gelu_tanh(float x) { return sc_gelu_tanh(x); }
__device__ __forceinline__ float sfk_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ double sfk_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// ----------------------------------------------------------------------------- reduction ops

template <typename T> struct sfk_op_sum {
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
template <typename T> struct sfk_op_prod {
  __device__ __forceinline__ T operator()(T a, T b) const { return a * b; }
};
template <typename T> struct sfk_op_max {
  __device__ __forceinline__ T operator()(T a, T b) const { return sfk_maximum(a, b); }
};
template <typename T> struct sfk_op_min {
  __device__ __forceinline__ T operator()(T a, T b) const { return sfk_minimum(a, b); }
};
struct sfk_op_any {
  __device__ __forceinline__ bool operator()(bool a, bool b) const { return a || b; }
};
struct sfk_op_all {
  __device__ __forceinline__ bool operator()(bool a, bool b) const { return a && b; }
};

// (value, position) for argmax/argmin: first extremum wins, NaN counts as the extremum
// (torch.argmax semantics). The combine is symmetric, so every lane of a butterfly agrees.
template <typename T> struct sfk_argpair {
  T v;
  long long i;
};
template <typename T, bool MAX> struct sfk_op_arg {
  __device__ __forceinline__ sfk_argpair<T> operator()(sfk_argpair<T> a, sfk_argpair<T> b) const {
    const bool an = sfk_isnan(a.v), bn = sfk_isnan(b.v);
    if (an || bn) {
      if (an && bn) return a.i < b.i ? a : b;
      return an ? a : b;
    }
    if (a.v == b.v) return a.i < b.i ? a : b;
    return (MAX ? (a.v > b.v) : (a.v < b.v)) ? a : b;
  }
};

// (max, sum of exp(x - max)) of softmax's row in one pass ("online" softmax), for rows
// too long to read three times from the L2: two partial pairs combine by rescaling each
// sum to the larger maximum. A partial of only -inf elements is {-inf, 0} and adds
// nothing; NaN propagates through the maximum (sfk_maximum), and through the sum from
// there.
template <typename T> struct sfk_mspair {
  T m;
  T s;
};
#ifdef SFK_FAST_EXP  // the fast form (stitch_backend/codegen/fast_math.py): 2 + 1.17|x| ulp
__device__ __forceinline__ float sfk_exp_(float x) { return __expf(x); }
#else
__device__ __forceinline__ float sfk_exp_(float x) { return expf(x); }
#endif
__device__ __forceinline__ double sfk_exp_(double x) { return exp(x); }
__device__ __forceinline__ float sfk_inf_like(float) { return SFK_INF_F; }
__device__ __forceinline__ double sfk_inf_like(double) { return SFK_INF_D; }
template <typename T> struct sfk_op_online {
  __device__ __forceinline__ sfk_mspair<T> operator()(sfk_mspair<T> a, sfk_mspair<T> b) const {
    const T m = sfk_maximum(a.m, b.m);
    if (m == -sfk_inf_like(m)) return sfk_mspair<T>{m, a.s + b.s};
    const T sa = a.s == T(0) ? T(0) : a.s * sfk_exp_(a.m - m);
    const T sb = b.s == T(0) ? T(0) : b.s * sfk_exp_(b.m - m);
    return sfk_mspair<T>{m, sa + sb};
  }
};

// One element into a pair: one exp an element, and a second only where the element
// raises the maximum (rare along a long row: where its values are in random order, about
// ln(n) times in n). A -inf maximum contributes nothing to the sum (exp(-inf - -inf)
// would be NaN), so a row of only -inf ends as {-inf, 0} and its softmax
// exp(-inf - -inf) / 0 is NaN, as eager's; a NaN or a +inf element makes the sum NaN,
// as eager's exp(x - max) does there.
template <typename T> __device__ __forceinline__ sfk_mspair<T> sfk_online_add(sfk_mspair<T> a, T x) {
  const T m = sfk_maximum(a.m, x);               // NaN propagates
  if (!(m == a.m)) {                             // a new maximum (or a NaN): rescale once
    a.s = a.m == -sfk_inf_like(x) ? T(0) : a.s * sfk_exp_(a.m - m);
    a.m = m;
  }
  a.s += a.m == -sfk_inf_like(x) ? T(0) : sfk_exp_(x - a.m);
  return a;
}

// A vector chunk's V elements into a pair (the fast kernel's, codegen/fast_math.py): the
// chunk's maximum first, so at most one rescale a chunk and no branch an element, then
// the V exponentials summed as a tree. The same special values as sfk_online_add: a -inf
// maximum adds nothing, a NaN or +inf element makes the sum NaN.
template <typename T, int V> __device__ __forceinline__ sfk_mspair<T> sfk_online_addv(sfk_mspair<T> a, const T (&x)[V]) {
  static_assert(V > 0 && (V & (V - 1)) == 0, "a chunk of a power of two lanes");
  T t[V];
#pragma unroll
  for (int v = 0; v < V; ++v) t[v] = x[v];
#pragma unroll
  for (int w = V / 2; w > 0; w /= 2) {   // the lanes' maximum as a tree, then the row's
#pragma unroll
    for (int v = 0; v < w; ++v) t[v] = sfk_maximum(t[v], t[v + w]);
  }
  const T m = sfk_maximum(a.m, t[0]);
  if (!(m == a.m)) {
    a.s = a.m == -sfk_inf_like(m) ? T(0) : a.s * sfk_exp_(a.m - m);
    a.m = m;
  }
  if (a.m == -sfk_inf_like(m)) return a;
  T e[V];
#pragma unroll
  for (int v = 0; v < V; ++v) e[v] = sfk_exp_(x[v] - m);
#pragma unroll
  for (int w = V / 2; w > 0; w /= 2) {
#pragma unroll
    for (int v = 0; v < w; ++v) e[v] += e[v + w];
  }
  a.s += e[0];
  return a;
}

// ----------------------------------------------------------------------------- shuffles

template <typename T> __device__ __forceinline__ T sfk_shfl_xor(T v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
template <> __device__ __forceinline__ bool sfk_shfl_xor<bool>(bool v, int m) {
  return __shfl_xor_sync(0xffffffffu, (int)v, m) != 0;
}
template <> __device__ __forceinline__ signed char sfk_shfl_xor<signed char>(signed char v, int m) {
  return (signed char)__shfl_xor_sync(0xffffffffu, (int)v, m);
}
template <> __device__ __forceinline__ unsigned char sfk_shfl_xor<unsigned char>(unsigned char v, int m) {
  return (unsigned char)__shfl_xor_sync(0xffffffffu, (int)v, m);
}
template <> __device__ __forceinline__ short sfk_shfl_xor<short>(short v, int m) {
  return (short)__shfl_xor_sync(0xffffffffu, (int)v, m);
}
template <typename T> __device__ __forceinline__ sfk_argpair<T> sfk_shfl_xor(sfk_argpair<T> p, int m) {
  sfk_argpair<T> out;
  out.v = sfk_shfl_xor(p.v, m);
  out.i = __shfl_xor_sync(0xffffffffu, p.i, m);
  return out;
}

template <typename T> __device__ __forceinline__ sfk_mspair<T> sfk_shfl_xor(sfk_mspair<T> p, int m) {
  sfk_mspair<T> out;
  out.m = sfk_shfl_xor(p.m, m);
  out.s = sfk_shfl_xor(p.s, m);
  return out;
}

// sfk_group_reduce: reduce `v` over the TK = 2^log2_tk threads of one row group and give
// every thread of the group the result (bit-identical in all of them).
//   inner layout:  group = TK consecutive threads (tk = threadIdx.x % TK);
//   column layout: group = threads with equal threadIdx.x % RB (RB = blockDim.x / TK).
// Every thread of the block must call it (it may __syncthreads). `smem` holds at least
// blockDim.x values of T. Safe to call back to back with the same smem.
template <typename T, typename Op>
__device__ __forceinline__ T sfk_group_reduce(T v, Op op, int log2_tk, bool inner, T* smem) {
  const int TK = 1 << log2_tk;
  if (TK == 1) return v;
  if (inner) {
    const int w = TK < 32 ? TK : 32;
#pragma unroll 1
    for (int m = w >> 1; m > 0; m >>= 1) v = op(v, sfk_shfl_xor(v, m));
    if (TK <= 32) return v;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    const int nw = TK >> 5, first = (warp / nw) * nw;
    T acc = smem[first];
    for (int j = 1; j < nw; ++j) acc = op(acc, smem[first + j]);
    return acc;
  }
  const int RB = blockDim.x >> log2_tk, tr = threadIdx.x % RB;
  if (RB < 32 && (blockDim.x & 31) == 0) {
    // A warp holds 32 / RB threads of each of its RB rows, lanes RB apart: shuffles
    // combine them first, then each thread combines its row's one value per warp (at
    // most 32) in warp order. Before, every thread combined all TK values serially from
    // shared memory: 128 dependent loads for a channels-last BatchNorm's 8 x 128 block.
#pragma unroll 1
    for (int m = 16; m >= RB; m >>= 1) v = op(v, sfk_shfl_xor(v, m));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane < RB) smem[warp * RB + lane] = v;
    __syncthreads();
    T acc = smem[tr];
    for (int j = 1; j < nw; ++j) acc = op(acc, smem[j * RB + tr]);
    return acc;
  }
  __syncthreads();
  smem[threadIdx.x] = v;
  __syncthreads();
  T acc = smem[tr];
  for (int j = 1; j < TK; ++j) acc = op(acc, smem[j * RB + tr]);
  return acc;
}

// ----------------------------------------------------------------------------- clusters
// The ``cluster`` reduction layout (sm_90): the SFK_CLUSTER blocks of a thread-block
// cluster share each row, a slice each, and combine their parts through distributed
// shared memory. Raw PTX, so the generated code needs no cooperative_groups header.

// This block's rank in its (1-D) cluster.
__device__ __forceinline__ unsigned sfk_cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

// Every thread of every block of the cluster arrives before any goes on; shared-memory
// writes before it are visible to the cluster's blocks after it.
__device__ __forceinline__ void sfk_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();   // the Coder proposes the cluster layout for sm_90 and later only
#endif
}

// `slot` (this block's shared memory) in block `rank` of the cluster, as a generic address.
template <typename T> __device__ __forceinline__ const T* sfk_cluster_map(const T* slot, unsigned rank) {
  unsigned long long out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(slot), "r"(rank));
#endif
  return reinterpret_cast<const T*>(out);
}

// sfk_cluster_reduce: `v` (the same in every thread of the block, as sfk_group_reduce
// leaves it) combined over the cluster's N blocks in rank order, so every block and every
// thread gets bit-identical results. `slots` holds 2 values of T in shared memory, taken
// in turn by `parity` (flipped by the caller once per call site and row): a slot is
// written again only after the next call's cluster barrier, which every block reaches
// only after it has read the slot. The caller ends the kernel with sfk_cluster_sync(),
// so that no block exits while another may still read its slots.
template <int N, typename T, typename Op>
__device__ __forceinline__ T sfk_cluster_reduce(T v, Op op, T* slots, int parity) {
  if (threadIdx.x == 0) slots[parity] = v;
  sfk_cluster_sync();
  T acc = *sfk_cluster_map(slots + parity, 0u);
#pragma unroll
  for (int j = 1; j < N; ++j) acc = op(acc, *sfk_cluster_map(slots + parity, (unsigned)j));
  return acc;
}

// ----------------------------------------------------------------------------- vector access

// sfk_vec<T, N>: N elements moved by one aligned access of N * sizeof(T) (<= 16) bytes.
template <typename T, int N> struct alignas(sizeof(T) * N) sfk_vec {
  T v[N];
};
template <int N, typename T> __device__ __forceinline__ sfk_vec<T, N> sfk_ldv(const T* p) {
  return *reinterpret_cast<const sfk_vec<T, N>*>(p);
}
template <int N, typename T> __device__ __forceinline__ void sfk_stv(T* p, const sfk_vec<T, N>& x) {
  *reinterpret_cast<sfk_vec<T, N>*>(p) = x;
}
__device__ __forceinline__ bool sfk_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}
