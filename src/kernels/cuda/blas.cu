// cuBLASLt GEMMs for linear() (bf16 tensor cores on split activations, or exact fp32), the
// process-wide GEMM precision, and the per-device stream-ordered scratch pool. Plans (matmul
// descriptor, layouts, the heuristic's algorithm) are cached per (device, shape, dtype,
// alignments): the heuristic query costs far more than the GEMM launch.
#include "kernels/cuda/blas.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include <cublasLt.h>
#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

std::atomic<GemmPrecision> g_precision{GemmPrecision::kExact};

[[noreturn]] void cublas_fail(cublasStatus_t st, const char* what, const char* file, int line) {
  std::fprintf(stderr, "m3serve: cuBLASLt call failed at %s:%d: %s: status %d\n", file, line, what,
               static_cast<int>(st));
  std::abort();
}

#define M3_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                   \
    cublasStatus_t m3_st_ = (expr);                                                      \
    if (m3_st_ != CUBLAS_STATUS_SUCCESS) cublas_fail(m3_st_, #expr, __FILE__, __LINE__); \
  } while (0)

constexpr int kMaxDevices = 64;
constexpr size_t kMaxWorkspace = size_t{32} << 20;

// Per-device state, created on first use under g_mutex and never destroyed (the process ends
// with it; destroying a handle after the driver shut down would fault at exit).
struct DeviceState {
  cublasLtHandle_t lt = nullptr;
  cudaMemPool_t pool = nullptr;
};
std::mutex g_mutex;
DeviceState g_dev[kMaxDevices];

int current_device() {
  int d = 0;
  M3_CUDA_CHECK(cudaGetDevice(&d));
  M3_CHECK(d >= 0 && d < kMaxDevices, "device %d", d);
  return d;
}

DeviceState& device_state() {
  const int d = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceState& s = g_dev[d];
  if (s.lt == nullptr) M3_CUBLAS_CHECK(cublasLtCreate(&s.lt));
  if (s.pool == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = d;
    M3_CUDA_CHECK(cudaMemPoolCreate(&s.pool, &props));
    // Keep freed memory in the pool: the same scratch sizes come back every step.
    uint64_t keep = UINT64_MAX;
    M3_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  return s;
}

// Largest power of two (<= 256) dividing the address: cuBLASLt picks algorithms by it.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

struct PlanKey {
  int device;
  int64_t m, n, k;
  bool f32;
  uint32_t align_a, align_b, align_c;
  // gemm_fp8's plans: 0 = cuBLASLt scales by the outer vectors (fp32 out), 1 = unscaled fp32
  // out, 2 = unscaled bf16 out (each scaled by scale_outer after); -1: not an FP8 plan.
  int fp8_mode = -1;
  auto tie() const { return std::tie(device, m, n, k, f32, align_a, align_b, align_c, fp8_mode); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  size_t workspace = 0;
};

std::mutex g_plan_mutex;
std::map<PlanKey, Plan> g_plans;

// The plan's algorithm from cuBLASLt's heuristic for its descriptors, within kMaxWorkspace and
// the operands' alignments (p.ok stays false when there is none).
void pick_algo(Plan& p, cublasLtHandle_t lt, uint32_t align_a, uint32_t align_b, uint32_t align_c) {
  cublasLtMatmulPreference_t pref = nullptr;
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kMaxWorkspace;
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a));
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b));
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));
  cublasLtMatmulHeuristicResult_t res = {};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
  M3_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
    p.ok = true;
    p.algo = res.algo;
    p.workspace = res.workspaceSize;
  }
}

// Row-major y[n, m] = x[n, k] · W[m, k]ᵀ is column-major yᵀ[m, n] = op(A)·B with A = W seen as
// column-major [k, m] (transposed), B = x seen as column-major [k, n].
const Plan& plan_for(const PlanKey& key, cublasLtHandle_t lt) {
  std::lock_guard<std::mutex> lock(g_plan_mutex);
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return it->second;
  Plan p;
  const cudaDataType_t in_t = key.f32 ? CUDA_R_32F : CUDA_R_16BF;
  M3_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in_t, key.k, key.m, key.k));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in_t, key.k, key.n, key.k));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, key.m, key.n, key.m));
  pick_algo(p, lt, key.align_a, key.align_b, key.align_c);
  // A shape without an algorithm is remembered too (ok = false), so it is not asked again.
  return g_plans.emplace(key, p).first->second;
}

