// VisionTowerCuda: the MiniMax-M3 vision tower, projector and patch merge on one GPU: the one
// forward of model/vision_forward.h (VisionForward<Ops>, the CPU tower's) over VisionCudaOps,
// each member the kernels/cuda op of the same name on the owner's stream: linear through
// kernels::cuda::linear (cuBLASLt bf16 tensor cores under GemmPrecision::kBf16, the split-exact
// path under kExact), LayerNorm / GELU / rotary / segment attention from kernels/cuda/vision.h.
// The weights are a device copy of the CPU tower's (upload) or generated on the device
// (synthetic: M3's real shapes for the bench and `--model synthetic:...,vision=1`).
// Called by M3ModelCuda::encode_images (the single-GPU backend's image input), the tower tests
// and bench/bench_vision.cpp. Invariant: encode() is not reentrant (it owns its scratch) and has
// finished on the device when it returns; the weights never change after construction.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/device_buffer.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/vision_tower.h"

namespace m3::model {

enum class VBuf;
template <class Ops>
class VisionForward;

// The tower's ops on one GPU (the members of VisionCpuOps, model/vision_tower.cpp): device
// buffers grown on demand; copy() also takes host sources (the processor's patch rows).
class VisionCudaOps {
 public:
  explicit VisionCudaOps(cudaStream_t s) : s_(s) {}
  float* f32(VBuf b, int64_t n);
  const float* upload(VBuf b, const std::vector<float>& host);
  void download(std::vector<float>& host, const float* src, int64_t n);
  void copy(float* dst, const float* src, int64_t n);
  void linear(const float* x, int64_t n, const kernels::MatRef& w, float* y);
  void linear_bias(const float* x, int64_t n, const kernels::MatRef& w, const kernels::VecRef& b,
                   float* y);
  void layer_norm(const float* x, int64_t rows, int64_t dim, const kernels::VecRef& w,
                  const kernels::VecRef& b, float eps, float* out);
  void gelu(float* x, int64_t n);
  void rope_cos_sin(float* x, int64_t n, int64_t heads, int64_t d, int64_t rot, const float* c,
                    const float* s);
  void attention_segments(const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, const std::vector<int64_t>& seg, float scale, float* out);
  void add_inplace(float* x, const float* y, int64_t n);

 private:
  template <class T>
  T* ensure(gpu::DeviceBuffer<T>& b, int64_t n);
  cudaStream_t s_;
  std::array<gpu::DeviceBuffer<float>, 13> bufs_;  // one per VBuf (static_assert in the .cpp)
  gpu::DeviceBuffer<uint8_t> attn_ws_;
};

class VisionTowerCuda {
 public:
  // A device copy of the CPU tower's weights (as stored: bf16 or f32), on `stream`.
  static std::unique_ptr<VisionTowerCuda> upload(const M3Config& cfg, const VisionWeights& host,
                                                 cudaStream_t stream);
  // Weights generated on the device from `seed` for cfg.vision (which must be present): bf16
  // matrices uniform with std 1/sqrt(fan_in), LayerNorm weights near 1, small biases.
  static std::unique_ptr<VisionTowerCuda> synthetic(const M3Config& cfg, uint64_t seed,
                                                    cudaStream_t stream);
  // Device bytes of the tower's weights when uploaded from a checkpoint with these dtypes (the
  // bf16 default: 2 bytes per element) or generated (bf16 matrices, f32 vectors).
  static int64_t weight_bytes(const M3Config& cfg);
  ~VisionTowerCuda();

  // As VisionTower::encode (model/vision_tower.h): embeds [sum of tokens, text hidden] f32 on
  // the host; tower_hidden (may be null) the encoder's last hidden state.
  void encode(std::span<const VisionImage> images, std::vector<float>* embeds,
              std::vector<float>* tower_hidden = nullptr);
  size_t device_bytes() const { return bytes_; }
  const M3Config& config() const { return cfg_; }

 private:
  VisionTowerCuda(const M3Config& cfg, cudaStream_t stream);
  kernels::MatRef put(const kernels::MatRef& m);
  kernels::VecRef put(const kernels::VecRef& v);
  void* alloc(size_t bytes);
  void finish();  // builds the forward once the weights are final

  M3Config cfg_;
  cudaStream_t stream_;
  VisionWeights w_;  // device views
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  size_t bytes_ = 0;
  std::unique_ptr<VisionCudaOps> ops_;
  std::unique_ptr<VisionForward<VisionCudaOps>> fw_;
};

}  // namespace m3::model
