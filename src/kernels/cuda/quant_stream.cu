// The one-token GEMVs over quantized weights of quant_stream.cuh. Two kernels:
// - qstream_kernel, for the 4-bit formats (NVFP4, MXFP4): gemv::stream_kernel's design
//   (kernels/cuda/gemv.cuh) over their codes. One CTA of 8 warps per SM for the whole launch: x
//   staged once in shared memory (f32, laid out so that lane l reads its 32 elements of a warp
//   segment as conflict-free float4s), and each warp an even share of all the rows (every matrix
//   of the launch: one dense matrix, or each projection of each active expert back to back)
//   streamed through its own ring of shared-memory stages filled by bulk copies (lane 0 issues
//   them, one mbarrier per stage). A stage holds 4 rows x 1024 bytes (2048 codes) and their
//   block scales. For a dense matrix the first stages go out before pdl_enter (weights are no
//   earlier kernel's output). Numerics: lane l owns 32 consecutive codes of each 512-byte warp
//   segment, decodes them exactly by integer operations (dot16: no conversion instructions),
//   sums their products with x in fp32, multiplies that by the block's scale (MXFP4: one per 32,
//   NVFP4: one per 16) and the warp's sum by NVFP4's global scale: the CPU twin's exact products
//   in another fp32 order, within quant_cuda_test's gemv_quant bound.
// - qdirect_kernel, fp8_per_channel on the tensor cores (comment below).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "core/env.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_format.cuh"
#include "kernels/cuda/quant_stream.cuh"

namespace m3::kernels::cuda::qstream {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 2048;  // k elements of a row per stage
constexpr int kMaxStages = 8;
constexpr int64_t kMaxK = 16384;  // x staged whole: 64 KiB per row

// The CUDA-core stream's layout per 4-bit format: a lane's 16 bytes are 32 codes; a stage holds
// 4 rows x 1024 bytes (kChunk codes) and their block scales.
template <WeightQuant Q>
struct Fmt {
  static_assert(Q == WeightQuant::kNvfp4 || Q == WeightQuant::kMxfp4, "the 4-bit formats");
  static constexpr int E = 32;     // codes of a lane's 16 bytes
  static constexpr int R = 4;      // rows per stage
  static constexpr int CB = 1024;  // bytes of one row's kChunk codes
  static constexpr int kBlock = Q == WeightQuant::kNvfp4 ? 16 : 32;
  static constexpr int SB = kChunk / kBlock;  // scale bytes of a row per stage
  static constexpr int kStage = R * (CB + SB);
  static constexpr int kSeg = 32 * E;  // elements of a 512-byte warp segment
  static_assert(kStage % 128 == 0 && CB % 512 == 0, "stage layout");
};

struct Proj {
  const uint8_t* w = nullptr;      // expert 0's codes (dense: the matrix)
  const uint8_t* scale = nullptr;  // its scales
  float global = 1.f;              // NVFP4's global scale
  const float* globals = nullptr;  // per expert (device), or null: `global`
  float* y = nullptr;              // [positions, m]
};

struct Params {
  Proj proj[2];
  int nproj = 1;
  const float* x = nullptr;
  const int32_t* x_rows = nullptr;
  int64_t m = 0, k = 0, row_bytes = 0, scale_row_bytes = 0, w_stride = 0, scale_stride = 0;
  // Grouped: the slots' experts and the experts' positions (device); null: one dense matrix.
  const int32_t* offsets = nullptr;
  const int32_t* active = nullptr;
  const int32_t* num_active = nullptr;
  int xcopies = 1;  // x rows staged: 1 (dense, or every position's x is one row), else one per slot
  int kpad = 0;     // x elements staged per row: k rounded up to 1024 (zeros past k)
  int stages = 0;   // ring stages per warp
  int slots = 1;    // qdirect_kernel: matrices per projection (grouped: the expert slots)
  int cpm = 0;      // qdirect_kernel: CTAs per matrix
  int ntok = 1;     // qdirect_kernel: tokens (dense: x rows, y rows; grouped: 1)
};

// Shared memory: x (xcopies x kpad f32), the slot table (expert, position per slot; the active
// count), the barriers, then the rings (128-byte aligned).
__host__ __device__ inline size_t table_offset(int xcopies, int kpad) {
  return static_cast<size_t>(xcopies) * kpad * 4;
}
__host__ __device__ inline size_t bar_offset(int xcopies, int kpad) {
  return table_offset(xcopies, kpad) + (2 * kMaxSlots + 2) * 4;  // 8-byte aligned
}
__host__ __device__ inline size_t ring_offset(int xcopies, int kpad) {
  return (bar_offset(xcopies, kpad) + kWarps * kMaxStages * 8 + 127) / 128 * 128;
}

__device__ __forceinline__ float e8m0(uint8_t s) {
  return s == 0 ? 5.877471754111438e-39f : __uint_as_float(static_cast<uint32_t>(s) << 23);
}
__device__ __forceinline__ float fp8_e4m3(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

// x is staged times 2^kXShift and each code decodes by integer operations alone to an f32 of
// its value times 2^-kWShift (exact, subnormal codes included), so the products' sum is the
// row's times 2^-kPost with no conversion instruction (the F2F pipe: with the e4m3 -> f16 -> f32
// conversions this kernel ran at 45% of the copy bandwidth for fp8, 30% for E2M1, on the H200).
// The products stay in the normal range unless |x * value| < 2^-78, which no model input reaches.
constexpr int kXShift = 64;
constexpr int kPost = 126 - kXShift;

// Sum over a lane's 16 bytes of E2M1 codes times xv (element order), unscaled and times
// 2^-kPost (see above), as two halves of 16 codes (NVFP4's two blocks). A nibble at bits 31..28
// shifted right 6 (arithmetic) puts (e, m) at f32 bits 24..22 and copies its sign to 31: the
// f32 is the code's value x 2^-126 (0.5: a subnormal).
__device__ __forceinline__ void dot16(const uint4& raw, const float* xv, float& lo, float& hi) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  lo = 0.f;
  hi = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int32_t t = static_cast<int32_t>(w[i] << (28 - 4 * j));
      d = fmaf(__uint_as_float(static_cast<uint32_t>(t >> 6) & 0x81c00000u), xv[8 * i + j], d);
    }
    if (i >= 2)
      hi += d;
    else
      lo += d;
  }
}

