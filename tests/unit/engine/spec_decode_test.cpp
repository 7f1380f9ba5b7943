// Speculative decoding (engine/spec_decode.h, the runner's verification, the scheduler's draft
// tokens and rollback): the rejection sampler keeps the target distribution (chi-square, per
// position and over a request's first three tokens through the scheduler + runner); greedy
// output with drafts is exactly the output without them, through the scheduler + runner with
// drafts that are partly right (accepted prefixes, rejections, a bonus token, drafts cut by the
// budget and the pages) and through the engine with a random draft read from disk; penalties,
// logprobs, stop ids and max_tokens see exactly the accepted tokens; constrained requests draft
// only what their constraint takes and verify under its masks; bad drafts are refused at
// start-up with both numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <unordered_map>

#include "engine/engine.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/spec_decode.h"
#include "engine_test_util.h"
#include "kernels/cpu/sample.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"
#include "sched/scheduler.h"
#include "spec_test_util.h"

namespace m3::engine {
namespace {

using testing::kModel;

// ---------------------------------------------------------------- the rejection sampler

// Pearson's chi-square of counts against probabilities (cells with p > 0).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double x = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = p[i] * static_cast<double>(n);
    x += (counts[i] - e) * (counts[i] - e) / e;
  }
  return x;
}

TEST(RejectionSampler, KeepsTheTargetDistributionWhateverTheDraft) {
  // 6 tokens; the draft distribution differs from the target's (general q, and a greedy draft:
  // one-hot q); the accepted-or-resampled token must be distributed as the target.
  const std::vector<double> p = {0.35, 0.05, 0.2, 0.0, 0.3, 0.1};
  const std::vector<double> q = {0.1, 0.4, 0.1, 0.2, 0.15, 0.05};
  const int64_t n = 200000;
  std::mt19937_64 g(12345);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::discrete_distribution<int> draw_q(q.begin(), q.end());
  for (int mode = 0; mode < 2; ++mode) {
    std::vector<int64_t> counts(p.size(), 0);
    int64_t accepted = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t d = mode == 0 ? draw_q(g) : 2;  // greedy draft: always token 2
      bool ok = false;
      const int32_t tok = Sampler::rejection_sample(
          p, mode == 0 ? std::span<const double>(q) : std::span<const double>(), d, u(g), u(g),
          &ok);
      ++counts[tok];
      accepted += ok;
    }
    // 5 degrees of freedom (6 cells, one with p = 0 and no count): P(chi2 > 20.5) = 0.001, so a
    // correct sampler fails this one time in a thousand; a sampler that keeps the draft's
    // distribution anywhere gives chi-square in the thousands at this n.
    EXPECT_LT(chi_square(counts, p, n), 20.5) << "mode " << mode;
    // Acceptance rate: sum min(p, q) for a sampled draft, p[2] for the greedy one (+-5 sigma).
    double expect = 0;
    for (size_t i = 0; i < p.size(); ++i) expect += std::min(p[i], q[i]);
    if (mode == 1) expect = p[2];
    EXPECT_NEAR(static_cast<double>(accepted) / n, expect, 5 * std::sqrt(0.25 / n));
  }
}

TEST(RejectionSampler, TheEnginesRowRuleKeepsTheProcessedDistribution) {
  // The runner's path for a sampled row: prepare (penalties) -> probs (temperature, top_k) ->
  // rejection_sample against a greedy draft, with the per-(seed, step) uniforms it uses.
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 4;
  sp.presence_penalty = 0.5f;
  const std::vector<float> logits = {1.0f, 0.5f, 2.0f, -1.0f, 0.2f, 1.5f};
  const std::vector<int32_t> generated = {2};
  std::vector<float> row = logits;
  Sampler::prepare(row, sp, generated, generated, 6);
  std::vector<double> p;
  Sampler::probs(row, sp, 6, &p);
  double sum = 0;
  int nonzero = 0;
  for (double x : p) sum += x, nonzero += x > 0;
  EXPECT_NEAR(sum, 1.0, 1e-12);
  EXPECT_EQ(nonzero, 4);  // top_k
  const int64_t n = 100000;
  std::vector<int64_t> counts(6, 0), direct(6, 0);
  for (int64_t s = 0; s < n; ++s) {
    bool ok = false;
    ++counts[Sampler::rejection_sample(p, {}, 5, kernels::cpu::sample_uniform(s, 0, 7),
                                       kernels::cpu::sample_uniform(s, 0, 8), &ok)];
    // The draw without drafts (Gumbel-max over the same row) follows the same p.
    std::vector<float> r2 = logits;
    SampleRng rng{static_cast<uint64_t>(s), 0};
    ++direct[Sampler::sample(r2, sp, generated, generated, rng, 6)];
  }
  // 3 degrees of freedom (4 cells): P(chi2 > 16.3) = 0.001.
  EXPECT_LT(chi_square(counts, p, n), 16.3);
  EXPECT_LT(chi_square(direct, p, n), 16.3);
}

TEST(SyntheticAcceptance, ProbabilityGivesTheMeanLength) {
  for (double L : {1.0, 1.5, 2.78, 3.5, 4.0}) {
    const double a = synthetic_accept_probability(L, 3);
    EXPECT_NEAR(1 + a + a * a + a * a * a, L, 1e-9) << L;
  }
}

// ---------------------------------------------------------------- scheduler + runner

struct Result1 {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobOut> logprobs;
  sched::FinishReason reason = sched::FinishReason::kNone;
};

