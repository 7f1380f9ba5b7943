#include "engine/spec_decode.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"

namespace m3::engine {

double synthetic_accept_probability(double length, int k) {
  if (length <= 1.0) return 0.0;
  if (length >= k + 1.0) return 1.0;
  auto mean = [k](double a) {
    double s = 1.0, t = 1.0;
    for (int i = 0; i < k; ++i) s += (t *= a);
    return s;
  };
  double lo = 0.0, hi = 1.0;  // mean() rises with a
  for (int it = 0; it < 100; ++it) {
    const double mid = 0.5 * (lo + hi);
    (mean(mid) < length ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

Result<std::unique_ptr<SpecDecoder>> SpecDecoder::create(
    const SpeculativeConfig& cfg, const model::M3Config& target,
    std::shared_ptr<const model::M3Weights> target_weights, int64_t num_pages) {
  M3_TRY(auto draft,
         model::Eagle3Draft::load(cfg.model, target, std::move(target_weights), num_pages));
  return std::make_unique<SpecDecoder>(cfg, std::move(draft));
}

Result<std::unique_ptr<SpecDecoder>> SpecDecoder::create(
    const SpeculativeConfig& cfg, runtime::ForwardBackend& backend,
    std::shared_ptr<const model::M3Weights> target_weights) {
  M3_TRY(auto draft, backend.make_draft(cfg.model, std::move(target_weights)));
  return std::make_unique<SpecDecoder>(cfg, std::move(draft));
}

SpecDecoder::SpecDecoder(const SpeculativeConfig& cfg, std::unique_ptr<model::Eagle3Draft> draft)
    : SpecDecoder(cfg, model::host_draft_proposer(std::move(draft))) {}

SpecDecoder::SpecDecoder(const SpeculativeConfig& cfg, std::unique_ptr<model::DraftProposer> draft)
    : cfg_(cfg), draft_(std::move(draft)) {
  M3_CHECK(draft_ != nullptr && cfg_.num_speculative_tokens >= 1 &&
           cfg_.num_speculative_tokens <= kMaxSpeculativeTokens);
  if (cfg_.synthetic)
    accept_prob_ =
        synthetic_accept_probability(cfg_.synthetic_acceptance_length, cfg_.num_speculative_tokens);
  stats_.enabled = true;
  stats_.accepted_per_pos.assign(cfg_.num_speculative_tokens, 0);
}

std::string SpecDecoder::summary() const {
  char verify[128];
  if (cfg_.synthetic) {
    std::snprintf(verify, sizeof verify,
                  "SYNTHETIC acceptance length %.2f (benchmark only: output is not the target's)",
                  cfg_.synthetic_acceptance_length);
  } else {
    std::snprintf(verify, sizeof verify, "exact verification");
  }
  return cfg_.method + " with " + std::to_string(cfg_.num_speculative_tokens) + " draft tokens, " +
         verify + "; " + draft_->config().summary() + ", draft KV " +
         std::to_string(draft_->kv_bytes_per_token()) + " B/token, on the " + draft_->where() +
         " (" + cfg_.model + ")";
}

std::vector<std::vector<int32_t>> SpecDecoder::propose(const std::vector<DraftSeq>& seqs,
                                                       std::span<const float> aux_hidden) {
  auto out = draft_->propose(seqs, aux_hidden, cfg_.num_speculative_tokens);
  if (override_) out = override_(seqs, out);
  return out;
}

void SpecDecoder::count(int num_drafts, int num_accepted) {
  if (num_drafts <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.num_drafts;
  stats_.num_draft_tokens += num_drafts;
  stats_.num_accepted_tokens += num_accepted;
  for (int i = 0; i < num_accepted && i < static_cast<int>(stats_.accepted_per_pos.size()); ++i)
    ++stats_.accepted_per_pos[i];
}

SpecDecodeStats SpecDecoder::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace m3::engine
