// The GPU backend's host KV tier (runtime/cuda/host_kv_tier_cuda.h, CudaBackend's
// enable_host_kv_tier / copy_host_kv_pages): the copies move every array of every layer byte for
// byte, for every pair of KV and index-K formats, batching runs of consecutive pages and slots
// and copying a page out before the same step refills it; host memory that cannot be pinned is
// refused naming the flag; and through the engine on the GPU, a prefix evicted to the host and
// restored gives the greedy tokens of transformers (the golden) and the logprobs of the same
// prefix recomputed, bit for bit those of a device prefix-cache hit, with async scheduling too.
// Skips where no GPU is usable.
//
// Tolerance: recomputing the prefix runs a prefill of a different length than the one that wrote
// the restored pages (other GEMM tilings, other summation orders), so its logprobs match to
// kRecomputeTol (f32 KV: the differences are f32 rounding of a 2-layer model, ~1e-5 seen on the
// CPU; 2e-3 leaves room for the GPU's bf16 GEMMs), not exactly. A device prefix hit reads the
// very bytes a restore writes, so that comparison is exact (EXPECT_FLOAT_EQ: 4 ulps).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "engine/engine.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "model/config.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/kv_cache.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/host_kv_tier_cuda.h"

namespace m3::runtime {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using kernels::KvDtype;

constexpr double kRecomputeTol = 2e-3;
const std::string kModel = std::string(M3_SOURCE_DIR) + "/tests/golden/model/msa_small_blocks";

std::string no_gpu_reason() {
  auto info = gpu::probe_device(0);
  return info ? std::string() : info.error().message;
}

// Every array of every layer of `cache` (K, V, index-K, index-K scales), device pointer and bytes
// per page.
struct ArrayView {
  uint8_t* base;
  int64_t page_bytes;
};
std::vector<std::vector<ArrayView>> arrays_of(model::KvCacheCuda& cache) {
  std::vector<std::vector<ArrayView>> out;
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    const auto p = cache.layer(l);
    const int64_t kv =
        p.page_size * p.num_kv_heads * p.head_dim * kernels::kv_dtype_size(p.kv_dtype);
    std::vector<ArrayView> a{{static_cast<uint8_t*>(p.k), kv}, {static_cast<uint8_t*>(p.v), kv}};
    if (p.ik != nullptr)
      a.push_back({static_cast<uint8_t*>(p.ik),
                   p.page_size * p.index_dim * kernels::kv_dtype_size(p.ik_dtype)});
    if (p.ik_scale != nullptr)
      a.push_back({reinterpret_cast<uint8_t*>(p.ik_scale), p.page_size * 4});
    out.push_back(std::move(a));
  }
  return out;
}

std::vector<uint8_t> read_page(const ArrayView& a, int64_t page) {
  std::vector<uint8_t> b(static_cast<size_t>(a.page_bytes));
  M3_CUDA_CHECK(
      cudaMemcpy(b.data(), a.base + page * a.page_bytes, b.size(), cudaMemcpyDeviceToHost));
  return b;
}

// Random bytes into every page of every array.
void scramble(model::KvCacheCuda& cache, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& layer : arrays_of(cache)) {
    for (const ArrayView& a : layer) {
      std::vector<uint8_t> b(static_cast<size_t>(a.page_bytes * cache.num_pages()));
      for (auto& x : b) x = static_cast<uint8_t>(rng());
      M3_CUDA_CHECK(cudaMemcpy(a.base, b.data(), b.size(), cudaMemcpyHostToDevice));
    }
  }
}

