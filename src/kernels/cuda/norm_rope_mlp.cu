// Gemma RMSNorm, partial NeoX RoPE and SwiGLU-OAI: the elementwise-ish ops, one thread block per
// row (norm, rope) or a grid-stride loop (swiglu). Same fp32 formulas as kernels/cpu, term by
// term, so results differ from the CPU op only by summation order and libm ulps.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {

using detail::block_sum;
using detail::ceil_div;
using detail::load_weight;

constexpr int kNormThreads = 256;

__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_gemma_kernel(const float* x, int64_t dim, const void* __restrict__ w, bool w_bf16,
                         float eps, float* out) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  float* o = out + r * dim;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = block_sum(ss, red);  // every read of xr is done before this returns, so out may alias x
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float scale = 1.0f + load_weight(w, w_bf16, i);
    o[i] = (xr[i] * inv) * scale;
  }
}

__global__ void __launch_bounds__(detail::kRowThreadsMax)
    rmsnorm_vec_kernel(const float* x, int64_t dim, const void* __restrict__ w, bool w_bf16,
                       float eps, float* out) {
  __shared__ float red[32];
  detail::pdl_enter();
  const int64_t r = blockIdx.x;
  detail::rmsnorm_row_vec<false>(const_cast<float*>(x + r * dim), nullptr, dim, w, w_bf16, eps,
                                 out + r * dim, red);
}

// inv_freq travels by value in the launch parameters (computed on the host like the CPU op).
struct RopeFreqs {
  float inv_freq[kMaxRopeHalf];
};

__global__ void rope_neox_kernel(float* x, int64_t num_heads, int64_t head_dim, int64_t half,
                                 const int32_t* __restrict__ positions, const RopeFreqs freqs) {
  __shared__ float c[kMaxRopeHalf], s[kMaxRopeHalf];
  const int64_t t = blockIdx.x;
  const float p = static_cast<float>(positions[t]);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = p * freqs.inv_freq[i];
    c[i] = cosf(a);
    s[i] = sinf(a);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < num_heads * half; e += blockDim.x) {
    const int64_t h = e / half, i = e % half;
    float* v = x + (t * num_heads + h) * head_dim;
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c[i] - x2 * s[i];
    v[i + half] = x2 * c[i] + x1 * s[i];
  }
}

__global__ void swiglu_oai_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                  int64_t total, float alpha, float limit, float beta,
                                  float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const float g = gate[i], u = up[i];
    const float gc = limit < g ? limit : g;                          // std::min(g, limit)
    const float uc = u < -limit ? -limit : (limit < u ? limit : u);  // std::clamp
    const float glu = gc * (1.0f / (1.0f + expf(-alpha * gc)));
    out[i] = (uc + beta) * glu;
  }
}

}  // namespace

void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                   float* out, cudaStream_t stream) {
  M3_CHECK(w.n == dim, "cuda::rmsnorm: weight has %lld entries, dim %lld", (long long)w.n,
           (long long)dim);
  M3_CHECK(w.dtype == DType::kBF16 || w.dtype == DType::kF32, "cuda::rmsnorm: weight dtype %s",
           dtype_name(w.dtype));
  if (rows == 0) return;
  M3_CHECK(rows <= 0x7fffffff);
  if (detail::norm_row_fits(dim, x, out, x)) {
    detail::launch_pdl(rmsnorm_vec_kernel, dim3(static_cast<unsigned>(rows)),
                       dim3(detail::norm_row_threads(dim)), 0, stream, x, dim, w.data,
                       w.dtype == DType::kBF16, eps, out);
    return;
  }
  rmsnorm_gemma_kernel<<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(
      x, dim, w.data, w.dtype == DType::kBF16, eps, out);
  M3_CUDA_CHECK_LAUNCH("rmsnorm_gemma_kernel");
}

void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta, cudaStream_t stream) {
  M3_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim);
  M3_CHECK(rot_dim / 2 <= kMaxRopeHalf, "cuda::rope: rot_dim %lld", (long long)rot_dim);
  if (rot_dim == 0 || n == 0) return;
  M3_CHECK(n <= 0x7fffffff);
  const int64_t half = rot_dim / 2;
  // Exactly the CPU op's fp32 formula (same host libm), so angles match bit for bit.
  RopeFreqs freqs{};
  for (int64_t i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    freqs.inv_freq[i] = 1.0f / std::pow(static_cast<float>(theta), e);
  }
  rope_neox_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(x, num_heads, head_dim, half,
                                                                 positions, freqs);
  M3_CUDA_CHECK_LAUNCH("rope_neox_kernel");
}

void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                float limit, float beta, float* out, cudaStream_t stream) {
  const int64_t total = n * inter;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(total, 256), 132 * 32);
  swiglu_oai_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(gate, up, total, alpha,
                                                                       limit, beta, out);
  M3_CUDA_CHECK_LAUNCH("swiglu_oai_kernel");
}

}  // namespace m3::kernels::cuda
