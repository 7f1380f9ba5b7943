// The MoE router's top-k (the twin of kernels/cuda/moe_router.cu).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias, int64_t k,
                 float scale, int32_t* ids, float* weights) {
  M3_CHECK(k > 0 && k <= num_experts);
  parallel_for(n, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(num_experts), choice(num_experts);
    std::vector<int32_t> order(num_experts);
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = logits + t * num_experts;
      for (int64_t e = 0; e < num_experts; ++e) {
        s[e] = 1.0f / (1.0f + std::exp(-l[e]));
        choice[e] = s[e] + (bias ? bias[e] : 0.0f);
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += s[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        ids[t * k + j] = order[j];
        weights[t * k + j] = s[order[j]] / sum * scale;
      }
    }
  });
}

}  // namespace m3::kernels::cpu
