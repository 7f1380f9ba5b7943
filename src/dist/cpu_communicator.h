// CpuCommunicator: Communicator for N ranks that are threads of one process (host memory). A
// CpuGroup is the rendezvous the ranks share: each collective posts the rank's buffer pointers,
// waits for all ranks, reads the others' buffers directly, and waits again before returning, so
// no rank reuses a buffer another rank is still reading. Used by the CPU sharded forward
// (runtime/forward_backend.h make_cpu_sharded_backend) and the sharded-model tests.
// Invariant: deterministic: all_reduce_sum adds ranks in rank order (0, 1, ..., N-1) on every
// rank, so every rank holds bitwise the same sum. A CpuGroup must outlive its communicators.
#pragma once

#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"

namespace m3::dist {

class CpuGroup : public std::enable_shared_from_this<CpuGroup> {
 public:
  // Errors: world_size < 1.
  static Result<std::shared_ptr<CpuGroup>> create(int world_size);
  explicit CpuGroup(int world_size);

  int world_size() const { return world_size_; }
  // The communicator of `rank` (0 <= rank < world_size); call once per rank, from any thread.
  // The group must be owned by a shared_ptr (create); each communicator keeps it alive.
  std::unique_ptr<Communicator> communicator(int rank);

 private:
  friend class CpuCommunicator;
  // What a rank posts for the collective in flight.
  struct Slot {
    const void* send = nullptr;
    void* recv = nullptr;
    const int64_t* send_counts = nullptr;
    int64_t n = 0;
    int op = 0;
  };
  int world_size_;
  std::vector<Slot> slots_;
  std::barrier<> barrier_;
};

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator(std::shared_ptr<CpuGroup> group, int rank);

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  std::string backend_name() const override { return "cpu-threads"; }

  void all_reduce_sum(float* data, int64_t n) override;
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
  // Posts this rank's slot and waits until every rank has posted; checks that all ranks are in
  // the same collective with the same size.
  void post(const CpuGroup::Slot& s);
  void done();  // waits until every rank has finished reading the posted buffers
  template <class T>
  void gather_impl(const T* send, int64_t n, T* recv, int op);
  template <class T>
  void a2a_impl(const T* send, const int64_t* send_counts, T* recv, const int64_t* recv_counts,
                int op);
  template <class T>
  void bcast_impl(T* data, int64_t n, int root, int op);

  std::shared_ptr<CpuGroup> group_;
  int rank_;
  std::vector<float> scratch_;
};

// Runs fn(rank, communicator) on world_size threads (rank 0 on the calling thread) and joins
// them: the harness the tests and the tools use for one-off sharded work.
void run_cpu_ranks(int world_size, const std::function<void(int, Communicator&)>& fn);

}  // namespace m3::dist
