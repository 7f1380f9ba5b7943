// The engine on a golden checkpoint: greedy output through the scheduler (chunked prefill,
// batching, preemption) equals the scheduler-free SequenceRunner; prompt logprobs; seeded
// sampling (the GPU sampler's rule, independent of the batch); aborts free pages; admission
// errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/m3_model.h"
#include "runtime/sequence_runner.h"
#include "unit/engine/engine_test_util.h"

namespace m3::engine {
namespace {

using testing::collect;
using testing::Collected;
using testing::kModel;
using testing::random_prompt;
using testing::reference_greedy;
using testing::reference_sampled;
using testing::seeded_requests;

std::unique_ptr<Engine> make_engine(EngineConfig cfg) {
  cfg.model_dir = kModel;
  auto e = Engine::create(cfg);
  EXPECT_TRUE(e.has_value()) << (e ? "" : e.error().message);
  return e ? std::move(*e) : nullptr;
}

TEST(Engine, GreedyBatchedAndChunkedEqualsReference) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 48;  // forces chunked prefill and mixed prefill/decode steps
  cfg.max_num_seqs = 8;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(random_prompt(10 + 23 * i, 100 + i, V));
    GenerateRequest r;
    r.prompt_token_ids = prompts.back();
    r.params.temperature = 0;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    auto s = e->submit(r);
    ASSERT_TRUE(s.has_value()) << s.error().message;
    streams.push_back(*s);
  }
  for (int i = 0; i < 6; ++i) {
    auto c = collect(*streams[i]);
    EXPECT_EQ(c.last.finish_reason, "length");
    EXPECT_EQ(c.tokens, reference_greedy(**m, prompts[i], 6)) << "request " << i;
    EXPECT_EQ(c.last.num_prompt_tokens, static_cast<int>(prompts[i].size()));
    EXPECT_EQ(c.last.num_output_tokens, 6);
  }
  auto st = e->stats();
  EXPECT_EQ(st.num_running, 0);
  EXPECT_EQ(st.kv_cache_usage, 0.0);
  EXPECT_EQ(st.generation_tokens_total, 36);
}

TEST(Engine, PreemptionUnderATinyPoolGivesTheSameTokens) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  const auto& mc = (*m)->config();
  EngineConfig cfg;
  cfg.block_size = static_cast<int>(mc.sparse_block_size);
  cfg.max_model_len = 96;
  // 14 pages of 8 tokens: four 40-token sequences cannot all stay resident to the end.
  cfg.kv_cache_memory_bytes = 14 * model::KvCache::page_bytes(mc);
  cfg.max_num_seqs = 4;
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(20, 7 + i, V));
    GenerateRequest r;
    r.prompt_token_ids = prompts.back();
    r.params.temperature = 0;
    r.params.max_tokens = 20;
    r.params.ignore_eos = true;
    streams.push_back(*e->submit(r));
  }
  for (int i = 0; i < 4; ++i) {
    auto c = collect(*streams[i]);
    EXPECT_EQ(c.tokens, reference_greedy(**m, prompts[i], 20)) << "request " << i;
  }
  EXPECT_GT(e->stats().num_preemptions, 0) << "the pool was meant to force preemption";
  EXPECT_EQ(e->stats().kv_cache_usage, 0.0);
}

TEST(Engine, PromptLogprobsAndSampledLogprobs) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  EngineConfig cfg;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  cfg.max_num_batched_tokens = 16;  // prompt logprobs across chunks
  auto e = make_engine(cfg);
  const int V = static_cast<int>(e->model_info().vocab_size);
  auto prompt = random_prompt(40, 3, V);
  GenerateRequest r;
  r.prompt_token_ids = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = 2;
  r.params.prompt_logprobs = 3;
  r.params.logprobs = 2;
  auto c = collect(**e->submit(r));
  // reference: one-shot prefill with all logits
  runtime::SequenceRunner ref(**m, 64, 1);
  const int s = ref.add_sequence();
  auto out = ref.step({{s, prompt, true}});
  const auto& first = c.all.front();
  ASSERT_TRUE(first.prompt_logprobs.has_value());
  ASSERT_EQ(first.prompt_logprobs->size(), prompt.size());
  EXPECT_FALSE((*first.prompt_logprobs)[0].has_value());
  for (size_t i = 1; i < prompt.size(); ++i) {
    const auto& lp = (*first.prompt_logprobs)[i];
    ASSERT_TRUE(lp.has_value()) << i;
    auto want =
        Sampler::logprobs(std::span<const float>(out.logits.data() + (i - 1) * V, V), prompt[i], 3);
    EXPECT_EQ(lp->token, prompt[i]);
    EXPECT_NEAR(lp->logprob, want.logprob, 1e-5);
    ASSERT_EQ(lp->top.size(), 3u);
    EXPECT_EQ(lp->top[0].first, want.top[0].first);
  }
  ASSERT_EQ(c.tokens.size(), 2u);
  size_t nlp = 0;
  for (const auto& o : c.all) nlp += o.logprobs.size();
  EXPECT_EQ(nlp, 2u);
  EXPECT_EQ(c.all.front().logprobs.front().token, c.tokens[0]);
  EXPECT_EQ(c.all.front().logprobs.front().top.size(), 2u);
}

TEST(Engine, SeededSamplingIsReproducible) {
  EngineConfig cfg;
  cfg.block_size = 8;
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  auto run = [&](uint64_t seed) {
    GenerateRequest r;
    r.prompt_token_ids = random_prompt(12, 5, V);
    r.params.temperature = 1.0f;
    r.params.top_p = 0.9f;
    r.params.top_k = 50;
    r.params.seed = seed;
    r.params.max_tokens = 12;
    r.params.ignore_eos = true;
    return collect(**e->submit(r)).tokens;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));  // 12 tokens from a non-trivial distribution: a clash is ~impossible
}

