#include "model/cuda/cuda_ops.h"

#include "core/check.h"

namespace m3::model {

namespace ops = kernels::cuda;

namespace {
// MSA scores beyond this are computed token chunk by token chunk (prefill at long contexts).
constexpr size_t kAttnWorkspaceCap = size_t{64} << 20;
}  // namespace

CudaOps::~CudaOps() {
  if (ev_fork_) cudaEventDestroy(ev_fork_);
  if (ev_join_) cudaEventDestroy(ev_join_);
}

void CudaOps::attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream) {
  M3_CHECK(comm != nullptr && comm_stream != nullptr,
           "a sharded GPU model needs a device communicator and its stream");
  comm_ = comm;
  comm_stream_ = comm_stream;
  M3_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
}

void CudaOps::msa_select_blocks(const float* iq, int64_t ni, const KvPages& cache,
                                const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                                int64_t local_blocks, int64_t max_kv_len, int32_t* out) {
  const int64_t T = layout.num_tokens;
  // The scores of all tokens, capped (the op then scores token chunk by chunk), but never less
  // than one token's.
  const size_t bytes = std::min(
      ops::msa_select_workspace_bytes(T, ni, cache, max_kv_len),
      std::max(kAttnWorkspaceCap, ops::msa_select_workspace_bytes(1, ni, cache, max_kv_len)));
  // One workspace serves the selection and the attention after it (consumed op by op).
  const size_t have = std::max(bytes, attn_ws_.size());
  const ops::Workspace ws{ensure(attn_ws_, static_cast<int64_t>(have)), have};
  ops::msa_select_blocks(iq, ni, cache, layout, topk, init_blocks, local_blocks, max_kv_len, ws,
                         out, s_);
}

void CudaOps::attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                              const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                              float scale, int64_t max_kv_len, float* out) {
  const size_t need =
      ops::attention_workspace_bytes(layout.num_tokens, num_heads, cache, max_blocks, max_kv_len);
  const size_t have = std::max(need, attn_ws_.size());
  const ops::Workspace ws{ensure(attn_ws_, static_cast<int64_t>(have)), have};
  ops::attention_paged(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len, ws, out,
                       s_);
}

void CudaOps::moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights,
                          int64_t k, const kernels::MoeExpertWeights& w,
                          const kernels::SwigluParams& act, const float* shared, float* out) {
  uint8_t* work = ensure(moe_ws_, static_cast<int64_t>(ops::moe_workspace_bytes(n, k, w)));
  if (!ops::moe_experts_graph_safe(n, x, w)) syncs_host_ = true;  // never captured
  ops::moe_experts(x, n, ids, weights, k, w, act, shared, out, work, s_);
}

void CudaOps::moe_experts_shared(const float* x, int64_t n, const int32_t* ids,
                                 const float* weights, int64_t k,
                                 const kernels::MoeExpertWeights& w,
                                 const kernels::MoeSharedExpert& s,
                                 const kernels::SwigluParams& act, float* out) {
  uint8_t* work = ensure(moe_ws_, static_cast<int64_t>(ops::moe_workspace_bytes(n, k, w)));
  ops::moe_experts_shared(x, n, ids, weights, k, w, s, act, out, work, s_);
}

void CudaOps::linear_quant(const float* x, int64_t n, const MatRef& w, float* y) {
  const size_t need = ops::linear_quant_workspace_bytes(n, w);
  void* ws = need > 0 ? ensure(quant_ws_, static_cast<int64_t>(need)) : nullptr;
  ops::linear_quant(x, n, w, y, ops::Workspace{ws, need > 0 ? quant_ws_.size() : 0}, s_);
}

void CudaOps::download(int32_t* host, const int32_t* src, int64_t n) {
  if (n <= 0) return;
  M3_CUDA_CHECK(cudaMemcpyAsync(host, src, static_cast<size_t>(n) * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, s_));
  M3_CUDA_CHECK(cudaStreamSynchronize(s_));
}

void CudaOps::upload(int32_t* dst, const int32_t* host, int64_t n) {
  syncs_host_ = true;
  if (n <= 0) return;
  M3_CUDA_CHECK(cudaMemcpyAsync(dst, host, static_cast<size_t>(n) * sizeof(int32_t),
                                cudaMemcpyHostToDevice, s_));
}

template <class F>
void CudaOps::on_comm(F&& collective) {
  if (skip_collectives_) return;
  M3_CHECK(comm_ != nullptr, "a collective on a GPU model that is not sharded");
  M3_CUDA_CHECK(cudaEventRecord(ev_fork_, s_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_fork_, 0));
  collective();
  M3_CUDA_CHECK(cudaEventRecord(ev_join_, comm_stream_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(s_, ev_join_, 0));
}

void CudaOps::all_reduce_sum(float* data, int64_t n) {
  on_comm([&] { comm_->all_reduce_sum(data, n); });
}
void CudaOps::all_gather(const float* send, int64_t n, float* recv) {
  on_comm([&] { comm_->all_gather(send, n, recv); });
}
void CudaOps::all_gather(const int32_t* send, int64_t n, int32_t* recv) {
  on_comm([&] { comm_->all_gather(send, n, recv); });
}
void CudaOps::reduce_scatter_sum(const float* send, int64_t n, float* recv) {
  on_comm([&] { comm_->reduce_scatter_sum(send, n, recv); });
}
void CudaOps::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                           const int64_t* recv_counts) {
  on_comm([&] { comm_->all_to_all_v(send, send_counts, recv, recv_counts); });
}
void CudaOps::all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                           const int64_t* recv_counts) {
  on_comm([&] { comm_->all_to_all_v(send, send_counts, recv, recv_counts); });
}

}  // namespace m3::model
