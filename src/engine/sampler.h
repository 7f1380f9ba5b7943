// Sampler: turns one row of logits into a token, per request (the token masks: allowed_token_ids,
// bad words and a constraint's allowed set; then logit_bias and the presence/frequency/repetition
// penalties; then temperature, top_k, min_p, top_p and the draw), and computes logprobs of the
// raw model distribution (before penalties and temperature, as vLLM reports them by default).
// Called by the engine's model runner per row sampled on the host, and by `m3serve generate`.
// Invariant: the draw is kernels/cpu/sample.h's rule (the GPU sampler's oracle): token `step` of a
// request seeded `seed` depends only on its logits row and (seed, step), so a seeded request gives
// the same tokens on the CPU and the GPU backend and in any batch.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "engine/sampling_params.h"
#include "kernels/cpu/sample.h"

namespace m3::engine {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
  int64_t rank = 1;  // 1 + the tokens ranked above `token` (the order of `top`: ties by id)
};

// A counter-based RNG: draw number `step` of a request uses the noise of (seed, step) alone.
// `step` is the output index of the token drawn next (what the GPU sampler is given).
struct SampleRng {
  uint64_t seed = 0;
  uint64_t step = 0;
};

class Sampler {
 public:
  // The request's RNG at step 0: seeded from params.seed, else from a random device.
  static SampleRng make_rng(const SamplingParams& p);

  // Samples from `logits` with the draw (rng.seed, rng.step), then advances rng.step. `logits`
  // is modified in place (penalties; ids >= `num_valid`, padding rows, set to -inf and never
  // chosen). `history` = prompt + generated ids (for the repetition penalty), `generated` =
  // output ids (for presence/frequency and bad words). `allowed`, when not empty, is a
  // constraint's bitmask (TokenConstraint::fill_allowed): tokens whose bit is clear get -inf.
  // When the masks together leave no token, they are dropped for this draw and `*none_allowed`
  // (if given) is set: the caller ends the request after this token.
  static int32_t sample(std::span<float> logits, const SamplingParams& p,
                        std::span<const int32_t> history, std::span<const int32_t> generated,
                        SampleRng& rng, int64_t num_valid, std::span<const uint32_t> allowed = {},
                        bool* none_allowed = nullptr);

  // sample() without the draw: ids >= num_valid set to -inf, the masks (dropped, with
  // *none_allowed set, when they leave no token), logit_bias and the penalties, in place.
  static void prepare(std::span<float> logits, const SamplingParams& p,
                      std::span<const int32_t> history, std::span<const int32_t> generated,
                      int64_t num_valid, std::span<const uint32_t> allowed = {},
                      bool* none_allowed = nullptr);
  // The distribution sample() draws from for a prepared row (temperature, top_k, min_p, top_p;
  // greedy: 1 at the argmax), [logits.size()] with zeros at ids >= num_valid.
  static void probs(std::span<const float> prepared, const SamplingParams& p, int64_t num_valid,
                    std::vector<double>* out);
  // Speculative decoding's rejection sampler for one position: accepts `draft_token` with
  // probability min(1, target/draft) (u_accept uniform in (0, 1)), else draws from the residual
  // max(0, target - draft) normalised, by inverse CDF with u_residual. `draft` empty: the draft
  // proposed greedily (one-hot at draft_token). The result is distributed as `target` whatever
  // the draft (the chi-square test in tests/unit/engine proves it).
  static int32_t rejection_sample(std::span<const double> target, std::span<const double> draft,
                                  int32_t draft_token, double u_accept, double u_residual,
                                  bool* accepted);
  // The SampleRow of a draw (seed, step) of `p` (kernels/cpu/sample.h) from logits row `row`.
  static kernels::cpu::SampleRow draw_row(const SamplingParams& p, uint64_t seed, uint64_t step,
                                          int32_t logits_row = 0);

  // Sets -inf where the masks of `p` (allowed_token_ids, bad_words) and `allowed` forbid a token
  // among the first `num_valid` ids and adds logit_bias. Returns false, leaving `logits`
  // unchanged, when no token would remain.
  static bool apply_masks(std::span<float> logits, const SamplingParams& p,
                          std::span<const int32_t> generated, int64_t num_valid,
                          std::span<const uint32_t> allowed);

  // log_softmax(logits)[token] and the `k` best (token, logprob) pairs, best first; ties by id.
  static TokenLogprob logprobs(std::span<const float> logits, int32_t token, int32_t k);
};

}  // namespace m3::engine
