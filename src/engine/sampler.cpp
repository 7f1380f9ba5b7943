#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

namespace m3::engine {

std::mt19937_64 Sampler::make_rng(const SamplingParams& p) {
  if (p.seed) return std::mt19937_64(*p.seed);
  std::random_device rd;
  return std::mt19937_64((static_cast<uint64_t>(rd()) << 32) ^ rd());
}

int32_t Sampler::sample(std::span<float> logits, const SamplingParams& p,
                        std::span<const int32_t> history, std::span<const int32_t> generated,
                        std::mt19937_64& rng, int64_t num_valid) {
  const int64_t V = std::min<int64_t>(static_cast<int64_t>(logits.size()), num_valid);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = V; i < static_cast<int64_t>(logits.size()); ++i) logits[i] = ninf;

  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(logits.size(), false);
    for (int32_t t : history)
      if (t >= 0 && t < V) seen[t] = true;
    for (int64_t i = 0; i < V; ++i) {
      if (!seen[i]) continue;
      logits[i] = logits[i] > 0 ? logits[i] / p.repetition_penalty : logits[i] * p.repetition_penalty;
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
  // Greedy: argmax, ties to the lower id.
  if (p.temperature <= 0.f) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  for (int64_t i = 0; i < V; ++i) logits[i] /= p.temperature;

  // No filter: draw from the whole softmax in id order (sorting 200K candidates would cost more
  // than the rest of a decode step).
  if (p.top_k <= 0 && p.top_p >= 1.0f && p.min_p <= 0.f) {
    float mx = logits[0];
    for (int64_t i = 1; i < V; ++i) mx = std::max(mx, logits[i]);
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) total += std::exp(static_cast<double>(logits[i] - mx));
    std::uniform_real_distribution<double> u(0.0, total);
    const double r = u(rng);
    double acc = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double e = std::exp(static_cast<double>(logits[i] - mx));
      if (e <= 0.0) continue;
      acc += e;
      last = i;
      if (r < acc) return static_cast<int32_t>(i);
    }
    return static_cast<int32_t>(last);
  }

  // Candidates sorted by logit, best first (ties by id) — top_k/top_p/min_p all cut this list.
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t k = (p.top_k > 0) ? std::min<int64_t>(p.top_k, V) : V;
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  if (k < V) {
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(k);
  } else {
    std::sort(idx.begin(), idx.end(), better);
  }
  const float mx = logits[idx[0]];
  std::vector<double> prob(idx.size());
  double sum = 0.0;
  for (size_t i = 0; i < idx.size(); ++i) {
    prob[i] = std::exp(static_cast<double>(logits[idx[i]] - mx));
    sum += prob[i];
  }
  size_t keep = idx.size();
  if (p.min_p > 0.f) {
    // min_p is relative to the best token's probability.
    const double thresh = p.min_p * (prob[0] / sum);
    size_t j = 1;
    while (j < keep && prob[j] / sum >= thresh) ++j;
    keep = j;
  }
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    size_t j = 0;
    while (j < keep) {
      cum += prob[j] / sum;
      ++j;
      if (cum >= p.top_p) break;
    }
    keep = std::max<size_t>(1, j);
  }
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += prob[i];
  std::uniform_real_distribution<double> u(0.0, total);
  const double r = u(rng);
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (r < acc) return idx[i];
  }
  return idx[keep - 1];
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
