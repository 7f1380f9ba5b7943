// Helpers shared by the CPU paged-attention and MSA-selection ops (attn_paged.cpp,
// msa_select.cpp). Internal to kernels/cpu. The dot product's summation order is the one the
// CUDA MSA kernel mirrors (kernels/cuda/msa_select.cu), so block choices agree exactly.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "kernels/views.h"

namespace m3::kernels::cpu::detail {

// 8 interleaved accumulators, summed in pairs, plus the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// The physical page of logical block `block` of sequence `seq`.
inline int32_t page_of(const TokenLayout& L, int32_t seq, int64_t block) {
  return L.block_table[L.block_table_offsets[seq] + block];
}

// E4M3 code -> value, all 256 codes.
inline const std::array<float, 256>& fp8_table() {
  static const auto t = [] {
    std::array<float, 256> a{};
    for (int c = 0; c < 256; ++c) a[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    return a;
  }();
  return t;
}

// Elements [at, at + n) of a cache array of `dt` elements, as fp32 values times `scale`
// (the scale applies to fp8 only; docs/KV_CACHE.md).
inline void load_row(const void* base, KvDtype dt, int64_t at, int64_t n, float scale, float* out) {
  switch (dt) {
    case KvDtype::kF32:
      std::memcpy(out, static_cast<const float*>(base) + at, n * sizeof(float));
      return;
    case KvDtype::kBf16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    case KvDtype::kFp8: {
      const uint8_t* p = static_cast<const uint8_t*>(base) + at;
      const auto& t = fp8_table();
      for (int64_t i = 0; i < n; ++i) out[i] = t[p[i]] * scale;
      return;
    }
  }
}

// Stores n fp32 values at elements [at, at + n) of a cache array of `dt` elements: bf16 rounds
// to nearest even, fp8 stores fp8(x * inv_scale) (saturating, as the GPU converts).
inline void store_row(void* base, KvDtype dt, int64_t at, int64_t n, float inv_scale,
                      const float* in) {
  switch (dt) {
    case KvDtype::kF32:
      std::memcpy(static_cast<float*>(base) + at, in, n * sizeof(float));
      return;
    case KvDtype::kBf16: {
      uint16_t* p = static_cast<uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(in[i]);
      return;
    }
    case KvDtype::kFp8: {
      uint8_t* p = static_cast<uint8_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_fp8_e4m3(in[i] * inv_scale);
      return;
    }
  }
}

}  // namespace m3::kernels::cpu::detail
