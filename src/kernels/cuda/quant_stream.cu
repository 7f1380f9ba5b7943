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
// - qmma_kernel, fp8_per_channel on the tensor cores, opt-in (comment below: slower as it
//   stands).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>

#include "core/check.h"
#include "core/env.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/common.cuh"
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

// ---- fp8_per_channel on the tensor cores ----
// The CUDA-core loop above, run over fp8 rows (a form since removed), spent ~4 instructions per
// code byte (the decode, then one FMA per code) and with 8 warps per SM could not issue them at
// the bandwidth: it ran at 40-45% of the copy bandwidth. Here each e4m3 pair converts once to an
// f16 pair (exact) that is the B operand of an m16n8k16 MMA as it stands, so a warp spends ~10
// instructions per 512 bytes. B = 8 weight rows (its 8 columns) x 16 codes; A = the x terms: row 0
// x_hi, row 1 x_lo, with x scaled by 2^-E (E from x's largest magnitude, so it sits in [2^14,
// 2^15)) and x_hi = f16(x), x_lo = f16(x - x_hi): 22 bits of x, fp32 accumulation. A lane's k slots
// map to 16 consecutive codes of its row (the k order inside a 64-code window is free: A uses the
// same map), so it reads them as one 16-byte load. A CTA works through 8-row groups (an even share
// of all groups of the launch), one CTA-wide ring stage per group (thread 0 issues it, one mbarrier
// per stage); its 8 warps split k (k / 8 each), and after a barrier warp 0 sums the warps' partials
// in warp order (deterministic) while thread 0 refills the stage. The first form (per-warp rings of
// 8 rows x
// <= 512 bytes, 8 bulk copies per 4.5 KB stage) measured 38.3 us on q_proj against the group
// kernel's 22.8; this one has not run on the GPU yet at the time of writing.
// A stage is one 8-row group, whole rows (8 bulk copies of k bytes), at a row pitch of k + 64 so
// that the lanes' 16-byte loads of two rows fall in different banks.
__host__ __device__ inline int64_t mma_pitch(int64_t k) {
  return k + 64;
}

// Shared memory of qmma_kernel: x_hi, x_lo (f16, xcopies x k each), the x factors, the slot
// table, the warps' partials (two groups), the stage barriers, the ring of stages.
__host__ __device__ inline size_t mma_fac_offset(int xcopies, int64_t k) {
  return static_cast<size_t>(xcopies) * k * 4;  // two f16 arrays
}
__host__ __device__ inline size_t mma_table_offset(int xcopies, int64_t k) {
  return mma_fac_offset(xcopies, k) + kMaxSlots * 4;
}
__host__ __device__ inline size_t mma_part_offset(int xcopies, int64_t k) {
  return mma_table_offset(xcopies, k) + (2 * kMaxSlots + 2) * 4 + 8 * 4;  // + red[8]
}
__host__ __device__ inline size_t mma_bar_offset(int xcopies, int64_t k) {
  return (mma_part_offset(xcopies, k) + 2 * kWarps * 8 * 4 + 7) / 8 * 8;
}
__host__ __device__ inline size_t mma_ring_offset(int xcopies, int64_t k) {
  return (mma_bar_offset(xcopies, k) + kMaxStages * 8 + 127) / 128 * 128;
}

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

