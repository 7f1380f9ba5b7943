// gemv_quant and dequantize_bf16 (kernels/cuda/quant.h). The weight row is walked in 16-element
// units (16 bytes of e4m3 codes, 8 bytes of E2M1 codes); a CTA of 8 warps owns R rows and splits
// their units over its 256 threads, each thread loading its unit of all R rows before using any
// (R 16-byte / 8-byte loads in flight) and the unit's x of every token of the pass, then decoding
// each row's unit once for all tokens. A unit's codes are decoded unscaled (exact) and their dot
// product with x is multiplied by the unit's scale (one load per row and unit; the per-channel
// scale multiplies the row's sum). Partial sums are reduced across the warp by shuffles and across
// the 8 warps in shared memory. e4m3 decodes through the hardware's fp8x2 -> half2 conversion,
// E2M1 through fp16 bit patterns (decode_unscaled).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_stream.cuh"

namespace m3::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <WeightQuant Q>
struct Fmt {
  static constexpr bool kFour = Q == WeightQuant::kNvfp4 || Q == WeightQuant::kMxfp4;
  using Raw = typename std::conditional<kFour, uint2, uint4>::type;
};
// Rows per CTA: 4 (4 x 16 bytes in flight per thread for fp8); 8 for 4-bit codes at one token
// (8 x 8 bytes), where the registers allow it (x of more tokens takes them).
template <WeightQuant Q, int NT>
constexpr int rows_per_cta() {
  return Fmt<Q>::kFour && NT == 1 ? 8 : 4;
}

__device__ __forceinline__ float e2m1(uint32_t c) {
  // Magnitude code c & 7 = (e, m): 0 -> 0, 1 -> 0.5, else (1 + m / 2) * 2^(e - 1).
  const uint32_t mag = c & 7u, e = mag >> 1, m = mag & 1u;
  const float v =
      mag < 2 ? 0.5f * static_cast<float>(mag) : __uint_as_float(((126u + e) << 23) | (m << 22));
  return (c & 8u) ? -v : v;
}

__device__ __forceinline__ float e8m0(uint8_t s) {
  // 2^(s - 127); s = 0 is 2^-127 (a subnormal); 255 (NaN) never appears in weights.
  return s == 0 ? 5.877471754111438e-39f : __uint_as_float(static_cast<uint32_t>(s) << 23);
}

__device__ __forceinline__ float fp8_e4m3(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

// Unit u (elements [16u, 16u + 16)) of a row as 16 floats, scale applied except the per-channel
// one (applied to the row's sum): the dequantisation kernel's decode, exactly the CPU's values.
template <WeightQuant Q>
__device__ __forceinline__ void decode(const typename Fmt<Q>::Raw& raw, const uint8_t* srow,
                                       int64_t u, float g, float* f) {
  if constexpr (Fmt<Q>::kFour) {
    float s;
    if constexpr (Q == WeightQuant::kNvfp4) {
      s = fp8_e4m3(srow[u]) * g;  // one fp8 scale per 16: the unit's block
    } else {
      s = e8m0(srow[u / 2]);  // one E8M0 per 32
    }
    const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) f[8 * i + j] = e2m1((w[i] >> (4 * j)) & 15u) * s;
  } else {
    const float s = Q == WeightQuant::kMxfp8 ? e8m0(srow[u / 2]) : 1.f;
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * j)) & 0xffffu), __NV_E4M3);
        const float2 v = __half22float2(__half2(h2));
        f[4 * i + 2 * j] = v.x * s;
        f[4 * i + 2 * j + 1] = v.y * s;
      }
    }
  }
}