// One matmul y = A·B (+ beta y) through a cached plan; false if there is no algorithm.
bool matmul(const void* wdata, bool f32, const void* xdata, int64_t n, int64_t m, int64_t k,
            float* y, float beta, cudaStream_t stream) {
  DeviceState& ds = device_state();
  const PlanKey key{current_device(), m,           n, k, f32, alignment(wdata),
                    alignment(xdata), alignment(y)};
  const Plan& p = plan_for(key, ds.lt);
  if (!p.ok) return false;
  void* ws = p.workspace > 0 ? blas::pool_alloc(p.workspace, stream) : nullptr;
  const float alpha = 1.f;
  M3_CUBLAS_CHECK(cublasLtMatmul(ds.lt, p.desc, &alpha, wdata, p.a, xdata, p.b, &beta, y, p.c, y,
                                 p.c, &p.algo, ws, p.workspace, stream));
  if (ws) blas::pool_free(ws, stream);
  return true;
}

// Plans of gemm_strided_batched, keyed by every field of the call and the alignments.
struct BatchedKey {
  int device;
  blas::BatchedGemm g;
  uint32_t align_a, align_b, align_c;
  auto tie() const {
    return std::tie(device, g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.stride_a,
                    g.stride_b, g.stride_c, g.batch, g.bf16, align_a, align_b, align_c);
  }
  bool operator<(const BatchedKey& o) const { return tie() < o.tie(); }
};
std::map<BatchedKey, Plan> g_batched_plans;

// The alignment every batch member keeps: that of the base and of the stride in bytes.
uint32_t batched_alignment(const void* p, int64_t stride_elems, size_t elem) {
  const uint32_t a = alignment(p);
  const uint32_t s = alignment(reinterpret_cast<const void*>(static_cast<uintptr_t>(stride_elems) *
                                                             static_cast<uintptr_t>(elem)));
  return stride_elems == 0 ? a : std::min(a, s);
}

const Plan& batched_plan_for(const BatchedKey& key, cublasLtHandle_t lt) {
  std::lock_guard<std::mutex> lock(g_plan_mutex);
  auto it = g_batched_plans.find(key);
  if (it != g_batched_plans.end()) return it->second;
  const blas::BatchedGemm& g = key.g;
  Plan p;
  const cudaDataType_t in_t = g.bf16 ? CUDA_R_16BF : CUDA_R_32F;
  M3_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  // Stored shapes: A is [m, k] or (transposed) [k, m], B [k, n] or [n, k], column-major.
  M3_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.a, in_t, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda));
  M3_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.b, in_t, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, g.m, g.n, g.ldc));
  const int32_t batch = static_cast<int32_t>(g.batch);
  const cublasLtMatrixLayout_t layouts[3] = {p.a, p.b, p.c};
  const int64_t strides[3] = {g.stride_a, g.stride_b, g.stride_c};
  for (int i = 0; i < 3; ++i) {
    M3_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &batch, sizeof batch));
    M3_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i], sizeof strides[i]));
  }
  pick_algo(p, lt, key.align_a, key.align_b, key.align_c);
  return g_batched_plans.emplace(key, p).first->second;
}

// x [count] f32 -> `terms` bf16 arrays, `stride` apart: t0 = bf16(x), t1 = bf16(x - t0), ...
// (each difference is exact in fp32, so x = Σ terms up to the last one's rounding).
__global__ void split_bf16_kernel(const float* __restrict__ x, int64_t count, int64_t stride,
                                  int terms, __nv_bfloat16* __restrict__ out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    float r = x[i];
    for (int t = 0; t < terms; ++t) {
      const __nv_bfloat16 b = __float2bfloat16_rn(r);
      out[t * stride + i] = b;
      r -= __bfloat162float(b);
    }
  }
}

// y[i] = Σ_t yt[t * count + i], in term order (hi first, as the beta = 1 path adds them).
__global__ void sum_terms_kernel(const float* __restrict__ yt, int terms, int64_t count,
                                 float* __restrict__ y) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    float s = yt[i];
    for (int t = 1; t < terms; ++t) s += yt[t * count + i];
    y[i] = s;
  }
}

