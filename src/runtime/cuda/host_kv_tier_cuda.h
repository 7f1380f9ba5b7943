// HostKvTierCuda: the GPU backend's host KV tier (`--kv-transfer-config` offloading,
// `--kv-offloading-size`): `num_slots` page-sized slots of pinned host memory behind a
// KvCacheCuda, and the copies between them on a dedicated copy stream. The scheduler decides
// what moves (sched/host_block_pool.h); this class only moves bytes. Used by CudaBackend
// (runtime/cuda/cuda_backend.cpp) and the GPU tests / bench.
//
// Layout: for every layer, for every array of the layer (K, V, then on sparse layers index-K and
// the fp8 index-K scales; the order of ForwardBackend::kv_regions), one block of
// num_slots * page_bytes(array) bytes, slot s at s * page_bytes(array): consecutive slots of one
// array are contiguous, as consecutive pages are on the device, so a run of consecutive pages
// that goes to (or comes from) a run of consecutive slots is one cudaMemcpyAsync per array.
//
// Ordering (enqueue): the copy stream first waits for everything enqueued on the compute stream
// so far (a step still running may write a page this batch reads or overwrites); then, layer by
// layer, every offload (device -> host), every restore (host -> device), and the layer's event.
// A forward that waits for layer_event(l) before its first access of layer l's pages (attn_prep,
// M3ModelCuda::wait_for_kv_copies) overlaps the copies of the later layers with its own compute.
// Offloads of a layer precede its restores on the one stream: a page evicted and refilled in the
// same step is copied out before it is overwritten. Not thread-safe (the engine thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "runtime/forward_backend.h"

namespace m3::model {
class KvCacheCuda;
}  // namespace m3::model

namespace m3::runtime {

class HostKvTierCuda {
 public:
  // Pins num_slots * (the cache's bytes per page) of host memory (cudaHostAlloc) on the current
  // device's context. Errors: num_slots < 1; the host memory cannot be pinned (names the size and
  // the flags that set it).
  static Result<std::unique_ptr<HostKvTierCuda>> create(model::KvCacheCuda& cache,
                                                        int64_t num_slots);
  ~HostKvTierCuda();
  HostKvTierCuda(const HostKvTierCuda&) = delete;
  HostKvTierCuda& operator=(const HostKvTierCuda&) = delete;

  int64_t num_slots() const { return num_slots_; }
  int64_t page_bytes() const { return page_bytes_; }  // all arrays of all layers
  int64_t num_layers() const { return static_cast<int64_t>(layer_ready_.size()); }

  // Enqueues one step's copies (the order above) after the work enqueued on `compute` so far.
  // Page ids and slots are checked against the pool and the tier (out of range: a bug, fatal).
  void enqueue(std::span<const HostPageCopy> offloads, std::span<const HostPageCopy> restores,
               cudaStream_t compute);
  // Recorded on the copy stream after layer l's copies of the last enqueue (a wait on it made
  // now covers every earlier enqueue too: the copy stream is in order).
  cudaEvent_t layer_event(int64_t l) const { return layer_ready_[static_cast<size_t>(l)]; }
  std::vector<cudaEvent_t> layer_events() const { return layer_ready_; }
  // Blocks until every enqueued copy has finished.
  void synchronize() const;
  // cudaMemcpyAsync calls the last enqueue issued (one per run of consecutive pages and slots,
  // per array), and the bytes it moved.
  int64_t last_num_copies() const { return last_copies_; }
  int64_t last_bytes() const { return last_bytes_; }
  // Slot s's bytes of array a of layer l (tests): page_bytes(array) bytes of pinned host memory.
  const uint8_t* host_slot(int64_t layer, int array, int64_t slot) const;

 private:
  struct Array {
    uint8_t* device = nullptr;  // the pool's array (page p at p * page_bytes)
    uint8_t* host = nullptr;    // its block in the pinned memory (slot s at s * page_bytes)
    int64_t page_bytes = 0;
  };
  HostKvTierCuda() = default;

  std::vector<std::vector<Array>> layers_;
  int64_t num_slots_ = 0;
  int64_t num_pages_ = 0;
  int64_t page_bytes_ = 0;
  uint8_t* pinned_ = nullptr;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t compute_mark_ = nullptr;  // recorded on the compute stream at each enqueue
  std::vector<cudaEvent_t> layer_ready_;
  int64_t last_copies_ = 0;
  int64_t last_bytes_ = 0;
};

}  // namespace m3::runtime
