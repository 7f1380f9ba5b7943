// Synthetic weight generation and the device checksum (see synthetic_weights.h). The generator
// is splitmix64 over a counter: cheap, stateless per element, and good enough that weight
// statistics (mean 0, std bound/sqrt(3)) hold for every tensor size we draw.
#include "model/cuda/synthetic_weights.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::model {

namespace {

constexpr int kThreads = 256;

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A per-tensor key, so tensors of one seed draw independent streams.
__host__ __device__ __forceinline__ uint64_t tensor_key(uint64_t seed, uint64_t tensor_id) {
  return splitmix64(splitmix64(seed) ^ (tensor_id * 0xd1342543de82ef95ULL));
}

// Uniform in [-1, 1) from the top 24 bits (exact in f32).
__device__ __forceinline__ float uniform_pm1(uint64_t key, uint64_t i) {
  const uint64_t r = splitmix64(key ^ (i * 0x9e3779b97f4a7c15ULL));
  return static_cast<float>(r >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

unsigned blocks_for(size_t n) {
  // Grid-stride loops: enough blocks to fill an H200 several times over.
  return static_cast<unsigned>(std::clamp<size_t>((n + kThreads - 1) / kThreads, 1, 132 * 64));
}

__global__ void fill_bf16_kernel(uint16_t* __restrict__ dst, size_t n, float bound, uint64_t key) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const __nv_bfloat16 b = __float2bfloat16_rn(uniform_pm1(key, i) * bound);
    dst[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

__global__ void fill_bf16_block_kernel(uint16_t* __restrict__ dst, FillBlock b, float bound,
                                       uint64_t key) {
  const size_t n = static_cast<size_t>(b.outer_count) * b.row_count * b.col_count;
  const uint64_t rc = static_cast<uint64_t>(b.row_count), cc = static_cast<uint64_t>(b.col_count);
  for (size_t l = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; l < n;
       l += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t j = l % cc, i = (l / cc) % rc, a = l / (cc * rc);
    const uint64_t g = ((b.outer_begin + a) * static_cast<uint64_t>(b.rows) + b.row_begin + i) *
                           static_cast<uint64_t>(b.cols) +
                       b.col_begin + j;
    const __nv_bfloat16 v = __float2bfloat16_rn(uniform_pm1(key, g) * bound);
    dst[l] = *reinterpret_cast<const uint16_t*>(&v);
  }
}

__global__ void fill_f32_kernel(float* __restrict__ dst, size_t n, float bound, uint64_t key) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = uniform_pm1(key, i) * bound;
  }
}

__global__ void checksum_kernel(const uint8_t* __restrict__ p, size_t bytes,
                                unsigned long long* out) {
  const size_t words = (bytes + 7) / 8;
  uint64_t acc = 0;
  for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < words;
       w += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t v = 0;
    const size_t base = w * 8;
    if (base + 8 <= bytes && (reinterpret_cast<uintptr_t>(p) % 8) == 0) {
      v = reinterpret_cast<const uint64_t*>(p)[w];
    } else {
      for (size_t b = 0; b < 8 && base + b < bytes; ++b)
        v |= static_cast<uint64_t>(p[base + b]) << (8 * b);
    }
    acc += splitmix64(v ^ splitmix64(w));
  }
  // Sum of 64-bit values modulo 2^64: order-independent, so any reduction order agrees.
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
}

}  // namespace

void fill_uniform_bf16(uint16_t* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                       cudaStream_t stream) {
  if (n == 0) return;
  M3_CHECK(dst != nullptr && bound >= 0.f);
  fill_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, n, bound,
                                                           tensor_key(seed, tensor_id));
  M3_CUDA_CHECK(cudaGetLastError());
}

void fill_uniform_bf16_block(uint16_t* dst, const FillBlock& b, float bound, uint64_t seed,
                             uint64_t tensor_id, cudaStream_t stream) {
  M3_CHECK(b.outer_begin >= 0 && b.outer_count >= 0 && b.outer_begin + b.outer_count <= b.outer &&
               b.row_begin >= 0 && b.row_count >= 0 && b.row_begin + b.row_count <= b.rows &&
               b.col_begin >= 0 && b.col_count >= 0 && b.col_begin + b.col_count <= b.cols,
           "fill block outside its tensor");
  const size_t n = b.size();
  if (n == 0) return;
  M3_CHECK(dst != nullptr && bound >= 0.f);
  fill_bf16_block_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, b, bound,
                                                                 tensor_key(seed, tensor_id));
  M3_CUDA_CHECK(cudaGetLastError());
}

void fill_uniform_f32(float* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                      cudaStream_t stream) {
  if (n == 0) return;
  M3_CHECK(dst != nullptr && bound >= 0.f);
  fill_f32_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, n, bound,
                                                          tensor_key(seed, tensor_id));
  M3_CUDA_CHECK(cudaGetLastError());
}

