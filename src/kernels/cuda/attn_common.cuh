// Device helpers of the attention and MSA kernels (attn_paged.cu, msa_select.cu): cp.async
// copies, block max / exclusive scan, the SM count that sizes split grids. Included only by .cu
// files in this folder. Invariant: block-wide helpers assume blockDim.x is a multiple of 32,
// at most 1024, and are called by every thread of the block.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/views.h"

namespace m3::kernels::cuda::detail {

// 16-byte global -> shared copy that bypasses L1 (the data is streamed once).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
}
// The same, or 16 zero bytes when !valid (cp.async's source size 0; gmem is not read then).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Whether token t shares its sequence with a neighbour in the batch (a sequence's tokens are
// contiguous): such tokens are a prefill chunk or a verify run, which the query-tiled kernel
// (attn_prefill.cu) serves when TokenLayout::multi_token_seqs is set; the per-token kernels then
// skip them.
__device__ __forceinline__ bool in_multi_run(const TokenLayout& L, int64_t t) {
  const int32_t s = L.seq_ids[t];
  return (t > 0 && L.seq_ids[t - 1] == s) || (t + 1 < L.num_tokens && L.seq_ids[t + 1] == s);
}

// The query-tiled dense attention (attn_prefill.cu): whether it takes this cache and GQA group,
// and its launch, which writes the output rows of every token in_multi_run (others untouched).
bool prefill_tiled_supported(const KvPages& c, int64_t group);
// Dense split-KV decode attention (attention_paged's rows without a block list) on the TMA rings
// of msa_sparse_prefill.cu: grid (tokens x kv heads, splits), the split format of the combine
// kernel (part_o / part_ml; the output itself when splits == 1). False, launching nothing, where
// it does not serve the cache (fp32, head_dim != 128, group > 16, pages not a multiple of 16
// slots, no tensor maps) or M3_ATTN_TMA_DECODE=0.
bool attention_decode_tma(const float* q, int64_t num_heads, const KvPages& c,
                          const TokenLayout& layout, float scale, int64_t max_kv_len, int splits,
                          float* part_o, float* part_ml, float* out, bool skip_multi,
                          cudaStream_t stream);
void attention_prefill_tiled(const float* q, int64_t num_heads, const KvPages& c,
                             const TokenLayout& L, float scale, int64_t max_kv_len, float* out,
                             cudaStream_t stream);

// Max over the block; every thread gets it. `red` is __shared__ float[32].
__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < num_warps ? red[lane] : -INFINITY;
    t = warp_max(t);
    if (lane == 0) red[0] = t;
  }
  __syncthreads();
  const float r = red[0];
  __syncthreads();
  return r;
}

// Exclusive prefix sum over the block in thread order; every thread gets its prefix and the
// block's total. `red` is __shared__ uint32_t[33].
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* red,
                                                         uint32_t* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  uint32_t incl = v;
  for (int o = 1; o < kWarp; o <<= 1) {
    const uint32_t n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == kWarp - 1) red[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t tot = lane < num_warps ? red[lane] : 0u;
    uint32_t x = tot;
    for (int o = 1; o < kWarp; o <<= 1) {
      const uint32_t n = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += n;
    }
    if (lane < num_warps) red[lane] = x - tot;  // exclusive prefix of the warp totals
    if (lane == num_warps - 1) red[32] = x;
  }
  __syncthreads();
  const uint32_t r = red[warp] + incl - v;
  *total = red[32];
  __syncthreads();  // red may be reused right after
  return r;
}

// Multiprocessors of the current device (sizes split grids): blas::num_sms, read once per
// device, so ranks on different GPUs of one process each get their own.
inline int num_sms() {
  return blas::num_sms();
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` once per device: the attribute is a
// property of the function on one device, so a process driving several GPUs (tensor-parallel
// ranks) must set it on each. `done` is the call site's set of devices already done.
template <class Kernel>
void raise_smem_limit_once(std::atomic<uint64_t>& done, Kernel kernel, int bytes) {
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

// The warp merge of a split-KV CTA (attention_mma_kernel, attention_decode_tma_kernel), called by
// every thread once each warp's rows sit in shared memory: the quad leaders park their rows'
// running maxima / sums (rows lane / 4 and lane / 4 + 8: m[0], m[1], l[0], l[1]) in Wm / Wl, then
// threads h < kRows set the merged maximum Ms[h], sum Ls[h] and each warp's weight Wt[w][h] (0
// for a warp that saw no key), with a CTA barrier before and after. kExp2: the maxima are in the
// exp2 domain.
template <int kWarps, int kRows, bool kExp2>
__device__ __forceinline__ void merge_warp_stats(int warp, int lane, const float (&m)[2],
                                                 const float (&l)[2], float (&Wm)[kWarps][kRows],
                                                 float (&Wl)[kWarps][kRows],
                                                 float (&Wt)[kWarps][kRows], float* Ms, float* Ls) {
  if (lane % 4 == 0) {
    const int r = lane / 4;
    Wm[warp][r] = m[0];
    Wm[warp][r + 8] = m[1];
    Wl[warp][r] = l[0];
    Wl[warp][r + 8] = l[1];
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int h = threadIdx.x;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, Wm[w][h]);
    float lt = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float d = Wm[w][h] - mx;
      const float wt = Wm[w][h] == -INFINITY ? 0.f : (kExp2 ? exp2f(d) : expf(d));
      Wt[w][h] = wt;
      lt += wt * Wl[w][h];
    }
    Ms[h] = mx;
    Ls[h] = lt;
  }
  __syncthreads();
}

// The merged rows of that CTA (Ow [kWarps][kRows][D], weighted by Wt, times vmul): normalised into
// out_rows (the group's first row) when there is one split, else into the combine kernel's
// partials of split index idx (part_ml's maxima in the natural-log domain: times ln 2 for kExp2).
template <int kWarps, int kRows, int D, bool kExp2>
__device__ __forceinline__ void write_split_rows(const float* Ow, const float (&Wt)[kWarps][kRows],
                                                 const float* Ms, const float* Ls, int group,
                                                 float vmul, int num_splits, int64_t idx,
                                                 float* out_rows, float* part_o, float* part_ml) {
  for (int e = threadIdx.x; e < group * D; e += blockDim.x) {
    const int h = e / D, i = e % D;
    float acc = 0.f;
    for (int w = 0; w < kWarps; ++w) acc = fmaf(Wt[w][h], Ow[(w * kRows + h) * D + i], acc);
    acc *= vmul;
    if (num_splits == 1)
      out_rows[h * D + i] = acc * (1.0f / Ls[h]);
    else
      part_o[(idx * group + h) * D + i] = acc;
  }
  if (num_splits > 1 && threadIdx.x < group) {
    const float mx = Ms[threadIdx.x];
    part_ml[(idx * group + threadIdx.x) * 2] =
        kExp2 && mx != -INFINITY ? mx * 0.6931471805599453f : mx;
    part_ml[(idx * group + threadIdx.x) * 2 + 1] = Ls[threadIdx.x];
  }
}

}  // namespace m3::kernels::cuda::detail