// The engine loop without threads: schedule -> execute -> update, as EngineImpl::loop does.
class Driver {
 public:
  Driver(const model::M3Model& m, std::unique_ptr<SpecDecoder> spec, int num_pages, int budget,
         bool prefix_caching = true, int max_num_seqs = 8)
      : Driver(m, runtime::borrow_cpu_backend(m, num_pages), std::move(spec), num_pages, budget,
               prefix_caching, max_num_seqs) {}
  // Over a given backend of num_pages pages (for m).
  Driver(const model::M3Model& m, std::unique_ptr<runtime::ForwardBackend> backend,
         std::unique_ptr<SpecDecoder> spec, int num_pages, int budget, bool prefix_caching = true,
         int max_num_seqs = 8)
      : runner_(std::move(backend), m.config().vocab_size, std::move(spec), 256) {
    sched::SchedulerConfig sc;
    sc.max_num_seqs = max_num_seqs;
    sc.max_num_batched_tokens = budget;
    sc.max_model_len = 256;
    sc.block_size = static_cast<int>(m.config().sparse_block_size);
    sc.num_blocks = num_pages;
    sc.enable_prefix_caching = prefix_caching;
    if (runner_.spec_decoder() != nullptr)
      sc.num_lookahead_tokens = runner_.spec_decoder()->num_speculative_tokens();
    sched_ = std::make_unique<sched::Scheduler>(sc);
  }
  void add(uint64_t id, const std::vector<int32_t>& prompt, const SamplingParams& p) {
    sched::StopCriteria stop;
    stop.max_tokens = p.max_tokens;
    stop.stop_token_ids = p.stop_token_ids;
    stop.ignore_eos = true;
    ASSERT_TRUE(sched_->add_request(std::make_unique<sched::Request>(id, prompt, stop)));
    RunnerRequestState st;
    st.params = p;
    if (p.constraint) st.constraint = p.constraint->make();
    st.seed = p.seed.value_or(1);
    st.history = prompt;
    st.num_prompt_tokens = static_cast<int>(prompt.size());
    states_.emplace(id, std::move(st));
  }
  std::map<uint64_t, Result1> run() {
    std::map<uint64_t, Result1> out;
    while (sched_->has_unfinished()) {
      sched::SchedulerOutput so = sched_->schedule();
      sched::RunnerOutput ro;
      if (!so.empty()) ro = runner_.execute(so, states_);
      for (const auto& u : sched_->update_from_output(so, ro)) {
        Result1& r = out[u.request_id];
        r.tokens.insert(r.tokens.end(), u.new_token_ids.begin(), u.new_token_ids.end());
        auto& st = states_.at(u.request_id);
        if (st.params.logprobs >= 0) {
          auto lp = st.step_logprobs;
          lp.resize(u.new_token_ids.size());
          r.logprobs.insert(r.logprobs.end(), lp.begin(), lp.end());
        }
        if (u.finished) r.reason = u.finish_reason;
      }
      max_running_ = std::max(max_running_, sched_->num_running());
    }
    return out;
  }
  const sched::Scheduler& scheduler() const { return *sched_; }

 private:
  ModelRunner runner_;
  std::unique_ptr<sched::Scheduler> sched_;
  std::unordered_map<uint64_t, RunnerRequestState> states_;
  int max_running_ = 0;
};

std::unique_ptr<SpecDecoder> random_spec(const model::M3Model& m, int k, int num_pages,
                                         const std::string& dir) {
  testing::write_draft(dir, testing::shape_for(m.config()));
  SpeculativeConfig sc;
  sc.method = "eagle3";
  sc.model = dir;
  sc.num_speculative_tokens = k;
  auto s = SpecDecoder::create(sc, m.config(), m.base_weights(), num_pages);
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
  return s ? std::move(*s) : nullptr;
}

// Drafts from the reference continuation: right except where (index % 5 == 3), so steps accept
// a prefix, reject, or take all drafts and a bonus token.
SpecDecoder::ProposalOverride oracle(std::map<uint64_t, std::vector<int32_t>> full, int vocab) {
  return [full, vocab](const std::vector<DraftSeq>& seqs,
                       const std::vector<std::vector<int32_t>>& drafted) {
    std::vector<std::vector<int32_t>> out(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int known = seqs[i].start_pos + seqs[i].num_valid + 1;  // tokens of the request
      auto it = full.find(seqs[i].request_id);
      if (it == full.end()) {
        out[i] = drafted[i];  // not scripted: the random draft's own proposals
        continue;
      }
      const auto& f = it->second;
      // The draft's own count says how many fit (pages, max_tokens, model length).
      for (size_t j = 0; j < drafted[i].size() && known + j < f.size(); ++j) {
        const int idx = known + static_cast<int>(j);
        out[i].push_back(idx % 5 == 3 ? (f[idx] + 1) % vocab : f[idx]);
      }
    }
    return out;
  };
}

TEST(SpecDecode, GreedyOutputIsExactlyTheTargetsWithPartlyRightDrafts) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::map<uint64_t, std::vector<int32_t>> prompts, refs, full;
  const int n_out = 21;
  for (uint64_t id = 1; id <= 4; ++id) {
    prompts[id] = testing::random_prompt(5 + 7 * static_cast<int>(id), 100 + id, V);
    refs[id] = testing::reference_greedy(**m, prompts[id], n_out);
    full[id] = prompts[id];
    full[id].insert(full[id].end(), refs[id].begin(), refs[id].end());
  }
  for (int k : {1, 3, 5}) {
    for (int budget : {7, 64}) {
      SCOPED_TRACE("K " + std::to_string(k) + ", budget " + std::to_string(budget));
      auto spec = random_spec(**m, k, 64, ::testing::TempDir() + "/draft_oracle");
      ASSERT_NE(spec, nullptr);
      spec->set_proposal_override(oracle(full, V));
      SpecDecoder* sd = spec.get();
      Driver d(**m, std::move(spec), 64, budget);
      SamplingParams p;
      p.temperature = 0.f;
      p.max_tokens = n_out;
      for (const auto& [id, pr] : prompts) d.add(id, pr, p);
      auto out = d.run();
      for (const auto& [id, ref] : refs) {
        EXPECT_EQ(out[id].tokens, ref) << "request " << id;
        EXPECT_EQ(out[id].reason, sched::FinishReason::kLength);
      }
      const SpecDecodeStats st = sd->stats();
      EXPECT_GT(st.num_drafts, 0);
      EXPECT_GT(st.num_accepted_tokens, 0);
      EXPECT_LT(st.num_accepted_tokens, st.num_draft_tokens);  // some rejected
      for (int i = 1; i < k; ++i) EXPECT_LE(st.accepted_per_pos[i], st.accepted_per_pos[i - 1]);
      // Only verified tokens were ever registered: a second round of the same prompts hits the
      // prefix cache and still gives the reference (rejected drafts' KV never leaked into it).
      const int64_t hits0 = d.scheduler().stats().prefix_cache_hits;
      for (const auto& [id, pr] : prompts)
        d.add(id + 100, full[id], [] {
          SamplingParams q;
          q.temperature = 0.f;
          q.max_tokens = 1;
          return q;
        }());
      auto again = d.run();
      EXPECT_GT(d.scheduler().stats().prefix_cache_hits, hits0);
      for (const auto& [id, pr] : prompts) {
        const auto next = testing::reference_greedy(**m, full[id], 1);
        EXPECT_EQ(again[id + 100].tokens, next) << "request " << id;
      }
    }
  }
}