// The GEMV's decode: a unit's codes as 16 floats without the scale, in element order, plus the
// unit's scale (what multiplies their dot product with x). E2M1 goes through fp16 bit patterns:
// the code's magnitude bits land in the half's exponent/mantissa (bits 11..9) and its sign in
// bit 15, which is the code's value times 2^-14 (subnormal for 0.5); the 2^14 joins the scale.
// Two codes per half2 (nibbles j and j + 4 of a word), converted to float2 exactly.
template <WeightQuant Q>
__device__ __forceinline__ float decode_unscaled(const typename Fmt<Q>::Raw& raw,
                                                 const uint8_t* srow, int64_t u, float g,
                                                 float* f) {
  if constexpr (Fmt<Q>::kFour) {
    const float s = Q == WeightQuant::kNvfp4 ? fp8_e4m3(srow[u]) * g : e8m0(srow[u / 2]);
    const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t v = w[i] >> (4 * j);
        const uint32_t h = ((v << 9) & 0x0e000e00u) | ((v << 12) & 0x80008000u);
        const float2 p = __half22float2(__half2(*reinterpret_cast<const __half2_raw*>(&h)));
        f[8 * i + j] = p.x;      // nibble j
        f[8 * i + j + 4] = p.y;  // nibble j + 4
      }
    }
    return s * 16384.f;
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * j)) & 0xffffu), __NV_E4M3);
        const float2 v = __half22float2(__half2(h2));
        f[4 * i + 2 * j] = v.x;
        f[4 * i + 2 * j + 1] = v.y;
      }
    }
    return Q == WeightQuant::kMxfp8 ? e8m0(srow[u / 2]) : 1.f;
  }
}

struct Args {
  const float* x;
  const int32_t* x_rows;  // x row of position p: x_rows[p] (null: p itself)
  const uint8_t* w;
  const uint8_t* scale;
  float global;
  int64_t m, k, row_bytes, scale_row_bytes;
  float* y;        // [positions, m]
  int64_t t0, nt;  // dense: this pass's positions [t0, t0 + nt)
  // Grouped (gemv_quant_grouped): expert e's codes at w + e * w_stride, its scales at
  // scale + e * scale_stride, its global scale globals[e] (null: `global`); its positions
  // [offsets[e], offsets[e + 1]); CTA row blockIdx.y is the slot into active[0, *num_active).
  int64_t w_stride, scale_stride;
  const float* globals;
  const int32_t* offsets;
  const int32_t* active;
  const int32_t* num_active;
};

// The matrix and position range a CTA works on: the dense pass's, or its expert's.
struct Work {
  const uint8_t* w;
  const uint8_t* scale;
  float global;
  int64_t p0, p1;
};

template <bool kGrouped>
__device__ __forceinline__ bool work_of(const Args& a, Work* wk) {
  wk->w = a.w;
  wk->scale = a.scale;
  wk->global = a.global;
  wk->p0 = a.t0;
  wk->p1 = a.t0 + a.nt;
  if constexpr (kGrouped) {
    const int slot = blockIdx.y;
    if (slot >= *a.num_active) return false;  // fewer active experts than slots
    const int e = a.active[slot];
    wk->w += e * a.w_stride;
    wk->scale += e * a.scale_stride;
    if (a.globals != nullptr) wk->global = a.globals[e];
    wk->p0 = a.offsets[e];
    wk->p1 = a.offsets[e + 1];
  }
  return true;
}

// x row of position p.
__device__ __forceinline__ int64_t x_row(const Args& a, int64_t p) {
  return a.x_rows != nullptr ? static_cast<int64_t>(a.x_rows[p]) : p;
}

// The end of one token group of both GEMV kernels: each warp's partial sums across its lanes,
// then the warps' partials summed per (row, token), times the per-channel scale for
// fp8_per_channel, into y. Ends with a barrier (part[] is rewritten by the next group).
template <WeightQuant Q, int R, int NT>
__device__ __forceinline__ void store_group(float (&acc)[R][NT], float (&part)[kWarps][R][NT],
                                            const Args& a, const Work& wk, int64_t r0, int64_t pg,
                                            int nt) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[warp][r][t] = v;
    }
  __syncthreads();
  if (threadIdx.x < R * NT) {
    const int r = threadIdx.x / NT, t = threadIdx.x % NT;
    if (r0 + r < a.m && t < nt) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += part[w][r][t];
      if constexpr (Q == WeightQuant::kFp8Channel) {
        v *= reinterpret_cast<const float*>(wk.scale)[r0 + r];
      }
      a.y[(pg + t) * a.m + r0 + r] = v;
    }
  }
  __syncthreads();
}

