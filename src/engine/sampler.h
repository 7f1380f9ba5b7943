// Sampler: turns one row of logits into a token, per request (temperature, top_k, top_p, min_p,
// presence/frequency/repetition penalties, seeded RNG), and computes logprobs of the raw model
// distribution (before penalties and temperature, as vLLM reports them by default).
// Called by the engine's model runner per sampled row, and by `m3serve generate`.
// Invariant: with the same logits, history and RNG state, the same token comes out.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "engine/sampling_params.h"

namespace m3::engine {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
};

class Sampler {
 public:
  // The request's RNG: seeded from params.seed, else from a random device.
  static std::mt19937_64 make_rng(const SamplingParams& p);

  // Samples from `logits` (modified in place: penalties, temperature, filters).
  // `history` = prompt + generated ids (for the repetition penalty), `generated` = output ids
  // (for presence/frequency). Tokens with id >= `num_valid` (padding rows) are never chosen.
  static int32_t sample(std::span<float> logits, const SamplingParams& p,
                        std::span<const int32_t> history, std::span<const int32_t> generated,
                        std::mt19937_64& rng, int64_t num_valid);

  // log_softmax(logits)[token] and the `k` best (token, logprob) pairs, best first; ties by id.
  static TokenLogprob logprobs(std::span<const float> logits, int32_t token, int32_t k);
};

}  // namespace m3::engine
