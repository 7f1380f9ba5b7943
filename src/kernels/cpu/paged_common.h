// Helpers shared by the CPU paged-attention and MSA-selection ops (attn_paged.cpp,
// msa_select.cpp). Internal to kernels/cpu. The dot product's summation order is the one the
// CUDA MSA kernel mirrors (kernels/cuda/msa_select.cu), so block choices agree exactly.
#pragma once

#include <cstdint>

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

}  // namespace m3::kernels::cpu::detail
