// Helpers shared by the engine tests (engine_test.cpp, backend_test.cpp, and the multi-GPU
// engine cases of tests/model_cuda, sampling_cuda_test.cpp): the golden checkpoint they run,
// random prompts, the scheduler-free greedy and seeded-sampling references, draining a request
// stream, batched greedy generation.
// Header-only.
// Invariant: the references use runtime::SequenceRunner, never the engine under test.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "kernels/cpu/sample.h"
#include "model/golden_util.h"
#include "model/m3_model.h"
#include "runtime/sequence_runner.h"

namespace m3::engine::testing {

inline const std::string kModel =
    std::string(M3_SOURCE_DIR) + "/tests/golden/model/msa_small_blocks";

inline std::vector<int32_t> random_prompt(int n, uint32_t seed, int vocab) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Greedy continuation with the scheduler-free runner (the reference).
inline std::vector<int32_t> reference_greedy(const model::M3Model& m,
                                             const std::vector<int32_t>& prompt, int n) {
  runtime::SequenceRunner r(m, static_cast<int64_t>(prompt.size()) + n + 1, 1);
  const int s = r.add_sequence();
  auto out = r.step({{s, prompt, false}});
  std::vector<int32_t> toks;
  for (int i = 0; i < n; ++i) {
    const int32_t t = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) -
                                           out.logits.begin());
    toks.push_back(t);
    if (i + 1 < n) out = r.step({{s, std::span<const int32_t>(&t, 1), false}});
  }
  return toks;
}

// A seeded sampled continuation with the scheduler-free runner: each step's logits row drawn by
// kernels::cpu::sample_rows with (params.seed, output index), the rule both backends sample by.
// `num_stable` counts the leading tokens whose draw survives lowering the drawn token's logit by
// `margin` (a step below it may flip on another backend's summation order). The request has a
// seed, ignores EOS and has no penalties (their rows are tested in sampler_test.cpp).
struct SampledReference {
  std::vector<int32_t> tokens;
  size_t num_stable = 0;
};
inline SampledReference reference_sampled(const model::M3Model& m, const GenerateRequest& r,
                                          float margin = 0.f) {
  const SamplingParams& p = r.params;
  EXPECT_TRUE(p.seed.has_value() && p.ignore_eos && p.repetition_penalty == 1.f &&
              p.presence_penalty == 0.f && p.frequency_penalty == 0.f);
  const int n = p.max_tokens;
  runtime::SequenceRunner runner(m, static_cast<int64_t>(r.prompt_token_ids.size()) + n + 1, 1);
  const int s = runner.add_sequence();
  auto out = runner.step({{s, r.prompt_token_ids, false}});
  const int64_t vocab = static_cast<int64_t>(out.logits.size());
  auto draw = [&](const std::vector<float>& row, uint64_t step) {
    kernels::cpu::SampleRow sr;
    sr.temperature = p.temperature;
    sr.top_p = p.top_p;
    sr.top_k = p.top_k;
    sr.min_p = p.min_p;
    sr.seed = *p.seed;
    sr.step = step;
    int32_t t = -1;
    kernels::cpu::sample_rows(row.data(), vocab, vocab, &sr, 1, &t);
    return t;
  };
  SampledReference ref;
  bool stable = true;
  for (int i = 0; i < n; ++i) {
    const int32_t t = draw(out.logits, static_cast<uint64_t>(i));
    std::vector<float> lowered = out.logits;
    lowered[t] -= margin;
    stable = stable && (margin <= 0.f || draw(lowered, static_cast<uint64_t>(i)) == t);
    if (stable) ++ref.num_stable;
    ref.tokens.push_back(t);
    if (i + 1 < n) out = runner.step({{s, std::span<const int32_t>(&t, 1), false}});
  }
  return ref;
}

// Seeded requests over the settings the sampler supports (temperature, top_k, top_p, min_p), one
// with logprobs (on the GPU backend the host samples that row), 10 tokens each.
inline std::vector<GenerateRequest> seeded_requests(int vocab) {
  struct S {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    int logprobs;
  };
  const S settings[] = {{1.f, 0, 1.f, 0.f, -1},
                        {0.8f, 40, 1.f, 0.f, -1},
                        {1.2f, 0, 0.9f, 0.f, -1},
                        {1.f, 0, 1.f, 0.05f, 2},
                        {0.9f, 50, 0.95f, 0.02f, -1}};
  std::vector<GenerateRequest> out;
  uint64_t seed = 7;
  for (const S& s : settings) {
    GenerateRequest r;
    r.prompt_token_ids = random_prompt(9 + 7 * static_cast<int>(out.size()),
                                       static_cast<uint32_t>(60 + out.size()), vocab);
    r.params.temperature = s.temperature;
    r.params.top_k = s.top_k;
    r.params.top_p = s.top_p;
    r.params.min_p = s.min_p;
    r.params.logprobs = s.logprobs;
    r.params.seed = seed++;
    r.params.max_tokens = 10;
    r.params.ignore_eos = true;
    out.push_back(std::move(r));
  }
  return out;
}

struct Collected {
  std::vector<int32_t> tokens;
  RequestOutput last;
  std::vector<RequestOutput> all;
};

// Every output of the stream until it finishes (a 60 s silence fails the test).
inline Collected collect(RequestStream& s) {
  Collected c;
  for (;;) {
    auto o = s.next(std::chrono::milliseconds(60000));
    if (!o) {
      ADD_FAILURE() << "stream timed out";
      return c;
    }
    c.tokens.insert(c.tokens.end(), o->new_token_ids.begin(), o->new_token_ids.end());
    c.all.push_back(*o);
    if (o->finished) {
      c.last = *o;
      return c;
    }
  }
}

// Submits every request at once (so the engine batches their steps) and returns each one's
// generated tokens, in request order.
inline std::vector<std::vector<int32_t>> generate_all(Engine& e,
                                                      const std::vector<GenerateRequest>& reqs) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) {
    auto s = e.submit(r);
    if (!s) {
      ADD_FAILURE() << s.error().message;
      return {};
    }
    streams.push_back(std::move(*s));
  }
  std::vector<std::vector<int32_t>> outs;
  for (auto& s : streams) outs.push_back(collect(*s).tokens);
  return outs;
}

// A greedy request of `n` tokens that ignores EOS.
inline GenerateRequest greedy_request(std::vector<int32_t> prompt, int n) {
  GenerateRequest r;
  r.prompt_token_ids = std::move(prompt);
  r.params.temperature = 0;
  r.params.max_tokens = n;
  r.params.ignore_eos = true;
  return r;
}

// One greedy request per golden case (golden.json's "cases"), each as long as the case's greedy
// continuation before its first near-tie; cases that start with a near-tie are left out.
inline std::vector<GenerateRequest> golden_greedy_requests(const nlohmann::json& g) {
  std::vector<GenerateRequest> reqs;
  for (const auto& c : g["cases"]) {
    const size_t n = model::golden::greedy_tokens_before_near_tie(c);
    if (n > 0)
      reqs.push_back(
          greedy_request(c["prompt_ids"].get<std::vector<int32_t>>(), static_cast<int>(n)));
  }
  return reqs;
}

}  // namespace m3::engine::testing
