// The one-shot all-reduce (dist/one_shot_all_reduce.h) on real GPUs: W ranks as W streams of GPU
// 0 (any machine with a GPU), and one rank per GPU where there are several. Many calls in a row
// with changing sizes (the epochs and the two staging slots), an unaligned vector, CUDA-graph
// replays mixed with eager calls. Exact inputs (multiples of 1/2: every sum exact in any order)
// must give the exact sums; random inputs must give every rank the same bits, the rank-order sum.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dist/one_shot_all_reduce.h"

namespace {

using m3::dist::OneShotGroup;

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct Ranks {
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;
  std::vector<float*> bufs;  // per rank: the vector, cap + 4 floats (offset 1 for unaligned)
  int64_t cap = 0;

  ~Ranks() {
    for (size_t r = 0; r < devices.size(); ++r) {
      cudaSetDevice(devices[r]);
      if (r < streams.size()) cudaStreamDestroy(streams[r]);
      if (r < bufs.size()) cudaFree(bufs[r]);
    }
    cudaSetDevice(0);
  }
};

void make_ranks(Ranks& rk, const std::vector<int>& devices, int64_t cap) {
  rk.devices = devices;
  rk.cap = cap;
  for (int d : devices) {
    CUDA_OK(cudaSetDevice(d));
    cudaStream_t s = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    rk.streams.push_back(s);
    float* b = nullptr;
    CUDA_OK(cudaMalloc(&b, (cap + 4) * sizeof(float)));
    rk.bufs.push_back(b);
  }
}

// One collective call: each rank's input uploaded, then every rank's call (eager, or its graph
// when graphs is set), then all synchronised; returns each rank's output.
void run_call(const Ranks& rk, const OneShotGroup& g, const std::vector<std::vector<float>>& in,
              int64_t n, int64_t offset, const std::vector<cudaGraphExec_t>* graphs,
              std::vector<std::vector<float>>* out) {
  const int w = static_cast<int>(rk.devices.size());
  for (int r = 0; r < w; ++r) {
    CUDA_OK(cudaSetDevice(rk.devices[r]));
    CUDA_OK(cudaMemcpyAsync(rk.bufs[r] + offset, in[r].data(), n * sizeof(float),
                            cudaMemcpyHostToDevice, rk.streams[r]));
  }
  for (int r = 0; r < w; ++r) {
    CUDA_OK(cudaSetDevice(rk.devices[r]));
    if (graphs != nullptr) {
      CUDA_OK(cudaGraphLaunch((*graphs)[r], rk.streams[r]));
    } else {
      g.all_reduce_sum(r, rk.bufs[r] + offset, n, rk.streams[r]);
    }
  }
  out->assign(w, {});
  for (int r = 0; r < w; ++r) {
    CUDA_OK(cudaSetDevice(rk.devices[r]));
    (*out)[r].resize(n);
    CUDA_OK(cudaMemcpyAsync((*out)[r].data(), rk.bufs[r] + offset, n * sizeof(float),
                            cudaMemcpyDeviceToHost, rk.streams[r]));
    CUDA_OK(cudaStreamSynchronize(rk.streams[r]));
  }
  CUDA_OK(cudaSetDevice(0));
}

std::vector<std::vector<float>> inputs(int w, int64_t n, int call, bool exact) {
  std::mt19937 gen(1000 + call);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  std::vector<std::vector<float>> in(w, std::vector<float>(n));
  for (int r = 0; r < w; ++r)
    for (int64_t i = 0; i < n; ++i)
      in[r][i] = exact ? static_cast<float>((r * 37 + call * 11 + i % 101) % 257) * 0.5f : u(gen);
  return in;
}

// The rank-order sum the kernel must give: ((0 + x0) + x1) + ...
std::vector<float> rank_order_sum(const std::vector<std::vector<float>>& in, int64_t n) {
  std::vector<float> s(n, 0.f);
  for (const auto& x : in)
    for (int64_t i = 0; i < n; ++i) s[i] += x[i];
  return s;
}

void check(const std::vector<std::vector<float>>& in, const std::vector<std::vector<float>>& out,
           int64_t n, const std::string& what) {
  const std::vector<float> want = rank_order_sum(in, n);
  for (size_t r = 0; r < out.size(); ++r) {
    ASSERT_EQ(out[r].size(), static_cast<size_t>(n));
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; ++i)
      if (std::memcmp(&out[r][i], &want[i], sizeof(float)) != 0) bad = i;
    EXPECT_EQ(bad, -1) << what << ": rank " << r << " element " << bad << " is "
                       << (bad >= 0 ? out[r][bad] : 0.f) << ", the rank-order sum "
                       << (bad >= 0 ? want[bad] : 0.f);
  }
}

