// The grouped expert GEMMs over QUANTIZED expert weights (moe_grouped_quant.cuh gate_up_quant /
// down_quant): moe_grouped.cu's mma.sync kernel with B (the expert matrices) loaded as stored
// (e4m3 codes, or E2M1 codes two per byte) and converted to bf16 in shared memory, each element
// multiplied by its block scale while converting; bf16 activations, fp32 accumulation, the row
// factor (per-channel scale, NVFP4 global scale, the conversion's power of two) in the epilogue.
// A weight byte is read once per tile of positions of its expert (1 byte per fp8 weight, half a
// byte plus the block scales for 4-bit), with no dequantised copy anywhere.
//
// Layout of one CTA (128 threads, 4 warps as 2 x 2, as moe_grouped.cu): per pipeline stage an A
// tile [BM][64] bf16 (swizzled 16-byte chunks) and the raw B tile [128][64 codes] (64 or 32
// bytes a row) by cp.async; one stage ahead of the MMAs the threads convert the raw tile into
// one of two bf16 B tiles [128][64] (swizzled as A), so a k-step costs one __syncthreads and the
// conversion of tile kt + 1 overlaps the MMAs of tile kt across warps.
//
// Exact conversion (every product lands in bf16 exactly, so the GEMM is the fp32 product of
// bf16(x) and the CPU twin's dequantised weights up to summation order):
//  e4m3 byte b -> bf16 bits ((b & 0x7f) << 4) | ((b & 0x80) << 8) = value * 2^-120 (subnormal
//    codes included: both formats' subnormals scale by the same power);
//  E2M1 nibble c -> bf16 bits ((c & 7) << 6) | ((c & 8) << 12) = value * 2^-126;
//  then one bf16x2 multiply by M, a power of two or e4m3 x a power of two (the product has at
//  most 3 + 1 or 2 + 4 significant bits): fp8_per_channel M = 2^120 (factor scale[r] in the
//  epilogue); MXFP8 M = 2^(s - 127 + 120 - 8) (factor 2^8); NVFP4 M = fp8(s) * 2^(126 - 16)
//  (factor global * 2^16); MXFP4 M = 2^(s - 127 + 126 - 16) (factor 2^16).
//  The offsets 2^-8 / 2^-16 keep the products normal and M finite for every NVFP4 scale and for
//  E8M0 block scales 2^-109 .. 2^15 (MXFP8) / 2^-109 .. 2^17 (MXFP4); outside that range an M
//  overflows to inf (visible, never silently rescaled) or a tiny product rounds as a bf16
//  subnormal. Weights' block scales sit near amax / 448 or amax / 6, far inside it.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/attn_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/moe_grouped_quant.cuh"

