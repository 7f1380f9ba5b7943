// Paged KV writes and causal paged attention (dense, or over MSA-selected blocks), GQA.
// The fast path (group <= 16, head_dim % 4 == 0, head_dim <= 128) is split-KV: one CTA of four
// warps per (token, kv head, split); each warp streams 32-key tiles (K via cp.async into shared
// memory, one lane per key for the scores; V straight from global memory, one lane per 4 output
// dims) with its own online fp32 softmax; the CTA merges its warps, and
// attention_combine_kernel merges the splits. Other geometries use the generic kernel: one CTA per
// (token, kv head), 32-key chunks. Those two read an fp32 cache; a bf16 / fp8 cache (every format
// of docs/KV_CACHE.md) takes attention_mma_kernel at head_dim 128 and groups <= 16 (tensor
// cores, q and P rounded as the doc allows) and the generic kernel, templated on the element
// type, elsewhere; its dense rows go to attention_decode_tma_kernel (msa_sparse_prefill.cu:
// per-warp rings filled by TMA boxes, the same split format) where the pages are a multiple of
// 16 slots and the tensor maps can be made; the selected rows of decode tokens over such a cache
// take attention_cta_kernel (8 warps per 128 keys, clusters of up to 16 CTAs). kv_write stores
// every format with the CPU twin's bytes.
#include <algorithm>
#include <utility>

#include <cooperative_groups.h>

#include "core/env.h"
#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/attn_flash.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

constexpr int kKvThreads = 256;
constexpr int kAttnThreads = 256;
constexpr int kChunk = 32;  // keys per shared-memory pass

// One CTA per token. inv_k / inv_v: 1 / k_scale, 1 / v_scale (host fp32). An fp8 index-K row
// gets its per-token power-of-two scale (docs/KV_CACHE.md).
template <class T, class TI>
__global__ void __launch_bounds__(kKvThreads)
    kv_write_kernel(KvPages c, TokenLayout L, const float* __restrict__ k,
                    const float* __restrict__ v, const float* __restrict__ ik, float inv_k,
                    float inv_v) {
  using E = detail::KvElem<T>;
  using EI = detail::KvElem<TI>;
  __shared__ float red[32];
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
    E::store(c.k_as<T>(), slot * row + i, k[t * row + i], inv_k);
    E::store(c.v_as<T>(), slot * row + i, v[t * row + i], inv_v);
  }
  if (ik != nullptr) {
    const float* x = ik + t * c.index_dim;
    float inv = 1.f;
    if constexpr (EI::kDtype == KvDtype::kFp8) {
      float amax = 0.f;
      for (int64_t i = threadIdx.x; i < c.index_dim; i += blockDim.x)
        amax = fmaxf(amax, fabsf(x[i]));
      amax = detail::block_max(amax, red);
      const float sc = fp8_row_scale(amax);
      if (threadIdx.x == 0) c.ik_scale[slot] = sc;
      inv = 1.0f / sc;  // a power of two: exact
    }
    for (int64_t i = threadIdx.x; i < c.index_dim; i += blockDim.x)
      EI::store(c.ik_as<TI>(), slot * c.index_dim + i, x[i], inv);
  }
}

// Shared memory of one attention block, in floats (slots first: 8-byte aligned).
struct AttnSmem {
  int64_t group, d;
  __host__ __device__ int64_t kd() const { return d + 1; }  // K rows padded: no bank conflicts
  __host__ __device__ size_t bytes() const {
    return kChunk * sizeof(int64_t) + sizeof(float) * (group * d + kChunk * kd() + kChunk * d +
                                                       group * kChunk + group * d + 3 * group);
  }
};

// T: the cache's storage type (kv_format.cuh); a bf16 / fp8 cache takes the query rounded to
// bf16 (docs/KV_CACHE.md), as the CPU op does.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_generic_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c,
                             TokenLayout L, const int32_t* __restrict__ blocks, int64_t max_blocks,
                             float scale, float* __restrict__ out) {
  using E = detail::KvElem<T>;
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
    qs[e] = (E::kDtype == KvDtype::kF32 ? qg[e] : detail::round_bf16(qg[e])) * scale;
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
        ks[j * kd + i] = E::load(c.k_as<T>(), src, c.k_scale);
        vs[j * d + i] = E::load(c.v_as<T>(), src, c.v_scale);
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

// ---- split-KV fast path ----
constexpr int kSplitWarps = 4;
constexpr int kSplitThreads = kSplitWarps * detail::kWarp;
constexpr int kTile = 32;         // keys per warp tile: one per lane for the scores
constexpr int kMaxSplits = 256;   // the combine kernel keeps one weight per split in smem
constexpr int kFastMaxDim = 128;  // one lane per 4 output dims
constexpr int kFastMaxGroup = 16;
constexpr int kCombineThreads = 128;

// Shared memory of one split CTA, in floats: q·scale transposed [D][G]; per warp a K tile
// [kTile][D + 4] (rows padded: lane-per-row float4 reads are conflict-free) then the tile's
// probabilities [kTile][G]; per-warp softmax states and merge weights [warps][G] x 3; the CTA's
// max and sum [G] x 2. Every region is a multiple of 4 floats (16-byte aligned).
struct SplitSmem {
  int g, d;
  __host__ __device__ int q_floats() const { return d * g; }
  __host__ __device__ int warp_floats() const { return kTile * (d + 4) + kTile * g; }
  __host__ __device__ int state_offset() const { return q_floats() + kSplitWarps * warp_floats(); }
  __host__ __device__ size_t bytes() const {
    return sizeof(float) * (state_offset() + 3 * kSplitWarps * g + 2 * g);
  }
};

// G: the GQA group rounded up to a power of two (extra heads have q = 0 and are not stored).
// Split `blockIdx.y` of (token, kv head) `blockIdx.x` covers tiles [tile0, tile1) of the token's
// key list: dense, positions 0..p; selected, entry e of the list covers keys e*bs .. e*bs+bs-1 of
// block sel[e] (none for -1), each masked to positions <= p. Warps take every 4th tile.
template <int G>
__global__ void __launch_bounds__(kSplitThreads)
    attention_split_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c, TokenLayout L,
                           const int32_t* __restrict__ blocks, int64_t max_blocks, float scale,
                           int64_t max_kv_len, int num_splits, float* __restrict__ part_o,
                           float* __restrict__ part_ml, float* __restrict__ out) {
  using detail::kWarp;
  extern __shared__ __align__(16) float split_smem[];
  const int D = static_cast<int>(c.head_dim);
  const int64_t nkv = c.num_kv_heads, bs = c.page_size;
  const int group = static_cast<int>(num_heads / nkv);
  const SplitSmem lay{G, D};
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* qT = split_smem;
  float* Ks = split_smem + lay.q_floats() + warp * lay.warp_floats();
  float* Ps = Ks + kTile * (D + 4);
  float* Wm = split_smem + lay.state_offset();
  float* Wl = Wm + kSplitWarps * G;
  float* Wt = Wl + kSplitWarps * G;
  float* Ms = Wt + kSplitWarps * G;
  float* Ls = Ms + G;

  const int64_t t = blockIdx.x / nkv, g = blockIdx.x % nkv;
  const int split = blockIdx.y;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  M3_DEVICE_CHECK(max_kv_len <= 0 || p < max_kv_len,
                  "attention: position %d beyond max_kv_len %lld", p,
                  static_cast<long long>(max_kv_len));
  const int64_t nb = p / bs + 1;
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int32_t* sel = blocks ? blocks + (t * nkv + g) * max_blocks : nullptr;
  const int64_t nvirt = sel ? max_blocks * bs : static_cast<int64_t>(p) + 1;
  const int64_t ntiles = (nvirt + kTile - 1) / kTile;
  const int64_t per = (ntiles + num_splits - 1) / num_splits;
  const int64_t tile0 = split * per, tile1 = min(ntiles, tile0 + per);

  // q·scale (as the CPU op: scale first, then the dot), transposed to [D][G]; extra heads 0.
  // Read as float4 in memory order, all of a thread's loads issued before any store.
  const float4* qg = reinterpret_cast<const float4*>(q + (t * num_heads + g * group) * D);
  constexpr int kQPerThread = (kFastMaxGroup * kFastMaxDim / 4 + kSplitThreads - 1) / kSplitThreads;
  const int nq4 = G * D / 4, real4 = group * D / 4;
  float4 qv[kQPerThread];
#pragma unroll
  for (int u = 0; u < kQPerThread; ++u) {
    const int e = threadIdx.x + u * kSplitThreads;
    qv[u] = e < real4 ? qg[e] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int u = 0; u < kQPerThread; ++u) {
    const int e = threadIdx.x + u * kSplitThreads;
    if (e >= nq4) continue;
    const int h = (e * 4) / D, i = (e * 4) % D;  // D % 4 == 0: the 4 values share a head
    qT[(i + 0) * G + h] = qv[u].x * scale;
    qT[(i + 1) * G + h] = qv[u].y * scale;
    qT[(i + 2) * G + h] = qv[u].z * scale;
    qT[(i + 3) * G + h] = qv[u].w * scale;
  }
  __syncthreads();

  float m[G], lsum[G], acc[G][4];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    lsum[h] = 0.f;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) acc[h][cc] = 0.f;
  }
  const bool has_d = lane * 4 < D;
  for (int64_t tt = tile0 + warp; tt < tile1; tt += kSplitWarps) {
    // This lane's key: its cache row (in units of D floats), or -1 if masked.
    const int64_t vk = tt * kTile + lane;
    int64_t row = -1;
    if (vk < nvirt) {
      const int64_t o = vk % bs;
      int64_t b = vk / bs;
      if (sel) {
        b = sel[b];
        M3_DEVICE_CHECK(b < nb, "attention: selected block %lld is in the future (token at %d)",
                        static_cast<long long>(b), p);
      }
      if (b >= 0 && b * bs + o <= p) row = (static_cast<int64_t>(table[b]) * bs + o) * nkv + g;
    }
    if (__ballot_sync(0xffffffffu, row >= 0) == 0) continue;  // a fully masked tile
    for (int r = 0; r < kTile; ++r) {
      const int64_t rr = __shfl_sync(0xffffffffu, row, r);
      if (rr < 0) continue;
      for (int cix = lane; cix < D / 4; cix += kWarp)
        detail::cp_async16(Ks + r * (D + 4) + cix * 4, c.k_as<float>() + rr * D + cix * 4);
    }
    detail::cp_async_commit();
    detail::cp_async_wait<0>();
    __syncwarp();

    // Scores of this lane's key for every head, summed over i in order as the CPU op does.
    float sc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) sc[h] = 0.f;
    const float* kr = Ks + lane * (D + 4);
    for (int i = 0; i < D; i += 4) {
      const float4 k4 = *reinterpret_cast<const float4*>(kr + i);
      const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        const float* qi = qT + (i + ii) * G;
        if constexpr (G % 4 == 0) {
#pragma unroll
          for (int h4 = 0; h4 < G / 4; ++h4) {
            const float4 q4 = reinterpret_cast<const float4*>(qi)[h4];
            sc[4 * h4 + 0] = fmaf(q4.x, kv[ii], sc[4 * h4 + 0]);
            sc[4 * h4 + 1] = fmaf(q4.y, kv[ii], sc[4 * h4 + 1]);
            sc[4 * h4 + 2] = fmaf(q4.z, kv[ii], sc[4 * h4 + 2]);
            sc[4 * h4 + 3] = fmaf(q4.w, kv[ii], sc[4 * h4 + 3]);
          }
        } else {
#pragma unroll
          for (int h = 0; h < G; ++h) sc[h] = fmaf(qi[h], kv[ii], sc[h]);
        }
      }
    }
    // Online softmax of the warp (m is warp-uniform; lsum is this lane's share of the sum).
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float sv = row >= 0 ? sc[h] : -INFINITY;
      const float nm = fmaxf(m[h], detail::warp_max(sv));
      const float corr = m[h] == -INFINITY ? 0.f : expf(m[h] - nm);
      const float pr = row >= 0 ? expf(sv - nm) : 0.f;
      lsum[h] = lsum[h] * corr + pr;
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) acc[h][cc] *= corr;
      m[h] = nm;
      Ps[lane * G + h] = pr;
    }
    __syncwarp();
    // acc[h][:] += p[h][j] * v_j[lane*4 .. lane*4+3]; V rows straight from global memory (a
    // warp reads one 4·D-byte row per key, coalesced), 8 rows in flight. Masked rows are not
    // read (their p is 0).
    for (int j0 = 0; j0 < kTile; j0 += 8) {
      float4 v4[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int64_t rr = __shfl_sync(0xffffffffu, row, j0 + u);
        v4[u] = (rr >= 0 && has_d)
                    ? __ldg(reinterpret_cast<const float4*>(c.v_as<float>() + rr * D) + lane)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float* pj = Ps + (j0 + u) * G;
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float w = pj[h];
          acc[h][0] = fmaf(w, v4[u].x, acc[h][0]);
          acc[h][1] = fmaf(w, v4[u].y, acc[h][1]);
          acc[h][2] = fmaf(w, v4[u].z, acc[h][2]);
          acc[h][3] = fmaf(w, v4[u].w, acc[h][3]);
        }
      }
    }
    __syncwarp();  // Ks and Ps are rewritten by the next tile
  }
