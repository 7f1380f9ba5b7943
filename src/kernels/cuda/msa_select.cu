// MSA block selection. (a) msa_score_kernel: CTAs over (token, block range), two per SM; each
// warp scores 32 index-K rows at a time, one lane per row loading it straight from global memory
// and summing it for every index head in the CPU op's order; per-block maxima go to the
// workspace [tokens, index_heads, nb_stride]. (b) msa_topk_kernel: one CTA per
// (token, index head): the keys go to shared memory, a 4-pass 8-bit radix select finds the k-th
// key by (score desc, id asc), forced blocks keyed as +inf, then an ordered compaction emits
// ascending ids. Geometries the fast scorer does not cover use msa_score_generic_kernel; callers
// without a workspace use msa_fused_kernel (scores in shared memory, same top-k). A bf16 / fp8
// index-K (query rounded to bf16, fp8 rows times their per-token scale) is scanned by
// msa_score_mma_kernel on tensor cores where the geometry allows (index dim 128, <= 8 heads), by
// the generic and fused kernels, templated on the element type, elsewhere. In a step with prefill
// chunks (TokenLayout::multi_token_seqs) their tokens are scored by msa_score_tiled_kernel (a
// tile of tokens shares each index-K block through shared memory) and ranked one warp per row
// by msa_topk_warp_kernel; the kernels above keep the tokens alone in their sequence.
#include <algorithm>

#include "core/env.h"
#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::kWarp;

constexpr int kScoreThreads = 256;
constexpr int kGenericScoreWarps = 4;
constexpr int kGenericScoreThreads = kGenericScoreWarps * kWarp;
constexpr int kScoreRows = 32;  // index-K rows per warp row group: one per lane
constexpr int kFastMaxIndexDim = 128;
constexpr int kTopkThreads = 1024;
constexpr size_t kTopkSmemKeys = 40960;  // keys of up to 5M tokens (128-token pages) in smem
// Decode rows over many blocks (few rows, so few CTAs) rank in two steps: each of a row's
// ceil(nb / kSplitKeys) CTAs takes the topk of its kSplitKeys blocks (one key per thread), then
// one CTA per row ranks those candidates (msa_topk_split_kernel, msa_topk_merge_kernel). Used
// from kSplitMinBlocks blocks per row for top-k up to kSplitMaxTopk; the candidates live in the
// workspace after the scores.
constexpr int64_t kSplitKeys = kTopkThreads;
constexpr int64_t kSplitMinBlocks = 2048;
constexpr int64_t kSplitMaxTopk = 64;
constexpr int kFusedThreads = 256;

// Scores as unsigned keys whose order is the float order; -0 and +0 get one key (they tie on the
// CPU too). Forced blocks score +inf on the CPU: the same key here.
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t u = __float_as_uint(s + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint32_t forced_key() {
  return order_key(INFINITY);
}

// The CPU op's dot (kernels/cpu/paged_common.h): 8 interleaved accumulators, summed in pairs, plus
// the tail; the same order gives the same fp32 scores, so near-ties break the same way.
__device__ __forceinline__ float cpu_order_dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
  float tail = 0.f;
  for (; i < n; ++i) tail = fmaf(a[i], b[i], tail);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// A bf16 / fp8 index-K row's dot with a bf16-rounded query in the same order: the row's element
// values (fp8: the codes' values, the caller applies the row scale).
template <class T>
__device__ __forceinline__ float typed_order_dot(const float* a, const T* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
#pragma unroll
    for (int l = 0; l < 8; ++l)
      acc[l] = fmaf(a[i + l], detail::KvElem<T>::load(b, i + l, 1.f), acc[l]);
  float tail = 0.f;
  for (; i < n; ++i) tail = fmaf(a[i], detail::KvElem<T>::load(b, i, 1.f), tail);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// The max over rows [j0, bs) step `stride` of block page `page`: the scores of those index-K rows
// (fp32 in the CPU op's order; bf16 / fp8 with the row scale).
template <class T>
__device__ __forceinline__ float rows_max(const float* qv, const KvPages& c, int64_t page,
                                          int64_t j0, int64_t stride) {
  const int64_t bs = c.page_size, di = c.index_dim;
  float mx = -INFINITY;
  for (int64_t j = j0; j < bs; j += stride) {
    const int64_t slot = page * bs + j;
    if constexpr (sizeof(T) == 4) {
      mx = fmaxf(mx, cpu_order_dot(qv, c.ik_as<float>() + slot * di, di));
    } else {
      const float sc = sizeof(T) == 1 ? c.ik_scale[slot] : 1.f;
      mx = fmaxf(mx, sc * typed_order_dot(qv, c.ik_as<T>() + slot * di, di));
    }
  }
  return mx;
}

// The index query as the scan reads it: as is for an fp32 index-K, else rounded to bf16.
template <class T>
__device__ __forceinline__ float index_q(float x) {
  return sizeof(T) == 4 ? x : detail::round_bf16(x);
}

// ---- (a) scores ----

// The block range [b0, b1) of chunk `chunk` of `chunks` over the scored blocks [init, nb - local)
// of a token with nb blocks; empty when every block is selected or forced.
struct ScoreRange {
  int64_t b0 = 0, b1 = 0;
};
__device__ __forceinline__ ScoreRange score_range(int64_t nb, int64_t topk, int64_t init_blocks,
                                                  int64_t local_blocks, int64_t chunk,
                                                  int64_t chunks) {
  ScoreRange r;
  if (nb <= topk) return r;
  const int64_t lo = min(init_blocks, nb), hi = nb - local_blocks;
  if (hi <= lo) return r;
  const int64_t per = (hi - lo + chunks - 1) / chunks;
  r.b0 = lo + chunk * per;
  r.b1 = min(hi, r.b0 + per);
  if (r.b0 > r.b1) r.b0 = r.b1;
  return r;
}

bool fast_score_supported(const KvPages& c, int64_t ni) {
  const int64_t bs = c.page_size, di = c.index_dim;
  return ni >= 1 && ni <= 8 && di >= 4 && di % 4 == 0 && di <= kFastMaxIndexDim &&
         (bs % kScoreRows == 0 || kScoreRows % bs == 0);
}

// NIP: index heads rounded up to 4 or 8 (q of the extra heads is 0; they are not stored).
// A warp's work is a list of units: one block when page_size >= 32 (page_size / 32 row groups),
// else 32 / page_size whole blocks (one row group); warps take every 8th unit. One lane per row:
// it loads its own row straight from global memory through the read-only path, 8 float4 in
// flight (the second half of each 32-byte sector is an L1 hit), and sums it for every head in
// the CPU op's order. (A version staging rows through shared memory with cp.async, one CTA per
// SM, ran at half this speed on the H200.)
template <int NIP>
__global__ void __launch_bounds__(kScoreThreads)
    msa_score_kernel(const float* __restrict__ iq, int64_t ni, KvPages c, TokenLayout L,
                     int64_t topk, int64_t init_blocks, int64_t local_blocks, int64_t nb_stride,
                     float* __restrict__ scores) {
  __shared__ __align__(16) float qT[kFastMaxIndexDim * NIP];  // [di][NIP]
  const int bs = static_cast<int>(c.page_size);
  const int di = static_cast<int>(c.index_dim);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nwarps = blockDim.x / kWarp;
  const int64_t t = blockIdx.x;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  const ScoreRange rg = score_range(nb, topk, init_blocks, local_blocks, blockIdx.y, gridDim.y);
  if (rg.b0 >= rg.b1) return;  // uniform over the CTA
  M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)", p,
                  static_cast<long long>(nb_stride));
  for (int e = threadIdx.x; e < di * NIP; e += blockDim.x) {
    const int i = e / NIP, h = e % NIP;
    qT[e] = h < ni ? iq[(t * ni + h) * di + i] : 0.f;
  }
  __syncthreads();
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int bpu = bs >= kScoreRows ? 1 : kScoreRows / bs;  // blocks per unit
  const int spu = bs >= kScoreRows ? bs / kScoreRows : 1;  // row groups per unit
  const int nunits = static_cast<int>((rg.b1 - rg.b0 + bpu - 1) / bpu);
  const int di8 = di & ~7;
  for (int unit = warp; unit < nunits; unit += nwarps) {
    float run[NIP];
#pragma unroll
    for (int h = 0; h < NIP; ++h) run[h] = -INFINITY;
    for (int st = 0; st < spu; ++st) {
      const int r = st * kScoreRows + lane;
      const int64_t blk = rg.b0 + static_cast<int64_t>(unit) * bpu + r / bs;
      const bool valid = blk < rg.b1;
      const float* kr =
          valid ? c.ik_as<float>() + (static_cast<int64_t>(table[blk]) * bs + r % bs) * di
                : c.ik_as<float>();
      float acc[NIP][8];
      float tail[NIP];
#pragma unroll
      for (int h = 0; h < NIP; ++h) {
        tail[h] = 0.f;
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[h][l] = 0.f;
      }
      for (int i0 = 0; i0 < di8; i0 += 32) {
        float4 kv4[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          kv4[u] = (valid && i0 + 4 * u < di8) ? __ldg(reinterpret_cast<const float4*>(kr + i0) + u)
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u2 = 0; u2 < 4; ++u2) {
          if (i0 + 8 * u2 >= di8) break;
          const float kv[8] = {kv4[2 * u2].x,     kv4[2 * u2].y,     kv4[2 * u2].z,
                               kv4[2 * u2].w,     kv4[2 * u2 + 1].x, kv4[2 * u2 + 1].y,
                               kv4[2 * u2 + 1].z, kv4[2 * u2 + 1].w};
#pragma unroll
          for (int l = 0; l < 8; ++l) {
            const float4* qi = reinterpret_cast<const float4*>(qT + (i0 + 8 * u2 + l) * NIP);
#pragma unroll
            for (int h4 = 0; h4 < NIP / 4; ++h4) {
              const float4 q4 = qi[h4];
              acc[4 * h4 + 0][l] = fmaf(q4.x, kv[l], acc[4 * h4 + 0][l]);
              acc[4 * h4 + 1][l] = fmaf(q4.y, kv[l], acc[4 * h4 + 1][l]);
              acc[4 * h4 + 2][l] = fmaf(q4.z, kv[l], acc[4 * h4 + 2][l]);
              acc[4 * h4 + 3][l] = fmaf(q4.w, kv[l], acc[4 * h4 + 3][l]);
            }
          }
        }
      }
      for (int i = di8; i < di; ++i) {
        const float kv = valid ? __ldg(kr + i) : 0.f;
#pragma unroll
        for (int h = 0; h < NIP; ++h) tail[h] = fmaf(qT[i * NIP + h], kv, tail[h]);
      }
      float d[NIP];
#pragma unroll
      for (int h = 0; h < NIP; ++h) {
        const float* a = acc[h];
        d[h] = valid ? ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail[h]
                     : -INFINITY;
      }
      if (bs >= kScoreRows) {
#pragma unroll
        for (int h = 0; h < NIP; ++h) run[h] = fmaxf(run[h], detail::warp_max(d[h]));
      } else {
        for (int off = 1; off < bs; off <<= 1) {
#pragma unroll
          for (int h = 0; h < NIP; ++h) d[h] = fmaxf(d[h], __shfl_xor_sync(0xffffffffu, d[h], off));
        }
        if (lane % bs == 0 && valid) {
#pragma unroll
          for (int h = 0; h < NIP; ++h)
            if (h < ni) scores[(t * ni + h) * nb_stride + blk] = d[h];
        }
      }
    }
    if (bs >= kScoreRows && lane == 0) {
      const int64_t blk = rg.b0 + unit;
#pragma unroll
      for (int h = 0; h < NIP; ++h)
        if (h < ni) scores[(t * ni + h) * nb_stride + blk] = run[h];
    }
  }
}

