// The plain data that crosses the scheduler <-> model runner seam each step (design.md
// "Plain-data seams"): SchedulerOutput (what to compute), RunnerOutput (what was sampled) and
// RequestUpdate (what the engine forwards to the request's stream). Built by Scheduler, read by
// the engine. Invariant: ScheduledRequest covers positions [start_idx, start_idx +
// token_ids.size()) of the request, and its block_ids cover every position up to the end of that
// range.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sched/request.h"

namespace m3::sched {

// A ScheduledRequest::token_ids entry whose id is not known on the host yet: the token the step
// in flight samples for this request (async scheduling). The runner has the backend read it from
// that step's device-side samples.
inline constexpr int32_t kPlaceholderToken = -1;

struct ScheduledRequest {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;  // tokens to compute this step, positions start_idx...
                                   // (kPlaceholderToken: sampled by the step in flight)
  int start_idx = 0;  // == the request's num_computed_tokens (+ tokens in flight) before this step
  std::vector<int32_t> block_ids;  // the whole block table: page i holds positions [i*bs, (i+1)*bs)
  bool will_sample = false;        // this step reaches the last known token: sample one after it
  // The last num_spec_tokens of token_ids are draft tokens (speculative decoding) after the
  // request's last known token: the runner verifies them and returns 1 + the accepted count.
  int num_spec_tokens = 0;
  bool from_waiting = false;  // new or resumed after preemption this step (runner resets state)
  int num_new_tokens() const { return static_cast<int>(token_ids.size()); }
};

// One page copy between the device KV pool and the host tier (sched/host_block_pool.h).
struct KvPageCopy {
  int32_t device_page = 0;
  int32_t host_slot = 0;
};

// Pages admitted this step for a request whose prompt KV comes from a prefill worker
// (Request::load_remote_kv): page i is to receive positions [i*bs, (i+1)*bs) of the prompt. The
// engine reads them in and then calls Scheduler::finish_remote_kv.
struct KvLoad {
  uint64_t request_id = 0;
  std::vector<int32_t> block_ids;  // the request's whole block table
  // Leading blocks already here (a local prefix-cache hit): only blocks from this one on are
  // read from the prefill worker.
  int32_t first_block = 0;
};

struct SchedulerOutput {
  std::vector<ScheduledRequest> requests;  // running requests first, then admitted ones
  // Host KV tier copies, run before the step's forward in this order: every offload (device page
  // -> host slot: evicted pages whose new owners write them this step), then every restore (host
  // slot -> device page: prefix hits found in the host tier).
  std::vector<KvPageCopy> kv_offloads;
  std::vector<KvPageCopy> kv_restores;
  std::vector<KvLoad> kv_loads;         // not part of the forward: the engine starts these reads
  int total_num_tokens = 0;             // sum of num_new_tokens, <= max_num_batched_tokens
  std::vector<uint64_t> preempted_ids;  // preempted this step: pages freed, state to drop
  std::vector<uint64_t> finished_ids;   // finished (any reason) since the previous schedule()
  // schedule(ahead) only: this step could not be scheduled without preempting (or the scheduler
  // state needs the step in flight first); nothing was scheduled. Report the step in flight and
  // schedule again.
  bool deferred = false;
  bool empty() const { return requests.empty() && kv_offloads.empty() && kv_restores.empty(); }
};

struct SampledTokens {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;  // usually one; with speculative decoding 1 + accepted drafts
  // The request's token constraint (a grammar) is complete after these tokens: it stops as on
  // EOS, whatever ignore_eos and min_tokens say.
  bool stop = false;
  // Draft tokens proposed for after token_ids (verified by the next step); at most the
  // scheduler's num_lookahead_tokens.
  std::vector<int32_t> spec_token_ids;
};

struct RunnerOutput {
  std::vector<SampledTokens> sampled;  // one entry per ScheduledRequest with will_sample
};

struct RequestUpdate {
  uint64_t request_id = 0;
  std::vector<int32_t> new_token_ids;  // appended this step (a final eos / stop id included)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::optional<int32_t> stop_token_id;  // the stop_token_ids entry matched (not set for eos)
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;  // prefix-cache hit at first scheduling (usage details)
  int num_preemptions = 0;
  // Finished with Request::hold_kv_on_finish: the pages it keeps (prompt KV in position order)
  // until Scheduler::release_held_kv.
  std::vector<int32_t> held_block_ids;
};

}  // namespace m3::sched
