// The engine's backend seam (EngineConfig::backend_factory, runtime/forward_backend.h): an injected
// backend is what the engine runs, its page count is the scheduler's pool, its device name and KV
// flag reach ModelInfo and the errors, and the CPU backend through a factory gives the same
// greedy tokens as the scheduler-free SequenceRunner; a backend with KV partitions (attention
// data parallel) gets sequences whose pages stay in one partition, spread over all of them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <random>

#include "engine/engine.h"
#include "kernels/cpu/sample.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"
#include "unit/engine/engine_test_util.h"

namespace m3::engine {
namespace {

using testing::kModel;
using testing::random_prompt;
using testing::reference_greedy;

// The tokens of a finished stream and its finish reason.
std::vector<int32_t> collect(RequestStream& s, std::string* finish_reason) {
  auto c = testing::collect(s);
  *finish_reason = c.last.finish_reason;
  return c.tokens;
}

// What the engine did through the seam, read after the engine is gone or idle.
struct Record {
  int64_t factory_cpu_num_pages = -1;
  int forwards = 0;
  int64_t tokens = 0;
  int32_t max_page_id = -1;
};

// Delegates to the real CPU backend and records every call the engine makes.
class RecordingBackend final : public runtime::ForwardBackend {
 public:
  RecordingBackend(std::unique_ptr<runtime::ForwardBackend> inner, Record* rec)
      : inner_(std::move(inner)), rec_(rec) {}
  const model::M3Config& config() const override { return inner_->config(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  void forward(const model::ForwardBatch& b, model::ForwardResult* out, bool capture) override {
    ++rec_->forwards;
    rec_->tokens += static_cast<int64_t>(b.token_ids.size());
    for (int32_t p : b.block_table) rec_->max_page_id = std::max(rec_->max_page_id, p);
    inner_->forward(b, out, capture);
  }
  std::string device_name() const override { return "recording(" + inner_->device_name() + ")"; }
  std::string kv_cache_flag() const override { return "--recording-pool"; }

 private:
  std::unique_ptr<runtime::ForwardBackend> inner_;
  Record* rec_;
};

// A factory giving the CPU backend `pages` pages (ignoring the engine's CPU sizing), recorded.
BackendFactory recording_factory(int64_t pages, Record* rec) {
  return [pages, rec](std::unique_ptr<model::M3Model> host,
                      int64_t cpu_num_pages) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
    rec->factory_cpu_num_pages = cpu_num_pages;
    M3_TRY(auto inner, runtime::make_cpu_backend(std::move(host), pages));
    return std::unique_ptr<runtime::ForwardBackend>(new RecordingBackend(std::move(inner), rec));
  };
}

TEST(EngineBackend, InjectedCpuBackendGivesTheReferenceGreedyTokens) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const auto& mc = (*m)->config();
  Record rec;
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = static_cast<int>(mc.sparse_block_size);
  cfg.max_model_len = 96;
  cfg.max_num_seqs = 4;
  // The engine sizes 500 CPU pages; the backend keeps 14, so four 40-token sequences (5 pages
  // each at the end) must preempt: only the backend's count can have been the scheduler's pool.
  cfg.kv_cache_memory_bytes = 500 * model::KvCache::page_bytes(mc);
  cfg.backend_factory = recording_factory(14, &rec);
  auto e = Engine::create(cfg);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  EXPECT_EQ(rec.factory_cpu_num_pages, 500);
  EXPECT_EQ((*e)->model_info().num_kv_blocks, 14);
  EXPECT_EQ((*e)->model_info().kv_tokens, 14 * mc.sparse_block_size);
  EXPECT_EQ((*e)->model_info().device, "recording(cpu)");
  EXPECT_EQ((*e)->stats().num_kv_blocks, 14);