int read_exact_terms() {
  const char* env = std::getenv("M3_GEMM_EXACT_TERMS");
  if (env == nullptr) return 3;
  const int t = std::atoi(env);
  M3_CHECK(t >= 1 && t <= 3, "M3_GEMM_EXACT_TERMS=%s: use 1, 2 or 3", env);
  return t;
}

}  // namespace

void set_gemm_precision(GemmPrecision p) {
  g_precision.store(p);
}
GemmPrecision gemm_precision() {
  return g_precision.load();
}

namespace blas {

int exact_split_terms() {
  static const int terms = read_exact_terms();
  return terms;
}

int num_sms() {
  static std::atomic<int> cache[kMaxDevices];
  const int d = current_device();
  int v = cache[d].load();
  if (v == 0) {
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d));
    cache[d].store(v);
  }
  return v;
}

void* pool_alloc(size_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  if (bytes == 0) return p;
  M3_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, device_state().pool, stream));
  return p;
}

void pool_free(void* p, cudaStream_t stream) {
  if (p != nullptr) M3_CUDA_CHECK(cudaFreeAsync(p, stream));
}

bool gemm_strided_batched(const BatchedGemm& g, const void* a, const void* b, float* c,
                          cudaStream_t stream) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return true;
  M3_CHECK(g.k > 0 && g.batch <= INT32_MAX, "gemm_strided_batched: k %lld, batch %lld",
           static_cast<long long>(g.k), static_cast<long long>(g.batch));
  DeviceState& ds = device_state();
  const size_t el = g.bf16 ? 2 : 4;
  const BatchedKey key{current_device(), g, batched_alignment(a, g.stride_a, el),
                       batched_alignment(b, g.stride_b, el), batched_alignment(c, g.stride_c, 4)};
  const Plan& p = batched_plan_for(key, ds.lt);
  if (!p.ok) return false;
  void* ws = p.workspace > 0 ? pool_alloc(p.workspace, stream) : nullptr;
  const float alpha = 1.f, beta = 0.f;
  M3_CUBLAS_CHECK(cublasLtMatmul(ds.lt, p.desc, &alpha, a, p.a, b, p.b, &beta, c, p.c, c, p.c,
                                 &p.algo, ws, p.workspace, stream));
  if (ws) pool_free(ws, stream);
  return true;
}

namespace {

const Plan& fp8_plan_for(const PlanKey& key, cublasLtHandle_t lt) {
  // g_plan_mutex is held by the caller.
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return it->second;
  Plan p;
  M3_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // FP8 needs the "TN" layout
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  M3_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (key.fp8_mode == 0) {
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    // An unsupported attribute (an older cuBLASLt) leaves the plan without an algorithm.
    if (cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer,
                                       sizeof outer) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer,
                                       sizeof outer) != CUBLAS_STATUS_SUCCESS)
      return g_plans.emplace(key, p).first->second;
  }
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, key.k, key.m, key.k));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, key.k, key.n, key.k));
  M3_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, key.fp8_mode == 2 ? CUDA_R_16BF : CUDA_R_32F,
                                             key.m, key.n, key.m));
  if (key.fp8_mode == 0) {
    // The heuristic needs the scale pointers' presence, not their values: any aligned address.
    static const float* const kAnyScale = reinterpret_cast<const float*>(uintptr_t{256});
    M3_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                   &kAnyScale, sizeof kAnyScale));
    M3_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                   &kAnyScale, sizeof kAnyScale));
  }
  pick_algo(p, lt, key.align_a, key.align_b, key.align_c);
  return g_plans.emplace(key, p).first->second;
}

}  // namespace

