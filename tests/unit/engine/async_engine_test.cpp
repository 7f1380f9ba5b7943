// Async scheduling (EngineConfig::async_scheduling) on the CPU backend: the pipelined loop (step
// N+1 scheduled and launched before step N is reported, its decode rows reading step N's samples
// through ForwardBackend::launch) gives exactly the synchronous loop's outputs: greedy and seeded
// tokens, logprobs and prompt logprobs, stop ids, max_tokens, n > 1 choices, host-sampled rows
// (penalties, a token constraint), chunked prefill, preemption, prefix caching and aborts.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <thread>

#include "engine/engine.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "unit/engine/engine_test_util.h"

namespace m3::engine {
namespace {

using testing::collect;
using testing::Collected;
using testing::kModel;
using testing::random_prompt;
using testing::reference_greedy;
using testing::seeded_requests;

std::unique_ptr<Engine> make_engine(EngineConfig cfg, bool async) {
  cfg.model_dir = kModel;
  cfg.async_scheduling = async;
  auto e = Engine::create(cfg);
  EXPECT_TRUE(e.has_value()) << (e ? "" : e.error().message);
  if (!e) return nullptr;
  EXPECT_EQ((*e)->model_info().async_scheduling, async);
  return std::move(*e);
}

// A constraint that allows exactly one token sequence, then terminates (a stand-in for a
// grammar: its rows are masked and sampled on the host).
class FixedConstraint final : public TokenConstraint {
 public:
  explicit FixedConstraint(std::vector<int32_t> toks) : toks_(std::move(toks)) {}
  void fill_allowed(std::span<uint32_t> allowed) override {
    const int32_t t = toks_[pos_];
    allowed[t / 32] |= 1u << (t % 32);
  }
  bool accept(int32_t t) override {
    if (pos_ >= toks_.size() || toks_[pos_] != t) return false;
    ++pos_;
    return true;
  }
  bool is_terminated() const override { return pos_ == toks_.size(); }

 private:
  std::vector<int32_t> toks_;
  size_t pos_ = 0;
};
class FixedFactory final : public TokenConstraintFactory {
 public:
  explicit FixedFactory(std::vector<int32_t> toks) : toks_(std::move(toks)) {}
  std::unique_ptr<TokenConstraint> make() const override {
    return std::make_unique<FixedConstraint>(toks_);
  }

 private:
  std::vector<int32_t> toks_;
};

void expect_same_output(const Collected& a, const Collected& s, const std::string& what) {
  EXPECT_EQ(a.tokens, s.tokens) << what;
  EXPECT_EQ(a.last.finish_reason, s.last.finish_reason) << what;
  EXPECT_EQ(a.last.stop_token_id, s.last.stop_token_id) << what;
  EXPECT_EQ(a.last.num_output_tokens, s.last.num_output_tokens) << what;
  EXPECT_EQ(a.last.num_prompt_tokens, s.last.num_prompt_tokens) << what;
  // Logprobs in token order, whichever outputs carried them.
  std::vector<TokenLogprobOut> la, ls;
  std::optional<std::vector<std::optional<TokenLogprobOut>>> pa, ps;
  for (const auto& o : a.all) {
    la.insert(la.end(), o.logprobs.begin(), o.logprobs.end());
    if (o.prompt_logprobs) pa = o.prompt_logprobs;
  }
  for (const auto& o : s.all) {
    ls.insert(ls.end(), o.logprobs.begin(), o.logprobs.end());
    if (o.prompt_logprobs) ps = o.prompt_logprobs;
  }
  ASSERT_EQ(la.size(), ls.size()) << what;
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i].token, ls[i].token) << what << " logprob " << i;
    EXPECT_EQ(la[i].logprob, ls[i].logprob) << what << " logprob " << i;
    EXPECT_EQ(la[i].top, ls[i].top) << what << " logprob " << i;
    EXPECT_EQ(la[i].rank, ls[i].rank) << what << " logprob " << i;
  }
  ASSERT_EQ(pa.has_value(), ps.has_value()) << what;
  if (pa) {
    ASSERT_EQ(pa->size(), ps->size()) << what;
    for (size_t i = 0; i < pa->size(); ++i) {
      ASSERT_EQ((*pa)[i].has_value(), (*ps)[i].has_value()) << what << " prompt " << i;
      if ((*pa)[i]) {
        EXPECT_EQ((*pa)[i]->token, (*ps)[i]->token) << what << " prompt " << i;
        EXPECT_EQ((*pa)[i]->logprob, (*ps)[i]->logprob) << what << " prompt " << i;
      }
    }
  }
}

