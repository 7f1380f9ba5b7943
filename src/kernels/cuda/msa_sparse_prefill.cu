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
#include <algorithm>
#include <atomic>

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

template <class T>
struct SpSmem {
  static constexpr int kRowBytes = kSpDim * int(sizeof(T));
  // A stage of the whole CTA: 4 sub-tiles of 16 keys (one per warp of the CTA, whatever T),
  // K rows then V rows.
  static constexpr int kStageBytes = 2 * kSpWarps * kSpSubKeys * kRowBytes;
  static constexpr int kStages = sizeof(T) == 1 ? 5 : 3;  // two CTAs per SM
  static constexpr int kBytes = kStages * kStageBytes;
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

template <class T>
__global__ void __launch_bounds__(kSpThreads, 2)
    msa_sparse_prefill_kernel(const float* __restrict__ q, int64_t num_heads, KvPages c,
                              TokenLayout L, const int32_t* __restrict__ blocks, int64_t max_blocks,
                              float scale, int64_t max_kv_len, SpParams prm,
                              float* __restrict__ out) {
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
      sp_group_loop<T, 1>(c, g, bs32, ent_pos, ent_slot, ent_mask, e0, ne, tok_pos, tok_ok, qa,
                          smul, vmul, sp_smem, smask, orow_lo, orow_hi);
      break;
  }
}

}  // namespace

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
  // at T = 4): T = 4 ran 43.3 / 22.9 / 18.1 ms at mean 4-token unions of 45.7 / 20.8 / 15.5
  // blocks where T = 1 ran 25.5 ms over ~62, T = 2 35.0 / 23.1 / 20.8 ms. So a T = 4 CTA must
  // read under 0.4x (T = 2: 0.65x) the blocks of T = 1: random selections stay T = 1.
  const SpParams prm{1.55f, 2.5f, tokens_per_tile};
  detail::dispatch_kv(cache.kv_dtype, [&]<class T>() {
    if constexpr (sizeof(T) < 4) {
      constexpr int smem = SpSmem<T>::kBytes;
      static std::atomic<uint64_t> attr_set{0};
      detail::raise_smem_limit_once(attr_set, msa_sparse_prefill_kernel<T>, smem);
      msa_sparse_prefill_kernel<T><<<static_cast<unsigned>(grid), kSpThreads, smem, stream>>>(
          q, num_heads, cache, layout, blocks, max_blocks, scale, max_kv_len, prm, out);
      M3_CUDA_CHECK_LAUNCH("msa_sparse_prefill_kernel");
    }
  });
}

}  // namespace m3::kernels::cuda
