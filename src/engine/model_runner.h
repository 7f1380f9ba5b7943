// ModelRunner: turns one SchedulerOutput into the flat ForwardBatch the model reads (token ids,
// absolute positions, block tables as CSR, logits rows), runs the forward pass, and samples the
// requests that reach the end of their known tokens (rows with penalties, logprobs, masks or a
// TokenConstraint on the host; a constraint's allowed set is filled on a helper thread while
// the forward runs, so constrained rows cost the batch little). Owns the ForwardBackend (model + KV
// pages on one device) whose pages the scheduler hands out. Called only from the engine thread.
// Invariant: page ids in the block tables index the backend's KV cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/spec_decode.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "sched/scheduler_output.h"

namespace m3::engine {

// What the runner keeps per request between steps.
struct RunnerRequestState {
  SamplingParams params;
  // Seed of the request's draws (params.seed when given, else random): output token i is drawn
  // with the noise of (seed, i) whether the host or the device samples it (sampler.h).
  uint64_t seed = 0;
  std::vector<int32_t> history;  // prompt + sampled tokens (penalties)
  int num_prompt_tokens = 0;
  // prompt logprobs, filled while the prompt is computed (entry 0 stays empty)
  std::vector<std::optional<TokenLogprobOut>> prompt_logprobs;
  int prompt_logprobs_filled = 0;
  // logprobs of the tokens sampled in the last step, consumed by the engine
  std::vector<TokenLogprobOut> step_logprobs;
  // params.constraint->make(), made at admission; null without structured outputs. It has seen
  // every sampled token (preemption recomputes the KV, not the tokens, so it stays valid).
  // Shared with a launched step whose helper thread may still fill its mask after an abort.
  std::shared_ptr<TokenConstraint> constraint;
  // Device samples launched and not finished yet (async scheduling): the next draw's output
  // index is the history's generated count plus these.
  int num_pending_samples = 0;
  // Image input: prompt spans {first position, tokens} of the images, in order; their pixels
  // until the first step that computes an image position runs the tower over all of them
  // (then freed), and from then on their embeddings [sum of tokens, hidden] f32 (kept through
  // preemption, which recomputes the KV).
  std::vector<std::pair<int32_t, int32_t>> image_spans;
  std::vector<ImageInput> images;
  std::vector<float> image_embeds;
};

// A step launched on the backend and not finished yet (ModelRunner::launch / finish): its batch
// and what finish() needs to turn the backend's result into sampled tokens.
struct LaunchedStep {
  // Logits rows wanted per scheduled request: prompt-logprob rows (position -> row), and the
  // sampling row (-1 when the request does not sample this step).
  struct Want {
    std::vector<std::pair<int, int32_t>> prompt_rows;
    int32_t sample_row = -1;
    // Speculative decoding: the rows of the last known token and of each draft after it (the
    // first is sample_row), and the request's first token in the step.
    std::vector<int32_t> verify_rows;
    int first_token = 0;
  };
  sched::SchedulerOutput out;  // the step as scheduled
  model::ForwardBatch batch;
  std::vector<Want> want;
  std::vector<int32_t> device_slot;  // per request: its entry of batch.device_samples, or -1
  // Constrained rows: their allowed-token bitmasks, filled on `filler` while the forward runs
  // (request i's sampling row has mask mask_at[i], its verify row j mask mask_at[i] + j); the
  // constraints are held so an abort cannot free one under it. A drafting request's row j is
  // filled with its constraint advanced over drafts 1..j, then stepped back (rollback).
  int64_t mask_words = 0;
  std::vector<int32_t> mask_at;
  struct Constrained {
    std::shared_ptr<TokenConstraint> constraint;
    std::vector<int32_t> drafts;  // the verified drafts, in order (none: one row)
  };
  std::vector<Constrained> constrained;
  std::vector<uint32_t> masks;
  std::thread filler;
  bool launched = false;  // through ForwardBackend::launch (else forward)
  // Some request samples on the host this step (logprobs, penalties, masks, drafts): the next
  // step cannot be launched before this one's tokens are on the host.
  bool host_samples = false;
  ~LaunchedStep() {
    if (filler.joinable()) filler.join();
  }
};

class ModelRunner {
 public:
  // `num_sampleable` (<= vocab size): ids at or above it are never sampled. `spec` (may be
  // null): speculative decoding; then `max_model_len` bounds the positions drafts may take.
  ModelRunner(std::unique_ptr<runtime::ForwardBackend> backend, int64_t num_sampleable,
              std::unique_ptr<SpecDecoder> spec = nullptr, int max_model_len = 0);
  const SpecDecoder* spec_decoder() const { return spec_.get(); }