namespace m3::kernels::cuda::moe_grouped {

namespace {

using detail::ceil_div;

constexpr int kThreads = 128;
constexpr int kBK = 64;   // K per stage
constexpr int kBN = 128;  // weight rows per CTA

// Pipeline depth: at most ~112 KiB of smem, so two CTAs fit on an SM.
template <int BM, bool kFour>
constexpr int qstages() {
  return BM == 128 && !kFour ? 3 : 4;
}

__device__ __forceinline__ int swz(int row, int c) {
  return row * kBK + ((c ^ (row & 7)) << 3);
}

template <WeightQuant Q>
struct QFmt {
  static constexpr bool kFour = Q == WeightQuant::kNvfp4 || Q == WeightQuant::kMxfp4;
  static constexpr int kRowBytes = kFour ? kBK / 2 : kBK;  // raw bytes of a row per stage
  static constexpr int kChunks = kRowBytes / 16;           // 16-byte cp.async chunks per row
  // The epilogue's power of two (see the file comment).
  static constexpr float kFactor = Q == WeightQuant::kMxfp8   ? 256.f
                                   : Q == WeightQuant::kNvfp4 ? 65536.f
                                   : Q == WeightQuant::kMxfp4 ? 65536.f
                                                              : 1.f;
};

struct QArgs {
  const uint16_t* a;      // activations, rows of K
  const int32_t* a_rows;  // position -> row of `a` (null: the position itself)
  const uint8_t* b[2];    // expert 0's codes: first matrix (w1 or w2), second (w3; gate|up)
  const uint8_t* s[2];    // expert 0's scales
  int64_t b_stride[2], s_stride[2];  // bytes between experts
  const float* g[2];                 // NVFP4 per-expert global scales (null: gs)
  float gs[2];
  int64_t row_bytes, srow_bytes;  // per weight row: codes, scales
  int n, k;
  const Tile* tiles;  // null: dense (one matrix, expert 0): tile t = rows [t BM, ...) of dense_rows
  const int32_t* num_tiles;
  int dense_rows;
  int k_split;           // K per blockIdx.z (a multiple of kBK; k when not split)
  int64_t split_stride;  // elements between the splits' partial outputs (down only)
  void* out;
  SwigluParams act;
};

// bf16x2 bits of the scale multiplier M for scale byte sb (see the file comment).
template <WeightQuant Q>
__device__ __forceinline__ uint32_t multiplier(uint32_t sb) {
  uint32_t bits;
  if constexpr (Q == WeightQuant::kFp8Channel) {
    bits = (120u + 127u) << 7;
  } else if constexpr (Q == WeightQuant::kMxfp8) {
    bits = min(sb + 112u, 255u) << 7;  // exponent field of 2^(s - 15)
  } else if constexpr (Q == WeightQuant::kMxfp4) {
    bits = min(sb + 110u, 255u) << 7;  // 2^(s - 17)
  } else {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(sb), __NV_E4M3);
    const float v = __half2float(__half(h)) * 0x1p110f;
    bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  return bits | (bits << 16);
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// 8 codes (elements in order) -> 4 bf16x2 words of value * M * 2^-120 / 2^-126.
template <WeightQuant Q>
__device__ __forceinline__ uint4 convert8(uint2 raw, uint32_t m) {
  uint32_t o[4];
  if constexpr (QFmt<Q>::kFour) {
    const uint32_t w = raw.x, w4 = w >> 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // byte 0: byte i of w (nibble 2i in its low bits), byte 2: byte i of w >> 4 (nibble 2i + 1)
      const uint32_t x = __byte_perm(w, w4, static_cast<uint32_t>(((4 + i) << 8) | i));
      o[i] = bmul2(((x << 6) & 0x01c001c0u) | ((x << 12) & 0x80008000u), m);
    }
  } else {
    const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // bytes 2i, 2i + 1 into the high bytes of the two halves
        const uint32_t x = __byte_perm(w[h], 0u, i == 0 ? 0x1404u : 0x3424u);
        o[2 * h + i] = bmul2((x & 0x80008000u) | ((x >> 4) & 0x07f007f0u), m);
      }
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

template <int BM, bool kGateUp, WeightQuant Q>
__global__ void __launch_bounds__(kThreads, 2) grouped_quant_kernel(QArgs p) {
  using F = QFmt<Q>;
  constexpr int MI = BM / 32;
  constexpr int NJ = 8;
  constexpr int kStages = qstages<BM, F::kFour>();
  const int t = blockIdx.y;
  Tile tile;
  if (p.tiles != nullptr) {
    if (t >= *p.num_tiles) return;
    tile = p.tiles[t];
  } else {
    tile = Tile{0, t * BM, min(p.dense_rows, (t + 1) * BM)};
  }
  // This CTA's K range (split-K: blockIdx.z); kbeg is a multiple of kBK.
  const int kbeg = static_cast<int>(blockIdx.z) * p.k_split, kend = min(p.k, kbeg + p.k_split);
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* As = smem;                                           // [kStages][BM][kBK]
  uint16_t* Bc = smem + kStages * BM * kBK;                      // [2][kBN][kBK] converted
  uint8_t* Br = reinterpret_cast<uint8_t*>(Bc + 2 * kBN * kBK);  // [kStages][kBN][kRowBytes]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int c0 = blockIdx.x * (kGateUp ? kBN / 2 : kBN);
  const int64_t e = tile.expert;

  // A loads: chunk lc of rows lr + 16 i.
  constexpr int kAL = BM / 16;
  const int lc = tid & 7, lr = tid >> 3;
  int64_t a_off[kAL];
#pragma unroll
  for (int i = 0; i < kAL; ++i) {
    const int pos = tile.row_begin + lr + 16 * i;
    a_off[i] = pos < tile.row_end
                   ? static_cast<int64_t>(p.a_rows ? p.a_rows[pos] : pos) * p.k + lc * 8
                   : -1;
  }
  // Raw B loads: chunk rc of smem rows rr + (128 / kChunks) i, i < kChunks.
  const int rc = tid % F::kChunks, rr = tid / F::kChunks;
  constexpr int kRowStep = kBN / F::kChunks;
  const uint8_t* bsrc[F::kChunks];
#pragma unroll
  for (int i = 0; i < F::kChunks; ++i) {
    const int srow = rr + kRowStep * i;
    const int mat = kGateUp && srow >= kBN / 2 ? 1 : 0;
    const int wrow = c0 + (kGateUp ? (srow & (kBN / 2 - 1)) : srow);
    bsrc[i] = wrow < p.n ? p.b[mat] + e * p.b_stride[mat] + wrow * p.row_bytes + rc * 16 : nullptr;
  }
  // Conversion units: 8 elements (chunk lc) of smem rows lr + 16 i, i < 8 (gate|up: rows from
  // 64, i >= 4, are w3's); their scale rows as byte offsets from the expert's scales (-1: past N).
  const uint8_t* sbase[2] = {p.s[0] + e * p.s_stride[0], p.s[1] + e * p.s_stride[1]};
  int soff[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int srow = lr + 16 * i;
    const int wrow = c0 + (kGateUp ? (srow & (kBN / 2 - 1)) : srow);
    soff[i] = wrow < p.n ? wrow * static_cast<int>(p.srow_bytes) : -1;
  }

  const int ktiles = (kend - kbeg + kBK - 1) / kBK;
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kbeg + kt * kBK;
    uint16_t* as = As + stage * BM * kBK;
    {
      const bool k_ok = k0 + lc * 8 < kend;
#pragma unroll
      for (int i = 0; i < kAL; ++i) {
        const bool ok = k_ok && a_off[i] >= 0;
        detail::cp_async16_zfill(as + swz(lr + 16 * i, lc), ok ? p.a + a_off[i] + k0 : p.a, ok);
      }
    }
    uint8_t* br = Br + stage * kBN * F::kRowBytes;
    // Byte k0 / (2 if 4-bit) of the row; the chunk covers elements [k0 + 16 rc (x2), ...).
    const int64_t kb = F::kFour ? k0 / 2 : k0;
    const bool k_ok = (F::kFour ? 32 : 16) * rc + k0 < kend;
#pragma unroll
    for (int i = 0; i < F::kChunks; ++i) {
      const bool ok = k_ok && bsrc[i] != nullptr;
      detail::cp_async16_zfill(br + (rr + kRowStep * i) * F::kRowBytes + rc * 16,
                               ok ? bsrc[i] + kb : p.b[0], ok);
    }
  };
  // Scale bytes of this thread's 8 units for k-tile kt (0 where the unit is past K or N).
  auto load_scales = [&](int kt, uint32_t(&sv)[8]) {
    const int k0 = kbeg + kt * kBK + lc * 8;
    const bool k_ok = k0 < kend;
    const int blk = Q == WeightQuant::kNvfp4 ? k0 / 16 : k0 / 32;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bool ok = k_ok && soff[i] >= 0;
      if constexpr (Q == WeightQuant::kFp8Channel) {
        sv[i] = ok;
      } else {
        const uint8_t* sp = sbase[kGateUp && i >= 4 ? 1 : 0] + soff[i] + blk;
        sv[i] = ok ? __ldg(sp) : 0xffffu;
      }
    }
  };
  auto convert_stage = [&](int kt, const uint32_t(&sv)[8]) {
    const uint8_t* br = Br + (kt % kStages) * kBN * F::kRowBytes;
    uint16_t* bc = Bc + (kt & 1) * kBN * kBK;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int row = lr + 16 * i;
      uint2 raw;
      if constexpr (F::kFour) {
        raw.x = *reinterpret_cast<const uint32_t*>(br + row * F::kRowBytes + lc * 4);
        raw.y = 0;
      } else {
        raw = *reinterpret_cast<const uint2*>(br + row * F::kRowBytes + lc * 8);
      }
      uint32_t m;
      if constexpr (Q == WeightQuant::kFp8Channel)
        m = sv[i] ? multiplier<Q>(0) : 0u;
      else
        m = sv[i] == 0xffffu ? 0u : multiplier<Q>(sv[i]);
      *reinterpret_cast<uint4*>(bc + swz(row, lc)) = convert8<Q>(raw, m);
    }
  };

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    detail::cp_async_commit();
  }
  uint32_t sv[8];
  load_scales(0, sv);
  detail::cp_async_wait<kStages - 2>();  // stage 0 landed
  __syncthreads();
  convert_stage(0, sv);
  if (ktiles > 1) load_scales(1, sv);

  const int a_row = lane & 15, a_chunk = lane >> 4;
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
  for (int kt = 0; kt < ktiles; ++kt) {
    // Stage kt + 1 landed (groups committed so far: kStages - 1 + kt); Bc[kt & 1] complete and
    // the MMAs of kt - 1 done everywhere (Bc[(kt + 1) & 1] and stage (kt - 1) % kStages free).
    detail::cp_async_wait<kStages - 3>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < ktiles) load_stage(next % kStages, next);
      detail::cp_async_commit();
    }
    if (kt + 1 < ktiles) {
      convert_stage(kt + 1, sv);
      if (kt + 2 < ktiles) load_scales(kt + 2, sv);
    }
    const uint16_t* as = As + (kt % kStages) * BM * kBK;
    const uint16_t* bs = Bc + (kt & 1) * kBN * kBK;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int row = wm * (BM / 2) + i * 16 + a_row;
        detail::ldmatrix_x4(detail::smem_addr(as + swz(row, kk * 2 + a_chunk)), af[i][0], af[i][1],
                            af[i][2], af[i][3]);
      }
      uint32_t bf[NJ][2];