#pragma unroll
  for (int h = 0; h < G; ++h) lsum[h] = detail::warp_sum(lsum[h]);

  // Merge the warps: each parks its unnormalised output [G][D] in its (now free) K tile.
  float* Ow = Ks;
  if (has_d) {
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) Ow[h * D + lane * 4 + cc] = acc[h][cc];
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      Wm[warp * G + h] = m[h];
      Wl[warp * G + h] = lsum[h];
    }
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int h = threadIdx.x;
    float mx = -INFINITY;
    for (int w = 0; w < kSplitWarps; ++w) mx = fmaxf(mx, Wm[w * G + h]);
    float l = 0.f;
    for (int w = 0; w < kSplitWarps; ++w) {
      const float wt = Wm[w * G + h] == -INFINITY ? 0.f : expf(Wm[w * G + h] - mx);
      Wt[w * G + h] = wt;
      l += wt * Wl[w * G + h];
    }
    Ms[h] = mx;
    Ls[h] = l;
  }
  __syncthreads();
  const int64_t idx = (t * nkv + g) * num_splits + split;
  for (int e = threadIdx.x; e < group * D; e += blockDim.x) {
    const int h = e / D, i = e % D;
    float o = 0.f;
    for (int w = 0; w < kSplitWarps; ++w)
      o = fmaf(Wt[w * G + h], split_smem[lay.q_floats() + w * lay.warp_floats() + h * D + i], o);
    if (num_splits == 1) {
      out[(t * num_heads + g * group + h) * D + i] = o * (1.0f / Ls[h]);
    } else {
      part_o[(idx * group + h) * D + i] = o;
    }
  }
  if (num_splits > 1 && threadIdx.x < group) {
    part_ml[(idx * group + threadIdx.x) * 2] = Ms[threadIdx.x];
    part_ml[(idx * group + threadIdx.x) * 2 + 1] = Ls[threadIdx.x];
  }
}

// Merges the splits of one (token, query head): out = Σ_s w_s o_s / Σ_s w_s l_s with
// w_s = exp(m_s - max m) (0 for an empty split).
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             int64_t num_heads, int64_t nkv, int64_t d, int num_splits,
                             float* __restrict__ out, TokenLayout L, bool skip_multi) {
  __shared__ float wts[kMaxSplits];
  __shared__ float red[32];
  detail::pdl_enter();
  const int64_t t = blockIdx.x / num_heads, hq = blockIdx.x % num_heads;
  if (skip_multi && detail::in_multi_run(L, t)) return;  // written by the query-tiled kernel
  const int64_t group = num_heads / nkv, g = hq / group, h = hq % group;
  const int64_t base = (t * nkv + g) * num_splits;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s < num_splits; s += blockDim.x)
    mx = fmaxf(mx, part_ml[((base + s) * group + h) * 2]);
  mx = detail::block_max(mx, red);
  float l = 0.f;
  for (int s = threadIdx.x; s < num_splits; s += blockDim.x) {
    const float ms = part_ml[((base + s) * group + h) * 2];
    const float w = ms == -INFINITY ? 0.f : expf(ms - mx);
    wts[s] = w;
    l += w * part_ml[((base + s) * group + h) * 2 + 1];
  }
  l = detail::block_sum(l, red);  // also orders the wts writes before the reads below
  const float inv = 1.0f / l;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < num_splits; ++s)
      o = fmaf(wts[s], part_o[((base + s) * group + h) * d + i], o);
    out[(t * num_heads + hq) * d + i] = o * inv;
  }
}

