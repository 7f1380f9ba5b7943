// CpuOps: the Ops of M3Forward (model/m3_forward.h) on the CPU: each member calls the
// kernels/cpu op of the same name (the reference ops and their fused twins) on host memory; the
// scratch buffers are host vectors; the collectives go to the shard's communicator (threads of
// one process, dist/cpu_communicator.h). M3Model owns one per model and uses it from one thread
// at a time (a forward is not reentrant).
// Invariant: a buffer keeps its contents while it does not grow; f32(name, n) with n no larger
// than before returns the same pointer.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "dist/communicator.h"
#include "kernels/cpu/fused.h"
#include "kernels/cpu/ops.h"
#include "model/m3_forward.h"

namespace m3::model {

class CpuOps {
 public:
  using MatRef = kernels::MatRef;
  using VecRef = kernels::VecRef;
  using KvPages = kernels::KvPages;
  using TokenLayout = kernels::TokenLayout;

  explicit CpuOps(dist::Communicator* comm = nullptr) : comm_(comm) {}

  float* f32(Buf b, int64_t n) { return grow(f32_[static_cast<size_t>(b)], n); }
  int32_t* i32(IBuf b, int64_t n) { return grow(i32_[static_cast<size_t>(b)], n); }

  void linear(const float* x, int64_t n, const MatRef& w, float* y) {
    kernels::cpu::linear(x, n, w, y);
  }
  void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out) {
    kernels::cpu::embedding(table, ids, n, out);
  }
  void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                             int64_t hidden, const int32_t* ids, int64_t n, float* out) {
    kernels::cpu::embedding_vocab_slice(table, vocab_begin, vocab_size, hidden, ids, n, out);
  }
  void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                     float* out) {
    kernels::cpu::rmsnorm_gemma(x, rows, dim, w, eps, out);
  }
  void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                         float eps, float* out) {
    kernels::cpu::add_rmsnorm_gemma(x, y, rows, dim, w, eps, out);
  }
  void add_inplace(float* x, const float* y, int64_t n) { kernels::cpu::add_inplace(x, y, n); }
  void attn_prep(const kernels::AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout) {
    kernels::cpu::attn_prep(a, cache, layout);
  }
  void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                         const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                         int64_t local_blocks, int64_t /*max_kv_len*/, int32_t* out) {
    kernels::cpu::msa_select_blocks(iq, num_index_heads, cache, layout, topk, init_blocks,
                                    local_blocks, out);
  }
  void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                       const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                       float scale, int64_t /*max_kv_len*/, float* out) {
    kernels::cpu::attention_paged(q, num_heads, cache, layout, blocks, max_blocks, scale, out);
  }
  void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                  float limit, float beta, float* out) {
    kernels::cpu::swiglu_oai(gate, up, n, inter, alpha, limit, beta, out);
  }
  void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                       float beta, float* out) {
    kernels::cpu::swiglu_oai_rows(gate_up, n, inter, alpha, limit, beta, out);
  }
  void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias,
                   int64_t k, float scale, int32_t* ids, float* weights) {
    kernels::cpu::router_topk(logits, n, num_experts, bias, k, scale, ids, weights);
  }
  void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count) {
    kernels::cpu::moe_localize_ids(ids, n, first, count);
  }
  void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                   const kernels::MoeExpertWeights& w, const kernels::SwigluParams& act,
                   const float* shared, float* out) {
    kernels::cpu::moe_experts(x, n, ids, weights, k, w, act, shared, out);
  }
  void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst) {
    kernels::cpu::gather_rows(src, rows, n, cols, dst);
  }
  void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                    int64_t width, int64_t rows) {
    kernels::cpu::copy_rows_2d(dst, dst_stride, src, src_stride, width, rows);
  }
  void fill_zero(float* x, int64_t n) { kernels::cpu::fill_zero(x, n); }
  // x[rows[i], :] = values[i, :] (image embeddings over their placeholder rows).
  void scatter_rows(float* x, const int32_t* rows, int64_t n, int64_t cols, const float* values) {
    for (int64_t i = 0; i < n; ++i)
      std::copy(values + i * cols, values + (i + 1) * cols, x + rows[i] * cols);
  }
  void copy(float* dst, const float* src, int64_t n) { kernels::cpu::copy(dst, src, n); }
  // Ops memory is host memory: a plain copy.
  void download(int32_t* host, const int32_t* src, int64_t n) { std::copy(src, src + n, host); }
  void upload(int32_t* dst, const int32_t* host, int64_t n) { std::copy(host, host + n, dst); }

  // Collectives of a shard (every rank calls them in the same order).
  void all_reduce_sum(float* data, int64_t n) { group().all_reduce_sum(data, n); }
  template <class T>
  void all_gather(const T* send, int64_t n, T* recv) {
    group().all_gather(send, n, recv);
  }
  void reduce_scatter_sum(const float* send, int64_t n, float* recv) {
    group().reduce_scatter_sum(send, n, recv);
  }
  // Counts are host arrays of world_size() entries (dist::Communicator::all_to_all_v).
  template <class T>
  void all_to_all_v(const T* send, const int64_t* send_counts, T* recv,
                    const int64_t* recv_counts) {
    group().all_to_all_v(send, send_counts, recv, recv_counts);
  }

 private:
  template <class T>
  static T* grow(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    return v.data();
  }
  dist::Communicator& group() {
    M3_CHECK(comm_ != nullptr, "a collective on a model that is not sharded");
    return *comm_;
  }

  dist::Communicator* comm_ = nullptr;
  std::array<std::vector<float>, static_cast<size_t>(Buf::kCount)> f32_;
  std::array<std::vector<int32_t>, static_cast<size_t>(IBuf::kCount)> i32_;
};

}  // namespace m3::model
