// Paged KV writes and causal paged attention (dense, or over MSA-selected blocks), GQA.
// Attention: one thread block per (token, kv head) serving all query heads of the group; keys
// stream through shared memory kChunk at a time with an online (running max) fp32 softmax.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

constexpr int kKvThreads = 256;
constexpr int kAttnThreads = 256;
constexpr int kChunk = 32;  // keys per shared-memory pass

__global__ void __launch_bounds__(kKvThreads)
    kv_write_kernel(KvPages c, TokenLayout L, const float* __restrict__ k,
                    const float* __restrict__ v, const float* __restrict__ ik) {
  const int64_t t = blockIdx.x;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nblk = L.block_table_offsets[s + 1] - L.block_table_offsets[s];
  M3_DEVICE_CHECK(p >= 0 && p / c.page_size < nblk,
                  "kv_write: position %d beyond the block table (%lld pages)", p,
                  static_cast<long long>(nblk));
  const int32_t page = L.block_table[L.block_table_offsets[s] + p / c.page_size];
  M3_DEVICE_CHECK(page >= 0 && page < c.num_pages, "kv_write: page %d out of range", page);
  const int64_t slot = static_cast<int64_t>(page) * c.page_size + p % c.page_size;
  const int64_t row = c.num_kv_heads * c.head_dim;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    c.k[slot * row + i] = k[t * row + i];
    c.v[slot * row + i] = v[t * row + i];
  }
  if (ik != nullptr) {
    for (int64_t i = threadIdx.x; i < c.index_dim; i += blockDim.x)
      c.ik[slot * c.index_dim + i] = ik[t * c.index_dim + i];
  }
}

// Shared memory of one attention block, in floats (slots first: 8-byte aligned).
struct AttnSmem {
  int64_t group, d;
  __host__ __device__ int64_t kd() const { return d + 1; }  // K rows padded: no bank conflicts
  __host__ __device__ size_t bytes() const {
    return kChunk * sizeof(int64_t) +
           sizeof(float) * (group * d + kChunk * kd() + kChunk * d + group * kChunk +
                            group * d + 3 * group);
  }
};

