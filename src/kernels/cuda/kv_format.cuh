// The element formats of the paged KV cache on the device (docs/KV_CACHE.md): typed loads and
// stores of K / V / index-K elements, the conversions the tensor-core kernels use, and the
// warp-level MMA wrappers. Kernels are templated on the storage type: float (kF32), uint16_t
// (kBf16, the bf16 bits) or uint8_t (kFp8, the E4M3 code). Included only by .cu files in this
// folder. Invariant: a store writes the byte the CPU twin (kernels/cpu/paged_common.h store_row)
// writes for the same fp32 input; a load returns the exact fp32 value of the stored element
// (times the fp8 scale).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "kernels/views.h"

namespace m3::kernels::cuda::detail {

// fp32 -> bf16 bits, round to nearest even, NaN kept quiet: m3::f32_to_bf16 bit for bit.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float round_bf16(float f) {
  return bf16_bits_to_f32(f32_to_bf16_bits(f));
}

// fp32 -> E4M3 code, saturating, round to nearest even (m3::f32_to_fp8_e4m3 for every input).
__device__ __forceinline__ uint8_t f32_to_fp8(float f) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float fp8_to_f32(uint8_t c) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
  return __half2float(__half(h));
}

template <class T>
struct KvElem;
template <>
struct KvElem<float> {
  static constexpr KvDtype kDtype = KvDtype::kF32;
  __device__ static float load(const float* p, int64_t i, float) { return p[i]; }
  __device__ static void store(float* p, int64_t i, float x, float) { p[i] = x; }
};
template <>
struct KvElem<uint16_t> {
  static constexpr KvDtype kDtype = KvDtype::kBf16;
  __device__ static float load(const uint16_t* p, int64_t i, float) {
    return bf16_bits_to_f32(p[i]);
  }
  __device__ static void store(uint16_t* p, int64_t i, float x, float) {
    p[i] = f32_to_bf16_bits(x);
  }
};
template <>
struct KvElem<uint8_t> {
  static constexpr KvDtype kDtype = KvDtype::kFp8;
  // scale: the per-tensor (K/V) or per-token (index-K) scale; inv: 1 / scale (host fp32).
  __device__ static float load(const uint8_t* p, int64_t i, float scale) {
    return fp8_to_f32(p[i]) * scale;
  }
  __device__ static void store(uint8_t* p, int64_t i, float x, float inv) {
    p[i] = f32_to_fp8(x * inv);
  }
};

// Runs f.template operator()<T>() with T the storage type of `d`.
template <class F>
void dispatch_kv(KvDtype d, F&& f) {
  switch (d) {
    case KvDtype::kF32:
      f.template operator()<float>();
      return;
    case KvDtype::kBf16:
      f.template operator()<uint16_t>();
      return;
    case KvDtype::kFp8:
      f.template operator()<uint8_t>();
      return;
  }
}

// ---- tensor cores: m16n8k16, fp32 accumulation ----
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 * r + c (r = lane / 4, c = lane % 4).
//   A (16 x 16, row): a0 = A[r][2c, 2c+1], a1 = A[r+8][2c, 2c+1], a2 = A[r][2c+8, 2c+9],
//                     a3 = A[r+8][2c+8, 2c+9]
//   B (16 x 8, col):  b0 = B[2c, 2c+1][r], b1 = B[2c+8, 2c+9][r]
//   C (16 x 8):       c0, c1 = C[r][2c, 2c+1], c2, c3 = C[r+8][2c, 2c+1]
// A product's reduction index may be permuted freely (the same way for A and B): the kernels
// assign the k columns so that each lane's 16-byte loads of a cache row feed its fragments
// directly (kv_k_base below).

// Packs two fp32 into bf16x2 / f16x2 (round to nearest even; lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16_bits(lo)) |
         (static_cast<uint32_t>(f32_to_bf16_bits(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// Two E4M3 codes (the low 16 bits of `v`, lo first) -> f16x2, exact.
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t v) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// A 16-byte read-only global load that stays in program order with the other asm statements
// (the MMAs): a batch of these is in flight before the first product needs one.
__device__ __forceinline__ uint4 ldg_nc16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A hint to bring the 128-byte line at p into L2 (no register, no wait): streams a warp's next
// piece of work while it computes the current one.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- shared-memory fragment loads (ldmatrix) ----
// Four 8x8 16-bit matrices; lane L gives the row address of matrix L / 8, row L % 8; register i
// of a lane holds matrix i's row (lane / 4), elements 2 (lane % 4), +1 (the MMA's A / B layout).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// The same, transposed: register i holds matrix i's column (lane / 4), rows 2 (lane % 4), +1.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                                  uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// The tensor-core element type of a cache format: bf16 rows feed bf16 MMAs; E4M3 codes convert
// exactly to f16 and feed f16 MMAs (the other operand, a bf16-rounded fp32 query, converts to
// f16 exactly unless its magnitude is outside f16's normal range [2^-14, 65504]: queries after
// RMSNorm are far inside it).
template <class T>
struct MmaOf;
template <>
struct MmaOf<uint16_t> {
  static constexpr int kElemsPer16B = 8;
  __device__ static uint32_t pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16(d, a, b0, b1);
  }
  // One 16-byte load (8 bf16) as 4 packed pairs.
  __device__ static void unpack(const uint4& v, uint32_t* out) {
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
};
template <>
struct MmaOf<uint8_t> {
  static constexpr int kElemsPer16B = 16;
  __device__ static uint32_t pack(float lo, float hi) { return pack_f16x2(lo, hi); }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_f16(d, a, b0, b1);
  }
  // One 16-byte load (16 codes) as 8 f16 pairs.
  __device__ static void unpack(const uint4& v, uint32_t* out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = fp8x2_to_f16x2(w[i]);
      out[2 * i + 1] = fp8x2_to_f16x2(w[i] >> 16);
    }
  }
};

// The first of the 4 row elements that lane column c (lane % 4) contributes to k-step ks of a
// dot over a row read as 16-byte pieces of E elements: piece j of the row (elements
// [j * 4E, (j + 1) * 4E), lane c holding [j * 4E + c * E, + E)) feeds k-steps
// j * E / 4 .. (j + 1) * E / 4 - 1, four elements each: (base, base + 1) as the fragment's low
// pair (k = 2c, 2c + 1), (base + 2, base + 3) as its high pair (k = 2c + 8, 2c + 9).
template <int E>
__device__ __forceinline__ int kv_k_base(int ks, int c) {
  constexpr int steps = E / 4;
  return 4 * E * (ks / steps) + E * c + 4 * (ks % steps);
}

}  // namespace m3::kernels::cuda::detail