template <WeightQuant Q, int NT, bool kGrouped>
__global__ void __launch_bounds__(kThreads) gemv_quant_kernel(Args a) {
  using F = Fmt<Q>;
  using Raw = typename F::Raw;
  constexpr int R = rows_per_cta<Q, NT>();
  __shared__ float part[kWarps][R][NT];
  Work wk;
  if (!work_of<kGrouped>(a, &wk)) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * R;
  const int64_t units = a.k / 16;
  for (int64_t pg = wk.p0; pg < wk.p1; pg += NT) {
    const int nt = static_cast<int>(min(static_cast<int64_t>(NT), wk.p1 - pg));
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) xr[t] = a.x + x_row(a, pg + (t < nt ? t : 0)) * a.k;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    for (int64_t u = threadIdx.x; u < units; u += kThreads) {
      Raw raw[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        raw[r] = r0 + r < a.m
                     ? __ldg(reinterpret_cast<const Raw*>(wk.w + (r0 + r) * a.row_bytes) + u)
                     : Raw{};
      }
      float xv[NT][16];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4* xp =
            reinterpret_cast<const float4*>(xr[t] + u * 16);  // a missing
                                                              // token reads the first
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 v = __ldg(xp + i);
          xv[t][4 * i] = v.x;
          xv[t][4 * i + 1] = v.y;
          xv[t][4 * i + 2] = v.z;
          xv[t][4 * i + 3] = v.w;
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float f[16];
        const float s = decode_unscaled<Q>(
            raw[r], wk.scale + min(r0 + r, a.m - 1) * a.scale_row_bytes, u, wk.global, f);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float d = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) d = fmaf(f[i], xv[t][i], d);
          acc[r][t] = fmaf(d, s, acc[r][t]);
        }
      }
    }
    store_group<Q, R, NT>(acc, part, a, wk, r0, pg, nt);
  }
}

// The fast GEMV for cols % 128 == 0 (every M3 linear): a lane owns 4 consecutive elements of a
// 128-element chunk (4 fp8 bytes or 2 bytes of E2M1 codes: a warp's weight load is one 128-byte
// or 64-byte line) so its x is one float4 and a warp's x load is 512 contiguous bytes (the
// unit kernel above reads x in 64-byte strides: a quarter of L1's bandwidth). A warp takes every
// 8th chunk, kChunks of them per iteration (R x kChunks loads in flight per thread).
constexpr int kChunks = 4;

template <WeightQuant Q>
struct Group {
  using Raw = typename std::conditional<Fmt<Q>::kFour, uint16_t, uint32_t>::type;
  static constexpr int kBytes = Fmt<Q>::kFour ? 2 : 4;  // bytes of 4 codes
};

// Rows per CTA of the fast GEMV: each CTA reads x once for its rows, so more rows mean less x
// traffic per weight byte. bench_quant_gemv on the H200 (n = 1, M3's expert and q_proj shapes):
// 8 rows cut the 4-bit formats' time by 1-21% (nvfp4 q_proj 35.0 -> 27.5 us) but cost fp8 up to
// 14% on [3072, 6144]; groups of 2 and 4 tokens keep 4 rows (8 rows spill registers there).
template <WeightQuant Q, int NT>
constexpr int group_rows() {
  return Fmt<Q>::kFour && NT == 1 ? 8 : 4;  // rows x kChunks loads in flight per thread
}

// 4 codes -> 4 unscaled floats (element order) and the group's scale (see decode_unscaled).
template <WeightQuant Q>
__device__ __forceinline__ float decode4(typename Group<Q>::Raw raw, const uint8_t* srow,
                                         int64_t e0, float g, float* f) {
  if constexpr (Fmt<Q>::kFour) {
    // Bytes [b0 b1] -> [b0 0 b1 0]: nibbles 0, 1 in the low half, 2, 3 in the high half.
    const uint32_t w = __byte_perm(static_cast<uint32_t>(raw), 0u, 0x4140);
    const uint32_t ha = ((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u);  // nibbles 0, 2
    const uint32_t v = w >> 4;
    const uint32_t hb = ((v << 9) & 0x0e000e00u) | ((v << 12) & 0x80008000u);  // nibbles 1, 3
    const float2 a = __half22float2(__half2(*reinterpret_cast<const __half2_raw*>(&ha)));
    const float2 b = __half22float2(__half2(*reinterpret_cast<const __half2_raw*>(&hb)));
    f[0] = a.x;
    f[1] = b.x;
    f[2] = a.y;
    f[3] = b.y;
    const float s = Q == WeightQuant::kNvfp4 ? fp8_e4m3(srow[e0 / 16]) * g : e8m0(srow[e0 / 32]);
    return s * 16384.f;
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((raw >> (16 * j)) & 0xffffu), __NV_E4M3);
      const float2 v = __half22float2(__half2(h2));
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
    return Q == WeightQuant::kMxfp8 ? e8m0(srow[e0 / 32]) : 1.f;
  }
}