// ---- tensor-core path: a bf16 or fp8 cache, head_dim 128, GQA group <= 16 ----
// The same split-KV grid and partial format as attention_split_kernel (the combine kernel merges
// either). Each warp takes 16-key tiles through its own ring of kStages shared-memory stages
// filled by cp.async (lanes 0-15 copy key l's K row, lanes 16-31 its V row; masked keys are
// zero-filled), so several tiles are in flight while it computes one: S[16 heads x 16 keys] =
// Q·K^T on m16n8k16 MMAs (the group's heads as rows, zero-padded to 16; q rounded to bf16, fp32
// accumulation), an online fp32 softmax per head, then O[16 x 128] += P·V with P rounded to the
// MMA type (bf16; f16 for fp8). Fragments are read from the stage as 16-byte pieces: K rows
// through kv_k_base's permutation of the dot's terms; V as four keys x 16 consecutive dims per
// lane, paired into B fragments with byte permutes, which makes the output column of lane row r
// in n-tile n the dim 16 r + n.
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * detail::kWarp;
constexpr int kMmaTile = 16;  // keys per warp step
constexpr int kMmaDim = 128;
constexpr int kMmaRows = 16;           // heads per CTA (the MMA's M)
constexpr int kPortableCluster = 8;    // the portable cluster size
constexpr int kMaxClusterSplits = 16;  // Hopper's non-portable maximum, where it schedules
constexpr int kMmaMaxPages = 1024;     // a split's page list staged in shared memory

template <class T>
struct MmaAttnSmem {
  static constexpr int kRowBytes = kMmaDim * int(sizeof(T)) + 16;  // padded: fewer bank conflicts
  static constexpr int kStageBytes = 2 * kMmaTile * kRowBytes;     // K rows, then V rows
  static constexpr int kStages = sizeof(T) == 1 ? 5 : 3;           // 2 CTAs per SM
  static constexpr int kWarpBytes = kStages * kStageBytes;
  // After the loop: the warps' outputs, then (cluster merge) the CTA's output.
  static constexpr int kMergeBytes = kMmaWarps * kMmaRows * kMmaDim * 4;
  static constexpr int kAfterBytes = kMergeBytes + kMmaRows * kMmaDim * 4;
  static constexpr int kBytes =
      kMmaWarps * kWarpBytes > kAfterBytes ? kMmaWarps* kWarpBytes : kAfterBytes;
};

// The splits of a (token, KV head) that form one thread-block cluster merge through distributed
// shared memory (after a cluster barrier): each CTA's Ms / Ls hold its running max and sum per
// head, its Oc the [group][D] output scaled to that max; CTA `rank` writes one slice of the
// group's normalised rows to out (the group's first row), with every load of an element in
// flight at once. The caller syncs the cluster again before any CTA leaves.
template <int D>
__device__ __forceinline__ void cluster_merge_splits(cooperative_groups::cluster_group& cl,
                                                     float* Ms, float* Ls, float* Oc, int group,
                                                     float* out) {
  __shared__ float Wc[kMaxClusterSplits][kMmaRows], Lt[kMmaRows];
  const int ns = static_cast<int>(cl.num_blocks());
  const int rank = static_cast<int>(cl.block_rank());
  if (threadIdx.x < group) {
    const int h = threadIdx.x;
    float mr[kMaxClusterSplits], lr[kMaxClusterSplits];
#pragma unroll
    for (int rk = 0; rk < kMaxClusterSplits; ++rk) {
      mr[rk] = rk < ns ? cl.map_shared_rank(Ms, rk)[h] : -INFINITY;
      lr[rk] = rk < ns ? cl.map_shared_rank(Ls, rk)[h] : 0.f;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int rk = 0; rk < kMaxClusterSplits; ++rk) mx = fmaxf(mx, mr[rk]);
    float lt = 0.f;
#pragma unroll
    for (int rk = 0; rk < kMaxClusterSplits; ++rk) {
      const float w = mr[rk] == -INFINITY ? 0.f : expf(mr[rk] - mx);
      Wc[rk][h] = w;
      lt += w * lr[rk];
    }
    Lt[h] = lt;
  }
  __syncthreads();
  const int total = group * D, per_rank = (total + ns - 1) / ns;
  const int e1 = min(total, (rank + 1) * per_rank);
  for (int e = rank * per_rank + threadIdx.x; e < e1; e += blockDim.x) {
    const int h = e / D;
    float v[kMaxClusterSplits];
#pragma unroll
    for (int rk = 0; rk < kMaxClusterSplits; ++rk)
      v[rk] = rk < ns ? cl.map_shared_rank(Oc, rk)[e] : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int rk = 0; rk < kMaxClusterSplits; ++rk) acc = fmaf(Wc[rk][h], v[rk], acc);
    out[e] = acc * (1.0f / Lt[h]);
  }
}

