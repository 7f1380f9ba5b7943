// Timing helper shared by the CUDA benchmarks in bench/: mean milliseconds per call measured with
// CUDA events on one stream. Header-only; included by bench_*.cpp (CUDA builds only).
// Invariant: two untimed warm-up calls come first, so first-use costs (plan caches, lazy
// attribute setting, pool growth) stay out of the figure.
#pragma once

#include <cuda_runtime.h>

#include "gpu/cuda_check.h"

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

}  // namespace m3::bench