// x[0, k) times 2^kXShift -> dst (zeros to kpad): element kk of warp segment s at float4
// (kk % E) / 4 * 32 + (kk % kSeg) / E of the segment, so lane l's float4 q is at q * 32 + l
// (the caller syncs).
template <WeightQuant Q>
__device__ __forceinline__ void stage_x(float* dst, const float* x, int64_t k, int kpad) {
  using T = Fmt<Q>;
  const float up = __uint_as_float(static_cast<uint32_t>(127 + kXShift) << 23);
  for (int q4 = threadIdx.x; q4 < kpad / 4; q4 += kThreads) {
    const int kk = q4 * 4;
    const int s = kk / T::kSeg, in = kk % T::kSeg;
    const int l = in / T::E, q = (in % T::E) / 4;
    float4 v = kk < k ? __ldg(reinterpret_cast<const float4*>(x + kk)) : make_float4(0, 0, 0, 0);
    v.x *= up;
    v.y *= up;
    v.z *= up;
    v.w *= up;
    *reinterpret_cast<float4*>(dst + s * T::kSeg + (q * 32 + l) * 4) = v;
  }
}

// The launch's active expert slots (grouped: the router's output, after pdl_enter) into the slot
// table: slot s's expert and position; returns their count (1 for a dense matrix). Every thread
// of the CTA calls it.
__device__ __forceinline__ int load_slots(const Params& p, bool grouped, int* slot_e, int* slot_p,
                                          int* active_n) {
  if (grouped) {
    detail::pdl_enter();
    if (threadIdx.x == 0) *active_n = min(*p.num_active, kMaxSlots);
    if (threadIdx.x < kMaxSlots) {
      const int s = threadIdx.x;
      const int e = s < *p.num_active ? p.active[s] : 0;
      slot_e[s] = e;
      slot_p[s] = s < *p.num_active ? p.offsets[e] : 0;
    }
    __syncthreads();
  }
  __syncwarp();
  return grouped ? *active_n : 1;
}

// A warp's walk over its rows: row group (v: first virtual row, nr rows of one matrix) and
// chunk c. Issue and consume walk it alike, S items apart.
struct Cursor {
  int64_t v;
  int c, nr;
};

