// DType and scalar conversions (bf16, fp16, fp8 e4m3, e8m0 scales) used by the loader and CPU ops.
// Called from model/ (safetensors dtypes, dequantisation) and kernels/cpu (bf16 weights read in
// place). Invariant: conversions to f32 are exact; f32 -> bf16/f16 rounds to nearest even.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace m3 {

enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kU8, kI8, kI32, kI64, kF64, kBool };

size_t dtype_size(DType d);
const char* dtype_name(DType d);                           // safetensors spelling: "BF16", ...
std::optional<DType> dtype_from_name(std::string_view s);  // inverse of dtype_name

struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_to_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// OCP FP8 E4M3 ("fn": no infinities, S.1111.111 is NaN), bias 7.
float fp8_e4m3_to_f32(uint8_t v);
// f32 -> E4M3 as the GPU's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) does it: round to
// nearest even, magnitudes above 448 (and infinities) saturate to +-448, NaN stays NaN (0x7f).
uint8_t f32_to_fp8_e4m3(float f);
inline float round_to_fp8_e4m3(float f) {
  return fp8_e4m3_to_f32(f32_to_fp8_e4m3(f));
}
// OCP E8M0 scale: 2^(v-127); 255 is NaN.
float e8m0_to_f32(uint8_t v);

// OCP E2M1 (FP4) code in the low 4 bits: bit 3 the sign, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
inline float e2m1_to_f32(uint8_t code) {
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float m = kMag[code & 7];
  return (code & 8) ? -m : m;
}
// f32 -> E2M1 code: round to nearest, ties to the even code, magnitudes above 6 saturate to 6,
// NaN to +0 (E2M1 has no NaN; quantizers never feed one).
uint8_t f32_to_e2m1(float f);

}  // namespace m3
