// FlashPrefill (attn_flash.h): our step plan and the gather / scatter around FlashInfer's Hopper
// paged prefill kernel. Built with FlashInfer's headers when M3_FLASHINFER is defined (CMake
// finds them: M3_FLASHINFER_DIR); without them the class plans nothing and the attention takes
// the query-tiled kernel.
#include "kernels/cuda/attn_flash.h"

#include <algorithm>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"

#ifdef M3_FLASHINFER
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/cutlass_utils.cuh>
#endif

namespace m3::kernels::cuda {

#ifdef M3_FLASHINFER

namespace {

using FiBf16 = cutlass::bfloat16_t;

// The parameter block FlashInfer's paged SM90 kernel reads (the fields its dispatch uses).
struct FiPagedParams {
  using DTypeQ = FiBf16;
  using DTypeKV = FiBf16;
  using DTypeO = FiBf16;
  using IdType = int32_t;
  DTypeQ* q_ptr;
  DTypeKV* k_ptr;
  DTypeKV* v_ptr;
  DTypeO* o_ptr;
  float* lse_ptr;
  IdType* qo_tile_indices;
  IdType* qo_indptr;
  IdType* kv_indptr;
  IdType* kv_indices;
  IdType* qo_lens;
  IdType* kv_lens;
  IdType* head_indices;
  IdType* work_indptr;
  IdType* batch_indices;
  struct AdditionalParams {
    float sm_scale;
  } additional_params;
  int64_t q_stride_n, k_stride_n, v_stride_n, o_stride_n;
  int64_t q_stride_h, k_stride_h, v_stride_h, o_stride_h;
  int64_t nnz_qo;
  int64_t k_page_stride, v_page_stride;
  int head_dim, num_qo_heads, num_kv_heads, group_size, page_size, window_left;
  bool causal;
};

constexpr int kGatherThreads = 256;

// q16[r, h, :] = bf16(q[rows[r], h, :]) for the num_heads * 128 values of each row.
__global__ void gather_q_bf16(const float* __restrict__ q, const int32_t* __restrict__ rows,
                              int64_t row_elems, uint16_t* __restrict__ q16) {
  const int64_t r = blockIdx.x;
  const float4* src = reinterpret_cast<const float4*>(q + rows[r] * row_elems);
  uint2* dst = reinterpret_cast<uint2*>(q16 + r * row_elems);
  for (int64_t i = threadIdx.x; i < row_elems / 4; i += blockDim.x) {
    const float4 v = src[i];
    dst[i] = make_uint2(detail::pack_bf16x2(v.x, v.y), detail::pack_bf16x2(v.z, v.w));
  }
}

// out[rows[r], h, :] = f32(o16[r, h, :]).
__global__ void scatter_o_f32(const uint16_t* __restrict__ o16, const int32_t* __restrict__ rows,
                              int64_t row_elems, float* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const uint2* src = reinterpret_cast<const uint2*>(o16 + r * row_elems);
  float4* dst = reinterpret_cast<float4*>(out + rows[r] * row_elems);
  for (int64_t i = threadIdx.x; i < row_elems / 4; i += blockDim.x) {
    const uint2 v = src[i];
    dst[i] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                         __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
  }
}

template <class T>
void grow(T*& p, size_t& cap, size_t n) {
  if (n <= cap) return;
  if (p != nullptr) M3_CUDA_CHECK(cudaFree(p));
  cap = std::max(n, cap * 2);
  M3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), cap * sizeof(T)));
}

}  // namespace

struct FlashPrefill::Impl {
  std::vector<FlashPrefill::Run> runs;
  bool planned = false;
  int64_t heads = 0, kv_heads = 0, page_size = 0, rows = 0;
  flashinfer::PrefillPlanSM90Info info;
  // FlashInfer's workspaces: device int plan, its pinned staging, a float one (unused by the
  // SM90 plan but passed).
  int32_t* int_ws = nullptr;
  size_t int_cap = 0;
  void* pinned = nullptr;
  size_t pinned_cap = 0;
  float* float_ws = nullptr;
  size_t float_cap = 0;
  // Batch row of each compact row, and the bf16 q / output of the run rows.
  int32_t* rows_dev = nullptr;
  size_t rows_cap = 0;
  int32_t* rows_pinned = nullptr;
  size_t rows_pinned_cap = 0;
  uint16_t* q16 = nullptr;
  size_t q16_cap = 0;
  uint16_t* o16 = nullptr;
  size_t o16_cap = 0;
  // Recorded after each copy out of a pinned buffer: the next step (scheduled while this one
  // runs, under async scheduling) waits for it before writing the buffer again.
  cudaEvent_t rows_copied = nullptr, plan_copied = nullptr;

  static void before_reuse(cudaEvent_t& ev) {
    if (ev == nullptr) {
      M3_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      return;
    }
    M3_CUDA_CHECK(cudaEventSynchronize(ev));
  }