template <WeightQuant Q, int NT, bool kGrouped>
__global__ void __launch_bounds__(kThreads, 2) gemv_group_kernel(Args a) {
  using Raw = typename Group<Q>::Raw;
  constexpr int R = group_rows<Q, NT>();
  constexpr int B = Group<Q>::kBytes;
  __shared__ float part[kWarps][R][NT];
  Work wk;
  if (!work_of<kGrouped>(a, &wk)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * R;
  const int64_t chunks = a.k / 128;
  for (int64_t pg = wk.p0; pg < wk.p1; pg += NT) {
    const int nt = static_cast<int>(min(static_cast<int64_t>(NT), wk.p1 - pg));
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) xr[t] = a.x + x_row(a, pg + (t < nt ? t : 0)) * a.k;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    for (int64_t c0 = warp; c0 < chunks; c0 += kWarps * kChunks) {
      Raw raw[kChunks][R];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int64_t c = c0 + static_cast<int64_t>(j) * kWarps;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          raw[j][r] =
              (c < chunks && r0 + r < a.m)
                  ? __ldg(reinterpret_cast<const Raw*>(wk.w + (r0 + r) * a.row_bytes + c * 32 * B) +
                          lane)
                  : Raw{};
        }
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int64_t c = c0 + static_cast<int64_t>(j) * kWarps;
        if (c >= chunks) break;
        const int64_t e0 = c * 128 + lane * 4;
        float4 xv[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) xv[t] = __ldg(reinterpret_cast<const float4*>(xr[t] + e0));
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float f[4];
          const float s = decode4<Q>(raw[j][r], wk.scale + min(r0 + r, a.m - 1) * a.scale_row_bytes,
                                     e0, wk.global, f);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float d =
                fmaf(f[3], xv[t].w, fmaf(f[2], xv[t].z, fmaf(f[1], xv[t].y, f[0] * xv[t].x)));
            acc[r][t] = fmaf(d, s, acc[r][t]);
          }
        }
      }
    }
    store_group<Q, R, NT>(acc, part, a, wk, r0, pg, nt);
  }
}

// unscaled: the values without their row factor (row_factor below): the per-channel scale and
// the NVFP4 global scale are left out, so every value is exact in bf16.
template <WeightQuant Q>
__global__ void dequant_kernel(const uint8_t* w, const uint8_t* scale, float g, int64_t m,
                               int64_t k, int64_t row_bytes, int64_t scale_row_bytes, bool unscaled,
                               uint16_t* out) {
  using Raw = typename Fmt<Q>::Raw;
  const int64_t units = k / 16;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * units) return;
  const int64_t r = i / units, u = i % units;
  const Raw raw = __ldg(reinterpret_cast<const Raw*>(w + r * row_bytes) + u);
  float f[16];
  decode<Q>(raw, scale + r * scale_row_bytes, u, unscaled ? 1.f : g, f);
  const float s =
      Q == WeightQuant::kFp8Channel && !unscaled ? reinterpret_cast<const float*>(scale)[r] : 1.f;
  uint32_t packed[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // f32 -> bf16 round to nearest even (the host's f32_to_bf16; weights are finite).
    uint32_t lo = __float_as_uint(f[2 * j] * s), hi = __float_as_uint(f[2 * j + 1] * s);
    lo = (lo + 0x7fffu + ((lo >> 16) & 1u)) >> 16;
    hi = (hi + 0x7fffu + ((hi >> 16) & 1u)) >> 16;
    packed[j] = lo | (hi << 16);
  }
  uint4* o = reinterpret_cast<uint4*>(out + r * k + u * 16);
  o[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  o[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// y[t, r] *= scale[r] (per channel) or g (NVFP4's global scale).
__global__ void row_factor_kernel(float* y, int64_t count, int64_t m, const float* scale, float g) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step)
    y[i] *= scale != nullptr ? scale[i % m] : g;
}