TEST(HostKvTierCuda, CopiesRoundTripEveryArrayForEveryFormatPair) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  auto base = model::load_config(kModel);
  ASSERT_TRUE(base.has_value()) << base.error().message;
  ASSERT_GT(base->num_sparse_layers(), 0);
  ASSERT_LT(base->num_sparse_layers(), base->num_hidden_layers);  // dense and sparse layers
  gpu::Stream compute;
  for (KvDtype kv : {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8}) {
    for (KvDtype ik : {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8}) {
      SCOPED_TRACE(std::string(kernels::kv_dtype_name(kv)) + " KV, " + kernels::kv_dtype_name(ik) +
                   " index-K");
      model::M3Config cfg = *base;
      cfg.kv_cache_dtype = kv;
      cfg.index_cache_dtype = ik;
      model::KvCacheCuda cache(cfg, 12);
      auto tier = HostKvTierCuda::create(cache, 10);
      ASSERT_TRUE(tier.has_value()) << tier.error().message;
      EXPECT_EQ((*tier)->page_bytes(), model::KvCache::page_bytes(cfg));
      const auto arrays = arrays_of(cache);
      int64_t num_arrays = 0;
      for (const auto& l : arrays) num_arrays += static_cast<int64_t>(l.size());
      EXPECT_EQ(num_arrays, 2 * cfg.num_hidden_layers +
                                cfg.num_sparse_layers() * (ik == KvDtype::kFp8 ? 2 : 1));
      scramble(cache, 17);
      // Pages 2..4 -> slots 0..2 are one run; 7 -> 5 and 9 -> 3 are runs of one.
      const std::vector<HostPageCopy> out = {{9, 3}, {2, 0}, {7, 5}, {3, 1}, {4, 2}};
      std::vector<std::vector<std::vector<uint8_t>>> before(arrays.size());
      for (size_t l = 0; l < arrays.size(); ++l)
        for (const auto& a : arrays[l]) {
          std::vector<uint8_t> all;
          for (int64_t p = 0; p < 12; ++p) {
            auto b = read_page(a, p);
            all.insert(all.end(), b.begin(), b.end());
          }
          before[l].push_back(std::move(all));
        }
      (*tier)->enqueue(out, {}, compute.get());
      EXPECT_EQ((*tier)->last_num_copies(), 3 * num_arrays);
      EXPECT_EQ((*tier)->last_bytes(), 5 * (*tier)->page_bytes());
      (*tier)->synchronize();
      for (size_t l = 0; l < arrays.size(); ++l)
        for (size_t a = 0; a < arrays[l].size(); ++a)
          for (const HostPageCopy& c : out) {
            const int64_t pb = arrays[l][a].page_bytes;
            EXPECT_EQ(std::memcmp((*tier)->host_slot(static_cast<int64_t>(l), static_cast<int>(a),
                                                     c.host_slot),
                                  before[l][a].data() + c.device_page * pb, pb),
                      0)
                << "layer " << l << " array " << a << " page " << c.device_page;
          }
      // New bytes everywhere; then in one step: page 5 goes out to slot 6 and is refilled from
      // slot 0 (the offload must read it first), slots 0, 1 come back to pages 10, 11 (one
      // run), slot 5 to page 2 and slot 3 to page 0.
      scramble(cache, 99);
      std::vector<std::vector<std::vector<uint8_t>>> page5(arrays.size());
      for (size_t l = 0; l < arrays.size(); ++l)
        for (const auto& a : arrays[l]) page5[l].push_back(read_page(a, 5));
      const std::vector<HostPageCopy> offl = {{5, 6}};
      const std::vector<HostPageCopy> rest = {{10, 0}, {11, 1}, {2, 5}, {0, 3}, {5, 0}};
      (*tier)->enqueue(offl, rest, compute.get());
      (*tier)->synchronize();
      // {5 <- 0} and {10 <- 0, 11 <- 1} and 2 <- 5 and 0 <- 3: the restores sorted by page are
      // 0, 2, 5, 10, 11 with slots 3, 5, 0, 0, 1: one run of two.
      EXPECT_EQ((*tier)->last_num_copies(), (1 + 4) * num_arrays);
      for (size_t l = 0; l < arrays.size(); ++l)
        for (size_t a = 0; a < arrays[l].size(); ++a) {
          const int64_t pb = arrays[l][a].page_bytes;
          EXPECT_EQ(std::memcmp((*tier)->host_slot(static_cast<int64_t>(l), static_cast<int>(a), 6),
                                page5[l][a].data(), pb),
                    0)
              << "layer " << l << " array " << a << ": page 5 was not copied out first";
          // Slot s holds original page p (the first batch); each restored page must be it.
          const std::vector<std::pair<int64_t, int64_t>> want = {
              {10, 2}, {11, 3}, {2, 7}, {0, 9}, {5, 2}};
          for (const auto& [page, orig] : want) {
            const auto got = read_page(arrays[l][a], page);
            EXPECT_EQ(std::memcmp(got.data(), before[l][a].data() + orig * pb, pb), 0)
                << "layer " << l << " array " << a << " page " << page;
          }
        }
    }
  }
}

