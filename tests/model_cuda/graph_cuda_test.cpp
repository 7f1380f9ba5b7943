// CUDA-graph replay of decode steps (M3ModelCuda::forward) equals eager execution bit for bit:
// two models from the same weights, one replaying graphs and one with graphs off, run the same
// prefill and decode steps on their own caches, feeding both the eager model's greedy tokens.
// Checked on a golden checkpoint (MSA with small blocks, so the bucketed key bound and the
// block tables move across steps) and on synthetic weights at M3's real shapes (4 layers: dense
// and MoE + MSA), where the decode batch crosses pages while graphs replay. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/synthetic_model.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

using m3::testing::gpu_unavailable_reason;
using m3::testing::kU;
using m3::testing::randn;
using m3::testing::to_bf16;

int32_t argmax_row(const std::vector<float>& logits, int64_t row, int64_t vocab) {
  auto b = logits.begin() + row * vocab;
  return static_cast<int32_t>(std::max_element(b, b + vocab) - b);
}

// Prefills `prompts`, then decodes `steps` tokens for all of them in one batch per step, on a
// graph model and an eager model; every step's logits must be identical.
void expect_graphs_equal_eager(M3ModelCuda& graph, M3ModelCuda& eager,
                               const std::vector<std::vector<int32_t>>& prompts, int steps) {
  ASSERT_TRUE(graph.use_graphs());
  eager.set_use_graphs(false);
  int64_t total = 0;
  for (const auto& p : prompts) total += static_cast<int64_t>(p.size()) + steps + 1;
  const int64_t n = static_cast<int64_t>(prompts.size());
  SequenceRunner rg(borrow_cuda_backend(graph, total, n)), re(borrow_cuda_backend(eager, total, n));
  std::vector<SequenceChunk> chunks;
  for (const auto& p : prompts) {
    const int sg = rg.add_sequence(), se = re.add_sequence();
    ASSERT_EQ(sg, se);
    chunks.push_back({sg, p, false});
  }
  ForwardResult og = rg.step(chunks), oe = re.step(chunks);
  ASSERT_EQ(og.logits, oe.logits) << "prefill";
  const int64_t V = oe.vocab_size;
  std::vector<int32_t> next(n);
  for (int s = 0; s < steps; ++s) {
    std::vector<SequenceChunk> dec;
    for (int64_t i = 0; i < n; ++i) {
      next[i] = argmax_row(oe.logits, i, V);
      dec.push_back({static_cast<int>(i), std::span<const int32_t>(&next[i], 1), false});
    }
    og = rg.step(dec);
    oe = re.step(dec);
    ASSERT_EQ(og.logits.size(), oe.logits.size());
    for (size_t j = 0; j < og.logits.size(); ++j)
      ASSERT_EQ(og.logits[j], oe.logits[j]) << "decode step " << s << " entry " << j;
  }
  // The first decode step of a shape runs eagerly, the second captures, the rest replay; a
  // block table outgrowing its buffer costs one eager step and one capture again.
  EXPECT_GE(graph.graph_captures(), 1);
  EXPECT_GE(graph.graph_replays(), steps / 2);
  EXPECT_EQ(eager.graph_replays(), 0);
}

std::vector<int32_t> random_ids(int n, uint32_t seed, int64_t vocab) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(CudaGraphs, ReplayEqualsEagerOnGoldenCheckpoint) {
  SKIP_WITHOUT_GPU();
  const std::string dir = std::string(M3_SOURCE_DIR) + "/tests/golden/model/msa_small_blocks";
  auto g = M3ModelCuda::load(dir);
  auto e = M3ModelCuda::load(dir);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  ASSERT_TRUE(e.has_value()) << e.error().message;
  const int64_t V = (*g)->config().vocab_size;
  // Three sequences of different lengths; 40 decode steps cross several small MSA blocks.
  expect_graphs_equal_eager(**g, **e,
                            {random_ids(37, 1, V), random_ids(70, 2, V), random_ids(5, 3, V)}, 40);
}

TEST(CudaGraphs, ReplayEqualsEagerAtM3Shapes) {
  SKIP_WITHOUT_GPU();
  const M3Config cfg = synthetic_m3_config(4);
  auto g = M3ModelCuda::synthetic(cfg, 3);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  auto e = M3ModelCuda::synthetic(cfg, 3);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  std::vector<std::vector<int32_t>> prompts;
  // Eight sequences; the longest starts 3 tokens before a page boundary and has more than 16
  // blocks of context, so MSA selects while the graph replays across the page boundary.
  for (int i = 0; i < 8; ++i)
    prompts.push_back(random_ids(i == 0 ? 2301 : 100 + 37 * i, 10 + i, 200000));
  expect_graphs_equal_eager(**g, **e, prompts, 8);
}

}  // namespace
}  // namespace m3::model