TEST(SpecDecode, PenaltiesLogprobsStopsAndMaxTokensSeeExactlyTheAcceptedTokens) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::map<uint64_t, std::vector<int32_t>> prompts;
  for (uint64_t id = 1; id <= 3; ++id)
    prompts[id] = testing::random_prompt(9 + 4 * static_cast<int>(id), 300 + id, V);
  auto params = [](uint64_t id) {
    SamplingParams p;
    p.temperature = 0.f;
    p.max_tokens = 17 + static_cast<int>(id);
    p.repetition_penalty = 1.4f;
    p.frequency_penalty = 0.3f;
    p.logprobs = 2;
    return p;
  };
  // Without drafts: the expected tokens and logprobs; then a stop id from inside each output.
  Driver plain(**m, nullptr, 64, 64);
  for (const auto& [id, pr] : prompts) plain.add(id, pr, params(id));
  auto base = plain.run();
  std::map<uint64_t, std::vector<int32_t>> full;
  for (const auto& [id, pr] : prompts) {
    full[id] = pr;
    full[id].insert(full[id].end(), base[id].tokens.begin(), base[id].tokens.end());
  }
  for (int with_stop = 0; with_stop < 2; ++with_stop) {
    auto spec = random_spec(**m, 4, 64, ::testing::TempDir() + "/draft_penalties");
    ASSERT_NE(spec, nullptr);
    spec->set_proposal_override(oracle(full, V));
    Driver d(**m, std::move(spec), 64, 64);
    std::map<uint64_t, std::vector<int32_t>> expect;
    for (const auto& [id, pr] : prompts) {
      SamplingParams p = params(id);
      expect[id] = base[id].tokens;
      if (with_stop) {
        const int32_t stop = base[id].tokens[9];  // first occurrence ends the output there
        p.stop_token_ids = {stop};
        const auto at = std::find(expect[id].begin(), expect[id].end(), stop);
        expect[id].erase(at + 1, expect[id].end());
      }
      d.add(id, pr, p);
    }
    auto out = d.run();
    for (const auto& [id, pr] : prompts) {
      SCOPED_TRACE("request " + std::to_string(id) + (with_stop ? " with a stop id" : ""));
      EXPECT_EQ(out[id].tokens, expect[id]);
      EXPECT_EQ(out[id].reason,
                with_stop ? sched::FinishReason::kStop : sched::FinishReason::kLength);
      ASSERT_EQ(out[id].logprobs.size(), expect[id].size());
      for (size_t i = 0; i < expect[id].size(); ++i) {
        // The verify chunk scores these rows in a batch of 1 + K tokens instead of one at a
        // time: the same sums in fp32 up to the kernels' blocking, |logits| < 20 and a 64-wide
        // model give differences far below 1e-4.
        const auto& a = out[id].logprobs[i];
        const auto& b = base[id].logprobs[i];
        EXPECT_EQ(a.token, b.token);
        EXPECT_NEAR(a.logprob, b.logprob, 1e-4);
        ASSERT_EQ(a.top.size(), b.top.size());
        for (size_t t = 0; t < a.top.size(); ++t) {
          EXPECT_EQ(a.top[t].first, b.top[t].first);
          EXPECT_NEAR(a.top[t].second, b.top[t].second, 1e-4);
        }
      }
    }
  }
}

// A constraint for the runner's tests: a token may not share the previous token's residue mod 4
// (the first is free), and the output is complete after `len` tokens. It counts the tokens it
// refused and those rolled back; `rollback` says whether it can step back.
struct AltStats {
  int refused = 0, rolled_back = 0;
};
class AltConstraint final : public TokenConstraint {
 public:
  AltConstraint(int len, int vocab, bool rollback, std::shared_ptr<AltStats> s)
      : len_(len), vocab_(vocab), rollback_(rollback), s_(std::move(s)) {}
  void fill_allowed(std::span<uint32_t> allowed) override {
    if (is_terminated()) return;
    for (int32_t t = 0; t < vocab_; ++t)
      if (fits(t)) allowed[t / 32] |= 1u << (t % 32);
  }
  bool accept(int32_t t) override {
    if (is_terminated() || !fits(t)) {
      ++s_->refused;
      return false;
    }
    seen_.push_back(t);
    return true;
  }
  bool is_terminated() const override { return static_cast<int>(seen_.size()) >= len_; }
  bool can_rollback() const override { return rollback_; }
  void rollback(int n) override {
    ASSERT_TRUE(rollback_);
    ASSERT_LE(static_cast<size_t>(n), seen_.size());
    seen_.resize(seen_.size() - static_cast<size_t>(n));
    s_->rolled_back += n;
  }
  static bool follows(int32_t prev, int32_t t) { return t % 4 != prev % 4; }

