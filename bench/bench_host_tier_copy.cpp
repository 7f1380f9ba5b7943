// The GPU host KV tier's copies (runtime/cuda/host_kv_tier_cuda.h) at M3's KV shapes: a prefix of
// `tokens` tokens (synthetic:layers=N's config, default 4 layers and 32K tokens) offloaded to
// pinned host memory and restored, as one run of consecutive pages and slots (one copy per array)
// and scattered (slots in a random order: one copy per page per array), against the pinned-memory
// ceiling of the same run: one cudaMemcpyAsync of the same byte count each way between a pinned
// host buffer and device memory. Prints GB/s (1e9 bytes/s) of each.
// Usage: bench_host_tier_copy [tokens=32768] [layers=4] [bfloat16|fp8|float32 KV] [iters=5]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/synthetic_model.h"
#include "runtime/cuda/host_kv_tier_cuda.h"

namespace {

using m3::bench::now_s;
using m3::runtime::HostKvTierCuda;
using m3::runtime::HostPageCopy;

m3::kernels::KvDtype parse_dtype(const std::string& s) {
  if (s == "fp8") return m3::kernels::KvDtype::kFp8;
  if (s == "float32") return m3::kernels::KvDtype::kF32;
  return m3::kernels::KvDtype::kBf16;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int64_t layers = argc > 2 ? std::atoll(argv[2]) : 4;
  const std::string kvs = argc > 3 ? argv[3] : "bfloat16";
  const int iters = argc > 4 ? std::atoi(argv[4]) : 5;
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "no usable GPU: %s\n", dev.error().message.c_str());
    return 1;
  }
  m3::model::M3Config cfg = m3::model::synthetic_m3_config(layers);
  cfg.kv_cache_dtype = parse_dtype(kvs);
  cfg.index_cache_dtype = cfg.kv_cache_dtype;
  const int64_t pages = (tokens + cfg.sparse_block_size - 1) / cfg.sparse_block_size;
  m3::model::KvCacheCuda cache(cfg, pages);
  auto tier = HostKvTierCuda::create(cache, pages);
  if (!tier) {
    std::fprintf(stderr, "%s\n", tier.error().message.c_str());
    return 1;
  }
  const double bytes = static_cast<double>(pages) * static_cast<double>((*tier)->page_bytes());
  m3::gpu::Stream compute;
  std::vector<HostPageCopy> run(pages), scattered(pages);
  std::vector<int32_t> perm(static_cast<size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  for (int64_t p = 0; p < pages; ++p) {
    run[p] = {static_cast<int32_t>(p), static_cast<int32_t>(p)};
    scattered[p] = {static_cast<int32_t>(p), perm[static_cast<size_t>(p)]};
  }
  auto gbs = [&](auto fn) {
    fn();
    (*tier)->synchronize();
    const double t0 = now_s();
    for (int i = 0; i < iters; ++i) fn();
    (*tier)->synchronize();
    return bytes * iters / (now_s() - t0) / 1e9;
  };
  int64_t copies_run = 0, copies_scat = 0;
  const double off_run = gbs([&] { (*tier)->enqueue(run, {}, compute.get()); });
  const double res_run = gbs([&] {
    (*tier)->enqueue({}, run, compute.get());
    copies_run = (*tier)->last_num_copies();
  });
  const double off_scat = gbs([&] { (*tier)->enqueue(scattered, {}, compute.get()); });
  const double res_scat = gbs([&] {
    (*tier)->enqueue({}, scattered, compute.get());
    copies_scat = (*tier)->last_num_copies();
  });
  // The ceiling: one copy of the same bytes between pinned host memory and the device.
  void* host = nullptr;
  M3_CUDA_CHECK(cudaHostAlloc(&host, static_cast<size_t>(bytes), cudaHostAllocPortable));
  m3::gpu::DeviceBuffer<uint8_t> d(static_cast<size_t>(bytes));
  m3::gpu::Stream s;
  auto raw = [&](cudaMemcpyKind kind) {
    void* dst = kind == cudaMemcpyHostToDevice ? static_cast<void*>(d.data()) : host;
    const void* src = kind == cudaMemcpyHostToDevice ? host : static_cast<const void*>(d.data());
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, s.get()));
    s.synchronize();
    const double t0 = now_s();
    for (int i = 0; i < iters; ++i)
      M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, s.get()));
    s.synchronize();
    return bytes * iters / (now_s() - t0) / 1e9;
  };
  const double ceil_h2d = raw(cudaMemcpyHostToDevice), ceil_d2h = raw(cudaMemcpyDeviceToHost);
  M3_CUDA_CHECK(cudaFreeHost(host));
  std::printf(
      "%s: %lld-token prefix of synthetic:layers=%lld, %s KV: %lld pages x %lld B = %.1f MB\n",
      dev->name.c_str(), static_cast<long long>(tokens), static_cast<long long>(layers),
      kvs.c_str(), static_cast<long long>(pages), static_cast<long long>((*tier)->page_bytes()),
      bytes / 1e6);
  std::printf("  pinned ceiling (one copy):  host->device %.1f GB/s, device->host %.1f GB/s\n",
              ceil_h2d, ceil_d2h);
  std::printf(
      "  one run (%lld copies):      restore %.1f GB/s (%.0f%%), offload %.1f GB/s (%.0f%%)\n",
      static_cast<long long>(copies_run), res_run, 100 * res_run / ceil_h2d, off_run,
      100 * off_run / ceil_d2h);
  std::printf(
      "  scattered (%lld copies):  restore %.1f GB/s (%.0f%%), offload %.1f GB/s (%.0f%%)\n",
      static_cast<long long>(copies_scat), res_scat, 100 * res_scat / ceil_h2d, off_scat,
      100 * off_scat / ceil_d2h);
  std::printf("  restore of the prefix: %.2f ms (one run)\n", bytes / (res_run * 1e9) * 1e3);
  return 0;
}
