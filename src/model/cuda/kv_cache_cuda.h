// KvCacheCuda: the device storage of the paged KV cache for every layer, laid out exactly like
// the CPU KvCache (K, V and, on sparse layers, index-K in the config's formats, docs/KV_CACHE.md;
// one page = sparse_block_size tokens) so the GPU forward computes the same numbers as the CPU one.
// Used by M3ModelCuda::forward and the GPU backends (src/runtime/cuda). Invariant: every page
// starts zeroed; layer(i) hands out device pointers.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu/device_buffer.h"
#include "kernels/cpu/ops.h"
#include "model/config.h"

namespace m3::model {

class KvCacheCuda {
 public:
  // Allocates num_pages pages on the current device (a failed cudaMalloc ends the process naming
  // the call; size the cache from the free memory first).
  KvCacheCuda(const M3Config& cfg, int64_t num_pages);
  // A tensor-parallel rank's cache: only `num_kv_heads` KV heads per layer (the shard plan's
  // num_kv_heads); index-K (one head) is kept whole, as on every rank.
  KvCacheCuda(const M3Config& cfg, int64_t num_pages, int64_t num_kv_heads);

  int64_t num_pages() const { return num_pages_; }
  int64_t page_size() const { return page_size_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Layer i's pages; the pointers inside are device pointers.
  kernels::cpu::KvPages layer(int64_t i);
  int64_t total_bytes() const { return total_bytes_; }
  // Unique per cache object in the process (keys the model's captured CUDA graphs).
  uint64_t id() const { return id_; }

 private:
  struct LayerStore {
    gpu::DeviceBuffer<uint8_t> k, v, ik;
    gpu::DeviceBuffer<float> ik_scale;  // fp8 index-K only
  };
  kernels::KvDtype kv_dtype_, ik_dtype_;
  std::vector<float> k_scale_, v_scale_;
  int64_t num_pages_;
  int64_t page_size_;
  int64_t num_kv_heads_;
  int64_t head_dim_;
  int64_t index_dim_;
  int64_t total_bytes_ = 0;
  uint64_t id_;
  std::vector<LayerStore> layers_;
};

}  // namespace m3::model