 private:
  bool fits(int32_t t) const { return seen_.empty() || follows(seen_.back(), t); }
  int len_, vocab_;
  bool rollback_;
  std::shared_ptr<AltStats> s_;
  std::vector<int32_t> seen_;
};
class AltFactory final : public TokenConstraintFactory {
 public:
  AltFactory(int len, int vocab, bool rollback, std::shared_ptr<AltStats> s)
      : len_(len), vocab_(vocab), rollback_(rollback), s_(std::move(s)) {}
  std::unique_ptr<TokenConstraint> make() const override {
    return std::make_unique<AltConstraint>(len_, vocab_, rollback_, s_);
  }

 private:
  int len_, vocab_;
  bool rollback_;
  std::shared_ptr<AltStats> s_;
};

// Structured outputs with drafts: the runner proposes only the drafts the constraint takes (a
// draft it refuses is cut with those after it, the constraint stepped back), draws every verify
// row under the allowed set with the drafts before it, and accepts the decided tokens into the
// constraint; greedy output is exactly the output without drafts, sampled output keeps to the
// constraint, and both end where it completes. A constraint without rollback gets no drafts.
TEST(SpecDecode, ConstrainedRequestsDraftWhatTheConstraintTakes) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  ASSERT_EQ(V % 4, 0);  // t + 4 keeps t's residue
  std::map<uint64_t, std::vector<int32_t>> prompts;
  for (uint64_t id = 1; id <= 3; ++id)
    prompts[id] = testing::random_prompt(8 + 5 * static_cast<int>(id), 500 + id, V);
  auto len = [](uint64_t id) { return 17 + static_cast<int>(id); };
  auto params = [&](uint64_t id, bool rollback, std::shared_ptr<AltStats> st) {
    SamplingParams p;
    p.temperature = id == 3 ? 1.f : 0.f;  // request 3 samples
    p.seed = 40 + id;
    p.max_tokens = 40;
    p.constraint = std::make_shared<AltFactory>(len(id), V, rollback, std::move(st));
    return p;
  };
  auto keeps = [&](const std::vector<int32_t>& t) {
    for (size_t i = 1; i < t.size(); ++i)
      if (!AltConstraint::follows(t[i - 1], t[i])) return false;
    return true;
  };
  auto plain_stats = std::make_shared<AltStats>();
  Driver plain(**m, nullptr, 64, 64);
  for (const auto& [id, pr] : prompts) plain.add(id, pr, params(id, true, plain_stats));
  auto base = plain.run();
  std::map<uint64_t, std::vector<int32_t>> full;
  for (const auto& [id, pr] : prompts) {
    ASSERT_EQ(static_cast<int>(base[id].tokens.size()), len(id)) << id;
    EXPECT_TRUE(keeps(base[id].tokens)) << id;
    EXPECT_EQ(base[id].reason, sched::FinishReason::kStop) << id;
    full[id] = pr;
    full[id].insert(full[id].end(), base[id].tokens.begin(), base[id].tokens.end());
  }
  EXPECT_EQ(plain_stats->refused, 0);
  // Drafts from the reference, except: every 5th position one the constraint refuses (the
  // previous token's residue), every 7th a wrong one it takes.
  auto drafts = [&full, V](const std::vector<DraftSeq>& seqs,
                           const std::vector<std::vector<int32_t>>& drafted) {
    std::vector<std::vector<int32_t>> out(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int known = seqs[i].start_pos + seqs[i].num_valid + 1;
      const auto& f = full.at(seqs[i].request_id);
      int32_t prev = f[known - 1];
      for (size_t j = 0; j < drafted[i].size() && known + j < f.size(); ++j) {
        const int idx = known + static_cast<int>(j);
        int32_t t = f[idx];
        if (idx % 5 == 3) {
          t = (prev + 4) % V;
        } else if (idx % 7 == 2) {
          t = (f[idx] + 1) % V;
          if (!AltConstraint::follows(prev, t)) t = (t + 1) % V;
        }
        out[i].push_back(t);
        prev = t;
      }
    }
    return out;
  };
  for (bool rollback : {true, false}) {
    SCOPED_TRACE(rollback ? "with rollback" : "without rollback");
    auto st = std::make_shared<AltStats>();
    auto spec = random_spec(**m, 3, 64, ::testing::TempDir() + "/draft_constrained");
    ASSERT_NE(spec, nullptr);
    spec->set_proposal_override(drafts);
    SpecDecoder* sd = spec.get();
    Driver d(**m, std::move(spec), 64, 64);
    for (const auto& [id, pr] : prompts) d.add(id, pr, params(id, rollback, st));
    auto out = d.run();
    for (const auto& [id, pr] : prompts) {
      SCOPED_TRACE("request " + std::to_string(id));
      if (id != 3) {
        EXPECT_EQ(out[id].tokens, base[id].tokens);
      }
      EXPECT_EQ(static_cast<int>(out[id].tokens.size()), len(id));
      EXPECT_TRUE(keeps(out[id].tokens));
      EXPECT_EQ(out[id].reason, sched::FinishReason::kStop);
    }
    const SpecDecodeStats s = sd->stats();
    if (rollback) {
      EXPECT_GT(s.num_draft_tokens, 0);
      EXPECT_GT(s.num_accepted_tokens, 0);
      EXPECT_LT(s.num_accepted_tokens, s.num_draft_tokens);
      EXPECT_GT(st->refused, 0);      // drafts were checked and cut
      EXPECT_GT(st->rolled_back, 0);  // and the constraint stepped back
    } else {
      EXPECT_EQ(s.num_draft_tokens, 0);
      EXPECT_EQ(st->rolled_back, 0);
    }
  }
}