__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c, TokenLayout L,
                     const int32_t* __restrict__ blocks, int64_t max_blocks, float scale,
                     float* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char attn_smem[];
  const int64_t nkv = c.num_kv_heads, d = c.head_dim, bs = c.page_size;
  const int64_t group = num_heads / nkv;
  const AttnSmem lay{group, d};
  const int64_t kd = lay.kd();
  int64_t* slots = reinterpret_cast<int64_t*>(attn_smem);  // [kChunk] cache slots of the chunk
  float* qs = reinterpret_cast<float*>(slots + kChunk);    // [group][d], q * scale
  float* ks = qs + group * d;                              // [kChunk][kd]
  float* vs = ks + kChunk * kd;                            // [kChunk][d]
  float* ps = vs + kChunk * d;                             // [group][kChunk] scores, then probs
  float* acc = ps + group * kChunk;                        // [group][d] unnormalised output
  float* run_max = acc + group * d;                        // [group]
  float* run_sum = run_max + group;                        // [group]
  float* rescale = run_sum + group;                        // [group]

  const int64_t t = blockIdx.x / nkv, g = blockIdx.x % nkv;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const float* qg = q + (t * num_heads + g * group) * d;
  for (int64_t e = threadIdx.x; e < group * d; e += blockDim.x) {
    qs[e] = qg[e] * scale;
    acc[e] = 0.f;
  }
  for (int64_t h = threadIdx.x; h < group; h += blockDim.x) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.f;
  }
  __syncthreads();

  const int32_t* sel = blocks ? blocks + (t * nkv + g) * max_blocks : nullptr;
  const int64_t num_listed = blocks ? max_blocks : nb;
  for (int64_t bi = 0; bi < num_listed; ++bi) {
    const int64_t b = sel ? sel[bi] : bi;
    if (b < 0) continue;
    M3_DEVICE_CHECK(b < nb, "attention: selected block %lld is in the future (token at %d)",
                    static_cast<long long>(b), p);
    const int64_t page = table[b];
    const int64_t last = min(bs, static_cast<int64_t>(p) - b * bs + 1);  // causal in the block
    for (int64_t o0 = 0; o0 < last; o0 += kChunk) {
      const int64_t cnt = min(static_cast<int64_t>(kChunk), last - o0);
      for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x) slots[j] = page * bs + o0 + j;
      __syncthreads();
      for (int64_t e = threadIdx.x; e < cnt * d; e += blockDim.x) {
        const int64_t j = e / d, i = e % d;
        const int64_t src = (slots[j] * nkv + g) * d + i;
        ks[j * kd + i] = c.k[src];
        vs[j * d + i] = c.v[src];
      }
      __syncthreads();
      for (int64_t e = threadIdx.x; e < group * cnt; e += blockDim.x) {
        const int64_t h = e / cnt, j = e % cnt;
        const float* qh = qs + h * d;
        const float* kj = ks + j * kd;
        float sc = 0.f;
        for (int64_t i = 0; i < d; ++i) sc = fmaf(qh[i], kj[i], sc);
        ps[h * kChunk + j] = sc;
      }
      __syncthreads();
      for (int64_t h = threadIdx.x; h < group; h += blockDim.x) {
        float* ph = ps + h * kChunk;
        float mx = run_max[h];
        for (int64_t j = 0; j < cnt; ++j) mx = fmaxf(mx, ph[j]);
        const float r = expf(run_max[h] - mx);  // 0 on the first chunk (exp(-inf))
        float sum = 0.f;
        for (int64_t j = 0; j < cnt; ++j) {
          ph[j] = expf(ph[j] - mx);
          sum += ph[j];
        }
        run_sum[h] = run_sum[h] * r + sum;
        run_max[h] = mx;
        rescale[h] = r;
      }
      __syncthreads();
      for (int64_t e = threadIdx.x; e < group * d; e += blockDim.x) {
        const int64_t h = e / d, i = e % d;
        const float* ph = ps + h * kChunk;
        float a = acc[e] * rescale[h];
        for (int64_t j = 0; j < cnt; ++j) a = fmaf(ph[j], vs[j * d + i], a);
        acc[e] = a;
      }
      __syncthreads();
    }
  }
  float* og = out + (t * num_heads + g * group) * d;
  for (int64_t e = threadIdx.x; e < group * d; e += blockDim.x) {
    const int64_t h = e / d;
    og[e] = acc[e] * (1.0f / run_sum[h]);
  }
}

}  // namespace

void kv_write(const KvPages& cache, const TokenLayout& layout, const float* k, const float* v,
              const float* ik, cudaStream_t stream) {
  M3_CHECK(ik == nullptr || cache.ik != nullptr, "cuda::kv_write: layer has no index-K cache");
  if (layout.num_tokens == 0) return;
  M3_CHECK(layout.num_tokens <= 0x7fffffff);
  kv_write_kernel<<<static_cast<unsigned>(layout.num_tokens), kKvThreads, 0, stream>>>(
      cache, layout, k, v, ik);
  M3_CUDA_CHECK_LAUNCH("kv_write_kernel");
}

void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                     const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                     float scale, float* out, cudaStream_t stream) {
  M3_CHECK(cache.num_kv_heads > 0 && num_heads % cache.num_kv_heads == 0);
  if (layout.num_tokens == 0) return;
  const int64_t grid = layout.num_tokens * cache.num_kv_heads;
  M3_CHECK(grid <= 0x7fffffff);
  const AttnSmem lay{num_heads / cache.num_kv_heads, cache.head_dim};
  const size_t smem = lay.bytes();
  M3_CHECK(smem <= 227 * 1024, "cuda::attention: %zu bytes of shared memory (group %lld, head "
           "dim %lld)", smem, (long long)lay.group, (long long)lay.d);
  if (smem > 48 * 1024) {
    M3_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  }
  attention_kernel<<<static_cast<unsigned>(grid), kAttnThreads, smem, stream>>>(
      q, num_heads, cache, layout, blocks, max_blocks, scale, out);
  M3_CUDA_CHECK_LAUNCH("attention_kernel");
}

}  // namespace m3::kernels::cuda
