// Device helpers shared by the CUDA ops: bf16/f32 weight loads, warp/block reductions, the
// (score, id) ordering used by every top-k, and M3_DEVICE_CHECK. Included only by .cu files in
// this folder. Invariant: reductions assume blockDim.x is a multiple of 32 and at most 1024.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include <utility>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/ops.h"

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

// One row of a Gemma RMSNorm held in registers (kRowVec float4 per thread; see norm_row_fits):
// a decode step's row is one CTA, so every load is issued at once instead of in a serial loop.
// With kAdd, the row is x + y and is written back to x first (the residual add). out may alias
// x: every read of the row is done before block_sum returns.
inline constexpr int kRowVec = 2;
inline constexpr int kRowThreadsMax = 1024;
inline bool norm_row_fits(int64_t dim, const void* a, const void* b, const void* c) {
  auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return dim > 0 && dim % 4 == 0 && dim / 4 <= int64_t{kRowVec} * kRowThreadsMax && al(a) &&
         al(b) && al(c);
}
inline int norm_row_threads(int64_t dim) {
  const int64_t per = (dim / 4 + kRowVec - 1) / kRowVec;
  return static_cast<int>((per + kWarp - 1) / kWarp * kWarp);
}
template <bool kAdd>
__device__ __forceinline__ void rmsnorm_row_vec(float* x, const float* y, int64_t dim,
                                                const void* w, bool w_bf16, float eps, float* out,
                                                float* red) {
  const int64_t nv = dim / 4;
  float4 v[kRowVec];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kRowVec; ++j) {
    const int64_t i = threadIdx.x + j * static_cast<int64_t>(blockDim.x);
    if (i < nv) {
      v[j] = reinterpret_cast<const float4*>(x)[i];
      if (kAdd) {
        const float4 b = reinterpret_cast<const float4*>(y)[i];
        v[j] = make_float4(v[j].x + b.x, v[j].y + b.y, v[j].z + b.z, v[j].w + b.w);
        reinterpret_cast<float4*>(x)[i] = v[j];
      }
      ss = fmaf(v[j].x, v[j].x, ss);
      ss = fmaf(v[j].y, v[j].y, ss);
      ss = fmaf(v[j].z, v[j].z, ss);
      ss = fmaf(v[j].w, v[j].w, ss);
    }
  }
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
#pragma unroll
  for (int j = 0; j < kRowVec; ++j) {
    const int64_t i = threadIdx.x + j * static_cast<int64_t>(blockDim.x);
    if (i < nv) {
      const int64_t e = 4 * i;
      float4 o;
      o.x = (v[j].x * inv) * (1.0f + load_weight(w, w_bf16, e));
      o.y = (v[j].y * inv) * (1.0f + load_weight(w, w_bf16, e + 1));
      o.z = (v[j].z * inv) * (1.0f + load_weight(w, w_bf16, e + 2));
      o.w = (v[j].w * inv) * (1.0f + load_weight(w, w_bf16, e + 3));
      reinterpret_cast<float4*>(out)[i] = o;
    }
  }
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

// Programmatic dependent launch (ops.h launch_overlap). A kernel launched by launch_pdl() may
// be resident before the kernel ahead of it in the stream has finished, so it must call
// pdl_enter() before its first read of anything an earlier kernel writes and before its first
// global write (an earlier kernel may still read that buffer), in every CTA, early returns
// included; only reads of data no kernel writes (weights) may come before. pdl_enter() then lets
// the next kernel start launching: one kernel of look-ahead, never a chain. Without the launch
// attribute both instructions return at once.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with the programmatic-serialization attribute
// when launch_overlap() (the kernel must call pdl_enter(), above); errors end the process as
// M3_CUDA_CHECK does.
template <class... P, class... A>
void launch_pdl_when(bool allow, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                     cudaStream_t stream, A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = allow && launch_overlap() ? 1 : 0;
  M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}
template <class... P, class... A>
void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                A&&... args) {
  launch_pdl_when(true, kernel, grid, block, smem, stream, std::forward<A>(args)...);
}
// The attention and MSA selection kernels' share of the overlap (ops.h launch_overlap_attention).
template <class... P, class... A>
void launch_pdl_attn(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     A&&... args) {
  launch_pdl_when(launch_overlap_attention(), kernel, grid, block, smem, stream,
                  std::forward<A>(args)...);
}

// The dynamic shared memory one block may take on this device (its opt-in limit), read once.
inline int64_t smem_optin_limit() {
  static const int64_t v = [] {
    int dev = 0, optin = 0;
    M3_CUDA_CHECK(cudaGetDevice(&dev));
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return static_cast<int64_t>(optin);
  }();
  return v;
}

// Lets `Kernel` take up to smem_optin_limit() of dynamic shared memory (set once per kernel).
template <auto Kernel>
void allow_optin_smem() {
  static const bool done = [] {
    M3_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem_optin_limit())));
    return true;
  }();
  (void)done;
}

// ---- shared memory addresses, mbarriers and bulk (TMA) copies (sm_90) ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of bulk copies to come in the barrier's phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Generic-proxy writes of shared memory ordered before later async-proxy (TMA) accesses.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned) as one bulk
// copy, completing as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                              uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

}  // namespace m3::kernels::cuda::detail
