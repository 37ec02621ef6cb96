// csrc/runtime/gemm_lt.cu: cuBLASLt matmuls with fused epilogues behind a C ABI (gemm_lt.h).
//
// Host code only. A handle owns a cublasLt handle and a cache of plans (descriptors plus
// the chosen algorithm) keyed by everything that shapes the choice: sizes, layouts,
// dtype, compute mode, epilogue, pointer alignments, workspace size, algo rank. A repeat
// call with the same key only re-points bias/aux and enqueues cublasLtMatmul, so the
// per-call cost is close to cuBLASLt's own. Heuristics are told the real alignment of
// every pointer: their default assumes 256-byte alignment, and an algorithm chosen under
// that assumption may fail on a sliced tensor.
#include "gemm_lt.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace {

thread_local std::string g_last_error;

void set_error(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
}

// SC_LT_TRY: return the status of a failing cuBLASLt call, recording the call, file and line.
#define SC_LT_TRY(call)                                                                       \
  do {                                                                                        \
    cublasStatus_t sc_st_ = (call);                                                           \
    if (sc_st_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      set_error("%s returned %s at %s:%d", #call, cublasLtGetStatusName(sc_st_), __FILE__, __LINE__); \
      return sc_st_;                                                                          \
    }                                                                                         \
  } while (0)

#define SC_LT_INVALID(...)              \
  do {                                  \
    set_error(__VA_ARGS__);             \
    return CUBLAS_STATUS_INVALID_VALUE; \
  } while (0)

struct EpilogueInfo {
  cublasLtEpilogue_t lt;
  bool bias_in;    // reads bias
  bool bias_out;   // writes a bias gradient
  bool aux;        // reads or writes aux
  bool relu_mask;  // aux is a bit mask (ld in bits)
};

bool epilogue_info(int e, EpilogueInfo* out) {
  switch (e) {
    case SC_LT_EPI_DEFAULT: *out = {CUBLASLT_EPILOGUE_DEFAULT, false, false, false, false}; return true;
    case SC_LT_EPI_BIAS: *out = {CUBLASLT_EPILOGUE_BIAS, true, false, false, false}; return true;
    case SC_LT_EPI_RELU: *out = {CUBLASLT_EPILOGUE_RELU, false, false, false, false}; return true;
    case SC_LT_EPI_RELU_BIAS: *out = {CUBLASLT_EPILOGUE_RELU_BIAS, true, false, false, false}; return true;
    case SC_LT_EPI_GELU: *out = {CUBLASLT_EPILOGUE_GELU, false, false, false, false}; return true;
    case SC_LT_EPI_GELU_BIAS: *out = {CUBLASLT_EPILOGUE_GELU_BIAS, true, false, false, false}; return true;
    case SC_LT_EPI_RELU_AUX: *out = {CUBLASLT_EPILOGUE_RELU_AUX, false, false, true, true}; return true;
    case SC_LT_EPI_RELU_AUX_BIAS: *out = {CUBLASLT_EPILOGUE_RELU_AUX_BIAS, true, false, true, true}; return true;
    case SC_LT_EPI_GELU_AUX: *out = {CUBLASLT_EPILOGUE_GELU_AUX, false, false, true, false}; return true;
    case SC_LT_EPI_GELU_AUX_BIAS: *out = {CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, false, true, false}; return true;
    case SC_LT_EPI_DRELU: *out = {CUBLASLT_EPILOGUE_DRELU, false, false, true, true}; return true;
    case SC_LT_EPI_DRELU_BGRAD: *out = {CUBLASLT_EPILOGUE_DRELU_BGRAD, false, true, true, true}; return true;
    case SC_LT_EPI_DGELU: *out = {CUBLASLT_EPILOGUE_DGELU, false, false, true, false}; return true;
    case SC_LT_EPI_DGELU_BGRAD: *out = {CUBLASLT_EPILOGUE_DGELU_BGRAD, false, true, true, false}; return true;
    case SC_LT_EPI_BGRADA: *out = {CUBLASLT_EPILOGUE_BGRADA, false, true, false, false}; return true;
    case SC_LT_EPI_BGRADB: *out = {CUBLASLT_EPILOGUE_BGRADB, false, true, false, false}; return true;
    default: return false;
  }
}

bool cuda_dtype(int d, cudaDataType_t* out) {
  switch (d) {
    case SC_LT_F32: *out = CUDA_R_32F; return true;
    case SC_LT_F16: *out = CUDA_R_16F; return true;
    case SC_LT_BF16: *out = CUDA_R_16BF; return true;
    default: return false;
  }
}

// Largest power of two (<= 256) dividing the address; NULL counts as fully aligned.
int64_t alignment(const void* p) {
  const uint64_t v = reinterpret_cast<uint64_t>(p);
  if (v == 0) return 256;
  const uint64_t low = v & (~v + 1);
  return low >= 256 ? 256 : static_cast<int64_t>(low);
}

using PlanKey = std::array<int64_t, 28>;

// Descriptors for one problem shape plus the algorithm picked for it.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_needed = 0;
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

constexpr size_t kMaxPlans = 4096;  // a safety valve; real graphs use a few dozen shapes
constexpr int kMaxAlgos = 64;

}  // namespace