// Any geometry and format: a warp per block, lanes over its rows, index-K read from global memory.
template <class T>
__global__ void __launch_bounds__(kGenericScoreThreads)
    msa_score_generic_kernel(const float* __restrict__ iq, int64_t ni, KvPages c, TokenLayout L,
                             int64_t topk, int64_t init_blocks, int64_t local_blocks,
                             int64_t nb_stride, float* __restrict__ scores) {
  extern __shared__ __align__(16) float gen_smem[];  // q [ni][di]
  const int64_t bs = c.page_size, di = c.index_dim;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t t = blockIdx.x;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  const ScoreRange rg = score_range(nb, topk, init_blocks, local_blocks, blockIdx.y, gridDim.y);
  if (rg.b0 >= rg.b1) return;
  M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)", p,
                  static_cast<long long>(nb_stride));
  for (int64_t e = threadIdx.x; e < ni * di; e += blockDim.x)
    gen_smem[e] = index_q<T>(iq[t * ni * di + e]);
  __syncthreads();
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  for (int64_t b = rg.b0 + warp; b < rg.b1; b += kGenericScoreWarps) {
    const int64_t page = table[b];
    for (int64_t h = 0; h < ni; ++h) {
      float mx = rows_max<T>(gen_smem + h * di, c, page, lane, kWarp);
      mx = detail::warp_max(mx);
      if (lane == 0) scores[(t * ni + h) * nb_stride + b] = mx;
    }
  }
}

// A bf16 or fp8 index-K of dim 128, up to 8 index heads, pages a multiple of the unit: the scan on
// tensor cores. S[16 keys x 8 heads] = IK·IQ^T on m16n8k16 MMAs (keys as rows, the index heads as
// the 8 columns, fp32 accumulation; fp8 rows times their scale after). Each lane's 16-byte loads
// of its rows are its A fragments (kv_format.cuh kv_k_base); the query's B fragments are built
// once. Work unit: kUnitTiles m-tiles (bf16 2, fp8 4: 16 loads in flight per lane) of one block;
// the CTA's warps take the units of a sub-range of its blocks in turn and max-pool into shared
// memory (order keys, atomicMax), flushed to the workspace per sub-range.
constexpr int kMmaScoreThreads = 256;
constexpr int kMmaSubBlocks = 64;  // blocks per shared-memory sub-range
constexpr int kMmaIndexDim = 128;

template <class T>
struct ScoreMma {
  using M = detail::MmaOf<T>;
  static constexpr int E = M::kElemsPer16B;
  static constexpr int KPieces = kMmaIndexDim / (4 * E);  // 16-byte loads per lane and row
  static constexpr int KSteps = kMmaIndexDim / 16;
  static constexpr int kUnitTiles = sizeof(T) == 1 ? 4 : 2;
  static constexpr int kUnitKeys = 16 * kUnitTiles;
};