namespace m3::model {
namespace {

// --compilation-config cudagraph_capture_sizes: only the listed step sizes replay graphs; a
// 3-sequence decode step with sizes {1, 2} runs eagerly (and still equals the eager model).
TEST(CudaGraphs, OnlyTheListedStepSizesReplay) {
  SKIP_WITHOUT_GPU();
  const std::string dir = std::string(M3_SOURCE_DIR) + "/tests/golden/model/msa_small_blocks";
  auto g = M3ModelCuda::load(dir);
  auto e = M3ModelCuda::load(dir);
  ASSERT_TRUE(g.has_value() && e.has_value());
  const int64_t V = (*g)->config().vocab_size;
  (*g)->set_graph_sizes({1, 2});
  (*e)->set_use_graphs(false);
  SequenceRunner rg(borrow_cuda_backend(**g, 400, 3)), re(borrow_cuda_backend(**e, 400, 3));
  std::vector<std::vector<int32_t>> prompts = {random_ids(9, 4, V), random_ids(14, 5, V),
                                               random_ids(6, 6, V)};
  std::vector<SequenceChunk> chunks;
  for (const auto& p : prompts) chunks.push_back({rg.add_sequence(), p, false});
  for (size_t i = 0; i < prompts.size(); ++i) re.add_sequence();
  ForwardResult og = rg.step(chunks), oe = re.step(chunks);
  ASSERT_EQ(og.logits, oe.logits);
  std::vector<int32_t> next(3);
  for (int s = 0; s < 6; ++s) {
    std::vector<SequenceChunk> dec;
    for (int i = 0; i < 3; ++i) {
      next[i] = argmax_row(oe.logits, i, V);
      dec.push_back({i, std::span<const int32_t>(&next[i], 1), false});
    }
    og = rg.step(dec);
    oe = re.step(dec);
    ASSERT_EQ(og.logits, oe.logits) << "step " << s;
  }
  EXPECT_EQ((*g)->graph_replays(), 0) << "3-token steps are not a listed size";
  // A 2-token step is: after its eager first run it is captured and replayed.
  for (int s = 0; s < 4; ++s) {
    std::vector<SequenceChunk> dec;
    for (int i = 0; i < 2; ++i) {
      next[i] = argmax_row(oe.logits, i, V);
      dec.push_back({i, std::span<const int32_t>(&next[i], 1), false});
    }
    og = rg.step(dec);
    oe = re.step(dec);
    ASSERT_EQ(og.logits, oe.logits) << "2-token step " << s;
  }
  EXPECT_GE((*g)->graph_replays(), 2);
}

}  // namespace
}  // namespace m3::model

namespace m3::model {
namespace {

// The logits of a prefill and `steps` greedy decode steps (graphs on) of `prompts` on `m`.
std::vector<std::vector<float>> greedy_logits(M3ModelCuda& m,
                                              const std::vector<std::vector<int32_t>>& prompts,
                                              int steps) {
  int64_t total = 0;
  for (const auto& p : prompts) total += static_cast<int64_t>(p.size()) + steps + 1;
  const int64_t n = static_cast<int64_t>(prompts.size());
  SequenceRunner r(borrow_cuda_backend(m, total, n));
  std::vector<SequenceChunk> chunks;
  for (const auto& p : prompts) chunks.push_back({r.add_sequence(), p, false});
  std::vector<std::vector<float>> all;
  ForwardResult o = r.step(chunks);
  all.push_back(o.logits);
  std::vector<int32_t> next(n);
  for (int s = 0; s < steps; ++s) {
    std::vector<SequenceChunk> dec;
    for (int64_t i = 0; i < n; ++i) {
      next[i] = argmax_row(o.logits, i, o.vocab_size);
      dec.push_back({static_cast<int>(i), std::span<const int32_t>(&next[i], 1), false});
    }
    o = r.step(dec);
    all.push_back(o.logits);
  }
  return all;
}

// Programmatic dependent launch (kernels/cuda/ops.h launch_overlap): the decode kernels started
// while the kernel ahead of them finishes give the logits of serial launches bit for bit, eager
// and graph-replayed, at batch 1 (the fused router and the shared expert's GEMV slot) and 8.
TEST(CudaGraphs, OverlappedLaunchesEqualSerialLaunches) {
  SKIP_WITHOUT_GPU();
  const bool before = kernels::cuda::launch_overlap();
  const M3Config cfg = synthetic_m3_config(4);
  for (int batch : {1, 8}) {
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < batch; ++i)
      prompts.push_back(random_ids(i == 0 ? 2301 : 100 + 37 * i, 20 + i, 200000));
    std::vector<std::vector<std::vector<float>>> runs;
    for (bool overlap : {false, true}) {
      kernels::cuda::set_launch_overlap(overlap);
      auto m = M3ModelCuda::synthetic(cfg, 3);
      ASSERT_TRUE(m.has_value()) << m.error().message;
      runs.push_back(greedy_logits(**m, prompts, 12));
      EXPECT_GE((*m)->graph_replays(), 6);
    }
    ASSERT_EQ(runs[0].size(), runs[1].size());
    for (size_t s = 0; s < runs[0].size(); ++s)
      ASSERT_EQ(runs[0][s], runs[1][s]) << "batch " << batch << " step " << s;
  }
  kernels::cuda::set_launch_overlap(before);
}

}  // namespace
}  // namespace m3::model
