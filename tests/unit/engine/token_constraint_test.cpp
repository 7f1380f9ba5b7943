// Token masks on the sampler's path: allowed_token_ids, bad words, logit_bias and a
// TokenConstraint's allowed set are honoured by engine::Sampler for every sampling setting
// (masked ids are never drawn, the draw over the rest is kernels::cpu::sample_rows on the masked
// row, so seeds keep their meaning); and through the engine a constraint is fed every sampled
// token, restricts every step of its own request only, and ends the request when it terminates
// (even with ignore_eos), while an unconstrained request in the same batch is unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "kernels/cpu/sample.h"
#include "unit/engine/engine_test_util.h"

namespace m3::engine {
namespace {

constexpr int64_t kVocab = 300;

std::vector<float> logits_of(uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> v(kVocab);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<uint32_t> bits_of(const std::vector<int32_t>& ids, int64_t vocab) {
  std::vector<uint32_t> b((vocab + 31) / 32, 0u);
  for (int32_t t : ids) b[t / 32] |= 1u << (t % 32);
  return b;
}

std::vector<SamplingParams> settings() {
  std::vector<SamplingParams> out;
  for (float t : {0.f, 1.f, 0.7f}) {
    for (int k : {0, 20}) {
      SamplingParams p;
      p.temperature = t;
      p.top_k = k;
      p.top_p = k ? 0.9f : 1.f;
      out.push_back(p);
    }
  }
  return out;
}

TEST(TokenMasks, MaskedIdsAreNeverDrawnAndTheDrawIsTheOracleOnTheMaskedRow) {
  const std::vector<int32_t> allowed = {3, 17, 64, 65, 250, 299};
  const auto bits = bits_of(allowed, kVocab);
  for (const SamplingParams& p : settings()) {
    for (uint64_t step = 0; step < 200; ++step) {
      auto row = logits_of(static_cast<uint32_t>(step));
      auto masked = row;
      for (int64_t t = 0; t < kVocab; ++t)
        if (std::find(allowed.begin(), allowed.end(), t) == allowed.end())
          masked[t] = -std::numeric_limits<float>::infinity();
      kernels::cpu::SampleRow r;
      r.temperature = p.temperature;
      r.top_k = p.top_k;
      r.top_p = p.top_p;
      r.seed = 7;
      r.step = step;
      int32_t want = -1;
      kernels::cpu::sample_rows(masked.data(), kVocab, kVocab, &r, 1, &want);
      SampleRng rng{7, step};
      bool none = false;
      const int32_t got = Sampler::sample(row, p, {}, {}, rng, kVocab, bits, &none);
      ASSERT_FALSE(none);
      ASSERT_NE(std::find(allowed.begin(), allowed.end(), got), allowed.end()) << got;
      EXPECT_EQ(got, want);
    }
  }
}

TEST(TokenMasks, AllowedTokenIdsAndTheConstraintIntersect) {
  SamplingParams p;
  p.temperature = 1.f;
  p.allowed_token_ids = {5, 6, 7, 8};
  const auto bits = bits_of({7, 8, 9}, kVocab);
  for (uint64_t step = 0; step < 100; ++step) {
    auto row = logits_of(static_cast<uint32_t>(step + 1000));
    SampleRng rng{1, step};
    const int32_t got = Sampler::sample(row, p, {}, {}, rng, kVocab, bits);
    EXPECT_TRUE(got == 7 || got == 8) << got;
  }
}

TEST(TokenMasks, BadWordsBanTheLastTokenAfterTheirPrefix) {
  SamplingParams p;
  p.temperature = 0.f;
  auto row = logits_of(3);
  const int32_t best = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
  // A one-token bad word is always banned.
  p.bad_words = {{best}};
  SampleRng rng{0, 0};
  auto work = row;
  EXPECT_NE(Sampler::sample(work, p, {}, {}, rng, kVocab), best);
  // A two-token bad word bans `best` only right after its first token.
  p.bad_words = {{42, best}};
  const std::vector<int32_t> after = {1, 42}, other = {42, 1};
  work = row;
  EXPECT_NE(Sampler::sample(work, p, after, after, rng, kVocab), best);
  work = row;
  EXPECT_EQ(Sampler::sample(work, p, other, other, rng, kVocab), best);
}

TEST(TokenMasks, LogitBiasMovesTheGreedyChoice) {
  SamplingParams p;
  p.temperature = 0.f;
  auto row = logits_of(4);
  const int32_t worst =
      static_cast<int32_t>(std::min_element(row.begin(), row.end()) - row.begin());
  p.logit_bias = {{worst, 100.f}};  // logits are N(0, 3): +100 beats every other id
  SampleRng rng{0, 0};
  EXPECT_EQ(Sampler::sample(row, p, {}, {}, rng, kVocab), worst);
  // A -100 bias on every id but one forces that one.
  auto row2 = logits_of(5);
  p.logit_bias.clear();
  for (int32_t t = 0; t < kVocab; ++t)
    if (t != 11) p.logit_bias.push_back({t, -100.f});
  EXPECT_EQ(Sampler::sample(row2, p, {}, {}, rng, kVocab), 11);
}

TEST(TokenMasks, MasksThatLeaveNothingAreDroppedAndReported) {
  SamplingParams p;
  p.temperature = 0.f;
  p.allowed_token_ids = {5};
  const auto bits = bits_of({6}, kVocab);
  auto row = logits_of(6);
  const int32_t best = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
  SampleRng rng{0, 0};
  bool none = false;
  EXPECT_EQ(Sampler::sample(row, p, {}, {}, rng, kVocab, bits, &none), best);
  EXPECT_TRUE(none);
}

// A constraint that spells a fixed token sequence, then terminates; it records what it saw.
struct Script {
  std::vector<int32_t> tokens;
  std::vector<int32_t> seen;
  int fills = 0;
};

class ScriptConstraint final : public TokenConstraint {
 public:
  explicit ScriptConstraint(std::shared_ptr<Script> s) : s_(std::move(s)) {}
  void fill_allowed(std::span<uint32_t> allowed) override {
    ++s_->fills;
    const int32_t t = s_->tokens[pos_];
    allowed[t / 32] |= 1u << (t % 32);
  }
  bool accept(int32_t t) override {
    s_->seen.push_back(t);
    if (pos_ >= s_->tokens.size() || s_->tokens[pos_] != t) return false;
    ++pos_;
    return true;
  }
  bool is_terminated() const override { return pos_ == s_->tokens.size(); }

 private:
  std::shared_ptr<Script> s_;
  size_t pos_ = 0;
};

class ScriptFactory final : public TokenConstraintFactory {
 public:
  explicit ScriptFactory(std::shared_ptr<Script> s) : s_(std::move(s)) {}
  std::unique_ptr<TokenConstraint> make() const override {
    return std::make_unique<ScriptConstraint>(s_);
  }

 private:
  std::shared_ptr<Script> s_;
};

TEST(TokenConstraintEngine, TheConstraintDrivesItsRequestAndEndsItAsEos) {
  EngineConfig cfg;
  cfg.model_dir = testing::kModel;
  cfg.block_size = 8;
  auto e = Engine::create(cfg);
  ASSERT_TRUE(e.has_value()) << e.error().message;
  const int V = static_cast<int>((*e)->model_info().vocab_size);
  auto script = std::make_shared<Script>();
  script->tokens = {5, 9, 5, 77, 3};
  GenerateRequest constrained;
  constrained.prompt_token_ids = testing::random_prompt(20, 11, V);
  constrained.params.temperature = 1.f;
  constrained.params.seed = 3;
  constrained.params.max_tokens = 50;
  constrained.params.ignore_eos = true;  // the constraint's end stops it all the same
  constrained.params.constraint = std::make_shared<ScriptFactory>(script);
  GenerateRequest free_req = testing::greedy_request(testing::random_prompt(20, 12, V), 10);
  const auto alone = testing::collect(**(*e)->submit(free_req)).tokens;

  auto s1 = (*e)->submit(constrained);
  auto s2 = (*e)->submit(free_req);
  ASSERT_TRUE(s1 && s2);
  const auto got = testing::collect(**s1);
  const auto other = testing::collect(**s2);
  EXPECT_EQ(got.tokens, script->tokens);
  EXPECT_EQ(got.last.finish_reason, "stop");
  EXPECT_EQ(script->seen, script->tokens);
  EXPECT_EQ(script->fills, static_cast<int>(script->tokens.size()));
  EXPECT_EQ(other.tokens, alone);  // the batch neighbour is untouched
}

}  // namespace
}  // namespace m3::engine
