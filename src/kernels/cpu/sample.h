// Sampling of logits rows by the counter-based Gumbel-max rule that the GPU sampler
// (kernels/cuda/sample.h) implements, so a GPU step never copies whole vocabulary rows to the
// host. This CPU op is its oracle: it keeps exactly the candidate set of engine::Sampler (top_k,
// then min_p relative to the best token, then the top_p prefix of the top_k set, at least one
// token) and picks argmax(z_i + gumbel_i) over it, z = (logit - max) / temperature, with the
// Gumbel noise a pure function of (seed, step, token id). Called by tests/kernels and by hosts
// without a GPU sampler. Invariant: same logits and (seed, step) give the same token.
#pragma once

#include <cstdint>

namespace m3::kernels::cpu {

// One row to sample. temperature <= 0 means greedy (argmax, ties to the lower id).
struct SampleRow {
  int32_t row = 0;          // index into the logits rows [R, vocab]
  float temperature = 1.f;  // > 0 scales logits by 1/temperature
  float top_p = 1.f;        // (0, 1]
  int32_t top_k = 0;        // <= 0: off
  float min_p = 0.f;        // [0, 1]
  uint64_t seed = 0;        // per request
  uint64_t step = 0;        // per sampled token of the request (e.g. its output index)
};

// The uniform variate in (0, 1) for token `id` of draw (seed, step): 53 bits of a splitmix64
// chain, never 0 or 1. Shared bit for bit with the GPU kernel.
double sample_uniform(uint64_t seed, uint64_t step, int64_t id);

// The distribution the draw of `row` samples from, over ids [0, num_valid): the kept candidates'
// softmax(z) (greedy: 1 at the argmax). Speculative decoding's rejection sampler reads it.
void sample_probs(const float* logits, int64_t num_valid, const SampleRow& row, double* probs);

// out_ids[i] = the token sampled for rows[i]; only ids < num_valid are ever chosen.
void sample_rows(const float* logits, int64_t vocab, int64_t num_valid, const SampleRow* rows,
                 int64_t n, int32_t* out_ids);

}  // namespace m3::kernels::cpu
