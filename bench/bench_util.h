// Timing helpers shared by the CUDA benchmarks in bench/: mean milliseconds per call measured with
// CUDA events on one stream, a host clock, and the device copy bandwidth (the ceiling the
// bandwidth-bound figures are set against). Header-only; included by bench_*.cpp (CUDA builds).
// Invariant: two untimed warm-up calls come first, so first-use costs (plan caches, lazy
// attribute setting, pool growth) stay out of the figure.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"

namespace m3::bench {

template <class F>
double time_ms(cudaStream_t stream, int iters, F fn) {
  fn();
  fn();
  cudaEvent_t a, b;
  M3_CUDA_CHECK(cudaEventCreate(&a));
  M3_CUDA_CHECK(cudaEventCreate(&b));
  M3_CUDA_CHECK(cudaEventRecord(a, stream));
  for (int i = 0; i < iters; ++i) fn();
  M3_CUDA_CHECK(cudaEventRecord(b, stream));
  M3_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  M3_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  M3_CUDA_CHECK(cudaEventDestroy(a));
  M3_CUDA_CHECK(cudaEventDestroy(b));
  return ms / iters;
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Copy bandwidth of the current device (bytes read + written per second) over a 2 GiB buffer,
// best of five.
inline double copy_bandwidth() {
  const size_t n = size_t{1} << 31;
  gpu::DeviceBuffer<uint8_t> a(n), b(n);
  M3_CUDA_CHECK(cudaMemset(a.data(), 1, n));
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const double t0 = now_s();
    M3_CUDA_CHECK(cudaMemcpy(b.data(), a.data(), n, cudaMemcpyDeviceToDevice));
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    best = std::max(best, 2.0 * n / (now_s() - t0));
  }
  return best;
}

// Fills `bytes` bytes of device memory at dst by repeating a host block (a large buffer filled
// without generating all of it).
inline void fill_tiled_from_host(void* dst, size_t bytes, const void* block, size_t block_bytes) {
  for (size_t at = 0; at < bytes; at += block_bytes)
    M3_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(dst) + at, block,
                             std::min(block_bytes, bytes - at), cudaMemcpyHostToDevice));
}
template <class T>
void fill_repeat(gpu::DeviceBuffer<T>& b, const std::vector<T>& block) {
  fill_tiled_from_host(b.data(), b.size() * sizeof(T), block.data(), block.size() * sizeof(T));
}

}  // namespace m3::bench
