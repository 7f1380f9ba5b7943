// Query-tiled dense causal attention on the paged bf16 / fp8 cache (head_dim 128, GQA group
// dividing 16): the prefill path. The per-token kernels of attn_paged.cu read every key once per
// query token, which bounds prefill at a few tens of TFLOP/s; here one CTA takes 64 query rows
// (the group's heads of 64 / group consecutive tokens of one sequence, one kv head) and streams
// the sequence's keys in tiles of 64 through shared memory, so each key tile serves all of them
// (FlashAttention-2's structure on mma.sync m16n8k16):
//   - K / V tiles arrive by cp.async, two stages (tile j + 1 loads while tile j computes), rows
//     stored as 16-byte chunks XOR-swizzled by the key's low 3 bits so ldmatrix reads are free of
//     bank conflicts; an fp8 tile is widened to f16 in shared memory once per tile (exact), then
//     read like a bf16 one.
//   - each warp owns 16 rows: S = Q·K^T on 64 MMAs per tile (Q fragments in registers, rounded
//     as the per-token kernel rounds them), an online softmax in the exp2 domain, O += P·V on 64
//     more with P rounded to the MMA type (bf16; f16 for fp8), V fragments by ldmatrix.trans.
//   - rows carry their own positions (the causal mask), so a tile may hold tokens of several
//     sequences (one pass per run of the tile) and positions need not be consecutive.
// Tokens that are alone in their sequence (decode rows of a mixed step) are left to the
// per-token kernel, which splits long contexts over CTAs. Numerics: those of
// attention_mma_kernel (the CPU twin's bound in tests/kernels/attn_cuda_test.cpp applies).
#include <algorithm>
#include <atomic>

#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda::detail {