template <WeightQuant Q>
__global__ void __launch_bounds__(kThreads, 1) qstream_kernel(Params p) {
  using T = Fmt<Q>;
  constexpr int R = T::R;
  extern __shared__ float4 qstream_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(qstream_smem);
  float* xs = reinterpret_cast<float*>(smem);
  int* slot_e = reinterpret_cast<int*>(smem + table_offset(p.xcopies, p.kpad));
  int* slot_p = slot_e + kMaxSlots;
  int* active_n = slot_p + kMaxSlots;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int S = p.stages;
  const uint32_t bar0 =
      detail::smem_addr(smem + bar_offset(p.xcopies, p.kpad)) + warp * kMaxStages * 8;
  const unsigned char* ring_p =
      smem + ring_offset(p.xcopies, p.kpad) + static_cast<size_t>(warp) * S * T::kStage;
  const uint32_t ring = detail::smem_addr(ring_p);
  const bool grouped = p.active != nullptr;

  if (lane == 0) {
    for (int st = 0; st < S; ++st) detail::mbar_init(bar0 + 8 * st, 1);
    detail::mbar_fence_init();
  }
  const int A = load_slots(p, grouped, slot_e, slot_p, active_n);

  // This warp's virtual rows [v0, v1) of nproj x A matrices of m rows: an even share.
  const int64_t V = static_cast<int64_t>(p.nproj) * A * p.m;
  const int64_t W = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t v0 = gw * V / W, v1 = (gw + 1) * V / W;
  const int nch = static_cast<int>((p.row_bytes + T::CB - 1) / T::CB);
  auto rows_at = [&](int64_t v) {
    return static_cast<int>(min(min(static_cast<int64_t>(R), v1 - v), p.m - v % p.m));
  };
  auto advance = [&](Cursor& cu) {
    if (++cu.c == nch) {
      cu.c = 0;
      cu.v += cu.nr;
      cu.nr = cu.v < v1 ? rows_at(cu.v) : 0;
    }
  };
  // Matrix of virtual row v: projection, slot, row.
  auto where = [&](int64_t v, int* proj, int* slot, int64_t* row) {
    const int64_t mat = v / p.m;
    *proj = static_cast<int>(mat / A);
    *slot = static_cast<int>(mat % A);
    *row = v % p.m;
  };

  int issued = 0;
  Cursor ic{v0, 0, v0 < v1 ? rows_at(v0) : 0};
  auto issue = [&]() {
    if (ic.v >= v1) return;
    const int st = issued % S;
    ++issued;
    __syncwarp();  // every lane is past its reads of this stage
    if (lane == 0) {
      int proj, slot;
      int64_t row;
      where(ic.v, &proj, &slot, &row);
      const Proj& pr = proj == 0 ? p.proj[0] : p.proj[1];
      const int64_t e = grouped ? slot_e[slot] : 0;
      const int64_t b0 = static_cast<int64_t>(ic.c) * T::CB;
      const uint32_t bytes =
          static_cast<uint32_t>(min(static_cast<int64_t>(T::CB), p.row_bytes - b0));
      const uint8_t* src = pr.w + e * p.w_stride + row * p.row_bytes + b0;
      const uint32_t bar = bar0 + 8 * st;
      const uint32_t dst = ring + st * T::kStage;
      const int64_t s0 = static_cast<int64_t>(ic.c) * T::SB;
      const uint32_t sbytes =
          static_cast<uint32_t>(min(static_cast<int64_t>(T::SB), p.scale_row_bytes - s0));
      const uint8_t* ssrc = pr.scale + e * p.scale_stride + row * p.scale_row_bytes + s0;
      detail::mbar_arrive_expect_tx(bar, ic.nr * (bytes + sbytes));
      for (int j = 0; j < ic.nr; ++j) {
        detail::bulk_copy_g2s(dst + j * T::CB, src + j * p.row_bytes, bytes, bar);
        detail::bulk_copy_g2s(dst + R * T::CB + j * T::SB, ssrc + j * p.scale_row_bytes, sbytes,
                              bar);
      }
    }
    advance(ic);
  };

  if (!grouped) {
    for (int i = 0; i < S; ++i) issue();
    detail::pdl_enter();  // x and y belong to earlier kernels
    stage_x<Q>(xs, p.x, p.k, p.kpad);
  } else {
    for (int i = 0; i < S; ++i) issue();
    auto xrow = [&](int pos) {
      return p.x + (p.x_rows != nullptr ? static_cast<int64_t>(p.x_rows[pos]) : pos) * p.k;
    };
    for (int c = 0; c < p.xcopies && c < A; ++c)
      stage_x<Q>(xs + static_cast<size_t>(c) * p.kpad, xrow(slot_p[c]), p.k, p.kpad);
  }
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int j = 0; j < R; ++j) acc[j] = 0.f;
  float rf = 1.f;  // the row factor: NVFP4's global scale
  Cursor cc{v0, 0, v0 < v1 ? rows_at(v0) : 0};
  for (int i = 0; cc.v < v1; ++i) {
    const int st = i % S;
    int proj, slot;
    int64_t row;
    where(cc.v, &proj, &slot, &row);
    const Proj& pr = proj == 0 ? p.proj[0] : p.proj[1];
    const int64_t e = grouped ? slot_e[slot] : 0;
    if constexpr (Q == WeightQuant::kNvfp4) {
      if (cc.c == 0) rf = pr.globals != nullptr ? __ldg(pr.globals + e) : pr.global;
    }
    detail::mbar_wait(bar0 + 8 * st, static_cast<uint32_t>(i / S) & 1u);
    const unsigned char* stage = ring_p + st * T::kStage;
    const int64_t kk0 = static_cast<int64_t>(cc.c) * kChunk;
    const float* xc = xs + static_cast<size_t>(p.xcopies == 1 ? 0 : slot) * p.kpad + kk0;
#pragma unroll
    for (int sg = 0; sg < T::CB / 512; ++sg) {
      const int64_t seg0 = kk0 + sg * T::kSeg;
      if (seg0 >= p.k) break;  // uniform: a short last chunk
      const bool valid = seg0 + lane * T::E < p.k;
      float xv[T::E];
#pragma unroll
      for (int q = 0; q < T::E / 4; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(xc + sg * T::kSeg + (q * 32 + lane) * 4);
        xv[4 * q] = v.x;
        xv[4 * q + 1] = v.y;
        xv[4 * q + 2] = v.z;
        xv[4 * q + 3] = v.w;
      }
      const int ec = sg * T::kSeg + lane * T::E;  // the lane's first element in the chunk
#pragma unroll
      for (int j = 0; j < R; ++j) {
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (valid && j < cc.nr)
          raw = *reinterpret_cast<const uint4*>(stage + j * T::CB + sg * 512 + lane * 16);
        float lo, hi;
        dot16(raw, xv, lo, hi);
        const unsigned char* sc = stage + R * T::CB + j * T::SB;
        if constexpr (Q == WeightQuant::kMxfp4) {
          acc[j] = fmaf(lo + hi, valid ? e8m0(sc[ec / 32]) : 0.f, acc[j]);
        } else {  // NVFP4: the lane's 32 codes are two blocks of 16
          const float s0 = valid ? fp8_e4m3(sc[ec / 16]) : 0.f;
          const float s1 = valid ? fp8_e4m3(sc[ec / 16 + 1]) : 0.f;
          acc[j] = fmaf(hi, s1, fmaf(lo, s0, acc[j]));
        }
      }
    }
    const bool last = cc.c == nch - 1;
    const int nr = cc.nr;
    advance(cc);
    issue();  // into the stage just read
    if (last) {
      const int64_t pos = grouped ? slot_p[slot] : 0;
      const float post = __uint_as_float(static_cast<uint32_t>(127 + kPost) << 23);
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const float s = detail::warp_sum(acc[j]);
        if (lane == j && j < nr) pr.y[pos * p.m + row + j] = s * post * rf;
        acc[j] = 0.f;
      }
    }
  }
}

