#include "model/kv_cache.h"

namespace m3::model {

KvCache::KvCache(const M3Config& cfg, int64_t num_pages)
    : KvCache(cfg, num_pages, cfg.num_key_value_heads) {}

KvCache::KvCache(const M3Config& cfg, int64_t num_pages, int64_t num_kv_heads)
    : cfg_(&cfg),
      num_pages_(num_pages),
      page_size_(cfg.sparse_block_size),
      num_kv_heads_(num_kv_heads),
      bytes_per_page_(page_bytes(cfg, num_kv_heads)) {
  layers_.resize(cfg.num_hidden_layers);
  const int64_t slots = num_pages * page_size_;
  const int64_t row = num_kv_heads * cfg.head_dim;
  // Elements of `n` of a format, in whole floats.
  auto floats = [](int64_t n, kernels::KvDtype dt) {
    return (n * kernels::kv_dtype_size(dt) + 3) / 4;
  };
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    layers_[i].k.assign(floats(slots * row, cfg.kv_cache_dtype), 0.f);
    layers_[i].v.assign(floats(slots * row, cfg.kv_cache_dtype), 0.f);
    if (cfg.layer_is_sparse[i]) {
      layers_[i].ik.assign(floats(slots * cfg.index_head_dim, cfg.index_cache_dtype), 0.f);
      if (cfg.index_cache_dtype == kernels::KvDtype::kFp8) layers_[i].ik_scale.assign(slots, 0.f);
    }
  }
}

kernels::cpu::KvPages KvCache::layer(int64_t i) {
  auto& L = layers_[i];
  kernels::cpu::KvPages p;
  p.k = L.k.data();
  p.v = L.v.data();
  p.ik = L.ik.empty() ? nullptr : L.ik.data();
  p.num_pages = num_pages_;
  p.page_size = page_size_;
  p.num_kv_heads = num_kv_heads_;
  p.head_dim = cfg_->head_dim;
  p.index_dim = L.ik.empty() ? 0 : cfg_->index_head_dim;
  p.ik_scale = L.ik_scale.empty() ? nullptr : L.ik_scale.data();
  p.kv_dtype = cfg_->kv_cache_dtype;
  p.ik_dtype = cfg_->index_cache_dtype;
  p.k_scale = cfg_->k_scale(i);
  p.v_scale = cfg_->v_scale(i);
  return p;
}

int64_t KvCache::page_bytes(const M3Config& cfg) {
  return page_bytes(cfg, cfg.num_key_value_heads);
}

int64_t KvCache::page_bytes(const M3Config& cfg, int64_t num_kv_heads) {
  const int64_t kv = kernels::kv_dtype_size(cfg.kv_cache_dtype);
  const int64_t ik = kernels::kv_dtype_size(cfg.index_cache_dtype);
  const int64_t ik_scale = cfg.index_cache_dtype == kernels::KvDtype::kFp8 ? 4 : 0;
  const int64_t per_token = cfg.num_hidden_layers * 2 * num_kv_heads * cfg.head_dim * kv +
                            cfg.num_sparse_layers() * (cfg.index_head_dim * ik + ik_scale);
  return per_token * cfg.sparse_block_size;
}

}  // namespace m3::model
