// The vision tower's CUDA ops (kernels/cuda/vision.h): LayerNorm (one block per row), bias add
// and GELU (grid-stride loops), rotary from cos/sin tables (one block per token), and the
// segment attention as batched cuBLASLt GEMMs around a softmax kernel. Same fp32 formulas as
// kernels/cpu/vision.cpp term by term, so results differ from the CPU op by summation order,
// the statistics' precision (fp32 here, double there) and libm ulps; and, under the bf16 GEMM
// precision, by the bf16 rounding of the attention's operands.
#include "kernels/cuda/vision.h"

#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::block_sum;
using detail::load_weight;

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535));
}

__global__ void __launch_bounds__(kThreads)
    layer_norm_kernel(const float* x, int64_t dim, const void* __restrict__ w, bool w_bf16,
                      const void* __restrict__ b, bool b_bf16, float eps, float* out) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  float* o = out + r * dim;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
  const float mean = block_sum(s, red) / static_cast<float>(dim);
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float d = xr[i] - mean;
    ss = fmaf(d, d, ss);
  }
  // Every read of xr is done before block_sum returns, so out may alias x.
  const float var = block_sum(ss, red) / static_cast<float>(dim);
  const float inv = 1.0f / sqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    o[i] = (xr[i] - mean) * inv * load_weight(w, w_bf16, i) + load_weight(b, b_bf16, i);
}

__global__ void add_bias_rows_kernel(float* __restrict__ y, int64_t total, int64_t cols,
                                     const void* __restrict__ bias, bool bf16) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = __fadd_rn(y[e], load_weight(bias, bf16, e % cols));
}

__global__ void gelu_erf_kernel(float* __restrict__ x, int64_t n) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[e];
    x[e] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}

__global__ void rope_cos_sin_kernel(float* x, int64_t num_heads, int64_t head_dim, int64_t half,
                                    const float* __restrict__ cos, const float* __restrict__ sin) {
  const int64_t t = blockIdx.x, rot = 2 * half;
  const float* c = cos + t * rot;
  const float* s = sin + t * rot;
  for (int64_t e = threadIdx.x; e < num_heads * half; e += blockDim.x) {
    const int64_t h = e / half, i = e % half;
    float* v = x + (t * num_heads + h) * head_dim;
    const float x1 = v[i], x2 = v[i + half];
    v[i] = __fsub_rn(__fmul_rn(x1, c[i]), __fmul_rn(x2, s[i]));
    v[i + half] = __fadd_rn(__fmul_rn(x2, c[i + half]), __fmul_rn(x1, s[i + half]));
  }
}

// rows x cols f32 -> bf16 for q, k, v at once (rows of width `cols`).
__global__ void to_bf16_kernel(const float* __restrict__ a, const float* __restrict__ b,
                               const float* __restrict__ c, int64_t n,
                               __nv_bfloat16* __restrict__ ab, __nv_bfloat16* __restrict__ bb,
                               __nv_bfloat16* __restrict__ cb) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ab[e] = __float2bfloat16_rn(a[e]);
    bb[e] = __float2bfloat16_rn(b[e]);
    cb[e] = __float2bfloat16_rn(c[e]);
  }
}

// One block per score row of `len` keys: p = exp(s * scale - max) / sum, as the CPU op; written
// in place (f32) or to pb (bf16). Three passes over the row (it stays in L1/L2): a variant
// holding the row in registers (one read, one write) measured slower on the H200, 0.61 against
// 0.50 ms per layer at 2304 keys x 16 heads (bench_vision), so it was not kept.
__global__ void __launch_bounds__(kThreads)
    softmax_rows_kernel(float* s, int64_t len, float scale, __nv_bfloat16* pb) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  float* row = s + r * len;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) mx = fmaxf(mx, row[j] * scale);
  // block max through the sum helper's layout: warp max, then across warps.
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  if (warp == 0) {
    float t = lane < static_cast<int>(blockDim.x / 32) ? red[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    if (lane == 0) red[0] = t;
  }
  __syncthreads();
  mx = red[0];
  __syncthreads();
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    const float e = expf(row[j] * scale - mx);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, red);  // divided by below, as the CPU op does (p / sum)
  if (pb != nullptr) {
    __nv_bfloat16* prow = pb + r * len;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
      prow[j] = __float2bfloat16_rn(row[j] / sum);
  } else {
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) row[j] = row[j] / sum;
  }
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

