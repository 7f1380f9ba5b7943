// The GPU ForwardBackend (runtime/cuda/cuda_backend.h) behind the engine, as `serve --device cuda`
// wires it: greedy tokens through the engine on the GPU equal the transformers goldens (up to the
// first near-tie), the KV pool is sized from the free memory or an explicit byte count, and bad
// sizing values are refused with the flag named. GPU tests skip where no GPU is usable; the
// argument checks run everywhere (they fail before touching the device).
//
// Tolerance: kGreedyMarginFloor is model_cuda_test's (the CPU golden test's, derived there): a
// greedy step whose top-2 logprob margin in the golden is below it may flip on summation order,
// so the comparison stops at the first such step.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "engine/engine.h"
#include "gpu/device.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "runtime/cuda/cuda_backend.h"

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kGreedyMarginFloor = 4e-3;
const std::string kModel = std::string(M3_SOURCE_DIR) + "/tests/golden/model/msa_small_blocks";

std::string no_gpu_reason() {
  auto info = gpu::probe_device(0);
  return info ? std::string() : info.error().message;
}

engine::BackendFactory cuda_factory(CudaBackendOptions opts) {
  return [opts](std::unique_ptr<M3Model> host, int64_t) {
    return make_cuda_backend(std::move(host), opts);
  };
}

engine::EngineConfig engine_config(CudaBackendOptions opts) {
  engine::EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;  // msa_small_blocks' sparse_block_size
  cfg.max_model_len = 256;
  cfg.backend_factory = cuda_factory(opts);
  return cfg;
}

// A golden case as a greedy request up to its first near-tie, and the tokens it must give.
struct GreedyCase {
  std::string name;
  engine::GenerateRequest request;
  std::vector<int32_t> want;
};
std::vector<GreedyCase> greedy_cases() {
  std::ifstream f(fs::path(kModel) / "golden.json");
  const json golden = json::parse(f);
  std::vector<GreedyCase> out;
  for (const auto& c : golden["cases"]) {
    const auto want = c["greedy_ids"].get<std::vector<int32_t>>();
    const auto margin = c["greedy_margin"].get<std::vector<double>>();
    size_t n = 0;
    while (n < want.size() && margin[n] >= kGreedyMarginFloor) ++n;
    if (n == 0) continue;
    GreedyCase g;
    g.name = c["name"].get<std::string>();
    g.request.prompt_token_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    g.request.params.temperature = 0;
    g.request.params.max_tokens = static_cast<int>(n);
    g.request.params.ignore_eos = true;
    g.want.assign(want.begin(), want.begin() + n);
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<int32_t> collect(engine::RequestStream& s) {
  std::vector<int32_t> got;
  for (;;) {
    auto o = s.next(std::chrono::milliseconds(120000));
    if (!o) {
      ADD_FAILURE() << "stream timed out";
      return got;
    }
    got.insert(got.end(), o->new_token_ids.begin(), o->new_token_ids.end());
    if (o->finished) return got;
  }
}

TEST(CudaBackend, UtilizationOutsideZeroOneIsRefusedNamingTheFlag) {
  for (double u : {0.0, -0.5, 1.01}) {
    CudaBackendOptions opts;
    opts.gpu_memory_utilization = u;
    auto e = engine::Engine::create(engine_config(opts));
    ASSERT_FALSE(e.has_value());
    EXPECT_NE(e.error().message.find("--gpu-memory-utilization"), std::string::npos)
        << e.error().message;
  }
}

TEST(CudaBackend, EngineGreedyOnTheGpuMatchesTransformers) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  CudaBackendOptions opts;
  opts.gpu_memory_utilization = 0.05;  // a small slice: other tests may share the GPU
  auto e = engine::Engine::create(engine_config(opts));
  ASSERT_TRUE(e.has_value()) << e.error().message;
  const auto& info = (*e)->model_info();
  EXPECT_EQ(info.device.rfind("cuda:0", 0), 0u) << info.device;
  EXPECT_GE(info.num_kv_blocks * info.block_size, 256);
  for (const auto& g : greedy_cases()) {
    auto s = (*e)->submit(g.request);
    ASSERT_TRUE(s.has_value()) << s.error().message;
    EXPECT_EQ(collect(**s), g.want) << g.name;
  }
}

// Continuous batching on the GPU: every golden case submitted at once, twice (so steps mix
// prefill chunks of some requests with decodes of others, and replay CUDA graphs), must give the
// tokens each gives alone, i.e. the goldens' greedy prefix up to the first near-tie.
TEST(CudaBackend, ConcurrentRequestsGiveTheSequentialTokens) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  CudaBackendOptions opts;
  opts.gpu_memory_utilization = 0.05;
  auto cfg = engine_config(opts);
  cfg.max_num_seqs = 16;
  cfg.max_num_batched_tokens = 96;  // prompts longer than this are prefilled in chunks
  auto e = engine::Engine::create(cfg);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  const auto cases = greedy_cases();
  ASSERT_GE(cases.size(), 2u);
  std::vector<std::shared_ptr<engine::RequestStream>> streams;
  for (int rep = 0; rep < 2; ++rep) {
    for (const auto& g : cases) {
      auto s = (*e)->submit(g.request);
      ASSERT_TRUE(s.has_value()) << s.error().message;
      streams.push_back(*s);
    }
  }
  for (size_t i = 0; i < streams.size(); ++i)
    EXPECT_EQ(collect(*streams[i]), cases[i % cases.size()].want) << cases[i % cases.size()].name;
}