  const int V = static_cast<int>((*e)->model_info().vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(20, 31 + i, V));
    GenerateRequest r;
    r.prompt_token_ids = prompts.back();
    r.params.temperature = 0;
    r.params.max_tokens = 20;
    r.params.ignore_eos = true;
    auto s = (*e)->submit(r);
    ASSERT_TRUE(s.has_value()) << s.error().message;
    streams.push_back(*s);
  }
  for (int i = 0; i < 4; ++i) {
    std::string reason;
    EXPECT_EQ(collect(*streams[i], &reason), reference_greedy(**m, prompts[i], 20)) << i;
    EXPECT_EQ(reason, "length");
  }
  EXPECT_GT((*e)->stats().num_preemptions, 0) << "a 14-page pool was meant to force preemption";
  (*e)->shutdown(true);
  // Every step went through the injected backend, and only its pages were handed out. At least
  // 4 x 20 prompt tokens and 4 x 19 decode inputs were computed (more after preemption).
  EXPECT_GE(rec.tokens, 4 * 20 + 4 * 19);
  EXPECT_GE(rec.forwards, 20);
  EXPECT_GE(rec.max_page_id, 0);
  EXPECT_LT(rec.max_page_id, 14);
}

// A backend that samples "on the device" the way the GPU backend does (kernels/cpu/sample_rows
// is the GPU sampler's oracle) and returns only the logits rows the runner asks for.
struct DeviceRecord {
  int64_t device_rows = 0;
  int64_t host_rows = 0;
};
class DeviceSamplingBackend final : public runtime::ForwardBackend {
 public:
  DeviceSamplingBackend(std::unique_ptr<runtime::ForwardBackend> inner, DeviceRecord* rec)
      : inner_(std::move(inner)), rec_(rec) {}
  const model::M3Config& config() const override { return inner_->config(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  bool samples_on_device() const override { return true; }
  void forward(const model::ForwardBatch& b, model::ForwardResult* out, bool capture) override {
    model::ForwardResult full;
    model::ForwardBatch all_rows = b;  // the inner CPU backend returns every row's logits then
    all_rows.device_samples.clear();
    all_rows.host_logits_rows.clear();
    inner_->forward(all_rows, &full, capture);
    const int64_t V = full.vocab_size;
    out->vocab_size = V;
    out->sampled.assign(b.device_samples.size(), -1);
    if (!b.device_samples.empty()) {
      kernels::cpu::sample_rows(full.logits.data(), V, b.num_sampleable, b.device_samples.data(),
                                static_cast<int64_t>(b.device_samples.size()), out->sampled.data());
    }
    out->logits_rows = b.host_logits_rows;
    out->logits.clear();
    for (int32_t r : b.host_logits_rows)
      out->logits.insert(out->logits.end(), full.logits.begin() + r * V,
                         full.logits.begin() + (r + 1) * V);
    rec_->device_rows += static_cast<int64_t>(b.device_samples.size());
    rec_->host_rows += static_cast<int64_t>(b.host_logits_rows.size());
  }
  std::string device_name() const override { return "device-sampling"; }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }

 private:
  std::unique_ptr<runtime::ForwardBackend> inner_;
  DeviceRecord* rec_;
};

std::unique_ptr<Engine> device_sampling_engine(DeviceRecord* rec) {
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;
  cfg.max_model_len = 96;
  cfg.max_num_seqs = 4;
  cfg.backend_factory = [rec](std::unique_ptr<model::M3Model> host,
                              int64_t pages) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
    M3_TRY(auto inner, runtime::make_cpu_backend(std::move(host), pages));
    return std::unique_ptr<runtime::ForwardBackend>(
        new DeviceSamplingBackend(std::move(inner), rec));
  };
  auto e = Engine::create(cfg);
  EXPECT_TRUE(e.has_value()) << e.error().message;
  return e ? std::move(*e) : nullptr;
}

TEST(EngineBackend, DeviceSamplingGreedyEqualsReferenceAndSeedsReproduce) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  DeviceRecord rec;
  auto e = device_sampling_engine(&rec);
  ASSERT_NE(e, nullptr);
  const int V = static_cast<int>(e->model_info().vocab_size);
  const auto prompt = random_prompt(20, 77, V);
  auto run = [&](float t, std::optional<uint64_t> seed, int logprobs) {
    GenerateRequest r;
    r.prompt_token_ids = prompt;
    r.params.temperature = t;
    r.params.seed = seed;
    r.params.max_tokens = 12;
    r.params.ignore_eos = true;
    r.params.logprobs = logprobs;
    auto s = e->submit(r);
    EXPECT_TRUE(s.has_value());
    std::string reason;
    return collect(**s, &reason);
  };
  EXPECT_EQ(run(0.f, std::nullopt, -1), reference_greedy(**m, prompt, 12));
  const int64_t device_rows = rec.device_rows;
  EXPECT_GE(device_rows, 12) << "greedy rows should have been sampled on the device";
  const auto a = run(1.5f, 5, -1), b = run(1.5f, 5, -1), c = run(1.5f, 6, -1);
  EXPECT_EQ(a, b) << "same seed, same tokens";
  EXPECT_NE(a, c) << "another seed should draw other tokens at temperature 1.5";
  // A request with logprobs needs its raw row: it is sampled on the host from copied logits.
  const int64_t host_before = rec.host_rows;
  EXPECT_EQ(run(0.f, std::nullopt, 2), reference_greedy(**m, prompt, 12));
  EXPECT_GE(rec.host_rows - host_before, 12);
  e->shutdown(true);
}

TEST(EngineBackend, FactoryErrorsReachTheCaller) {
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;
  cfg.backend_factory = [](std::unique_ptr<model::M3Model>,
                           int64_t) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
    return make_error(ErrorCode::kUnavailable, "test device is unplugged; use --device cpu",
                      "--device");
  };
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.error().code, ErrorCode::kUnavailable);
  EXPECT_EQ(e.error().message, "test device is unplugged; use --device cpu");
}