TEST(SpecDecode, PreemptionUnderATinyPoolKeepsTheOutput) {
  // 14 pages of 8 tokens for four requests that grow to 40 tokens (+ lookahead pages): they
  // preempt each other; drafts are dropped with the pages and the output stays the target's.
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::map<uint64_t, std::vector<int32_t>> prompts, refs, full;
  for (uint64_t id = 1; id <= 4; ++id) {
    prompts[id] = testing::random_prompt(20, 40 + id, V);
    refs[id] = testing::reference_greedy(**m, prompts[id], 20);
    full[id] = prompts[id];
    full[id].insert(full[id].end(), refs[id].begin(), refs[id].end());
  }
  auto spec = random_spec(**m, 3, 14, ::testing::TempDir() + "/draft_preempt");
  ASSERT_NE(spec, nullptr);
  spec->set_proposal_override(oracle(full, V));
  Driver d(**m, std::move(spec), 14, 64);
  SamplingParams p;
  p.temperature = 0.f;
  p.max_tokens = 20;
  for (const auto& [id, pr] : prompts) d.add(id, pr, p);
  auto out = d.run();
  for (const auto& [id, ref] : refs) EXPECT_EQ(out[id].tokens, ref) << "request " << id;
  EXPECT_GT(d.scheduler().stats().num_preemptions, 0) << "the pool was meant to force preemption";
}

TEST(SpecDecode, SyntheticAcceptanceAcceptsAtTheAskedRate) {
  // Benchmark mode: drafts (the random draft's) accepted at random, whatever the target says.
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  const std::string dir = ::testing::TempDir() + "/draft_synthetic";
  testing::write_draft(dir, testing::shape_for((*m)->config()));
  SpeculativeConfig sc;
  sc.method = "eagle3";
  sc.model = dir;
  sc.num_speculative_tokens = 3;
  sc.synthetic = true;
  sc.synthetic_acceptance_length = 2.78;
  auto spec = SpecDecoder::create(sc, (*m)->config(), (*m)->base_weights(), 96);
  ASSERT_TRUE(spec.has_value()) << spec.error().message;
  SpecDecoder* sd = spec->get();
  const double a = sd->accept_probability();
  Driver d(**m, std::move(*spec), 96, 64);
  SamplingParams p;
  p.temperature = 0.f;
  p.max_tokens = 80;
  for (uint64_t id = 1; id <= 4; ++id) d.add(id, testing::random_prompt(10, 500 + id, V), p);
  auto out = d.run();
  for (uint64_t id = 1; id <= 4; ++id) EXPECT_EQ(out[id].tokens.size(), 80u);
  const SpecDecodeStats st = sd->stats();
  ASSERT_GT(st.num_drafts, 60);
  // The first draft of a step is accepted with probability a (~0.68): the binomial standard error
  // at >= 60 steps is <= 0.06, so 0.2 is over 3 of them.
  EXPECT_NEAR(static_cast<double>(st.accepted_per_pos[0]) / st.num_drafts, a, 0.2);
  const double len = 1.0 + static_cast<double>(st.num_accepted_tokens) / st.num_drafts;
  EXPECT_NEAR(len, 2.78, 0.5);  // drafts cut short near max_tokens pull it down a little
}