// Async scheduling on the GPU (the default there): decode steps launched behind the running
// one, their inputs gathered from its samples on the device, give exactly the synchronous loop's
// outputs: greedy tokens, seeded draws, logprobs (host-sampled rows), stop ids and lengths.
TEST(CudaBackend, AsyncSchedulingGivesTheSynchronousOutputs) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  CudaBackendOptions opts;
  opts.gpu_memory_utilization = 0.05;
  std::vector<engine::GenerateRequest> reqs;
  for (const auto& g : greedy_cases()) reqs.push_back(g.request);
  ASSERT_GE(reqs.size(), 2u);
  for (int i = 0; i < 4; ++i) {
    engine::GenerateRequest r = reqs[i % reqs.size()];
    r.params.temperature = 0.8f + 0.1f * i;
    r.params.seed = 5 + i;
    r.params.max_tokens = 12 + i;
    if (i == 1) r.params.logprobs = 2;  // sampled on the host: that step runs synchronously
    if (i == 2) r.params.top_k = 20;
    reqs.push_back(r);
  }
  {
    engine::GenerateRequest r = reqs[0];
    r.params.max_tokens = 20;
    r.params.stop_token_ids = {reqs[0].prompt_token_ids[0], 7, 11};
    r.params.ignore_eos = false;
    reqs.push_back(r);
  }
  auto run = [&](bool async, int64_t* ahead) {
    auto cfg = engine_config(opts);
    cfg.max_num_seqs = 6;
    cfg.max_num_batched_tokens = 64;
    cfg.async_scheduling = async;
    auto e = engine::Engine::create(cfg);
    EXPECT_TRUE(e.has_value()) << e.error().message;
    std::vector<std::shared_ptr<engine::RequestStream>> streams;
    for (const auto& r : reqs) streams.push_back(*(*e)->submit(r));
    std::vector<std::vector<int32_t>> out;
    for (auto& s : streams) out.push_back(collect(*s));
    *ahead = (*e)->stats().steps_launched_ahead;
    EXPECT_EQ((*e)->model_info().async_scheduling, async);
    return out;
  };
  int64_t ahead_sync = 0, ahead_async = 0;
  const auto want = run(false, &ahead_sync);
  const auto got = run(true, &ahead_async);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  EXPECT_EQ(ahead_sync, 0);
  EXPECT_GT(ahead_async, 10);
}

TEST(CudaBackend, ExplicitBytesGiveExactlyThatManyPages) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  auto host = M3Model::load(kModel);
  ASSERT_TRUE(host.has_value());
  CudaBackendOptions opts;
  opts.kv_cache_memory_bytes = 40 * KvCache::page_bytes((*host)->config()) + 1;
  auto b = make_cuda_backend(std::move(*host), opts);
  ASSERT_TRUE(b.has_value()) << b.error().message;
  EXPECT_EQ((*b)->num_pages(), 40);
  EXPECT_EQ((*b)->kv_cache_flag(), "--kv-cache-memory-bytes");
}

TEST(CudaBackend, BudgetsThatCannotFitAreRefusedWithTheNumbers) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  {
    auto host = M3Model::load(kModel);
    ASSERT_TRUE(host.has_value());
    CudaBackendOptions opts;
    opts.kv_cache_memory_bytes = int64_t{1} << 50;  // 1 PiB
    auto b = make_cuda_backend(std::move(*host), opts);
    ASSERT_FALSE(b.has_value());
    EXPECT_NE(b.error().message.find("free after the weights"), std::string::npos)
        << b.error().message;
  }
  {
    auto host = M3Model::load(kModel);
    ASSERT_TRUE(host.has_value());
    CudaBackendOptions opts;
    opts.kv_cache_memory_bytes = 1;  // under one page
    auto b = make_cuda_backend(std::move(*host), opts);
    ASSERT_FALSE(b.has_value());
    EXPECT_NE(b.error().message.find("no KV page fits"), std::string::npos) << b.error().message;
  }
}

}  // namespace
}  // namespace m3::model
