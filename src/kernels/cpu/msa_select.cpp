// MSA block selection (the twin of kernels/cuda/msa_select.cu): per (token, index head), the
// max-pooled index scores of every block the token sees, then the forced and top-k blocks.
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

void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& c,
                       const TokenLayout& L, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int32_t* out) {
  const int64_t bs = c.page_size, di = c.index_dim;
  M3_CHECK(c.ik != nullptr, "msa_select_blocks: layer has no index-K cache");
  // The query's own (partial) block is always forced, so every scored block lies wholly before
  // the query; the config loader refuses sparse_local_block < 1.
  M3_CHECK(local_blocks >= 1, "msa_select_blocks: local_blocks must be >= 1");
  // A bf16 / fp8 index-K: the query enters as bf16 (exact products), an fp8 row's score is its
  // per-token scale times the dot with its codes (docs/KV_CACHE.md).
  const bool f32 = c.ik_dtype == KvDtype::kF32;
  M3_CHECK(c.ik_dtype != KvDtype::kFp8 || c.ik_scale != nullptr,
           "msa_select_blocks: an fp8 index-K needs its scale array");
  parallel_for(L.num_tokens * num_index_heads, [&](int64_t w0, int64_t w1) {
    std::vector<float> score, qbuf(di), kbuf;
    std::vector<int32_t> order;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / num_index_heads;  // index head = w % num_index_heads
      const int32_t p = L.positions[t], s = L.seq_ids[t];
      const int64_t nb = p / bs + 1;
      int32_t* o = out + w * topk;
      std::fill(o, o + topk, -1);
      if (nb <= topk) {
        for (int64_t b = 0; b < nb; ++b) o[b] = static_cast<int32_t>(b);
        continue;
      }
      const float* qv = iq + w * di;
      if (!f32) {
        for (int64_t i = 0; i < di; ++i) qbuf[i] = round_to_bf16(qv[i]);
        qv = qbuf.data();
        kbuf.resize(bs * di);
      }
      const float inf = std::numeric_limits<float>::infinity();
      score.assign(nb, -inf);
      for (int64_t b = 0; b < nb; ++b) {
        const bool forced = b < init_blocks || b >= nb - local_blocks;
        if (forced) {
          score[b] = inf;
          continue;
        }
        // Block b < nb - local_blocks lies wholly before p: every token in it is visible.
        const int64_t page = page_of(L, s, b);
        float mx = -inf;
        if (f32) {
          const float* kb = static_cast<const float*>(c.ik) + page * bs * di;
          for (int64_t j = 0; j < bs; ++j) mx = std::max(mx, dot(qv, kb + j * di, di));
        } else {
          load_row(c.ik, c.ik_dtype, page * bs * di, bs * di, 1.f, kbuf.data());
          const bool fp8 = c.ik_dtype == KvDtype::kFp8;
          for (int64_t j = 0; j < bs; ++j) {
            const float sc = fp8 ? c.ik_scale[page * bs + j] : 1.f;
            mx = std::max(mx, sc * dot(qv, kbuf.data() + j * di, di));
          }
        }
        score[b] = mx;
      }
      order.resize(nb);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                        [&](int32_t a, int32_t b) {
                          return score[a] > score[b] || (score[a] == score[b] && a < b);
                        });
      std::sort(order.begin(), order.begin() + topk);
      for (int64_t i = 0; i < topk; ++i) o[i] = order[i];
    }
  });
}

}  // namespace m3::kernels::cpu
