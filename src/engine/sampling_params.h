// SamplingParams: the per-request sampling and stopping options, as plain data (no JSON), plus
// the token masks and biases on the sampler's path: logit_bias, allowed_token_ids, bad words as
// token sequences, and an optional TokenConstraint (e.g. a grammar matcher made by the server
// from text::StructuredOutputCompiler) that names the tokens allowed next.
// Filled by the server from the OpenAI request (validated there) and by `m3serve generate`;
// read by the sampler, the model runner and the scheduler's stop criteria.
// Invariant: the engine never sees what a constraint means; it only asks for the allowed set,
// reports the token drawn from it, and stops the request (as on EOS) once it is terminated.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace m3::engine {

// The state of one request's constraint on its next token. Made per request (per choice) by a
// TokenConstraintFactory when the engine admits it; used only by the engine thread afterwards.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets bit (t % 32) of word (t / 32) of `allowed` for each token id t that may come next. The
  // span covers the model's vocabulary ((vocab + 31) / 32 words) and is all zero on entry.
  virtual void fill_allowed(std::span<uint32_t> allowed) = 0;
  // Advances past `token_id`, which was drawn from the allowed set. False: the constraint cannot
  // take it (then the request stops after it).
  virtual bool accept(int32_t token_id) = 0;
  // True once the constraint is complete and takes no more tokens: the request stops.
  virtual bool is_terminated() const = 0;
  // Speculative decoding: whether rollback() works. When it does, the runner checks a request's
  // drafts against the constraint (accept, then rollback) and fills the allowed set of every
  // verify row; otherwise the request gets no drafts.
  virtual bool can_rollback() const { return false; }
  // Steps back over the last `n` accepted tokens (n at most those accepted since the last
  // rollback and at most kMaxSpeculativeTokens + 1), undoing termination. Only when
  // can_rollback().
  virtual void rollback(int n) { (void)n; }
};

// Immutable and shared by the choices of a request (and by requests with the same grammar).
class TokenConstraintFactory {
 public:
  virtual ~TokenConstraintFactory() = default;
  virtual std::unique_ptr<TokenConstraint> make() const = 0;
};

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

  // Added to the logits of these ids before the draw (OpenAI logit_bias, in [-100, 100]).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // When non-empty, only these ids can be drawn (vLLM allowed_token_ids).
  std::vector<int32_t> allowed_token_ids;
  // Banned token sequences (vLLM bad_words): the last id of a sequence cannot be drawn when the
  // output so far ends with the sequence's other ids.
  std::vector<std::vector<int32_t>> bad_words;
  // Structured outputs: each request made from these params gets its own constraint.
  std::shared_ptr<const TokenConstraintFactory> constraint;

  // Whether the row must be sampled on the host (penalties, logprobs, masks or biases).
  bool needs_host_sampling() const {
    return logprobs >= 0 || repetition_penalty != 1.0f || presence_penalty != 0.f ||
           frequency_penalty != 0.f || !logit_bias.empty() || !allowed_token_ids.empty() ||
           !bad_words.empty() || constraint != nullptr;
  }
};

}  // namespace m3::engine
