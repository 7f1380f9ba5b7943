// gather_rows, scatter_rows, add_inplace, copy_rows_2d, fill_zero and copy (kernels/cuda/ops.h).
// Grid-stride loops over the elements; __fadd_rn keeps the CPU op's rounding (nvcc would otherwise
// contract adds).
#include "kernels/cuda/ops.h"

#include <algorithm>

#include "core/check.h"
#include "gpu/cuda_check.h"

namespace m3::kernels::cuda {

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

__global__ void scatter_rows_kernel(float* __restrict__ dst, const int32_t* __restrict__ rows,
                                    int64_t n, int64_t cols, const float* __restrict__ values) {
  const int64_t total = n * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    dst[static_cast<int64_t>(rows[i]) * cols + c] = values[e];
  }
}

__global__ void add_inplace_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[e] = __fadd_rn(x[e], y[e]);
}

}  // namespace

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst,
                 cudaStream_t stream) {
  if (n == 0 || cols == 0) return;
  gather_rows_kernel<<<blocks_for(n * cols), kThreads, 0, stream>>>(src, rows, n, cols, dst);
  M3_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

void scatter_rows(float* dst, const int32_t* rows, int64_t n, int64_t cols, const float* values,
                  cudaStream_t stream) {
  if (n == 0 || cols == 0) return;
  scatter_rows_kernel<<<blocks_for(n * cols), kThreads, 0, stream>>>(dst, rows, n, cols, values);
  M3_CUDA_CHECK_LAUNCH("scatter_rows_kernel");
}

void add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_inplace_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, y, n);
  M3_CUDA_CHECK_LAUNCH("add_inplace_kernel");
}

void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                  int64_t width, int64_t rows, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  M3_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride * sizeof(float), src, src_stride * sizeof(float),
                                  width * sizeof(float), rows, cudaMemcpyDeviceToDevice, stream));
}

void fill_zero(float* x, int64_t n, cudaStream_t stream) {
  if (n > 0) M3_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(float), stream));
}

void copy(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
}

}  // namespace m3::kernels::cuda