void eager_calls(const std::vector<int>& devices, const std::string& name) {
  const int64_t cap = 3 * 6144 * 8;
  Ranks rk;
  make_ranks(rk, devices, cap);
  auto g = OneShotGroup::create(devices, cap);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  // Sizes that change every call (the slots alternate, the chunks move), one unaligned vector.
  const int64_t sizes[] = {6144, 1, 5, 4096, cap, 61, 6144 * 3, 0, 1000, 6144 * 8, 7, cap};
  int call = 0;
  for (const int64_t n : sizes) {
    for (const bool exact : {true, false}) {
      const int64_t offset = call % 5 == 3 ? 1 : 0;
      const int64_t nn = offset ? std::min<int64_t>(n, cap - 1) : n;
      const auto in = inputs(static_cast<int>(devices.size()), nn, call, exact);
      std::vector<std::vector<float>> out;
      run_call(rk, **g, in, nn, offset, nullptr, &out);
      check(in, out, nn,
            name + " call " + std::to_string(call) + " (n " + std::to_string(nn) +
                (offset ? ", unaligned" : "") + ")");
      ++call;
    }
  }
}

TEST(OneShotAllReduce, RanksAsStreamsOfOneGpu) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  for (int w : {2, 3, 4}) eager_calls(std::vector<int>(w, 0), std::to_string(w) + " streams");
}

TEST(OneShotAllReduce, OneRankPerGpu) {
  const int n = gpu_count();
  if (n < 2) GTEST_SKIP() << "fewer than two GPUs";
  std::vector<int> devices;
  for (int d = 0; d < std::min(n, OneShotGroup::kMaxRanks); ++d) devices.push_back(d);
  for (size_t w = 2; w <= devices.size(); w *= 2)
    eager_calls(std::vector<int>(devices.begin(), devices.begin() + w),
                std::to_string(w) + " GPUs");
}

TEST(OneShotAllReduce, GraphReplaysMixedWithEagerCalls) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::vector<int> devices =
      gpu_count() >= 2 ? std::vector<int>{0, 1} : std::vector<int>{0, 0};
  const int64_t n = 6144 * 4, cap = 6144 * 8;
  Ranks rk;
  make_ranks(rk, devices, cap);
  auto g = OneShotGroup::create(devices, cap);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  std::vector<cudaGraphExec_t> execs;
  std::vector<cudaGraph_t> graphs;
  for (size_t r = 0; r < devices.size(); ++r) {
    CUDA_OK(cudaSetDevice(devices[r]));
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(rk.streams[r], cudaStreamCaptureModeThreadLocal));
    (*g)->all_reduce_sum(static_cast<int>(r), rk.bufs[r], n, rk.streams[r]);
    CUDA_OK(cudaStreamEndCapture(rk.streams[r], &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    graphs.push_back(graph);
    execs.push_back(exec);
  }
  for (int call = 0; call < 9; ++call) {
    const bool replay = call % 3 != 1;  // replay, eager, replay, ...
    const auto in = inputs(static_cast<int>(devices.size()), n, call, call % 2 == 0);
    std::vector<std::vector<float>> out;
    run_call(rk, **g, in, n, 0, replay ? &execs : nullptr, &out);
    check(in, out, n, std::string(replay ? "replay" : "eager") + " call " + std::to_string(call));
  }
  for (size_t r = 0; r < devices.size(); ++r) {
    cudaSetDevice(devices[r]);
    cudaGraphExecDestroy(execs[r]);
    cudaGraphDestroy(graphs[r]);
  }
  cudaSetDevice(0);
}

TEST(OneShotAllReduce, RefusesBadGroups) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  auto none = OneShotGroup::create({}, 16);
  ASSERT_FALSE(none.has_value());
  EXPECT_NE(none.error().message.find("0 ranks"), std::string::npos) << none.error().message;
  auto many = OneShotGroup::create(std::vector<int>(OneShotGroup::kMaxRanks + 1, 0), 16);
  ASSERT_FALSE(many.has_value());
  auto empty = OneShotGroup::create({0, 0}, 0);
  ASSERT_FALSE(empty.has_value());
  EXPECT_NE(empty.error().message.find("capacity"), std::string::npos) << empty.error().message;
}

}  // namespace
