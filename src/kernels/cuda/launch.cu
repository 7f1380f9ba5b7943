// The process-wide switch of programmatic dependent launch (ops.h launch_overlap, common.cuh
// launch_pdl / pdl_enter).
#include <atomic>

#include "core/env.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

namespace {
// -1: not decided yet; 0 off; 1 on.
std::atomic<int> g_overlap{-1};

int decide() {
  if (!env_switch("M3_PDL", true)) return 0;
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();  // no device: nothing launches anyway
    return 0;
  }
  return major >= 9 ? 1 : 0;
}
}  // namespace

bool launch_overlap() {
  int v = g_overlap.load(std::memory_order_relaxed);
  if (v < 0) {
    int expected = -1;
    g_overlap.compare_exchange_strong(expected, decide());
    v = g_overlap.load(std::memory_order_relaxed);
  }
  return v == 1;
}

bool launch_overlap_attention() {
  static const bool on = env_switch("M3_PDL_ATTN", false);
  return on;
}

void set_launch_overlap(bool on) {
  g_overlap.store(on ? 1 : 0, std::memory_order_relaxed);
}

}  // namespace m3::kernels::cuda