// The CPU backend samples with the GPU's rule: a seeded request's tokens are the scheduler-free
// logits drawn by kernels::cpu::sample_rows with (seed, output index), alone or batched with
// other requests (chunked prefill, mixed steps), so a draw depends on the request only.
TEST(Engine, SeededSamplingIsTheGpuRuleAndIndependentOfTheBatch) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 32;  // chunked prefill, prefill chunks next to decodes
  cfg.max_num_seqs = 16;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  const std::vector<GenerateRequest> seeded = seeded_requests(V);
  std::vector<std::vector<int32_t>> want;
  int differs_from_greedy = 0;
  for (const GenerateRequest& r : seeded) {
    want.push_back(reference_sampled(**m, r).tokens);
    if (want.back() != reference_greedy(**m, r.prompt_token_ids, r.params.max_tokens))
      ++differs_from_greedy;
    EXPECT_EQ(collect(**e->submit(r)).tokens, want.back()) << "alone, seed " << *r.params.seed;
  }
  EXPECT_GE(differs_from_greedy, 3) << "the sampled references should not all be greedy";

  // The same requests among others (unseeded and greedy ones, longer prompts) and in another
  // order: each seeded request still gets its tokens.
  std::vector<GenerateRequest> batch;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest other;
    other.prompt_token_ids = random_prompt(40 + 11 * i, static_cast<uint32_t>(90 + i), V);
    other.params.temperature = i == 0 ? 0.f : 1.f;
    other.params.max_tokens = 14;
    other.params.ignore_eos = true;
    batch.push_back(other);
  }
  for (size_t i = seeded.size(); i-- > 0;) batch.push_back(seeded[i]);
  const auto got = testing::generate_all(*e, batch);
  ASSERT_EQ(got.size(), batch.size());
  for (size_t i = 0; i < seeded.size(); ++i)
    EXPECT_EQ(got[3 + seeded.size() - 1 - i], want[i])
        << "batched, seed " << *seeded[i].params.seed;
}

TEST(Engine, IdsPastTheSampleableVocabularyAreNeverSampled) {
  EngineConfig cfg;
  cfg.block_size = 8;
  cfg.num_sampleable_tokens = 7;  // as if the tokenizer defined only ids 0..6
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  for (float temp : {0.0f, 1.5f}) {
    GenerateRequest r;
    r.prompt_token_ids = random_prompt(9, 11, static_cast<int>(e->model_info().vocab_size));
    r.params.temperature = temp;
    r.params.seed = 1;
    r.params.max_tokens = 24;
    r.params.ignore_eos = true;
    for (int32_t t : collect(**e->submit(r)).tokens) EXPECT_LT(t, 7) << "temperature " << temp;
  }
}

TEST(Engine, AbortFreesPagesAndFinishesTheStream) {
  EngineConfig cfg;
  cfg.block_size = 8;
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  GenerateRequest r;
  r.prompt_token_ids = random_prompt(30, 9, V);
  r.params.max_tokens =
      10000 > e->model_info().max_model_len - 40 ? e->model_info().max_model_len - 40 : 10000;
  r.params.ignore_eos = true;
  auto s = *e->submit(r);
  auto first = s->next(std::chrono::milliseconds(60000));
  ASSERT_TRUE(first.has_value());
  e->abort(s->id());
  auto c = collect(*s);
  EXPECT_EQ(c.last.finish_reason, "abort");
  for (int i = 0; i < 200 && (e->stats().kv_cache_usage > 0 || e->stats().num_running > 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(e->stats().kv_cache_usage, 0.0);
  EXPECT_EQ(e->stats().num_running, 0);
  EXPECT_EQ(e->stats().requests_finished_abort, 1);
}

TEST(Engine, AdmissionErrorsNameTheProblem) {
  EngineConfig cfg;
  cfg.block_size = 8;
  cfg.max_model_len = 64;
  auto e = make_engine(cfg);
  ASSERT_TRUE(e);
  GenerateRequest r;
  r.params.max_tokens = 4;
  auto empty = e->submit(r);
  ASSERT_FALSE(empty.has_value());
  EXPECT_EQ(empty.error().code, ErrorCode::kInvalidArgument);
  r.prompt_token_ids = {1, static_cast<int32_t>(e->model_info().vocab_size)};
  auto oov = e->submit(r);
  ASSERT_FALSE(oov.has_value());
  EXPECT_NE(oov.error().message.find("outside the vocabulary"), std::string::npos);
  r.prompt_token_ids = std::vector<int32_t>(62, 1);
  r.params.max_tokens = 10;
  auto too_long = e->submit(r);
  ASSERT_FALSE(too_long.has_value());
  EXPECT_EQ(too_long.error().code, ErrorCode::kContextLength);
  EXPECT_NE(too_long.error().message.find("72"), std::string::npos) << too_long.error().message;
}

TEST(Engine, BadBlockSizeAndTooSmallKvAreRefused) {
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = 16;  // the model's MSA block is 8
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.error().message.find("--block-size"), std::string::npos) << e.error().message;
  cfg.block_size = 8;
  cfg.max_model_len = 256;
  cfg.kv_cache_memory_bytes = 1000;
  auto e2 = Engine::create(cfg);
  ASSERT_FALSE(e2.has_value());
  EXPECT_NE(e2.error().message.find("--kv-cache-memory-bytes"), std::string::npos)
      << e2.error().message;
}

}  // namespace
}  // namespace m3::engine
