// OneShotGroup: a one-shot all-reduce (sum, fp32) for the small vectors of tensor-parallel decode,
// among the W ranks of one process (one thread and one GPU per rank, as runtime/cuda/rank_group
// starts them; or W streams of one GPU, as the test runs them). Each rank stages its vector in its
// own device buffer, tells every rank so through a flag in that rank's memory, waits for the
// others' flags, and sums all W buffers in rank order straight from the peers' memory (peer
// access over NVLink / PCIe): one kernel, no NCCL protocol or proxy, every rank the same bits.
//
// Invariants: the kernel's grid is fixed (kCtas CTAs), and CTA b of every rank handles chunk b of
// the vector; its epoch (calls so far) lives in device memory per CTA, so eager calls, CUDA-graph
// replays and their mixes keep the ranks in step. Two staging slots alternate by epoch: a rank
// cannot overwrite the slot of call e (at call e + 2) before every peer has finished call e (it
// waits for their flags of call e + 1, which they raise only after call e's kernel ended on their
// stream). Flags are compared with >=: a peer may already have raised call e + 1's flag when a
// rank looks for call e's. Every rank must call with the same n, in the same order of calls.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"

namespace m3::dist {

class OneShotGroup {
 public:
  static constexpr int kMaxRanks = 8;
  static constexpr int kCtas = 32;

  // Rank r's buffers on devices[r] (2 slots of max_floats floats, flags, epochs), peer access
  // enabled between distinct devices. Errors: more than kMaxRanks ranks, a device that cannot
  // reach another's memory (the message names both), or allocation failure.
  static Result<std::shared_ptr<OneShotGroup>> create(const std::vector<int>& devices,
                                                      int64_t max_floats);
  ~OneShotGroup();
  OneShotGroup(const OneShotGroup&) = delete;
  OneShotGroup& operator=(const OneShotGroup&) = delete;

  int world_size() const { return static_cast<int>(devices_.size()); }
  int64_t max_floats() const { return max_floats_; }
  // Rank `rank`: data[0, n) (on the rank's device) = the sum over ranks of their data[0, n), in
  // rank order, enqueued on `stream` (the rank's device current). n <= max_floats().
  void all_reduce_sum(int rank, float* data, int64_t n, cudaStream_t stream) const;

 private:
  OneShotGroup() = default;
  std::vector<int> devices_;
  int64_t max_floats_ = 0;
  std::vector<float*> bufs_;       // per rank: [2][max_floats]
  std::vector<uint32_t*> flags_;   // per rank: [W][kCtas], raised by the ranks
  std::vector<uint32_t*> epochs_;  // per rank: [kCtas], the calls each CTA has made
};

}  // namespace m3::dist
