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
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/golden_util.h"
#include "vision/image_decode.h"
#include "vision/image_processor.h"

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

// A golden image (tests/golden/vision/images/NAME) through the decoder and the processor.
inline vision::ProcessedImage load_golden_image(const std::string& name) {
  std::ifstream f(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/images/" + name,
                  std::ios::binary);
  std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  auto img = vision::decode_image(bytes, 1 << 26);
  EXPECT_TRUE(img.has_value());
  auto p = vision::preprocess_image(*img, vision::ProcessorConfig{});
  EXPECT_TRUE(p.has_value());
  return std::move(*p);
}

// A golden case's images (`names`, in prompt order) as the engine's inputs: each at the next run
// of `image_id` in `prompt`, its content hash the name's plus `hash_salt` (a salt stands for other
// content behind the same placeholder ids).
inline std::vector<engine::ImageInput> golden_image_inputs(const std::vector<int32_t>& prompt,
                                                           const nlohmann::json& names,
                                                           int32_t image_id,
                                                           uint64_t hash_salt = 0) {
  std::vector<engine::ImageInput> out;
  int32_t pos = 0;
  for (const auto& n : names) {
    vision::ProcessedImage p = load_golden_image(n.get<std::string>());
    engine::ImageInput im;
    im.grid_t = p.grid_t;
    im.grid_h = p.grid_h;
    im.grid_w = p.grid_w;
    im.num_tokens = static_cast<int32_t>(vision::num_image_tokens(p, 2));
    while (prompt[pos] != image_id) ++pos;
    im.token_offset = pos;
    pos += im.num_tokens;
    im.patches = std::move(p.pixel_values);
    im.content_hash = std::hash<std::string>{}(n.get<std::string>()) + hash_salt;
    out.push_back(std::move(im));
  }
  return out;
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