// x row (k f32) -> hi / lo f16 arrays scaled by 2^-E, *fac = 2^E; by every thread of the CTA
// (`red`: 8 floats of shared memory); ends with a barrier.
__device__ __forceinline__ void mma_stage_x(__half* hi, __half* lo, float* fac, const float* x,
                                            int64_t k, float* red) {
  float mx = 0.f;
  for (int64_t i = threadIdx.x * 4; i < k; i += kThreads * 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
    mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
  mx = detail::warp_max(mx);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  int e = 0;
  if (mx > 0.f && mx < INFINITY) frexpf(mx, &e);  // mx < 2^e
  const float down = ldexpf(1.f, 15 - e);
  for (int64_t i = threadIdx.x * 4; i < k; i += kThreads * 4) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
    const float f[4] = {v.x * down, v.y * down, v.z * down, v.w * down};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half h = __float2half_rn(f[j]);
      hi[i + j] = h;
      lo[i + j] = __float2half_rn(f[j] - __half2float(h));
    }
  }
  if (threadIdx.x == 0) *fac = ldexpf(1.f, e - 15);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) qmma_kernel(Params p) {
  extern __shared__ float4 qmma_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(qmma_smem);
  const int64_t K = p.k;
  __half* xh = reinterpret_cast<__half*>(smem);
  __half* xl = xh + static_cast<size_t>(p.xcopies) * K;
  float* xfac = reinterpret_cast<float*>(smem + mma_fac_offset(p.xcopies, K));
  int* slot_e = reinterpret_cast<int*>(smem + mma_table_offset(p.xcopies, K));
  int* slot_p = slot_e + kMaxSlots;
  int* active_n = slot_p + kMaxSlots;
  float* red = reinterpret_cast<float*>(active_n + 2);
  float* part = reinterpret_cast<float*>(smem + mma_part_offset(p.xcopies, K));  // [2][8][8]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int S = p.stages;
  const int64_t pitch = mma_pitch(K);
  const size_t stage_bytes = static_cast<size_t>(8 * pitch);
  const uint32_t bar0 = detail::smem_addr(smem + mma_bar_offset(p.xcopies, K));
  const unsigned char* ring_p = smem + mma_ring_offset(p.xcopies, K);
  const uint32_t ring = detail::smem_addr(ring_p);
  const bool grouped = p.active != nullptr;

  if (threadIdx.x == 0) {
    for (int st = 0; st < S; ++st) detail::mbar_init(bar0 + 8 * st, 1);
    detail::mbar_fence_init();
  }
  const int A = load_slots(p, grouped, slot_e, slot_p, active_n);

  // This CTA's 8-row groups [q0, q1) of nproj x A matrices, one stage each; this warp's k slice.
  const int64_t gpm = p.m / 8;
  const int64_t G = static_cast<int64_t>(p.nproj) * A * gpm;
  const int64_t q0 = blockIdx.x * G / gridDim.x, q1 = (blockIdx.x + 1) * G / gridDim.x;
  const int items = static_cast<int>(q1 - q0);
  const int64_t slice = K / kWarps, kw0 = warp * slice;
  auto where = [&](int64_t q, int* proj, int* slot, int64_t* row0) {
    const int64_t mat = q / gpm;
    *proj = static_cast<int>(mat / A);
    *slot = static_cast<int>(mat % A);
    *row0 = (q % gpm) * 8;
  };
  auto issue = [&](int i) {  // thread 0: group q0 + i's 8 whole rows into stage i % S
    if (i >= items) return;
    int proj, slot;
    int64_t row0;
    where(q0 + i, &proj, &slot, &row0);
    const Proj& pr = proj == 0 ? p.proj[0] : p.proj[1];
    const int64_t e = grouped ? slot_e[slot] : 0;
    const uint8_t* src = pr.w + e * p.w_stride + row0 * p.row_bytes;
    const int st = i % S;
    const uint32_t bar = bar0 + 8 * st;
    detail::mbar_arrive_expect_tx(bar, static_cast<uint32_t>(8 * K));
    for (int j = 0; j < 8; ++j)
      detail::bulk_copy_g2s(ring + static_cast<uint32_t>(st * stage_bytes + j * pitch),
                            src + j * p.row_bytes, static_cast<uint32_t>(K), bar);
  };
  if (threadIdx.x == 0)
    for (int i = 0; i < S; ++i) issue(i);
  if (!grouped) {
    detail::pdl_enter();  // x and y belong to earlier kernels
    mma_stage_x(xh, xl, xfac, p.x, K, red);
  } else {
    for (int c = 0; c < p.xcopies && c < A; ++c) {
      const int pos = slot_p[c];
      const float* xr = p.x + (p.x_rows != nullptr ? static_cast<int64_t>(p.x_rows[pos]) : pos) * K;
      mma_stage_x(xh + static_cast<size_t>(c) * K, xl + static_cast<size_t>(c) * K, xfac + c, xr, K,
                  red);
    }
  }

  const int windows = static_cast<int>(slice / 64);
  for (int i = 0; i < items; ++i) {
    int proj, slot;
    int64_t row0;
    where(q0 + i, &proj, &slot, &row0);
    const Proj& pr = proj == 0 ? p.proj[0] : p.proj[1];
    const int64_t e = grouped ? slot_e[slot] : 0;
    const int xc = p.xcopies == 1 ? 0 : slot;
    float rf = 0.f;  // warp 0, lane r < 8: row row0 + r's per-channel scale (loaded ahead)
    if (warp == 0 && lane < 8)
      rf = __ldg(reinterpret_cast<const float*>(pr.scale + e * p.scale_stride) + row0 + lane);
    const int st = i % S;
    detail::mbar_wait(bar0 + 8 * st, static_cast<uint32_t>(i / S) & 1u);
    const unsigned char* arow = ring_p + st * stage_bytes + g * pitch + kw0 + 16 * t;
    const __half* xsrc = (g == 0 ? xh : xl) + static_cast<size_t>(xc) * K + kw0 + 16 * t;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int w = 0; w < windows; ++w) {
      const uint4 raw = *reinterpret_cast<const uint4*>(arow + w * 64);
      uint4 xa = make_uint4(0u, 0u, 0u, 0u), xb = make_uint4(0u, 0u, 0u, 0u);
      if (g < 2) {
        xa = *reinterpret_cast<const uint4*>(xsrc + w * 64);
        xb = *reinterpret_cast<const uint4*>(xsrc + w * 64 + 8);
      }
      const uint32_t wd[4] = {raw.x, raw.y, raw.z, raw.w};
      const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4)
        mma_f16(acc, xv[2 * s4], xv[2 * s4 + 1], e4m3x2_to_f16x2(wd[s4]),
                e4m3x2_to_f16x2(wd[s4] >> 16));
    }
    // D row 0 (x_hi) is in lanes 0-3, row 1 (x_lo) in lanes 4-7, columns 2t and 2t + 1.
    const float v0 = acc[0] + __shfl_down_sync(0xffffffffu, acc[0], 4);
    const float v1 = acc[1] + __shfl_down_sync(0xffffffffu, acc[1], 4);
    const int par = i & 1;
    if (lane < 4) {
      part[(par * kWarps + warp) * 8 + 2 * t] = v0;
      part[(par * kWarps + warp) * 8 + 2 * t + 1] = v1;
    }
    __syncthreads();  // every warp is past stage st and its partials are in
    if (threadIdx.x == 0) issue(i + S);
    if (warp == 0 && lane < 8) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += part[(par * kWarps + w) * 8 + lane];
      const int64_t pos = grouped ? slot_p[slot] : 0;
      pr.y[pos * p.m + row0 + lane] = sum * xfac[xc] * rf;
    }
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

