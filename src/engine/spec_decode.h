// Speculative decoding (EAGLE-3, issue #19): the --speculative-config values as plain data, and
// SpecDecoder, which the model runner calls after each target step to run the draft head
// (model/eagle3_draft.h) over the positions the step verified and to propose the next step's
// draft tokens. Verification itself (the target scoring 1 + K tokens in one step, rejection
// sampling, rollback) is the runner's and the scheduler's (engine/model_runner.cpp,
// sched/scheduler.cpp). Called only from the engine thread; stats() from any thread.
// Invariant: the draft's KV at a position is written only from verified tokens and the target's
// hidden states there (context pass) or by a draft step past them, which the next context pass
// overwrites; proposals never exceed the request's pages, max_tokens or the model length.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/eagle3_draft.h"
#include "model/weights.h"
#include "runtime/forward_backend.h"

namespace m3::engine {

// The most draft tokens per step m3serve verifies (num_speculative_tokens in [1, this]).
constexpr int kMaxSpeculativeTokens = 8;

struct SpeculativeConfig {
  std::string method;  // "eagle3"; empty: speculative decoding off
  std::string model;   // the draft's directory
  int num_speculative_tokens = 0;
  // rejection_sample_method "synthetic": drafts are accepted at random so that the mean
  // acceptance length is synthetic_acceptance_length (benchmarks only: the output is not the
  // target's).
  bool synthetic = false;
  double synthetic_acceptance_length = 0.0;
  bool enabled() const { return !method.empty(); }
};

// vLLM's spec_decode counters (/metrics): verify steps with drafts, draft tokens, accepted ones,
// and accepted per draft position.
struct SpecDecodeStats {
  bool enabled = false;
  int64_t num_drafts = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_pos;  // [num_speculative_tokens]
};

// The chance of accepting each draft so that 1 + a + a^2 + ... + a^k == length (k drafts).
double synthetic_accept_probability(double length, int k);

// One request's part of a draft pass (model/eagle3_draft.h).
using model::DraftSeq;

class SpecDecoder {
 public:
  // Loads the draft on the host (Eagle3Draft::load) with `num_pages` KV pages, the target's
  // page ids.
  static Result<std::unique_ptr<SpecDecoder>> create(
      const SpeculativeConfig& cfg, const model::M3Config& target,
      std::shared_ptr<const model::M3Weights> target_weights, int64_t num_pages);
  // The draft where `backend` runs it (ForwardBackend::make_draft: on the GPU for the CUDA
  // backend, else on the host) with the backend's page count.
  static Result<std::unique_ptr<SpecDecoder>> create(
      const SpeculativeConfig& cfg, runtime::ForwardBackend& backend,
      std::shared_ptr<const model::M3Weights> target_weights);
  // Over a draft made elsewhere (tests).
  SpecDecoder(const SpeculativeConfig& cfg, std::unique_ptr<model::Eagle3Draft> draft);
  SpecDecoder(const SpeculativeConfig& cfg, std::unique_ptr<model::DraftProposer> draft);

  const SpeculativeConfig& config() const { return cfg_; }
  int num_speculative_tokens() const { return cfg_.num_speculative_tokens; }
  const std::vector<int32_t>& aux_layers() const { return draft_->config().aux_layer_ids; }
  double accept_probability() const { return accept_prob_; }  // synthetic only
  // For the start-up line: method, K, verification, the draft's shape.
  std::string summary() const;

  // True: the draft reads the target's aux states on the device (the batch then asks for
  // ForwardBatch::aux_on_device and propose() gets no host copy).
  bool aux_on_device() const { return draft_->aux_on_device(); }
  // Runs the draft over `seqs` (the aux hidden states [T, aux * hidden] of the target step, on
  // the host unless aux_on_device()) and returns per seq its proposals (num_propose tokens or
  // fewer where pages run out).
  std::vector<std::vector<int32_t>> propose(const std::vector<DraftSeq>& seqs,
                                            std::span<const float> aux_hidden);

  // Tests: proposals from `f` instead of the draft's (the draft still runs, so its KV and
  // timing stay real); f gets the seqs and the draft's own proposals and returns the proposals.
  using ProposalOverride = std::function<std::vector<std::vector<int32_t>>(
      const std::vector<DraftSeq>&, const std::vector<std::vector<int32_t>>&)>;
  void set_proposal_override(ProposalOverride f) { override_ = std::move(f); }

  // Counts one verification of `num_drafts` tokens of which `num_accepted` were accepted.
  void count(int num_drafts, int num_accepted);
  SpecDecodeStats stats() const;

 private:
  SpeculativeConfig cfg_;
  std::unique_ptr<model::DraftProposer> draft_;
  double accept_prob_ = 0.0;
  ProposalOverride override_;
  mutable std::mutex mu_;
  SpecDecodeStats stats_;
};

}  // namespace m3::engine
