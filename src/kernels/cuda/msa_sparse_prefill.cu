// MSA block-sparse attention for prefill chunks (issue #16 item 2) on the paged bf16 / fp8 cache,
// head_dim 128, GQA group <= 16: the rows of tokens that share their sequence with a neighbour
// (TokenLayout::multi_token_seqs); tokens alone in their sequence stay with the per-token kernel
// of attn_paged.cu (its KV splits serve a decode token's latency).
//
// One CTA of four warps takes four consecutive tokens x one kv head; warp w always computes the
// 16 query rows (the group's heads, zero-padded) of token w over the blocks that token selected.
// The CTA first decides how its warps share key tiles, from the selected ids alone (no pre-pass,
// no host sync): with T = 4 the four warps stream the UNION of the four tokens' blocks through
// one cp.async ring, so a block picked by several neighbours is read once for all of them; with
// T = 2 each pair of warps streams its pair's union; with T = 1 each warp streams its own token's
// blocks. The CTA takes the T whose total union (blocks read) is smallest after a per-T weight
// (a larger T lets warps whose token did not pick a block idle at its tiles), so random
// selections (neighbours share only the local block) run as T = 1 and a trained model's
// overlapping ones as T = 4.
//
// A warp group of T warps has its own ring of kStages stages of 16 T keys (K rows, then V rows,
// 16-byte chunks XOR-swizzled so the fragment reads below are free of bank conflicts); a group's
// virtual key list is its union entries x page_size keys, each key of the stage carries one bit
// per token (picked by that token and at or before its position: the causal mask of the local
// block and of a partial last block), and a key no token of the group may see is zero-filled
// (never read: unwritten slots may hold anything). Per 16-key sub-tile a warp computes
// S[16 heads x 16 keys] = Q.K^T on m16n8k16 MMAs (q rounded to bf16, fp32 accumulation, the
// reduction index permuted as kv_k_base assigns it so each lane's 16-byte reads of a row feed
// its fragments directly, as attention_mma_kernel does), an online softmax in the exp2 domain
// over the whole stage, then O += P.V with P rounded to the MMA type (bf16; f16 for fp8, whose
// codes widen to f16 exactly in registers). Numerics: those of attention_mma_kernel (the CPU
// twin's bound in tests/kernels/attn_cuda_test.cpp applies).
//
// The T = 1 loop (sp_token_core) also serves attention_paged's dense decode rows over a bf16 /
// fp8 cache (attention_decode_tma_kernel, at the end): a split-KV grid whose warps each stream a
// contiguous run of 16-key tiles through their TMA ring, merged into the combine kernel's split
// format. Against attention_mma_kernel's per-lane cp.async rings (one H200 run, 2026-12-02,
// bench_msa_decode, one layer, us): bf16 batch 1 at 128K / 1M 109.6 -> 86.3, 630.0 -> 532.4,
// batch 8 at 1M 4898 -> 4085; fp8 89.1 -> 66.0, 481.5 -> 317.3, 3652 -> 2352. The cp.async
// kernel issued 16 copies per lane per tile and was bound by its instruction stream (ncu: 4.3
// cycles per issued instruction, 8 warps per SM, no memory stall on top), not by bandwidth.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "core/env.h"
#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

constexpr int kSpWarps = 4;  // = tokens per CTA
constexpr int kSpThreads = kSpWarps * detail::kWarp;
constexpr int kSpDim = 128;
constexpr int kSpRows = 16;     // query rows per warp (the MMA's M)
constexpr int kSpMaxSel = 32;   // selected-list length: 4 tokens x 32 ids = one per thread
constexpr int kSpSubKeys = 16;  // keys per sub-tile (one MMA k-step of P.V)

// Stages of the T = 1 rings (a build-time knob for the standalone harness): bf16 3 (102 KB per
// CTA, two CTAs per SM), fp8 5 (90 KB).
// M3_SP_T1_TMA = 1 (the default) builds the TMA T = 1 path (sp_token_loop); 0 keeps T = 1 on
// sp_group_loop's cp.async ring (also where the tensor maps cannot be made). Measured with the
// standalone harness on the H200 (2026-12-02, both builds in one run, 32K tokens, random
// selections): T = 1 bf16 25.7 -> 17.7 ms (83 -> 121 TFLOP/s), fp8 22.0 -> 18.7 ms (97 -> 114);
// its check against the fp32 reference passed every case (pages 8-128, groups 3-16, partial
// blocks, NaN past the tail). To compare again:
//   nvcc ... -DM3_SP_T1_TMA=0 tools/perf/msa_sparse_prefill_harness.cu
#ifndef M3_SP_T1_TMA
#define M3_SP_T1_TMA 1
#endif
#ifndef M3_SP_T1_STAGES
#define M3_SP_T1_STAGES (sizeof(T) == 1 ? 5 : 3)
#endif
constexpr int kSpT1MaxStages = 8;

template <class T>
struct SpSmem {
  static constexpr int kRowBytes = kSpDim * int(sizeof(T));
  // A stage of the whole CTA: 4 sub-tiles of 16 keys (one per warp of the CTA, whatever T),
  // K rows then V rows.
  static constexpr int kStageBytes = 2 * kSpWarps * kSpSubKeys * kRowBytes;
  static constexpr int kStages =
      sizeof(T) == 1 ? 5 : 3;  // two CTAs per SM
                               // The T = 1 path (sp_token_loop): per warp a ring of kT1Stages
                               // stages of 16 keys, K then V,
  // each as boxes of 16 rows x 128 bytes (bf16: two per row, dims 0-63 and 64-127) written by
  // the tensor-memory accelerator with its 128-byte swizzle (chunk c of row k at c ^ (k % 8)),
  // 1024-byte aligned (one more KB of dynamic shared memory for the alignment).
  static constexpr int kT1Box = 16 * 128;
  static constexpr int kT1StageBytes = 2 * kSpSubKeys * kRowBytes;
  static constexpr int kT1Stages = M3_SP_T1_STAGES;
  static constexpr int kT1Bytes = kSpWarps * kT1Stages * kT1StageBytes + 1024;
  static constexpr int kBytes =
      M3_SP_T1_TMA && kT1Bytes > kStages* kStageBytes ? kT1Bytes : kStages* kStageBytes;
};