// kCluster: the splits of a (token, kv head) are one thread-block cluster (gridDim.y <= 16 CTAs);
// they merge through distributed shared memory and CTA 0 writes the output (no combine kernel,
// no workspace).
template <class T, bool kCluster>
__global__ void __launch_bounds__(kMmaThreads)
    attention_mma_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c, TokenLayout L,
                         const int32_t* __restrict__ blocks, int64_t max_blocks, float scale,
                         int64_t max_kv_len, int num_splits, float* __restrict__ part_o,
                         float* __restrict__ part_ml, float* __restrict__ out, bool skip_multi) {
  using M = detail::MmaOf<T>;
  using Sm = MmaAttnSmem<T>;
  using detail::kWarp;
  constexpr int D = kMmaDim;
  constexpr int E = M::kElemsPer16B;                      // row elements per 16-byte piece
  constexpr int KPieces = D / (4 * E);                    // K pieces per lane and key
  constexpr int KSteps = D / 16;                          // MMA k-steps of a Q·K^T dot
  constexpr int VPieces = (D / 8) * int(sizeof(T)) / 16;  // V pieces per lane and key
  constexpr int RowChunks = D * int(sizeof(T)) / 16;      // 16-byte chunks of a row
  constexpr int NT = D / 8;                               // output n-tiles
  constexpr int S = Sm::kStages;
  constexpr bool kFp8 = sizeof(T) == 1;
  extern __shared__ __align__(16) unsigned char mma_smem[];
  __shared__ float Wm[kMmaWarps][kMmaRows], Wl[kMmaWarps][kMmaRows], Wt[kMmaWarps][kMmaRows];
  __shared__ float Ms[kMmaRows], Ls[kMmaRows];
  __shared__ unsigned tile_mask[kMmaWarps][S];
  detail::pdl_enter();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads, bs = c.page_size;
  const int group = static_cast<int>(num_heads / nkv);
  const int64_t t = blockIdx.x / nkv, g = blockIdx.x % nkv;
  // The query-tiled kernel writes this token (the whole CTA leaves together).
  if (skip_multi && detail::in_multi_run(L, t)) return;
  const int split = blockIdx.y;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  M3_DEVICE_CHECK(max_kv_len <= 0 || p < max_kv_len,
                  "attention: position %d beyond max_kv_len %lld", p,
                  static_cast<long long>(max_kv_len));
  const int64_t nb = p / bs + 1;
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int32_t* sel = blocks ? blocks + (t * nkv + g) * max_blocks : nullptr;
  const int64_t nvirt = sel ? max_blocks * bs : static_cast<int64_t>(p) + 1;
  const int64_t ntiles = (nvirt + kMmaTile - 1) / kMmaTile;
  const int64_t per = (ntiles + num_splits - 1) / num_splits;
  const int64_t tile0 = split * per, tile1 = min(ntiles, tile0 + per);
  // This warp's tiles: tile0 + warp + i * kMmaWarps, i < my_tiles.
  const int64_t first = tile0 + warp;
  const int my_tiles =
      first < tile1 ? static_cast<int>((tile1 - first + kMmaWarps - 1) / kMmaWarps) : 0;

  // Q fragments of the 8 k-steps: rows r and r + 8 (heads of the group; 0 past it). Loaded
  // first: their global reads overlap the page lookups below.
  const float* qg = q + (t * num_heads + g * group) * D;
  uint32_t qa[KSteps][4];
  auto qv = [&](int h, int i) { return h < group ? detail::round_bf16(qg[h * D + i]) : 0.f; };
#pragma unroll
  for (int ks = 0; ks < KSteps; ++ks) {
    const int b = detail::kv_k_base<E>(ks, cq);
    qa[ks][0] = M::pack(qv(r, b), qv(r, b + 1));
    qa[ks][1] = M::pack(qv(r + 8, b), qv(r + 8, b + 1));
    qa[ks][2] = M::pack(qv(r, b + 2), qv(r, b + 3));
    qa[ks][3] = M::pack(qv(r + 8, b + 2), qv(r + 8, b + 3));
  }

  // The pages of the split's virtual blocks, looked up once into shared memory (where they fit):
  // the loop then finds a key's row without a dependent global load. vpage = physical page
  // (-1: no block), vstart = the logical block's first position.
  __shared__ int32_t vpage[kMmaMaxPages], vstart[kMmaMaxPages];
  const int64_t vlim = sel ? max_blocks : nb;  // virtual blocks
  const int64_t vb0 = tile0 * kMmaTile / bs;
  const int64_t vb1 = tile1 > tile0 ? min(vlim, (tile1 * kMmaTile - 1) / bs + 1) : vb0;
  const bool staged = vb1 - vb0 <= kMmaMaxPages;
  if (staged) {
    for (int64_t i = threadIdx.x; i < vb1 - vb0; i += blockDim.x) {
      int64_t b = vb0 + i;
      if (sel) {
        b = sel[b];
        M3_DEVICE_CHECK(b < nb, "attention: selected block %lld is in the future (token at %d)",
                        static_cast<long long>(b), p);
      }
      vpage[i] = b >= 0 ? table[b] : -1;
      vstart[i] = static_cast<int32_t>(b * bs);
    }
  }
  __syncthreads();
  // The cache row (in units of D elements) of virtual key vk, or -1 when masked.
  auto key_row = [&](int64_t vk) -> int64_t {
    if (vk >= nvirt) return -1;
    const int32_t v32 = static_cast<int32_t>(vk), bs32 = static_cast<int32_t>(bs);
    const int32_t o = v32 % bs32, vb = v32 / bs32;
    if (staged) {
      const int32_t page = vpage[vb - vb0];
      if (page < 0 || vstart[vb - vb0] + o > p) return -1;
      return (static_cast<int64_t>(page) * bs + o) * nkv + g;
    }
    int64_t b = vb;
    if (sel) {
      b = sel[b];
      M3_DEVICE_CHECK(b < nb, "attention: selected block %lld is in the future (token at %d)",
                      static_cast<long long>(b), p);
    }
    if (b < 0 || b * bs + o > p) return -1;
    return (static_cast<int64_t>(table[b]) * bs + o) * nkv + g;
  };
  auto tile_row = [&](int i) -> int64_t {
    return i < my_tiles
               ? key_row((first + static_cast<int64_t>(i) * kMmaWarps) * kMmaTile + lane % kMmaTile)
               : -1;
  };
  unsigned char* ring = mma_smem + warp * Sm::kWarpBytes;
  const T* kbase = c.k_as<T>();
  const T* vbase = c.v_as<T>();
  // Tile i into stage i % S: its 16 K rows then its 16 V rows, each row copied by consecutive
  // lanes (16-byte chunks: whole 32-byte sectors per request); masked keys zero-filled.
  auto issue = [&](int i, int64_t row) {
    const unsigned vm = __ballot_sync(0xffffffffu, row >= 0) & 0xffffu;
    unsigned char* st = ring + (i % S) * Sm::kStageBytes;
    if (lane == 0) tile_mask[warp][i % S] = vm;
    if (vm != 0) {
      constexpr int RowsPerCopy = kWarp / RowChunks;
      const int sub = lane / RowChunks, ch = lane % RowChunks;
#pragma unroll
      for (int it = 0; it < 2 * kMmaTile / RowsPerCopy; ++it) {
        const int rr = it * RowsPerCopy + sub;  // K rows 0..15, V rows 16..31
        const int64_t kr = __shfl_sync(0xffffffffu, row, rr % kMmaTile);
        const T* src = (rr >= kMmaTile ? vbase : kbase) + (kr >= 0 ? kr : 0) * D;
        detail::cp_async16_zfill(st + rr * Sm::kRowBytes + ch * 16,
                                 reinterpret_cast<const uint4*>(src) + ch, kr >= 0);
      }
    }
    detail::cp_async_commit();
  };

  // Start the ring: rows of tiles 0..S-2 issued, tile S-1's row read ahead.
  int64_t ahead = tile_row(0);
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    const int64_t row = ahead;
    ahead = tile_row(i + 1);
    issue(i, row);
  }

  const float smul = kFp8 ? scale * c.k_scale : scale;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows r, r + 8
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  for (int i = 0; i < my_tiles; ++i) {
    // Refill the stage freed by tile i - 1 with tile i + S - 1, then wait for tile i.
    {
      const int64_t row = ahead;
      ahead = tile_row(i + S);
      issue(i + S - 1, row);
      // Tile i + S's rows into L2 now; its copy is issued next iteration.
      if (ahead >= 0) {
        const unsigned char* pr =
            reinterpret_cast<const unsigned char*>((lane < kMmaTile ? kbase : vbase) + ahead * D);
#pragma unroll
        for (int ln = 0; ln < D * int(sizeof(T)) / 128; ++ln) detail::prefetch_l2(pr + ln * 128);
      }
    }
    detail::cp_async_wait<S - 1>();
    __syncwarp();
    const unsigned vm = tile_mask[warp][i % S];
    if (vm != 0) {
      const unsigned char* st = ring + (i % S) * Sm::kStageBytes;
      float x[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t kb[2 * KSteps];
        const unsigned char* kr = st + (nt * 8 + r) * Sm::kRowBytes;
#pragma unroll
        for (int j = 0; j < KPieces; ++j)
          M::unpack(*reinterpret_cast<const uint4*>(kr + (j * 4 + cq) * 16), kb + j * (E / 2));
#pragma unroll
        for (int e = 0; e < 4; ++e) x[nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSteps; ++ks) M::mma(x[nt], qa[ks], kb[2 * ks], kb[2 * ks + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + 2 * cq + (e & 1);
          x[nt][e] = (vm >> key) & 1u ? x[nt][e] * smul : -INFINITY;
        }
      }
      // Online softmax of rows r (e = 0, 1) and r + 8 (e = 2, 3); a quad holds a row's keys.
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx =
            fmaxf(fmaxf(x[0][2 * hh], x[0][2 * hh + 1]), fmaxf(x[1][2 * hh], x[1][2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float nm = fmaxf(m[hh], mx);
        const float corr = m[hh] == -INFINITY ? 0.f : expf(m[hh] - nm);
        m[hh] = nm;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const float pr = x[nt][e] == -INFINITY ? 0.f : expf(x[nt][e] - nm);
            x[nt][e] = pr;
            sum += pr;
          }
        l[hh] = l[hh] * corr + sum;
        if (corr != 1.f) {
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            o[n][2 * hh] *= corr;
            o[n][2 * hh + 1] *= corr;
          }
        }
      }
      // O += P·V: P's A fragment is the S accumulator repacked; V's B fragments pair two keys.
      const uint32_t pa[4] = {M::pack(x[0][0], x[0][1]), M::pack(x[0][2], x[0][3]),
                              M::pack(x[1][0], x[1][1]), M::pack(x[1][2], x[1][3])};
      uint32_t vv[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int key = 2 * cq + (u & 1) + (u >> 1) * 8;
        const unsigned char* vr = st + (kMmaTile + key) * Sm::kRowBytes + 16 * r * int(sizeof(T));
#pragma unroll
        for (int j = 0; j < VPieces; ++j)
          M::unpack(*reinterpret_cast<const uint4*>(vr + 16 * j), vv[u] + j * (E / 2));
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const unsigned selb = (n & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(vv[0][n / 2], vv[1][n / 2], selb);
        const uint32_t b1 = __byte_perm(vv[2][n / 2], vv[3][n / 2], selb);
        M::mma(o[n], pa, b0, b1);
      }
    }
    __syncwarp();  // the stage is refilled by the next iteration
  }
  detail::cp_async_wait<0>();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
  __syncthreads();  // every warp is done with its ring: the merge reuses the memory
  // Merge the warps (as attention_split_kernel): each parks its rows in Ow.
  float* Ow = reinterpret_cast<float*>(mma_smem);
  float* ow = Ow + warp * kMmaRows * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    ow[r * D + (2 * cq) * 16 + n] = o[n][0];
    ow[r * D + (2 * cq + 1) * 16 + n] = o[n][1];
    ow[(r + 8) * D + (2 * cq) * 16 + n] = o[n][2];
    ow[(r + 8) * D + (2 * cq + 1) * 16 + n] = o[n][3];
  }
  detail::merge_warp_stats<kMmaWarps, kMmaRows, false>(warp, lane, m, l, Wm, Wl, Wt, Ms, Ls);
  const float vmul = kFp8 ? c.v_scale : 1.f;
  if constexpr (kCluster) {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    float* Oc = reinterpret_cast<float*>(mma_smem + Sm::kMergeBytes);  // [group][D]
    for (int e = threadIdx.x; e < group * D; e += blockDim.x) {
      const int h = e / D, i = e % D;
      float acc = 0.f;
      for (int w = 0; w < kMmaWarps; ++w) acc = fmaf(Wt[w][h], Ow[(w * kMmaRows + h) * D + i], acc);
      Oc[e] = acc * vmul;
    }
    cl.sync();
    cluster_merge_splits<D>(cl, Ms, Ls, Oc, group, out + (t * num_heads + g * group) * D);
    cl.sync();  // every CTA keeps its shared memory until the others have read it
    return;
  }
  detail::write_split_rows<kMmaWarps, kMmaRows, D, false>(
      Ow, Wt, Ms, Ls, group, vmul, num_splits, (t * nkv + g) * num_splits + split,
      out + (t * num_heads + g * group) * D, part_o, part_ml);
}

