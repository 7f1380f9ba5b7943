// M3ModelCuda: the MiniMax-M3 text model on one GPU, computing what M3Model::forward computes,
// op by op, with the CUDA ops of kernels/cuda. Loading reuses M3Model::load (config, checkpoint,
// weight checks) on the host, then uploads every weight once, bf16/f32 as stored. Called by
// `m3serve generate --device cuda`, SequenceRunnerCuda and tests/model_cuda.
// Invariant: forward() has M3Model::forward's contract (host batch in, host logits out, K/V/index-K
// of every step token written before any attention reads them) and has finished on the device
// when it returns. Not thread-safe: one forward at a time (it owns its stream and scratch space).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "gpu/device_buffer.h"
#include "model/config.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/m3_model.h"
#include "model/weights.h"

namespace m3::model {

class M3ModelCuda {
 public:
  // Loads on the host, checks the GPU (present, enough free memory) and uploads the weights.
  static Result<std::unique_ptr<M3ModelCuda>> load(const std::string& model_dir,
                                                   const LoadOptions& opts = {}, int device = 0);
  // Uploads an already-loaded host model (tests reuse one for the CPU comparison).
  static Result<std::unique_ptr<M3ModelCuda>> from_host(std::unique_ptr<M3Model> host,
                                                        int device = 0);

  M3ModelCuda(const M3ModelCuda&) = delete;
  M3ModelCuda& operator=(const M3ModelCuda&) = delete;

  const M3Config& config() const { return host_->config(); }
  // The host model the weights came from (same numbers on the CPU path).
  const M3Model& host() const { return *host_; }
  Status validate_prompt(std::span<const int32_t> ids) const {
    return host_->validate_prompt(ids);
  }
  size_t weight_bytes() const { return weight_bytes_; }

  void forward(const ForwardBatch& batch, KvCacheCuda& cache, ForwardResult* out,
               bool capture_msa = false);

 private:
  explicit M3ModelCuda(std::unique_ptr<M3Model> host);
  void upload_weights();
  MatRef upload(const MatRef& m);
  VecRef upload(const VecRef& v);
  VecRef upload_f32(const VecRef& v);  // widened to f32 on the host first (router bias)

  void moe(const LayerWeights& L, const float* x, int64_t n, float* out);
  void dense_mlp(const MatRef& gate, const MatRef& up, const MatRef& down, const float* x,
                 int64_t n, float* out);

  // Scratch: grown on demand (after a stream sync, so no kernel still reads the old memory).
  template <class T>
  T* ensure(gpu::DeviceBuffer<T>& b, size_t n);
  template <class T>
  T* upload_async(gpu::DeviceBuffer<T>& b, const T* host, size_t n);

  std::unique_ptr<M3Model> host_;
  M3Weights dev_;  // the same views as host_->weights(), pointing to device memory
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  size_t weight_bytes_ = 0;
  gpu::Stream stream_;

  struct Scratch {
    gpu::DeviceBuffer<int32_t> tokens, positions, seq_ids, bt_offsets, block_table, logit_rows;
    gpu::DeviceBuffer<float> x, a, q, k, v, attn, y, iq, ik, hs, logits;
    gpu::DeviceBuffer<int32_t> sel;
    gpu::DeviceBuffer<float> g, u;                         // MLP intermediates
    gpu::DeviceBuffer<float> router_logits, route_w, routed, xe, ye, tok_w;
    gpu::DeviceBuffer<int32_t> route_ids, tok_rows;
  } ws_;
  std::vector<int32_t> h_ids_, h_rows_, h_offsets_;  // host side of the MoE dispatch
  std::vector<float> h_w_, h_tok_w_;
};

}  // namespace m3::model
