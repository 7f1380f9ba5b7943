#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <unordered_map>

#include "kernels/cpu/sample.h"

namespace m3::engine {

SampleRng Sampler::make_rng(const SamplingParams& p) {
  if (p.seed) return SampleRng{*p.seed, 0};
  std::random_device rd;
  return SampleRng{(static_cast<uint64_t>(rd()) << 32) ^ rd(), 0};
}

bool Sampler::apply_masks(std::span<float> logits, const SamplingParams& p,
                          std::span<const int32_t> generated, int64_t num_valid,
                          std::span<const uint32_t> allowed) {
  const int64_t V = std::min<int64_t>(static_cast<int64_t>(logits.size()), num_valid);
  const bool masked = !allowed.empty() || !p.allowed_token_ids.empty() || !p.bad_words.empty();
  if (masked) {
    // ok[t]: token t survives every mask.
    std::vector<uint8_t> ok(V, p.allowed_token_ids.empty() ? 1 : 0);
    for (int32_t t : p.allowed_token_ids)
      if (t >= 0 && t < V) ok[t] = 1;
    for (const auto& w : p.bad_words) {
      if (w.empty() || w.back() < 0 || w.back() >= V) continue;
      const size_t prefix = w.size() - 1;
      if (prefix > generated.size()) continue;
      if (std::equal(w.begin(), w.end() - 1, generated.end() - prefix)) ok[w.back()] = 0;
    }
    if (!allowed.empty()) {
      for (int64_t t = 0; t < V; ++t) {
        const size_t word = static_cast<size_t>(t) / 32;
        if (word >= allowed.size() || !((allowed[word] >> (t % 32)) & 1u)) ok[t] = 0;
      }
    }
    if (std::find(ok.begin(), ok.end(), uint8_t{1}) == ok.end()) return false;
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < V; ++t)
      if (!ok[t]) logits[t] = ninf;
  }
  for (const auto& [t, bias] : p.logit_bias)
    if (t >= 0 && t < V) logits[t] += bias;
  return true;
}

int32_t Sampler::sample(std::span<float> logits, const SamplingParams& p,
                        std::span<const int32_t> history, std::span<const int32_t> generated,
                        SampleRng& rng, int64_t num_valid, std::span<const uint32_t> allowed,
                        bool* none_allowed) {
  prepare(logits, p, history, generated, num_valid, allowed, none_allowed);
  const int64_t V = std::min<int64_t>(static_cast<int64_t>(logits.size()), num_valid);
  // The draw itself is the GPU sampler's rule, by calling its CPU oracle on the penalised row.
  kernels::cpu::SampleRow row = draw_row(p, rng.seed, rng.step++);
  int32_t token = 0;
  kernels::cpu::sample_rows(logits.data(), static_cast<int64_t>(logits.size()), V, &row, 1, &token);
  return token;
}

kernels::cpu::SampleRow Sampler::draw_row(const SamplingParams& p, uint64_t seed, uint64_t step,
                                          int32_t logits_row) {
  kernels::cpu::SampleRow row;
  row.row = logits_row;
  row.temperature = p.temperature;
  row.top_p = p.top_p;
  row.top_k = p.top_k;
  row.min_p = p.min_p;
  row.seed = seed;
  row.step = step;
  return row;
}

void Sampler::probs(std::span<const float> prepared, const SamplingParams& p, int64_t num_valid,
                    std::vector<double>* out) {
  const int64_t V = std::min<int64_t>(static_cast<int64_t>(prepared.size()), num_valid);
  out->assign(prepared.size(), 0.0);
  kernels::cpu::sample_probs(prepared.data(), V, draw_row(p, 0, 0), out->data());
}

