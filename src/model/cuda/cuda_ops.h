// CudaOps: the Ops of M3Forward (model/m3_forward.h) on one GPU: each member enqueues the
// kernels/cuda op of the same name on the model's stream; scratch buffers are device buffers
// grown on demand; the collectives of a shard run on the communicator's stream, forked from and
// joined to the model's stream by events (legal inside a CUDA graph capture). M3ModelCuda owns
// one and captures the graphs of run_layers through it.
// Invariants: graph-safe — nothing allocates or synchronises while the buffers are large enough
// (an eager run of the same shape sizes them first); a buffer that grows bumps generation(), so
// graphs captured against the old addresses are re-captured; syncs_host() tells that a call took
// a path that reads device data on the host (never captured).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "dist/communicator.h"
#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/fused.h"
#include "kernels/cuda/ops.h"
#include "model/m3_forward.h"

namespace m3::model {

class CudaOps {
 public:
  using MatRef = kernels::MatRef;
  using VecRef = kernels::VecRef;
  using KvPages = kernels::KvPages;
  using TokenLayout = kernels::TokenLayout;

  explicit CudaOps(cudaStream_t stream) : s_(stream) {}
  ~CudaOps();
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  // A shard's communicator and the stream it enqueues on (dist::NcclCommunicator::stream()).
  void attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream);
  // Benchmarks only: the collectives become no-ops (wrong results; bench/bench_tp times a step
  // without its communication).
  void set_skip_collectives(bool on) { skip_collectives_ = on; }

  cudaStream_t stream() const { return s_; }
  uint64_t generation() const { return generation_; }
  bool syncs_host() const { return syncs_host_; }
  // The host KV tier (runtime/cuda/host_kv_tier_cuda.h): per layer, an event the stream waits
  // for before the layer first touches its KV pages (M3Forward::run_layers calls
  // wait_kv_layer(l) before attn_prep). Empty: no wait. Never set while capturing a graph.
  void set_kv_layer_waits(std::vector<cudaEvent_t> events) { kv_waits_ = std::move(events); }
  void wait_kv_layer(int64_t layer) {
    if (layer < static_cast<int64_t>(kv_waits_.size()))
      M3_CUDA_CHECK(cudaStreamWaitEvent(s_, kv_waits_[static_cast<size_t>(layer)], 0));
  }
  void clear_syncs_host() { syncs_host_ = false; }

  float* f32(Buf b, int64_t n) { return ensure(f32_[static_cast<size_t>(b)], n); }
  int32_t* i32(IBuf b, int64_t n) { return ensure(i32_[static_cast<size_t>(b)], n); }
  // Device buffers outside the forward's names (the step's arrays, sampling), grown the same way.
  template <class T>
  T* ensure(gpu::DeviceBuffer<T>& b, int64_t n);

