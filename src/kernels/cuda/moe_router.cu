// The sigmoid MoE router's top-k: one warp per token. The k picks are made in rank order (biased
// score descending, ties to the lower expert id) by k warp-wide argmax passes, each over the
// experts ranked after the previous pick, so no "taken" flags are needed.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::kNoId;
using detail::kWarp;
using detail::ranks_before;
using detail::warp_best;

constexpr int64_t kMaxExperts = 4096;  // s and choice live in shared memory (32 KiB)

__global__ void __launch_bounds__(kWarp)
    router_topk_kernel(const float* __restrict__ logits, int64_t num_experts,
                       const float* __restrict__ bias, int64_t k, float scale,
                       int32_t* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float router_smem[];
  float* s = router_smem;                     // [num_experts] sigmoid scores
  float* choice = router_smem + num_experts;  // [num_experts] scores + bias
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const float* l = logits + t * num_experts;
  for (int64_t e = lane; e < num_experts; e += kWarp) {
    s[e] = 1.0f / (1.0f + expf(-l[e]));
    const float c = s[e] + (bias ? bias[e] : 0.0f);
    choice[e] = isnan(c) ? -INFINITY : c;  // a NaN ranks last, so k picks always exist
  }
  __syncwarp();
  float prev_c = 0.f;
  int32_t prev_id = kNoId;  // no pick yet: every expert is eligible
  for (int64_t j = 0; j < k; ++j) {
    float best_c = 0.f;
    int32_t best_id = kNoId;
    for (int64_t e = lane; e < num_experts; e += kWarp) {
      const int32_t id = static_cast<int32_t>(e);
      // Eligible: ranked after the previous pick.
      if (prev_id != kNoId && !ranks_before(prev_c, prev_id, choice[e], id)) continue;
      if (ranks_before(choice[e], id, best_c, best_id)) {
        best_c = choice[e];
        best_id = id;
      }
    }
    warp_best(best_c, best_id);
    if (lane == 0) ids[t * k + j] = best_id;
    prev_c = best_c;
    prev_id = best_id;
  }
  __syncwarp();
  if (lane == 0) {
    // Sum in pick order, as the CPU op does.
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += s[ids[t * k + j]];
    for (int64_t j = 0; j < k; ++j) weights[t * k + j] = s[ids[t * k + j]] / sum * scale;
  }
}

}  // namespace

void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias, int64_t k,
                 float scale, int32_t* ids, float* weights, cudaStream_t stream) {
  M3_CHECK(k > 0 && k <= num_experts);
  M3_CHECK(num_experts <= kMaxExperts, "cuda::router_topk: %lld experts (max %lld)",
           (long long)num_experts, (long long)kMaxExperts);
  if (n == 0) return;
  M3_CHECK(n <= 0x7fffffff);
  const size_t smem = 2 * static_cast<size_t>(num_experts) * sizeof(float);
  router_topk_kernel<<<static_cast<unsigned>(n), kWarp, smem, stream>>>(logits, num_experts, bias,
                                                                        k, scale, ids, weights);
  M3_CUDA_CHECK_LAUNCH("router_topk_kernel");
}

}  // namespace m3::kernels::cuda