TEST(SpecDecode, SampledRequestsKeepTheTargetsJointDistribution) {
  // The whole chain (drafts, rejection sampling per position, the bonus token, rollback, the
  // next step's drafts) against the exact distribution: tokens 1-3 of a sampled request (top_k 4,
  // temperature 1) over 6000 seeds, with drafts that are often wrong, vs the product of the
  // model's processed next-token distributions p(t1) p(t2 | t1) p(t3 | t1, t2).
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  const std::vector<int32_t> prompt = testing::random_prompt(10, 4242, V);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 4;
  p.max_tokens = 4;  // tokens 1-3 are compared; the 4th lets the first verify take 2 drafts
  auto dist = [&](const std::vector<int32_t>& ctx) {
    runtime::SequenceRunner r(**m, static_cast<int64_t>(ctx.size()) + 1, 1);
    const int s = r.add_sequence();
    auto out = r.step({{s, ctx, false}});
    std::vector<float> row(out.logits.begin(), out.logits.begin() + V);
    std::vector<double> pr;
    Sampler::prepare(row, p, ctx, {}, V);
    Sampler::probs(row, p, V, &pr);
    return pr;
  };
  // Exact joint over the top-k supports, and per context the drafts: the second most likely
  // t2 given t1 (often rejected), then the most likely t3 after it.
  std::map<std::vector<int32_t>, double> exact;
  std::map<int32_t, std::vector<int32_t>> drafts_after;
  auto ranked = [](const std::vector<double>& pr) {
    std::vector<int32_t> idx;
    for (int32_t t = 0; t < static_cast<int32_t>(pr.size()); ++t)
      if (pr[t] > 0) idx.push_back(t);
    std::sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) { return pr[x] > pr[y]; });
    return idx;
  };
  const auto p1 = dist(prompt);
  for (int32_t a = 0; a < V; ++a) {
    if (p1[a] <= 0) continue;
    auto c1 = prompt;
    c1.push_back(a);
    const auto p2 = dist(c1);
    const int32_t d1 = ranked(p2)[1];
    auto cd = c1;
    cd.push_back(d1);
    drafts_after[a] = {d1, ranked(dist(cd))[0]};
    for (int32_t b = 0; b < V; ++b) {
      if (p2[b] <= 0) continue;
      auto c2 = c1;
      c2.push_back(b);
      const auto p3 = dist(c2);
      for (int32_t c = 0; c < V; ++c)
        if (p3[c] > 0) exact[{a, b, c}] = p1[a] * p2[b] * p3[c];
    }
  }
  ASSERT_EQ(drafts_after.size(), 4u);
  auto spec = random_spec(**m, 2, 512, ::testing::TempDir() + "/draft_joint");
  ASSERT_NE(spec, nullptr);
  spec->set_proposal_override(
      [&](const std::vector<DraftSeq>& seqs, const std::vector<std::vector<int32_t>>& drafted) {
        std::vector<std::vector<int32_t>> out = drafted;  // later steps: the random draft's
        for (size_t i = 0; i < seqs.size(); ++i) {
          // The step that sampled t1: its last verified position is the prompt's last (the
          // prefix cache may have served the start of the prompt).
          const size_t end = static_cast<size_t>(seqs[i].start_pos + seqs[i].num_valid);
          if (end != prompt.size() || drafted[i].empty()) continue;
          const auto& d = drafts_after.at(seqs[i].next_tokens.back());  // after t1
          out[i].assign(d.begin(), d.begin() + std::min(d.size(), drafted[i].size()));
        }
        return out;
      });
  SpecDecoder* sd = spec.get();
  Driver d(**m, std::move(spec), 512, 1024, /*prefix_caching=*/true, /*max_num_seqs=*/64);
  const int n = 6000;
  for (int i = 0; i < n; ++i) {
    SamplingParams q = p;
    q.seed = 1000 + i;
    d.add(static_cast<uint64_t>(i + 1), prompt, q);
  }
  auto out = d.run();
  std::map<std::vector<int32_t>, int64_t> counts;
  for (const auto& [id, r] : out) {
    ASSERT_EQ(r.tokens.size(), 4u);
    const std::vector<int32_t> first3(r.tokens.begin(), r.tokens.begin() + 3);
    ASSERT_TRUE(exact.count(first3)) << "a token outside the top-k support";
    ++counts[first3];
  }
  EXPECT_GT(sd->stats().num_accepted_tokens, 0);
  EXPECT_LT(sd->stats().num_accepted_tokens, sd->stats().num_draft_tokens);
  // Pearson's chi-square over cells with >= 5 expected (the rest pooled into one cell).
  double chi = 0, pooled_e = 0, pooled_o = 0;
  int cells = 0;
  for (const auto& [k, pr] : exact) {
    const double e = pr * n;
    const double o = counts.count(k) ? static_cast<double>(counts[k]) : 0.0;
    if (e < 5) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    chi += (o - e) * (o - e) / e;
    ++cells;
  }
  if (pooled_e > 0) {
    chi += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++cells;
  }
  // The 0.999 quantile of chi-square with df = cells - 1 (Wilson-Hilferty, z = 3.09): a correct
  // sampler fails one time in a thousand; one that leans toward the drafts fails at once.
  const double df = cells - 1, z = 3.09;
  const double q999 = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  EXPECT_LT(chi, q999) << cells << " cells, " << sd->stats().num_accepted_tokens << " of "
                       << sd->stats().num_draft_tokens << " drafts accepted";
}

// ---------------------------------------------------------------- verification on the device

// The CPU backend, counting per step the logits rows it returned to the host and the rows its
// sampler drew (the GPU backend's device sampler, kernels/cuda/sample.h, has this CPU op as its
// oracle). `device` false: a backend without device sampling (every row to the host, every draw
// by the runner's host sampler), the reference the device path must reproduce.
class CountingBackend final : public runtime::ForwardBackend {
 public:
  CountingBackend(const model::M3Model& m, int num_pages, bool device)
      : b_(runtime::borrow_cpu_backend(m, num_pages)), device_(device) {}
  const model::M3Config& config() const override { return b_->config(); }
  int64_t num_pages() const override { return b_->num_pages(); }
  void forward(const model::ForwardBatch& batch, model::ForwardResult* out,
               bool capture_msa) override {
    b_->forward(batch, out, capture_msa);
    host_rows += static_cast<int64_t>(out->logits.size()) / out->vocab_size;
    device_rows += static_cast<int64_t>(batch.device_samples.size());
  }
  bool samples_on_device() const override { return device_; }
  std::string device_name() const override { return "cpu"; }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }
  std::string speculative_refusal() const override { return ""; }
  int64_t host_rows = 0, device_rows = 0;

 private:
  std::unique_ptr<runtime::ForwardBackend> b_;
  bool device_;
};

