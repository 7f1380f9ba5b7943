// The image and video golden tests' engine side: one request's whole output from an engine
// stream, and its comparison with a golden case of tools/goldens/make_vision_goldens.py /
// make_video_goldens.py (greedy tokens up to the first near-tie, their logprobs, prompt logprobs).
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/engine.h"
#include "model/golden_util.h"

namespace m3::model::golden {

struct EngineRun {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // of `tokens` (the request asked for logprobs)
  std::optional<std::vector<std::optional<engine::TokenLogprobOut>>> prompt_logprobs;
  engine::RequestOutput last;  // the finishing output (finish reason, cached tokens)
  bool timed_out = false;      // no output within a minute
};

inline EngineRun collect(engine::RequestStream& s) {
  EngineRun run;
  for (;;) {
    auto o = s.next(std::chrono::seconds(60));
    if (!o.has_value()) {
      run.timed_out = true;
      return run;
    }
    for (size_t i = 0; i < o->new_token_ids.size(); ++i) {
      run.tokens.push_back(o->new_token_ids[i]);
      if (i < o->logprobs.size()) run.logprobs.push_back(o->logprobs[i].logprob);
    }
    if (o->prompt_logprobs) run.prompt_logprobs = o->prompt_logprobs;
    if (o->finished) {
      run.last = std::move(*o);
      return run;
    }
  }
}

// Greedy tokens against the golden's (`greedy`: token, logprob, top) up to its first near-tie:
// equal tokens, logprobs within kLogprobTol. Returns how many were compared, or -1 after adding a
// failure at the first differing token.
inline int compare_greedy(const EngineRun& run, const nlohmann::json& greedy) {
  int compared = 0;
  for (size_t i = 0; i < greedy.size() && i < run.tokens.size(); ++i) {
    const double margin =
        greedy[i]["top"][0][1].get<double>() - greedy[i]["top"][1][1].get<double>();
    if (margin < kGreedyMarginFloor) break;
    if (run.tokens[i] != greedy[i]["token"].get<int32_t>()) {
      ADD_FAILURE() << "greedy token " << i << ": " << run.tokens[i] << " vs the golden's "
                    << greedy[i]["token"].get<int32_t>();
      return -1;
    }
    EXPECT_LT(i, run.logprobs.size()) << "no logprob for token " << i;
    if (i < run.logprobs.size()) {
      EXPECT_NEAR(run.logprobs[i], greedy[i]["logprob"].get<double>(), kLogprobTol) << i;
    }
    ++compared;
  }
  return compared;
}

// Prompt logprobs (position 0 has none) within kLogprobTol of the golden's `want`.
inline void expect_prompt_logprobs(const EngineRun& run, const nlohmann::json& want) {
  ASSERT_TRUE(run.prompt_logprobs.has_value());
  ASSERT_EQ(run.prompt_logprobs->size(), want.size() + 1);
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE((*run.prompt_logprobs)[i + 1].has_value());
    worst = std::max(worst, std::fabs((*run.prompt_logprobs)[i + 1]->logprob -
                                      want[i]["logprob"].get<double>()));
  }
  EXPECT_LE(worst, kLogprobTol);
}

}  // namespace m3::model::golden
