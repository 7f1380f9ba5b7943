#include "core/dtype.h"

#include <algorithm>
#include <array>

#include <cmath>
#include <limits>

namespace m3 {

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
    case DType::kU8:
      return 1;
    case DType::kI8:
      return 1;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kF64:
      return 8;
    case DType::kBool:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kF64:
      return "F64";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view s) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kU8, DType::kI8,
                  DType::kI32, DType::kI64, DType::kF64, DType::kBool}) {
    if (s == dtype_name(d)) return d;
  }
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // overflow to inf (rounding included)
  if (ax < 0x38800000u) {                        // subnormal or zero in f16
    float a;
    std::memcpy(&a, &ax, 4);
    const float scaled = a * 16777216.0f;  // 2^24: one f16 subnormal ulp = 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
  return sign | static_cast<uint16_t>((r - 0x38000000u) >> 13);
}

float fp8_e4m3_to_f32(uint8_t v) {
  const int sign = v >> 7;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 0x7;
  float r;
  if (exp == 0xf && man == 0x7) {
    r = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    r = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  } else {
    r = std::ldexp(static_cast<float>(8 + man), exp - 10);  // (1+man/8) * 2^(exp-7)
  }
  return sign ? -r : r;
}

uint8_t f32_to_fp8_e4m3(float f) {
  // The 127 finite non-negative codes in increasing order of value (code c has value
  // fp8_e4m3_to_f32(c)); a binary search finds the two neighbours of |f|.
  static const auto table = [] {
    std::array<float, 127> t{};
    for (int c = 0; c < 127; ++c) t[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= table[126]) return sign | 126;  // saturate to 448
  // c = the largest code with table[c] <= a.
  const int c =
      static_cast<int>(std::upper_bound(table.begin(), table.end(), a) - table.begin()) - 1;
  if (table[c] == a) return sign | static_cast<uint8_t>(c);
  const float below = a - table[c], above = table[c + 1] - a;
  int pick = below < above ? c : above < below ? c + 1 : (c % 2 == 0 ? c : c + 1);
  return sign | static_cast<uint8_t>(pick);
}

uint8_t f32_to_e2m1(float f) {
  if (std::isnan(f)) return 0;
  const uint8_t sign = std::signbit(f) ? 8 : 0;
  const float a = std::fabs(f);
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  if (a >= 6.f) return sign | 7;
  int c = 0;
  while (c < 7 && kMag[c + 1] <= a) ++c;  // the largest code with kMag[c] <= a
  if (kMag[c] == a) return sign | static_cast<uint8_t>(c);
  const float below = a - kMag[c], above = kMag[c + 1] - a;
  const int pick = below < above ? c : above < below ? c + 1 : (c % 2 == 0 ? c : c + 1);
  return sign | static_cast<uint8_t>(pick);
}

float e8m0_to_f32(uint8_t v) {
  if (v == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

}  // namespace m3