// ---- fp8_per_channel on the tensor cores: qdirect_kernel ----
// The CUDA-core loop above, run over fp8 rows (a form since removed), spent ~4 instructions per
// code byte and could not issue them at the bandwidth (40-45% of the copy bandwidth). Here each
// e4m3 pair converts once to an f16 pair (exact) that is the B operand of an m16n8k16 MMA as it
// stands: ~14 instructions per 16 code bytes per lane, MMAs included. B = the 8 rows of a warp's
// row group (its 8 columns) x 16 codes; A = the x terms: row 0 x_hi, row 1 x_lo, with x scaled
// by 2^-E (E from x's largest magnitude, so that it sits below 2^15) and x_hi = f16(x), x_lo =
// f16(x - x_hi): 22 bits of x, fp32 accumulation; A's rows 2-15 are zero. A lane's k slots map
// to consecutive codes of its row (the k order inside an MMA is free: A uses the same map): a
// piece is a lane's 16 bytes at 64j + 16t of its row (t = lane % 4), its four MMAs accumulate in
// four chains, and the row's channel scale applies at the end.
// No shared-memory ring: each warp streams its rows straight into registers (U pieces in flight
// per lane, the first U issued before pdl_enter for a dense matrix); the CTA's warps share x,
// staged once as f16 hi / lo. One CTA per 4 / KS row groups of one matrix (dense: the matrix;
// grouped: each projection of each expert slot), KS warps splitting a group's k. A row's sum
// adds its partial sums in one fixed order: deterministic.
// Measured against it (H200, bench_quant_gemv --quick, n = 1): qmma_kernel, the form before
// (8-row groups through a CTA-wide ring of bulk copies, k split over 8 warps, a CTA barrier per
// group: q_proj 38.3 us first, 27 us rewritten); the same kernel over MXFP8 (8-byte pieces so
// that a row's four lanes cover one 32-code block, each piece's two MMAs in a zeroed tile scaled
// by the block's E8M0): 12.9 / 15.2 / 28.1 / 32.1 us on expert w1 / w2 / q_proj / dense gate
// against the group kernel's 12.1 / 13.5 / 27.0 / 36.1 (twice the instructions per byte), so
// MXFP8 stays on the group kernel.
constexpr int kPieceBytes = 16;  // a lane's bytes per piece
constexpr int kPieceStep = 64;   // row bytes per piece index
constexpr int kInFlight = 16;    // pieces in flight per lane
constexpr int kLoPad = 8;        // f16 between x_hi and x_lo (the lo reads' bank offset)
constexpr int kDirectWarps = 4;  // warps per CTA
constexpr int kDirectThreads = 32 * kDirectWarps;

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Shared memory of qdirect_kernel: per token x_hi [k], kLoPad, x_lo [k], kLoPad (f16), then the
// tokens' x factors, the max-reduction slots and the warps' partial sums.
__host__ __device__ inline int64_t direct_token_stride(int64_t k) {  // f16 elements
  return 2 * (k + kLoPad);
}
__host__ __device__ inline size_t direct_fac_offset(int64_t k, int nt) {
  return static_cast<size_t>(nt * direct_token_stride(k)) * 2;
}
__host__ __device__ inline size_t direct_smem(int64_t k, int nt) {
  return direct_fac_offset(k, nt) + (nt + kDirectWarps + 8 * kDirectWarps * nt) * 4;
}