int32_t Sampler::rejection_sample(std::span<const double> target, std::span<const double> draft,
                                  int32_t draft_token, double u_accept, double u_residual,
                                  bool* accepted) {
  const double pt = target[draft_token];
  const double qt = draft.empty() ? 1.0 : draft[draft_token];
  // Accept with probability min(1, p/q); u_accept is uniform in (0, 1).
  if (qt > 0.0 && u_accept * qt < pt) {
    *accepted = true;
    return draft_token;
  }
  *accepted = false;
  // Rejected: draw from the residual max(0, p - q), normalised (inverse CDF, ascending ids).
  double total = 0.0;
  for (size_t i = 0; i < target.size(); ++i) {
    const double qi =
        draft.empty() ? (static_cast<int32_t>(i) == draft_token ? 1.0 : 0.0) : draft[i];
    total += std::max(0.0, target[i] - qi);
  }
  if (!(total > 0.0)) {
    // p <= q everywhere means p == q: the draft was accepted with probability 1; only rounding
    // gets here. Fall back to the target itself.
    total = 0.0;
    for (double t : target) total += t;
    double acc = 0.0;
    for (size_t i = 0; i < target.size(); ++i) {
      acc += target[i];
      if (u_residual * total < acc) return static_cast<int32_t>(i);
    }
    return draft_token;
  }
  double acc = 0.0;
  int32_t last = draft_token;
  for (size_t i = 0; i < target.size(); ++i) {
    const double qi =
        draft.empty() ? (static_cast<int32_t>(i) == draft_token ? 1.0 : 0.0) : draft[i];
    const double r = std::max(0.0, target[i] - qi);
    if (r <= 0.0) continue;
    last = static_cast<int32_t>(i);
    acc += r;
    if (u_residual * total < acc) return last;
  }
  return last;
}

void Sampler::prepare(std::span<float> logits, const SamplingParams& p,
                      std::span<const int32_t> history, std::span<const int32_t> generated,
                      int64_t num_valid, std::span<const uint32_t> allowed, bool* none_allowed) {
  const int64_t V = std::min<int64_t>(static_cast<int64_t>(logits.size()), num_valid);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = V; i < static_cast<int64_t>(logits.size()); ++i) logits[i] = ninf;
  if (!apply_masks(logits, p, generated, num_valid, allowed)) {
    if (none_allowed) *none_allowed = true;
    SamplingParams unmasked = p;
    unmasked.allowed_token_ids.clear();
    unmasked.bad_words.clear();
    apply_masks(logits, unmasked, generated, num_valid, {});
  }

  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(logits.size(), false);
    for (int32_t t : history)
      if (t >= 0 && t < V) seen[t] = true;
    for (int64_t i = 0; i < V; ++i) {
      if (!seen[i]) continue;
      logits[i] =
          logits[i] > 0 ? logits[i] / p.repetition_penalty : logits[i] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.f || p.frequency_penalty != 0.f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t t : generated) ++counts[t];
    for (const auto& [t, c] : counts) {
      if (t < 0 || t >= V) continue;
      logits[t] -= p.frequency_penalty * static_cast<float>(c) + p.presence_penalty;
    }
  }
}

TokenLogprob Sampler::logprobs(std::span<const float> logits, int32_t token, int32_t k) {
  const int64_t V = static_cast<int64_t>(logits.size());
  float mx = -std::numeric_limits<float>::infinity();
  for (float l : logits) mx = std::max(mx, l);
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l - mx));
  const float lse = mx + static_cast<float>(std::log(sum));
  TokenLogprob r;
  r.token = token;
  r.logprob = logits[token] - lse;
  const float lt = logits[token];
  for (int64_t i = 0; i < V; ++i)
    r.rank += (logits[i] > lt || (logits[i] == lt && i < token)) ? 1 : 0;
  if (k > 0) {
    std::vector<int32_t> idx(V);
    std::iota(idx.begin(), idx.end(), 0);
    const int64_t kk = std::min<int64_t>(k, V);
    std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < kk; ++i) r.top.push_back({idx[i], logits[idx[i]] - lse});
  }
  return r;
}

}  // namespace m3::engine