// ---- CTA-cooperative tensor-core path (bf16 / fp8 cache, head_dim 128, group <= 16) ----
// One CTA of 8 warps per (token, kv head, split) takes its keys in rounds of 128 (8 tiles of
// 16): every warp copies the K and V rows of its own tile (cp.async, masked keys zero-filled;
// the whole round is in flight at once), computes S = Q·K^T of that tile for the 16 head rows
// on m16n8k16 MMAs (q from shared memory, rounded as attention_mma_kernel rounds it), and the
// CTA shares one running max per head: the warps' tile maxima meet in shared memory, each warp
// writes its tile's probabilities P (rounded to the MMA type; the sums keep fp32) into a
// [16 heads x 128 keys] tile, and then every warp computes O[16 heads x its 16 dims] += P·V over
// the whole round (ldmatrix for P and, bf16, for V; fp8 V converted pairwise). No per-warp
// output merge: each warp owns its 16 output dims. Rounds run one after the other (M3's top-16
// of 128-token pages is one round per CTA of a 16-CTA cluster). kCluster: the splits of a
// (token, kv head) are one thread-block cluster merged through distributed shared memory (no
// combine kernel); otherwise one split writes the output. Serves the selected rows of decode
// tokens only: for dense rows a ring of rounds in this kernel measured slower than
// attention_mma_kernel (CTA-wide barriers every round).
constexpr int kCtaWarps = 8;
constexpr int kCtaThreads = kCtaWarps * detail::kWarp;
constexpr int kRoundTiles = kCtaWarps;              // tiles of kMmaTile keys per round
constexpr int kRoundKeys = kRoundTiles * kMmaTile;  // 128

template <class T>
struct CtaAttnSmem {
  static constexpr int kRowBytes = kMmaDim * int(sizeof(T)) + 16;  // padded: fewer conflicts
  static constexpr int kStageBytes = 2 * kRoundKeys * kRowBytes;   // K rows, then V rows
  static constexpr int kHalfRowBytes = kMmaDim * 2 + 16;           // a row of 16-bit q / P
  static constexpr int kQOffset = kStageBytes;
  static constexpr int kPOffset = kQOffset + kMmaRows * kHalfRowBytes;
  static constexpr int kBytes = kPOffset + kMmaRows * kHalfRowBytes;
  static_assert(kRoundKeys == kMmaDim, "P rows share the q row stride");
  static_assert(kMmaRows * kMmaDim * 4 <= kStageBytes, "the cluster merge reuses stage 0");
};

template <class T, bool kCluster>
__global__ void __launch_bounds__(kCtaThreads, 2)
    attention_cta_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c, TokenLayout L,
                         const int32_t* __restrict__ blocks, int64_t max_blocks, float scale,
                         int64_t max_kv_len, int num_splits, float* __restrict__ out,
                         bool skip_multi) {
  using M = detail::MmaOf<T>;
  using Sm = CtaAttnSmem<T>;
  using detail::kWarp;
  constexpr int D = kMmaDim;
  constexpr int E = M::kElemsPer16B;                  // row elements per 16-byte piece
  constexpr int KPieces = D / (4 * E);                // K pieces per lane and key
  constexpr int KSteps = D / 16;                      // MMA k-steps of a Q·K^T dot
  constexpr int RowChunks = D * int(sizeof(T)) / 16;  // 16-byte chunks of a row
  constexpr bool kFp8 = sizeof(T) == 1;
  extern __shared__ __align__(16) unsigned char cta_smem[];
  __shared__ float mw[kCtaWarps][kMmaRows], lw[kCtaWarps][kMmaRows];
  __shared__ unsigned tmask[kRoundTiles];
  __shared__ float Ms[kMmaRows], Ls[kMmaRows];
  detail::pdl_enter();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads, bs = c.page_size;
  const int group = static_cast<int>(num_heads / nkv);
  const int64_t t = blockIdx.x / nkv, g = blockIdx.x % nkv;
  // The query-tiled kernel writes this token (the whole CTA, and cluster, leaves together).
  if (skip_multi && detail::in_multi_run(L, t)) return;
  const int split = blockIdx.y;

  // The group's q rows (fp32), two float4 per thread, loaded first: they overlap the lookups.
  const float4* qg = reinterpret_cast<const float4*>(q + (t * num_heads + g * group) * D);
  float4 qv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int e = threadIdx.x + u * kCtaThreads;  // < 16 rows x 32 float4
    qv[u] = e < group * (D / 4) ? qg[e] : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  const int32_t p = L.positions[t], s = L.seq_ids[t];
  M3_DEVICE_CHECK(max_kv_len <= 0 || p < max_kv_len,
                  "attention: position %d beyond max_kv_len %lld", p,
                  static_cast<long long>(max_kv_len));
  const int64_t nb = p / bs + 1;
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int32_t* sel = blocks ? blocks + (t * nkv + g) * max_blocks : nullptr;
  const int64_t nvirt = sel ? max_blocks * bs : static_cast<int64_t>(p) + 1;
  const int64_t ntiles = (nvirt + kMmaTile - 1) / kMmaTile;
  // Splits cover whole rounds.
  const int64_t per =
      ((ntiles + num_splits - 1) / num_splits + kRoundTiles - 1) / kRoundTiles * kRoundTiles;
  const int64_t tile0 = split * per, tile1 = min(ntiles, tile0 + per);
  const int nrounds =
      tile1 > tile0 ? static_cast<int>((tile1 - tile0 + kRoundTiles - 1) / kRoundTiles) : 0;

  // The cache row (in units of D elements) of virtual key vk, or -1 when masked.
  // 32-bit index arithmetic (virtual keys are below 2^31): the lookup heads the load chain.
  auto key_row = [&](int64_t vk) -> int64_t {
    if (vk >= nvirt) return -1;
    const int32_t v32 = static_cast<int32_t>(vk), bs32 = static_cast<int32_t>(bs);
    const int32_t o = v32 % bs32;
    int32_t b = v32 / bs32;
    if (sel) {
      b = sel[b];
      M3_DEVICE_CHECK(b < nb, "attention: selected block %d is in the future (token at %d)", b, p);
    }
    if (b < 0 || b * bs32 + o > p) return -1;
    return (static_cast<int64_t>(table[b]) * bs + o) * nkv + g;
  };
  // This lane's key (lane % 16) of this warp's tile in round rd.
  auto round_row = [&](int rd) -> int64_t {
    const int64_t tt = tile0 + static_cast<int64_t>(rd) * kRoundTiles + warp;
    return rd < nrounds && tt < tile1 ? key_row(tt * kMmaTile + lane % kMmaTile) : -1;
  };
  unsigned char* stages = cta_smem;
  unsigned char* qs = cta_smem + Sm::kQOffset;
  unsigned char* ps = cta_smem + Sm::kPOffset;
  const T* kbase = c.k_as<T>();
  const T* vbase = c.v_as<T>();
  // Round rd into the stage: this warp's 16 K rows and 16 V rows (K rows of the stage first,
  // then V rows, tile w at rows 16 w ..), each row copied by consecutive lanes; masked keys
  // zero-filled (P·V multiplies them by 0). The next round's rows are looked up meanwhile.
  int64_t ahead = round_row(0);
  auto issue = [&](int rd) {
    const int64_t row = ahead;
    ahead = round_row(rd + 1);
    const unsigned vm = __ballot_sync(0xffffffffu, row >= 0) & 0xffffu;
    unsigned char* st = stages;
    if (lane == 0) tmask[warp] = vm;
    if (vm != 0) {
      constexpr int RowsPerCopy = kWarp / RowChunks;
      const int sub = lane / RowChunks, ch = lane % RowChunks;
#pragma unroll
      for (int it = 0; it < 2 * kMmaTile / RowsPerCopy; ++it) {
        const int rr = it * RowsPerCopy + sub;  // K rows 0..15, V rows 16..31
        const int64_t kr = __shfl_sync(0xffffffffu, row, rr % kMmaTile);
        const bool is_v = rr >= kMmaTile;
        const T* src = (is_v ? vbase : kbase) + (kr >= 0 ? kr : 0) * D;
        unsigned char* dst =
            st + ((is_v ? kRoundKeys : 0) + warp * kMmaTile + rr % kMmaTile) * Sm::kRowBytes;
        detail::cp_async16_zfill(dst + ch * 16, reinterpret_cast<const uint4*>(src) + ch, kr >= 0);
      }
    }
    detail::cp_async_commit();
  };
  if (nrounds > 0) issue(0);  // in flight while q is staged

    // q rounded to bf16 (as the CPU op), stored as the MMA's 16-bit type, rows of 128.
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int e = threadIdx.x + u * kCtaThreads;
    const int h = e / (D / 4), i = (e % (D / 4)) * 4;
    uint2 w;
    w.x = M::pack(detail::round_bf16(qv[u].x), detail::round_bf16(qv[u].y));
    w.y = M::pack(detail::round_bf16(qv[u].z), detail::round_bf16(qv[u].w));
    *reinterpret_cast<uint2*>(qs + h * Sm::kHalfRowBytes + i * 2) = w;
  }
  __syncthreads();
  // Q fragments of the 8 k-steps (kv_k_base's permutation of the dot's terms): rows r, r + 8.
  uint32_t qa[KSteps][4];
