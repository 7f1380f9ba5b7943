// engine::Sampler draws with the GPU sampler's rule: for every setting (greedy, temperature,
// top_k, min_p, top_p and their mixes) its token equals kernels::cpu::sample_rows (the oracle of
// kernels/cuda/sample.h) on the same row and (seed, step); penalties are applied to the row
// before that draw; ids past num_valid are never drawn; the step advances once per draw.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "engine/sampler.h"
#include "kernels/cpu/sample.h"

namespace m3::engine {
namespace {

std::vector<float> random_logits(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(g);
  return v;
}

kernels::cpu::SampleRow row_of(const SamplingParams& p, uint64_t seed, uint64_t step) {
  kernels::cpu::SampleRow r;
  r.temperature = p.temperature;
  r.top_p = p.top_p;
  r.top_k = p.top_k;
  r.min_p = p.min_p;
  r.seed = seed;
  r.step = step;
  return r;
}

int32_t oracle(const std::vector<float>& logits, int64_t num_valid, const SamplingParams& p,
               uint64_t seed, uint64_t step) {
  const kernels::cpu::SampleRow r = row_of(p, seed, step);
  int32_t tok = -1;
  kernels::cpu::sample_rows(logits.data(), static_cast<int64_t>(logits.size()), num_valid, &r, 1,
                            &tok);
  return tok;
}

std::vector<SamplingParams> settings() {
  std::vector<SamplingParams> out;
  auto add = [&](float t, int k, float top_p, float min_p) {
    SamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    p.min_p = min_p;
    out.push_back(p);
  };
  add(0.f, 0, 1.f, 0.f);       // greedy
  add(1.f, 0, 1.f, 0.f);       // the whole distribution
  add(0.7f, 0, 1.f, 0.f);      // temperature only
  add(1.3f, 20, 1.f, 0.f);     // top_k
  add(1.f, 0, 0.8f, 0.f);      // top_p
  add(1.f, 0, 1.f, 0.05f);     // min_p
  add(0.9f, 50, 0.9f, 0.02f);  // all three
  return out;
}

TEST(Sampler, DrawsExactlyWhatTheGpuSamplersOracleDraws) {
  constexpr int64_t kVocab = 1000;
  int checked = 0, differs_from_greedy = 0;
  for (const SamplingParams& p : settings()) {
    for (uint64_t seed : {1ull, 42ull, 0xdeadbeefull}) {
      for (uint64_t step = 0; step < 12; ++step) {
        const std::vector<float> logits = random_logits(kVocab, static_cast<uint32_t>(seed + step));
        std::vector<float> work = logits;
        SampleRng rng{seed, step};
        const int32_t got = Sampler::sample(work, p, {}, {}, rng, kVocab);
        EXPECT_EQ(got, oracle(logits, kVocab, p, seed, step))
            << "temperature " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p
            << " min_p " << p.min_p << " seed " << seed << " step " << step;
        EXPECT_EQ(rng.step, step + 1);
        SamplingParams greedy;
        greedy.temperature = 0.f;
        if (got != oracle(logits, kVocab, greedy, seed, step)) ++differs_from_greedy;
        ++checked;
      }
    }
  }
  // The comparison must not be vacuous: at these temperatures many draws leave the argmax.
  EXPECT_GT(differs_from_greedy, checked / 4);
}

TEST(Sampler, PenaltiesChangeTheRowBeforeTheSameDraw) {
  constexpr int64_t kVocab = 300;
  const std::vector<float> logits = random_logits(kVocab, 7);
  const std::vector<int32_t> history = {3, 5, 5, 9, 5, 200};  // prompt 3, 5; then the output
  const std::vector<int32_t> generated(history.begin() + 2, history.end());
  SamplingParams p;
  p.temperature = 1.f;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 0.4f;
  p.frequency_penalty = 0.25f;
  // The penalised row, written out: repetition over the whole history, presence/frequency over
  // the output.
  std::vector<float> want = logits;
  for (int32_t t : {3, 5, 9, 200})
    want[t] = want[t] > 0 ? want[t] / p.repetition_penalty : want[t] * p.repetition_penalty;
  want[5] -= 2 * p.frequency_penalty + p.presence_penalty;  // 5 twice in the output
  for (int32_t t : {9, 200}) want[t] -= p.frequency_penalty + p.presence_penalty;
  for (uint64_t step = 0; step < 16; ++step) {
    std::vector<float> work = logits;
    SampleRng rng{11, step};
    const int32_t got = Sampler::sample(work, p, history, generated, rng, kVocab);
    EXPECT_EQ(work, want) << "the row the draw sees";
    EXPECT_EQ(got, oracle(want, kVocab, p, 11, step)) << "step " << step;
  }
}

TEST(Sampler, IdsPastNumValidAreNeverDrawn) {
  constexpr int64_t kVocab = 64, kValid = 10;
  std::vector<float> logits = random_logits(kVocab, 3);
  for (int64_t i = kValid; i < kVocab; ++i) logits[i] += 50.f;  // padding rows would win
  for (const SamplingParams& p : settings()) {
    for (uint64_t step = 0; step < 20; ++step) {
      std::vector<float> work = logits;
      SampleRng rng{5, step};
      const int32_t got = Sampler::sample(work, p, {}, {}, rng, kValid);
      EXPECT_LT(got, kValid);
      EXPECT_EQ(got, oracle(logits, kValid, p, 5, step));
    }
  }
}

TEST(Sampler, MakeRngStartsAtStepZeroWithTheRequestSeed) {
  SamplingParams p;
  p.seed = 1234;
  const SampleRng r = Sampler::make_rng(p);
  EXPECT_EQ(r.seed, 1234u);
  EXPECT_EQ(r.step, 0u);
}

}  // namespace
}  // namespace m3::engine
