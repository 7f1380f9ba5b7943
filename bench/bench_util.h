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
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"
#include "kernels/views.h"

namespace m3::bench {

// One M3 sparse-attention layer at TP1 (the MSA benches): 128-token pages = MSA blocks, 64 q / 4
// KV heads x 128, index 4 x 128 over one shared index-K head, top-16.
namespace msa {
inline constexpr int64_t kPage = 128, kKvHeads = 4, kHeads = 64, kDim = 128, kIndexHeads = 4,
                         kIndexDim = 128, kTopk = 16;
}  // namespace msa

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

// Times fn captured once into a CUDA graph (one launch per decode step, as the engine runs it).
template <class F>
double graph_ms(cudaStream_t s, int iters, F fn) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  M3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  fn();
  M3_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  M3_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = time_ms(s, iters, [&] { M3_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  M3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  M3_CUDA_CHECK(cudaGraphDestroy(graph));
  return ms;
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

// argv[i] as a comma-separated list of integers (e.g. "8192,32768"), else `fallback`.
inline std::vector<int64_t> int_list_arg(int argc, char** argv, int i,
                                         std::vector<int64_t> fallback) {
  if (argc <= i) return fallback;
  std::vector<int64_t> out;
  std::stringstream ss(argv[i]);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

// `bytes` bytes of N(0, 1) draws stored as KV elements of `dt` (fp8: divided by `scale` first):
// the block a bench tiles over a cache.
inline std::vector<uint8_t> normal_kv_bytes(kernels::KvDtype dt, float scale, size_t bytes,
                                            std::mt19937& g) {
  const size_t es = static_cast<size_t>(kernels::kv_dtype_size(dt)), n = bytes / es;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint8_t> h(n * es);
  for (size_t i = 0; i < n; ++i) {
    const float x = nd(g);
    if (dt == kernels::KvDtype::kF32) {
      std::memcpy(h.data() + 4 * i, &x, 4);
    } else if (dt == kernels::KvDtype::kBf16) {
      const uint16_t b = f32_to_bf16(x);
      std::memcpy(h.data() + 2 * i, &b, 2);
    } else {
      h[i] = f32_to_fp8_e4m3(x / scale);
    }
  }
  return h;
}

}  // namespace m3::bench