__device__ __forceinline__ float key_to_float(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(u);
}

template <class T>
__global__ void __launch_bounds__(kMmaScoreThreads)
    msa_score_mma_kernel(const float* __restrict__ iq, int64_t ni, KvPages c, TokenLayout L,
                         int64_t topk, int64_t init_blocks, int64_t local_blocks, int64_t nb_stride,
                         bool skip_multi, float* __restrict__ scores) {
  using S = ScoreMma<T>;
  using M = typename S::M;
  constexpr int E = S::E;
  __shared__ uint32_t pool[kMmaSubBlocks * 8];  // [block][head] order keys of the maxima
  detail::pdl_enter();
  const int bs = static_cast<int>(c.page_size);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nwarps = blockDim.x / kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t t = blockIdx.x;
  if (skip_multi && detail::in_multi_run(L, t)) return;  // scored by msa_score_tiled_kernel
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  const ScoreRange rg = score_range(nb, topk, init_blocks, local_blocks, blockIdx.y, gridDim.y);
  if (rg.b0 >= rg.b1) return;  // uniform over the CTA
  M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)", p,
                  static_cast<long long>(nb_stride));
  // B fragments: column r = index head r (0 past ni), rows = the permuted dims of each k-step.
  uint32_t qb[S::KSteps][2];
  {
    const float* qh = iq + (t * ni + r) * kMmaIndexDim;
    auto qv = [&](int i) { return r < ni ? detail::round_bf16(qh[i]) : 0.f; };
#pragma unroll
    for (int ks = 0; ks < S::KSteps; ++ks) {
      const int b = detail::kv_k_base<E>(ks, cq);
      qb[ks][0] = M::pack(qv(b), qv(b + 1));
      qb[ks][1] = M::pack(qv(b + 2), qv(b + 3));
    }
  }
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int upb = bs / S::kUnitKeys;  // units per block
  const T* ikb = c.ik_as<T>();
  for (int64_t sb0 = rg.b0; sb0 < rg.b1; sb0 += kMmaSubBlocks) {
    const int nblk = static_cast<int>(min(static_cast<int64_t>(kMmaSubBlocks), rg.b1 - sb0));
    for (int e = threadIdx.x; e < nblk * 8; e += blockDim.x) pool[e] = 0u;  // below every key
    __syncthreads();
    const int nunits = nblk * upb;
    // The page of this warp's next unit is read one unit ahead.
    // The pages of this warp's next two units are read ahead; with a bf16 index-K the next unit
    // is prefetched into L2 (8 KB: two lines per lane) while this one is loaded.
    int64_t page_cur = warp < nunits ? table[sb0 + warp / upb] : 0;
    int64_t page_nxt = warp + nwarps < nunits ? table[sb0 + (warp + nwarps) / upb] : 0;
    for (int u = warp; u < nunits; u += nwarps) {
      const int bl = u / upb;
      const int64_t page = page_cur;
      const int64_t slot0 = page * bs + (u % upb) * S::kUnitKeys;
      uint4 raw[S::kUnitTiles][2][S::KPieces];
#pragma unroll
      for (int mt = 0; mt < S::kUnitTiles; ++mt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const uint4* src =
              reinterpret_cast<const uint4*>(ikb + (slot0 + mt * 16 + hi * 8 + r) * kMmaIndexDim);
#pragma unroll
          for (int j = 0; j < S::KPieces; ++j) raw[mt][hi][j] = detail::ldg_nc16(src + j * 4 + cq);
        }
      static_assert(S::kUnitKeys * kMmaIndexDim * sizeof(T) == 64 * 128, "a unit is 64 lines");
      // bf16 only: measured on the H200, it sped the bf16 scan up (batch 8 at 1M: 588 -> 556 us)
      // and slowed the fp8 one down (290 -> 312 us).
      if (sizeof(T) == 2 && u + nwarps < nunits) {
        const unsigned char* nb_base = reinterpret_cast<const unsigned char*>(
            ikb + (page_nxt * bs + ((u + nwarps) % upb) * S::kUnitKeys) * kMmaIndexDim);
        detail::prefetch_l2(nb_base + lane * 256);
        detail::prefetch_l2(nb_base + lane * 256 + 128);
      }
      page_cur = page_nxt;
      if (u + 2 * nwarps < nunits) page_nxt = table[sb0 + (u + 2 * nwarps) / upb];
      float sc[S::kUnitTiles][2];
      if constexpr (sizeof(T) == 1) {
#pragma unroll
        for (int mt = 0; mt < S::kUnitTiles; ++mt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi)
            sc[mt][hi] = __ldg(c.ik_scale + slot0 + mt * 16 + hi * 8 + r);
      }
      float mx0 = -INFINITY, mx1 = -INFINITY;  // heads 2 cq, 2 cq + 1
#pragma unroll
      for (int mt = 0; mt < S::kUnitTiles; ++mt) {
        uint32_t a0[2 * S::KSteps], a1[2 * S::KSteps];
#pragma unroll
        for (int j = 0; j < S::KPieces; ++j) {
          M::unpack(raw[mt][0][j], a0 + j * (E / 2));
          M::unpack(raw[mt][1][j], a1 + j * (E / 2));
        }
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < S::KSteps; ++ks) {
          const uint32_t a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
          M::mma(d, a, qb[ks][0], qb[ks][1]);
        }
        if constexpr (sizeof(T) == 1) {
          d[0] *= sc[mt][0];
          d[1] *= sc[mt][0];
          d[2] *= sc[mt][1];
          d[3] *= sc[mt][1];
        }
        mx0 = fmaxf(mx0, fmaxf(d[0], d[2]));
        mx1 = fmaxf(mx1, fmaxf(d[1], d[3]));
      }
#pragma unroll
      for (int off = 4; off < kWarp; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      if (r == 0) {
        atomicMax(&pool[bl * 8 + 2 * cq], order_key(mx0));
        atomicMax(&pool[bl * 8 + 2 * cq + 1], order_key(mx1));
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nblk * 8; e += blockDim.x) {
      const int bl = e / 8, h = e % 8;
      if (h < ni) scores[(t * ni + h) * nb_stride + sb0 + bl] = key_to_float(pool[e]);
    }
    __syncthreads();
  }
}

bool mma_score_supported(const KvPages& c, int64_t ni) {
  if (c.ik_dtype == KvDtype::kF32 || ni < 1 || ni > 8 || c.index_dim != kMmaIndexDim) return false;
  const int64_t unit =
      c.ik_dtype == KvDtype::kFp8 ? ScoreMma<uint8_t>::kUnitKeys : ScoreMma<uint16_t>::kUnitKeys;
  return c.page_size >= unit && c.page_size % unit == 0;
}

// ---- (a') scores of prefill tokens, query-tiled ----