// NT tokens (1, 2 or 4; p.ntok <= NT of them real): A row 2i is token i's x_hi, 2i + 1 its
// x_lo, so one read of the weights serves up to 4 tokens. KS warps share an 8-row group, each a
// contiguous k slice of it (more warps in flight for matrices with few rows); their partial sums
// add in slice order.
template <int NT, int KS>
__global__ void __launch_bounds__(kDirectThreads) qdirect_kernel(Params p) {
  constexpr int U = kInFlight;
  constexpr int kGroups = kDirectWarps / KS;  // 8-row groups per CTA
  extern __shared__ float4 qdirect_smem[];
  __half* xs = reinterpret_cast<__half*>(qdirect_smem);
  const int64_t K = p.k, TS = direct_token_stride(K);
  float* xfac = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(qdirect_smem) +
                                         direct_fac_offset(K, NT));
  float* red = xfac + NT;
  float* part = red + kDirectWarps;  // [warp][NT][8]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int ks = warp % KS;
  const int mat = static_cast<int>(blockIdx.x / p.cpm);
  const int64_t group = static_cast<int64_t>(blockIdx.x % p.cpm) * kGroups + warp / KS;
  const int proj = mat / p.slots, slot = mat % p.slots;
  const Proj& pr = proj == 0 ? p.proj[0] : p.proj[1];
  const bool grouped = p.active != nullptr;
  int64_t e = 0, pos = 0;
  if (grouped) {
    detail::pdl_enter();                // the router's output
    if (slot >= *p.num_active) return;  // the whole CTA: one slot
    e = p.active[slot];
    pos = p.offsets[e];
  }
  const bool has = group * 8 < p.m;
  const int64_t row0 = group * 8;
  const int np = static_cast<int>(K / kPieceStep / KS);  // this warp's pieces
  const int j0 = ks * np;
  constexpr int kStride = kPieceStep / kPieceBytes;  // in uint4s
  const uint4* wp = reinterpret_cast<const uint4*>(pr.w + e * p.w_stride +
                                                   (row0 + g) * p.row_bytes + t * kPieceBytes) +
                    static_cast<int64_t>(j0) * kStride;
  uint4 buf[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    buf[u] = make_uint4(0u, 0u, 0u, 0u);
    if (has && u < np) buf[u] = detail::ldg_nc16(wp + u * kStride);
  }
  // The channel scales of rows 2t, 2t + 1 (the D fragment's columns), loaded now.
  float cs0 = 1.f, cs1 = 1.f;
  if (has && g % 2 == 0) {
    const float* sc = reinterpret_cast<const float*>(pr.scale + e * p.scale_stride) + row0 + 2 * t;
    cs0 = __ldg(sc);
    cs1 = __ldg(sc + 1);
  }
  if (!grouped) detail::pdl_enter();  // x and y belong to earlier kernels

  // x (the slot's row; dense: the tokens' rows) -> x_hi / x_lo, by every thread of the CTA.
  const float* xr =
      p.x + (grouped ? (p.x_rows != nullptr ? static_cast<int64_t>(p.x_rows[pos]) : pos) : 0) * K;