bool gemm_fp8(const void* qx, const float* sx, int64_t n, const cpu::MatRef& w, float* y,
              cudaStream_t stream) {
  M3_CHECK(w.quant == WeightQuant::kFp8Channel, "gemm_fp8: %s weights", weight_quant_name(w.quant));
  if (n == 0 || w.rows == 0) return true;
  if (w.cols == 0 || w.cols % 16 != 0) return false;
  DeviceState& ds = device_state();
  const int dev = current_device();
  const float* sw = static_cast<const float*>(w.scale);
  for (int mode = 0; mode < 3; ++mode) {
    std::unique_lock<std::mutex> lock(g_plan_mutex);
    const PlanKey key{dev,
                      w.rows,
                      n,
                      w.cols,
                      false,
                      alignment(w.data),
                      alignment(qx),
                      mode == 2 ? 256u : alignment(y),
                      mode};
    const Plan& p = fp8_plan_for(key, ds.lt);
    if (!p.ok) continue;
    if (mode == 0) {
      // The plan's descriptor is shared: its scale pointers are set and read under the lock.
      M3_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                     &sw, sizeof sw));
      M3_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                     &sx, sizeof sx));
    }
    void* ws = p.workspace > 0 ? pool_alloc(p.workspace, stream) : nullptr;
    void* out = mode == 2 ? pool_alloc(static_cast<size_t>(n * w.rows) * 2, stream) : y;
    const float alpha = 1.f, beta = 0.f;
    M3_CUBLAS_CHECK(cublasLtMatmul(ds.lt, p.desc, &alpha, w.data, p.a, qx, p.b, &beta, out, p.c,
                                   out, p.c, &p.algo, ws, p.workspace, stream));
    lock.unlock();
    if (ws) pool_free(ws, stream);
    if (mode > 0)
      scale_outer(y, mode == 2 ? static_cast<const uint16_t*>(out) : nullptr, n, w.rows, sx, sw,
                  stream);
    if (mode == 2) pool_free(out, stream);
    return true;
  }
  return false;
}

bool gemm_bf16(const void* xb, int64_t n, const cpu::MatRef& w, float* y, float beta,
               cudaStream_t stream) {
  M3_CHECK(w.dtype == DType::kBF16);
  return matmul(w.data, false, xb, n, w.rows, w.cols, y, beta, stream);
}

bool gemm(const float* x, int64_t n, const cpu::MatRef& w, float* y, cudaStream_t stream) {
  if (n == 0 || w.rows == 0) return true;
  if (w.cols == 0) return false;  // y = 0: the SIMT kernel writes it
  if (w.dtype == DType::kF32) return matmul(w.data, true, x, n, w.rows, w.cols, y, 0.f, stream);
  M3_CHECK(w.dtype == DType::kBF16, "blas::gemm: weight dtype %s", dtype_name(w.dtype));
  const int terms = gemm_precision() == GemmPrecision::kExact ? exact_split_terms() : 1;
  const int64_t count = n * w.cols;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 65536);
  if (terms > 1 && n <= kConcatMaxTokens) {
    // Few tokens: the GEMM is bound by reading W, so read it once for all terms: the terms
    // stacked as terms * n rows of one B matrix, then y = Σ_t y_t in term order.
    auto* xb =
        static_cast<__nv_bfloat16*>(pool_alloc(count * terms * sizeof(__nv_bfloat16), stream));
    auto* yt = static_cast<float*>(pool_alloc(terms * n * w.rows * sizeof(float), stream));
    split_bf16_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(x, count, count, terms,
                                                                             xb);
    M3_CUDA_CHECK_LAUNCH("split_bf16_kernel");
    const bool ok = matmul(w.data, false, xb, terms * n, w.rows, w.cols, yt, 0.f, stream);
    if (ok) {
      const int64_t out = n * w.rows;
      sum_terms_kernel<<<static_cast<unsigned>(std::min<int64_t>((out + 255) / 256, 65536)), 256, 0,
                         stream>>>(yt, terms, out, y);
      M3_CUDA_CHECK_LAUNCH("sum_terms_kernel");
    }
    pool_free(yt, stream);
    pool_free(xb, stream);
    return ok;
  }
  // Many tokens: one GEMM per term, accumulated through beta = 1 (no extra output pass). Each
  // term starts 256-byte aligned, so all terms share term 0's plan and alignment.
  const int64_t stride = (count + 127) / 128 * 128;
  auto* xb =
      static_cast<__nv_bfloat16*>(pool_alloc(stride * terms * sizeof(__nv_bfloat16), stream));
  split_bf16_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(x, count, stride, terms,
                                                                           xb);
  M3_CUDA_CHECK_LAUNCH("split_bf16_kernel");
  // Term 0 has no algorithm only if none exists for this shape; then nothing else runs and the
  // caller's fallback overwrites y. Later terms use the same plan, so they cannot fail.
  bool ok = true;
  for (int t = 0; t < terms && ok; ++t)
    ok = matmul(w.data, false, xb + t * stride, n, w.rows, w.cols, y, t == 0 ? 0.f : 1.f, stream);
  pool_free(xb, stream);
  return ok;
}

}  // namespace blas
}  // namespace m3::kernels::cuda
