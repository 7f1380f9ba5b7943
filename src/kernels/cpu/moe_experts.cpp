// The MoE experts, expert-parallel id mapping, the vocabulary-slice embedding and the row ops
// on the CPU (ops.h): twins of kernels/cuda/moe_experts.cu, shard_ops.cu and row_ops.cu.
#include <algorithm>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count) {
  for (int64_t i = 0; i < n; ++i)
    ids[i] = (ids[i] >= first && ids[i] < first + count) ? static_cast<int32_t>(ids[i] - first)
                                                         : -1;
}

void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                 const MoeExpertWeights& w, const SwigluParams& act, const float* shared,
                 float* out) {
  M3_CHECK(w.dtype == DType::kBF16 || w.dtype == DType::kF32, "moe_experts: dtype %s",
           dtype_name(w.dtype));
  const int64_t h = w.hidden, inter = w.inter, ne = w.num_experts;
  // Group the picks by expert, tokens ascending within an expert (the CUDA op's order).
  std::vector<std::vector<std::pair<int32_t, float>>> by_expert(ne);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e == -1) continue;  // another rank's expert
      M3_CHECK(e >= 0 && e < ne, "moe_experts: expert id %d of %lld", e,
               static_cast<long long>(ne));
      by_expert[e].push_back({static_cast<int32_t>(t), weights[t * k + j]});
    }
  }
  std::vector<float> routed(n * h, 0.f), xe, g, u, ye;  // routed: [n, hidden] f32
  for (int64_t e = 0; e < ne; ++e) {
    const auto& toks = by_expert[e];
    if (toks.empty()) continue;
    const int64_t m = static_cast<int64_t>(toks.size());
    xe.resize(m * h);
    g.resize(m * inter);
    u.resize(m * inter);
    ye.resize(m * h);
    for (int64_t i = 0; i < m; ++i) std::copy_n(x + toks[i].first * h, h, xe.begin() + i * h);
    const MatRef gate{w.expert(w.w1, w.w1_of, e), w.dtype, inter, h};
    const MatRef up{w.expert(w.w3, w.w3_of, e), w.dtype, inter, h};
    const MatRef down{w.expert(w.w2, w.w2_of, e), w.dtype, h, inter};
    linear(xe.data(), m, gate, g.data());  // g: [m, inter] f32
    linear(xe.data(), m, up, u.data());    // u: [m, inter] f32
    swiglu_oai(g.data(), u.data(), m, inter, act.alpha, act.limit, act.beta, g.data());
    linear(g.data(), m, down, ye.data());  // ye: [m, hidden] f32
    for (int64_t i = 0; i < m; ++i) {
      float* r = routed.data() + toks[i].first * h;
      const float wgt = toks[i].second;
      for (int64_t c = 0; c < h; ++c) r[c] += wgt * ye[i * h + c];
    }
  }
  for (int64_t i = 0; i < n * h; ++i) out[i] = shared ? shared[i] + routed[i] : routed[i];
}

void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                           int64_t hidden, const int32_t* ids, int64_t n, float* out) {
  M3_CHECK(table.rows == 0 || table.cols == hidden, "embedding_vocab_slice: table of %lld columns "
           "for hidden %lld", static_cast<long long>(table.cols), static_cast<long long>(hidden));
  M3_CHECK(vocab_begin >= 0 && vocab_begin + table.rows <= vocab_size,
           "embedding_vocab_slice: rows [%lld, %lld) outside the vocabulary of %lld",
           static_cast<long long>(vocab_begin), static_cast<long long>(vocab_begin + table.rows),
           static_cast<long long>(vocab_size));
  std::fill(out, out + n * hidden, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t id = ids[t];
    M3_CHECK(id >= 0 && id < vocab_size, "embedding id %d out of range", id);
    if (id < vocab_begin || id >= vocab_begin + table.rows) continue;
    const int32_t local = static_cast<int32_t>(id - vocab_begin);
    embedding(table, &local, 1, out + t * hidden);
  }
}

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(src + static_cast<int64_t>(rows[i]) * cols, cols, dst + i * cols);
}

void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                  int64_t width, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(src + r * src_stride, width, dst + r * dst_stride);
}

void fill_zero(float* x, int64_t n) { std::fill(x, x + n, 0.f); }

void copy(float* dst, const float* src, int64_t n) {
  if (n > 0 && dst != src) std::copy(src, src + n, dst);
}

}  // namespace m3::kernels::cpu