// A prefill chunk's tokens all scan the same earlier blocks, so the per-token scan above reads
// each index-K block once per token (L2-bound: ~24 TFLOP/s at 32K tokens). Here one CTA takes a
// tile of kQtColumns (token, index head) columns (256 / NIP consecutive tokens) and streams the
// blocks of their sequence through shared memory once for all of them: S[keys x columns] =
// IK·IQ^T on m16n8k16 MMAs, each warp owning 32 columns (4 n-tiles, q fragments in registers)
// and every key of the block, then the per-block maximum per column. Blocks arrive by cp.async
// in two stages (rows as 16-byte chunks XOR-swizzled by the key's low 3 bits for conflict-free
// ldmatrix); an fp8 block is widened to f16 in shared memory (exact) and its rows' scales applied
// to the products, as the per-token kernel does. Tokens of a tile that belong to different
// sequences get one pass per run (attn_prefill.cu's rule); tokens alone in their sequence are
// left to the per-token kernel (in_multi_run). grid.y splits each tile's block range.
constexpr int kQtWarps = 8;
constexpr int kQtThreads = kQtWarps * kWarp;
constexpr int kQtColumns = kQtWarps * 32;
constexpr int kQtDim = 128;
constexpr int kQtMaxKeys = 128;  // page_size (= block) bound: one block per stage

template <class T>
struct QtSmem {
  static constexpr int kRawBytes = kQtMaxKeys * kQtDim * int(sizeof(T));  // one stage
  static constexpr int kWideBytes = sizeof(T) == 1 ? kQtMaxKeys * kQtDim * 2 : 0;
  static constexpr int kBytes = 2 * kRawBytes + kWideBytes;
};

__device__ __forceinline__ int qt_swz(int key, int c) {  // 16-bit rows of 128: 16 chunks
  return key * (kQtDim * 2) + ((c ^ (key & 7)) << 4);
}

// 168-180 registers (one CTA per SM); capping them for two CTAs per SM spilled and ran 5%
// slower on the H200.
template <class T, int NIP>
__global__ void __launch_bounds__(kQtThreads)
    msa_score_tiled_kernel(const float* __restrict__ iq, int64_t ni, KvPages c, TokenLayout L,
                           int64_t topk, int64_t init_blocks, int64_t local_blocks,
                           int64_t nb_stride, float* __restrict__ scores) {
  using M = detail::MmaOf<T>;
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr int TPC = kQtColumns / NIP;  // tokens per CTA
  constexpr int KSteps = kQtDim / 16;
  constexpr int RawChunks = kQtDim * int(sizeof(T)) / 16;  // 16-byte chunks of a stored row
  extern __shared__ __align__(128) unsigned char qt_smem[];
  __shared__ int32_t tok_seq[TPC], tok_hi[TPC];  // hi: end of the token's scored range
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int bs = static_cast<int>(c.page_size);
  const int64_t ntok = L.num_tokens;
  const int64_t ntile = (ntok + TPC - 1) / TPC;
  const int64_t tile = ntile - 1 - static_cast<int64_t>(blockIdx.x);  // longest rows first
  const int64_t t0 = tile * TPC;
  for (int i = threadIdx.x; i < TPC; i += blockDim.x) {
    const int64_t t = t0 + i;
    int32_t s = -1, hi = 0;
    if (t < ntok && detail::in_multi_run(L, t)) {
      const int64_t nb = L.positions[t] / bs + 1;
      M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)",
                      L.positions[t], static_cast<long long>(nb_stride));
      s = L.seq_ids[t];
      // Scored blocks [init, nb - local) when the token selects among more than topk.
      hi = nb > topk ? static_cast<int32_t>(nb - local_blocks > 0 ? nb - local_blocks : 0) : 0;
    }
    tok_seq[i] = s;
    tok_hi[i] = hi;
  }
  // B fragments of the warp's 4 n-tiles: column n = token (n / NIP), head (n % NIP) (0 past ni).
  uint32_t qb[4][KSteps][2];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = warp * 32 + nt * 8 + r;
    const int64_t t = t0 + col / NIP;
    const int h = col % NIP;
    const bool ok = t < ntok && h < ni;
    const float* qh = iq + (t * ni + h) * kQtDim;
    auto qv = [&](int i) { return ok ? detail::round_bf16(qh[i]) : 0.f; };
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
      qb[nt][ks][0] = M::pack(qv(ks * 16 + 2 * cq), qv(ks * 16 + 2 * cq + 1));
      qb[nt][ks][1] = M::pack(qv(ks * 16 + 2 * cq + 8), qv(ks * 16 + 2 * cq + 9));
    }
  }
  __syncthreads();
  const T* ikb = c.ik_as<T>();
  unsigned char* raw = qt_smem;                              // two stages
  unsigned char* wide = qt_smem + 2 * QtSmem<T>::kRawBytes;  // fp8 only
  const int mtiles = bs / 16;
  for (int i0 = 0; i0 < TPC;) {
    const int32_t s = tok_seq[i0];
    int i1 = i0 + 1;
    while (i1 < TPC && tok_seq[i1] == s) ++i1;
    if (s < 0) {
      i0 = i1;
      continue;
    }
    int32_t hi_all = 0;
    for (int i = i0; i < i1; ++i) hi_all = max(hi_all, tok_hi[i]);
    const int64_t lo_all = init_blocks;
    // This CTA's share of the blocks [lo_all, hi_all).
    int64_t b0 = lo_all, b1 = hi_all;
    if (b1 > b0) {
      const int64_t per = (b1 - b0 + gridDim.y - 1) / gridDim.y;
      b0 = lo_all + blockIdx.y * per;
      b1 = b0 + per < hi_all ? b0 + per : static_cast<int64_t>(hi_all);
    }
    const int32_t* table = L.block_table + L.block_table_offsets[s];
    auto load = [&](int64_t b, int stage) {
      const T* src = ikb + static_cast<int64_t>(table[b]) * bs * kQtDim;
      unsigned char* dst = raw + stage * QtSmem<T>::kRawBytes;
      for (int e = threadIdx.x; e < bs * RawChunks; e += blockDim.x) {
        const int key = e / RawChunks, ch = e % RawChunks;
        // bf16: swizzled in place; fp8: plain rows, widened (and swizzled) after.
        const int off = kFp8 ? e * 16 : qt_swz(key, ch);
        detail::cp_async16(dst + off, reinterpret_cast<const uint4*>(src + key * kQtDim) + ch);
      }
      detail::cp_async_commit();
    };
    if (b0 < b1) load(b0, 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int stage = static_cast<int>((b - b0) & 1);
      if (b + 1 < b1) {
        load(b + 1, stage ^ 1);
        detail::cp_async_wait<1>();
      } else {
        detail::cp_async_wait<0>();
      }
      __syncthreads();
      const unsigned char* tilep = raw + stage * QtSmem<T>::kRawBytes;
      if constexpr (kFp8) {
        // 16 codes -> 16 f16 (two 16-byte chunks of the swizzled layout).
        for (int e = threadIdx.x; e < bs * RawChunks; e += blockDim.x) {
          const int key = e / RawChunks, ch = e % RawChunks;
          const uint4 v = *reinterpret_cast<const uint4*>(tilep + e * 16);
          uint32_t h[8];
          M::unpack(v, h);
          *reinterpret_cast<uint4*>(wide + qt_swz(key, 2 * ch)) =
              make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(wide + qt_swz(key, 2 * ch + 1)) =
              make_uint4(h[4], h[5], h[6], h[7]);
        }
        __syncthreads();
        tilep = wide;
      }
      const int64_t page = table[b];
      float mx[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mx[nt][0] = mx[nt][1] = -INFINITY;
      for (int mt = 0; mt < mtiles; ++mt) {
        float d[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
        // ldmatrix x4: lanes 0-7 rows 0-7 / chunk 2ks, 8-15 rows 8-15 / 2ks, 16-23 rows 0-7 /
        // 2ks+1, 24-31 rows 8-15 / 2ks+1: registers a0..a3 of the A fragment.
        const int lrow = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int ks = 0; ks < KSteps; ++ks) {
          uint32_t a[4];
          detail::ldmatrix_x4(detail::smem_addr(tilep + qt_swz(lrow, 2 * ks + (lane >> 4))), a[0],
                              a[1], a[2], a[3]);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) M::mma(d[nt], a, qb[nt][ks][0], qb[nt][ks][1]);
        }
        float s_lo = 1.f, s_hi = 1.f;
        if constexpr (kFp8) {
          s_lo = __ldg(c.ik_scale + page * bs + mt * 16 + r);
          s_hi = __ldg(c.ik_scale + page * bs + mt * 16 + r + 8);
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          mx[nt][0] = fmaxf(mx[nt][0], fmaxf(s_lo * d[nt][0], s_hi * d[nt][2]));
          mx[nt][1] = fmaxf(mx[nt][1], fmaxf(s_lo * d[nt][1], s_hi * d[nt][3]));
        }
      }
      // Max over the 8 row groups (lanes with one cq), then lanes 0-3 write their columns.
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int off = 4; off < kWarp; off <<= 1)
            mx[nt][j] = fmaxf(mx[nt][j], __shfl_xor_sync(0xffffffffu, mx[nt][j], off));
      if (r == 0) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = warp * 32 + nt * 8 + 2 * cq + j;
            const int ti = col / NIP, h = col % NIP;
            if (ti >= i0 && ti < i1 && h < ni && b < tok_hi[ti])
              scores[((t0 + ti) * ni + h) * nb_stride + b] = mx[nt][j];
          }
      }
      __syncthreads();  // the stage is reloaded two blocks on
    }
    i0 = i1;
  }
}

