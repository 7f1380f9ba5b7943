// M3ModelCuda: the MiniMax-M3 text model on one GPU, computing what M3Model::forward computes,
// op by op, with the CUDA ops of kernels/cuda. Loading reuses M3Model::load (config, checkpoint,
// weight checks) on the host, then uploads every weight once, bf16/f32 as stored; synthetic()
// instead generates M3-shaped weights on the device (no host weights at all). The model keeps its
// own M3Config. Called by `m3serve generate|serve --device cuda`, SequenceRunnerCuda,
// model/cuda/cuda_backend.cpp and tests/model_cuda.
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
  // Weights generated on the device from `seed` (model/cuda/synthetic_weights.h) for `cfg`
  // (model/synthetic_model.h's synthetic_m3_config): uniform with std 1/sqrt(fan_in) for the
  // matrices, std 1 for the embedding, near-zero Gemma norm weights ((1 + w) ~ 1) and a small
  // router bias, so activations stay O(1) through the layers. MoE expert weights of a layer are
  // one allocation per projection (experts[e].w1.data == experts[0].w1.data + e*inter*hidden).
  // Errors: no GPU, weights that do not fit in the free memory (names the numbers and layers=).
  static Result<std::unique_ptr<M3ModelCuda>> synthetic(const M3Config& cfg, uint64_t seed,
                                                        int device = 0);

  M3ModelCuda(const M3ModelCuda&) = delete;
  M3ModelCuda& operator=(const M3ModelCuda&) = delete;

  const M3Config& config() const { return cfg_; }
  // The host model the weights came from (same numbers on the CPU path); null for synthetic().
  const M3Model* host() const { return host_.get(); }
  Status validate_prompt(std::span<const int32_t> ids) const {
    return validate_prompt_ids(cfg_, ids);
  }
  size_t weight_bytes() const { return weight_bytes_; }
  // The device views of every weight (device pointers), e.g. for checksums in tests.
  const M3Weights& device_weights() const { return dev_; }

  void forward(const ForwardBatch& batch, KvCacheCuda& cache, ForwardResult* out,
               bool capture_msa = false);

 private:
  M3ModelCuda(M3Config cfg, std::unique_ptr<M3Model> host);
  void upload_weights();
  void generate_weights(uint64_t seed);  // synthetic(): fills dev_ on the device
  void* alloc_weight(size_t bytes);      // one weight allocation, counted in weight_bytes_
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

  M3Config cfg_;
  std::unique_ptr<M3Model> host_;  // null for synthetic models
  M3Weights dev_;  // the same views as host_->weights(), pointing to device memory
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  size_t weight_bytes_ = 0;
  gpu::Stream stream_;

  struct Scratch {
    gpu::DeviceBuffer<int32_t> tokens, positions, seq_ids, bt_offsets, block_table, logit_rows;
    gpu::DeviceBuffer<float> x, a, q, k, v, attn, y, iq, ik, hs, logits;
    gpu::DeviceBuffer<int32_t> sel;
    gpu::DeviceBuffer<uint8_t> attn_ws;  // attention / MSA workspace (kernels/cuda/ops.h)
    gpu::DeviceBuffer<float> g, u;                         // MLP intermediates
    gpu::DeviceBuffer<float> router_logits, route_w;       // MoE router output
    gpu::DeviceBuffer<int32_t> route_ids;
    gpu::DeviceBuffer<uint8_t> moe;                        // moe_experts' workspace
  } ws_;
  // Device sampling: the step's SampleRow list and the sampled ids.
  gpu::DeviceBuffer<kernels::cpu::SampleRow> smp_rows_;
  gpu::DeviceBuffer<int32_t> smp_ids_;
};

}  // namespace m3::model