// The XOR applied to 16-byte chunk indices of key row `key` (its index in its 16-key sub-tile).
// K fragment reads put keys 2i, 2i+1 in one 8-lane phase (4 chunks each): the swizzles must
// differ in bit 2. V fragment reads put keys {0,2,4,6} (or {1,3,5,7}) in a phase at chunk c and
// c + 2 (bf16) / c + 1 (fp8): the swizzles of those four keys must take four values that map
// both chunks to 8 distinct banks groups.
template <class T>
__device__ __forceinline__ int sp_swz(int key) {
  if constexpr (sizeof(T) == 2) {
    return (((key >> 1) & 1) | (((key >> 2) & 1) << 2)) ^ ((key & 1) << 2);
  } else {
    return (key & 6) ^ ((key & 1) << 2);
  }
}

// Barrier of one warp group (T warps, group index q): the CTA, a named barrier, or the warp.
__device__ __forceinline__ void group_sync(int T, int q) {
  if (T == kSpWarps) {
    __syncthreads();
  } else if (T > 1) {  // T = 2: two pairs, barriers 1 and 2 of 64 threads
    if (q == 0)
      asm volatile("bar.sync 1, 64;\n" ::: "memory");
    else
      asm volatile("bar.sync 2, 64;\n" ::: "memory");
  } else {
    __syncwarp();
  }
}

struct SpParams {
  float w2, w4;  // cost weights of T = 2 and T = 4 against T = 1 (union sizes)
  int force_t;   // 0: decide per CTA; 1, 2, 4: that T everywhere (tests, benches)
  int t1_tma;    // the tensor maps below are set: T = 1 runs sp_token_loop
};
// Tensor maps of the K and V caches as [slots][kv heads][128] (3-d, dims innermost first), box
// 16 slots x 1 head x 128 bytes, 128-byte swizzle.
struct SpTma {
  CUtensorMap k, v;
};

// The warps' main loop for a group of TT warps (TT = the CTA's T): the group's ring, its union
// entries [e0, e0 + ne), warp w's own token (cta token index w).
template <class T, int TT>
__device__ __forceinline__ void sp_group_loop(
    const KvPages& c, int64_t g, int32_t bs32, const int32_t* ent_pos, const int64_t* ent_slot,
    const uint8_t* ent_mask, int e0, int ne, const int32_t* tok_pos, bool tok_ok,
    const uint32_t (&qa)[kSpDim / 16][4], float smul, float vmul, unsigned char* smem,
    uint16_t (*smask)[kSpWarps][kSpWarps], float* orow_lo, float* orow_hi) {
  using M = detail::MmaOf<T>;
  using Sm = SpSmem<T>;
  using detail::kWarp;
  constexpr int D = kSpDim;
  constexpr int E = M::kElemsPer16B;
  constexpr int KPieces = D / (4 * E);
  constexpr int KSteps = D / 16;
  constexpr int VPieces = (D / 8) * int(sizeof(T)) / 16;
  constexpr int RowChunks = D * int(sizeof(T)) / 16;
  constexpr int NT = D / 8;
  constexpr int S = Sm::kStages;
  constexpr int TileKeys = kSpSubKeys * TT;
  constexpr float kLog2e = 1.4426950408889634f;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int q = warp / TT, wi = warp % TT;  // group, warp within the group
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads;
  const int64_t nvk = static_cast<int64_t>(ne) * bs32;
  const int ntiles = static_cast<int>((nvk + TileKeys - 1) / TileKeys);
  const T* kbase = c.k_as<T>();
  const T* vbase = c.v_as<T>();
  // This group's sub-tiles (one per warp of the group) within every stage.
  auto ksub = [&](int stage, int u) {
    return smem + stage * Sm::kStageBytes + (q * TT + u) * kSpSubKeys * Sm::kRowBytes;
  };
  auto vsub = [&](int stage, int u) {
    return smem + stage * Sm::kStageBytes + (kSpWarps + q * TT + u) * kSpSubKeys * Sm::kRowBytes;
  };
  // Tile i: warp wi of the group fetches sub-tile wi (keys i * TileKeys + wi * 16 + 0..15):
  // lanes 0-15 resolve one key each (source row, token bits), then the warp copies its 16 K
  // and 16 V rows. The token bits go to smask[stage][token][wi] for the computing warps.
  auto issue = [&](int i) {
    const int st = i % S;
    int64_t row = -1;
    unsigned bits = 0;
    const int64_t vk = static_cast<int64_t>(i) * TileKeys + wi * kSpSubKeys + lane % kSpSubKeys;
    if (i < ntiles && vk < nvk) {
      const int32_t e = static_cast<int32_t>(vk / bs32), o = static_cast<int32_t>(vk % bs32);
      const int32_t pos = ent_pos[e0 + e] + o;
      const unsigned m = ent_mask[e0 + e];
#pragma unroll
      for (int k = 0; k < kSpWarps; ++k)
        if (((m >> k) & 1u) && pos <= tok_pos[k]) bits |= 1u << k;
      if (bits != 0) row = (ent_slot[e0 + e] + o) * nkv + g;
    }
    unsigned any = 0;
#pragma unroll
    for (int k = 0; k < TT; ++k) {  // the group's tokens only: other groups own the rest
      const int tk = q * TT + k;
      const unsigned b = __ballot_sync(0xffffffffu, (bits >> tk) & 1u) & 0xffffu;
      any |= b;
      if (lane == 0) smask[st][tk][wi] = static_cast<uint16_t>(b);
    }
    if (any != 0) {
      constexpr int RowsPerCopy = kWarp / RowChunks;
      const int sub = lane / RowChunks, ch = lane % RowChunks;
      unsigned char* kd = ksub(st, wi);
      unsigned char* vd = vsub(st, wi);
#pragma unroll
      for (int it = 0; it < 2 * kSpSubKeys / RowsPerCopy; ++it) {
        const int rr = it * RowsPerCopy + sub;  // K rows 0..15, V rows 16..31
        const int key = rr % kSpSubKeys;
        const int64_t kr = __shfl_sync(0xffffffffu, row, key);
        const T* src = (rr >= kSpSubKeys ? vbase : kbase) + (kr >= 0 ? kr : 0) * D;
        unsigned char* dst =
            (rr >= kSpSubKeys ? vd : kd) + key * Sm::kRowBytes + ((ch ^ sp_swz<T>(key)) << 4);
        detail::cp_async16_zfill(dst, reinterpret_cast<const uint4*>(src) + ch, kr >= 0);
      }
    }
    detail::cp_async_commit();
  };

  const float sl2 = smul * kLog2e;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows r, r + 8 (exp2 domain)
  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  for (int j = 0; j < ntiles; ++j) {
    detail::cp_async_wait<S - 2>();
    group_sync(TT, q);  // tile j landed for the group; every warp is done with tile j - 1
    issue(j + S - 1);   // into the stage tile j - 1 used
    const int st = j % S;
    unsigned bm[TT];
    unsigned allb = 0;
#pragma unroll
    for (int u = 0; u < TT; ++u) {
      bm[u] = tok_ok ? smask[st][warp][u] : 0u;
      allb |= bm[u];
    }
    if (allb == 0) continue;  // warp-uniform: nothing of this tile for this token
    float x[2 * TT][4];
#pragma unroll
    for (int u = 0; u < TT; ++u) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[2 * u + nt][e] = 0.f;
        if (bm[u] == 0) continue;
        const int key = nt * 8 + r;
        const unsigned char* kr = ksub(st, u) + key * Sm::kRowBytes;
        const int sw = sp_swz<T>(key);
        uint32_t kb[2 * KSteps];
#pragma unroll
        for (int jj = 0; jj < KPieces; ++jj)
          M::unpack(*reinterpret_cast<const uint4*>(kr + (((jj * 4 + cq) ^ sw) << 4)),
                    kb + jj * (E / 2));
#pragma unroll
        for (int ks = 0; ks < KSteps; ++ks)
          M::mma(x[2 * u + nt], qa[ks], kb[2 * ks], kb[2 * ks + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + 2 * cq + (e & 1);
          x[2 * u + nt][e] = (bm[u] >> key) & 1u ? x[2 * u + nt][e] * sl2 : -INFINITY;
        }
    }
    // Online softmax over the stage's keys of rows r (e = 0, 1) and r + 8 (e = 2, 3).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2 * TT; ++n) mx = fmaxf(mx, fmaxf(x[n][2 * hh], x[n][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float nm = fmaxf(m[hh], mx);  // finite: the stage has a visible key for the token
      const float corr = m[hh] == -INFINITY ? 0.f : exp2f(m[hh] - nm);
      m[hh] = nm;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2 * TT; ++n)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float pr = exp2f(x[n][e] - nm);  // exp2(-inf) = 0
          x[n][e] = pr;
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
    // O += P.V per sub-tile: P's A fragment is the S accumulator repacked; V's B fragments pair
    // two keys' 16 consecutive dims (the output column of lane row r in n-tile n is dim 16 r + n).
#pragma unroll
    for (int u = 0; u < TT; ++u) {
      if (bm[u] == 0) continue;
      const uint32_t pa[4] = {M::pack(x[2 * u][0], x[2 * u][1]), M::pack(x[2 * u][2], x[2 * u][3]),
                              M::pack(x[2 * u + 1][0], x[2 * u + 1][1]),
                              M::pack(x[2 * u + 1][2], x[2 * u + 1][3])};
      uint32_t vv[4][8];
#pragma unroll
      for (int uu = 0; uu < 4; ++uu) {
        const int key = 2 * cq + (uu & 1) + (uu >> 1) * 8;
        const unsigned char* vr = vsub(st, u) + key * Sm::kRowBytes;
        const int sw = sp_swz<T>(key);
#pragma unroll
        for (int jj = 0; jj < VPieces; ++jj) {
          const int chunk = r * VPieces + jj;  // bytes 16 r sizeof(T) + 16 jj
          M::unpack(*reinterpret_cast<const uint4*>(vr + ((chunk ^ sw) << 4)),
                    vv[uu] + jj * (E / 2));
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const unsigned selb = (n & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(vv[0][n / 2], vv[1][n / 2], selb);
        const uint32_t b1 = __byte_perm(vv[2][n / 2], vv[3][n / 2], selb);
        M::mma(o[n], pa, b0, b1);
      }
    }
  }
  detail::cp_async_wait<0>();
  if (!tok_ok) return;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
  // Rows r / r + 8: dims 32 cq + n (o[n][0 | 2]) and 32 cq + 16 + n (o[n][1 | 3]).
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float* orow = hh == 0 ? orow_lo : orow_hi;
    if (orow == nullptr) continue;
    const float inv = vmul / l[hh];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float4* dst = reinterpret_cast<float4*>(orow + 32 * cq + 16 * half);
#pragma unroll
      for (int n4 = 0; n4 < 4; ++n4)
        dst[n4] =
            make_float4(o[4 * n4][2 * hh + half] * inv, o[4 * n4 + 1][2 * hh + half] * inv,
                        o[4 * n4 + 2][2 * hh + half] * inv, o[4 * n4 + 3][2 * hh + half] * inv);
    }
  }
}