bool tiled_score_supported(const KvPages& c, int64_t ni) {
  return c.ik_dtype != KvDtype::kF32 && ni >= 1 && ni <= 8 && c.index_dim == kQtDim &&
         c.page_size >= 16 && c.page_size <= kQtMaxKeys && c.page_size % 16 == 0;
}

// ---- (b) top-k ----

struct TopkShared {
  uint32_t hist[256];
  uint32_t scan[33];
  uint32_t digit, need;
};

// Writes id_of(i) for the topk indices i of [0, nb) ranked by (key desc, index asc) to o, in
// ascending index order. nb > topk. Histogram passes visit indices strided over the threads
// (coalesced; lanes with one bin add once, through __match_any_sync); the compaction walks
// chunks of blockDim indices in order.
template <class KeyFn, class IdFn>
__device__ void radix_topk_ids(KeyFn key, IdFn id_of, int64_t nb, int64_t topk,
                               int32_t* __restrict__ o, TopkShared& sh) {
  const int nt = blockDim.x, tid = threadIdx.x, lane = tid % kWarp;
  uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(topk);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += nt) sh.hist[i] = 0;
    __syncthreads();
    for (int64_t b0 = 0; b0 < nb; b0 += nt) {
      const int64_t b = b0 + tid;
      const uint32_t k = b < nb ? key(b) : 0u;
      const bool hit = b < nb && (k & mask) == prefix;
      const uint32_t bin = (k >> shift) & 0xffu;
      const unsigned active = __ballot_sync(0xffffffffu, hit);
      if (hit) {
        const unsigned peers = __match_any_sync(active, bin);
        if (lane == __ffs(peers) - 1)
          atomicAdd(&sh.hist[bin], static_cast<uint32_t>(__popc(peers)));
      }
    }
    __syncthreads();
    if (tid < kWarp) {
      // Lane l owns digits 8l..8l+7; find the digit where the count from the top reaches need.
      uint32_t cnt[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        cnt[j] = sh.hist[tid * 8 + j];
        sum += cnt[j];
      }
      uint32_t incl = sum;  // elements in the digits of lanes >= this one
      for (int off = 1; off < kWarp; off <<= 1) {
        const uint32_t n = __shfl_down_sync(0xffffffffu, incl, off);
        if (tid + off < kWarp) incl += n;
      }
      uint32_t above = incl - sum;
#pragma unroll
      for (int j = 7; j >= 0; --j) {
        if (above < need && above + cnt[j] >= need) {
          sh.digit = static_cast<uint32_t>(tid * 8 + j);
          sh.need = need - above;
        }
        above += cnt[j];
      }
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    mask |= 0xffu << shift;
    need = sh.need;
  }
  // prefix is the k-th key: take every larger key and the `need` lowest ids equal to it. An id's
  // output slot is (larger keys before it) + min(equal keys before it, need).
  const uint32_t thr = prefix, need_eq = need;
  uint32_t base_gt = 0, base_eq = 0;
  for (int64_t b0 = 0; b0 < nb; b0 += nt) {
    const int64_t b = b0 + tid;
    const uint32_t k = b < nb ? key(b) : 0u;
    const uint32_t gt = b < nb && k > thr, eq = b < nb && k == thr;
    uint32_t total;
    const uint32_t ex = detail::block_exclusive_scan(gt << 16 | eq, sh.scan, &total);
    const uint32_t gt_before = base_gt + (ex >> 16), eq_before = base_eq + (ex & 0xffffu);
    if (gt || (eq && eq_before < need_eq)) o[gt_before + min(eq_before, need_eq)] = id_of(b);
    base_gt += total >> 16;
    base_eq += total & 0xffffu;
    if (base_gt + min(base_eq, need_eq) >= topk) break;  // uniform: all topk written
  }
}

// The ids of [0, nb) themselves (radix_topk_ids with the identity).
template <class KeyFn>
__device__ void radix_topk(KeyFn key, int64_t nb, int64_t topk, int32_t* __restrict__ o,
                           TopkShared& sh) {
  radix_topk_ids(
      key, [](int64_t b) { return static_cast<int32_t>(b); }, nb, topk, o, sh);
}

__device__ __forceinline__ bool write_all_blocks(int64_t nb, int64_t topk, int32_t* o) {
  if (nb > topk) return false;
  for (int64_t i = threadIdx.x; i < topk; i += blockDim.x)
    o[i] = i < nb ? static_cast<int32_t>(i) : -1;
  return true;
}

// Prefill rows (tokens in_multi_run) with at most kWarpTopkMaxBlocks blocks: one warp per
// (token, index head) instead of a 1024-thread CTA. The keys go to the warp's shared memory;
// topk rounds each take the warp's largest key (the lower id on equal keys: the radix select's
// order, forced blocks keyed +inf) and clear it; the winners are written in ascending order by
// rank. A prefill step has one row per token and head, each over few blocks, so the CTA radix
// select's passes and barriers cost more than the ranking itself.
constexpr int kWarpTopkWarps = 4;
constexpr int64_t kWarpTopkMaxBlocks = 2048;

__device__ __forceinline__ bool warp_topk_row(const TokenLayout& L, int64_t t, int64_t bs,
                                              int64_t topk) {
  return topk <= kWarp && detail::in_multi_run(L, t) &&
         L.positions[t] / bs + 1 <= kWarpTopkMaxBlocks;
}

