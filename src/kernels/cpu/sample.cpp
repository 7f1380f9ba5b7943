#include "kernels/cpu/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"

namespace m3::kernels::cpu {

namespace {
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

int32_t argmax(const float* l, int64_t V) {  // ties to the lower id
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (l[i] > l[best]) best = i;
  return static_cast<int32_t>(best);
}

// The kept candidates of a tempered draw (temperature > 0), best first: idx[0, keep), with
// z = (logit - max) / temperature for every id.
size_t candidates(const float* l, int64_t V, const SampleRow& p, std::vector<float>& z,
                  std::vector<int32_t>& idx) {
  float mx = l[0];
  for (int64_t i = 1; i < V; ++i) mx = std::max(mx, l[i]);
  z.resize(V);
  for (int64_t i = 0; i < V; ++i) z[i] = (l[i] - mx) / p.temperature;
  // Candidates best first, ties by id: the order engine::Sampler cuts with top_k/min_p/top_p.
  idx.resize(V);
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
  const int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(k);
  double sum = 0.0;
  for (int32_t i : idx) sum += std::exp(static_cast<double>(z[i]));
  size_t keep = idx.size();
  if (p.min_p > 0.f) {
    // min_p relative to the best token's probability (exp(0) / sum).
    const double thresh = static_cast<double>(p.min_p) * (1.0 / sum);
    size_t j = 1;
    while (j < keep && std::exp(static_cast<double>(z[idx[j]])) / sum >= thresh) ++j;
    keep = j;
  }
  if (p.top_p < 1.f) {
    double cum = 0.0;
    size_t j = 0;
    while (j < keep) {
      cum += std::exp(static_cast<double>(z[idx[j]])) / sum;
      ++j;
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    keep = std::max<size_t>(1, j);
  }
  return keep;
}

int32_t sample_one(const float* l, int64_t V, const SampleRow& p) {
  if (p.temperature <= 0.f) return argmax(l, V);
  std::vector<float> z;
  std::vector<int32_t> idx;
  const size_t keep = candidates(l, V, p, z, idx);
  // Gumbel-max over the kept candidates: P(i) = exp(z_i) / sum over kept.
  int32_t best = -1;
  double best_score = 0.0;
  for (size_t j = 0; j < keep; ++j) {
    const int32_t i = idx[j];
    const double g = -std::log(-std::log(sample_uniform(p.seed, p.step, i)));
    const double s = static_cast<double>(z[i]) + g;
    if (best < 0 || s > best_score || (s == best_score && i < best)) {
      best = i;
      best_score = s;
    }
  }
  return best;
}
}  // namespace

double sample_uniform(uint64_t seed, uint64_t step, int64_t id) {
  const uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ static_cast<uint64_t>(id));
  // 53 random bits, centred in their cell: strictly inside (0, 1).
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

void sample_probs(const float* logits, int64_t num_valid, const SampleRow& row, double* probs) {
  M3_CHECK(num_valid >= 1, "sample_probs: no valid token");
  std::fill(probs, probs + num_valid, 0.0);
  if (row.temperature <= 0.f) {
    probs[argmax(logits, num_valid)] = 1.0;
    return;
  }
  std::vector<float> z;
  std::vector<int32_t> idx;
  const size_t keep = candidates(logits, num_valid, row, z, idx);
  double sum = 0.0;
  for (size_t j = 0; j < keep; ++j) sum += std::exp(static_cast<double>(z[idx[j]]));
  for (size_t j = 0; j < keep; ++j) probs[idx[j]] = std::exp(static_cast<double>(z[idx[j]])) / sum;
}

void sample_rows(const float* logits, int64_t vocab, int64_t num_valid, const SampleRow* rows,
                 int64_t n, int32_t* out_ids) {
  const int64_t V = std::min(vocab, num_valid);
  M3_CHECK(V >= 1, "sample_rows: no valid token (vocab %lld, num_valid %lld)",
           static_cast<long long>(vocab), static_cast<long long>(num_valid));
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      out_ids[i] = sample_one(logits + static_cast<int64_t>(rows[i].row) * vocab, V, rows[i]);
  });
}

}  // namespace m3::kernels::cpu