#pragma unroll 1
  for (int tk = 0; tk < NT; ++tk) {
    const bool real = tk < p.ntok;
    const float* xt = xr + tk * K;
    __half* xh = xs + tk * TS;
    __half* xl = xh + K + kLoPad;
    float mx = 0.f;
    for (int64_t i = threadIdx.x * 4; real && i < K; i += kDirectThreads * 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(xt + i));
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    mx = detail::warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int w = 1; w < kDirectWarps; ++w) mx = fmaxf(mx, red[w]);
    int ex = 0;
    if (mx > 0.f && mx < INFINITY) frexpf(mx, &ex);  // mx < 2^ex
    const float down = ldexpf(1.f, 15 - ex);
    for (int64_t i = threadIdx.x * 4; i < K; i += kDirectThreads * 4) {
      const float4 v =
          real ? __ldg(reinterpret_cast<const float4*>(xt + i)) : make_float4(0, 0, 0, 0);
      const float2 a = make_float2(v.x * down, v.y * down), b = make_float2(v.z * down, v.w * down);
      const __half2 ha = __float22half2_rn(a), hb = __float22half2_rn(b);
      const float2 ra = __half22float2(ha), rb = __half22float2(hb);
      const __half2 la = __float22half2_rn(make_float2(a.x - ra.x, a.y - ra.y));
      const __half2 lb = __float22half2_rn(make_float2(b.x - rb.x, b.y - rb.y));
      *reinterpret_cast<__half2*>(xh + i) = ha;
      *reinterpret_cast<__half2*>(xh + i + 2) = hb;
      *reinterpret_cast<__half2*>(xl + i) = la;
      *reinterpret_cast<__half2*>(xl + i + 2) = lb;
    }
    if (threadIdx.x == 0) xfac[tk] = ldexpf(1.f, ex - 15);
    __syncthreads();  // also: every warp is past red before the next token's max
  }
  if (KS == 1 && !has) return;

  // Lanes of A rows 2i (token i's x_hi) and 2i + 1 (its x_lo) read x; rows from 2 NT on are zero.
  const bool arow = g < 2 * NT;
  const __half* xa_base = xs + (g / 2) * TS + (g % 2) * (K + kLoPad) + t * kPieceBytes +
                          static_cast<int64_t>(j0) * kPieceStep;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int c = 0; has && c < np; c += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = c + u;
      const uint4 w = buf[u];
      if (j + U < np) buf[u] = detail::ldg_nc16(wp + (j + U) * kStride);
      uint4 xa = make_uint4(0u, 0u, 0u, 0u), xb = make_uint4(0u, 0u, 0u, 0u);
      if (arow && j < np) {
        xa = *reinterpret_cast<const uint4*>(xa_base + j * kPieceStep);
        xb = *reinterpret_cast<const uint4*>(xa_base + j * kPieceStep + 8);
      }
      if (j < np) {
        mma_f16(acc[0], xa.x, xa.y, e4m3x2_to_f16x2(w.x), e4m3x2_to_f16x2(w.x >> 16));
        mma_f16(acc[1], xa.z, xa.w, e4m3x2_to_f16x2(w.y), e4m3x2_to_f16x2(w.y >> 16));
        mma_f16(acc[2], xb.x, xb.y, e4m3x2_to_f16x2(w.z), e4m3x2_to_f16x2(w.z >> 16));
        mma_f16(acc[3], xb.z, xb.w, e4m3x2_to_f16x2(w.w), e4m3x2_to_f16x2(w.w >> 16));
      }
    }
  }
  // D row 2i (token i's x_hi . W) is in lanes 8i + t, row 2i + 1 (x_lo . W) in lanes 8i + 4 + t;
  // columns 2t, 2t + 1.
  float v0 = (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]);
  float v1 = (acc[0][1] + acc[1][1]) + (acc[2][1] + acc[3][1]);
  v0 += __shfl_down_sync(0xffffffffu, v0, 4);
  v1 += __shfl_down_sync(0xffffffffu, v1, 4);
  const int tk = g / 2;
  const bool out = g % 2 == 0 && tk < NT;
  if constexpr (KS > 1) {
    if (out) {
      part[(warp * NT + tk) * 8 + 2 * t] = v0;
      part[(warp * NT + tk) * 8 + 2 * t + 1] = v1;
    }
    __syncthreads();
    if (ks != 0 || !has) return;
    if (out) {
#pragma unroll
      for (int s = 1; s < KS; ++s) {
        v0 += part[((warp + s) * NT + tk) * 8 + 2 * t];
        v1 += part[((warp + s) * NT + tk) * 8 + 2 * t + 1];
      }
    }
  }
  if (out && tk < p.ntok) {
    const float f = xfac[tk];
    float* y = pr.y + (pos + tk) * p.m + row0 + 2 * t;
    y[0] = v0 * f * cs0;
    y[1] = v1 * f * cs1;
  }
}

int num_sms() {
  static const int v = [] {
    int dev = 0, n = 0;
    M3_CUDA_CHECK(cudaGetDevice(&dev));
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return v;
}

template <WeightQuant Q>
int stages_for(int xcopies, int kpad) {
  const int64_t left =
      detail::smem_optin_limit() - static_cast<int64_t>(ring_offset(xcopies, kpad));
  const int64_t s =
      std::min<int64_t>(kMaxStages, left / (static_cast<int64_t>(kWarps) * Fmt<Q>::kStage));
  return s >= 2 ? static_cast<int>(s) : 0;
}

template <WeightQuant Q>
void launch(const Params& p, cudaStream_t stream) {
  detail::allow_optin_smem<qstream_kernel<Q>>();
  const size_t smem =
      ring_offset(p.xcopies, p.kpad) + static_cast<size_t>(kWarps) * p.stages * Fmt<Q>::kStage;
  detail::launch_pdl(qstream_kernel<Q>, dim3(static_cast<unsigned>(num_sms())), dim3(kThreads),
                     smem, stream, p);
}

// Fills p.stages for the format and launches; false where the rings do not fit.
template <WeightQuant Q>
bool run(Params p, cudaStream_t stream) {
  p.stages = stages_for<Q>(p.xcopies, p.kpad);
  if (p.stages == 0) return false;
  launch<Q>(p, stream);
  return true;
}

// The CUDA-core stream: the 4-bit formats.
bool run_any(WeightQuant q, const Params& p, cudaStream_t stream) {
  if (q == WeightQuant::kNvfp4) return run<WeightQuant::kNvfp4>(p, stream);
  if (q == WeightQuant::kMxfp4) return run<WeightQuant::kMxfp4>(p, stream);
  return false;
}

// A small count from the environment (benchmark knobs): `def` when unset or empty; a value that
// is not a whole number `ok` accepts keeps `def` and says so, naming the accepted values.
int env_count(const char* name, int def, bool (*ok)(long), const char* accepted) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || !ok(n)) {
    std::fprintf(stderr, "m3serve: %s=%s ignored (accepted: %s); using %d\n", name, v, accepted,
                 def);
    return def;
  }
  return static_cast<int>(n);
}