__global__ void __launch_bounds__(kWarpTopkWarps* kWarp)
    msa_topk_warp_kernel(int64_t ni, TokenLayout L, int64_t bs, int64_t topk, int64_t init_blocks,
                         int64_t local_blocks, int64_t nb_stride, int64_t key_cap,
                         const float* __restrict__ scores, int32_t* __restrict__ out) {
  extern __shared__ uint32_t warp_keys[];  // [kWarpTopkWarps][key_cap]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpTopkWarps + warp;
  if (w >= L.num_tokens * ni) return;
  const int64_t t = w / ni;
  if (!warp_topk_row(L, t, bs, topk)) return;  // the CTA kernel's row
  const int64_t nb = L.positions[t] / bs + 1;
  int32_t* o = out + w * topk;
  if (nb <= topk) {
    for (int64_t i = lane; i < topk; i += kWarp) o[i] = i < nb ? static_cast<int32_t>(i) : -1;
    return;
  }
  M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)",
                  L.positions[t], static_cast<long long>(nb_stride));
  uint32_t* keys = warp_keys + warp * key_cap;  // nb <= key_cap: nb <= nb_stride
  const float* sc = scores + w * nb_stride;
  const int64_t hi_forced = nb - local_blocks;
  for (int64_t b = lane; b < nb; b += kWarp)
    keys[b] = (b < init_blocks || b >= hi_forced) ? forced_key() : order_key(sc[b]);
  __syncwarp();
  int32_t mine = -1;  // lane k: the k-th winner
  for (int k = 0; k < topk; ++k) {
    uint32_t bk = 0u;  // below every score's key (a taken key is 0)
    int32_t bid = 0x7fffffff;
    for (int64_t b = lane; b < nb; b += kWarp) {
      const uint32_t kb = keys[b];
      if (kb > bk) {  // ascending b: the lane's lowest id among its equal keys
        bk = kb;
        bid = static_cast<int32_t>(b);
      }
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      const uint32_t ok = __shfl_xor_sync(0xffffffffu, bk, off);
      const int32_t oid = __shfl_xor_sync(0xffffffffu, bid, off);
      if (ok > bk || (ok == bk && oid < bid)) {
        bk = ok;
        bid = oid;
      }
    }
    if (lane == k) mine = bid;
    if (lane == bid % kWarp) keys[bid] = 0u;
    __syncwarp();
  }
  int rank = 0;
  for (int j = 0; j < topk; ++j) {
    const int32_t other = __shfl_sync(0xffffffffu, mine, j);
    rank += other < mine ? 1 : 0;
  }
  if (lane < topk) o[rank] = mine;
}

// keys_in_smem: the token's keys are converted once into shared memory [nb_stride] (else every
// pass reads the score row from global memory).
__global__ void __launch_bounds__(kTopkThreads)
    msa_topk_kernel(int64_t ni, TokenLayout L, int64_t bs, int64_t topk, int64_t init_blocks,
                    int64_t local_blocks, int64_t nb_stride, bool keys_in_smem, bool skip_warp_rows,
                    const float* __restrict__ scores, int32_t* __restrict__ out) {
  extern __shared__ uint32_t topk_keys[];
  __shared__ TopkShared sh;
  detail::pdl_enter();
  // Rows in a grid-stride loop: with skip_warp_rows most rows of a prefill step are the warp
  // kernel's, and a CTA per row would be launched only to leave.
  for (int64_t w = blockIdx.x; w < L.num_tokens * ni; w += gridDim.x) {
    const int64_t t = w / ni;
    if (skip_warp_rows && warp_topk_row(L, t, bs, topk)) continue;  // msa_topk_warp_kernel's
    const int64_t nb = L.positions[t] / bs + 1;
    int32_t* o = out + w * topk;
    if (write_all_blocks(nb, topk, o)) continue;
    M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)",
                    L.positions[t], static_cast<long long>(nb_stride));
    const float* sc = scores + w * nb_stride;
    const int64_t hi_forced = nb - local_blocks;
    auto key = [&](int64_t b) {
      return (b < init_blocks || b >= hi_forced) ? forced_key() : order_key(sc[b]);
    };
    if (keys_in_smem) {
      for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) topk_keys[b] = key(b);
      __syncthreads();
      radix_topk([&](int64_t b) { return topk_keys[b]; }, nb, topk, o, sh);
    } else {
      radix_topk(key, nb, topk, o, sh);
    }
    __syncthreads();  // the next row reuses the shared keys and histograms
  }
}

// Step one of the split top-k: CTA (row w, split s) writes the topk of blocks
// [s * kSplitKeys, ...) of the row (the ranking of msa_topk_kernel: forced blocks first, then
// (score desc, id asc)), ascending, to cand[w][s]; the last split of a row may hold fewer than
// topk blocks and then writes them all. The global topk of a row is within the union of its
// splits' topk (a block outranked by fewer than topk blocks of the row is outranked by fewer than
// topk of its split), so step two ranks only those.
__global__ void __launch_bounds__(kTopkThreads)
    msa_topk_split_kernel(int64_t ni, TokenLayout L, int64_t bs, int64_t topk, int64_t init_blocks,
                          int64_t local_blocks, int64_t nb_stride, int64_t splits,
                          const float* __restrict__ scores, int32_t* __restrict__ cand) {
  __shared__ TopkShared sh;
  detail::pdl_enter();
  const int64_t w = blockIdx.x, s = blockIdx.y, t = w / ni;
  const int64_t nb = L.positions[t] / bs + 1;
  const int64_t b0 = s * kSplitKeys;
  if (nb <= topk || b0 >= nb) return;  // uniform: the merge writes all, or no blocks here
  M3_DEVICE_CHECK(nb <= nb_stride, "msa_select: position %d beyond max_kv_len (%lld blocks)",
                  L.positions[t], static_cast<long long>(nb_stride));
  const int64_t len = min(kSplitKeys, nb - b0);
  int32_t* o = cand + (w * splits + s) * topk;
  if (len <= topk) {
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) o[i] = static_cast<int32_t>(b0 + i);
    return;
  }
  // Thread i only ever asks for index i (len <= blockDim): its key in a register.
  const int64_t b = b0 + threadIdx.x;
  const uint32_t mine = threadIdx.x >= len ? 0u
                        : (b < init_blocks || b >= nb - local_blocks)
                            ? forced_key()
                            : order_key(scores[w * nb_stride + b]);
  radix_topk_ids([&](int64_t) { return mine; },
                 [&](int64_t i) { return static_cast<int32_t>(b0 + i); }, len, topk, o, sh);
}

