// NcclCommunicator: Communicator over NCCL, one GPU per rank, for the GPU sharded forward (tensor,
// expert and attention-data parallel within one node; multiple nodes are not implemented,
// docs/MULTI_NODE.md has the plan). Built only when CUDA and NCCL are found (M3_HAS_NCCL).
// Invariant: every collective is enqueued on stream() and returns without waiting for it (except
// barrier(), which synchronises the stream); buffers are device pointers. NVLS stays off
// (dist/nccl_env.h) before ncclCommInitRank runs.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/one_shot_all_reduce.h"

namespace m3::dist {

// The group's bootstrap id: rank 0 makes it and hands it to the others (threads: shared memory;
// processes or nodes: any side channel, see docs/MULTI_NODE.md).
Result<ncclUniqueId> make_nccl_unique_id();

class NcclCommunicator final : public Communicator {
 public:
  // Binds the calling thread to `device`, checks the NCCL environment (NVLS off), creates a
  // non-blocking stream and joins the group. Errors: a bad rank/world/device, NCCL_NVLS_ENABLE
  // set to anything but 0, or NCCL failing to initialise (the message carries NCCL's reason).
  static Result<std::unique_ptr<NcclCommunicator>> create(int rank, int world_size, int device,
                                                          const ncclUniqueId& id);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "nccl"; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

  // NCCL's all-reduce, or the one-shot group's (attach_one_shot) for up to its capacity.
  void all_reduce_sum(float* data, int64_t n) override;
  // From now on, all-reduces of at most g->max_floats() floats run g's one-shot kernel (this
  // communicator's rank is g's rank: the group is this process's ranks, in order). Null: NCCL.
  void attach_one_shot(std::shared_ptr<const OneShotGroup> g) { one_shot_ = std::move(g); }
  bool one_shot_attached() const { return one_shot_ != nullptr; }
  void all_gather(const float* send, int64_t n, float* recv) override;
  void all_gather(const int32_t* send, int64_t n, int32_t* recv) override;
  void reduce_scatter_sum(const float* send, int64_t n, float* recv) override;
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override;
  void all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                    const int64_t* recv_counts) override;
  void broadcast(float* data, int64_t n, int root) override;
  void broadcast(int32_t* data, int64_t n, int root) override;
  void barrier() override;

 private:
  NcclCommunicator(int rank, int world, int device, ncclComm_t comm, cudaStream_t stream,
                   float* scratch);
  template <class T>
  void a2a(const T* send, const int64_t* send_counts, T* recv, const int64_t* recv_counts,
           ncclDataType_t type);

  int rank_;
  int world_;
  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // one device float for barrier()
  std::shared_ptr<const OneShotGroup> one_shot_;
};

}  // namespace m3::dist