TEST(SpecDecode, GreedyAndSyntheticVerifyRowsAreSampledOnTheDeviceWithTheHostsTokens) {
  // Verification from the device's draws (greedy: the argmax; synthetic: the ordinary draw
  // after a random rejection) gives the tokens, acceptance counts and finish reasons of host
  // verification over full logits rows, and no verify row of those requests comes back as
  // logits; requests that need the row (exact rejection sampling, logprobs) keep it.
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::map<uint64_t, std::vector<int32_t>> prompts, full;
  const int n_out = 19;
  for (uint64_t id = 1; id <= 4; ++id) {
    prompts[id] = testing::random_prompt(6 + 5 * static_cast<int>(id), 700 + id, V);
    full[id] = prompts[id];
    const auto ref = testing::reference_greedy(**m, prompts[id], n_out);
    full[id].insert(full[id].end(), ref.begin(), ref.end());
  }
  struct Case {
    const char* name;
    bool synthetic;
    std::function<SamplingParams(uint64_t)> params;
    bool all_on_device;  // every row drawn by the backend's sampler, none to the host
  };
  auto greedy = [](uint64_t) {
    SamplingParams p;
    p.temperature = 0.f;
    p.max_tokens = n_out;
    return p;
  };
  auto sampled = [](uint64_t id) {
    SamplingParams p;
    p.temperature = 0.9f;
    p.top_k = 6;
    p.top_p = 0.95f;
    p.seed = 40 + id;
    p.max_tokens = n_out;
    return p;
  };
  auto mixed = [&](uint64_t id) {
    if (id == 2) return sampled(id);  // exact rejection sampling: its rows to the host
    SamplingParams p = greedy(id);
    if (id == 3) p.logprobs = 1;  // the row's logprobs: to the host
    return p;
  };
  const std::vector<Case> cases = {{"greedy, exact", false, greedy, true},
                                   {"greedy, synthetic", true, greedy, true},
                                   {"sampled, synthetic", true, sampled, true},
                                   {"mixed, exact", false, mixed, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::map<uint64_t, Result1> got[2];
    SpecDecodeStats stats[2];
    int64_t host_rows[2], device_rows[2];
    for (int device = 0; device < 2; ++device) {
      auto spec = random_spec(**m, 3, 64, ::testing::TempDir() + "/draft_device_verify");
      ASSERT_NE(spec, nullptr);
      if (c.synthetic) {
        SpeculativeConfig sc = spec->config();
        sc.synthetic = true;
        sc.synthetic_acceptance_length = 2.5;
        auto s = SpecDecoder::create(sc, (*m)->config(), (*m)->base_weights(), 64);
        ASSERT_TRUE(s.has_value()) << s.error().message;
        spec = std::move(*s);
      }
      spec->set_proposal_override(oracle(full, V));  // (the synthetic cases accept at random)
      SpecDecoder* sd = spec.get();
      auto backend = std::make_unique<CountingBackend>(**m, 64, device == 1);
      CountingBackend* cb = backend.get();
      Driver d(**m, std::move(backend), std::move(spec), 64, 64);
      for (const auto& [id, pr] : prompts) d.add(id, pr, c.params(id));
      got[device] = d.run();
      stats[device] = sd->stats();
      host_rows[device] = cb->host_rows;
      device_rows[device] = cb->device_rows;
    }
    for (const auto& [id, pr] : prompts) {
      EXPECT_EQ(got[1][id].tokens, got[0][id].tokens) << "request " << id;
      EXPECT_EQ(got[1][id].reason, sched::FinishReason::kLength) << "request " << id;
      EXPECT_EQ(got[1][id].logprobs.size(), got[0][id].logprobs.size()) << "request " << id;
      if (!c.synthetic && c.params(id).temperature <= 0.f) {
        EXPECT_EQ(got[1][id].tokens,
                  std::vector<int32_t>(full[id].begin() + pr.size(), full[id].end()))
            << "request " << id << ": not the target's greedy output";
      }
    }
    EXPECT_GT(stats[1].num_drafts, 0);
    EXPECT_EQ(stats[1].num_drafts, stats[0].num_drafts);
    EXPECT_EQ(stats[1].num_accepted_tokens, stats[0].num_accepted_tokens);
    EXPECT_LT(stats[1].num_accepted_tokens, stats[1].num_draft_tokens);  // some rejected
    EXPECT_EQ(device_rows[0], 0);
    EXPECT_GT(host_rows[0], 0);
    EXPECT_GT(device_rows[1], 0);
    if (c.all_on_device) {
      EXPECT_EQ(host_rows[1], 0) << "a verify row came back as logits";
      // Every row the host path had is drawn on the device instead (the same rows).
      EXPECT_EQ(device_rows[1], host_rows[0]);
    } else {
      EXPECT_GT(host_rows[1], 0) << "the sampled request's and the logprobs' rows";
      EXPECT_LT(host_rows[1], host_rows[0]) << "the greedy request's rows stay on the device";
      EXPECT_EQ(device_rows[1] + host_rows[1], host_rows[0]);
    }
  }
}

// ---------------------------------------------------------------- the engine, a draft on disk

class SpecDecodeEngineHeads : public ::testing::TestWithParam<int> {};

TEST_P(SpecDecodeEngineHeads, GreedyMatchesTheReferenceAndCountsDrafts) {
  // The draft head with GQA (2 KV heads of 4) and MHA (4 of 4), read from disk.
  const int kv_heads = GetParam();
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const std::string dir = ::testing::TempDir() + "/draft_engine_" + std::to_string(kv_heads);
  auto shape = testing::shape_for((*m)->config());
  shape.kv_heads = kv_heads;
  testing::write_draft(dir, shape);
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  cfg.max_num_seqs = 4;
  cfg.kv_cache_memory_bytes = 4 << 20;
  cfg.speculative.method = "eagle3";
  cfg.speculative.model = dir;
  cfg.speculative.num_speculative_tokens = 3;
  auto e = Engine::create(cfg);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  EXPECT_NE((*e)->model_info().speculative.find("eagle3 with 3 draft tokens"), std::string::npos)
      << (*e)->model_info().speculative;
  EXPECT_NE((*e)->model_info().speculative.find(kv_heads == 4 ? "(MHA)" : "(GQA, 2 KV heads)"),
            std::string::npos)
      << (*e)->model_info().speculative;
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<std::vector<int32_t>> refs;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest r;
    r.prompt_token_ids = testing::random_prompt(6 + 5 * i, 900 + i, V);
    r.params.temperature = 0.f;
    r.params.max_tokens = 14;
    r.params.ignore_eos = true;
    refs.push_back(testing::reference_greedy(**m, r.prompt_token_ids, 14));
    auto s = (*e)->submit(std::move(r));
    ASSERT_TRUE(s.has_value());
    streams.push_back(*s);
  }
  for (size_t i = 0; i < streams.size(); ++i)
    EXPECT_EQ(testing::collect(*streams[i]).tokens, refs[i]) << "request " << i;
  const SpecDecodeStats st = (*e)->stats().spec_decode;
  EXPECT_TRUE(st.enabled);
  EXPECT_GT(st.num_drafts, 0);
  EXPECT_EQ(st.num_draft_tokens > 0, true);
  EXPECT_EQ(st.accepted_per_pos.size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(GqaAndMha, SpecDecodeEngineHeads, ::testing::Values(2, 4));

// Tensor parallel, data parallel (each rank its own sequences, the aux states merged back in the
// step's order), and data parallel + expert parallel over partitioned pools: every request's
// greedy output is the single-rank reference's (dp_batch_split_test checks the merged aux states
// themselves: this random draft accepts nothing, so its proposals cannot show them).
TEST(SpecDecodeEngine, TensorAndDataParallelCpuRanksGiveTheReference) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const std::string dir = ::testing::TempDir() + "/draft_tp";
  testing::write_draft(dir, testing::shape_for((*m)->config()));
  struct Case {
    int tp, dp;
    bool ep, partitions;
  };
  const int V = static_cast<int>((*m)->config().vocab_size);
  std::vector<std::vector<int32_t>> prompts, refs;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(testing::random_prompt(9 + 4 * i, 77 + i, V));
    refs.push_back(testing::reference_greedy(**m, prompts.back(), 12));
  }
  for (const Case c :
       {Case{2, 1, false, false}, Case{1, 2, false, false}, Case{1, 2, true, true}}) {
    SCOPED_TRACE("tp " + std::to_string(c.tp) + " dp " + std::to_string(c.dp) +
                 (c.ep ? " ep" : "") + (c.partitions ? " partitioned" : ""));
    EngineConfig cfg;
    cfg.model_dir = kModel;
    cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
    cfg.max_num_seqs = 4;
    cfg.kv_cache_memory_bytes = 4 << 20;  // a small pool: the test is about the draft
    cfg.speculative.method = "eagle3";
    cfg.speculative.model = dir;
    cfg.speculative.num_speculative_tokens = 2;
    cfg.backend_factory = [c](std::unique_ptr<model::M3Model> host, int64_t pages) {
      return runtime::make_cpu_sharded_backend(std::move(host), pages, c.tp, c.ep, c.dp,
                                               c.partitions);
    };
    auto e = Engine::create(cfg);
    ASSERT_TRUE(e.has_value()) << e.error().message;
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& p : prompts) {
      GenerateRequest r;
      r.prompt_token_ids = p;
      r.params.temperature = 0.f;
      r.params.max_tokens = 12;
      r.params.ignore_eos = true;
      auto s = (*e)->submit(std::move(r));
      ASSERT_TRUE(s.has_value());
      streams.push_back(*s);
    }
    for (size_t i = 0; i < streams.size(); ++i)
      EXPECT_EQ(testing::collect(*streams[i]).tokens, refs[i]) << "request " << i;
    EXPECT_GT((*e)->stats().spec_decode.num_drafts, 0);
  }
}

