#include "runtime/cuda/host_kv_tier_cuda.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "core/check.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "model/cuda/kv_cache_cuda.h"

namespace m3::runtime {

namespace {

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

// Runs of `copies` (sorted by device page) whose pages and slots both advance by one.
struct Run {
  int64_t page = 0, slot = 0, n = 0;
};
std::vector<Run> runs_of(std::span<const HostPageCopy> copies) {
  std::vector<HostPageCopy> c(copies.begin(), copies.end());
  std::sort(c.begin(), c.end(), [](const HostPageCopy& a, const HostPageCopy& b) {
    return a.device_page < b.device_page;
  });
  std::vector<Run> out;
  for (const HostPageCopy& x : c) {
    if (!out.empty() && out.back().page + out.back().n == x.device_page &&
        out.back().slot + out.back().n == x.host_slot) {
      ++out.back().n;
    } else {
      out.push_back({x.device_page, x.host_slot, 1});
    }
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<HostKvTierCuda>> HostKvTierCuda::create(model::KvCacheCuda& cache,
                                                               int64_t num_slots) {
  M3_CHECK(num_slots >= 1, "host KV tier of %lld slots", static_cast<long long>(num_slots));
  std::unique_ptr<HostKvTierCuda> t(new HostKvTierCuda());
  t->num_slots_ = num_slots;
  t->num_pages_ = cache.num_pages();
  const int64_t L = static_cast<int64_t>(cache.num_layers());
  t->layers_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const auto p = cache.layer(l);
    const int64_t kv =
        p.page_size * p.num_kv_heads * p.head_dim * kernels::kv_dtype_size(p.kv_dtype);
    auto& arrays = t->layers_[static_cast<size_t>(l)];
    arrays.push_back({static_cast<uint8_t*>(p.k), nullptr, kv});
    arrays.push_back({static_cast<uint8_t*>(p.v), nullptr, kv});
    if (p.ik != nullptr)
      arrays.push_back({static_cast<uint8_t*>(p.ik), nullptr,
                        p.page_size * p.index_dim * kernels::kv_dtype_size(p.ik_dtype)});
    if (p.ik_scale != nullptr)
      arrays.push_back({reinterpret_cast<uint8_t*>(p.ik_scale), nullptr,
                        p.page_size * static_cast<int64_t>(sizeof(float))});
    for (const Array& a : arrays) t->page_bytes_ += a.page_bytes;
  }
  const double bytes = static_cast<double>(num_slots) * static_cast<double>(t->page_bytes_);
  const auto t0 = std::chrono::steady_clock::now();
  const cudaError_t err = cudaHostAlloc(
      reinterpret_cast<void**>(&t->pinned_),
      static_cast<size_t>(num_slots) * static_cast<size_t>(t->page_bytes_), cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls do not report it
    t->pinned_ = nullptr;
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot pin " + gib(bytes) + " of host memory for the host KV tier (" +
                          std::to_string(num_slots) + " pages of " +
                          std::to_string(t->page_bytes_) +
                          " bytes; cudaHostAlloc: " + cudaGetErrorString(err) +
                          "); lower kv_connector_extra_config.cpu_bytes_to_use in "
                          "--kv-transfer-config (or --kv-offloading-size), or free host memory",
                      "--kv-transfer-config");
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  uint8_t* at = t->pinned_;
  for (auto& arrays : t->layers_) {
    for (Array& a : arrays) {
      a.host = at;
      at += num_slots * a.page_bytes;
    }
  }
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(&t->copy_, cudaStreamNonBlocking));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(&t->compute_mark_, cudaEventDisableTiming));
  t->layer_ready_.resize(static_cast<size_t>(L));
  for (cudaEvent_t& e : t->layer_ready_)
    M3_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  M3_LOG_INFO("host KV tier: %s of pinned host memory = %lld pages (pinned in %.0f ms)",
              gib(bytes).c_str(), static_cast<long long>(num_slots), ms);
  return t;
}

HostKvTierCuda::~HostKvTierCuda() {
  // Nothing may still copy into or out of what is freed here (errors cannot be reported).
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  for (cudaEvent_t e : layer_ready_)
    if (e != nullptr) cudaEventDestroy(e);
  if (compute_mark_ != nullptr) cudaEventDestroy(compute_mark_);
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
}

void HostKvTierCuda::enqueue(std::span<const HostPageCopy> offloads,
                             std::span<const HostPageCopy> restores, cudaStream_t compute) {
  for (auto list : {offloads, restores}) {
    for (const HostPageCopy& c : list)
      M3_CHECK(c.device_page >= 0 && c.device_page < num_pages_ && c.host_slot >= 0 &&
                   c.host_slot < num_slots_,
               "host KV copy of page %d / slot %d (pool %lld pages, tier %lld slots)",
               c.device_page, c.host_slot, static_cast<long long>(num_pages_),
               static_cast<long long>(num_slots_));
  }
  last_copies_ = 0;
  last_bytes_ = 0;
  if (offloads.empty() && restores.empty()) return;
  M3_CUDA_CHECK(cudaEventRecord(compute_mark_, compute));
  M3_CUDA_CHECK(cudaStreamWaitEvent(copy_, compute_mark_, 0));
  const std::vector<Run> out = runs_of(offloads), in = runs_of(restores);
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (const Array& a : layers_[l]) {
      for (const Run& r : out) {
        M3_CUDA_CHECK(cudaMemcpyAsync(a.host + r.slot * a.page_bytes,
                                      a.device + r.page * a.page_bytes, r.n * a.page_bytes,
                                      cudaMemcpyDeviceToHost, copy_));
        ++last_copies_;
        last_bytes_ += r.n * a.page_bytes;
      }
    }
    for (const Array& a : layers_[l]) {
      for (const Run& r : in) {
        M3_CUDA_CHECK(cudaMemcpyAsync(a.device + r.page * a.page_bytes,
                                      a.host + r.slot * a.page_bytes, r.n * a.page_bytes,
                                      cudaMemcpyHostToDevice, copy_));
        ++last_copies_;
        last_bytes_ += r.n * a.page_bytes;
      }
    }
    M3_CUDA_CHECK(cudaEventRecord(layer_ready_[l], copy_));
  }
}

void HostKvTierCuda::synchronize() const {
  M3_CUDA_CHECK(cudaStreamSynchronize(copy_));
}

const uint8_t* HostKvTierCuda::host_slot(int64_t layer, int array, int64_t slot) const {
  M3_CHECK(layer >= 0 && layer < num_layers() && array >= 0 &&
               array < static_cast<int>(layers_[static_cast<size_t>(layer)].size()) && slot >= 0 &&
               slot < num_slots_,
           "host_slot(%lld, %d, %lld)", static_cast<long long>(layer), array,
           static_cast<long long>(slot));
  const Array& a = layers_[static_cast<size_t>(layer)][static_cast<size_t>(array)];
  return a.host + slot * a.page_bytes;
}

}  // namespace m3::runtime