// Bytes per score element: f32 scores (+ bf16 probabilities under kBf16).
size_t score_bytes(bool bf16) {
  return bf16 ? sizeof(float) + sizeof(__nv_bfloat16) : sizeof(float);
}

// The bf16 copies of q, k and v (kBf16 only).
size_t convert_bytes(int64_t n, int64_t width, bool bf16) {
  return bf16 ? 3 * align256(static_cast<size_t>(n * width) * sizeof(__nv_bfloat16)) : 0;
}

}  // namespace

void layer_norm(const float* x, int64_t rows, int64_t dim, const VecRef& w, const VecRef& b,
                float eps, float* out, cudaStream_t stream) {
  M3_CHECK(w.n == dim && b.n == dim, "cuda::layer_norm: weight %lld / bias %lld for dim %lld",
           static_cast<long long>(w.n), static_cast<long long>(b.n), static_cast<long long>(dim));
  M3_CHECK((w.dtype == DType::kBF16 || w.dtype == DType::kF32) &&
               (b.dtype == DType::kBF16 || b.dtype == DType::kF32),
           "cuda::layer_norm: weight dtype %s, bias %s", dtype_name(w.dtype), dtype_name(b.dtype));
  if (rows == 0) return;
  M3_CHECK(rows <= 0x7fffffff);
  layer_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      x, dim, w.data, w.dtype == DType::kBF16, b.data, b.dtype == DType::kBF16, eps, out);
  M3_CUDA_CHECK_LAUNCH("layer_norm_kernel");
}

void add_bias_rows(float* y, int64_t rows, const VecRef& bias, cudaStream_t stream) {
  const int64_t total = rows * bias.n;
  if (total == 0) return;
  M3_CHECK(bias.dtype == DType::kBF16 || bias.dtype == DType::kF32,
           "cuda::add_bias_rows: bias dtype %s", dtype_name(bias.dtype));
  add_bias_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(y, total, bias.n, bias.data,
                                                                 bias.dtype == DType::kBF16);
  M3_CUDA_CHECK_LAUNCH("add_bias_rows_kernel");
}

void gelu_erf(float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_erf_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n);
  M3_CUDA_CHECK_LAUNCH("gelu_erf_kernel");
}

void rope_cos_sin(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
                  const float* cos, const float* sin, cudaStream_t stream) {
  M3_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim,
           "cuda::rope_cos_sin: rot_dim %lld of head_dim %lld", static_cast<long long>(rot_dim),
           static_cast<long long>(head_dim));
  if (n == 0 || rot_dim == 0) return;
  M3_CHECK(n <= 0x7fffffff);
  rope_cos_sin_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, num_heads, head_dim,
                                                                         rot_dim / 2, cos, sin);
  M3_CUDA_CHECK_LAUNCH("rope_cos_sin_kernel");
}

size_t attention_segments_workspace_bytes(int64_t n, int64_t num_heads, int64_t head_dim,
                                          int64_t chunk_rows, int64_t max_seg_len) {
  const bool bf16 = gemm_precision() == GemmPrecision::kBf16;
  return convert_bytes(n, num_heads * head_dim, bf16) +
         static_cast<size_t>(num_heads * chunk_rows * max_seg_len) * score_bytes(bf16);
}

