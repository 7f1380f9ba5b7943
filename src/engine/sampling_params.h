// SamplingParams: the per-request sampling and stopping options, as plain data (no JSON).
// Filled by the server from the OpenAI request (validated there) and by `m3serve generate`;
// read by the sampler and the scheduler's stop criteria.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace m3::engine {

struct SamplingParams {
  float temperature = 1.0f;  // 0 => greedy
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0 or -1 => off
  float min_p = 0.0f;        // [0, 1]
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;  // > 0; 1 => off
  std::optional<uint64_t> seed;     // reproducible sampling when set
  int32_t logprobs = -1;            // -1: none; k >= 0: the chosen token's logprob + top k
  int32_t prompt_logprobs = -1;     // -1: none; k >= 0: per prompt token
  int32_t n = 1;
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

}  // namespace m3::engine