TEST(EngineBackend, ABackendPoolTooSmallForMaxModelLenNamesTheBackendsFlag) {
  Record rec;
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;
  cfg.max_model_len = 96;  // 12 pages of 8 tokens; the backend has 2
  cfg.backend_factory = recording_factory(2, &rec);
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.has_value());
  const std::string& msg = e.error().message;
  EXPECT_NE(msg.find("--recording-pool"), std::string::npos) << msg;
  EXPECT_NE(msg.find("recording(cpu)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has 2 pages = 16 tokens"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("--kv-cache-memory-bytes"), std::string::npos) << msg;
}

// The CPU backend presented as 2 KV partitions (what the GPU attention-DP backend reports): pages
// [0, P) and [P, 2P). Records, per step, each sequence's partition and any page outside it.
struct PartitionRecord {
  int seqs = 0, crossing = 0;
  int on[2] = {0, 0};
};

class TwoPartitionBackend final : public runtime::ForwardBackend {
 public:
  TwoPartitionBackend(std::unique_ptr<runtime::ForwardBackend> inner, PartitionRecord* rec)
      : inner_(std::move(inner)), rec_(rec) {}
  const model::M3Config& config() const override { return inner_->config(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  int num_kv_partitions() const override { return 2; }
  void forward(const model::ForwardBatch& b, model::ForwardResult* out, bool capture) override {
    const int64_t P = num_pages() / 2;
    for (size_t s = 0; s + 1 < b.block_table_offsets.size(); ++s) {
      if (b.block_table_offsets[s + 1] == b.block_table_offsets[s]) continue;
      const int64_t part = b.block_table[b.block_table_offsets[s]] / P;
      ++rec_->seqs;
      ++rec_->on[part];
      for (int32_t i = b.block_table_offsets[s]; i < b.block_table_offsets[s + 1]; ++i)
        rec_->crossing += b.block_table[i] / P != part;
    }
    inner_->forward(b, out, capture);
  }
  std::string device_name() const override { return "partitioned(cpu)"; }
  std::string kv_cache_flag() const override { return "--partitioned-pool"; }

 private:
  std::unique_ptr<runtime::ForwardBackend> inner_;
  PartitionRecord* rec_;
};

BackendFactory two_partition_factory(int64_t pages, PartitionRecord* rec) {
  return [pages, rec](std::unique_ptr<model::M3Model> host,
                      int64_t) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
    M3_TRY(auto inner, runtime::make_cpu_backend(std::move(host), pages));
    return std::unique_ptr<runtime::ForwardBackend>(new TwoPartitionBackend(std::move(inner), rec));
  };
}

// --max-model-len is checked against one partition's pages (a sequence cannot span two), and
// caps the default.
TEST(EngineBackend, KvPartitionsLimitMaxModelLenToOnePartition) {
  PartitionRecord rec;
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;
  cfg.max_model_len = 100;  // 13 pages of 8; 24 pages in all but 12 per partition
  cfg.backend_factory = two_partition_factory(24, &rec);
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.error().message.find("96 tokens in each of its 2 data-parallel partitions"),
            std::string::npos)
      << e.error().message;
  cfg.max_model_len = 96;
  ASSERT_TRUE(Engine::create(cfg).has_value());
  cfg.max_model_len = 0;  // unset: one partition's tokens
  auto e3 = Engine::create(cfg);
  ASSERT_TRUE(e3.has_value()) << e3.error().message;
  EXPECT_EQ((*e3)->model_info().max_model_len, 96);
}

// Four greedy requests on a pool of 2 x 8 pages (each needs 5): they land in both partitions,
// no sequence ever has a page outside its partition, and the tokens equal the reference.
TEST(EngineBackend, KvPartitionsKeepEachSequenceInOnePartition) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  PartitionRecord rec;
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  cfg.max_model_len = 48;
  cfg.max_num_seqs = 4;
  cfg.backend_factory = two_partition_factory(16, &rec);
  auto e = Engine::create(cfg);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  const int V = static_cast<int>((*e)->model_info().vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(20, 31 + i, V));
    reqs.push_back(testing::greedy_request(prompts.back(), 20));
  }
  const auto outs = testing::generate_all(**e, reqs);
  ASSERT_EQ(outs.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(outs[i], reference_greedy(**m, prompts[i], 20)) << i;
  (*e)->shutdown(true);
  EXPECT_EQ(rec.crossing, 0);
  EXPECT_GT(rec.on[0], 0);
  EXPECT_GT(rec.on[1], 0);
}

TEST(EngineBackend, CpuBackendRefusesAnEmptyPool) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  auto b = runtime::make_cpu_backend(std::move(*m), 0);
  ASSERT_FALSE(b.has_value());
  EXPECT_NE(b.error().message.find("--kv-cache-memory-bytes"), std::string::npos);
}

}  // namespace
}  // namespace m3::engine