// Every request submitted at once; each one's outputs.
std::vector<Collected> run_all(Engine& e, const std::vector<GenerateRequest>& reqs) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) {
    auto s = e.submit(r);
    EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
    if (!s) return {};
    streams.push_back(*s);
  }
  std::vector<Collected> out;
  for (auto& s : streams) out.push_back(collect(*s));
  return out;
}

TEST(AsyncEngine, MixedWorkloadGivesTheSynchronousOutputs) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::vector<GenerateRequest> reqs;
  std::vector<std::string> names;
  auto add = [&](GenerateRequest r, std::string name) {
    reqs.push_back(std::move(r));
    names.push_back(std::move(name));
  };
  // Greedy, different prompt lengths (chunked prefill next to decode rows).
  for (int i = 0; i < 3; ++i)
    add(testing::greedy_request(random_prompt(10 + 31 * i, 300 + i, V), 7 + 3 * i),
        "greedy " + std::to_string(i));
  // Stop ids: the greedy continuation's 4th token stops the request there (or earlier).
  const auto sp = random_prompt(17, 401, V);
  const auto ref = reference_greedy(**m, sp, 12);
  {
    GenerateRequest r = testing::greedy_request(sp, 12);
    r.params.stop_token_ids = {ref[3]};
    add(r, "stop id");
    r.params.min_tokens = 6;  // past the first occurrence: the stop may come later or not at all
    add(r, "stop id after min_tokens");
  }
  // max_tokens 1 and 2: finished by length right after prefill (the async loop must not run a
  // step for them).
  add(testing::greedy_request(random_prompt(12, 402, V), 1), "max_tokens 1");
  add(testing::greedy_request(random_prompt(9, 403, V), 2), "max_tokens 2");
  // Seeded sampling over the sampler's settings (one with logprobs: host-sampled).
  int k = 0;
  for (auto& r : seeded_requests(V)) add(r, "seeded " + std::to_string(k++));
  // n = 3 choices of one prompt (the server submits one request per choice).
  for (int c = 0; c < 3; ++c) {
    GenerateRequest r;
    r.prompt_token_ids = random_prompt(21, 404, V);
    r.params.temperature = 0.9f;
    r.params.seed = 40 + c;
    r.params.max_tokens = 9;
    r.params.ignore_eos = true;
    add(r, "choice " + std::to_string(c));
  }
  // Host-sampled rows: penalties, prompt logprobs, a token constraint.
  {
    GenerateRequest r;
    r.prompt_token_ids = random_prompt(25, 405, V);
    r.params.temperature = 0.8f;
    r.params.seed = 3;
    r.params.repetition_penalty = 1.3f;
    r.params.frequency_penalty = 0.4f;
    r.params.max_tokens = 10;
    r.params.ignore_eos = true;
    add(r, "penalties");
    GenerateRequest p = testing::greedy_request(random_prompt(30, 406, V), 5);
    p.params.prompt_logprobs = 2;
    p.params.logprobs = 1;
    add(p, "prompt logprobs");
    GenerateRequest c = testing::greedy_request(random_prompt(14, 407, V), 20);
    c.params.constraint = std::make_shared<FixedFactory>(std::vector<int32_t>{5, 9, 2, 7});
    add(c, "constraint");
  }

  EngineConfig cfg;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  cfg.max_num_batched_tokens = 40;  // chunked prefill, mixed steps
  cfg.max_num_seqs = 6;             // a queue: admissions while decoding
  auto sync = make_engine(cfg, false);
  auto async = make_engine(cfg, true);
  ASSERT_TRUE(sync && async);
  const auto s = run_all(*sync, reqs);
  const auto a = run_all(*async, reqs);
  ASSERT_EQ(s.size(), reqs.size());
  ASSERT_EQ(a.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) expect_same_output(a[i], s[i], names[i]);
  // Sanity of the workload itself.
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(s[i].tokens, reference_greedy(**m, reqs[i].prompt_token_ids, 7 + 3 * i));
  EXPECT_EQ(s[3].last.finish_reason, "stop");
  EXPECT_EQ(s[3].last.stop_token_id, ref[3]);
  EXPECT_LE(s[3].tokens.size(), 4u);
  EXPECT_EQ(s[5].tokens.size(), 1u);
  EXPECT_EQ(a.back().tokens, (std::vector<int32_t>{5, 9, 2, 7}));
  EXPECT_EQ(a.back().last.finish_reason, "stop");
  // The pipeline ran (host-sampled rows make many of these steps synchronous).
  const EngineStats st = async->stats();
  EXPECT_GT(st.steps_launched_ahead, 5);
  EXPECT_EQ(sync->stats().steps_launched_ahead, 0);
  EXPECT_EQ(st.generation_tokens_total, sync->stats().generation_tokens_total);
  for (Engine* e : {sync.get(), async.get()}) {
    EXPECT_EQ(e->stats().kv_cache_usage, 0.0);
    EXPECT_EQ(e->stats().num_running, 0);
  }
}