// ---- The T = 1 path: one token per warp, bulk copies into a per-warp ring (sm_90) ----
using detail::fence_proxy_async_smem;
using detail::mbar_arrive_expect_tx;
using detail::mbar_fence_init;
using detail::mbar_init;
using detail::mbar_wait;

// One box of the 3-d tensor map at (c0, c1, c2) -> shared `dst`, completing as transaction
// bytes on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ uint32_t pack_p(float lo, float hi, uint16_t) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // RNE: pack_bf16x2's bits for finite
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_p(float lo, float hi, uint8_t) {
  return detail::pack_f16x2(lo, hi);
}

// Warp w alone over its token's entries [e0, e0 + ne) (page size a multiple of 16, so a 16-key
// tile is 16 consecutive slots of one page): lane 0 loads a tile's K and V as TMA boxes (2 + 2
// for bf16, 1 + 1 for fp8) into the warp's ring, one mbarrier per stage. Keys past the token's
// position are masked in S, and in the tile holding the token's position their V rows are
// zeroed in shared memory after the load (slots past the sequence may hold NaN, and P = 0 times
// NaN is NaN). Per tile: S = Q.K^T on 16 MMAs from ldmatrix (bf16: the natural k order; fp8:
// one 8x8 b16 matrix = 8 keys x 16 codes per k-step, the lane's 4 codes as the k slots
// {2c, 2c+1}, {2c+8, 2c+9}), the online exp2 softmax of sp_group_loop, O += P.V from
// ldmatrix.trans (bf16) or the byte-permuted codes (fp8).
//
// sp_token_core is the loop over tiles [j0, j0 + ntiles) of the entries (entry e's tiles are
// e * tpe .. e * tpe + tpe - 1, tpe = page size / 16) that leaves the running state (m, l in the
// exp2 domain, l summed over the quad, O unnormalised and without the V scale) in the caller's
// registers; pos_of(e) / slot_of(e) give entry e's first position and cache slot (slot_of is
// called by lane 0 only). sp_token_loop writes a prefill token's normalised rows from it; the
// dense decode kernel below merges the warps' states.
template <class T, int kS, class PosOf, class SlotOf>
__device__ __forceinline__ void sp_token_core(const KvPages& c, int64_t g, int32_t bs32,
                                              PosOf pos_of, SlotOf slot_of, int j0, int ntiles,
                                              int32_t tokpos, const float* qg, int group,
                                              float smul, unsigned char* smem, uint64_t* bars,
                                              const SpTma& tma, float (&o)[kSpDim / 8][4],
                                              float (&m)[2], float (&l)[2]) {
  using M = detail::MmaOf<T>;
  using Sm = SpSmem<T>;
  using detail::kWarp;
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr int D = kSpDim;
  constexpr int KSteps = D / 16;
  constexpr int NT = D / 8;
  constexpr int S = kS;
  static_assert(S >= 2 && S <= kSpT1MaxStages, "T = 1 ring stages");
  constexpr int RB = Sm::kRowBytes;
  constexpr int Box = Sm::kT1Box;
  constexpr int KBytes = kSpSubKeys * RB;  // K (then V) part of a stage
  constexpr float kLog2e = 1.4426950408889634f;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int mi = lane >> 3, rr = lane & 7;  // ldmatrix: the matrix and row this lane addresses
  const int tiles_per_entry = bs32 / kSpSubKeys;
  const uint32_t base = (detail::smem_addr(smem) + 1023u) & ~1023u;
  const uint32_t ring = base + warp * S * Sm::kT1StageBytes;
  unsigned char* ring_p = smem + (ring - detail::smem_addr(smem));
  const uint32_t bar0 = detail::smem_addr(bars + warp * kSpT1MaxStages);

  // Q fragments in this path's k order (rows = heads; 0 past the group or for no token).
  uint32_t qa[KSteps][4];
  {
    auto q2 = [&](int h, int d) {
      return qg != nullptr && h < group ? *reinterpret_cast<const float2*>(qg + h * D + d)
                                        : make_float2(0.f, 0.f);
    };
    auto pk = [&](float2 v) { return M::pack(detail::round_bf16(v.x), detail::round_bf16(v.y)); };
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
      const int d0 = kFp8 ? 16 * ks + 4 * cq : 16 * ks + 2 * cq;  // k slots 2c, 2c + 1
      const int d1 = kFp8 ? d0 + 2 : d0 + 8;                      // k slots 2c + 8, 2c + 9
      qa[ks][0] = pk(q2(r, d0));
      qa[ks][1] = pk(q2(r + 8, d0));
      qa[ks][2] = pk(q2(r, d1));
      qa[ks][3] = pk(q2(r + 8, d1));
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < S; ++st) mbar_init(bar0 + 8 * st, 1);
    mbar_fence_init();
  }
  __syncwarp();

  auto issue = [&](int i) {
    if (i >= ntiles) return;
    __syncwarp();  // every lane is past its reads (and zero fills) of this stage (tile i - S)
    if (lane != 0) return;
    const int st = i % S;
    const int jt = j0 + i;
    const int e = jt / tiles_per_entry;
    const int slot = static_cast<int>(slot_of(e)) + (jt - e * tiles_per_entry) * kSpSubKeys;
    const uint32_t dst = ring + st * Sm::kT1StageBytes;
    const uint32_t bar = bar0 + 8 * st;
    mbar_arrive_expect_tx(bar, 2 * KBytes);
#pragma unroll
    for (int h = 0; h < RB / 128; ++h) {
      tma_load_3d(dst + h * Box, &tma.k, h * (128 / int(sizeof(T))), static_cast<int>(g), slot,
                  bar);
      tma_load_3d(dst + KBytes + h * Box, &tma.v, h * (128 / int(sizeof(T))), static_cast<int>(g),
                  slot, bar);
    }
  };

  const float sl2 = smul * kLog2e;
  m[0] = m[1] = -INFINITY;  // rows r, r + 8 (exp2 domain)
  l[0] = l[1] = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  for (int j = 0; j < ntiles; ++j) {
    issue(j + S - 1);  // into the stage tile j - 1 used
    const int st = j % S;
    const int jt = j0 + j;
    const int e = jt / tiles_per_entry;
    // Keys 0..lim of the tile are at or before the token's position.
    const int lim = tokpos - (pos_of(e) + (jt - e * tiles_per_entry) * kSpSubKeys);
    mbar_wait(bar0 + 8 * st, static_cast<uint32_t>(j / S) & 1u);
    if (lim < 0) continue;  // warp-uniform: the local block's keys past the token
    const uint32_t kst = ring + st * Sm::kT1StageBytes;
    const uint32_t vst = kst + KBytes;
    if (lim < kSpSubKeys - 1) {  // zero V rows lim + 1 .. 15 (whole rows: the swizzle is within)
      unsigned char* vz = ring_p + st * Sm::kT1StageBytes + KBytes;
      constexpr int Chunks = RB / 16;
      for (int idx = lane; idx < (kSpSubKeys - 1 - lim) * Chunks; idx += kWarp) {
        const int key = lim + 1 + idx / Chunks, ch = idx % Chunks;
        *reinterpret_cast<uint4*>(vz + (ch / 8) * Box + key * 128 + (ch % 8) * 16) =
            make_uint4(0u, 0u, 0u, 0u);
      }
      fence_proxy_async_smem();  // before a later TMA refills this stage
      __syncwarp();
    }
    float x[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) x[nt][e2] = 0.f;
    if constexpr (!kFp8) {
      // Matrices: keys 0-7 dims +0 / +8 (b0, b1 of n-tile 0), keys 8-15 dims +0 / +8 (n-tile 1).
      const uint32_t ka = kst + ((mi >> 1) * 8 + rr) * 128;
#pragma unroll
      for (int ks = 0; ks < KSteps; ++ks) {
        uint32_t b0, b1, b2, b3;
        const int ch = 2 * (ks % 4) + (mi & 1);  // 16-byte chunk in the half (box) ks / 4
        detail::ldmatrix_x4(ka + (ks / 4) * Box + ((ch ^ rr) << 4), b0, b1, b2, b3);
        M::mma(x[0], qa[ks], b0, b1);
        M::mma(x[1], qa[ks], b2, b3);
      }
    } else {
      // Matrices: 16-code chunks 4 jj + mi of keys 8 nt + 0..7, one k-step each.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int jj = 0; jj < KSteps / 4; ++jj) {
          uint32_t w[4];
          detail::ldmatrix_x4(kst + (nt * 8 + rr) * 128 + (((jj * 4 + mi) ^ rr) << 4), w[0], w[1],
                              w[2], w[3]);
#pragma unroll
          for (int u = 0; u < 4; ++u)
            M::mma(x[nt], qa[jj * 4 + u], detail::fp8x2_to_f16x2(w[u]),
                   detail::fp8x2_to_f16x2(w[u] >> 16));
        }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) {
        const int key = nt * 8 + 2 * cq + (e2 & 1);
        x[nt][e2] = key <= lim ? x[nt][e2] * sl2 : -INFINITY;
      }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx =
          fmaxf(fmaxf(x[0][2 * hh], x[0][2 * hh + 1]), fmaxf(x[1][2 * hh], x[1][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float nm = fmaxf(m[hh], mx);  // finite: key 0 of the tile is visible
      const float corr = m[hh] == -INFINITY ? 0.f : exp2f(m[hh] - nm);
      m[hh] = nm;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e2 = 2 * hh; e2 < 2 * hh + 2; ++e2) {
          const float pr = exp2f(x[nt][e2] - nm);
          x[nt][e2] = pr;
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
    const uint32_t pa[4] = {pack_p(x[0][0], x[0][1], T{}), pack_p(x[0][2], x[0][3], T{}),
                            pack_p(x[1][0], x[1][1], T{}), pack_p(x[1][2], x[1][3], T{})};
    if constexpr (!kFp8) {
      // Transposed matrices: keys 0-7 / 8-15 (b0 / b1) of dims 16 p + 0..7, then of + 8..15.
      const uint32_t va = vst + ((mi & 1) * 8 + rr) * 128;
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {
        uint32_t b0, b1, b2, b3;
        const int ch = 2 * (p % 4) + (mi >> 1);
        detail::ldmatrix_x4_trans(va + (p / 4) * Box + ((ch ^ rr) << 4), b0, b1, b2, b3);
        M::mma(o[2 * p], pa, b0, b1);
        M::mma(o[2 * p + 1], pa, b2, b3);
      }
    } else {
      // Keys 2c, 2c + 1, 2c + 8, 2c + 9, codes 16 r .. 16 r + 15 (dims 16 r + n in n-tile n).
      const unsigned char* vs = ring_p + st * Sm::kT1StageBytes + KBytes;
      uint32_t vv[4][8];
#pragma unroll
      for (int uu = 0; uu < 4; ++uu) {
        const int key = 2 * cq + (uu & 1) + (uu >> 1) * 8;
        M::unpack(*reinterpret_cast<const uint4*>(vs + key * 128 + ((r ^ (key & 7)) << 4)), vv[uu]);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const unsigned selb = (n & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(vv[0][n / 2], vv[1][n / 2], selb);
        const uint32_t b1 = __byte_perm(vv[2][n / 2], vv[3][n / 2], selb);
        M::mma(o[n], pa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
}

// One prefill token's rows over its entries [e0, e0 + ne) (sp_token_core), normalised.
template <class T>
__device__ __forceinline__ void sp_token_loop(const KvPages& c, int64_t g, int32_t bs32,
                                              const int32_t* ent_pos, const int64_t* ent_slot,
                                              int e0, int ne, int32_t tokpos, const float* qg,
                                              int group, float smul, float vmul,
                                              unsigned char* smem, uint64_t* bars, const SpTma& tma,
                                              float* orow_lo, float* orow_hi) {
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr int NT = kSpDim / 8;
  const int cq = (threadIdx.x % detail::kWarp) % 4;
  float o[NT][4], m[2], l[2];
  sp_token_core<T, SpSmem<T>::kT1Stages>(
      c, g, bs32, [&](int e) { return ent_pos[e0 + e]; }, [&](int e) { return ent_slot[e0 + e]; },
      0, ne * (bs32 / kSpSubKeys), tokpos, qg, group, smul, smem, bars, tma, o, m, l);
  if (qg == nullptr) return;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float* orow = hh == 0 ? orow_lo : orow_hi;
    if (orow == nullptr) continue;
    const float inv = vmul / l[hh];
    if constexpr (!kFp8) {
      // Row r / r + 8, dims 8 n + 2c, + 1.
#pragma unroll
      for (int n = 0; n < NT; ++n)
        *reinterpret_cast<float2*>(orow + 8 * n + 2 * cq) =
            make_float2(o[n][2 * hh] * inv, o[n][2 * hh + 1] * inv);
    } else {
      // Dims 32 c + n (o[n][0 | 2]) and 32 c + 16 + n (o[n][1 | 3]).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float4* dst = reinterpret_cast<float4*>(orow + 32 * cq + 16 * half);
#pragma unroll
        for (int n4 = 0; n4 < 4; ++n4)
          dst[n4] =
              make_float4(o[4 * n4][2 * hh + half] * inv, o[4 * n4 + 1][2 * hh + half] * inv,
                          o[4 * n4 + 2][2 * hh + half] * inv, o[4 * n4 + 3][2 * hh + half] * inv);
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kSpThreads, 2)
    msa_sparse_prefill_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c,
                              TokenLayout L, const int32_t* __restrict__ blocks, int64_t max_blocks,
                              float scale, int64_t max_kv_len, SpParams prm,
                              const __grid_constant__ SpTma tma, float* __restrict__ out) {
  using M = detail::MmaOf<T>;
  using detail::kWarp;
  constexpr int D = kSpDim;
  constexpr int E = M::kElemsPer16B;
  constexpr int KSteps = D / 16;
  constexpr bool kFp8 = sizeof(T) == 1;
  extern __shared__ __align__(128) unsigned char sp_smem[];
  __shared__ int32_t tok_pos[kSpWarps], tok_seq[kSpWarps];
  __shared__ int32_t id_b[kSpThreads], id_page[kSpThreads];
  __shared__ int32_t ent_pos[kSpThreads];
  __shared__ int64_t ent_slot[kSpThreads];
  __shared__ uint8_t ent_mask[kSpThreads];
  __shared__ int32_t grp_start[kSpWarps + 1];
  __shared__ uint32_t scan_red[33];
  __shared__ uint16_t smask[SpSmem<T>::kStages][kSpWarps][kSpWarps];
  __shared__ __align__(8) uint64_t sp_bars[kSpWarps * kSpT1MaxStages];

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads;
  const int32_t bs32 = static_cast<int32_t>(c.page_size);
  const int group = static_cast<int>(num_heads / nkv);
  const int mb = static_cast<int>(max_blocks);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x / nkv) * kSpWarps;
  const int64_t g = blockIdx.x % nkv;
  if (threadIdx.x < kSpWarps) {
    const int64_t t = t0 + threadIdx.x;
    const bool mine = t < L.num_tokens && detail::in_multi_run(L, t);
    tok_seq[threadIdx.x] = mine ? L.seq_ids[t] : -1;
    tok_pos[threadIdx.x] = mine ? L.positions[t] : -1;
    if (mine)
      M3_DEVICE_CHECK(max_kv_len <= 0 || L.positions[t] < max_kv_len,
                      "attention: position %d beyond max_kv_len %lld", L.positions[t],
                      static_cast<long long>(max_kv_len));
  }
  __syncthreads();
  // This thread's selected id (token i / mb, entry i % mb): block and page, -1 when none.
  const int i = threadIdx.x;
  const int ti = i / max(mb, 1);
  int32_t b = -1, page = -1;
  if (i < kSpWarps * mb && tok_seq[ti] >= 0) {
    b = blocks[((t0 + ti) * nkv + g) * max_blocks + i % mb];
    if (b >= 0) {
      const int32_t p = tok_pos[ti];
      M3_DEVICE_CHECK(b <= p / bs32, "attention: selected block %d is in the future (token at %d)",
                      b, p);
      page = L.block_table[L.block_table_offsets[tok_seq[ti]] + b];
    }
  }
  id_b[i] = b;
  id_page[i] = page;
  // Q fragments of warp w's token (rows r, r + 8 = heads; 0 past the group or for no token),
  // loaded while the ids are looked up.
  const bool tok_ok = tok_seq[warp] >= 0;
  uint32_t qa[KSteps][4];
  {
    const float* qg = q + ((t0 + warp) * num_heads + g * group) * D;
    auto qv = [&](int h, int k) {
      return tok_ok && h < group ? detail::round_bf16(qg[h * D + k]) : 0.f;
    };
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
      const int kb = detail::kv_k_base<E>(ks, cq);
      qa[ks][0] = M::pack(qv(r, kb), qv(r, kb + 1));
      qa[ks][1] = M::pack(qv(r + 8, kb), qv(r + 8, kb + 1));
      qa[ks][2] = M::pack(qv(r, kb + 2), qv(r, kb + 3));
      qa[ks][3] = M::pack(qv(r + 8, kb + 2), qv(r + 8, kb + 3));
    }
  }
  __syncthreads();
  // Union sizes: an id counts for a range of tokens when no earlier id of the range is the same
  // (block, page) (tokens of different sequences may share a page).
  auto first_in = [&](int lo) {
    if (b < 0) return false;
    for (int j = lo; j < i; ++j)
      if (id_b[j] == b && id_page[j] == page) return false;
    return true;
  };
  const int pair = ti / 2;
  const bool f4 = first_in(0), f2 = first_in(pair * 2 * mb), f1 = first_in(ti * mb);
  const int u4 = __syncthreads_count(f4);
  const int u2a = __syncthreads_count(f2 && pair == 0);
  const int u2b = __syncthreads_count(f2 && pair == 1);
  const int u1 = __syncthreads_count(f1);
  if (u1 == 0) return;  // no token of this CTA (uniform)
  int TT = 1;
  if (prm.force_t != 0) {
    TT = prm.force_t;
  } else {
    const float c1 = static_cast<float>(u1), c2 = prm.w2 * static_cast<float>(u2a + u2b),
                c4 = prm.w4 * static_cast<float>(u4);
    if (c4 < c1 && c4 < c2)
      TT = 4;
    else if (c2 < c1)
      TT = 2;
  }
  // The chosen T's entries: the first occurrences within each group of T tokens, in id order
  // (deterministic), with the bits of the group's tokens that picked them.
  const bool fT = TT == 4 ? f4 : TT == 2 ? f2 : f1;
  const int grp = ti / TT;
  uint32_t total = 0;
  const uint32_t at = detail::block_exclusive_scan(fT ? 1u : 0u, scan_red, &total);
  if (i < kSpWarps * mb && i % (TT * mb) == 0) grp_start[i / (TT * mb)] = static_cast<int>(at);
  if (i == 0) grp_start[kSpWarps / TT] = static_cast<int>(total);
  if (fT) {
    unsigned msk = 0;
    for (int j = grp * TT * mb; j < (grp + 1) * TT * mb; ++j)
      if (id_b[j] == b && id_page[j] == page) msk |= 1u << (j / mb);
    ent_pos[at] = b * bs32;
    ent_slot[at] = static_cast<int64_t>(page) * bs32;
    ent_mask[at] = static_cast<uint8_t>(msk);
  }
  __syncthreads();

  const float smul = kFp8 ? scale * c.k_scale : scale;
  const float vmul = kFp8 ? c.v_scale : 1.f;
  float* orow_lo = nullptr;
  float* orow_hi = nullptr;
  if (tok_ok) {
    float* og = out + ((t0 + warp) * num_heads + g * group) * D;
    if (r < group) orow_lo = og + r * D;
    if (r + 8 < group) orow_hi = og + (r + 8) * D;
  }
  const int q_grp = warp / TT;
  const int e0 = grp_start[q_grp], ne = grp_start[q_grp + 1] - e0;
  switch (TT) {
    case 4:
      sp_group_loop<T, 4>(c, g, bs32, ent_pos, ent_slot, ent_mask, e0, ne, tok_pos, tok_ok, qa,
                          smul, vmul, sp_smem, smask, orow_lo, orow_hi);
      break;
    case 2:
      sp_group_loop<T, 2>(c, g, bs32, ent_pos, ent_slot, ent_mask, e0, ne, tok_pos, tok_ok, qa,
                          smul, vmul, sp_smem, smask, orow_lo, orow_hi);
      break;
    default:
      if (M3_SP_T1_TMA && prm.t1_tma != 0) {
        const float* qg = tok_ok ? q + ((t0 + warp) * num_heads + g * group) * D : nullptr;
        sp_token_loop<T>(c, g, bs32, ent_pos, ent_slot, e0, ne, tok_pos[warp], qg, group, smul,
                         vmul, sp_smem, sp_bars, tma, orow_lo, orow_hi);
        break;
      }
      sp_group_loop<T, 1>(c, g, bs32, ent_pos, ent_slot, ent_mask, e0, ne, tok_pos, tok_ok, qa,
                          smul, vmul, sp_smem, smask, orow_lo, orow_hi);
      break;
  }
}

// The K and V tensor maps of sp_token_loop (SpTma); false where the driver has no
// cuTensorMapEncodeTiled or rejects the layout (T = 1 then runs sp_group_loop).
bool sp_encode_maps(const KvPages& c, int esz, SpTma* out) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult st{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &st) != cudaSuccess ||
        st != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kSpDim),
                              static_cast<cuuint64_t>(c.num_kv_heads),
                              static_cast<cuuint64_t>(c.num_pages * c.page_size)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kSpDim * esz),
                                 static_cast<cuuint64_t>(c.num_kv_heads * kSpDim * esz)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / esz), 1u, kSpSubKeys};
  const cuuint32_t estr[3] = {1u, 1u, 1u};
  const CUtensorMapDataType dt =
      esz == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  auto one = [&](void* p, CUtensorMap* m) {
    return encode(m, dt, 3, p, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return one(c.k, &out->k) && one(c.v, &out->v);
}

// sp_encode_maps once per pool: the maps depend only on the pool's arrays and shape, which stay
// put for a backend's life, so a prefill step's sparse layers reuse them instead of encoding two
// maps per launch on the host.
bool sp_maps(const KvPages& c, int esz, SpTma* out) {
  struct Entry {
    const void* k;
    const void* v;
    int64_t pages, page_size, heads;
    int esz;
    bool ok;
    SpTma maps;
  };
  static std::mutex mu;
  static std::vector<Entry> seen;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : seen) {
    if (e.k == c.k && e.v == c.v && e.pages == c.num_pages && e.page_size == c.page_size &&
        e.heads == c.num_kv_heads && e.esz == esz) {
      *out = e.maps;
      return e.ok;
    }
  }
  Entry e{c.k, c.v, c.num_pages, c.page_size, c.num_kv_heads, esz, false, {}};
  e.ok = sp_encode_maps(c, esz, &e.maps);
  if (seen.size() >= 64) seen.erase(seen.begin());  // pools come and go only in tests
  seen.push_back(e);
  *out = e.maps;
  return e.ok;
}