#pragma unroll
      for (int q = 0; q < NJ / 2; ++q) {
        const int base = kGateUp ? (q >> 1) * 64 + wn * 32 + (q & 1) * 16 : wn * 64 + q * 16;
        detail::ldmatrix_x4(detail::smem_addr(bs + swz(base + b_row, kk * 2 + b_chunk)),
                            bf[2 * q][0], bf[2 * q][1], bf[2 * q + 1][0], bf[2 * q + 1][1]);
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) detail::mma_bf16(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
  }
  detail::cp_async_wait<0>();

  // Row factors of this thread's output columns: fp8_per_channel scale[r] (f32 per row), NVFP4
  // the expert's global scale; times the conversion's power of two.
  auto factor_of = [&](int mat, int col) {
    float f = F::kFactor;
    if constexpr (Q == WeightQuant::kFp8Channel)
      f = reinterpret_cast<const float*>(p.s[mat] + e * p.s_stride[mat])[col];
    if constexpr (Q == WeightQuant::kNvfp4) f *= p.g[mat] ? p.g[mat][e] : p.gs[mat];
    return f;
  };
  const int g = lane >> 2, tq = lane & 3;
  if (kGateUp) {
    float fg[NJ / 2][2], fu[NJ / 2][2];
#pragma unroll
    for (int j = 0; j < NJ / 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = c0 + wn * 32 + j * 8 + 2 * tq + c;
        fg[j][c] = col < p.n ? factor_of(0, col) : 0.f;
        fu[j][c] = col < p.n ? factor_of(1, col) : 0.f;
      }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pos = tile.row_begin + wm * (BM / 2) + i * 16 + g + 8 * h;
        if (pos >= tile.row_end) continue;
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < NJ / 2; ++j) {
          const int col = c0 + wn * 32 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          const float v0 =
              gemv::swiglu_oai(acc[i][j][2 * h] * fg[j][0], acc[i][j + 4][2 * h] * fu[j][0], p.act);
          const float v1 = gemv::swiglu_oai(acc[i][j][2 * h + 1] * fg[j][1],
                                            acc[i][j + 4][2 * h + 1] * fu[j][1], p.act);
          *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
  } else {
    float fd[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = c0 + wn * 64 + j * 8 + 2 * tq + c;
        fd[j][c] = col < p.n ? factor_of(0, col) : 0.f;
      }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pos = tile.row_begin + wm * (BM / 2) + i * 16 + g + 8 * h;
        if (pos >= tile.row_end) continue;
        float* out = static_cast<float*>(p.out) + blockIdx.z * p.split_stride +
                     static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int col = c0 + wn * 64 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          *reinterpret_cast<float2*>(out + col) =
              make_float2(acc[i][j][2 * h] * fd[j][0], acc[i][j][2 * h + 1] * fd[j][1]);
        }
      }
    }
  }
}

