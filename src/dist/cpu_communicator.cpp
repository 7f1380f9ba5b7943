#include "dist/cpu_communicator.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/check.h"

namespace m3::dist {

namespace {
enum Op : int {
  kAllReduce = 1,
  kGatherF32,
  kGatherI32,
  kReduceScatter,
  kA2aF32,
  kA2aI32,
  kBcastF32,
  kBcastI32,
  kBarrier,
};
}  // namespace

Result<std::shared_ptr<CpuGroup>> CpuGroup::create(int world_size) {
  if (world_size < 1) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "a CPU communicator group needs at least 1 rank, got " + std::to_string(world_size),
        "world_size");
  }
  return std::make_shared<CpuGroup>(world_size);
}

CpuGroup::CpuGroup(int world_size)
    : world_size_(world_size), slots_(world_size), barrier_(world_size) {
  M3_CHECK(world_size >= 1);
}

std::unique_ptr<Communicator> CpuGroup::communicator(int rank) {
  M3_CHECK(rank >= 0 && rank < world_size_, "CpuGroup: rank %d outside [0, %d)", rank, world_size_);
  return std::make_unique<CpuCommunicator>(shared_from_this(), rank);
}

CpuCommunicator::CpuCommunicator(std::shared_ptr<CpuGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

void CpuCommunicator::post(const CpuGroup::Slot& s) {
  group_->slots_[rank_] = s;
  group_->barrier_.arrive_and_wait();
  // A rank in a different collective, or with a different size, is a bug in the caller: every
  // rank must issue the same sequence of collectives (communicator.h).
  const CpuGroup::Slot& r0 = group_->slots_[0];
  M3_CHECK(r0.op == s.op, "CpuCommunicator: rank %d is in collective %d, rank 0 in %d", rank_, s.op,
           r0.op);
  if (s.op != kA2aF32 && s.op != kA2aI32) {
    M3_CHECK(r0.n == s.n, "CpuCommunicator: rank %d has %lld elements, rank 0 has %lld", rank_,
             (long long)s.n, (long long)r0.n);
  }
}

void CpuCommunicator::done() {
  group_->barrier_.arrive_and_wait();
}

void CpuCommunicator::all_reduce_sum(float* data, int64_t n) {
  const int W = world_size();
  if (W == 1) return;
  post({data, data, nullptr, n, kAllReduce});
  // Every rank computes the whole sum in rank order into scratch (other ranks still read our
  // buffer), and writes it back only after the second barrier.
  scratch_.resize(n);
  const auto& slots = group_->slots_;
  std::memcpy(scratch_.data(), slots[0].send, n * sizeof(float));
  for (int r = 1; r < W; ++r) {
    const float* src = static_cast<const float*>(slots[r].send);
    for (int64_t i = 0; i < n; ++i) scratch_[i] += src[i];
  }
  done();
  std::memcpy(data, scratch_.data(), n * sizeof(float));
}

template <class T>
void CpuCommunicator::gather_impl(const T* send, int64_t n, T* recv, int op) {
  post({send, recv, nullptr, n, op});
  const auto& slots = group_->slots_;
  for (int r = 0; r < world_size(); ++r) std::memcpy(recv + r * n, slots[r].send, n * sizeof(T));
  done();
}

void CpuCommunicator::all_gather(const float* send, int64_t n, float* recv) {
  gather_impl(send, n, recv, kGatherF32);
}
void CpuCommunicator::all_gather(const int32_t* send, int64_t n, int32_t* recv) {
  gather_impl(send, n, recv, kGatherI32);
}

void CpuCommunicator::reduce_scatter_sum(const float* send, int64_t n, float* recv) {
  post({send, recv, nullptr, n, kReduceScatter});
  const auto& slots = group_->slots_;
  // recv may alias part of send: sum into scratch first.
  scratch_.assign(n, 0.f);
  std::memcpy(scratch_.data(), static_cast<const float*>(slots[0].send) + rank_ * n,
              n * sizeof(float));
  for (int r = 1; r < world_size(); ++r) {
    const float* src = static_cast<const float*>(slots[r].send) + rank_ * n;
    for (int64_t i = 0; i < n; ++i) scratch_[i] += src[i];
  }
  done();
  std::memcpy(recv, scratch_.data(), n * sizeof(float));
}

template <class T>
void CpuCommunicator::a2a_impl(const T* send, const int64_t* send_counts, T* recv,
                               const int64_t* recv_counts, int op) {
  post({send, recv, send_counts, 0, op});
  const int W = world_size();
  const auto& slots = group_->slots_;
  int64_t roff = 0;
  for (int s = 0; s < W; ++s) {
    const int64_t* sc = slots[s].send_counts;
    int64_t soff = 0;
    for (int d = 0; d < rank_; ++d) soff += sc[d];
    M3_CHECK(sc[rank_] == recv_counts[s],
             "all_to_all_v: rank %d sends %lld elements to rank %d, which expects %lld", s,
             (long long)sc[rank_], rank_, (long long)recv_counts[s]);
    std::memcpy(recv + roff, static_cast<const T*>(slots[s].send) + soff,
                recv_counts[s] * sizeof(T));
    roff += recv_counts[s];
  }
  done();
}

void CpuCommunicator::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                   const int64_t* recv_counts) {
  a2a_impl(send, send_counts, recv, recv_counts, kA2aF32);
}
void CpuCommunicator::all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                                   const int64_t* recv_counts) {
  a2a_impl(send, send_counts, recv, recv_counts, kA2aI32);
}

template <class T>
void CpuCommunicator::bcast_impl(T* data, int64_t n, int root, int op) {
  M3_CHECK(root >= 0 && root < world_size(), "broadcast: root %d outside [0, %d)", root,
           world_size());
  post({data, data, nullptr, n, op});
  if (rank_ != root) std::memcpy(data, group_->slots_[root].send, n * sizeof(T));
  done();
}

void CpuCommunicator::broadcast(float* data, int64_t n, int root) {
  bcast_impl(data, n, root, kBcastF32);
}
void CpuCommunicator::broadcast(int32_t* data, int64_t n, int root) {
  bcast_impl(data, n, root, kBcastI32);
}

void CpuCommunicator::barrier() {
  post({nullptr, nullptr, nullptr, 0, kBarrier});
  done();
}

void run_cpu_ranks(int world_size, const std::function<void(int, Communicator&)>& fn) {
  M3_CHECK(world_size >= 1);
  auto group = std::make_shared<CpuGroup>(world_size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world_size; ++r) comms.push_back(group->communicator(r));
  std::vector<std::thread> threads;
  for (int r = 1; r < world_size; ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  fn(0, *comms[0]);
  for (auto& t : threads) t.join();
}

}  // namespace m3::dist
