// Helpers shared by the engine tests (engine_test.cpp, backend_test.cpp): the golden checkpoint
// they run, random prompts, the scheduler-free greedy reference, and draining a request stream.
// Header-only, included by test sources in this folder.
// Invariant: reference_greedy uses model::SequenceRunner, never the engine under test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/m3_model.h"
#include "model/sequence_runner.h"

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
  model::SequenceRunner r(m, static_cast<int64_t>(prompt.size()) + n + 1, 1);
  const int s = r.add_sequence();
  auto out = r.step({{s, prompt, false}});
  std::vector<int32_t> toks;
  for (int i = 0; i < n; ++i) {
    const int32_t t = static_cast<int32_t>(
        std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
    toks.push_back(t);
    if (i + 1 < n) out = r.step({{s, std::span<const int32_t>(&t, 1), false}});
  }
  return toks;
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

}  // namespace m3::engine::testing