TEST(AsyncEngine, DeviceSampledDecodeStepsAreLaunchedBehindTheRunningOne) {
  EngineConfig cfg;
  cfg.block_size = 8;
  auto e = make_engine(cfg, true);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i)
    reqs.push_back(testing::greedy_request(random_prompt(11, 900 + i, V), 16));
  const auto a = run_all(*e, reqs);
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(a[i].tokens, reference_greedy(**m, reqs[i].prompt_token_ids, 16)) << i;
  // One prefill step (scheduled with nothing in flight), then 15 decode steps each launched
  // behind the one before; the last of them has no successor. (Submissions may straggle into
  // a second prefill step.)
  const EngineStats st = e->stats();
  EXPECT_GE(st.steps_launched_ahead, 14);
  EXPECT_LE(st.steps_not_overlapped, 3);
}

TEST(AsyncEngine, PreemptionUnderATinyPoolGivesTheSameTokens) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  const auto& mc = (*m)->config();
  EngineConfig cfg;
  cfg.block_size = static_cast<int>(mc.sparse_block_size);
  cfg.max_model_len = 96;
  cfg.kv_cache_memory_bytes = 14 * model::KvCache::page_bytes(mc);  // 14 pages of 8 tokens
  cfg.max_num_seqs = 4;
  auto e = make_engine(cfg, true);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i)
    reqs.push_back(testing::greedy_request(random_prompt(20, 7 + i, V), 20));
  GenerateRequest seeded;
  seeded.prompt_token_ids = random_prompt(20, 11, V);
  seeded.params.temperature = 1.f;
  seeded.params.seed = 99;
  seeded.params.max_tokens = 20;
  seeded.params.ignore_eos = true;
  reqs.push_back(seeded);
  const auto a = run_all(*e, reqs);
  ASSERT_EQ(a.size(), reqs.size());
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(a[i].tokens, reference_greedy(**m, reqs[i].prompt_token_ids, 20)) << i;
  EXPECT_EQ(a[4].tokens, testing::reference_sampled(**m, seeded).tokens);
  EXPECT_GT(e->stats().num_preemptions, 0) << "the pool was meant to force preemption";
  EXPECT_GT(e->stats().steps_launched_ahead, 0);
  EXPECT_EQ(e->stats().kv_cache_usage, 0.0);
}

