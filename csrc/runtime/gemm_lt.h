// csrc/runtime/gemm_lt.h: cuBLASLt matmuls with fused epilogues, as a plain C ABI.
//
// Built by stitch_backend/runtime.py into libstitch_runtime.so with nvcc alone (no torch
// headers) and called through ctypes. All functions return a cublasStatus_t value
// (0 = success); sc_lt_status_string names it and sc_lt_last_error says what failed.
//
// ---- Layout convention (read this before calling) -------------------------------------
// cuBLASLt is column-major. sc_lt_params describes the column-major problem
//
//     D (m x n) = epilogue( alpha * op(A) (m x k) * op(B) (k x n) + beta * C (m x n) )
//
// A row-major torch product  out (M,N) = a (M,K) @ b (K,N)  is computed as its
// transpose, which has the same bytes:  out^T (N x M) = b^T (N x K) * a^T (K x M).
// A row-major (R, C) matrix with row stride s is a column-major (C x R) matrix with
// ld = s, so for contiguous a, b, out:
//
//     m = N, n = M, k = K
//     A = b.data_ptr(), op(A) = N, lda = N      (b^T, column-major N x K)
//     B = a.data_ptr(), op(B) = N, ldb = K      (a^T, column-major K x M)
//     D = out.data_ptr(),          ldd = ldc = N
//
// A transposed view (stride (1, R)) is the untransposed column-major matrix: use op = T
// and ld = its second stride. Consequences for the epilogues (torch terms):
//   BIAS / *_BIAS: bias has length m = N and is added to every row of out (addmm/linear).
//   D*_BGRAD:      bias receives length-N sums over the rows of the result (db of a layer).
//   BGRADA:        bias[j] = sum_k b[k, j]   (length N; cuBLASLt's A is torch's b).
//   BGRADB:        bias[i] = sum_k a[i, k]   (length M; cuBLASLt's B is torch's a), so for
//                  dW = grad.T @ x, BGRADB yields grad.sum(0).
//   *_AUX:         aux is a column-major m x n matrix with leading dim ld_aux, i.e. a
//                  row-major (M, ld_aux) buffer: GELU_AUX stores the pre-activation in the
//                  output dtype (ld_aux % 8 == 0); RELU_AUX stores a bit mask, ld_aux in
//                  bits (% 128 == 0), (M * ld_aux / 8) bytes. DRELU/DGELU read them back.
// ----------------------------------------------------------------------------------------
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SC_LT_ABI_VERSION 1

typedef enum sc_lt_dtype {
  SC_LT_F32 = 0,   // float
  SC_LT_F16 = 1,   // __half
  SC_LT_BF16 = 2,  // __nv_bfloat16
} sc_lt_dtype;

typedef enum sc_lt_compute {
  SC_LT_COMPUTE_32F = 0,            // fp32 accumulate; for fp32 inputs: strict IEEE fp32 (no TF32)
  SC_LT_COMPUTE_32F_FAST_TF32 = 1,  // fp32 inputs with TF32 tensor cores (torch allow_tf32=True); fp32 only
} sc_lt_compute;

