// OneShotAllReduce: a one-shot all-reduce over the GPUs of one process (the tensor-parallel ranks
// are threads, one GPU each), for the small messages of a TP decode step, where NCCL's ring
// latency dominates. Each rank copies its data into a staging buffer of its own GPU; one kernel
// then (1) tells every peer, through a flag in the peer's memory, that its staging buffer is
// ready and waits for every peer's flag in its own memory, (2) reads all ranks' staging buffers
// over P2P (NVLink) and writes the sum, added in rank order 0, 1, ..., W-1, back into the data,
// and (3) does the same flag handshake again, so no rank overwrites its staging buffer (the next
// call's copy) while a peer still reads it. The flags are per block and count calls (an epoch
// kept in device memory), so the copy + kernel pair can be captured in a CUDA graph and
// replayed. The rank-order sum makes every rank's result bitwise the same (as NCCL's is) and
// equal to CpuCommunicator's order.
// Used by NcclCommunicator::all_reduce_sum for n <= max_elems when enabled
// (M3_ONE_SHOT_ALLREDUCE=1, off by default: it has run on one GPU only, with the "ranks" as
// streams of that GPU, never across several GPUs; docs/MULTI_NODE.md).
// Invariants: every rank calls all_reduce_sum the same number of times with the same n, on its
// own stream; a wait that exceeds ~2^26 polls (seconds) gives up, leaves the result wrong and
// raises fault() instead of hanging the GPU.
#pragma once

#include <cuda_runtime.h>

#include <barrier>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace m3::dist {

class OneShotAllReduce {
 public:
  static constexpr int kMaxRanks = 8;
  static constexpr int kMaxBlocks = 16;

  // A group of `world` ranks (2..kMaxRanks) whose messages hold at most max_elems floats.
  static Result<std::shared_ptr<OneShotAllReduce>> create(int world, int64_t max_elems);
  OneShotAllReduce(int world, int64_t max_elems);
  ~OneShotAllReduce();
  OneShotAllReduce(const OneShotAllReduce&) = delete;
  OneShotAllReduce& operator=(const OneShotAllReduce&) = delete;

  int world() const { return world_; }
  int64_t max_elems() const { return max_elems_; }

  // Rank `rank` on its own thread, `device` current: allocates its staging buffer, flags and
  // epochs on `device`, enables peer access to every other rank's device, and waits until every
  // rank has joined (all threads must call it). Several ranks may share one device (the
  // one-GPU test). Errors: a device pair without P2P access (then every rank's join fails the
  // same way, after the rendezvous, and the caller keeps NCCL).
  Status join(int rank, int device);
  // Enqueues on `stream` (rank's device current): data[0 .. n) = the sum over ranks of their
  // data[0 .. n), in rank order. n <= max_elems(). After every rank has joined.
  void all_reduce_sum(int rank, float* data, int64_t n, cudaStream_t stream);
  // Empty unless a rank's kernel gave up waiting for a peer (reads the device flag: syncs).
  std::string fault(int rank) const;

 private:
  struct Rank {
    int device = -1;
    float* staging = nullptr;   // [max_elems]
    uint32_t* flags = nullptr;  // [kMaxBlocks, kMaxRanks]: written by the peers
    uint32_t* epochs = nullptr; // [kMaxBlocks]: this rank's calls so far, per block
    int* error = nullptr;       // set by a kernel that timed out
  };
  int world_;
  int64_t max_elems_;
  std::vector<Rank> ranks_;
  std::barrier<> barrier_;
  std::vector<Status> join_status_;
};

}  // namespace m3::dist