struct sc_lt_handle {
  cublasLtHandle_t lt = nullptr;
  std::mutex mu;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

namespace {

cublasStatus_t validate(const sc_lt_params* p, EpilogueInfo* epi, cudaDataType_t* dt) {
  if (p == nullptr) SC_LT_INVALID("params is NULL");
  if (p->m <= 0 || p->n <= 0 || p->k <= 0)
    SC_LT_INVALID("m, n, k must be positive (got m=%lld n=%lld k=%lld)", (long long)p->m, (long long)p->n, (long long)p->k);
  if (p->batch_count < 1) SC_LT_INVALID("batch_count must be >= 1 (got %d)", p->batch_count);
  if (!cuda_dtype(p->dtype, dt)) SC_LT_INVALID("unknown dtype %d", p->dtype);
  if (!epilogue_info(p->epilogue, epi)) SC_LT_INVALID("unknown epilogue %d", p->epilogue);
  if (p->compute != SC_LT_COMPUTE_32F && p->compute != SC_LT_COMPUTE_32F_FAST_TF32)
    SC_LT_INVALID("unknown compute mode %d", p->compute);
  if (p->compute == SC_LT_COMPUTE_32F_FAST_TF32 && p->dtype != SC_LT_F32)
    SC_LT_INVALID("TF32 compute applies to fp32 inputs only (dtype %d)", p->dtype);
  const int64_t a_rows = p->trans_a ? p->k : p->m, b_rows = p->trans_b ? p->n : p->k;
  if (p->lda < a_rows || p->lda < 1) SC_LT_INVALID("lda=%lld < rows of stored A (%lld)", (long long)p->lda, (long long)a_rows);
  if (p->ldb < b_rows || p->ldb < 1) SC_LT_INVALID("ldb=%lld < rows of stored B (%lld)", (long long)p->ldb, (long long)b_rows);
  if (p->ldc < p->m) SC_LT_INVALID("ldc=%lld < m=%lld", (long long)p->ldc, (long long)p->m);
  if (!p->a || !p->b || !p->d) SC_LT_INVALID("a, b and d must be non-NULL");
  if (p->beta != 0.f && !p->c) SC_LT_INVALID("beta != 0 needs c");
  if ((epi->bias_in || epi->bias_out) && !p->bias) SC_LT_INVALID("epilogue %d needs a bias pointer", p->epilogue);
  if (!(epi->bias_in || epi->bias_out) && p->bias) SC_LT_INVALID("epilogue %d takes no bias pointer", p->epilogue);
  if (epi->aux) {
    if (!p->aux) SC_LT_INVALID("epilogue %d needs an aux pointer", p->epilogue);
    const int64_t mult = epi->relu_mask ? 128 : 8;
    if (p->ld_aux < p->m || p->ld_aux % mult != 0)
      SC_LT_INVALID("ld_aux=%lld must be >= m=%lld and a multiple of %lld", (long long)p->ld_aux, (long long)p->m,
                    (long long)mult);
    if (p->batch_count > 1 && p->stride_aux % mult != 0)
      SC_LT_INVALID("stride_aux=%lld must be a multiple of %lld", (long long)p->stride_aux, (long long)mult);
  } else if (p->aux) {
    SC_LT_INVALID("epilogue %d takes no aux pointer", p->epilogue);
  }
  if (p->workspace_size > 0 && !p->workspace) SC_LT_INVALID("workspace_size > 0 but workspace is NULL");
  return CUBLAS_STATUS_SUCCESS;
}

PlanKey plan_key(const sc_lt_params* p) {
  return PlanKey{p->m, p->n, p->k, p->lda, p->ldb, p->ldc,
                 p->stride_a, p->stride_b, p->stride_c, p->stride_bias, p->ld_aux, p->stride_aux,
                 p->batch_count, p->trans_a, p->trans_b, p->dtype, p->compute, p->epilogue,
                 p->algo_index, p->beta != 0.f,
                 alignment(p->a), alignment(p->b), alignment(p->beta != 0.f ? p->c : p->d), alignment(p->d),
                 alignment(p->bias), alignment(p->aux), static_cast<int64_t>(p->workspace_size), 0};
}

cublasStatus_t make_layout(cublasLtMatrixLayout_t* out, cudaDataType_t dt, int64_t rows, int64_t cols, int64_t ld,
                           int32_t batch, int64_t stride) {
  SC_LT_TRY(cublasLtMatrixLayoutCreate(out, dt, rows, cols, ld));
  if (batch > 1) {
    SC_LT_TRY(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
    SC_LT_TRY(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Point the descriptor at this call's bias and aux buffers (they are not part of the key).
cublasStatus_t set_pointers(Plan* plan, const sc_lt_params* p) {
  SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p->bias, sizeof(p->bias)));
  SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p->aux, sizeof(p->aux)));
  return CUBLAS_STATUS_SUCCESS;
}

// Descriptors for p (no algorithm yet).
cublasStatus_t build_descs(Plan* plan, const sc_lt_params* p, const EpilogueInfo& epi, cudaDataType_t dt) {
  const cublasComputeType_t ct =
      p->compute == SC_LT_COMPUTE_32F_FAST_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  SC_LT_TRY(cublasLtMatmulDescCreate(&plan->op, ct, CUDA_R_32F));
  const int32_t ta = p->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const uint32_t e = static_cast<uint32_t>(epi.lt);
  SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
  if (epi.bias_in || epi.bias_out) {
    SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &p->stride_bias,
                                             sizeof(p->stride_bias)));
  }
  if (epi.aux) {
    SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &p->ld_aux, sizeof(p->ld_aux)));
    SC_LT_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &p->stride_aux,
                                             sizeof(p->stride_aux)));
  }
  const cublasStatus_t st = set_pointers(plan, p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const int64_t a_rows = p->trans_a ? p->k : p->m, a_cols = p->trans_a ? p->m : p->k;
  const int64_t b_rows = p->trans_b ? p->n : p->k, b_cols = p->trans_b ? p->k : p->n;
  cublasStatus_t s;
  if ((s = make_layout(&plan->la, dt, a_rows, a_cols, p->lda, p->batch_count, p->stride_a)) != CUBLAS_STATUS_SUCCESS) return s;
  if ((s = make_layout(&plan->lb, dt, b_rows, b_cols, p->ldb, p->batch_count, p->stride_b)) != CUBLAS_STATUS_SUCCESS) return s;
  // C and D share one layout: D is written with C's leading dim and batch stride.
  if ((s = make_layout(&plan->lc, dt, p->m, p->n, p->ldc, p->batch_count, p->stride_c)) != CUBLAS_STATUS_SUCCESS) return s;
  return CUBLAS_STATUS_SUCCESS;
}