// ---- Variant 1: B converted straight into the MMA's registers (no bf16 tile in shared memory).
// 4 warps side by side along N (warp w: down rows [32 w, 32 w + 32) of the CTA's 128; gate|up
// gate rows [16 w, 16 w + 16) and the same up rows + 64), each owning all BM positions, so no
// weight is converted twice. The MMA's k order inside a group of G = 16 (fp8) / 32 (4-bit)
// elements is permuted so that a thread's B fragments are consecutive codes: A is stored with
// pair q of each group at pair slot (q % C) * 4 + q / C (C = G / 8), by its producers
// (to_bf16_quant, this kernel's gate|up epilogue); B pairs then follow from one 32-bit load of
// 4 (fp8) / 8 (4-bit) codes per n8 tile. The raw rows are padded by 16 bytes so those loads
// are free of bank conflicts.
template <WeightQuant Q>
struct RFmt {
  static constexpr int kG = QFmt<Q>::kFour ? 32 : 16;      // permutation group (elements)
  static constexpr int kStride = QFmt<Q>::kRowBytes + 16;  // padded raw row (bytes)
};

// Physical column of logical column c (even) of an A row under format Q's permutation.
template <int G>
__host__ __device__ __forceinline__ int perm_col(int c) {
  constexpr int C = G / 8;
  const int q = (c % G) / 2;
  return c - c % G + 2 * ((q % C) * 4 + q / C) + (c & 1);
}

template <int BM>
constexpr int rstages() {
  return 4;
}

