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

SpecDecoder::SpecDecoder(const SpeculativeConfig& cfg, std::unique_ptr<model::Eagle3Draft> draft)
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
         std::to_string(draft_->kv_bytes_per_token()) + " B/token (" + cfg_.model + ")";
}

std::vector<std::vector<int32_t>> SpecDecoder::propose(const std::vector<DraftSeq>& seqs,
                                                       std::span<const float> aux_hidden) {
  const model::Eagle3Config& dc = draft_->config();
  const int64_t aux_w = static_cast<int64_t>(dc.aux_layer_ids.size()) * dc.target_hidden_size;
  const int64_t H = dc.hidden_size;
  std::vector<std::vector<int32_t>> out(seqs.size());
  // Context pass: every verified position of the step, with the target's aux states.
  model::DraftBatch b;
  b.hidden_is_aux = true;
  b.block_table_offsets.push_back(0);
  std::vector<int> last_row(seqs.size(), -1);  // row of each seq's last position in b
  std::vector<int> logits_of(seqs.size(), -1);
  int32_t s_idx = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const DraftSeq& s = seqs[i];
    if (s.num_valid <= 0) continue;
    M3_CHECK(static_cast<int>(s.next_tokens.size()) == s.num_valid);
    b.block_table.insert(b.block_table.end(), s.block_table.begin(), s.block_table.end());
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
    for (int j = 0; j < s.num_valid; ++j) {
      b.token_ids.push_back(s.next_tokens[j]);
      b.positions.push_back(s.start_pos + j);
      b.seq_ids.push_back(s_idx);
      const float* h = aux_hidden.data() + static_cast<int64_t>(s.first_row + j) * aux_w;
      M3_CHECK(static_cast<size_t>((s.first_row + j + 1) * aux_w) <= aux_hidden.size(),
               "draft: aux hidden row %d outside the step", s.first_row + j);
      b.hidden.insert(b.hidden.end(), h, h + aux_w);
    }
    last_row[i] = static_cast<int>(b.token_ids.size()) - 1;
    if (s.num_propose > 0) {
      logits_of[i] = static_cast<int>(b.logits_indices.size());
      b.logits_indices.push_back(last_row[i]);
    }
    ++s_idx;
  }
  if (b.token_ids.empty()) return out;
  model::DraftResult r;
  draft_->forward(b, &r);
  // Autoregressive draft steps: each proposing seq feeds its last proposal and the draft's own
  // pre-norm output back in, one position further.
  std::vector<std::vector<float>> h(seqs.size());
  std::vector<int> pos(seqs.size(), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (logits_of[i] < 0) continue;
    out[i].push_back(r.argmax_tokens[logits_of[i]]);
    h[i].assign(r.prenorm.begin() + static_cast<int64_t>(last_row[i]) * H,
                r.prenorm.begin() + static_cast<int64_t>(last_row[i] + 1) * H);
    pos[i] = seqs[i].start_pos + seqs[i].num_valid;  // where the first proposal's KV goes
  }
  for (int step = 1; step < cfg_.num_speculative_tokens; ++step) {
    model::DraftBatch d;
    d.hidden_is_aux = false;
    d.block_table_offsets.push_back(0);
    std::vector<size_t> who;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const DraftSeq& s = seqs[i];
      if (static_cast<int>(out[i].size()) != step || step >= s.num_propose || pos[i] >= s.capacity)
        continue;
      d.block_table.insert(d.block_table.end(), s.block_table.begin(), s.block_table.end());
      d.block_table_offsets.push_back(static_cast<int32_t>(d.block_table.size()));
      d.token_ids.push_back(out[i].back());
      d.positions.push_back(pos[i]);
      d.seq_ids.push_back(static_cast<int32_t>(who.size()));
      d.hidden.insert(d.hidden.end(), h[i].begin(), h[i].end());
      d.logits_indices.push_back(static_cast<int32_t>(who.size()));
      who.push_back(i);
    }
    if (who.empty()) break;
    model::DraftResult dr;
    draft_->forward(d, &dr);
    for (size_t w = 0; w < who.size(); ++w) {
      const size_t i = who[w];
      out[i].push_back(dr.argmax_tokens[w]);
      h[i].assign(dr.prenorm.begin() + static_cast<int64_t>(w) * H,
                  dr.prenorm.begin() + static_cast<int64_t>(w + 1) * H);
      ++pos[i];
    }
  }
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