// fp8_per_channel with rows in whole 8-row groups: qdirect_kernel (on by default; M3_QUANT_MMA=0
// turns it off: the group kernel).
std::atomic<int> g_mma{-1};
bool mma_takes(const MatRef& w) {
  return mma_on() && w.quant == WeightQuant::kFp8Channel && w.rows % 8 == 0 && w.cols % 64 == 0;
}

template <int NT, int KS>
void launch_direct(Params p, cudaStream_t stream) {
  constexpr int kGroups = kDirectWarps / KS;
  p.cpm = static_cast<int>((p.m / 8 + kGroups - 1) / kGroups);
  detail::allow_optin_smem<qdirect_kernel<NT, KS>>();
  const unsigned grid = static_cast<unsigned>(p.cpm) * p.nproj * p.slots;
  detail::launch_pdl(qdirect_kernel<NT, KS>, dim3(grid), dim3(kDirectThreads), direct_smem(p.k, NT),
                     stream, p);
}

// k split over KS = 1, 2 or 4 warps: the fewest that give the launch >= 11 warps per SM (the
// kernel keeps up to 16 resident at its <= 128 registers).
// Measured (bench_quant_gemv --quick, n = 1, us for KS = 1 / 2 / 4): expert w1 [3072, 6144]
// 14.7 / 11.2 / 9.6, w2 [6144, 3072] 10.9 / 9.0 / 10.8, q_proj [8192, 6144] 19.9 / 17.1 / 21.2,
// dense gate [12288, 6144] 24.1 / 27.7 / 31.0: the rule picks 4, 2, 2, 1. M3_QUANT_MMA_KS forces
// one (benchmarks).
int direct_ks(const Params& p) {
  const int64_t np = p.k / kPieceStep;
  static const int forced = env_count(
      "M3_QUANT_MMA_KS", 0, [](long n) { return n == 1 || n == 2 || n == 4; }, "1, 2, 4");
  if (forced != 0 && np % forced == 0) return forced;
  const int64_t groups = p.m / 8 * p.nproj * p.slots;
  int ks = 1;
  while (ks < 4 && groups * ks < 11 * static_cast<int64_t>(num_sms()) && np % (2 * ks) == 0)
    ks *= 2;
  return ks;
}

template <int NT>
void launch_direct_ks(const Params& p, cudaStream_t stream) {
  switch (direct_ks(p)) {
    case 4:
      return launch_direct<NT, 4>(p, stream);
    case 2:
      return launch_direct<NT, 2>(p, stream);
    default:
      return launch_direct<NT, 1>(p, stream);
  }
}

// False where the tokens' x does not fit in shared memory (4 tokens: k <= ~14000).
bool run_mma(const Params& p, cudaStream_t stream) {
  const int nt = p.ntok <= 1 ? 1 : p.ntok <= 2 ? 2 : 4;
  if (p.ntok > 4 || static_cast<int64_t>(direct_smem(p.k, nt)) > detail::smem_optin_limit())
    return false;
  if (nt == 1)
    launch_direct_ks<1>(p, stream);
  else if (nt == 2)
    launch_direct_ks<2>(p, stream);
  else
    launch_direct_ks<4>(p, stream);
  return true;
}