template <int BM, bool kGateUp, WeightQuant Q>
__global__ void __launch_bounds__(kThreads, 2) grouped_quant_reg_kernel(QArgs p) {
  using F = QFmt<Q>;
  using R = RFmt<Q>;
  constexpr int MI = BM / 16;
  constexpr int NJ = 4;
  constexpr int kStages = rstages<BM>();
  const int t = blockIdx.y;
  Tile tile;
  if (p.tiles != nullptr) {
    if (t >= *p.num_tiles) return;
    tile = p.tiles[t];
  } else {
    tile = Tile{0, t * BM, min(p.dense_rows, (t + 1) * BM)};
  }
  const int kbeg = static_cast<int>(blockIdx.z) * p.k_split, kend = min(p.k, kbeg + p.k_split);
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* As = smem;                                                // [kStages][BM][kBK]
  uint8_t* Br = reinterpret_cast<uint8_t*>(As + kStages * BM * kBK);  // [kStages][kBN][kStride]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = blockIdx.x * (kGateUp ? kBN / 2 : kBN);
  const int64_t e = tile.expert;

  constexpr int kAL = BM >= 16 ? BM / 16 : 1;
  const int lc = tid & 7, lr = tid >> 3;
  int64_t a_off[kAL];
#pragma unroll
  for (int i = 0; i < kAL; ++i) {
    const int pos = tile.row_begin + lr + 16 * i;
    a_off[i] = pos < tile.row_end
                   ? static_cast<int64_t>(p.a_rows ? p.a_rows[pos] : pos) * p.k + lc * 8
                   : -1;
  }
  const int rc = tid % F::kChunks, rr = tid / F::kChunks;
  constexpr int kRowStep = kBN / F::kChunks;
  const uint8_t* bsrc[F::kChunks];
#pragma unroll
  for (int i = 0; i < F::kChunks; ++i) {
    const int srow = rr + kRowStep * i;
    const int mat = kGateUp && srow >= kBN / 2 ? 1 : 0;
    const int wrow = c0 + (kGateUp ? (srow & (kBN / 2 - 1)) : srow);
    bsrc[i] = wrow < p.n ? p.b[mat] + e * p.b_stride[mat] + wrow * p.row_bytes + rc * 16 : nullptr;
  }
  // This thread's B rows: n8 tile j, row g of it. smem row, its matrix and weight row.
  const int g = lane >> 2, tq = lane & 3;
  auto smem_row = [&](int j) {
    return kGateUp ? (j >> 1) * 64 + warp * 16 + (j & 1) * 8 + g : warp * 32 + j * 8 + g;
  };
  const uint8_t* sbase[2] = {p.s[0] + e * p.s_stride[0], p.s[1] + e * p.s_stride[1]};
  int soff[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int sr = smem_row(j);
    const int wrow = c0 + (kGateUp ? (sr & (kBN / 2 - 1)) : sr);
    soff[j] = wrow < p.n ? wrow * static_cast<int>(p.srow_bytes) : -1;
  }

  const int ktiles = (kend - kbeg + kBK - 1) / kBK;
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kbeg + kt * kBK;
    uint16_t* as = As + stage * BM * kBK;
    {
      const bool k_ok = k0 + lc * 8 < kend;
#pragma unroll
      for (int i = 0; i < kAL; ++i) {
        if (BM < 16 || lr + 16 * i < BM) {
          const bool ok = k_ok && a_off[i] >= 0;
          detail::cp_async16_zfill(as + swz(lr + 16 * i, lc), ok ? p.a + a_off[i] + k0 : p.a, ok);
        }
      }
    }
    uint8_t* br = Br + stage * kBN * R::kStride;
    const int64_t kb = F::kFour ? k0 / 2 : k0;
    const bool k_ok = (F::kFour ? 32 : 16) * rc + k0 < kend;
#pragma unroll
    for (int i = 0; i < F::kChunks; ++i) {
      const bool ok = k_ok && bsrc[i] != nullptr;
      detail::cp_async16_zfill(br + (rr + kRowStep * i) * R::kStride + rc * 16,
                               ok ? bsrc[i] + kb : p.b[0], ok);
    }
  };
  // Scale bytes for k-tile kt: [j][h], h the block half of the tile this thread's codes use
  // (MX: blocks of 32 = k16 steps 2h, 2h + 1; NVFP4: the 16-block of its 8 codes in 32-group h).
  auto load_scales = [&](int kt, uint32_t(&sv)[NJ][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k0 = kbeg + kt * kBK + 32 * h;
      const bool k_ok = k0 < kend;
      const int blk = Q == WeightQuant::kNvfp4 ? (k0 + 8 * tq) / 16 : k0 / 32;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const bool ok = k_ok && soff[j] >= 0;
        if constexpr (Q == WeightQuant::kFp8Channel) {
          sv[j][h] = ok;
        } else {
          const uint8_t* sp = sbase[kGateUp && j >= 2 ? 1 : 0] + soff[j] + blk;
          sv[j][h] = ok ? __ldg(sp) : 0xffffu;
        }
      }
    }
  };

  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    detail::cp_async_commit();
  }
  uint32_t sv[NJ][2];
  load_scales(0, sv);
  const int a_row = lane & 15, a_chunk = lane >> 4;
  for (int kt = 0; kt < ktiles; ++kt) {
    detail::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < ktiles) load_stage(next % kStages, next);
      detail::cp_async_commit();
    }
    uint32_t m[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (Q == WeightQuant::kFp8Channel)
          m[j][h] = sv[j][h] ? multiplier<Q>(0) : 0u;
        else
          m[j][h] = sv[j][h] == 0xffffu ? 0u : multiplier<Q>(sv[j][h]);
      }
    if (kt + 1 < ktiles) load_scales(kt + 1, sv);
    const uint16_t* as = As + (kt % kStages) * BM * kBK;
    const uint8_t* br = Br + (kt % kStages) * kBN * R::kStride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // B fragments of k16 steps 2h, 2h + 1 for the 4 n8 tiles.
      uint32_t bf[2][NJ][2];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const uint8_t* row = br + smem_row(j) * R::kStride;
        if constexpr (F::kFour) {
          const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 16 * h + 4 * tq);
          const uint4 o = convert8<Q>(make_uint2(w, 0u), m[j][h]);
          bf[0][j][0] = o.x;
          bf[0][j][1] = o.y;
          bf[1][j][0] = o.z;
          bf[1][j][1] = o.w;
        } else {
          const uint32_t w0 = *reinterpret_cast<const uint32_t*>(row + 32 * h + 4 * tq);
          const uint32_t w1 = *reinterpret_cast<const uint32_t*>(row + 32 * h + 16 + 4 * tq);
          const uint4 o = convert8<Q>(make_uint2(w0, w1), m[j][h]);
          bf[0][j][0] = o.x;
          bf[0][j][1] = o.y;
          bf[1][j][0] = o.z;
          bf[1][j][1] = o.w;
        }
      }
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2) {
        const int kk = 2 * h + s2;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          uint32_t af[4];
          detail::ldmatrix_x4(detail::smem_addr(as + swz(i * 16 + a_row, kk * 2 + a_chunk)), af[0],
                              af[1], af[2], af[3]);
#pragma unroll
          for (int j = 0; j < NJ; ++j) detail::mma_bf16(acc[i][j], af, bf[s2][j][0], bf[s2][j][1]);
        }
      }
    }
  }
  detail::cp_async_wait<0>();

  auto factor_of = [&](int mat, int col) {
    float f = F::kFactor;
    if constexpr (Q == WeightQuant::kFp8Channel)
      f = reinterpret_cast<const float*>(p.s[mat] + e * p.s_stride[mat])[col];
    if constexpr (Q == WeightQuant::kNvfp4) f *= p.g[mat] ? p.g[mat][e] : p.gs[mat];
    return f;
  };
  if (kGateUp) {
    float fg[2][2], fu[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = c0 + warp * 16 + j * 8 + 2 * tq + c;
        fg[j][c] = col < p.n ? factor_of(0, col) : 0.f;
        fu[j][c] = col < p.n ? factor_of(1, col) : 0.f;
      }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int pos = tile.row_begin + i * 16 + g + 8 * hh;
        if (pos >= tile.row_end) continue;
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = c0 + warp * 16 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          const float v0 = gemv::swiglu_oai(acc[i][j][2 * hh] * fg[j][0],
                                            acc[i][j + 2][2 * hh] * fu[j][0], p.act);
          const float v1 = gemv::swiglu_oai(acc[i][j][2 * hh + 1] * fg[j][1],
                                            acc[i][j + 2][2 * hh + 1] * fu[j][1], p.act);
          // act is the down projection's A: stored in its permuted k order.
          *reinterpret_cast<__nv_bfloat162*>(out + perm_col<R::kG>(col)) =
              __floats2bfloat162_rn(v0, v1);
        }
      }
    }
  } else {
    float fd[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = c0 + warp * 32 + j * 8 + 2 * tq + c;
        fd[j][c] = col < p.n ? factor_of(0, col) : 0.f;
      }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int pos = tile.row_begin + i * 16 + g + 8 * hh;
        if (pos >= tile.row_end) continue;
        float* out = static_cast<float*>(p.out) + blockIdx.z * p.split_stride +
                     static_cast<int64_t>(pos) * p.n;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int col = c0 + warp * 32 + j * 8 + 2 * tq;
          if (col >= p.n) continue;
          *reinterpret_cast<float2*>(out + col) =
              make_float2(acc[i][j][2 * hh] * fd[j][0], acc[i][j][2 * hh + 1] * fd[j][1]);
        }
      }
    }
  }
}