  // Quantized weights (w.quantized(): M3ModelCuda keeps them as stored) go to linear_quant:
  // the quantized GEMV up to kernels::cuda::kQuantGemvMaxTokens tokens, else dequantise into
  // quant_ws_ + the bf16 GEMM.
  void linear(const float* x, int64_t n, const MatRef& w, float* y) {
    if (w.quantized()) {
      linear_quant(x, n, w, y);
      return;
    }
    kernels::cuda::linear(x, n, w, y, s_);
  }
  // Sizes the dequantisation workspace once for the largest quantized matrix (M3ModelCuda after
  // the upload), so no step grows it.
  void reserve_quant_workspace(size_t bytes) {
    if (bytes > 0) ensure(quant_ws_, static_cast<int64_t>(bytes));
  }
  size_t quant_workspace_bytes() const { return quant_ws_.size(); }
  void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out) {
    kernels::cuda::embedding(table, ids, n, out, s_);
  }
  void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                             int64_t hidden, const int32_t* ids, int64_t n, float* out) {
    kernels::cuda::embedding_vocab_slice(table, vocab_begin, vocab_size, hidden, ids, n, out, s_);
  }
  void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                     float* out) {
    kernels::cuda::rmsnorm_gemma(x, rows, dim, w, eps, out, s_);
  }
  void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                         float eps, float* out) {
    kernels::cuda::add_rmsnorm_gemma(x, y, rows, dim, w, eps, out, s_);
  }
  void add_inplace(float* x, const float* y, int64_t n) { kernels::cuda::add_inplace(x, y, n, s_); }
  void attn_prep(const kernels::AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout) {
    kernels::cuda::attn_prep(a, cache, layout, s_);
  }
  // The MSA scores of every token in one launch pair when they fit a capped workspace, else
  // token chunk by chunk (kernels/cuda/ops.h).
  void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                         const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                         int64_t local_blocks, int64_t max_kv_len, int32_t* out);
  void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                       const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                       float scale, int64_t max_kv_len, float* out);
  void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                  float limit, float beta, float* out) {
    kernels::cuda::swiglu_oai(gate, up, n, inter, alpha, limit, beta, out, s_);
  }
  void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                       float beta, float* out) {
    kernels::cuda::swiglu_oai_rows(gate_up, n, inter, alpha, limit, beta, out, s_);
  }
  void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias,
                   int64_t k, float scale, int32_t* ids, float* weights) {
    kernels::cuda::router_topk(logits, n, num_experts, bias, k, scale, ids, weights, s_);
  }
  // The router GEMV + top-k in one launch for a decode step's few rows (kernels/cuda/ops.h).
  bool router_fuses(int64_t n, const MatRef& router, int64_t k, const float* x) const {
    return kernels::cuda::router_fused_supported(n, router, k, x);
  }
  void router_fused(const float* x, int64_t n, const MatRef& router, const float* bias, int64_t k,
                    float scale, float* logits, int32_t* ids, float* weights) {
    kernels::cuda::router_fused(x, n, router, bias, k, scale, logits, ids, weights,
                                router_counter(), s_);
  }
  // The shared expert inside the routed experts' grouped GEMVs (decode; kernels/cuda/ops.h).
  bool moe_fuses_shared(int64_t n, const float* x, const kernels::MoeExpertWeights& w,
                        const kernels::MoeSharedExpert& s) const {
    return kernels::cuda::moe_fuses_shared(n, x, w, s);
  }
  void moe_experts_shared(const float* x, int64_t n, const int32_t* ids, const float* weights,
                          int64_t k, const kernels::MoeExpertWeights& w,
                          const kernels::MoeSharedExpert& s, const kernels::SwigluParams& act,
                          float* out);
  void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count) {
    kernels::cuda::moe_localize_ids(ids, n, first, count, s_);
  }
  // The grouped GEMV / GEMM paths need no host sync; the exact precision's per-expert path
  // (above kernels::cuda::kMoeGemvMaxTokens rows) reads its expert counts on the host
  // (syncs_host() becomes true).
  void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                   const kernels::MoeExpertWeights& w, const kernels::SwigluParams& act,
                   const float* shared, float* out);
  void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst) {
    kernels::cuda::gather_rows(src, rows, n, cols, dst, s_);
  }
  void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                    int64_t width, int64_t rows) {
    kernels::cuda::copy_rows_2d(dst, dst_stride, src, src_stride, width, rows, s_);
  }
  void fill_zero(float* x, int64_t n) { kernels::cuda::fill_zero(x, n, s_); }
  // x[rows[i], :] = values[i, :] (image embeddings over their placeholder rows; device arrays).
  void scatter_rows(float* x, const int32_t* rows, int64_t n, int64_t cols, const float* values) {
    kernels::cuda::scatter_rows(x, rows, n, cols, values, s_);
  }
  void copy(float* dst, const float* src, int64_t n) { kernels::cuda::copy(dst, src, n, s_); }
  // Device to host, then a stream sync (eager steps only: the MSA capture).
  void download(int32_t* host, const int32_t* src, int64_t n);
  // Host to device on the stream (pageable source: returns once the source is staged, so the
  // host array may be reused at once); marks the step syncs_host() (never captured).
  void upload(int32_t* dst, const int32_t* host, int64_t n);

  void all_reduce_sum(float* data, int64_t n);
  void all_gather(const float* send, int64_t n, float* recv);
  void all_gather(const int32_t* send, int64_t n, int32_t* recv);
  void reduce_scatter_sum(const float* send, int64_t n, float* recv);
  // Counts are host arrays (dist::Communicator::all_to_all_v; NCCL grouped send / recv).
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts);
  void all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                    const int64_t* recv_counts);

 private:
  // The communicator's stream waits for the model's work so far, runs `collective`, and the
  // model's stream waits for it.
  template <class F>
  void on_comm(F&& collective);
  void linear_quant(const float* x, int64_t n, const MatRef& w, float* y);
  // router_fused's completion counter: zeroed once when allocated (an eager step, before any
  // capture), left at zero by every launch.
  unsigned* router_counter() {
    if (router_done_.size() == 0) {
      ensure(router_done_, 1);
      M3_CUDA_CHECK(cudaMemsetAsync(router_done_.data(), 0, sizeof(unsigned), s_));
    }
    return router_done_.data();
  }

  cudaStream_t s_;
  dist::Communicator* comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
  bool skip_collectives_ = false;
  uint64_t generation_ = 1;  // bumped whenever a buffer is reallocated
  bool syncs_host_ = false;
  std::vector<cudaEvent_t> kv_waits_;
  std::array<gpu::DeviceBuffer<float>, static_cast<size_t>(Buf::kCount)> f32_;
  std::array<gpu::DeviceBuffer<int32_t>, static_cast<size_t>(IBuf::kCount)> i32_;
  gpu::DeviceBuffer<uint8_t> attn_ws_;       // attention / MSA workspace
  gpu::DeviceBuffer<uint8_t> moe_ws_;        // moe_experts' workspace
  gpu::DeviceBuffer<uint8_t> quant_ws_;      // linear_quant's dequantised bf16 matrix
  gpu::DeviceBuffer<unsigned> router_done_;  // router_fused's counter
};

template <class T>
T* CudaOps::ensure(gpu::DeviceBuffer<T>& b, int64_t n) {
  const size_t want_n = static_cast<size_t>(n);
  if (b.size() < want_n) {
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));  // kernels may still read the old buffer
    // Small buffers (step arrays, decode activations) grow geometrically, so a growing block
    // table does not invalidate the captured graphs every step; large ones exactly.
    const size_t want =
        want_n * sizeof(T) < (size_t{64} << 20) ? std::max(want_n, 2 * b.size()) : want_n;
    b = gpu::DeviceBuffer<T>(want);
    ++generation_;  // captured graphs point at the old buffer
  }
  return b.data();
}

}  // namespace m3::model