// Step two: one CTA per row ranks its splits' candidates (in ascending id order, since the splits
// are) and writes the row's topk ids, ascending; a row of at most topk blocks gets them all.
__global__ void __launch_bounds__(kTopkThreads)
    msa_topk_merge_kernel(int64_t ni, TokenLayout L, int64_t bs, int64_t topk, int64_t init_blocks,
                          int64_t local_blocks, int64_t nb_stride, int64_t splits,
                          const float* __restrict__ scores, const int32_t* __restrict__ cand,
                          int32_t* __restrict__ out) {
  extern __shared__ int32_t merge_ids[];  // [splits * topk]
  __shared__ TopkShared sh;
  detail::pdl_enter();
  const int64_t w = blockIdx.x, t = w / ni;
  const int64_t nb = L.positions[t] / bs + 1;
  int32_t* o = out + w * topk;
  if (write_all_blocks(nb, topk, o)) return;
  const int64_t used = (nb + kSplitKeys - 1) / kSplitKeys;
  const int64_t count = (used - 1) * topk + min(topk, nb - (used - 1) * kSplitKeys);
  if (count <= topk) {  // one split: its candidates are the row's picks
    for (int64_t i = threadIdx.x; i < topk; i += blockDim.x) o[i] = cand[w * splits * topk + i];
    return;
  }
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    merge_ids[i] = cand[w * splits * topk + i];
  __syncthreads();
  const float* sc = scores + w * nb_stride;
  const int64_t hi_forced = nb - local_blocks;
  radix_topk_ids(
      [&](int64_t i) {
        const int64_t b = merge_ids[i];
        return (b < init_blocks || b >= hi_forced) ? forced_key() : order_key(sc[b]);
      },
      [&](int64_t i) { return merge_ids[i]; }, count, topk, o, sh);
}

// The split top-k is on unless M3_MSA_SPLIT_TOPK=0 (the H200 run of 2026-12-02: bf16 select at
// batch 1 over 1M tokens 98.5 -> 88.1 us with it).
bool split_topk_enabled() {
  static const bool on = env_switch("M3_MSA_SPLIT_TOPK", true);
  return on;
}

// No workspace: one CTA per (token, index head) scores into shared memory, then the same top-k.
template <class T>
__global__ void __launch_bounds__(kFusedThreads)
    msa_fused_kernel(const float* __restrict__ iq, int64_t ni, KvPages c, TokenLayout L,
                     int64_t topk, int64_t init_blocks, int64_t local_blocks, int64_t max_nb,
                     int32_t* __restrict__ out) {
  extern __shared__ __align__(16) float fused_smem[];
  __shared__ TopkShared sh;
  const int64_t bs = c.page_size, di = c.index_dim;
  float* qv = fused_smem;  // [di]
  float* score = qv + di;  // [max_nb]
  const int64_t w = blockIdx.x, t = w / ni;
  const int32_t p = L.positions[t], s = L.seq_ids[t];
  const int64_t nb = p / bs + 1;
  int32_t* o = out + w * topk;
  if (write_all_blocks(nb, topk, o)) return;
  M3_DEVICE_CHECK(nb <= max_nb, "msa_select: %lld blocks, more than the %lld supported",
                  static_cast<long long>(nb), static_cast<long long>(max_nb));
  for (int64_t i = threadIdx.x; i < di; i += blockDim.x) qv[i] = index_q<T>(iq[w * di + i]);
  __syncthreads();
  const int32_t* table = L.block_table + L.block_table_offsets[s];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  const int64_t hi_forced = nb - local_blocks;
  for (int64_t b = init_blocks + warp; b < hi_forced; b += num_warps) {
    float mx = rows_max<T>(qv, c, table[b], lane, kWarp);
    mx = detail::warp_max(mx);
    if (lane == 0) score[b] = mx;
  }
  __syncthreads();
  radix_topk(
      [&](int64_t b) {
        return (b < init_blocks || b >= hi_forced) ? forced_key() : order_key(score[b]);
      },
      nb, topk, o, sh);
}

}  // namespace

size_t msa_select_workspace_bytes(int64_t num_tokens, int64_t num_index_heads, const KvPages& cache,
                                  int64_t max_kv_len) {
  if (num_tokens <= 0 || max_kv_len <= 0 || cache.page_size <= 0) return 0;
  const int64_t nb_stride = (max_kv_len + cache.page_size - 1) / cache.page_size;
  // The scores, then (rows of kSplitMinBlocks and more) the split top-k's candidates.
  const int64_t cand =
      nb_stride >= kSplitMinBlocks ? (nb_stride + kSplitKeys - 1) / kSplitKeys * kSplitMaxTopk : 0;
  return sizeof(float) * static_cast<size_t>(num_tokens * num_index_heads * nb_stride) +
         sizeof(int32_t) * static_cast<size_t>(num_tokens * num_index_heads * cand);
}