// out[r, perm_col(c)] = bf16(x[r, c]) for the register variant's A (cols a multiple of G).
template <int G>
__global__ void to_bf16_perm_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                    __nv_bfloat16* __restrict__ out) {
  const int64_t pairs = rows * cols / 2;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += step) {
    const int64_t r = (2 * i) / cols;
    const int c = static_cast<int>(2 * i - r * cols);
    const float2 v = *reinterpret_cast<const float2*>(x + 2 * i);
    *reinterpret_cast<__nv_bfloat162*>(out + r * cols + perm_col<G>(c)) =
        __floats2bfloat162_rn(v.x, v.y);
  }
}

// The process-wide variant (quant_gemm_variant()): M3_QUANT_GEMM_VARIANT at first use, else 0.
std::atomic<int> g_variant{-1};

template <int BM, bool kGateUp, WeightQuant Q>
void launch_reg(const QArgs& a, int64_t max_tiles, int64_t ncols, int splits, cudaStream_t stream) {
  constexpr size_t smem =
      rstages<BM>() * BM * kBK * sizeof(uint16_t) + rstages<BM>() * kBN * RFmt<Q>::kStride;
  static std::atomic<uint64_t> raised{0};
  detail::raise_smem_limit_once(raised, grouped_quant_reg_kernel<BM, kGateUp, Q>,
                                static_cast<int>(smem));
  const int per_cta = kGateUp ? kBN / 2 : kBN;
  M3_CHECK(max_tiles <= 65535, "moe grouped quant GEMM: %lld tiles",
           static_cast<long long>(max_tiles));
  const dim3 grid(ceil_div(ncols, per_cta), static_cast<unsigned>(max_tiles),
                  static_cast<unsigned>(splits));
  grouped_quant_reg_kernel<BM, kGateUp, Q><<<grid, kThreads, smem, stream>>>(a);
  M3_CUDA_CHECK_LAUNCH("grouped_quant_reg_kernel");
}

template <int BM, bool kGateUp, WeightQuant Q>
void launch_q(const QArgs& a, int64_t max_tiles, int64_t ncols, int splits, cudaStream_t stream) {
  if (quant_gemm_variant() == 1)
    return launch_reg<BM, kGateUp, Q>(a, max_tiles, ncols, splits, stream);
  constexpr int S = qstages<BM, QFmt<Q>::kFour>();
  constexpr size_t smem = S * BM * kBK * sizeof(uint16_t) + 2 * kBN * kBK * sizeof(uint16_t) +
                          S * kBN * QFmt<Q>::kRowBytes;
  static std::atomic<uint64_t> raised{0};
  detail::raise_smem_limit_once(raised, grouped_quant_kernel<BM, kGateUp, Q>,
                                static_cast<int>(smem));
  const int per_cta = kGateUp ? kBN / 2 : kBN;
  M3_CHECK(max_tiles <= 65535, "moe grouped quant GEMM: %lld tiles",
           static_cast<long long>(max_tiles));
  const dim3 grid(ceil_div(ncols, per_cta), static_cast<unsigned>(max_tiles),
                  static_cast<unsigned>(splits));
  grouped_quant_kernel<BM, kGateUp, Q><<<grid, kThreads, smem, stream>>>(a);
  M3_CUDA_CHECK_LAUNCH("grouped_quant_kernel");
}

template <bool kGateUp, WeightQuant Q>
void launch_bm(const QArgs& a, int64_t max_tiles, int bm, int64_t ncols, int splits,
               cudaStream_t stream) {
  if (bm == 128)
    launch_q<128, kGateUp, Q>(a, max_tiles, ncols, splits, stream);
  else if (bm == 64)
    launch_q<64, kGateUp, Q>(a, max_tiles, ncols, splits, stream);
  else if (bm == 32)
    launch_q<32, kGateUp, Q>(a, max_tiles, ncols, splits, stream);
  else
    launch_reg<16, kGateUp, Q>(a, max_tiles, ncols, splits, stream);  // variant 1 only
}