#pragma unroll
  for (int ks = 0; ks < KSteps; ++ks) {
    const int b = detail::kv_k_base<E>(ks, cq);
    const uint2 lo = *reinterpret_cast<const uint2*>(qs + r * Sm::kHalfRowBytes + b * 2);
    const uint2 hi = *reinterpret_cast<const uint2*>(qs + (r + 8) * Sm::kHalfRowBytes + b * 2);
    qa[ks][0] = lo.x;
    qa[ks][1] = hi.x;
    qa[ks][2] = lo.y;
    qa[ks][3] = hi.y;
  }

  const float smul = kFp8 ? scale * c.k_scale : scale;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows r, r + 8 (CTA-wide values)
  float o[2][4];                                           // [n-tile][C fragment]
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  // Lane addresses of the P·V fragment loads (ldmatrix: lane L gives row L % 8 of matrix L / 8).
  const int mi = lane / 8, mr = lane % 8;
  const uint32_t p_addr =
      detail::smem_addr(ps + ((mi & 1) * 8 + mr) * Sm::kHalfRowBytes + (mi >> 1) * 8 * 2);

  for (int rd = 0; rd < nrounds; ++rd) {
    if (rd > 0) {
      __syncthreads();  // every warp is done with the stage of round rd - 1
      issue(rd);
    }
    detail::cp_async_wait<0>();
    __syncwarp();
    const unsigned char* st = stages;
    const unsigned vm = tmask[warp];
    // S of this warp's tile: rows r / r + 8, keys nt * 8 + 2 cq (+1).
    float x[2][4];
    if (vm != 0) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t kb[2 * KSteps];
        const unsigned char* kr = st + (warp * kMmaTile + nt * 8 + r) * Sm::kRowBytes;
#pragma unroll
        for (int j = 0; j < KPieces; ++j)
          M::unpack(*reinterpret_cast<const uint4*>(kr + (j * 4 + cq) * 16), kb + j * (E / 2));
#pragma unroll
        for (int e = 0; e < 4; ++e) x[nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSteps; ++ks) M::mma(x[nt], qa[ks], kb[2 * ks], kb[2 * ks + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + 2 * cq + (e & 1);
          x[nt][e] = (vm >> key) & 1u ? x[nt][e] * smul : -INFINITY;
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[nt][e] = -INFINITY;
    }
    // The tile's maximum per row (a quad holds a row's keys), shared through mw.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx =
          fmaxf(fmaxf(x[0][2 * hh], x[0][2 * hh + 1]), fmaxf(x[1][2 * hh], x[1][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (cq == 0) mw[warp][r + 8 * hh] = mx;
    }
    __syncthreads();  // the round's tile maxima and every warp's V rows are visible
    float nm[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float cm = -INFINITY;
#pragma unroll
      for (int w = 0; w < kCtaWarps; ++w) cm = fmaxf(cm, mw[w][r + 8 * hh]);
      nm[hh] = fmaxf(m[hh], cm);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float pr = x[nt][e] == -INFINITY ? 0.f : expf(x[nt][e] - nm[hh]);
          x[nt][e] = pr;
          sum += pr;
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (cq == 0) lw[warp][r + 8 * hh] = sum;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      unsigned char* pr = ps + (warp * kMmaTile + nt * 8 + 2 * cq) * 2;
      *reinterpret_cast<uint32_t*>(pr + r * Sm::kHalfRowBytes) = M::pack(x[nt][0], x[nt][1]);
      *reinterpret_cast<uint32_t*>(pr + (r + 8) * Sm::kHalfRowBytes) = M::pack(x[nt][2], x[nt][3]);
    }
    __syncthreads();  // P and the tile sums are visible
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float cl = 0.f;
#pragma unroll
      for (int w = 0; w < kCtaWarps; ++w) cl += lw[w][r + 8 * hh];
      const float corr = m[hh] == -INFINITY ? 0.f : expf(m[hh] - nm[hh]);
      l[hh] = l[hh] * corr + cl;
      m[hh] = nm[hh];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        o[j][2 * hh] *= corr;
        o[j][2 * hh + 1] *= corr;
      }
    }
    // O[:, this warp's 16 dims] += P·V over the round's tiles (fully masked tiles skipped).
    const unsigned char* vst = st + kRoundKeys * Sm::kRowBytes;
#pragma unroll
    for (int kk = 0; kk < kRoundTiles; ++kk) {
      if (tmask[kk] == 0) continue;
      uint32_t pa[4];
      detail::ldmatrix_x4(p_addr + kk * kMmaTile * 2, pa[0], pa[1], pa[2], pa[3]);
      if constexpr (!kFp8) {
        // Matrices: keys 0-7 / 8-15 of the tile x dims 16 w + 0-7, then 16 w + 8-15.
        uint32_t b[4];
        const unsigned char* va = vst + (kk * kMmaTile + (mi & 1) * 8 + mr) * Sm::kRowBytes +
                                  (warp * 16 + (mi >> 1) * 8) * 2;
        detail::ldmatrix_x4_trans(detail::smem_addr(va), b[0], b[1], b[2], b[3]);
        M::mma(o[0], pa, b[0], b[1]);
        M::mma(o[1], pa, b[2], b[3]);
      } else {
        // Lane (r, cq): dims 16 w + 2 r, + 1 (n-tile 0, 1) of keys 2 cq, 2 cq + 1, + 8, + 9.
        uint32_t h[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int key = kk * kMmaTile + 2 * cq + (u & 1) + (u >> 1) * 8;
          const uint32_t codes =
              *reinterpret_cast<const uint16_t*>(vst + key * Sm::kRowBytes + warp * 16 + 2 * r);
          h[u] = detail::fp8x2_to_f16x2(codes);
        }
        M::mma(o[0], pa, __byte_perm(h[0], h[1], 0x5410), __byte_perm(h[2], h[3], 0x5410));
        M::mma(o[1], pa, __byte_perm(h[0], h[1], 0x7632), __byte_perm(h[2], h[3], 0x7632));
      }
    }
  }
  // The output dim of n-tile j, C column 2 cq + ec.
  auto dim_of = [&](int j, int ec) {
    return kFp8 ? warp * 16 + 2 * (2 * cq + ec) + j : warp * 16 + 8 * j + 2 * cq + ec;
  };
  const float vmul = kFp8 ? c.v_scale : 1.f;
  if constexpr (kCluster) {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    __syncthreads();  // every warp is done with stage 0: the CTA's output goes there
    float* Oc = reinterpret_cast<float*>(cta_smem);  // [16][D]
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) Oc[(r + 8 * (e >> 1)) * D + dim_of(j, e & 1)] = o[j][e] * vmul;
    if (warp == 0 && cq == 0) {
      Ms[r] = m[0];
      Ms[r + 8] = m[1];
      Ls[r] = l[0];
      Ls[r + 8] = l[1];
    }
    cl.sync();
    cluster_merge_splits<D>(cl, Ms, Ls, Oc, group, out + (t * num_heads + g * group) * D);
    cl.sync();  // every CTA keeps its shared memory until the others have read it
  } else {
    // Without a cluster the launch has one split (launch_cta): the rows are final.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = r + 8 * hh;
      if (h >= group) continue;
      const float inv = 1.0f / l[hh];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int ec = 0; ec < 2; ++ec)
          out[(t * num_heads + g * group + h) * D + dim_of(j, ec)] = o[j][2 * hh + ec] * vmul * inv;
    }
  }
}

bool mma_path_supported(const KvPages& c, int64_t group) {
  return c.kv_dtype != KvDtype::kF32 && group >= 1 && group <= kMmaRows && c.head_dim == kMmaDim;
}

bool split_path_supported(int64_t group, int64_t d) {
  return group >= 1 && group <= kFastMaxGroup && d >= 4 && d <= kFastMaxDim && d % 4 == 0;
}

// The split-KV kernels: the fp32 one, or the tensor-core one for a bf16 / fp8 cache.
bool split_grid_supported(const KvPages& c, int64_t group) {
  return c.kv_dtype == KvDtype::kF32 ? split_path_supported(group, c.head_dim)
                                     : mma_path_supported(c, group);
}

int pow2_group(int64_t group) {
  int g = 1;
  while (g < group) g *= 2;
  return g;
}