TEST(HostKvTierCuda, HostMemoryThatCannotBePinnedIsRefusedNamingTheFlag) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  auto cfg = model::load_config(kModel);
  ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
  model::KvCacheCuda cache(*cfg, 4);
  // 2^52 bytes: more than a process can map, so the pinning fails at once.
  const int64_t slots = (int64_t{1} << 52) / model::KvCache::page_bytes(*cfg);
  auto tier = HostKvTierCuda::create(cache, slots);
  ASSERT_FALSE(tier.has_value());
  EXPECT_NE(tier.error().message.find("cannot pin"), std::string::npos) << tier.error().message;
  EXPECT_NE(tier.error().message.find("--kv-transfer-config"), std::string::npos);
  EXPECT_NE(tier.error().message.find("--kv-offloading-size"), std::string::npos);
  // The failure left nothing behind: a tier that fits still works.
  auto ok = HostKvTierCuda::create(cache, 2);
  ASSERT_TRUE(ok.has_value()) << ok.error().message;
}

// ------------------------------------------------------------------ through the engine

struct Golden {
  std::vector<int32_t> prompt;
  std::vector<int32_t> want;
};
std::vector<Golden> golden_cases() {
  std::ifstream f(fs::path(kModel) / "golden.json");
  const json golden = json::parse(f);
  std::vector<Golden> out;
  for (const auto& c : golden["cases"]) {
    out.push_back(
        {c["prompt_ids"].get<std::vector<int32_t>>(), c["greedy_ids"].get<std::vector<int32_t>>()});
  }
  return out;
}

struct Reply {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  int cached = -1;
};
Reply run_one(engine::Engine& e, const std::vector<int32_t>& prompt, int max_tokens,
              bool logprobs) {
  engine::GenerateRequest r;
  r.prompt_token_ids = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  if (logprobs) r.params.logprobs = 0;
  auto s = e.submit(r);
  EXPECT_TRUE(s.has_value()) << s.error().message;
  Reply out;
  if (!s.has_value()) return out;
  for (;;) {
    auto o = (*s)->next(std::chrono::milliseconds(120000));
    if (!o) {
      ADD_FAILURE() << "stream timed out";
      return out;
    }
    if (out.cached < 0) out.cached = o->num_cached_tokens;
    out.tokens.insert(out.tokens.end(), o->new_token_ids.begin(), o->new_token_ids.end());
    for (const auto& lp : o->logprobs) out.logprobs.push_back(lp.logprob);
    if (o->finished) return out;
  }
}

