// Request: one generation as the scheduler sees it — token ids, progress, stop rules, status.
// Created by the engine, handed to Scheduler::add_request, which owns it from then on; the
// KVCacheManager keeps its block hashes. The engine reads results only through RequestUpdate.
// Invariant: 0 <= num_computed_tokens <= num_tokens(); a waiting or preempted request has
// num_computed_tokens == 0 and holds no KV pages (kWaitingForRemoteKv holds its prompt's pages);
// block_hashes covers only full blocks of tokens.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sched/block_hash.h"

namespace m3::sched {

enum class RequestStatus {
  kWaiting,
  kRunning,
  kPreempted,        // pages freed, waiting to be recomputed (prompt + outputs so far)
  kFinishedStopped,  // an eos or stop token id was sampled
  kFinishedLength,   // max_tokens, max_model_len, or longer than the KV pool can ever hold
  kFinishedAborted,  // Scheduler::abort_request
  // Holds pages for its whole prompt while another worker's KV is read into them (P/D
  // disaggregation: Request::load_remote_kv); not scheduled, not preemptible.
  kWaitingForRemoteKv,
};

bool is_finished(RequestStatus status);

enum class FinishReason { kNone, kStop, kLength, kAbort };

// "stop", "length", "abort" (OpenAI finish_reason spelling; kNone -> "").
const char* finish_reason_name(FinishReason reason);

struct StopCriteria {
  int max_tokens = 16;  // output tokens; the request finishes with length at this count
  int min_tokens = 0;   // eos / stop ids do not stop before this many output tokens
  std::vector<int32_t> eos_token_ids;   // ignored when ignore_eos
  std::vector<int32_t> stop_token_ids;  // always honoured (after min_tokens)
  bool ignore_eos = false;
};

// Prompt positions [start, start + length) whose KV depends on content other than their token ids
// (an image's placeholder tokens): `hash` (of the image content) is mixed into the key of every
// block the span touches, and through the hash chain into every later block, so the same image
// reuses its pages and a different image behind the same placeholder ids never does.
struct ContentSpan {
  int start = 0;
  int length = 0;
  uint64_t hash = 0;
};

struct Request {
  Request(uint64_t id, std::vector<int32_t> prompt, StopCriteria stop_criteria,
          int priority_value = 0, uint64_t cache_salt_value = 0);

  int num_prompt_tokens() const { return static_cast<int>(prompt_token_ids.size()); }
  int num_output_tokens() const { return static_cast<int>(output_token_ids.size()); }
  int num_tokens() const { return num_prompt_tokens() + num_output_tokens(); }
  // Token at absolute position idx of prompt ++ output (what a resumed request recomputes).
  int32_t token_at(int idx) const;

  uint64_t request_id;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> output_token_ids;  // every sampled token, including a final eos / stop id
  StopCriteria stop;
  int priority = 0;  // lower value is served first under Policy::kPriority
  uint64_t cache_salt =
      0;  // mixed into every block hash: requests with different salts never share pages
  uint64_t arrival_seq = 0;  // set by Scheduler::add_request; ties and FCFS order use it

  RequestStatus status = RequestStatus::kWaiting;
  int num_computed_tokens = 0;  // tokens whose KV is in this request's pages
  // Async scheduling (Scheduler::schedule with ahead): tokens of steps scheduled but not yet
  // reported (positions num_computed_tokens ...), and how many of those steps sample a token
  // whose id the host does not know yet (a placeholder at position num_tokens() ...). Both 0
  // whenever no step is in flight (always, in the synchronous loop).
  int num_inflight_tokens = 0;
  int num_inflight_samples = 0;
  int num_cached_tokens = -1;  // prefix-cache hit at first scheduling; -1 until then
  int num_preemptions = 0;
  std::optional<int32_t> stop_token_id;    // the stop_token_ids entry that finished it (not eos)
  std::vector<BlockHash> block_hashes;     // hash chain of full blocks, grown by KVCacheManager
  std::vector<ContentSpan> content_spans;  // ascending, non-overlapping (image placeholders)
  // Speculative decoding: draft tokens proposed for positions num_tokens() ... by the last step,
  // verified by the next one. Never part of num_tokens(), the block hashes or the prefix cache.
  std::vector<int32_t> spec_token_ids;
  // Prefill/decode disaggregation (Scheduler::release_held_kv, finish_remote_kv). Producer: keep
  // the pages when it finishes by stop or length, for a decode worker to read. Consumer: admit it
  // by allocating pages for the prompt and waiting for them to be filled from the prefill worker.
  bool hold_kv_on_finish = false;
  bool load_remote_kv = false;
};

}  // namespace m3::sched