// Splits per (token, kv head): up to 2 CTAs per SM in one wave, at least one tile per warp per
// split.
int choose_splits(int64_t num_tokens, const KvPages& c, int64_t max_blocks, int64_t max_kv_len) {
  if (max_kv_len <= 0) return 1;
  const int64_t nvirt = max_blocks > 0 ? max_blocks * c.page_size : max_kv_len;
  const int64_t ntiles = (nvirt + kTile - 1) / kTile;
  const int64_t units = num_tokens * c.num_kv_heads;
  // As many splits as fill the two CTAs per SM once: rounding up would start a second, mostly
  // empty wave that doubles the time.
  int64_t s = 2 * static_cast<int64_t>(detail::num_sms()) / units;
  s = std::min<int64_t>(s, (ntiles + kSplitWarps - 1) / kSplitWarps);
  s = std::min<int64_t>(s, kMaxSplits);
  return static_cast<int>(std::max<int64_t>(s, 1));
}

// M3_ATTN_LEGACY=1: the selected rows of a bf16 / fp8 cache take attention_mma_kernel as
// before attention_cta_kernel (kept for comparisons).
bool attn_legacy() {
  static const bool on = env_switch("M3_ATTN_LEGACY", false);
  return on;
}

// The largest cluster the selected-block splits of a tensor-core kernel may form on this device:
// 16 (Hopper's non-portable size: half the keys per CTA of 8 at batch 1, where the kernel is
// latency-bound) when the function accepts it and cudaOccupancyMaxActiveClusters finds room for
// one, else the portable 8. Decided once per device, kernel and K/V type; the smem limit is raised
// here. kLegacy: attention_mma_kernel (M3_ATTN_LEGACY=1), else attention_cta_kernel.
template <class TT, bool kLegacy>
int cluster_limit_of() {
  static std::atomic<uint64_t> known{0}, wide{0};
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (!(known.load(std::memory_order_acquire) & bit)) {
    auto kernel = [] {
      if constexpr (kLegacy)
        return attention_mma_kernel<TT, true>;
      else
        return attention_cta_kernel<TT, true>;
    }();
    const int smem = kLegacy ? MmaAttnSmem<TT>::kBytes : CtaAttnSmem<TT>::kBytes;
    M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    bool ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
              cudaSuccess;
    if (ok) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(1, kMaxClusterSplits);
      cfg.blockDim = dim3(kLegacy ? kMmaThreads : kCtaThreads);
      cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = kMaxClusterSplits;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
    }
    (void)cudaGetLastError();  // a refused attribute or query leaves no sticky error
    if (ok) wide.fetch_or(bit, std::memory_order_acq_rel);
    known.fetch_or(bit, std::memory_order_acq_rel);
  }
  return (wide.load(std::memory_order_acquire) & bit) ? kMaxClusterSplits : kPortableCluster;
}

int cluster_limit(KvDtype kv, bool legacy) {
  if (legacy)
    return kv == KvDtype::kFp8 ? cluster_limit_of<uint8_t, true>()
                               : cluster_limit_of<uint16_t, true>();
  return kv == KvDtype::kFp8 ? cluster_limit_of<uint8_t, false>()
                             : cluster_limit_of<uint16_t, false>();
}

// Launches `kernel` over grid with the splits (grid.y) of each (token, kv head) as one
// thread-block cluster, overlapping the kernel ahead where the attention kernels may
// (launch_overlap_attention: their pdl_enter()).
template <class... KArgs, class... Args>
void launch_split_cluster(void (*kernel)(KArgs...), dim3 grid, int threads, int smem,
                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = grid.y;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // pdl_enter()
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = launch_overlap() && launch_overlap_attention() ? 2 : 1;
  M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Launches attention_cta_kernel<TT, kCluster> over grid (tokens x kv heads, splits); with
// kCluster the splits of a (token, kv head) form one cluster.
template <class TT, bool kCluster>
void launch_cta(dim3 grid, cudaStream_t stream, const float* q, int64_t num_heads,
                const KvPages& cache, const TokenLayout& layout, const int32_t* blocks,
                int64_t max_blocks, float scale, int64_t max_kv_len, int splits, float* out,
                bool skip_multi) {
  M3_CHECK(kCluster || splits == 1, "attention_cta_kernel: %d splits without a cluster", splits);
  constexpr int smem = CtaAttnSmem<TT>::kBytes;
  auto kernel = attention_cta_kernel<TT, kCluster>;
  static std::atomic<uint64_t> attr_set{0};
  detail::raise_smem_limit_once(attr_set, kernel, smem);
  if constexpr (kCluster) {
    launch_split_cluster(kernel, grid, kCtaThreads, smem, stream, q, num_heads, cache, layout,
                         blocks, max_blocks, scale, max_kv_len, splits, out, skip_multi);
  } else {
    detail::launch_pdl_attn(kernel, grid, dim3(kCtaThreads), static_cast<size_t>(smem), stream, q,
                            num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len, splits,
                            out, skip_multi);
  }
  M3_CUDA_CHECK_LAUNCH("attention_cta_kernel");
}

// The cluster size of the selected rows: the largest (cluster_limit) while every (token, kv
// head) then fits in one wave of two CTAs per SM, else 8 (each CTA taking more rounds; at batch
// 8 of M3's layer, 16 x 1 round measured 31.7 us and 8 x 2 rounds 27.5, bf16 at 8K).
int sparse_cluster(int64_t units, KvDtype kv) {
  const int lim = cluster_limit(kv, false);
  return units * lim <= 2 * static_cast<int64_t>(detail::num_sms())
             ? lim
             : std::min(lim, kPortableCluster);
}

// Rounds of kRoundKeys virtual keys of a selected list of max_blocks whole blocks.
int64_t cta_rounds(const KvPages& c, int64_t max_blocks) {
  return (max_blocks * c.page_size + kRoundKeys - 1) / kRoundKeys;
}

size_t split_bytes(int64_t num_tokens, int64_t num_heads, int64_t d, int splits) {
  if (splits <= 1) return 0;
  return sizeof(float) * static_cast<size_t>(num_tokens * num_heads * splits * (d + 2));
}

template <int G>
void launch_split(const float* q, int64_t num_heads, const KvPages& c, const TokenLayout& L,
                  const int32_t* blocks, int64_t max_blocks, float scale, int64_t max_kv_len,
                  int splits, float* part_o, float* part_ml, float* out, cudaStream_t stream) {
  const size_t smem = SplitSmem{G, static_cast<int>(c.head_dim)}.bytes();
  // The largest (head_dim 128) size, allowed once per instantiation and device.
  static std::atomic<uint64_t> attr_set{0};
  detail::raise_smem_limit_once(attr_set, attention_split_kernel<G>,
                                static_cast<int>(SplitSmem{G, kFastMaxDim}.bytes()));
  const dim3 grid(static_cast<unsigned>(L.num_tokens * c.num_kv_heads),
                  static_cast<unsigned>(splits));
  attention_split_kernel<G><<<grid, kSplitThreads, smem, stream>>>(
      q, num_heads, c, L, blocks, max_blocks, scale, max_kv_len, splits, part_o, part_ml, out);
  M3_CUDA_CHECK_LAUNCH("attention_split_kernel");
}

}  // namespace

void kv_write(const KvPages& cache, const TokenLayout& layout, const float* k, const float* v,
              const float* ik, cudaStream_t stream) {
  M3_CHECK(ik == nullptr || cache.ik != nullptr, "cuda::kv_write: layer has no index-K cache");
  M3_CHECK(ik == nullptr || cache.ik_dtype != KvDtype::kFp8 || cache.ik_scale != nullptr,
           "cuda::kv_write: an fp8 index-K needs its scale array");
  if (layout.num_tokens == 0) return;
  M3_CHECK(layout.num_tokens <= 0x7fffffff);
  const float inv_k = 1.0f / cache.k_scale, inv_v = 1.0f / cache.v_scale;
  detail::dispatch_kv(cache.kv_dtype, [&]<class T>() {
    detail::dispatch_kv(cache.ik_dtype, [&]<class TI>() {
      kv_write_kernel<T, TI><<<static_cast<unsigned>(layout.num_tokens), kKvThreads, 0, stream>>>(
          cache, layout, k, v, ik, inv_k, inv_v);
      M3_CUDA_CHECK_LAUNCH("kv_write_kernel");
    });
  });
}

size_t attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, const KvPages& cache,
                                 int64_t max_blocks, int64_t max_kv_len) {
  if (num_tokens <= 0 || cache.num_kv_heads <= 0) return 0;
  if (!split_grid_supported(cache, num_heads / cache.num_kv_heads)) return 0;
  return split_bytes(num_tokens, num_heads, cache.head_dim,
                     choose_splits(num_tokens, cache, max_blocks, max_kv_len));
}

