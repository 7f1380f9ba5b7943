#include "model/cuda/kv_cache_cuda.h"

#include <atomic>

#include "core/check.h"

namespace m3::model {

namespace {
uint64_t next_cache_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}
}  // namespace

KvCacheCuda::KvCacheCuda(const M3Config& cfg, int64_t num_pages)
    : KvCacheCuda(cfg, num_pages, cfg.num_key_value_heads) {}

KvCacheCuda::KvCacheCuda(const M3Config& cfg, int64_t num_pages, int64_t num_kv_heads)
    : num_pages_(num_pages),
      page_size_(cfg.sparse_block_size),
      num_kv_heads_(num_kv_heads),
      head_dim_(cfg.head_dim),
      index_dim_(cfg.index_head_dim),
      id_(next_cache_id()) {
  M3_CHECK(num_pages > 0, "KvCacheCuda: %lld pages", static_cast<long long>(num_pages));
  M3_CHECK(num_kv_heads > 0 && num_kv_heads <= cfg.num_key_value_heads,
           "KvCacheCuda: %lld KV heads of %lld", static_cast<long long>(num_kv_heads),
           static_cast<long long>(cfg.num_key_value_heads));
  const size_t slots = static_cast<size_t>(num_pages * page_size_);
  layers_.resize(cfg.num_hidden_layers);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    LayerStore& L = layers_[i];
    L.k = gpu::DeviceBuffer<float>(slots * num_kv_heads * cfg.head_dim);
    L.v = gpu::DeviceBuffer<float>(slots * num_kv_heads * cfg.head_dim);
    L.k.fill_bytes(0);
    L.v.fill_bytes(0);
    if (cfg.layer_is_sparse[i]) {
      L.ik = gpu::DeviceBuffer<float>(slots * cfg.index_head_dim);
      L.ik.fill_bytes(0);
    }
    total_bytes_ += static_cast<int64_t>(L.k.bytes() + L.v.bytes() + L.ik.bytes());
  }
}

kernels::cpu::KvPages KvCacheCuda::layer(int64_t i) {
  M3_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()), "KvCacheCuda: layer %lld",
           static_cast<long long>(i));
  LayerStore& L = layers_[i];
  kernels::cpu::KvPages p;
  p.k = L.k.data();
  p.v = L.v.data();
  p.ik = L.ik.size() == 0 ? nullptr : L.ik.data();
  p.num_pages = num_pages_;
  p.page_size = page_size_;
  p.num_kv_heads = num_kv_heads_;
  p.head_dim = head_dim_;
  p.index_dim = L.ik.size() == 0 ? 0 : index_dim_;
  return p;
}

}  // namespace m3::model