namespace {

using kernels::WeightQuant;

__device__ __forceinline__ float bf16_at(const uint16_t* src, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}
__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float from_e4m3(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}
// E2M1 code of v (nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6; saturating), sign in bit 3.
__device__ __forceinline__ uint32_t to_e2m1(float v) {
  const float m = fabsf(v);
  const uint32_t c = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) +
                     (m >= 3.5f) + (m > 5.f);
  return c | (v < 0.f && c != 0 ? 8u : 0u);
}
// E8M0 exponent byte of the smallest power of two s with amax / s <= emax (127: a zero block).
__device__ __forceinline__ uint8_t e8m0_for(float amax, float emax) {
  if (!(amax > 0.f)) return 127;
  const int e = static_cast<int>(ceilf(log2f(amax / emax)));
  return static_cast<uint8_t>(min(254, max(0, e + 127)));
}

// One CTA per row; each thread quantizes whole blocks (per channel: the row's amax first).
__global__ void quantize_rows_kernel(const uint16_t* __restrict__ src, int64_t cols, WeightQuant q,
                                     float global, int64_t row_bytes, int64_t scale_row_bytes,
                                     uint8_t* __restrict__ data, uint8_t* __restrict__ scale) {
  const int64_t r = blockIdx.x;
  const uint16_t* x = src + r * cols;
  uint8_t* d = data + r * row_bytes;
  uint8_t* sc = scale + r * scale_row_bytes;
  if (q == WeightQuant::kFp8Channel) {
    __shared__ float red[kThreads / 32];
    float amax = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      amax = fmaxf(amax, fabsf(bf16_at(x, c)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, red[w]);
    const float s = amax > 0.f ? amax / 448.f : 1.f;
    if (threadIdx.x == 0) reinterpret_cast<float*>(sc)[0] = s;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) d[c] = to_e4m3(bf16_at(x, c) / s);
    return;
  }
  const int64_t bs = q == WeightQuant::kNvfp4 ? 16 : 32;
  const int64_t nb = (cols + bs - 1) / bs;
  for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
    const int64_t c0 = b * bs, c1 = min(cols, c0 + bs);
    float amax = 0.f;
    for (int64_t c = c0; c < c1; ++c) amax = fmaxf(amax, fabsf(bf16_at(x, c)));
    float inv;
    if (q == WeightQuant::kNvfp4) {
      const uint8_t s8 = to_e4m3(amax / 6.f / global);
      sc[b] = s8;
      const float s = from_e4m3(s8) * global;
      inv = s > 0.f ? 1.f / s : 0.f;
    } else {
      const uint8_t e = e8m0_for(amax, q == WeightQuant::kMxfp8 ? 448.f : 6.f);
      sc[b] = e;
      inv = exp2f(127.f - static_cast<float>(e));
    }
    if (q == WeightQuant::kMxfp8) {
      for (int64_t c = c0; c < c1; ++c) d[c] = to_e4m3(bf16_at(x, c) * inv);
    } else {
      for (int64_t c = c0; c < c1; c += 2) {
        const uint32_t lo = to_e2m1(bf16_at(x, c) * inv);
        const uint32_t hi = c + 1 < c1 ? to_e2m1(bf16_at(x, c + 1) * inv) : 0u;
        d[c / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

}  // namespace

void quantize_bf16_rows(const uint16_t* src, int64_t rows, int64_t cols, WeightQuant format,
                        float global_scale, uint8_t* data, uint8_t* scale, cudaStream_t stream) {
  M3_CHECK(format != WeightQuant::kNone, "quantize_bf16_rows: no format");
  M3_CHECK(rows <= 0x7fffffff, "quantize_bf16_rows: %lld rows", static_cast<long long>(rows));
  if (rows == 0 || cols == 0) return;
  kernels::MatRef m;
  m.quant = format;
  m.dtype = kernels::weight_quant_is_4bit(format) ? DType::kU8 : DType::kF8E4M3;
  m.rows = rows;
  m.cols = cols;
  quantize_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      src, cols, format, global_scale, m.row_bytes(), m.scale_row_bytes(), data, scale);
  M3_CUDA_CHECK(cudaGetLastError());
}

uint64_t device_checksum(const void* p, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return 0;
  unsigned long long* d = nullptr;
  M3_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof *d, stream));
  M3_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof *d, stream));
  checksum_kernel<<<blocks_for((bytes + 7) / 8), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(p), bytes, d);
  M3_CUDA_CHECK(cudaGetLastError());
  unsigned long long h = 0;
  M3_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, stream));
  M3_CUDA_CHECK(cudaFreeAsync(d, stream));
  M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<uint64_t>(h);
}

}  // namespace m3::model