Args args_of(const float* x, const MatRef& w, float* y) {
  Args a{};
  a.x = x;
  a.w = static_cast<const uint8_t*>(w.data);
  a.scale = static_cast<const uint8_t*>(w.scale);
  a.global = w.global_scale;
  a.m = w.rows;
  a.k = w.cols;
  a.row_bytes = w.row_bytes();
  a.scale_row_bytes = w.scale_row_bytes();
  a.y = y;
  return a;
}

// One launch over `slots` CTA rows (1 when dense).
template <WeightQuant Q, int NT, bool kGrouped>
void launch_pass(const Args& a, unsigned slots, cudaStream_t s) {
  if (a.k % 128 == 0) {
    constexpr int R = group_rows<Q, NT>();
    const dim3 grid(static_cast<unsigned>((a.m + R - 1) / R), slots);
    gemv_group_kernel<Q, NT, kGrouped><<<grid, kThreads, 0, s>>>(a);
    M3_CUDA_CHECK_LAUNCH("gemv_group_kernel");
    return;
  }
  constexpr int R = rows_per_cta<Q, NT>();
  const dim3 grid(static_cast<unsigned>((a.m + R - 1) / R), slots);
  gemv_quant_kernel<Q, NT, kGrouped><<<grid, kThreads, 0, s>>>(a);
  M3_CUDA_CHECK_LAUNCH("gemv_quant_kernel");
}

template <WeightQuant Q>
void launch_gemv(Args a, int64_t n, cudaStream_t s) {
  for (int64_t t0 = 0; t0 < n; t0 += kGemvTokens) {
    a.t0 = t0;
    a.nt = std::min<int64_t>(kGemvTokens, n - t0);
    if (a.nt == 1) {
      launch_pass<Q, 1, false>(a, 1, s);
    } else if (a.nt == 2) {
      launch_pass<Q, 2, false>(a, 1, s);
    } else {
      launch_pass<Q, 4, false>(a, 1, s);
    }
  }
}

template <WeightQuant Q>
void launch_grouped(const Args& a, int nt, unsigned slots, cudaStream_t s) {
  if (nt <= 1) {
    launch_pass<Q, 1, true>(a, slots, s);
  } else if (nt == 2) {
    launch_pass<Q, 2, true>(a, slots, s);
  } else {
    launch_pass<Q, 4, true>(a, slots, s);
  }
}

}  // namespace

bool quant_op_supported(const MatRef& w) {
  return w.quantized() && w.cols % 16 == 0 && w.rows > 0;
}

void gemv_quant(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream) {
  M3_CHECK(quant_op_supported(w), "gemv_quant: %s weights of %lld columns (a multiple of 16)",
           weight_quant_name(w.quant), static_cast<long long>(w.cols));
  if (n <= 0) return;
  if (n <= 4 && qstream::dense(x, n, w, y, stream)) return;  // quant_stream.cu
  const Args a = args_of(x, w, y);
  switch (w.quant) {
    case WeightQuant::kFp8Channel:
      return launch_gemv<WeightQuant::kFp8Channel>(a, n, stream);
    case WeightQuant::kMxfp8:
      return launch_gemv<WeightQuant::kMxfp8>(a, n, stream);
    case WeightQuant::kNvfp4:
      return launch_gemv<WeightQuant::kNvfp4>(a, n, stream);
    case WeightQuant::kMxfp4:
      return launch_gemv<WeightQuant::kMxfp4>(a, n, stream);
    case WeightQuant::kNone:
      break;
  }
  M3_CHECK(false, "gemv_quant: unquantized weights");
}