TEST(AsyncEngine, PrefixHitsAndTheirTokensMatchTheSynchronousLoop) {
  EngineConfig cfg;
  cfg.block_size = 8;
  cfg.max_num_batched_tokens = 32;
  for (bool async : {false, true}) {
    auto e = make_engine(cfg, async);
    ASSERT_TRUE(e);
    const int V = static_cast<int>(e->model_info().vocab_size);
    const auto prompt = random_prompt(45, 500, V);
    const auto first = collect(**e->submit(testing::greedy_request(prompt, 10)));
    // The same prompt after the first finished: its full pages come from the prefix cache.
    const auto second = collect(**e->submit(testing::greedy_request(prompt, 10)));
    // The first request's prompt + output as a prompt: a hit over the pages decoded ones too.
    std::vector<int32_t> longer = prompt;
    longer.insert(longer.end(), first.tokens.begin(), first.tokens.end());
    const auto third = collect(**e->submit(testing::greedy_request(longer, 4)));
    EXPECT_EQ(first.tokens, second.tokens) << "async " << async;
    EXPECT_EQ(second.last.num_cached_tokens, 40) << "async " << async;
    EXPECT_EQ(third.last.num_cached_tokens, 48) << "async " << async;
    auto m = model::M3Model::load(kModel);
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(third.tokens, reference_greedy(**m, longer, 4)) << "async " << async;
  }
}

TEST(AsyncEngine, AnAbortMidStreamEndsOnlyThatRequest) {
  EngineConfig cfg;
  cfg.block_size = 8;
  auto sync = make_engine(cfg, false);
  auto async = make_engine(cfg, true);
  ASSERT_TRUE(sync && async);
  const int V = static_cast<int>(async->model_info().vocab_size);
  std::vector<GenerateRequest> others;
  for (int i = 0; i < 3; ++i)
    others.push_back(testing::greedy_request(random_prompt(15, 600 + i, V), 24));
  const auto want = run_all(*sync, others);
  const int long_tokens = std::min(200, async->model_info().max_model_len - 40);
  GenerateRequest victim = testing::greedy_request(random_prompt(30, 700, V), long_tokens);
  const auto victim_sync = collect(**sync->submit(victim));
  for (int round = 0; round < 3; ++round) {
    auto vs = *async->submit(victim);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& r : others) streams.push_back(*async->submit(r));
    // Abort after a few of its outputs (at a different point each round).
    std::vector<int32_t> got;
    for (int n = 0; n < 2 + 3 * round;) {
      auto o = vs->next(std::chrono::milliseconds(60000));
      ASSERT_TRUE(o.has_value());
      got.insert(got.end(), o->new_token_ids.begin(), o->new_token_ids.end());
      ASSERT_FALSE(o->finished);
      n += !o->new_token_ids.empty();
    }
    async->abort(vs->id());
    const auto rest = collect(*vs);
    got.insert(got.end(), rest.tokens.begin(), rest.tokens.end());
    EXPECT_EQ(rest.last.finish_reason, "abort");
    ASSERT_LE(got.size(), victim_sync.tokens.size());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), victim_sync.tokens.begin()))
        << "the aborted request's tokens are a prefix of its full output";
    for (size_t i = 0; i < streams.size(); ++i)
      expect_same_output(collect(*streams[i]), want[i], "other " + std::to_string(i));
  }
  for (int i = 0; i < 200 && (async->stats().kv_cache_usage > 0 || async->stats().num_running > 0);
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(async->stats().kv_cache_usage, 0.0);
  EXPECT_EQ(async->stats().requests_finished_abort, 3);
}

TEST(AsyncEngine, ShutdownWithAStepInFlightFinishesEveryStream) {
  EngineConfig cfg;
  cfg.block_size = 8;
  auto e = make_engine(cfg, true);
  ASSERT_TRUE(e);
  const int V = static_cast<int>(e->model_info().vocab_size);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i)
    streams.push_back(*e->submit(testing::greedy_request(
        random_prompt(12, 800 + i, V), std::min(300, e->model_info().max_model_len - 20))));
  ASSERT_TRUE(streams[0]->next(std::chrono::milliseconds(60000)).has_value());
  e->shutdown(/*drain=*/false);
  for (auto& s : streams) EXPECT_EQ(collect(*s).last.finish_reason, "abort");
}

}  // namespace
}  // namespace m3::engine
