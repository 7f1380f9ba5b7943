// Seeds mean the same on both backends: seeded requests (temperature, top_k, top_p, min_p, one
// with logprobs so the host samples its row) batched through the engine on the CPU backend and
// on the CUDA backend give the same tokens, which are the scheduler-free CPU logits drawn by
// kernels::cpu::sample_rows (the GPU sampler's oracle). Skips where no GPU is usable.
//
// Tolerance: the GPU logits differ from the CPU ones by summation order, so a draw whose
// Gumbel-max winner leads by less than kGreedyMarginFloor (the greedy margin floor of the golden
// tests, tests/model/golden_util.h, in the same logit units) may flip; each request is compared
// up to its first such step (reference_sampled's num_stable). The CPU backend has no such excuse
// and must match the reference in full.
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "gpu_test_util.h"
#include "model/m3_model.h"
#include "runtime/cuda/cuda_backend.h"
#include "unit/engine/engine_test_util.h"

namespace m3::engine {
namespace {

using testing::kModel;
using testing::reference_sampled;
using testing::seeded_requests;

EngineConfig engine_config(int block_size, BackendFactory factory) {
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = block_size;
  cfg.max_model_len = 256;
  cfg.max_num_batched_tokens = 32;  // chunked prefill next to decodes
  cfg.backend_factory = std::move(factory);
  return cfg;
}

TEST(SamplingCuda, SeededRequestsGiveTheSameTokensOnCpuAndGpu) {
  SKIP_WITHOUT_GPU();
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int bs = static_cast<int>((*m)->config().sparse_block_size);
  auto cpu = Engine::create(engine_config(bs, nullptr));
  ASSERT_TRUE(cpu.has_value()) << cpu.error().message;
  runtime::CudaBackendOptions opts;
  opts.gpu_memory_utilization = 0.05;  // a small slice: other tests may share the GPU
  auto gpu =
      Engine::create(engine_config(bs, [opts](std::unique_ptr<model::M3Model> host, int64_t) {
        return runtime::make_cuda_backend(std::move(host), opts);
      }));
  ASSERT_TRUE(gpu.has_value()) << gpu.error().message;
  ASSERT_EQ((*gpu)->model_info().device.rfind("cuda", 0), 0u) << (*gpu)->model_info().device;

  const auto reqs = seeded_requests(static_cast<int>((*cpu)->model_info().vocab_size));
  const auto on_cpu = testing::generate_all(**cpu, reqs);
  const auto on_gpu = testing::generate_all(**gpu, reqs);
  ASSERT_EQ(on_cpu.size(), reqs.size());
  ASSERT_EQ(on_gpu.size(), reqs.size());
  size_t compared = 0, total = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto ref =
        reference_sampled(**m, reqs[i], static_cast<float>(model::golden::kGreedyMarginFloor));
    EXPECT_EQ(on_cpu[i], ref.tokens) << "CPU backend, seed " << *reqs[i].params.seed;
    ASSERT_EQ(on_gpu[i].size(), ref.tokens.size());
    const std::vector<int32_t> gpu_prefix(on_gpu[i].begin(), on_gpu[i].begin() + ref.num_stable);
    const std::vector<int32_t> ref_prefix(ref.tokens.begin(), ref.tokens.begin() + ref.num_stable);
    EXPECT_EQ(gpu_prefix, ref_prefix) << "GPU backend, seed " << *reqs[i].params.seed << ", first "
                                      << ref.num_stable << " tokens";
    compared += ref.num_stable;
    total += ref.tokens.size();
  }
  // Near-flips are rare (a winner's lead is below 4e-3 in well under 1% of draws), so almost
  // every token is compared; a test that compared none would prove nothing.
  EXPECT_GE(compared * 2, total) << compared << " of " << total << " tokens compared";
}

}  // namespace
}  // namespace m3::engine
