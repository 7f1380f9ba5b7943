// The MoE experts and the expert-parallel id mapping on the CPU (ops.h): the twins of
// kernels/cuda/moe_experts.cu.
#include <algorithm>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count) {
  for (int64_t i = 0; i < n; ++i)
    ids[i] =
        (ids[i] >= first && ids[i] < first + count) ? static_cast<int32_t>(ids[i] - first) : -1;
}

void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                 const MoeExpertWeights& w, const SwigluParams& act, const float* shared,
                 float* out) {
  M3_CHECK(w.mats_of != nullptr || w.dtype == DType::kBF16 || w.dtype == DType::kF32,
           "moe_experts: dtype %s", dtype_name(w.dtype));
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
    const MatRef gate = w.expert_mat(0, e);  // any format: linear dequantises row blocks
    const MatRef up = w.expert_mat(1, e);
    const MatRef down = w.expert_mat(2, e);
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

}  // namespace m3::kernels::cpu
