// Device helpers shared by the CUDA ops: bf16/f32 weight loads, warp/block reductions, the
// (score, id) ordering used by every top-k, and M3_DEVICE_CHECK. Included only by .cu files in
// this folder. Invariant: reductions assume blockDim.x is a multiple of 32 and at most 1024.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "core/check.h"
#include "gpu/cuda_check.h"

// A broken caller contract inside a kernel (index out of range, a block in the future): print
// it and trap, so the next CUDA check on the host ends the process (design.md §4).
#define M3_DEVICE_CHECK(cond, fmt, ...)                                                         \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      printf("m3serve: device check failed at %s:%d: %s: " fmt "\n", __FILE__, __LINE__, #cond, \
             __VA_ARGS__);                                                                      \
      __trap();                                                                                 \
    }                                                                                           \
  } while (0)

namespace m3::kernels::cuda::detail {

inline constexpr int kWarp = 32;
inline constexpr int32_t kNoId = 0x7fffffff;

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Element i of a weight array that is bf16 (is_bf16) or f32.
__device__ __forceinline__ float load_weight(const void* p, bool is_bf16, int64_t i) {
  return is_bf16 ? bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i])
                 : static_cast<const float*>(p)[i];
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `red` is __shared__ float[32].
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < num_warps ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[0] = t;
  }
  __syncthreads();
  const float r = red[0];
  __syncthreads();  // red may be reused right after
  return r;
}

// The top-k order of every selection op: higher score first, ties to the lower id; kNoId
// (no candidate) ranks last.
__device__ __forceinline__ bool ranks_before(float sa, int32_t ia, float sb, int32_t ib) {
  if (ia == kNoId) return false;
  if (ib == kNoId) return true;
  return sa > sb || (sa == sb && ia < ib);
}

// The best (score, id) of the warp by ranks_before; every lane gets it.
__device__ __forceinline__ void warp_best(float& s, int32_t& id) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float os = __shfl_xor_sync(0xffffffffu, s, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, id, o);
    if (ranks_before(os, oi, s, id)) {
      s = os;
      id = oi;
    }
  }
}

// The best (score, id) of the block; every thread gets it. red_s/red_i: __shared__ [32] each.
__device__ __forceinline__ void block_best(float& s, int32_t& id, float* red_s, int32_t* red_i) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  warp_best(s, id);
  if (lane == 0) {
    red_s[warp] = s;
    red_i[warp] = id;
  }
  __syncthreads();
  if (warp == 0) {
    float ts = lane < num_warps ? red_s[lane] : 0.f;
    int32_t ti = lane < num_warps ? red_i[lane] : kNoId;
    warp_best(ts, ti);
    if (lane == 0) {
      red_s[0] = ts;
      red_i[0] = ti;
    }
  }
  __syncthreads();
  s = red_s[0];
  id = red_i[0];
  __syncthreads();
}

inline unsigned ceil_div(int64_t a, int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace m3::kernels::cuda::detail