// ---- Dense decode attention (attention_paged's split-KV rows) on the T = 1 TMA rings ----
// One CTA of four warps per (token, kv head, split); a split is a contiguous run of the
// token's 16-key tiles (up to the one holding its position), each warp a contiguous quarter of
// it through sp_token_core (its own ring, TMA boxes, ldmatrix fragments, exp2 softmax). The
// warps' states merge in shared memory into the combine kernel's split format: O unnormalised
// (times the V scale), m in the natural-log domain, l. The split's pages are looked up once into
// shared memory (up to kDecMaxPages; past that lane 0 reads the block table per tile).
constexpr int kDecMaxPages = 1024;

template <class T>
__global__ void __launch_bounds__(kSpThreads, 2)
    attention_decode_tma_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c,
                                TokenLayout L, float scale, int64_t max_kv_len, int num_splits,
                                float* __restrict__ part_o, float* __restrict__ part_ml,
                                float* __restrict__ out, bool skip_multi,
                                const __grid_constant__ SpTma tma) {
  using detail::kWarp;
  constexpr int D = kSpDim;
  constexpr int NT = D / 8;
  constexpr bool kFp8 = sizeof(T) == 1;
  extern __shared__ __align__(128) unsigned char sp_smem[];
  __shared__ __align__(8) uint64_t bars[kSpWarps * kSpT1MaxStages];
  __shared__ int32_t pages_s[kDecMaxPages];
  __shared__ float Wm[kSpWarps][kSpRows], Wl[kSpWarps][kSpRows], Wt[kSpWarps][kSpRows];
  __shared__ float Ms[kSpRows], Ls[kSpRows];
  detail::pdl_enter();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, cq = lane % 4;
  const int64_t nkv = c.num_kv_heads;
  const int group = static_cast<int>(num_heads / nkv);
  const int64_t t = blockIdx.x / nkv, g = blockIdx.x % nkv;
  if (skip_multi && detail::in_multi_run(L, t)) return;  // the whole CTA leaves together
  const int split = blockIdx.y;
  const int32_t p = L.positions[t], sq = L.seq_ids[t];
  M3_DEVICE_CHECK(max_kv_len <= 0 || p < max_kv_len,
                  "attention: position %d beyond max_kv_len %lld", p,
                  static_cast<long long>(max_kv_len));
  const int32_t bs32 = static_cast<int32_t>(c.page_size);
  const int tpe = bs32 / kSpSubKeys;
  const int ntiles = p / kSpSubKeys + 1;
  const int per = (ntiles + num_splits - 1) / num_splits;
  const int tile0 = min(ntiles, split * per), tile1 = min(ntiles, tile0 + per);
  const int32_t* table = L.block_table + L.block_table_offsets[sq];
  const int pb0 = tile0 / tpe;
  const int npg = tile1 > tile0 ? (tile1 - 1) / tpe - pb0 + 1 : 0;
  const bool staged = npg <= kDecMaxPages;
  if (staged)
    for (int i = threadIdx.x; i < npg; i += blockDim.x) pages_s[i] = table[pb0 + i];
  __syncthreads();
  const int ct = tile1 - tile0, pw = (ct + kSpWarps - 1) / kSpWarps;
  const int w0 = min(ct, warp * pw), w1 = min(ct, w0 + pw);
  const float* qg = q + (t * num_heads + g * group) * D;
  const float smul = kFp8 ? scale * c.k_scale : scale;
  float o[NT][4], m[2], l[2];
  sp_token_core<T, SpSmem<T>::kT1Stages>(
      c, g, bs32, [&](int e) { return (pb0 + e) * bs32; },
      [&](int e) { return static_cast<int64_t>(staged ? pages_s[e] : table[pb0 + e]) * bs32; },
      tile0 - pb0 * tpe + w0, w1 - w0, p, qg, group, smul, sp_smem, bars, tma, o, m, l);

  __syncthreads();  // every warp is done with its ring: the merge reuses the memory
  float* Ow = reinterpret_cast<float*>(sp_smem);  // [warps][16 rows][D]
  float* ow = Ow + warp * kSpRows * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float* row = ow + (r + 8 * hh) * D;
      if constexpr (!kFp8) {  // dims 8 n + 2 c, + 1
        row[8 * n + 2 * cq] = o[n][2 * hh];
        row[8 * n + 2 * cq + 1] = o[n][2 * hh + 1];
      } else {  // dims 32 c + n and 32 c + 16 + n
        row[32 * cq + n] = o[n][2 * hh];
        row[32 * cq + 16 + n] = o[n][2 * hh + 1];
      }
    }
  }
  detail::merge_warp_stats<kSpWarps, kSpRows, true>(warp, lane, m, l, Wm, Wl, Wt, Ms, Ls);
  detail::write_split_rows<kSpWarps, kSpRows, D, true>(
      Ow, Wt, Ms, Ls, group, kFp8 ? c.v_scale : 1.f, num_splits, (t * nkv + g) * num_splits + split,
      out + (t * num_heads + g * group) * D, part_o, part_ml);
}

}  // namespace