TEST(SpecDecodeEngine, BadDraftsAreRefusedWithBothNumbers) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  const model::M3Config& c = (*m)->config();
  auto refuse = [&](testing::DraftShape s, const std::vector<std::string>& needles,
                    const std::string& arch = "LlamaForCausalLMEagle3") {
    const std::string dir = ::testing::TempDir() + "/draft_bad";
    std::filesystem::remove_all(dir);
    testing::write_draft(dir, s, 3, arch);
    EngineConfig cfg;
    cfg.model_dir = kModel;
    cfg.block_size = static_cast<int>(c.sparse_block_size);
    cfg.max_num_seqs = 4;
    cfg.kv_cache_memory_bytes = 4 << 20;
    cfg.speculative.method = "eagle3";
    cfg.speculative.model = dir;
    cfg.speculative.num_speculative_tokens = 3;
    auto e = Engine::create(cfg);
    ASSERT_FALSE(e.has_value());
    for (const auto& n : needles)
      EXPECT_NE(e.error().message.find(n), std::string::npos) << e.error().message;
  };
  auto s = testing::shape_for(c);
  s.vocab = c.vocab_size + 8;
  refuse(s, {"vocabulary (" + std::to_string(c.vocab_size + 8), std::to_string(c.vocab_size)});
  s = testing::shape_for(c);
  s.hidden = c.hidden_size * 2;
  refuse(s, {"hidden size (" + std::to_string(c.hidden_size * 2),
             "target's (" + std::to_string(c.hidden_size) + ")"});
  s = testing::shape_for(c);
  s.target_hidden = c.hidden_size / 2;
  refuse(s, {std::to_string(c.hidden_size / 2), std::to_string(c.hidden_size)});
  s = testing::shape_for(c);
  s.aux = {1, 99};
  refuse(s, {"layer id 99", "[0, " + std::to_string(c.num_hidden_layers) + "]"});
  refuse(testing::shape_for(c), {"LlamaForCausalLM]", "LlamaForCausalLMEagle3"},
         "LlamaForCausalLM");
}

// The synthetic benchmark drafts are made on the GPU only: the CPU backend refuses them by name,
// and a synthetic (config-only) target's host draft is refused naming --device cuda.
TEST(SpecDecodeEngine, SyntheticDraftsAndTargetsNeedTheGpu) {
  auto m = model::M3Model::load(kModel);
  ASSERT_TRUE(m.has_value());
  EngineConfig cfg;
  cfg.model_dir = kModel;
  cfg.block_size = static_cast<int>((*m)->config().sparse_block_size);
  cfg.max_num_seqs = 4;
  cfg.kv_cache_memory_bytes = 4 << 20;
  cfg.speculative.method = "eagle3";
  cfg.speculative.model = "synthetic:gqa";
  cfg.speculative.num_speculative_tokens = 3;
  auto e = Engine::create(cfg);
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.error().message.find("synthetic:gqa"), std::string::npos) << e.error().message;
  EXPECT_NE(e.error().message.find("--device cuda"), std::string::npos) << e.error().message;
  const std::string dir = ::testing::TempDir() + "/draft_synth_target";
  testing::write_draft(dir, testing::shape_for((*m)->config()));
  auto d = model::Eagle3Draft::load(dir, (*m)->config(), nullptr, 4);
  ASSERT_FALSE(d.has_value());
  EXPECT_NE(d.error().message.find("--device cuda"), std::string::npos) << d.error().message;
}

}  // namespace
}  // namespace m3::engine