template <bool kGateUp>
void launch_fmt(const QArgs& a, WeightQuant q, int64_t max_tiles, int bm, int64_t ncols, int splits,
                cudaStream_t stream) {
  switch (q) {
    case WeightQuant::kFp8Channel:
      return launch_bm<kGateUp, WeightQuant::kFp8Channel>(a, max_tiles, bm, ncols, splits, stream);
    case WeightQuant::kMxfp8:
      return launch_bm<kGateUp, WeightQuant::kMxfp8>(a, max_tiles, bm, ncols, splits, stream);
    case WeightQuant::kNvfp4:
      return launch_bm<kGateUp, WeightQuant::kNvfp4>(a, max_tiles, bm, ncols, splits, stream);
    case WeightQuant::kMxfp4:
      return launch_bm<kGateUp, WeightQuant::kMxfp4>(a, max_tiles, bm, ncols, splits, stream);
    default:
      M3_CHECK(false, "moe grouped quant GEMM: format %s", weight_quant_name(q));
  }
}

// y[i] = sum over the splits of part[s * stride + i], in split order (deterministic).
__global__ void sum_splits_kernel(const float* __restrict__ part, int splits, int64_t stride,
                                  float* __restrict__ y) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < stride;
       i += step) {
    float v = part[i];
    for (int s = 1; s < splits; ++s) v += part[s * stride + i];
    y[i] = v;
  }
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

// The dense GEMM's plan for n tokens of w: tile height, K per split and the split count.
struct DensePlan {
  int bm = 32, splits = 1, k_split = 0;
  size_t xb_bytes = 0, part_bytes = 0;
};
DensePlan dense_plan(int64_t n, const MatRef& w, size_t ws_bytes) {
  DensePlan d;
  d.bm = n >= 128 ? 128 : n >= 64 ? 64 : (quant_gemm_variant() == 1 && n < 24) ? 16 : 32;
  const int64_t ctas = ceil_div(n, d.bm) * static_cast<int64_t>(ceil_div(w.rows, kBN));
  const int64_t ktiles = ceil_div(w.cols, kBK);
  // Enough CTAs for two per SM, each split at least 4 k-tiles long.
  int64_t splits = std::clamp<int64_t>(ceil_div(2 * detail::num_sms(), ctas), 1,
                                       std::max<int64_t>(1, ktiles / 4));
  d.xb_bytes = align256(static_cast<size_t>(n * w.cols) * sizeof(uint16_t));
  for (;; --splits) {
    const int64_t per = ceil_div(ktiles, splits);
    d.k_split = static_cast<int>(per * kBK);
    d.splits = static_cast<int>(ceil_div(ktiles, per));
    d.part_bytes = d.splits > 1 ? static_cast<size_t>(d.splits * n * w.rows) * sizeof(float) : 0;
    if (splits == 1 || d.xb_bytes + d.part_bytes <= ws_bytes) break;
  }
  return d;
}

void set_mat(QArgs& a, int slot, const QuantExperts& q) {
  a.b[slot] = static_cast<const uint8_t*>(q.first.data);
  a.s[slot] = static_cast<const uint8_t*>(q.first.scale);
  a.b_stride[slot] = q.data_stride;
  a.s_stride[slot] = q.scale_stride;
  a.g[slot] = q.global_scales;
  a.gs[slot] = q.first.global_scale;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

int quant_gemm_variant() {
  int v = g_variant.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("M3_QUANT_GEMM_VARIANT");
    const std::string s = env ? env : "0";
    M3_CHECK(s == "0" || s == "1",
             "M3_QUANT_GEMM_VARIANT=%s: 0 (bf16 tile in shared memory) or 1 (registers)",
             s.c_str());
    v = s == "1" ? 1 : 0;
    int expected = -1;
    if (!g_variant.compare_exchange_strong(expected, v)) v = expected;
  }
  return v;
}

void set_quant_gemm_variant(int v) {
  M3_CHECK(v == 0 || v == 1, "quant GEMM variant %d (0 or 1)", v);
  g_variant.store(v);
}

int tile_rows_quant(int64_t P, int64_t ne) {
  if (quant_gemm_variant() == 1)
    return P >= 64 * ne ? 128 : P >= 24 * ne ? 64 : P >= 12 * ne ? 32 : 16;
  return P >= 64 * ne ? 128 : P >= 16 * ne ? 64 : 32;
}

void to_bf16_quant(const float* x, int64_t rows, int64_t cols, WeightQuant q, uint16_t* out,
                   cudaStream_t stream) {
  if (quant_gemm_variant() == 0) return to_bf16(x, rows * cols, out, stream);
  if (rows * cols == 0) return;
  const int G = weight_quant_is_4bit(q) ? 32 : 16;
  M3_CHECK(cols % G == 0 && reinterpret_cast<uintptr_t>(x) % 8 == 0,
           "to_bf16_quant: %lld columns (a multiple of %d) of an 8-byte aligned x",
           static_cast<long long>(cols), G);
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>((rows * cols / 2 + 255) / 256, 1, 8192));
  auto* o = reinterpret_cast<__nv_bfloat16*>(out);
  if (G == 32)
    to_bf16_perm_kernel<32><<<blocks, 256, 0, stream>>>(x, rows, cols, o);
  else
    to_bf16_perm_kernel<16><<<blocks, 256, 0, stream>>>(x, rows, cols, o);
  M3_CUDA_CHECK_LAUNCH("to_bf16_perm_kernel");
}

