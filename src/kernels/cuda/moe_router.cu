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
using detail::warp_sum;

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

// ---- router_fused: the router GEMV and the top-k in one launch (decode) ----
constexpr int kFusedThreads = 256;
constexpr int kFusedVec = 8;  // float4 of a weight row per thread: hidden <= 256 * 4 * 8

// Token t's picks from logits l [ne] by the whole CTA: thread e ranks expert e against all
// others (the same order as router_topk_kernel's argmax passes: biased score descending, ties
// to the lower id, a NaN last), so the k picks land at their ranks at once.
__device__ void topk_by_rank(const float* l, int ne, const float* bias, int k, float scale,
                             float* s, float* choice, int32_t* pick, int32_t* ids, float* weights) {
  for (int e = threadIdx.x; e < ne; e += blockDim.x) {
    s[e] = 1.0f / (1.0f + expf(-__ldcg(l + e)));
    const float c = s[e] + (bias ? bias[e] : 0.0f);
    choice[e] = isnan(c) ? -INFINITY : c;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ne; e += blockDim.x) {
    const float c = choice[e];
    int rank = 0;
    for (int o = 0; o < ne; ++o) rank += ranks_before(choice[o], o, c, e) ? 1 : 0;
    if (rank < k) pick[rank] = e;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;  // in pick order, as the CPU op
    for (int j = 0; j < k; ++j) sum += s[pick[j]];
    for (int j = 0; j < k; ++j) {
      ids[j] = pick[j];
      weights[j] = s[pick[j]] / sum * scale;
    }
  }
  __syncthreads();  // s, choice and pick are reused for the next token
}

// One CTA per expert row e: logits[t, e] = x[t] . W[e] for the NT (<= n) tokens, the row's
// float4s held in registers; the last CTA to finish (a counter in `done`, reset by that CTA)
// makes every token's picks.
template <int NT>
__global__ void __launch_bounds__(kFusedThreads)
    router_fused_kernel(const float* __restrict__ x, int n, const float* __restrict__ W,
                        int64_t hidden, int ne, const float* __restrict__ bias, int k, float scale,
                        float* logits, int32_t* __restrict__ ids, float* __restrict__ weights,
                        unsigned* done) {
  __shared__ float red[NT][kFusedThreads / kWarp];
  __shared__ float s[kRouterFusedMaxExperts], choice[kRouterFusedMaxExperts];
  __shared__ int32_t pick[kRouterFusedMaxExperts];
  __shared__ bool last;
  const int e = blockIdx.x, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t nv = hidden / 4;
  const float4* w4 = reinterpret_cast<const float4*>(W + e * hidden);
  float4 wv[kFusedVec];
#pragma unroll
  for (int j = 0; j < kFusedVec; ++j) {
    const int64_t i = threadIdx.x + j * kFusedThreads;
    wv[j] = i < nv ? __ldg(w4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  detail::pdl_enter();  // the router's row is loaded; x and the counter belong to earlier kernels
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    acc[t] = 0.f;
    if (t >= n) continue;
    const float4* x4 = reinterpret_cast<const float4*>(x + t * hidden);
#pragma unroll
    for (int j = 0; j < kFusedVec; ++j) {
      const int64_t i = threadIdx.x + j * kFusedThreads;
      if (i < nv) {
        const float4 v = __ldg(x4 + i);
        acc[t] = fmaf(wv[j].x, v.x, acc[t]);
        acc[t] = fmaf(wv[j].y, v.y, acc[t]);
        acc[t] = fmaf(wv[j].z, v.z, acc[t]);
        acc[t] = fmaf(wv[j].w, v.w, acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    acc[t] = warp_sum(acc[t]);
    if (lane == 0) red[t][warp] = acc[t];
  }
  __syncthreads();
  if (threadIdx.x < n) {
    float v = 0.f;
    for (int w = 0; w < kFusedThreads / kWarp; ++w) v += red[threadIdx.x][w];
    logits[threadIdx.x * ne + e] = v;
  }
  // The last CTA sees every row: each CTA publishes its logits before counting itself.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *done = 0;  // ready for the next launch (graph replays)
  for (int t = 0; t < n; ++t)
    topk_by_rank(logits + t * ne, ne, bias, k, scale, s, choice, pick, ids + t * k,
                 weights + t * k);
}

}  // namespace

bool router_fused_supported(int64_t n, const MatRef& router, int64_t k, const float* x) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return n >= 1 && n <= kRouterFusedMaxTokens && router.dtype == DType::kF32 &&
         router.quant == WeightQuant::kNone && router.rows >= 1 &&
         router.rows <= kRouterFusedMaxExperts && k >= 1 && k <= router.rows &&
         router.cols % 4 == 0 && router.cols / 4 <= int64_t{kFusedThreads} * kFusedVec &&
         al(router.data) && al(x);
}

void router_fused(const float* x, int64_t n, const MatRef& router, const float* bias, int64_t k,
                  float scale, float* logits, int32_t* ids, float* weights, unsigned* counter,
                  cudaStream_t stream) {
  M3_CHECK(router_fused_supported(n, router, k, x),
           "cuda::router_fused: %lld tokens over a %s router of %lld x %lld, top-%lld, is not "
           "its shape (f32, <= %lld experts, <= %lld tokens, hidden %% 4 == 0); use linear + "
           "router_topk",
           static_cast<long long>(n), dtype_name(router.dtype), static_cast<long long>(router.rows),
           static_cast<long long>(router.cols), static_cast<long long>(k),
           static_cast<long long>(kRouterFusedMaxExperts),
           static_cast<long long>(kRouterFusedMaxTokens));
  const dim3 grid(static_cast<unsigned>(router.rows));
  const float* W = static_cast<const float*>(router.data);
  const int ne = static_cast<int>(router.rows), nn = static_cast<int>(n), kk = static_cast<int>(k);
  auto go = [&](auto kernel) {
    detail::launch_pdl(kernel, grid, dim3(kFusedThreads), 0, stream, x, nn, W, router.cols, ne,
                       bias, kk, scale, logits, ids, weights, counter);
  };
  if (n <= 1)
    go(router_fused_kernel<1>);
  else if (n <= 2)
    go(router_fused_kernel<2>);
  else if (n <= 4)
    go(router_fused_kernel<4>);
  else
    go(router_fused_kernel<8>);
}

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