  const runtime::ForwardBackend& backend() const { return *backend_; }
  // The backend's fault() (a lost node): after it turns non-empty, execute() and finish()
  // return no tokens and nothing more may be launched. Thread-safe.
  std::string fault() const { return backend_->fault(); }
  int64_t num_pages() const { return backend_->num_pages(); }
  int64_t num_image_encodes() const { return num_image_encodes_; }
  // The vision tower over one request's images (the backend's; supports_image_input() only).
  void encode_images(std::span<const model::VisionImage> images, std::vector<float>* embeds) {
    backend_->encode_images(images, embeds);
  }

  // Runs the step (its host KV tier copies first; a step of copies only runs just those);
  // returns the sampled tokens for requests with will_sample.
  sched::RunnerOutput execute(const sched::SchedulerOutput& out,
                              std::unordered_map<uint64_t, RunnerRequestState>& states);
  // Async scheduling: whether the backend can launch steps (ForwardBackend::launch).
  bool can_launch() const { return backend_->samples_on_device(); }
  // Builds the step and launches it on the backend without waiting; kPlaceholderToken entries
  // read the samples of the step launched before it (which must have sampled those requests on
  // the device). `out` must have requests; its host KV tier copies are handed to the backend
  // first (ForwardBackend::copy_host_kv_pages). Steps finish in launch order.
  std::unique_ptr<LaunchedStep> launch(sched::SchedulerOutput out,
                                       std::unordered_map<uint64_t, RunnerRequestState>& states);
  // Waits for a launched step and returns its sampled tokens (requests whose state is gone by
  // now, aborted or finished by the step before, are skipped).
  sched::RunnerOutput finish(LaunchedStep& step,
                             std::unordered_map<uint64_t, RunnerRequestState>& states);

 private:
  // The step's host KV tier copies to the backend (nothing when it has none).
  void copy_host_kv_pages(const sched::SchedulerOutput& out);
  // The step's batch, device samples and masks (filler started) into `step`.
  void prepare(LaunchedStep& step, const sched::SchedulerOutput& out,
               std::unordered_map<uint64_t, RunnerRequestState>& states, bool async);
  // The sampled tokens out of the step's result.
  sched::RunnerOutput finish_with(LaunchedStep& step, const sched::SchedulerOutput& out,
                                  model::ForwardResult& res,
                                  std::unordered_map<uint64_t, RunnerRequestState>& states);
  // Whether a drafting request of these params is verified from the device's draws alone
  // (greedy, or synthetic acceptance; the caller has checked it needs no host sampling).
  bool device_verifies(const SamplingParams& p) const;
  // Verifies a request's drafts against its logits rows (the last known token's, then one per
  // draft), or against `drawn` (not null: the device's draw of each of those rows, for a request
  // device_verifies() takes): returns 1 + the accepted drafts' count tokens, appended to
  // st.history. With a constraint, row j is drawn under `allowed(j)` (its bitmask with drafts
  // 1..j taken) and each token decided is accepted into it; `*stop` is set (and no token follows)
  // where the constraint refuses or completes, or its masks leave no token.
  std::vector<int32_t> verify(const sched::ScheduledRequest& r, const std::vector<int32_t>& rows,
                              RunnerRequestState& st,
                              const std::function<float*(int32_t)>& logits_row,
                              const int32_t* drawn, int64_t V,
                              const std::function<std::span<const uint32_t>(int)>& allowed,
                              bool* stop);
  // The draft over the step's verified positions; sets each sampled request's proposals.
  void propose(const sched::SchedulerOutput& out,
               std::unordered_map<uint64_t, RunnerRequestState>& states,
               const model::ForwardResult& res, sched::RunnerOutput& ro,
               const std::function<int(size_t)>& first_token);

  std::unique_ptr<runtime::ForwardBackend> backend_;
  int64_t num_sampleable_;
  std::unique_ptr<SpecDecoder> spec_;
  int max_model_len_ = 0;
  std::atomic<int64_t> num_image_encodes_{0};  // read by Engine::stats on other threads
  // The device sample slot of each request in the last launched step (async scheduling).
  std::unordered_map<uint64_t, int32_t> last_slots_;
};

}  // namespace m3::engine