void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                       const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int64_t max_kv_len, Workspace ws, int32_t* out,
                       cudaStream_t stream) {
  M3_CHECK(cache.ik != nullptr, "cuda::msa_select_blocks: layer has no index-K cache");
  M3_CHECK(cache.ik_dtype != KvDtype::kFp8 || cache.ik_scale != nullptr,
           "cuda::msa_select_blocks: an fp8 index-K needs its scale array");
  M3_CHECK(topk > 0 && init_blocks >= 0);
  M3_CHECK(local_blocks >= 1, "cuda::msa_select_blocks: local_blocks must be >= 1");
  const int64_t T = layout.num_tokens, ni = num_index_heads, bs = cache.page_size;
  if (T == 0) return;
  M3_CHECK(T * ni <= 0x7fffffff);
  const size_t per_token = msa_select_workspace_bytes(1, ni, cache, max_kv_len);
  const int64_t chunk =
      (per_token > 0 && ws.data != nullptr) ? static_cast<int64_t>(ws.bytes / per_token) : 0;
  if (chunk == 0) {
    // A sequence's blocks map to distinct pages, so it spans at most num_pages blocks.
    const int64_t max_nb = std::min(std::max(cache.num_pages, topk + 1), kMaxMsaBlocks);
    const size_t smem = sizeof(float) * (cache.index_dim + max_nb);
    M3_CHECK(smem <= 200 * 1024, "cuda::msa_select_blocks: %zu bytes of shared memory", smem);
    detail::dispatch_kv(cache.ik_dtype, [&]<class TI>() {
      if (smem > 48 * 1024) {
        M3_CUDA_CHECK(cudaFuncSetAttribute(msa_fused_kernel<TI>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
      }
      msa_fused_kernel<TI><<<static_cast<unsigned>(T * ni), kFusedThreads, smem, stream>>>(
          iq, ni, cache, layout, topk, init_blocks, local_blocks, max_nb, out);
      M3_CUDA_CHECK_LAUNCH("msa_fused_kernel");
    });
    return;
  }
  const int64_t nb_stride = (max_kv_len + bs - 1) / bs;
  float* scores = static_cast<float*>(ws.data);
  const bool f32 = cache.ik_dtype == KvDtype::kF32;
  const bool fast = f32 && fast_score_supported(cache, ni);
  const bool mma = !f32 && mma_score_supported(cache, ni);
  const bool keys_in_smem = static_cast<size_t>(nb_stride) <= kTopkSmemKeys;
  const size_t topk_smem = keys_in_smem ? sizeof(uint32_t) * nb_stride : 0;
  static std::atomic<uint64_t> topk_attr_set{0};  // per device (attn_common.cuh)
  detail::raise_smem_limit_once(topk_attr_set, msa_topk_kernel,
                                static_cast<int>(sizeof(uint32_t) * kTopkSmemKeys));
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    TokenLayout sub = layout;
    sub.num_tokens = n;
    sub.positions = layout.positions + t0;
    sub.seq_ids = layout.seq_ids + t0;
    const float* iq_n = iq + t0 * ni * cache.index_dim;
    if (nb_stride > topk) {  // else every token selects all its blocks: nothing to score
      // One wave over the chunk's tokens (the scorer holds two CTAs per SM): a second, partial
      // wave would double the time.
      const int64_t slots = 2 * static_cast<int64_t>(detail::num_sms());
      int64_t chunks = n <= slots ? slots / n : 1;
      chunks = std::max<int64_t>(1, std::min<int64_t>({chunks, nb_stride, 65535}));
      const unsigned cu = static_cast<unsigned>(chunks);
      if (mma) {
        detail::dispatch_kv(cache.ik_dtype, [&]<class TI>() {
          if constexpr (sizeof(TI) < 4) {
            // Prefill chunks: their tokens' scores from the query-tiled kernel; the per-token
            // kernel then takes only the tokens alone in their sequence.
            const bool tiled = layout.multi_token_seqs && tiled_score_supported(cache, ni);
            if (tiled) {
              auto launch = [&]<int NIP>(auto kernel) {
                constexpr int smem = QtSmem<TI>::kBytes;
                static std::atomic<uint64_t> attr_set{0};
                detail::raise_smem_limit_once(attr_set, kernel, smem);
                static const int qocc = [&] {
                  int b = 0;
                  M3_CUDA_CHECK(
                      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kQtThreads, smem));
                  return std::max(b, 1);
                }();
                const int64_t ntile = (n + kQtColumns / NIP - 1) / (kQtColumns / NIP);
                const int64_t want = 2 * qocc * static_cast<int64_t>(detail::num_sms());
                int64_t ychunks = ntile < want ? want / ntile : 1;
                ychunks = std::max<int64_t>(1, std::min<int64_t>({ychunks, nb_stride, 65535}));
                kernel<<<dim3(static_cast<unsigned>(ntile), static_cast<unsigned>(ychunks)),
                         kQtThreads, smem, stream>>>(iq_n, ni, cache, sub, topk, init_blocks,
                                                     local_blocks, nb_stride, scores);
                M3_CUDA_CHECK_LAUNCH("msa_score_tiled_kernel");
              };
              if (ni <= 4)
                launch.template operator()<4>(msa_score_tiled_kernel<TI, 4>);
              else
                launch.template operator()<8>(msa_score_tiled_kernel<TI, 8>);
            }
            // One full wave: as many CTAs as fit on the GPU at once, spread over the tokens.
            static const int occ = [] {
              int b = 0;
              M3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                  &b, msa_score_mma_kernel<TI>, kMmaScoreThreads, 0));
              return std::max(b, 1);
            }();
            const int64_t want = occ * static_cast<int64_t>(detail::num_sms());
            int64_t mchunks = n <= want ? want / n : 1;
            mchunks = std::max<int64_t>(1, std::min<int64_t>({mchunks, nb_stride, 65535}));
            const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(mchunks));
            detail::launch_pdl_attn(msa_score_mma_kernel<TI>, grid, dim3(kMmaScoreThreads), 0,
                                    stream, iq_n, ni, cache, sub, topk, init_blocks, local_blocks,
                                    nb_stride, tiled, scores);
          }
        });
      } else if (fast) {
        const dim3 grid(static_cast<unsigned>(n), cu);
        if (ni <= 4) {
          msa_score_kernel<4><<<grid, kScoreThreads, 0, stream>>>(
              iq_n, ni, cache, sub, topk, init_blocks, local_blocks, nb_stride, scores);
        } else {
          msa_score_kernel<8><<<grid, kScoreThreads, 0, stream>>>(
              iq_n, ni, cache, sub, topk, init_blocks, local_blocks, nb_stride, scores);
        }
        M3_CUDA_CHECK_LAUNCH("msa_score_kernel");
      } else {
        const size_t smem = sizeof(float) * ni * cache.index_dim;
        M3_CHECK(smem <= 48 * 1024, "cuda::msa_select_blocks: index q of %zu bytes", smem);
        detail::dispatch_kv(cache.ik_dtype, [&]<class TI>() {
          msa_score_generic_kernel<TI>
              <<<dim3(static_cast<unsigned>(n), cu), kGenericScoreThreads, smem, stream>>>(
                  iq_n, ni, cache, sub, topk, init_blocks, local_blocks, nb_stride, scores);
          M3_CUDA_CHECK_LAUNCH("msa_score_generic_kernel");
        });
      }
    }
    // Prefill rows over few blocks: a warp each (msa_topk_warp_kernel); the CTA radix select
    // takes the rest.
    const bool warp_rows = layout.multi_token_seqs && topk <= 32;
    const int64_t rows = n * ni;
    if (warp_rows) {
      // Shared keys sized to the step's longest row (more warps resident at short contexts).
      const int64_t key_cap = std::min(nb_stride, kWarpTopkMaxBlocks);
      const int smem = static_cast<int>(sizeof(uint32_t) * kWarpTopkWarps * key_cap);
      static std::atomic<uint64_t> warp_attr_set{0};
      detail::raise_smem_limit_once(
          warp_attr_set, msa_topk_warp_kernel,
          static_cast<int>(sizeof(uint32_t) * kWarpTopkWarps * kWarpTopkMaxBlocks));
      msa_topk_warp_kernel<<<static_cast<unsigned>((rows + kWarpTopkWarps - 1) / kWarpTopkWarps),
                             kWarpTopkWarps * kWarp, smem, stream>>>(
          ni, sub, bs, topk, init_blocks, local_blocks, nb_stride, key_cap, scores,
          out + t0 * ni * topk);
      M3_CUDA_CHECK_LAUNCH("msa_topk_warp_kernel");
    }
    // A decode step's few rows over many blocks: the two-step split top-k.
    const int64_t splits = (nb_stride + kSplitKeys - 1) / kSplitKeys;
    const size_t merge_smem = sizeof(int32_t) * static_cast<size_t>(splits * topk);
    if (split_topk_enabled() && !warp_rows && nb_stride >= kSplitMinBlocks &&
        topk <= kSplitMaxTopk && rows < detail::num_sms() && merge_smem <= 48 * 1024 &&
        splits <= 65535) {
      int32_t* cand = reinterpret_cast<int32_t*>(scores + chunk * ni * nb_stride);
      detail::launch_pdl_attn(msa_topk_split_kernel,
                              dim3(static_cast<unsigned>(rows), static_cast<unsigned>(splits)),
                              dim3(kTopkThreads), 0, stream, ni, sub, bs, topk, init_blocks,
                              local_blocks, nb_stride, splits, scores, cand);
      detail::launch_pdl_attn(msa_topk_merge_kernel, dim3(static_cast<unsigned>(rows)),
                              dim3(kTopkThreads), merge_smem, stream, ni, sub, bs, topk,
                              init_blocks, local_blocks, nb_stride, splits, scores, cand,
                              out + t0 * ni * topk);
      continue;
    }
    // With warp rows: at most two waves of CTAs, looping over the rows (most only skip).
    const int64_t radix_ctas =
        warp_rows ? std::min<int64_t>(rows, 4 * static_cast<int64_t>(detail::num_sms())) : rows;
    detail::launch_pdl_attn(msa_topk_kernel, dim3(static_cast<unsigned>(radix_ctas)),
                            dim3(kTopkThreads), topk_smem, stream, ni, sub, bs, topk, init_blocks,
                            local_blocks, nb_stride, keys_in_smem, warp_rows, scores,
                            out + t0 * ni * topk);
  }
}

}  // namespace m3::kernels::cuda
