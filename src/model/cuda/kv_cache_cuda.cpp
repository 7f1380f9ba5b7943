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
  kv_dtype_ = cfg.kv_cache_dtype;
  ik_dtype_ = cfg.index_cache_dtype;
  M3_CHECK(num_pages > 0, "KvCacheCuda: %lld pages", static_cast<long long>(num_pages));
  M3_CHECK(num_kv_heads > 0 && num_kv_heads <= cfg.num_key_value_heads,
           "KvCacheCuda: %lld KV heads of %lld", static_cast<long long>(num_kv_heads),
           static_cast<long long>(cfg.num_key_value_heads));
  const size_t slots = static_cast<size_t>(num_pages * page_size_);
  layers_.resize(cfg.num_hidden_layers);
  const size_t kv = kernels::kv_dtype_size(kv_dtype_), ik = kernels::kv_dtype_size(ik_dtype_);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    LayerStore& L = layers_[i];
    L.k = gpu::DeviceBuffer<uint8_t>(slots * num_kv_heads * cfg.head_dim * kv);
    L.v = gpu::DeviceBuffer<uint8_t>(slots * num_kv_heads * cfg.head_dim * kv);
    L.k.fill_bytes(0);
    L.v.fill_bytes(0);
    if (cfg.layer_is_sparse[i]) {
      L.ik = gpu::DeviceBuffer<uint8_t>(slots * cfg.index_head_dim * ik);
      L.ik.fill_bytes(0);
      if (ik_dtype_ == kernels::KvDtype::kFp8) {
        L.ik_scale = gpu::DeviceBuffer<float>(slots);
        L.ik_scale.fill_bytes(0);
      }
    }
    k_scale_.push_back(cfg.k_scale(i));
    v_scale_.push_back(cfg.v_scale(i));
    total_bytes_ +=
        static_cast<int64_t>(L.k.bytes() + L.v.bytes() + L.ik.bytes() + L.ik_scale.bytes());
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
  p.ik_scale = L.ik_scale.size() == 0 ? nullptr : L.ik_scale.data();
  p.kv_dtype = kv_dtype_;
  p.ik_dtype = ik_dtype_;
  p.k_scale = k_scale_[i];
  p.v_scale = v_scale_[i];
  return p;
}

}  // namespace m3::model
