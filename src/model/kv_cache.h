// KvCache: the CPU storage of the paged KV cache for every layer. A page holds sparse_block_size
// (128) tokens of K and V for all KV heads and, on sparse layers, the index-K of the same tokens,
// so a selected MSA block is exactly one page and K/V/index-K pages move as one unit.
// Who allocates pages is not decided here (sched/ in the server, a bump allocator in tests).
// A tensor-parallel rank's cache holds only its KV heads (M3Model::cache_kv_heads()).
// Element formats: cfg.kv_cache_dtype / cfg.index_cache_dtype, the fp8 K/V scales cfg.k_scale(i) /
// v_scale(i) (docs/KV_CACHE.md has the layout).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/config.h"

namespace m3::model {

class KvCache {
 public:
  KvCache(const M3Config& cfg, int64_t num_pages);
  // A rank's cache: `num_kv_heads` KV heads per layer (plus the one index-K head).
  KvCache(const M3Config& cfg, int64_t num_pages, int64_t num_kv_heads);

  int64_t num_pages() const { return num_pages_; }
  int64_t page_size() const { return page_size_; }
  kernels::cpu::KvPages layer(int64_t i);
  // Bytes of one page across all layers (K + V + index-K + fp8 index-K scales), in the config's
  // formats.
  static int64_t page_bytes(const M3Config& cfg);
  static int64_t page_bytes(const M3Config& cfg, int64_t num_kv_heads);
  int64_t total_bytes() const { return num_pages_ * bytes_per_page_; }

 private:
  struct LayerStore {
    std::vector<float> k, v, ik, ik_scale;  // float storage only for alignment; see layer()
  };
  const M3Config* cfg_;
  int64_t num_pages_;
  int64_t page_size_;
  int64_t num_kv_heads_;
  int64_t bytes_per_page_;
  std::vector<LayerStore> layers_;
};

}  // namespace m3::model