namespace {

constexpr int kPfWarps = 4;
constexpr int kPfThreads = kPfWarps * kWarp;
constexpr int kPfRows = kPfWarps * 16;  // query rows per CTA (tokens x heads of one kv head)
constexpr int kPfKeys = 64;             // keys per tile
constexpr int kPfDim = 128;
constexpr int kPfTileBytes16 = kPfKeys * kPfDim * 2;  // one 16-bit [64][128] tile

template <class T>
struct PfSmem {
  static constexpr int kRowBytes = kPfDim * int(sizeof(T));
  static constexpr int kStageBytes = 2 * kPfKeys * kRowBytes;  // K rows, then V rows
  static constexpr int kStages = 2;
  // fp8: the widened f16 K and V tiles after the stages.
  static constexpr int kWideBytes = sizeof(T) == 1 ? 2 * kPfTileBytes16 : 0;
  static constexpr int kBytes = kStages * kStageBytes + kWideBytes;
};

// Byte offset of (key, 16-byte chunk c) in a 16-bit [64][128] tile.
__device__ __forceinline__ int swz16(int key, int c) {
  return key * (kPfDim * 2) + ((c ^ (key & 7)) << 4);
}

template <class T>
__global__ void __launch_bounds__(kPfThreads, 2)
    attention_prefill_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c,
                             TokenLayout L, float scale, int64_t max_kv_len,
                             float* __restrict__ out) {
  using M = MmaOf<T>;
  using Sm = PfSmem<T>;
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr int D = kPfDim;
  constexpr int KSteps = D / 16;                    // MMA k-steps of a Q·K^T dot
  constexpr int NT = kPfKeys / 8;                   // score n-tiles per key tile
  constexpr int OT = D / 8;                         // output n-tiles
  constexpr int Chunks = D * int(sizeof(T)) / 16;   // 16-byte chunks of a stored row
  constexpr int RowsPerPass = kPfThreads / Chunks;  // rows one sweep of the CTA copies
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(128) unsigned char pf_smem[];
  __shared__ int32_t tok_pos[kPfRows], tok_seq[kPfRows];

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads;
  const int32_t bs32 = static_cast<int32_t>(c.page_size);
  const int group = static_cast<int>(num_heads / nkv);
  const int tpc = kPfRows / group;  // tokens per CTA
  const int64_t ntok = L.num_tokens;
  const int64_t ntile = (ntok + tpc - 1) / tpc;
  // The last tiles (the longest causal rows of a prefill) start first.
  const int64_t tile = ntile - 1 - static_cast<int64_t>(blockIdx.x) / nkv;
  const int64_t g = static_cast<int64_t>(blockIdx.x) % nkv;
  const int64_t t0 = tile * tpc;
  for (int i = threadIdx.x; i < tpc; i += blockDim.x) {
    const int64_t t = t0 + i;
    const bool mine = t < ntok && in_multi_run(L, t);
    tok_seq[i] = mine ? L.seq_ids[t] : -1;
    tok_pos[i] = mine ? L.positions[t] : -1;
    if (mine)
      M3_DEVICE_CHECK(max_kv_len <= 0 || tok_pos[i] < max_kv_len,
                      "attention: position %d beyond max_kv_len %lld", tok_pos[i],
                      static_cast<long long>(max_kv_len));
  }
  __syncthreads();

  const T* kbase = c.k_as<T>();
  const T* vbase = c.v_as<T>();
  unsigned char* wide = pf_smem + Sm::kStages * Sm::kStageBytes;  // fp8 only
  const float smul = (kFp8 ? scale * c.k_scale : scale) * kLog2e;
  const float vmul = kFp8 ? c.v_scale : 1.f;
  // The warp's rows: r and r + 8 of its m16 tile = row warp * 16 + r (+ 8) of the CTA, i.e.
  // head (row % group) of token (row / group).
  const int row_lo = warp * 16 + r, row_hi = row_lo + 8;
  const int tok_lo = row_lo / group, tok_hi = row_hi / group;

  for (int i0 = 0; i0 < tpc;) {
    // One pass per run of one sequence inside the tile.
    const int32_t s = tok_seq[i0];
    int i1 = i0 + 1;
    while (i1 < tpc && tok_seq[i1] == s) ++i1;
    if (s < 0) {
      i0 = i1;
      continue;
    }
    int32_t pmax = -1;
    for (int i = i0; i < i1; ++i) pmax = max(pmax, tok_pos[i]);
    const bool in_lo = tok_lo >= i0 && tok_lo < i1, in_hi = tok_hi >= i0 && tok_hi < i1;
    const int32_t p_lo = in_lo ? tok_pos[tok_lo] : -1, p_hi = in_hi ? tok_pos[tok_hi] : -1;
    // Warp-uniform bounds of its rows' positions (-1 for rows outside the pass: all masked).
    int32_t wmax = max(p_lo, p_hi), wmin = min(p_lo, p_hi);
    for (int o = 1; o < kWarp; o <<= 1) {
      wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
      wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
    }
    // Q fragments (rows r, r + 8; k = 16 ks + 2 cq, +1, +8, +9), rounded as attention_mma_kernel
    // rounds them.
    uint32_t qa[KSteps][4];
    {
      const float* qlo = q + ((t0 + tok_lo) * num_heads + g * group + row_lo % group) * D;
      const float* qhi = q + ((t0 + tok_hi) * num_heads + g * group + row_hi % group) * D;
      auto qv = [&](bool in, const float* qr, int k) { return in ? round_bf16(qr[k]) : 0.f; };
#pragma unroll
      for (int ks = 0; ks < KSteps; ++ks) {
        const int k = ks * 16 + 2 * cq;
        qa[ks][0] = M::pack(qv(in_lo, qlo, k), qv(in_lo, qlo, k + 1));
        qa[ks][1] = M::pack(qv(in_hi, qhi, k), qv(in_hi, qhi, k + 1));
        qa[ks][2] = M::pack(qv(in_lo, qlo, k + 8), qv(in_lo, qlo, k + 9));
        qa[ks][3] = M::pack(qv(in_hi, qhi, k + 8), qv(in_hi, qhi, k + 9));
      }
    }
    const int32_t* table = L.block_table + L.block_table_offsets[s];
    const int nkt = pmax / kPfKeys + 1;
    // Tile j's K and V rows into stage j % 2 (keys past pmax zero-filled).
    auto issue = [&](int j) {
      unsigned char* st = pf_smem + (j % Sm::kStages) * Sm::kStageBytes;
      const int ch = threadIdx.x % Chunks;
#pragma unroll
      for (int it = 0; it < kPfKeys / RowsPerPass; ++it) {
        const int kr = it * RowsPerPass + threadIdx.x / Chunks;
        const int32_t key = j * kPfKeys + kr;
        const bool valid = key <= pmax;
        int64_t row = 0;
        if (valid) row = (static_cast<int64_t>(table[key / bs32]) * bs32 + key % bs32) * nkv + g;
        const int off = kFp8 ? kr * Sm::kRowBytes + ch * 16 : swz16(kr, ch);
        cp_async16_zfill(st + off, reinterpret_cast<const uint4*>(kbase + row * D) + ch, valid);
        cp_async16_zfill(st + kPfKeys * Sm::kRowBytes + off,
                         reinterpret_cast<const uint4*>(vbase + row * D) + ch, valid);
      }
      cp_async_commit();
    };

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[OT][4];
#pragma unroll
    for (int n = 0; n < OT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

    issue(0);
    for (int j = 0; j < nkt; ++j) {
      if (j + 1 < nkt) {
        issue(j + 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const unsigned char* st = pf_smem + (j % Sm::kStages) * Sm::kStageBytes;
      const unsigned char* kt = st;
      const unsigned char* vt = st + kPfKeys * Sm::kRowBytes;
      if constexpr (kFp8) {
        // Widen the stage's codes to f16 (exact) into the swizzled 16-bit layout.
        for (int u = threadIdx.x; u < 2 * kPfKeys * Chunks; u += blockDim.x) {
          const int half = u / (kPfKeys * Chunks), rem = u % (kPfKeys * Chunks);
          const int kr = rem / Chunks, ch = rem % Chunks;
          const uint4 v = *reinterpret_cast<const uint4*>(st + half * kPfKeys * Sm::kRowBytes +
                                                          kr * Sm::kRowBytes + ch * 16);
          uint32_t h[8];
          M::unpack(v, h);
          unsigned char* dst = wide + half * kPfTileBytes16;
          *reinterpret_cast<uint4*>(dst + swz16(kr, 2 * ch)) = make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(dst + swz16(kr, 2 * ch + 1)) =
              make_uint4(h[4], h[5], h[6], h[7]);
        }
        __syncthreads();
        kt = wide;
        vt = wide + kPfTileBytes16;
      }
      const int key0 = j * kPfKeys;
      if (key0 <= wmax) {
        float x[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[n][e] = 0.f;
        // S = Q·K^T: lanes 0-7 / 8-15 / 16-23 / 24-31 address keys +0..7 chunk 2ks, keys +0..7
        // chunk 2ks + 1, keys +8..15 chunk 2ks, keys +8..15 chunk 2ks + 1 of a 16-key pair.
        const int kk_row = (lane / 16) * 8 + lane % 8, kk_ch = (lane / 8) & 1;
#pragma unroll
        for (int ks = 0; ks < KSteps; ++ks) {
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4(smem_addr(kt + swz16(np * 16 + kk_row, 2 * ks + kk_ch)), b0, b1, b2, b3);
            M::mma(x[2 * np], qa[ks], b0, b1);
            M::mma(x[2 * np + 1], qa[ks], b2, b3);
          }
        }
        // Scale into the exp2 domain; the causal mask where the tile reaches past a row.
        const bool need_mask = key0 + kPfKeys - 1 > wmin;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + n * 8 + 2 * cq + (e & 1);
            const int32_t p = e < 2 ? p_lo : p_hi;
            x[n][e] = (!need_mask || key <= p) ? x[n][e] * smul : -INFINITY;
          }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(x[n][2 * hh], x[n][2 * hh + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float nm = fmaxf(m[hh], mx);
          if (nm == -INFINITY) {  // every key so far masked for this row
#pragma unroll
            for (int n = 0; n < NT; ++n) x[n][2 * hh] = x[n][2 * hh + 1] = 0.f;
            continue;
          }
          const float corr = m[hh] == -INFINITY ? 0.f : exp2f(m[hh] - nm);
          m[hh] = nm;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
              const float pr = exp2f(x[n][e] - nm);  // exp2(-inf) = 0
              x[n][e] = pr;
              sum += pr;
            }
          l[hh] = l[hh] * corr + sum;
#pragma unroll
          for (int n = 0; n < OT; ++n) {
            o[n][2 * hh] *= corr;
            o[n][2 * hh + 1] *= corr;
          }
        }
        // O += P·V: P's A fragments are the score accumulators repacked (keys 16 kk ..);
        // ldmatrix.trans lanes 0-7 / 8-15 / 16-23 / 24-31 address keys +0..7 chunk 2dp, keys
        // +8..15 chunk 2dp, keys +0..7 chunk 2dp + 1, keys +8..15 chunk 2dp + 1.
        const int vv_row = ((lane / 8) & 1) * 8 + lane % 8, vv_ch = lane / 16;
#pragma unroll
        for (int kk = 0; kk < kPfKeys / 16; ++kk) {
          const uint32_t pa[4] = {M::pack(x[2 * kk][0], x[2 * kk][1]),
                                  M::pack(x[2 * kk][2], x[2 * kk][3]),
                                  M::pack(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                                  M::pack(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
          for (int dp = 0; dp < OT / 2; ++dp) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(smem_addr(vt + swz16(kk * 16 + vv_row, 2 * dp + vv_ch)), b0, b1, b2,
                              b3);
            M::mma(o[2 * dp], pa, b0, b1);
            M::mma(o[2 * dp + 1], pa, b2, b3);
          }
        }
      }
      __syncthreads();  // the stage (and the widened tile) is refilled next iteration
    }
    // The rows of this pass: l summed over the quad, then O / l.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
      l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const bool in = hh == 0 ? in_lo : in_hi;
      if (!in) continue;
      const int row = hh == 0 ? row_lo : row_hi;
      const int64_t t = t0 + row / group;
      float* orow = out + (t * num_heads + g * group + row % group) * D;
      const float inv = vmul / l[hh];
#pragma unroll
      for (int n = 0; n < OT; ++n) {
        const float2 v = make_float2(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
        *reinterpret_cast<float2*>(orow + n * 8 + 2 * cq) = v;
      }
    }
    i0 = i1;
  }
}

}  // namespace

bool prefill_tiled_supported(const KvPages& c, int64_t group) {
  return c.kv_dtype != KvDtype::kF32 && c.head_dim == kPfDim && group >= 1 && group <= 16 &&
         16 % group == 0;
}

void attention_prefill_tiled(const float* q, int64_t num_heads, const KvPages& c,
                             const TokenLayout& L, float scale, int64_t max_kv_len, float* out,
                             cudaStream_t stream) {
  const int64_t group = num_heads / c.num_kv_heads;
  M3_CHECK(prefill_tiled_supported(c, group), "attention_prefill_tiled: unsupported geometry");
  const int64_t tpc = kPfRows / group;
  const int64_t ntile = (L.num_tokens + tpc - 1) / tpc;
  const int64_t grid = ntile * c.num_kv_heads;
  M3_CHECK(grid <= 0x7fffffff);
  dispatch_kv(c.kv_dtype, [&]<class T>() {
    if constexpr (sizeof(T) < 4) {
      constexpr int smem = PfSmem<T>::kBytes;
      static std::atomic<uint64_t> attr_set{0};
      raise_smem_limit_once(attr_set, attention_prefill_kernel<T>, smem);
      attention_prefill_kernel<T><<<static_cast<unsigned>(grid), kPfThreads, smem, stream>>>(
          q, num_heads, c, L, scale, max_kv_len, out);
      M3_CUDA_CHECK_LAUNCH("attention_prefill_kernel");
    }
  });
}

}  // namespace m3::kernels::cuda::detail