// Which one-token kernel a format takes (H200, bench_quant_gemv --quick against the group kernel
// in the same runs, us at n = 1): the 4-bit formats the CUDA-core stream (NVFP4 q_proj 27.3 ->
// 22.0, dense gate 39.2 -> 31.6, expert w1 13.4 -> 11.6; MXFP4 alike). The fp8 formats stay on
// the group kernel: this stream with fp8 rows (2 x 2048 codes per stage) ran fp8_per_channel
// q_proj at 27.9-30.2 against 22.8, MXFP8 29.0-31.1 against 26.8 (issue-bound: ~4 instructions
// per code byte at 8 warps per SM), and qmma_kernel (opt-in) at 38.3.
bool stream_takes(WeightQuant q) {
  return weight_quant_is_4bit(q);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The matrix shapes and pointers the kernel takes: whole 512-element segments (so every row's
// codes, scales and chunk tails are whole 16-byte units), x staged whole, 16-byte aligned
// codes and block scales (the per-channel scales: 4-byte).
bool takes(const MatRef& w) {
  if (!w.quantized() || w.rows <= 0 || w.cols % 512 != 0 || w.cols > kMaxK) return false;
  if (!aligned16(w.data)) return false;
  return w.quant == WeightQuant::kFp8Channel ? reinterpret_cast<uintptr_t>(w.scale) % 4 == 0
                                             : aligned16(w.scale);
}

// x elements staged per row: k rounded up to a whole 4-bit warp segment (1024; reads stop at the
// first segment past k).
int kpad_of(int64_t k) {
  return static_cast<int>((k + 1023) / 1024 * 1024);
}

std::atomic<int> g_on{-1};

// A process-wide switch: the environment's value (or `def`) until set.
bool switch_value(std::atomic<int>& v, const char* env, bool def) {
  int x = v.load(std::memory_order_relaxed);
  if (x < 0) {
    int expected = -1;
    v.compare_exchange_strong(expected, env_switch(env, def) ? 1 : 0);
    x = v.load(std::memory_order_relaxed);
  }
  return x == 1;
}

}  // namespace

bool on() {
  return switch_value(g_on, "M3_QUANT_STREAM", true);
}

void set_on(bool v) {
  g_on.store(v ? 1 : 0, std::memory_order_relaxed);
}

bool mma_on() {
  return switch_value(g_mma, "M3_QUANT_MMA", true);
}

void set_mma_on(bool v) {
  g_mma.store(v ? 1 : 0, std::memory_order_relaxed);
}

namespace {
std::atomic<int> g_mma_tokens{-1};
}  // namespace

int mma_tokens() {
  int v = g_mma_tokens.load(std::memory_order_relaxed);
  if (v < 0) {
    int expected = -1;
    g_mma_tokens.compare_exchange_strong(
        expected, env_count(
                      "M3_QUANT_MMA_TOKENS", 1, [](long n) { return n >= 1 && n <= 4; }, "1-4"));
    v = g_mma_tokens.load(std::memory_order_relaxed);
  }
  return v;
}

void set_mma_tokens(int n) {
  g_mma_tokens.store(std::clamp(n, 1, 4), std::memory_order_relaxed);
}

bool dense(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream) {
  // Rows for every warp of the grid: fewer leave SMs idle, where the group kernel's CTAs of 4-8
  // rows spread better.
  if (!on() || !takes(w) || !aligned16(x) || w.rows < static_cast<int64_t>(num_sms()) * kWarps)
    return false;
  Params p;
  p.proj[0] = Proj{static_cast<const uint8_t*>(w.data), static_cast<const uint8_t*>(w.scale),
                   w.global_scale, nullptr, y};
  p.x = x;
  p.m = w.rows;
  p.k = w.cols;
  p.row_bytes = w.row_bytes();
  p.scale_row_bytes = w.scale_row_bytes();
  p.ntok = static_cast<int>(std::min<int64_t>(n, 5));
  if (mma_takes(w) && n <= mma_tokens()) return run_mma(p, stream);
  if (n != 1 || !stream_takes(w.quant)) return false;
  p.kpad = kpad_of(w.cols);
  return run_any(w.quant, p, stream);
}

bool grouped(const float* x, const int32_t* x_rows, bool x_one_row, const QuantExperts* w,
             float* const* y, int nproj, const int32_t* offsets, const int32_t* active,
             const int32_t* num_active, int64_t slots, cudaStream_t stream) {
  if (!on() || nproj < 1 || nproj > 2 || slots < 1 || slots > kMaxSlots || !aligned16(x))
    return false;
  const MatRef& f = w[0].first;
  if (!takes(f) || w[0].data_stride % 16 != 0 ||
      w[0].scale_stride % (f.quant == WeightQuant::kFp8Channel ? 4 : 16) != 0)
    return false;
  for (int j = 1; j < nproj; ++j) {
    const MatRef& g = w[j].first;
    if (g.quant != f.quant || g.rows != f.rows || g.cols != f.cols || !takes(g) ||
        w[j].data_stride != w[0].data_stride || w[j].scale_stride != w[0].scale_stride)
      return false;
  }
  Params p;
  for (int j = 0; j < nproj; ++j)
    p.proj[j] = Proj{static_cast<const uint8_t*>(w[j].first.data),
                     static_cast<const uint8_t*>(w[j].first.scale), w[j].first.global_scale,
                     w[j].global_scales, y[j]};
  p.nproj = nproj;
  p.x = x;
  p.x_rows = x_rows;
  p.m = f.rows;
  p.k = f.cols;
  p.row_bytes = f.row_bytes();
  p.scale_row_bytes = f.scale_row_bytes();
  p.w_stride = w[0].data_stride;
  p.scale_stride = w[0].scale_stride;
  p.offsets = offsets;
  p.active = active;
  p.num_active = num_active;
  p.xcopies = x_one_row ? 1 : static_cast<int>(slots);
  p.slots = static_cast<int>(slots);
  if (mma_takes(f)) return run_mma(p, stream);
  if (!stream_takes(f.quant)) return false;
  p.kpad = kpad_of(f.cols);
  return run_any(f.quant, p, stream);
}

}  // namespace m3::kernels::cuda::qstream
