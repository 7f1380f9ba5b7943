// OneShotAllReduce (dist/one_shot_all_reduce.h) on ONE GPU: the W "ranks" are threads, each with
// its own stream and staging buffer on device 0 (no P2P involved), so the handshake, the
// rank-order sum and the per-block epochs are exercised, but not NVLink reads between GPUs.
// It cannot hang: W <= 8 kernels of <= 16 blocks (at most 128 blocks of 512 threads, resident
// together on an H200's 132 SMs) and a wait that never ends gives up after seconds and raises
// fault(), which the test checks. Checked, bitwise against the rank-order float sum on the host:
// message sizes from 1 float to the maximum (one block to all 16, the tail of a grid stride),
// 20 calls back to back (the epochs), and a CUDA graph of one call replayed with new inputs.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <thread>
#include <vector>

#include "dist/one_shot_all_reduce.h"
#include "gpu/cuda_check.h"

namespace m3::dist {
namespace {

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Rank r's input of call `it`: values whose float sum depends on the order.
float input(int r, int it, int64_t i) {
  return 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>((i * 7 + it) % 4099) +
         (i % 3 == 0 ? 1e6f : 1.0f / 3.0f) * static_cast<float>(r % 2 ? 1 : -1);
}

std::vector<float> want_sum(int W, int it, int64_t n) {
  std::vector<float> s(n);
  for (int64_t i = 0; i < n; ++i) {
    volatile float acc = input(0, it, i);  // volatile: no contraction or reassociation
    for (int r = 1; r < W; ++r) acc = acc + input(r, it, i);
    s[i] = acc;
  }
  return s;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class OneShot : public ::testing::TestWithParam<int> {};

TEST_P(OneShot, RankOrderSumOverManyCallsAndAGraphReplay) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int W = GetParam();
  const int64_t max_elems = 40000;
  auto g = OneShotAllReduce::create(W, max_elems);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  std::shared_ptr<OneShotAllReduce> group = *g;
  const std::vector<int64_t> sizes = {1, 7, 1024, 6144, 3 * 6144 + 5, max_elems};
  std::vector<std::vector<std::string>> failures(W);
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r) {
    ts.emplace_back([&, r] {
      M3_CUDA_CHECK(cudaSetDevice(0));
      cudaStream_t s = nullptr;
      M3_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      float* d = nullptr;
      M3_CUDA_CHECK(cudaMalloc(&d, max_elems * sizeof(float)));
      const Status joined = group->join(r, 0);
      if (!joined.has_value()) {
        failures[r].push_back(joined.error().message);
        return;
      }
      auto run_one = [&](int it, int64_t n, cudaGraphExec_t exec) {
        std::vector<float> h(n);
        for (int64_t i = 0; i < n; ++i) h[i] = input(r, it, i);
        M3_CUDA_CHECK(cudaMemcpyAsync(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
        if (exec != nullptr) {
          M3_CUDA_CHECK(cudaGraphLaunch(exec, s));
        } else {
          group->all_reduce_sum(r, d, n, s);
        }
        M3_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
        M3_CUDA_CHECK(cudaStreamSynchronize(s));
        if (!bitwise_equal(h, want_sum(W, it, n)))
          failures[r].push_back("call " + std::to_string(it) + " of " + std::to_string(n) +
                                " floats differs from the rank-order sum");
      };
      int it = 0;
      for (int rep = 0; rep < 3; ++rep)
        for (int64_t n : sizes) run_one(it++, n, nullptr);
      // One call captured, replayed with new inputs (the epochs live on the device).
      const int64_t n = 6144;
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      M3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      group->all_reduce_sum(r, d, n, s);
      M3_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      M3_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 4; ++rep) run_one(it++, n, exec);
      run_one(it++, 7, nullptr);  // eager again after the replays
      if (std::string f = group->fault(r); !f.empty()) failures[r].push_back(f);
      M3_CUDA_CHECK(cudaGraphExecDestroy(exec));
      M3_CUDA_CHECK(cudaGraphDestroy(graph));
      M3_CUDA_CHECK(cudaFree(d));
      M3_CUDA_CHECK(cudaStreamDestroy(s));
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r)
    for (const auto& f : failures[r]) ADD_FAILURE() << "rank " << r << ": " << f;
}

INSTANTIATE_TEST_SUITE_P(Ranks, OneShot, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(OneShotAllReduce, RefusesOneRankAndMoreThanEight) {
  EXPECT_FALSE(OneShotAllReduce::create(1, 16).has_value());
  auto g = OneShotAllReduce::create(9, 16);
  ASSERT_FALSE(g.has_value());
  EXPECT_NE(g.error().message.find("2..8 ranks"), std::string::npos) << g.error().message;
}

}  // namespace
}  // namespace m3::dist