// fp8_per_channel with rows in whole 8-row groups: qmma_kernel, opt-in (M3_QUANT_MMA=1): it
// measured slower than the group kernel (see its comment).
std::atomic<int> g_mma{-1};
bool mma_takes(const MatRef& w) {
  return mma_on() && w.quant == WeightQuant::kFp8Channel && w.rows % 8 == 0;
}

bool run_mma(Params p, cudaStream_t stream) {
  const size_t off = mma_ring_offset(p.xcopies, p.k);
  const int64_t left = detail::smem_optin_limit() - static_cast<int64_t>(off);
  const int64_t stage = 8 * mma_pitch(p.k);
  p.stages = static_cast<int>(std::min<int64_t>(kMaxStages, left / stage));
  if (p.stages < 2) return false;
  detail::allow_optin_smem<qmma_kernel>();
  detail::launch_pdl(qmma_kernel, dim3(static_cast<unsigned>(num_sms())), dim3(kThreads),
                     off + static_cast<size_t>(p.stages * stage), stream, p);
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
  return switch_value(g_mma, "M3_QUANT_MMA", false);
}

void set_mma_on(bool v) {
  g_mma.store(v ? 1 : 0, std::memory_order_relaxed);
}

bool dense(const float* x, const MatRef& w, float* y, cudaStream_t stream) {
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
  if (mma_takes(w)) return run_mma(p, stream);
  if (!stream_takes(w.quant)) return false;
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
  if (mma_takes(f)) return run_mma(p, stream);
  if (!stream_takes(f.quant)) return false;
  p.kpad = kpad_of(f.cols);
  return run_any(f.quant, p, stream);
}

}  // namespace m3::kernels::cuda::qstream
