// NcclCommunicator on real GPUs: every collective of dist::Communicator for groups of 2 .. 4
// ranks (one thread and one GPU per rank), against the values the CPU communicator's contract
// defines. Inputs are small multiples of 1/2, so every sum is exact in fp32 whatever order NCCL
// reduces in, and results must be equal. Skips where fewer than two GPUs are usable.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "dist/nccl_communicator.h"

namespace {

using m3::dist::NcclCommunicator;

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

float value(int rank, int64_t i) {
  return static_cast<float>(rank * 64 + (i % 97)) * 0.5f;
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)), cudaSuccess);
  if (!h.empty()) {
    EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  return d;
}

// Rank r sends (r + d) % 3 + 1 elements to rank d.
int64_t a2a_count(int from, int to) {
  return (from + to) % 3 + 1;
}

void run_rank(int rank, int world, const ncclUniqueId& id) {
  auto c = NcclCommunicator::create(rank, world, rank, id);
  ASSERT_TRUE(c.has_value()) << c.error().message;
  NcclCommunicator& comm = **c;
  cudaStream_t s = comm.stream();
  const int64_t n = 1001;  // odd size

  // all_reduce_sum
  std::vector<float> mine(n);
  for (int64_t i = 0; i < n; ++i) mine[i] = value(rank, i);
  float* d = to_device(mine);
  comm.all_reduce_sum(d, n);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  auto got = to_host(d, n);
  for (int64_t i = 0; i < n; ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += value(r, i);
    ASSERT_EQ(got[i], want) << "all_reduce rank " << rank << " i " << i;
  }

  // all_gather (f32)
  float* g = to_device(std::vector<float>(world * n));
  float* src = to_device(mine);
  comm.all_gather(src, n, g);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  got = to_host(g, world * n);
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[r * n + i], value(r, i)) << "all_gather";

  // reduce_scatter_sum: send holds world * n; rank gets the sum of everyone's chunk `rank`.
  std::vector<float> big(world * n);
  for (int64_t i = 0; i < world * n; ++i) big[i] = value(rank, i);
  float* bs = to_device(big);
  float* rs = to_device(std::vector<float>(n));
  comm.reduce_scatter_sum(bs, n, rs);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  got = to_host(rs, n);
  for (int64_t i = 0; i < n; ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += value(r, rank * n + i);
    ASSERT_EQ(got[i], want) << "reduce_scatter";
  }

  // all_to_all_v (int32)
  std::vector<int64_t> sc(world), rc(world);
  std::vector<int32_t> send;
  for (int dst = 0; dst < world; ++dst) {
    sc[dst] = a2a_count(rank, dst);
    rc[dst] = a2a_count(dst, rank);
    for (int64_t j = 0; j < sc[dst]; ++j)
      send.push_back(rank * 100 + dst * 10 + static_cast<int>(j));
  }
  const int64_t nrecv = std::accumulate(rc.begin(), rc.end(), int64_t{0});
  int32_t* ds = to_device(send);
  int32_t* dr = to_device(std::vector<int32_t>(nrecv));
  comm.all_to_all_v(ds, sc.data(), dr, rc.data());
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  auto recv = to_host(dr, nrecv);
  int64_t at = 0;
  for (int from = 0; from < world; ++from)
    for (int64_t j = 0; j < rc[from]; ++j)
      ASSERT_EQ(recv[at++], from * 100 + rank * 10 + static_cast<int>(j)) << "all_to_all_v";

  // broadcast from the last rank, then a barrier.
  float* bc = to_device(mine);
  comm.broadcast(bc, n, world - 1);
  comm.barrier();
  got = to_host(bc, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], value(world - 1, i)) << "broadcast";

  for (void* p : {static_cast<void*>(d), static_cast<void*>(g), static_cast<void*>(src),
                  static_cast<void*>(bs), static_cast<void*>(rs), static_cast<void*>(ds),
                  static_cast<void*>(dr), static_cast<void*>(bc)})
    cudaFree(p);
}

TEST(NcclCommunicator, EveryCollectiveOnTwoToFourGpus) {
  const int gpus = gpu_count();
  if (gpus < 2) GTEST_SKIP() << "needs at least two GPUs; found " << gpus;
  for (int world = 2; world <= std::min(gpus, 4); world *= 2) {
    auto id = m3::dist::make_nccl_unique_id();
    ASSERT_TRUE(id.has_value()) << id.error().message;
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(run_rank, r, world, *id);
    for (auto& t : ranks) t.join();
  }
}

}  // namespace
