// Paged KV writes and causal paged attention (dense or over selected blocks): the twins of
// kernels/cuda/attn_paged.cu. Work is split over (token, kv head) pairs; each pair gathers its
// key list once and serves all query heads of its GQA group.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/paged_common.h"

namespace m3::kernels::cpu {

using detail::dot;
using detail::load_row;
using detail::page_of;
using detail::store_row;

void kv_write(const KvPages& c, const TokenLayout& L, const float* k, const float* v,
              const float* ik) {
  const int64_t row = c.num_kv_heads * c.head_dim;
  for (int64_t t = 0; t < L.num_tokens; ++t) {
    const int32_t p = L.positions[t];
    const int32_t s = L.seq_ids[t];
    const int64_t nblk = L.block_table_offsets[s + 1] - L.block_table_offsets[s];
    M3_CHECK(p / c.page_size < nblk, "kv_write: position %d beyond the block table (%lld pages)", p,
             (long long)nblk);
    const int32_t page = page_of(L, s, p / c.page_size);
    M3_CHECK(page >= 0 && page < c.num_pages, "kv_write: page %d out of range", page);
    const int64_t slot = static_cast<int64_t>(page) * c.page_size + p % c.page_size;
    store_row(c.k, c.kv_dtype, slot * row, row, 1.0f / c.k_scale, k + t * row);
    store_row(c.v, c.kv_dtype, slot * row, row, 1.0f / c.v_scale, v + t * row);
    if (ik) {
      M3_CHECK(c.ik != nullptr, "kv_write: layer has no index-K cache");
      const float* x = ik + t * c.index_dim;
      float inv = 1.f;
      if (c.ik_dtype == KvDtype::kFp8) {
        // One power-of-two scale per token (docs/KV_CACHE.md): x / s is exact.
        M3_CHECK(c.ik_scale != nullptr, "kv_write: an fp8 index-K needs its scale array");
        float amax = 0.f;
        for (int64_t i = 0; i < c.index_dim; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float sc = fp8_row_scale(amax);
        c.ik_scale[slot] = sc;
        inv = 1.0f / sc;
      }
      store_row(c.ik, c.ik_dtype, slot * c.index_dim, c.index_dim, inv, x);
    }
  }
}

void attention_paged(const float* q, int64_t num_heads, const KvPages& c, const TokenLayout& L,
                     const int32_t* blocks, int64_t max_blocks, float scale, float* out) {
  const int64_t nkv = c.num_kv_heads, d = c.head_dim, bs = c.page_size;
  M3_CHECK(num_heads % nkv == 0);
  const int64_t group = num_heads / nkv;
  // A bf16 / fp8 cache is read back to fp32 rows first, and the query enters as bf16, as in
  // the GPU kernels (docs/KV_CACHE.md); an fp32 cache is read in place.
  const bool f32 = c.kv_dtype == KvDtype::kF32;
  parallel_for(L.num_tokens * nkv, [&](int64_t w0, int64_t w1) {
    std::vector<int64_t> slots;  // cache slots of the visible keys, ascending position
    std::vector<float> scores;
    std::vector<float> qt, mx, sum, kbuf, vbuf;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / nkv, g = w % nkv;
      const int32_t p = L.positions[t], s = L.seq_ids[t];
      const int64_t nb = p / bs + 1;
      slots.clear();
      auto add_block = [&](int64_t b) {
        const int64_t page = page_of(L, s, b);
        const int64_t last = std::min<int64_t>(bs, p - b * bs + 1);  // causal within the block
        for (int64_t o = 0; o < last; ++o) slots.push_back(page * bs + o);
      };
      if (blocks == nullptr) {
        for (int64_t b = 0; b < nb; ++b) add_block(b);
      } else {
        const int32_t* sel = blocks + (t * nkv + g) * max_blocks;
        for (int64_t i = 0; i < max_blocks; ++i) {
          if (sel[i] < 0) continue;
          M3_CHECK(sel[i] < nb, "attention: selected block %d is in the future", sel[i]);
          add_block(sel[i]);
        }
      }
      // All query heads of the group at once: each key and value row is read once per group.
      // q is transposed to [d][group] and scores kept as [key][group], so the inner loops run
      // over the group's heads contiguously (one vector FMA chain per key dimension).
      const int64_t nk = static_cast<int64_t>(slots.size());
      scores.resize(nk * group);
      qt.resize(d * group);
      const float* qg = q + (t * num_heads + g * group) * d;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t i = 0; i < d; ++i)
          qt[i * group + h] = (f32 ? qg[h * d + i] : round_to_bf16(qg[h * d + i])) * scale;
      if (!f32) {
        kbuf.resize(nk * d);
        vbuf.resize(nk * d);
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t at = (slots[j] * nkv + g) * d;
          load_row(c.k, c.kv_dtype, at, d, c.k_scale, kbuf.data() + j * d);
          load_row(c.v, c.kv_dtype, at, d, c.v_scale, vbuf.data() + j * d);
        }
      }
      const float* kf = static_cast<const float*>(c.k);
      const float* vf = static_cast<const float*>(c.v);
      for (int64_t j = 0; j < nk; ++j) {
        const float* kj = f32 ? kf + (slots[j] * nkv + g) * d : kbuf.data() + j * d;
        float* sj = scores.data() + j * group;
        for (int64_t h = 0; h < group; ++h) sj[h] = 0.f;
        for (int64_t i = 0; i < d; ++i) {
          const float kv = kj[i];
          const float* qi = qt.data() + i * group;
          for (int64_t h = 0; h < group; ++h) sj[h] += qi[h] * kv;
        }
      }
      mx.assign(group, -std::numeric_limits<float>::infinity());
      sum.assign(group, 0.f);
      for (int64_t j = 0; j < nk; ++j) {
        const float* sj = scores.data() + j * group;
        for (int64_t h = 0; h < group; ++h) mx[h] = std::max(mx[h], sj[h]);
      }
      for (int64_t j = 0; j < nk; ++j) {
        float* sj = scores.data() + j * group;
        for (int64_t h = 0; h < group; ++h) {
          sj[h] = std::exp(sj[h] - mx[h]);
          sum[h] += sj[h];
        }
      }
      float* og = out + (t * num_heads + g * group) * d;
      std::fill(og, og + group * d, 0.f);
      for (int64_t j = 0; j < nk; ++j) {
        const float* vj = f32 ? vf + (slots[j] * nkv + g) * d : vbuf.data() + j * d;
        const float* sj = scores.data() + j * group;
        for (int64_t h = 0; h < group; ++h) {
          const float wj = sj[h];
          float* o = og + h * d;
          for (int64_t i = 0; i < d; ++i) o[i] += wj * vj[i];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        const float inv = 1.0f / sum[h];
        float* o = og + h * d;
        for (int64_t i = 0; i < d; ++i) o[i] *= inv;
      }
    }
  });
}

}  // namespace m3::kernels::cpu