void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                     const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                     float scale, int64_t max_kv_len, Workspace ws, float* out,
                     cudaStream_t stream) {
  M3_CHECK(cache.num_kv_heads > 0 && num_heads % cache.num_kv_heads == 0);
  if (layout.num_tokens == 0) return;
  const int64_t T = layout.num_tokens, group = num_heads / cache.num_kv_heads;
  M3_CHECK(T * cache.num_kv_heads <= 0x7fffffff);
  // Dense rows of multi-token sequences (prefill chunks) take the query-tiled kernel; the
  // per-token kernels below then serve only the tokens alone in their sequence.
  // With a FlashInfer plan for the step (bf16 cache) its Hopper kernel takes them instead.
  const bool flash = blocks == nullptr && layout.multi_token_seqs &&
                     layout.flash_prefill != nullptr && layout.flash_prefill->serves(cache);
  const bool tiled = blocks == nullptr && layout.multi_token_seqs &&
                     (flash || detail::prefill_tiled_supported(cache, group));
  // Selected rows of multi-token sequences (MSA prefill chunks) take the block-sparse prefill
  // kernel (msa_sparse_prefill.cu), which shares each selected block among neighbouring tokens.
  const bool sparse_tiled = blocks != nullptr && layout.multi_token_seqs &&
                            msa_sparse_prefill_supported(cache, group, max_blocks);
  if (flash)
    layout.flash_prefill->run(q, num_heads, cache, layout, scale, out, stream);
  else if (tiled)
    detail::attention_prefill_tiled(q, num_heads, cache, layout, scale, max_kv_len, out, stream);
  else if (sparse_tiled)
    msa_sparse_prefill(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len, out,
                       stream);
  // Tokens those kernels served are skipped by the per-token ones below; with no token alone in
  // its sequence (host-known) there is nothing left for them.
  const bool skip_multi = tiled || sparse_tiled;
  if (skip_multi && !layout.single_token_seqs) return;
  // A bf16 / fp8 cache at head_dim 128 and groups <= 16, at most kCtaMaxUnits (token, kv head)
  // rows: the selected blocks of every token in attention_cta_kernel, a cluster of up to 16 CTAs
  // per (token, kv head) (one round of 128 keys each at M3's top-16 of 128-token pages). More
  // rows, dense rows (and M3_ATTN_LEGACY=1) below. The bound, from one H200 run (2026-12-02,
  // bench_layer 8192 10 bf16, one M3 layer, 4 KV heads): the CTA kernel was faster at batch 8
  // (0.947 against 0.959 ms per step; MSA attention alone 27 against 47 us), even at batch 1,
  // slower at 64 (3.330 / 3.299) and 256 (4.357 / 4.211), and a 32K-token prefill through the
  // per-token path took 60.1 against 38.9 ms.
  constexpr int64_t kCtaMaxUnits = 32;
  const int64_t units = T * cache.num_kv_heads;
  if (blocks != nullptr && mma_path_supported(cache, group) && !attn_legacy() &&
      units <= kCtaMaxUnits) {
    const int ncl = static_cast<int>(
        std::min<int64_t>(sparse_cluster(units, cache.kv_dtype), cta_rounds(cache, max_blocks)));
    detail::dispatch_kv(cache.kv_dtype, [&]<class TT>() {
      if constexpr (sizeof(TT) < 4) {
        if (ncl >= 2)
          launch_cta<TT, true>(dim3(static_cast<unsigned>(units), static_cast<unsigned>(ncl)),
                               stream, q, num_heads, cache, layout, blocks, max_blocks, scale,
                               max_kv_len, ncl, out, skip_multi);
        else
          launch_cta<TT, false>(dim3(static_cast<unsigned>(units), 1), stream, q, num_heads, cache,
                                layout, blocks, max_blocks, scale, max_kv_len, 1, out, skip_multi);
      }
    });
    return;
  }
  if (split_grid_supported(cache, group)) {
    int splits = choose_splits(T, cache, blocks ? max_blocks : 0, max_kv_len);
    // The tensor-core path merges the splits of the selected blocks (few keys: a second kernel
    // would cost more than they do) inside a cluster of up to 16 (cluster_limit); dense rows go
    // through the workspace and the combine kernel.
    bool cluster = false;
    if (cache.kv_dtype != KvDtype::kF32 && splits > 1 && blocks != nullptr) {
      splits = std::min(splits, cluster_limit(cache.kv_dtype, true));
      cluster = true;
    }
    const size_t per_split = split_bytes(T, num_heads, cache.head_dim, 2) / 2;
    if (!cluster && splits > 1 && ws.bytes < per_split * splits) {
      splits = static_cast<int>(std::min<size_t>(ws.bytes / per_split, kMaxSplits));
      if (splits < 2) splits = 1;
    }
    float* part_o = nullptr;
    float* part_ml = nullptr;
    if (splits > 1 && !cluster) {
      M3_CHECK(ws.data != nullptr);
      part_o = static_cast<float*>(ws.data);
      part_ml = part_o + T * num_heads * splits * cache.head_dim;
    }
    // Dense rows of a bf16 / fp8 cache: the TMA kernel where it serves the cache, else the
    // cp.async one below.
    const bool tma_dense =
        blocks == nullptr &&
        detail::attention_decode_tma(q, num_heads, cache, layout, scale, max_kv_len, splits, part_o,
                                     part_ml, out, skip_multi, stream);
    if (tma_dense) {
      // launched; the combine below merges its splits
    } else if (cache.kv_dtype != KvDtype::kF32) {
      const dim3 grid(static_cast<unsigned>(T * cache.num_kv_heads), static_cast<unsigned>(splits));
      detail::dispatch_kv(cache.kv_dtype, [&]<class TT>() {
        if constexpr (sizeof(TT) < 4) {
          constexpr int smem = MmaAttnSmem<TT>::kBytes;
          if (cluster) {
            static std::atomic<uint64_t> attr_set{0};
            detail::raise_smem_limit_once(attr_set, attention_mma_kernel<TT, true>, smem);
            launch_split_cluster(attention_mma_kernel<TT, true>, grid, kMmaThreads, smem, stream, q,
                                 num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                                 splits, part_o, part_ml, out, skip_multi);
          } else {
            static std::atomic<uint64_t> attr_set{0};
            detail::raise_smem_limit_once(attr_set, attention_mma_kernel<TT, false>, smem);
            detail::launch_pdl_attn(attention_mma_kernel<TT, false>, grid, dim3(kMmaThreads),
                                    static_cast<size_t>(smem), stream, q, num_heads, cache, layout,
                                    blocks, max_blocks, scale, max_kv_len, splits, part_o, part_ml,
                                    out, skip_multi);
          }
          M3_CUDA_CHECK_LAUNCH("attention_mma_kernel");
        }
      });
    } else {
      switch (pow2_group(group)) {
        case 1:
          launch_split<1>(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                          splits, part_o, part_ml, out, stream);
          break;
        case 2:
          launch_split<2>(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                          splits, part_o, part_ml, out, stream);
          break;
        case 4:
          launch_split<4>(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                          splits, part_o, part_ml, out, stream);
          break;
        case 8:
          launch_split<8>(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                          splits, part_o, part_ml, out, stream);
          break;
        default:
          launch_split<16>(q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len,
                           splits, part_o, part_ml, out, stream);
          break;
      }
    }
    if (splits > 1 && !cluster) {
      M3_CHECK(T * num_heads <= 0x7fffffff);
      detail::launch_pdl_attn(attention_combine_kernel, dim3(static_cast<unsigned>(T * num_heads)),
                              dim3(kCombineThreads), 0, stream, part_o, part_ml, num_heads,
                              cache.num_kv_heads, cache.head_dim, splits, out, layout, skip_multi);
    }
    return;
  }
  // Other geometries (head_dim not a multiple of 4 or above 128, groups above 16).
  const int64_t grid = T * cache.num_kv_heads;
  const AttnSmem lay{group, cache.head_dim};
  const size_t smem = lay.bytes();
  M3_CHECK(smem <= 227 * 1024,
           "cuda::attention: %zu bytes of shared memory (group %lld, head "
           "dim %lld)",
           smem, (long long)lay.group, (long long)lay.d);
  detail::dispatch_kv(cache.kv_dtype, [&]<class T>() {
    if (smem > 48 * 1024) {
      M3_CUDA_CHECK(cudaFuncSetAttribute(attention_generic_kernel<T>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    }
    attention_generic_kernel<T><<<static_cast<unsigned>(grid), kAttnThreads, smem, stream>>>(
        q, num_heads, cache, layout, blocks, max_blocks, scale, out);
    M3_CUDA_CHECK_LAUNCH("attention_generic_kernel");
  });
}

}  // namespace m3::kernels::cuda