bool attention_decode_tma_supported(const KvPages& c, int64_t num_heads) {
  return M3_SP_T1_TMA && c.kv_dtype != KvDtype::kF32 && c.head_dim == kSpDim &&
         c.num_kv_heads > 0 && num_heads % c.num_kv_heads == 0 &&
         num_heads / c.num_kv_heads <= kSpRows && c.page_size >= kSpSubKeys &&
         c.page_size % kSpSubKeys == 0 && c.num_pages * c.page_size <= 0x7fffffff;
}

namespace detail {

bool attention_decode_tma(const float* q, int64_t num_heads, const KvPages& c,
                          const TokenLayout& layout, float scale, int64_t max_kv_len, int splits,
                          float* part_o, float* part_ml, float* out, bool skip_multi,
                          cudaStream_t stream) {
  static const bool on = env_switch("M3_ATTN_TMA_DECODE", true);
  if (!on || !attention_decode_tma_supported(c, num_heads)) return false;
  M3_CHECK(splits >= 1 && (splits == 1 || (part_o != nullptr && part_ml != nullptr)));
  bool launched = false;
  dispatch_kv(c.kv_dtype, [&]<class T>() {
    if constexpr (sizeof(T) < 4) {
      SpTma tma{};
      if (!sp_maps(c, int(sizeof(T)), &tma)) return;
      const dim3 grid(static_cast<unsigned>(layout.num_tokens * c.num_kv_heads),
                      static_cast<unsigned>(splits));
      constexpr int smem = SpSmem<T>::kT1Bytes;
      static std::atomic<uint64_t> attr_set{0};
      raise_smem_limit_once(attr_set, attention_decode_tma_kernel<T>, smem);
      launch_pdl_attn(attention_decode_tma_kernel<T>, grid, dim3(kSpThreads),
                      static_cast<size_t>(smem), stream, q, num_heads, c, layout, scale, max_kv_len,
                      splits, part_o, part_ml, out, skip_multi, tma);
      M3_CUDA_CHECK_LAUNCH("attention_decode_tma_kernel");
      launched = true;
    }
  });
  return launched;
}

}  // namespace detail