  ~Impl() {
    if (rows_copied != nullptr) cudaEventDestroy(rows_copied);
    if (plan_copied != nullptr) cudaEventDestroy(plan_copied);
    cudaFree(int_ws);
    cudaFreeHost(pinned);
    cudaFree(float_ws);
    cudaFree(rows_dev);
    cudaFreeHost(rows_pinned);
    cudaFree(q16);
    cudaFree(o16);
  }
};

bool flash_prefill_built() {
  return true;
}

FlashPrefill::FlashPrefill() : impl_(std::make_unique<Impl>()) {}
FlashPrefill::~FlashPrefill() = default;

bool FlashPrefill::has_runs() const {
  return !impl_->runs.empty();
}

bool FlashPrefill::serves(const KvPages& c) const {
  return !impl_->runs.empty() && c.kv_dtype == KvDtype::kBf16 && c.head_dim == 128;
}

void FlashPrefill::set_runs(const std::vector<Run>& runs, cudaStream_t stream) {
  Impl& m = *impl_;
  m.runs = runs;
  m.planned = false;
  if (runs.empty()) return;
  int64_t rows = 0;
  for (const Run& r : runs) rows += r.num_tokens;
  // The batch row of every compact row.
  Impl::before_reuse(m.rows_copied);
  if (m.rows_pinned_cap < static_cast<size_t>(rows)) {
    if (m.rows_pinned != nullptr) M3_CUDA_CHECK(cudaFreeHost(m.rows_pinned));
    m.rows_pinned_cap = std::max(static_cast<size_t>(rows), 2 * m.rows_pinned_cap);
    M3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&m.rows_pinned),
                                 m.rows_pinned_cap * sizeof(int32_t)));
  }
  int64_t at = 0;
  for (const Run& r : runs)
    for (int32_t i = 0; i < r.num_tokens; ++i) m.rows_pinned[at++] = r.first_token + i;
  grow(m.rows_dev, m.rows_cap, static_cast<size_t>(rows));
  M3_CUDA_CHECK(cudaMemcpyAsync(m.rows_dev, m.rows_pinned, rows * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream));
  M3_CUDA_CHECK(cudaEventRecord(m.rows_copied, stream));
  m.rows = rows;
}

namespace {

// FlashInfer's SM90 plan of m.runs for this geometry into m.int_ws (copied on `stream`).
void plan_runs(FlashPrefill::Impl& m, int64_t num_qo_heads, int64_t num_kv_heads, int64_t page_size,
               cudaStream_t stream) {
  M3_CHECK(num_kv_heads > 0 && num_qo_heads % num_kv_heads == 0);
  const int64_t batch = static_cast<int64_t>(m.runs.size());
  std::vector<int32_t> qo_indptr(batch + 1, 0), kv_indptr(batch), kv_len(batch);
  for (int64_t i = 0; i < batch; ++i) {
    qo_indptr[i + 1] = qo_indptr[i] + m.runs[i].num_tokens;
    kv_indptr[i] = m.runs[i].page_offset;
    kv_len[i] = m.runs[i].kv_len;
  }
  const int64_t rows = qo_indptr[batch];
  int num_sms = 0;
  {
    int dev = 0;
    M3_CUDA_CHECK(cudaGetDevice(&dev));
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  }
  // The plan's int arrays: 8 per work item, at most (ceil(rows / 128) + batch) work items per
  // head, and one per CTA; 16-byte aligned sections.
  const size_t works =
      static_cast<size_t>((rows + 127) / 128 + batch) * static_cast<size_t>(num_qo_heads);
  const size_t int_bytes = (8 * works + num_sms + 1) * sizeof(int32_t) + 16 * 16;
  grow(m.int_ws, m.int_cap, int_bytes / sizeof(int32_t) + 1);
  FlashPrefill::Impl::before_reuse(m.plan_copied);
  if (m.pinned_cap < int_bytes) {
    if (m.pinned != nullptr) M3_CUDA_CHECK(cudaFreeHost(m.pinned));
    m.pinned_cap = std::max(int_bytes, 2 * m.pinned_cap);
    M3_CUDA_CHECK(cudaMallocHost(&m.pinned, m.pinned_cap));
  }
  grow(m.float_ws, m.float_cap, 1024);
  const cudaError_t err = flashinfer::PrefillSM90Plan<int32_t>(
      m.float_ws, m.float_cap * sizeof(float), m.int_ws, m.pinned, m.int_cap * sizeof(int32_t),
      m.info, qo_indptr.data(), kv_indptr.data(), kv_len.data(), static_cast<uint32_t>(rows),
      static_cast<uint32_t>(batch), static_cast<uint32_t>(num_qo_heads),
      static_cast<uint32_t>(num_kv_heads), 128, 128, static_cast<uint32_t>(page_size),
      /*causal=*/true, /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/2, stream);
  M3_CHECK(err == cudaSuccess, "FlashInfer prefill plan: %s", cudaGetErrorString(err));
  M3_CUDA_CHECK(cudaEventRecord(m.plan_copied, stream));
  const size_t elems = static_cast<size_t>(rows * num_qo_heads * 128);
  grow(m.q16, m.q16_cap, elems);
  grow(m.o16, m.o16_cap, elems);
  m.heads = num_qo_heads;
  m.kv_heads = num_kv_heads;
  m.page_size = page_size;
  m.planned = true;
}

}  // namespace