struct TierRun {
  Reply first, again;
  int64_t offloaded = 0, restored = 0, ahead = 0;
};
// The golden prompt `a` (129 tokens: 16 full pages of 8), then two other 129-token prompts that
// need the pool's pages (22: one sequence of max-model-len 160 and two spare), so a's cached pages
// are evicted (to the host with a tier), then `a` again.
TierRun evict_and_resend(bool tier, bool async, bool logprobs, int64_t pool_pages) {
  auto mcfg = model::load_config(kModel);
  EXPECT_TRUE(mcfg.has_value());
  const int64_t pb = model::KvCache::page_bytes(*mcfg);
  CudaBackendOptions opts;
  opts.kv_cache_memory_bytes = pool_pages * pb;
  engine::EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 8;
  cfg.max_model_len = 160;
  cfg.async_scheduling = async;
  if (tier) cfg.host_kv_cache_bytes = 64 * pb;
  cfg.backend_factory = [opts](std::unique_ptr<model::M3Model> host, int64_t) {
    return make_cuda_backend(std::move(host), opts);
  };
  auto e = engine::Engine::create(cfg);
  EXPECT_TRUE(e.has_value()) << e.error().message;
  TierRun r;
  if (!e.has_value()) return r;
  EXPECT_EQ((*e)->model_info().async_scheduling, async);
  EXPECT_EQ((*e)->model_info().num_host_kv_pages, tier ? 64 : 0);
  const auto cases = golden_cases();
  const Golden& a = cases[3];  // len129: every greedy margin above 0.1
  EXPECT_EQ(a.prompt.size(), 129u);
  const std::vector<int32_t>& other = cases[4].prompt;  // len200
  r.first = run_one(**e, a.prompt, 16, logprobs);
  run_one(**e, std::vector<int32_t>(other.begin(), other.begin() + 129), 16, false);
  run_one(**e, std::vector<int32_t>(other.begin() + 71, other.end()), 16, false);
  r.again = run_one(**e, a.prompt, 16, logprobs);
  EXPECT_EQ(r.first.tokens, a.want);
  EXPECT_EQ(r.again.tokens, a.want);
  const auto st = (*e)->stats();
  r.offloaded = st.kv_offloaded_pages_total;
  r.restored = st.kv_restored_pages_total;
  r.ahead = st.steps_launched_ahead;
  return r;
}

TEST(HostKvTierCuda, EvictedPrefixRestoredFromHostGivesTheRecomputedTokens) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  const TierRun restored = evict_and_resend(/*tier=*/true, /*async=*/false, true, 22);
  const TierRun recomputed = evict_and_resend(false, false, true, 22);
  const TierRun device_hit = evict_and_resend(false, false, true, 80);  // nothing evicted
  // The tier: a's 16 full pages went out and came back (cached like a device hit).
  EXPECT_GE(restored.offloaded, 16);
  EXPECT_EQ(restored.restored, 16);
  EXPECT_EQ(restored.again.cached, 128);
  EXPECT_EQ(recomputed.offloaded, 0);
  EXPECT_EQ(recomputed.restored, 0);
  EXPECT_EQ(recomputed.again.cached, 0);
  EXPECT_EQ(device_hit.again.cached, 128);
  ASSERT_EQ(restored.again.logprobs.size(), 16u);
  ASSERT_EQ(recomputed.again.logprobs.size(), 16u);
  ASSERT_EQ(device_hit.again.logprobs.size(), 16u);
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_NEAR(restored.again.logprobs[i], recomputed.again.logprobs[i], kRecomputeTol) << i;
    EXPECT_NEAR(restored.again.logprobs[i], restored.first.logprobs[i], kRecomputeTol) << i;
    EXPECT_FLOAT_EQ(restored.again.logprobs[i], device_hit.again.logprobs[i]) << i;
  }
}

// Async scheduling stays on with the tier: steps with copies are launched ahead like any other
// (their copies ordered after the step in flight) and give the synchronous tokens.
TEST(HostKvTierCuda, AsyncSchedulingWithTheTierGivesTheSynchronousTokens) {
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  const TierRun async = evict_and_resend(true, true, false, 22);
  EXPECT_EQ(async.restored, 16);
  EXPECT_GE(async.offloaded, 16);
  EXPECT_EQ(async.again.cached, 128);
  EXPECT_GT(async.ahead, 10);
}

}  // namespace
}  // namespace m3::runtime