void gemv_quant_grouped(const float* x, const int32_t* x_rows, const QuantExperts& w, float* y,
                        const int32_t* offsets, const int32_t* active, const int32_t* num_active,
                        int64_t slots, int nt, cudaStream_t stream) {
  M3_CHECK(quant_op_supported(w.first),
           "gemv_quant_grouped: %s weights of %lld columns (a multiple of 16)",
           weight_quant_name(w.first.quant), static_cast<long long>(w.first.cols));
  M3_CHECK(slots > 0 && slots <= 65535, "gemv_quant_grouped: %lld expert slots",
           static_cast<long long>(slots));
  Args a = args_of(x, w.first, y);
  a.x_rows = x_rows;
  a.w_stride = w.data_stride;
  a.scale_stride = w.scale_stride;
  a.globals = w.global_scales;
  a.offsets = offsets;
  a.active = active;
  a.num_active = num_active;
  const auto sl = static_cast<unsigned>(slots);
  switch (w.first.quant) {
    case WeightQuant::kFp8Channel:
      return launch_grouped<WeightQuant::kFp8Channel>(a, nt, sl, stream);
    case WeightQuant::kMxfp8:
      return launch_grouped<WeightQuant::kMxfp8>(a, nt, sl, stream);
    case WeightQuant::kNvfp4:
      return launch_grouped<WeightQuant::kNvfp4>(a, nt, sl, stream);
    case WeightQuant::kMxfp4:
      return launch_grouped<WeightQuant::kMxfp4>(a, nt, sl, stream);
    case WeightQuant::kNone:
      break;
  }
  M3_CHECK(false, "gemv_quant_grouped: unquantized weights");
}

namespace {
void launch_dequant(const MatRef& w, bool unscaled, uint16_t* out, cudaStream_t stream) {
  M3_CHECK(quant_op_supported(w), "dequantize_bf16: %s weights of %lld columns",
           weight_quant_name(w.quant), static_cast<long long>(w.cols));
  const int64_t units = w.rows * (w.cols / 16);
  const unsigned blocks = static_cast<unsigned>((units + 255) / 256);
  const auto* d = static_cast<const uint8_t*>(w.data);
  const auto* sc = static_cast<const uint8_t*>(w.scale);
  const int64_t rb = w.row_bytes(), sb = w.scale_row_bytes();
  const float g = w.global_scale;
  switch (w.quant) {
    case WeightQuant::kFp8Channel:
      dequant_kernel<WeightQuant::kFp8Channel>
          <<<blocks, 256, 0, stream>>>(d, sc, g, w.rows, w.cols, rb, sb, unscaled, out);
      break;
    case WeightQuant::kMxfp8:
      dequant_kernel<WeightQuant::kMxfp8>
          <<<blocks, 256, 0, stream>>>(d, sc, g, w.rows, w.cols, rb, sb, unscaled, out);
      break;
    case WeightQuant::kNvfp4:
      dequant_kernel<WeightQuant::kNvfp4>
          <<<blocks, 256, 0, stream>>>(d, sc, g, w.rows, w.cols, rb, sb, unscaled, out);
      break;
    case WeightQuant::kMxfp4:
      dequant_kernel<WeightQuant::kMxfp4>
          <<<blocks, 256, 0, stream>>>(d, sc, g, w.rows, w.cols, rb, sb, unscaled, out);
      break;
    case WeightQuant::kNone:
      M3_CHECK(false, "dequantize_bf16: unquantized weights");
  }
  M3_CUDA_CHECK_LAUNCH("dequant_kernel");
}
}  // namespace

void dequantize_bf16(const MatRef& w, uint16_t* out, cudaStream_t stream) {
  launch_dequant(w, /*unscaled=*/false, out, stream);
}

void dequantize_bf16_unscaled(const MatRef& w, uint16_t* out, cudaStream_t stream) {
  launch_dequant(w, /*unscaled=*/true, out, stream);
}

bool has_row_factor(const MatRef& w) {
  return w.quant == WeightQuant::kFp8Channel ||
         (w.quant == WeightQuant::kNvfp4 && w.global_scale != 1.f);
}

void apply_row_factor(float* y, int64_t n, const MatRef& w, cudaStream_t stream) {
  if (!has_row_factor(w) || n <= 0 || w.rows <= 0) return;
  const int64_t count = n * w.rows;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((count + 255) / 256, 4096));
  const float* scale =
      w.quant == WeightQuant::kFp8Channel ? static_cast<const float*>(w.scale) : nullptr;
  row_factor_kernel<<<blocks, 256, 0, stream>>>(y, count, w.rows, scale, w.global_scale);
  M3_CUDA_CHECK_LAUNCH("row_factor_kernel");
}

}  // namespace m3::kernels::cuda