void attention_segments(const float* q, const float* k, const float* v, int64_t n,
                        int64_t num_heads, int64_t head_dim, const int64_t* seg_starts,
                        int64_t num_segments, float scale, Workspace ws, float* out,
                        cudaStream_t stream) {
  M3_CHECK(num_segments >= 1 && seg_starts[0] == 0 && seg_starts[num_segments] == n,
           "cuda::attention_segments: segments do not cover the %lld tokens",
           static_cast<long long>(n));
  if (n == 0) return;
  const bool bf16 = gemm_precision() == GemmPrecision::kBf16;
  const int64_t width = num_heads * head_dim;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_segments; ++s)
    longest = std::max(longest, seg_starts[s + 1] - seg_starts[s]);
  const size_t conv = convert_bytes(n, width, bf16);
  const size_t per_row = static_cast<size_t>(num_heads * longest) * score_bytes(bf16);
  M3_CHECK(ws.data != nullptr && ws.bytes >= conv + per_row,
           "cuda::attention_segments: workspace of %zu bytes, needs at least %zu", ws.bytes,
           conv + per_row);
  auto* base = static_cast<uint8_t*>(ws.data);
  const void *qa = q, *ka = k, *va = v;
  if (bf16) {
    const size_t one = conv / 3;
    auto* qb = reinterpret_cast<__nv_bfloat16*>(base);
    auto* kb = reinterpret_cast<__nv_bfloat16*>(base + one);
    auto* vb = reinterpret_cast<__nv_bfloat16*>(base + 2 * one);
    to_bf16_kernel<<<grid_for(n * width), kThreads, 0, stream>>>(q, k, v, n * width, qb, kb, vb);
    M3_CUDA_CHECK_LAUNCH("to_bf16_kernel");
    qa = qb;
    ka = kb;
    va = vb;
  }
  const size_t el = bf16 ? sizeof(__nv_bfloat16) : sizeof(float);
  auto* scores = reinterpret_cast<float*>(base + conv);
  const int64_t max_rows = static_cast<int64_t>((ws.bytes - conv) / per_row);
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t j0 = seg_starts[s], len = seg_starts[s + 1] - j0;
    if (len == 0) continue;
    const int64_t chunk = std::min(len, max_rows);
    for (int64_t r0 = 0; r0 < len; r0 += chunk) {
      const int64_t rows = std::min(chunk, len - r0);
      // Column-major Sᵀ_h [len, rows] (= row-major S_h [rows, len]) = op(A) · B with A = K_h
      // stored [head_dim, len] (ld = width) transposed and B = Q_h stored [head_dim, rows].
      blas::BatchedGemm g1;
      g1.trans_a = true;
      g1.m = len;
      g1.n = rows;
      g1.k = head_dim;
      g1.lda = width;
      g1.ldb = width;
      g1.ldc = len;
      g1.stride_a = head_dim;
      g1.stride_b = head_dim;
      g1.stride_c = rows * len;
      g1.batch = num_heads;
      g1.bf16 = bf16;
      const auto* ka_s = static_cast<const uint8_t*>(ka) + static_cast<size_t>(j0 * width) * el;
      const auto* qa_s =
          static_cast<const uint8_t*>(qa) + static_cast<size_t>((j0 + r0) * width) * el;
      M3_CHECK(blas::gemm_strided_batched(g1, ka_s, qa_s, scores, stream),
               "cuda::attention_segments: cuBLASLt has no algorithm for the scores GEMM "
               "(%lld keys, %lld rows, head_dim %lld)",
               static_cast<long long>(len), static_cast<long long>(rows),
               static_cast<long long>(head_dim));
      __nv_bfloat16* probs = bf16 ? reinterpret_cast<__nv_bfloat16*>(
                                        reinterpret_cast<uint8_t*>(scores) +
                                        static_cast<size_t>(num_heads * rows * len) * sizeof(float))
                                  : nullptr;
      const int64_t nrows = num_heads * rows;
      M3_CHECK(nrows <= 0x7fffffff);
      softmax_rows_kernel<<<static_cast<unsigned>(nrows), kThreads, 0, stream>>>(scores, len, scale,
                                                                                 probs);
      M3_CUDA_CHECK_LAUNCH("softmax_rows_kernel");
      // Column-major O_hᵀ [head_dim, rows] (ld = width) = V_h stored [head_dim, len] · Pᵀ
      // stored [len, rows] (ld = len).
      blas::BatchedGemm g2;
      g2.m = head_dim;
      g2.n = rows;
      g2.k = len;
      g2.lda = width;
      g2.ldb = len;
      g2.ldc = width;
      g2.stride_a = head_dim;
      g2.stride_b = rows * len;
      g2.stride_c = head_dim;
      g2.batch = num_heads;
      g2.bf16 = bf16;
      const auto* va_s = static_cast<const uint8_t*>(va) + static_cast<size_t>(j0 * width) * el;
      const void* pa = bf16 ? static_cast<const void*>(probs) : static_cast<const void*>(scores);
      M3_CHECK(blas::gemm_strided_batched(g2, va_s, pa, out + (j0 + r0) * width, stream),
               "cuda::attention_segments: cuBLASLt has no algorithm for the P.V GEMM "
               "(%lld keys, %lld rows, head_dim %lld)",
               static_cast<long long>(len), static_cast<long long>(rows),
               static_cast<long long>(head_dim));
    }
  }
}

}  // namespace m3::kernels::cuda