bool supports_quant(const QuantExperts& q) {
  const MatRef& m = q.first;
  if (m.quant == WeightQuant::kNone || m.rows % 8 != 0 || m.rows > 0x7fffffff) return false;
  // Whole 16-byte code chunks per row (16 fp8 / 32 4-bit elements), rows and experts 16-byte
  // aligned; the per-channel scales are f32 (4-byte aligned per expert).
  const int64_t unit = weight_quant_is_4bit(m.quant) ? 32 : 16;
  if (m.cols % unit != 0 || !aligned16(m.data) || q.data_stride % 16 != 0) return false;
  if (m.quant == WeightQuant::kFp8Channel &&
      (reinterpret_cast<uintptr_t>(m.scale) % 4 != 0 || q.scale_stride % 4 != 0))
    return false;
  return m.dtype == (weight_quant_is_4bit(m.quant) ? DType::kU8 : DType::kF8E4M3);
}

void gate_up_quant(const uint16_t* xb, const int32_t* pair_token, const Tile* tiles,
                   const int32_t* num_tiles, int64_t max_tiles, int bm, const QuantExperts& w1,
                   const QuantExperts& w3, const SwigluParams& act, uint16_t* act_out,
                   cudaStream_t stream) {
  M3_CHECK(w1.first.quant == w3.first.quant && w1.first.rows == w3.first.rows &&
           w1.first.cols == w3.first.cols && w1.first.row_bytes() == w3.first.row_bytes());
  QArgs a{};
  a.a = xb;
  a.a_rows = pair_token;
  set_mat(a, 0, w1);
  set_mat(a, 1, w3);
  a.row_bytes = w1.first.row_bytes();
  a.srow_bytes = w1.first.scale_row_bytes();
  a.n = static_cast<int>(w1.first.rows);
  a.k = static_cast<int>(w1.first.cols);
  a.tiles = tiles;
  a.num_tiles = num_tiles;
  a.out = act_out;
  a.act = act;
  a.k_split = a.k;
  launch_fmt<true>(a, w1.first.quant, max_tiles, bm, w1.first.rows, 1, stream);
}

void down_quant(const uint16_t* act, const Tile* tiles, const int32_t* num_tiles, int64_t max_tiles,
                int bm, const QuantExperts& w2, float* ye, cudaStream_t stream) {
  QArgs a{};
  a.a = act;
  a.a_rows = nullptr;
  set_mat(a, 0, w2);
  set_mat(a, 1, w2);
  a.row_bytes = w2.first.row_bytes();
  a.srow_bytes = w2.first.scale_row_bytes();
  a.n = static_cast<int>(w2.first.rows);
  a.k = static_cast<int>(w2.first.cols);
  a.tiles = tiles;
  a.num_tiles = num_tiles;
  a.out = ye;
  a.k_split = a.k;
  launch_fmt<false>(a, w2.first.quant, max_tiles, bm, w2.first.rows, 1, stream);
}

bool dense_quant_ok(int64_t n, const MatRef& w, const float* y, size_t ws_bytes) {
  QuantExperts q;
  q.first = w;
  if (n <= 0 || n > 0x7fffffff / std::max<int64_t>(1, w.cols) || !supports_quant(q) ||
      reinterpret_cast<uintptr_t>(y) % 8 != 0)
    return false;
  const DensePlan d = dense_plan(n, w, ws_bytes);
  return d.xb_bytes + d.part_bytes <= ws_bytes;
}

void dense_quant(const float* x, int64_t n, const MatRef& w, float* y, void* ws, size_t ws_bytes,
                 cudaStream_t stream) {
  M3_CHECK(dense_quant_ok(n, w, y, ws_bytes),
           "dense quant GEMM: %s [%lld, %lld] over %lld tokens with %zu bytes of workspace",
           weight_quant_name(w.quant), static_cast<long long>(w.rows),
           static_cast<long long>(w.cols), static_cast<long long>(n), ws_bytes);
  const DensePlan d = dense_plan(n, w, ws_bytes);
  auto* xb = static_cast<uint16_t*>(ws);
  float* part =
      d.splits > 1 ? reinterpret_cast<float*>(static_cast<uint8_t*>(ws) + d.xb_bytes) : nullptr;
  to_bf16_quant(x, n, w.cols, w.quant, xb, stream);
  QuantExperts q;
  q.first = w;
  QArgs a{};
  a.a = xb;
  a.a_rows = nullptr;
  set_mat(a, 0, q);
  set_mat(a, 1, q);
  a.row_bytes = w.row_bytes();
  a.srow_bytes = w.scale_row_bytes();
  a.n = static_cast<int>(w.rows);
  a.k = static_cast<int>(w.cols);
  a.tiles = nullptr;
  a.num_tiles = nullptr;
  a.dense_rows = static_cast<int>(n);
  a.k_split = d.k_split;
  a.split_stride = n * w.rows;
  a.out = part ? part : y;
  launch_fmt<false>(a, w.quant, ceil_div(n, d.bm), d.bm, w.rows, d.splits, stream);
  if (part) {
    const int64_t count = n * w.rows;
    const unsigned blocks =
        static_cast<unsigned>(std::clamp<int64_t>((count + 255) / 256, 1, 4 * detail::num_sms()));
    sum_splits_kernel<<<blocks, 256, 0, stream>>>(part, d.splits, count, y);
    M3_CUDA_CHECK_LAUNCH("sum_splits_kernel");
  }
}

}  // namespace m3::kernels::cuda::moe_grouped
