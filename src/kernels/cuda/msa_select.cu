// MSA block selection: one thread block per (token, index head). Warps score the blocks
// (max over the block's keys of <iq, ik_j>; forced init/local blocks score +inf) into shared
// memory, then topk block-wide argmax passes pick in rank order (score descending, ties to the
// lower block id), and the picks are written in ascending block order.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::block_best;
using detail::kNoId;
using detail::kWarp;
using detail::ranks_before;
using detail::warp_max;

constexpr int kMsaThreads = 256;

__global__ void __launch_bounds__(kMsaThreads)
    msa_select_kernel(const float* __restrict__ iq, int64_t num_index_heads, KvPages c,
                      TokenLayout L, int64_t topk, int64_t init_blocks, int64_t local_blocks,
                      int64_t max_nb, int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char msa_smem[];
  __shared__ float red_s[32];
  __shared__ int32_t red_i[32];
  const int64_t bs = c.page_size, di = c.index_dim;
  float* qv = reinterpret_cast<float*>(msa_smem);  // [di]
  float* score = qv + di;                          // [max_nb]
  int32_t* picks = reinterpret_cast<int32_t*>(score + max_nb);  // [topk]

  const int64_t w = blockIdx.x;
  const int64_t t = w / num_index_heads;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  int32_t* o = out + w * topk;
  if (nb <= topk) {
    for (int64_t i = threadIdx.x; i < topk; i += blockDim.x)
      o[i] = i < nb ? static_cast<int32_t>(i) : -1;
    return;
  }
  M3_DEVICE_CHECK(nb <= max_nb, "msa_select: %lld blocks, more than the %lld supported",
                  static_cast<long long>(nb), static_cast<long long>(max_nb));
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  for (int64_t i = threadIdx.x; i < di; i += blockDim.x) qv[i] = iq[w * di + i];
  __syncthreads();

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  for (int64_t b = warp; b < nb; b += num_warps) {
    if (b < init_blocks || b >= nb - local_blocks) {
      if (lane == 0) score[b] = INFINITY;
      continue;
    }
    // As the CPU op: every slot of the block (it lies wholly before p when local_blocks >= 1).
    const float* kb = c.ik + static_cast<int64_t>(table[b]) * bs * di;
    float mx = -INFINITY;
    for (int64_t j = lane; j < bs; j += kWarp) {
      const float* kj = kb + j * di;
      float dot = 0.f;
      for (int64_t i = 0; i < di; ++i) dot = fmaf(qv[i], kj[i], dot);
      mx = fmaxf(mx, dot);
    }
    mx = warp_max(mx);
    if (lane == 0) score[b] = mx;
  }
  __syncthreads();

  float prev_s = 0.f;
  int32_t prev_id = kNoId;  // no pick yet: every block is eligible
  for (int64_t j = 0; j < topk; ++j) {
    float best_s = 0.f;
    int32_t best_id = kNoId;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
      const int32_t id = static_cast<int32_t>(b);
      if (prev_id != kNoId && !ranks_before(prev_s, prev_id, score[b], id)) continue;
      if (ranks_before(score[b], id, best_s, best_id)) {
        best_s = score[b];
        best_id = id;
      }
    }
    block_best(best_s, best_id, red_s, red_i);
    if (threadIdx.x == 0) picks[j] = best_id == kNoId ? -1 : best_id;
    prev_s = best_s;
    prev_id = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Ascending block ids; -1 (only if scores were NaN) sorts to the end.
    for (int64_t i = 1; i < topk; ++i) {
      const int32_t v = picks[i];
      const uint32_t key = static_cast<uint32_t>(v);
      int64_t j = i - 1;
      while (j >= 0 && static_cast<uint32_t>(picks[j]) > key) {
        picks[j + 1] = picks[j];
        --j;
      }
      picks[j + 1] = v;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < topk; i += blockDim.x) o[i] = picks[i];
}

}  // namespace

void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                       const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int32_t* out, cudaStream_t stream) {
  M3_CHECK(cache.ik != nullptr, "cuda::msa_select_blocks: layer has no index-K cache");
  M3_CHECK(topk > 0);
  M3_CHECK(local_blocks >= 1, "cuda::msa_select_blocks: local_blocks must be >= 1");
  if (layout.num_tokens == 0) return;
  const int64_t grid = layout.num_tokens * num_index_heads;
  M3_CHECK(grid <= 0x7fffffff);
  // A sequence's blocks map to distinct pages, so it spans at most num_pages blocks.
  const int64_t max_nb = std::min(std::max(cache.num_pages, topk + 1), kMaxMsaBlocks);
  const size_t smem = sizeof(float) * (cache.index_dim + max_nb) + sizeof(int32_t) * topk;
  M3_CHECK(smem <= 200 * 1024, "cuda::msa_select_blocks: %zu bytes of shared memory", smem);
  if (smem > 48 * 1024) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(msa_select_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  }
  msa_select_kernel<<<static_cast<unsigned>(grid), kMsaThreads, smem, stream>>>(
      iq, num_index_heads, cache, layout, topk, init_blocks, local_blocks, max_nb, out);
  M3_CUDA_CHECK_LAUNCH("msa_select_kernel");
}

}  // namespace m3::kernels::cuda