typedef enum sc_lt_epilogue {
  SC_LT_EPI_DEFAULT = 0,        // D = alpha*AB + beta*C
  SC_LT_EPI_BIAS = 1,           // + bias (length m, broadcast over columns)
  SC_LT_EPI_RELU = 2,           // relu(.)
  SC_LT_EPI_RELU_BIAS = 3,      // relu(. + bias)
  SC_LT_EPI_GELU = 4,           // gelu_tanh(.)   (cuBLASLt's GELU is the tanh approximation)
  SC_LT_EPI_GELU_BIAS = 5,      // gelu_tanh(. + bias)
  SC_LT_EPI_RELU_AUX = 6,       // relu(.), relu bit mask to aux
  SC_LT_EPI_RELU_AUX_BIAS = 7,  // relu(. + bias), bit mask to aux
  SC_LT_EPI_GELU_AUX = 8,       // gelu_tanh(.), pre-activation to aux
  SC_LT_EPI_GELU_AUX_BIAS = 9,  // gelu_tanh(. + bias), pre-activation to aux
  SC_LT_EPI_DRELU = 10,         // D = AB * relu'(mask in aux)
  SC_LT_EPI_DRELU_BGRAD = 11,   // DRELU, and bias = row sums of D
  SC_LT_EPI_DGELU = 12,         // D = AB * gelu_tanh'(pre-activation in aux)
  SC_LT_EPI_DGELU_BGRAD = 13,   // DGELU, and bias = row sums of D
  SC_LT_EPI_BGRADA = 14,        // D = AB, and bias = sums of op(A) over k (length m)
  SC_LT_EPI_BGRADB = 15,        // D = AB, and bias = sums of op(B) over k (length n)
  SC_LT_EPI_COUNT = 16,
} sc_lt_epilogue;

// One matmul, column-major terms (see above). Field order keeps every member naturally
// aligned with no padding; Python mirrors it and checks sc_lt_params_size().
typedef struct sc_lt_params {
  int64_t m, n, k;
  int64_t lda, ldb, ldc;                  // leading dims as stored (before op); ldc is also D's
  int64_t stride_a, stride_b, stride_c;   // batch strides in elements (A/B may be 0: broadcast)
  int64_t stride_bias;                    // batch stride of bias in elements (0: shared)
  int64_t ld_aux, stride_aux;             // aux leading dim / batch stride (elements; bits for ReLU)
  const void* a;
  const void* b;
  const void* c;                          // read when beta != 0; may be NULL when beta == 0
  void* d;
  void* bias;                             // input for *BIAS, output for *BGRAD*; NULL otherwise
  void* aux;                              // output for *_AUX, input for DRELU*/DGELU*
  void* workspace;
  uint64_t workspace_size;
  void* stream;                           // cudaStream_t
  float alpha, beta;
  int32_t batch_count;                    // >= 1
  int32_t trans_a, trans_b;               // 0: op = N, 1: op = T
  int32_t dtype;                          // sc_lt_dtype of A, B, C, D, bias, GELU aux
  int32_t compute;                        // sc_lt_compute
  int32_t epilogue;                       // sc_lt_epilogue
  int32_t algo_index;                     // rank in cuBLASLt's heuristic list (0 = its best)
  int32_t reserved;                       // 0
} sc_lt_params;

typedef struct sc_lt_handle* sc_lt_handle_t;

// Create a handle (a cublasLt handle plus a cache of plans). Needs a GPU.
int sc_lt_create(sc_lt_handle_t* out);
// Destroy a handle and its plans.
int sc_lt_destroy(sc_lt_handle_t handle);
// Enqueue one matmul on params->stream. Thread-safe per handle.
int sc_lt_matmul(sc_lt_handle_t handle, const sc_lt_params* params);
// Number of algorithms cuBLASLt's heuristics offer for params (at most max_algos), in *count.
int sc_lt_heuristics(sc_lt_handle_t handle, const sc_lt_params* params, int max_algos, int* count);
// Drop cached plans (frees descriptors).
int sc_lt_clear_cache(sc_lt_handle_t handle);
// Name and description of a status code, e.g. "CUBLAS_STATUS_NOT_SUPPORTED: ...". Never NULL.
const char* sc_lt_status_string(int status);
// What the last failing call in this thread was doing (empty if none). Valid until the next call.
const char* sc_lt_last_error(void);
// sizeof(sc_lt_params), so bindings can check their mirror of the struct.
size_t sc_lt_params_size(void);
// SC_LT_ABI_VERSION of the built library.
int sc_lt_abi_version(void);
// cublasLtGetVersion() of the linked cuBLASLt.
size_t sc_lt_cublaslt_version(void);

#ifdef __cplusplus
}
#endif