// Ask the heuristics for up to `requested` algorithms for plan's descriptors.
cublasStatus_t run_heuristics(sc_lt_handle* h, Plan* plan, const sc_lt_params* p, int requested,
                              cublasLtMatmulHeuristicResult_t* results, int* returned) {
  Preference pref;
  SC_LT_TRY(cublasLtMatmulPreferenceCreate(&pref.pref));
  const uint64_t ws = p->workspace_size;
  SC_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al_a = (uint32_t)alignment(p->a), al_b = (uint32_t)alignment(p->b),
                 al_c = (uint32_t)alignment(p->beta != 0.f ? p->c : p->d), al_d = (uint32_t)alignment(p->d);
  SC_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  SC_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  SC_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  SC_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
  *returned = 0;
  SC_LT_TRY(cublasLtMatmulAlgoGetHeuristic(h->lt, plan->op, plan->la, plan->lb, plan->lc, plan->lc, pref.pref, requested,
                                           results, returned));
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

int sc_lt_create(sc_lt_handle_t* out) {
  if (out == nullptr) SC_LT_INVALID("out is NULL");
  *out = nullptr;
  std::unique_ptr<sc_lt_handle> h(new sc_lt_handle());
  SC_LT_TRY(cublasLtCreate(&h->lt));
  *out = h.release();
  return CUBLAS_STATUS_SUCCESS;
}

int sc_lt_destroy(sc_lt_handle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_SUCCESS;
  {
    std::lock_guard<std::mutex> lock(handle->mu);
    handle->plans.clear();
  }
  const cublasStatus_t st = cublasLtDestroy(handle->lt);
  delete handle;
  if (st != CUBLAS_STATUS_SUCCESS) set_error("cublasLtDestroy returned %s", cublasLtGetStatusName(st));
  return st;
}

int sc_lt_clear_cache(sc_lt_handle_t handle) {
  if (handle == nullptr) SC_LT_INVALID("handle is NULL");
  std::lock_guard<std::mutex> lock(handle->mu);
  handle->plans.clear();
  return CUBLAS_STATUS_SUCCESS;
}

int sc_lt_heuristics(sc_lt_handle_t handle, const sc_lt_params* p, int max_algos, int* count) {
  if (handle == nullptr || count == nullptr) SC_LT_INVALID("handle and count must be non-NULL");
  *count = 0;
  EpilogueInfo epi;
  cudaDataType_t dt;
  cublasStatus_t st = validate(p, &epi, &dt);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (max_algos < 1 || max_algos > kMaxAlgos) SC_LT_INVALID("max_algos must be in [1, %d]", kMaxAlgos);
  Plan plan;
  if ((st = build_descs(&plan, p, epi, dt)) != CUBLAS_STATUS_SUCCESS) return st;
  cublasLtMatmulHeuristicResult_t results[kMaxAlgos] = {};
  return run_heuristics(handle, &plan, p, max_algos, results, count);
}

int sc_lt_matmul(sc_lt_handle_t handle, const sc_lt_params* p) {
  if (handle == nullptr) SC_LT_INVALID("handle is NULL");
  EpilogueInfo epi;
  cudaDataType_t dt;
  cublasStatus_t st = validate(p, &epi, &dt);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (p->algo_index < 0 || p->algo_index >= kMaxAlgos) SC_LT_INVALID("algo_index %d out of [0, %d)", p->algo_index, kMaxAlgos);

  std::lock_guard<std::mutex> lock(handle->mu);
  const PlanKey key = plan_key(p);
  auto it = handle->plans.find(key);
  Plan* plan;
  if (it != handle->plans.end()) {
    plan = it->second.get();
    if ((st = set_pointers(plan, p)) != CUBLAS_STATUS_SUCCESS) return st;
  } else {
    std::unique_ptr<Plan> fresh(new Plan());
    if ((st = build_descs(fresh.get(), p, epi, dt)) != CUBLAS_STATUS_SUCCESS) return st;
    cublasLtMatmulHeuristicResult_t results[kMaxAlgos] = {};
    int returned = 0;
    if ((st = run_heuristics(handle, fresh.get(), p, p->algo_index + 1, results, &returned)) != CUBLAS_STATUS_SUCCESS)
      return st;
    if (returned == 0) {
      set_error("cuBLASLt has no algorithm for m=%lld n=%lld k=%lld batch=%d dtype=%d compute=%d epilogue=%d "
                "trans=(%d,%d) ld=(%lld,%lld,%lld) workspace=%llu",
                (long long)p->m, (long long)p->n, (long long)p->k, p->batch_count, p->dtype, p->compute, p->epilogue,
                p->trans_a, p->trans_b, (long long)p->lda, (long long)p->ldb, (long long)p->ldc,
                (unsigned long long)p->workspace_size);
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (p->algo_index >= returned)
      SC_LT_INVALID("algo_index %d but the heuristics offer only %d algorithms", p->algo_index, returned);
    fresh->algo = results[p->algo_index].algo;
    fresh->workspace_needed = results[p->algo_index].workspaceSize;
    if (handle->plans.size() >= kMaxPlans) handle->plans.clear();
    plan = fresh.get();
    handle->plans.emplace(key, std::move(fresh));
  }
  const void* c = p->beta != 0.f ? p->c : p->d;
  SC_LT_TRY(cublasLtMatmul(handle->lt, plan->op, &p->alpha, p->a, plan->la, p->b, plan->lb, &p->beta, c, plan->lc, p->d,
                           plan->lc, &plan->algo, p->workspace, p->workspace_size, static_cast<cudaStream_t>(p->stream)));
  return CUBLAS_STATUS_SUCCESS;
}

const char* sc_lt_status_string(int status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS: success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED: cuBLASLt could not initialise (no GPU or driver?)";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED: resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE: an unsupported value or parameter was passed";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH: the feature is absent on this GPU";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR: access to GPU memory failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED: the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR: an internal cuBLASLt operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED: the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR: license error";
    default: return "unknown cublasStatus_t";
  }
}

const char* sc_lt_last_error(void) { return g_last_error.c_str(); }

size_t sc_lt_params_size(void) { return sizeof(sc_lt_params); }

int sc_lt_abi_version(void) { return SC_LT_ABI_VERSION; }

size_t sc_lt_cublaslt_version(void) { return cublasLtGetVersion(); }

}  // extern "C"