void FlashPrefill::run(const float* q, int64_t num_heads, const KvPages& c, const TokenLayout& L,
                       float scale, float* out, cudaStream_t stream) {
  Impl& m = *impl_;
  M3_CHECK(serves(c), "FlashPrefill::run: no runs, or not a bf16 cache of head_dim 128");
  if (!m.planned || m.heads != num_heads || m.kv_heads != c.num_kv_heads ||
      m.page_size != c.page_size)
    plan_runs(m, num_heads, c.num_kv_heads, c.page_size, stream);
  const int64_t row_elems = num_heads * 128;
  gather_q_bf16<<<static_cast<unsigned>(m.rows), kGatherThreads, 0, stream>>>(q, m.rows_dev,
                                                                              row_elems, m.q16);
  M3_CUDA_CHECK_LAUNCH("gather_q_bf16");
  FiPagedParams p{};
  p.q_ptr = reinterpret_cast<FiBf16*>(m.q16);
  p.k_ptr = static_cast<FiBf16*>(c.k);
  p.v_ptr = static_cast<FiBf16*>(c.v);
  p.o_ptr = reinterpret_cast<FiBf16*>(m.o16);
  p.lse_ptr = nullptr;
  auto at = [&](int64_t off) {
    return reinterpret_cast<int32_t*>(reinterpret_cast<char*>(m.int_ws) + off);
  };
  p.qo_tile_indices = at(m.info.qo_tile_indices_offset);
  p.qo_indptr = at(m.info.qo_indptr_offset);
  p.kv_indptr = at(m.info.kv_indptr_offset);
  p.qo_lens = at(m.info.qo_len_offset);
  p.kv_lens = at(m.info.kv_len_offset);
  p.head_indices = at(m.info.head_indices_offset);
  p.work_indptr = at(m.info.work_indptr_offset);
  p.batch_indices = at(m.info.batch_indices_offset);
  p.kv_indices = const_cast<int32_t*>(L.block_table);
  p.additional_params.sm_scale = scale;
  p.q_stride_n = row_elems;
  p.q_stride_h = 128;
  p.o_stride_n = row_elems;
  p.o_stride_h = 128;
  // Pages [num_pages, page_size, num_kv_heads, 128] (FlashInfer's NHD).
  p.k_stride_n = p.v_stride_n = c.num_kv_heads * 128;
  p.k_stride_h = p.v_stride_h = 128;
  p.k_page_stride = p.v_page_stride = c.page_size * c.num_kv_heads * 128;
  p.nnz_qo = m.rows;
  p.head_dim = 128;
  p.num_qo_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(c.num_kv_heads);
  p.group_size = static_cast<int>(num_heads / c.num_kv_heads);
  p.page_size = static_cast<int>(c.page_size);
  p.window_left = -1;
  p.causal = true;
  cudaError_t err;
  if (m.info.same_schedule_for_all_heads) {
    err = flashinfer::BatchPrefillWithPagedKVCacheDispatched<
        128, 128, flashinfer::MaskMode::kCausal, false, true, flashinfer::StandardAttention>(
        p, false, stream);
  } else {
    err = flashinfer::BatchPrefillWithPagedKVCacheDispatched<
        128, 128, flashinfer::MaskMode::kCausal, false, false, flashinfer::StandardAttention>(
        p, false, stream);
  }
  M3_CHECK(err == cudaSuccess, "FlashInfer prefill: %s", cudaGetErrorString(err));
  scatter_o_f32<<<static_cast<unsigned>(m.rows), kGatherThreads, 0, stream>>>(m.o16, m.rows_dev,
                                                                              row_elems, out);
  M3_CUDA_CHECK_LAUNCH("scatter_o_f32");
}

#else  // !M3_FLASHINFER

struct FlashPrefill::Impl {};

bool flash_prefill_built() {
  return false;
}
FlashPrefill::FlashPrefill() = default;
FlashPrefill::~FlashPrefill() = default;
bool FlashPrefill::has_runs() const {
  return false;
}
bool FlashPrefill::serves(const KvPages&) const {
  return false;
}
void FlashPrefill::set_runs(const std::vector<Run>&, cudaStream_t) {}
void FlashPrefill::run(const float*, int64_t, const KvPages&, const TokenLayout&, float, float*,
                       cudaStream_t) {
  M3_CHECK(false, "FlashPrefill::run: this build has no FlashInfer (M3_FLASHINFER)");
}

#endif

}  // namespace m3::kernels::cuda
