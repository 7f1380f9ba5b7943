// CUDA error checks for the GPU backend. A CUDA fault after start-up ends the process naming the
// call or kernel (design.md §4: no CUDA error is swallowed). Included only by CUDA-enabled code.
#pragma once

#include <cuda_runtime.h>

namespace m3::gpu {
[[noreturn]] void cuda_fail(cudaError_t err, const char* what, const char* file, int line);
}  // namespace m3::gpu

#define M3_CUDA_CHECK(expr)                                                               \
  do {                                                                                    \
    cudaError_t m3_err_ = (expr);                                                         \
    if (m3_err_ != cudaSuccess) ::m3::gpu::cuda_fail(m3_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: checks the launch and names the kernel.
#define M3_CUDA_CHECK_LAUNCH(kernel_name)                                                       \
  do {                                                                                          \
    cudaError_t m3_err_ = cudaGetLastError();                                                   \
    if (m3_err_ != cudaSuccess) ::m3::gpu::cuda_fail(m3_err_, kernel_name, __FILE__, __LINE__); \
  } while (0)
