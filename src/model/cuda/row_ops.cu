// Row gather/scatter and residual adds (see row_ops.h). Grid-stride loops over the elements;
// __fmul_rn / __fadd_rn keep the CPU forward's separate multiply and add roundings (nvcc would
// otherwise contract them into an fma).
#include "model/cuda/row_ops.h"

#include <algorithm>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::model {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  // Grid-stride loops cover the rest; 65535 * 256 elements per pass is plenty.
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535));
}

__global__ void gather_rows_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                                   int64_t n, int64_t cols, float* __restrict__ dst) {
  const int64_t total = n * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    dst[e] = src[static_cast<int64_t>(rows[i]) * cols + c];
  }
}

__global__ void scatter_add_rows_kernel(const float* __restrict__ src,
                                        const int32_t* __restrict__ rows,
                                        const float* __restrict__ weights, int64_t n,
                                        int64_t cols, float* __restrict__ dst) {
  const int64_t total = n * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    float* d = dst + static_cast<int64_t>(rows[i]) * cols + c;
    *d = __fadd_rn(*d, __fmul_rn(weights[i], src[e]));
  }
}

__global__ void add_inplace_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[e] = __fadd_rn(x[e], y[e]);
}

}  // namespace

void cuda_gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst,
                      cudaStream_t stream) {
  if (n == 0 || cols == 0) return;
  gather_rows_kernel<<<blocks_for(n * cols), kThreads, 0, stream>>>(src, rows, n, cols, dst);
  M3_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

void cuda_scatter_add_rows(const float* src, const int32_t* rows, const float* weights, int64_t n,
                           int64_t cols, float* dst, cudaStream_t stream) {
  if (n == 0 || cols == 0) return;
  scatter_add_rows_kernel<<<blocks_for(n * cols), kThreads, 0, stream>>>(src, rows, weights, n,
                                                                         cols, dst);
  M3_CUDA_CHECK_LAUNCH("scatter_add_rows_kernel");
}

void cuda_add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_inplace_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, y, n);
  M3_CUDA_CHECK_LAUNCH("add_inplace_kernel");
}

}  // namespace m3::model