bool msa_sparse_prefill_supported(const KvPages& c, int64_t group, int64_t max_blocks) {
  return c.kv_dtype != KvDtype::kF32 && c.head_dim == kSpDim && group >= 1 && group <= kSpRows &&
         max_blocks >= 1 && max_blocks <= kSpMaxSel && c.page_size >= 1;
}

void msa_sparse_prefill(const float* q, int64_t num_heads, const KvPages& cache,
                        const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                        float scale, int64_t max_kv_len, float* out, cudaStream_t stream,
                        int tokens_per_tile) {
  M3_CHECK(cache.num_kv_heads > 0 && num_heads % cache.num_kv_heads == 0,
           "cuda::msa_sparse_prefill: %lld query heads over %lld kv heads", (long long)num_heads,
           (long long)cache.num_kv_heads);
  const int64_t group = num_heads / cache.num_kv_heads;
  M3_CHECK(msa_sparse_prefill_supported(cache, group, max_blocks),
           "cuda::msa_sparse_prefill: needs a bf16 / fp8 cache, head_dim 128, a GQA group <= 16 "
           "and <= 32 selected blocks (got %s, head_dim %lld, group %lld, %lld blocks)",
           kv_dtype_name(cache.kv_dtype), (long long)cache.head_dim, (long long)group,
           (long long)max_blocks);
  M3_CHECK(
      tokens_per_tile == 0 || tokens_per_tile == 1 || tokens_per_tile == 2 || tokens_per_tile == 4,
      "cuda::msa_sparse_prefill: tokens_per_tile %d (0 = per tile, or 1, 2, 4)", tokens_per_tile);
  M3_CHECK(blocks != nullptr, "cuda::msa_sparse_prefill: no selected blocks");
  if (layout.num_tokens == 0) return;
  const int64_t ntile = (layout.num_tokens + kSpWarps - 1) / kSpWarps;
  const int64_t grid = ntile * cache.num_kv_heads;
  M3_CHECK(grid <= 0x7fffffff);
  // Weights: the cost of a union block at T = 2 / 4 against one at T = 1, from the H200 at 32K
  // tokens (standalone harness, 2026-12-02; per-token time ~flat in the union at T = 1, ~linear
  // at T = 4). On the cp.async T = 1 loop: T = 4 ran 43.3 / 22.9 / 18.1 ms at mean 4-token
  // unions of 45.7 / 20.8 / 15.5 blocks where T = 1 ran 25.5 ms over ~62, T = 2 35.0 / 23.1 /
  // 20.8 ms: a T = 4 CTA must read under 0.4x (T = 2: 0.65x) the blocks of T = 1. On the TMA
  // T = 1 path (17.3-17.7 ms whatever the overlap, bf16) a T = 4 union block costs 3.4-4.3 and a
  // T = 2 one ~2.5 T = 1 blocks: T = 1 serves all but nearly identical neighbours.
  SpParams prm{1.55f, 2.5f, tokens_per_tile, 0};
  SpTma tma{};
  detail::dispatch_kv(cache.kv_dtype, [&]<class T>() {
    if constexpr (sizeof(T) < 4) {
      if (cache.page_size % kSpSubKeys == 0 && cache.num_pages * cache.page_size <= 0x7fffffff)
        prm.t1_tma = M3_SP_T1_TMA && sp_maps(cache, int(sizeof(T)), &tma) ? 1 : 0;
      if (prm.t1_tma != 0) {
        prm.w2 = 2.6f;
        prm.w4 = 4.0f;
      }
      constexpr int smem = SpSmem<T>::kBytes;
      static std::atomic<uint64_t> attr_set{0};
      detail::raise_smem_limit_once(attr_set, msa_sparse_prefill_kernel<T>, smem);
      msa_sparse_prefill_kernel<T><<<static_cast<unsigned>(grid), kSpThreads, smem, stream>>>(
          q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len, prm, tma, out);
      M3_CUDA_CHECK_LAUNCH("msa_sparse_prefill_kernel");
    }
  });
}

}  // namespace m3::kernels::cuda
