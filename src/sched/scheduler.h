// Scheduler: continuous batching under one invariant (design.md §1): every step each scheduled
// request gets num_new_tokens = min(num_tokens - num_computed_tokens, budget left), running
// requests first, then waiting ones in policy order. Chunked prefill, decode, prefix hits and
// preemption by recompute all follow from that. Driven by the engine thread only (not thread
// safe): schedule() -> runner -> update_from_output(), once per step, every step.
// Invariants: total tokens per step <= max_num_batched_tokens; running <= max_num_seqs; only
// running requests hold pages, each inside one KV partition (preemption frees pages only in the
// partition that needs them); every added request eventually gets exactly one finished update.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "sched/kv_cache_manager.h"
#include "sched/request.h"
#include "sched/scheduler_output.h"

namespace m3::sched {

enum class Policy {
  kFcfs,      // arrival order
  kPriority,  // lower Request::priority first, then arrival order
};

struct SchedulerConfig {
  int max_num_seqs = 256;
  int max_num_batched_tokens = 8192;
  int max_model_len = 8192;
  int block_size = 128;
  int num_blocks = 0;
  // KV page partitions (attention data parallel: one per rank, pages
  // [p * num_blocks / N, (p + 1) * num_blocks / N) on rank p). Every request's pages stay in one
  // partition, so one sequence can use at most num_blocks / N pages.
  int num_kv_partitions = 1;
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  Policy policy = Policy::kFcfs;
  // Speculative decoding: the most draft tokens a request carries (K). A step that samples also
  // gets pages for K positions past its tokens (where the draft writes its KV).
  int num_lookahead_tokens = 0;
  // > 0: a request gets at most this many prompt tokens per step (vLLM's
  // --long-prefill-token-threshold), so a long prompt's chunks stay short and the decoding
  // streams beside it keep stepping; 0: only the step budget limits a chunk.
  int long_prefill_token_threshold = 0;

  // Checks the values a user can set by flag; the message names the flag and the fix.
  Status validate() const;
};

struct SchedulerStats {
  int num_running = 0;
  int num_waiting = 0;
  int num_free_blocks = 0;
  double kv_cache_usage = 0.0;         // 0..1
  int64_t prefix_cache_queries = 0;    // tokens looked up at admission
  int64_t prefix_cache_hits = 0;       // tokens found
  int64_t num_preemptions = 0;         // total since start
  int64_t num_steps = 0;               // schedule() calls
  int64_t num_kv_offloaded_pages = 0;  // host KV tier: pages copied out, in
  int64_t num_kv_restored_pages = 0;
  int num_host_kv_slots = 0;
  int num_host_kv_cached = 0;
};

class Scheduler {
 public:
  // config must pass validate() (M3_CHECK); the engine validates flags first.
  explicit Scheduler(const SchedulerConfig& config);

  // Queues a request (status waiting). Fails when the id is already in use.
  Status add_request(std::unique_ptr<Request> request);
  // Frees its pages now; it is reported finished with abort in the next update_from_output.
  // Unknown or already finished ids are a no-op.
  void abort_request(uint64_t request_id);

  // The next step. `ahead` (async scheduling): the previous step's output has not been reported
  // yet; each of its requests counts as having computed its tokens, and one that samples as
  // having one more token whose id is unknown (kPlaceholderToken in token_ids, where the next
  // position needs it). A request that this sample surely finishes by length is left out; one
  // that finishes by a stop token is computed one step too many, and that step's output is
  // dropped. A step that would have to preempt is not scheduled (deferred is set): preemption
  // only ever happens with nothing in flight, as in the synchronous loop.
  SchedulerOutput schedule(bool ahead = false);
  // Must follow every schedule() with that step's output (also an empty one: pending abort and
  // length updates are delivered here), in schedule order (a deferred output needs none).
  // Returns updates for requests that sampled or finished.
  std::vector<RequestUpdate> update_from_output(const SchedulerOutput& scheduler_output,
                                                const RunnerOutput& runner_output);

  // Prefill/decode disaggregation. Producer: a request with Request::hold_kv_on_finish keeps its
  // pages when it finishes by stop or length (RequestUpdate::held_block_ids names them) until
  // release_held_kv (ids not held: a no-op). Consumer: a request with Request::load_remote_kv is
  // admitted by allocating pages for its whole prompt without computing anything; the step's
  // SchedulerOutput::kv_loads names them, and it waits (counted against max_num_seqs, never
  // preempted) until finish_remote_kv: loaded, its first num_prompt_tokens - 1 tokens count as
  // computed and cached (the last one is computed here for its logits, as vLLM does); not loaded,
  // the whole prompt is computed here. An abort while loading keeps the pages until then.
  void release_held_kv(uint64_t request_id);
  void finish_remote_kv(uint64_t request_id, bool loaded);
  int num_held_kv() const { return static_cast<int>(held_kv_.size()); }
  int num_loading_kv() const { return static_cast<int>(loading_.size()); }

  bool has_unfinished() const;
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  SchedulerStats stats() const;

  const SchedulerConfig& config() const { return config_; }
  // Requests still owned (waiting, running, or finished but not yet reported); nullptr otherwise.
  const Request* find_request(uint64_t request_id) const;
  std::vector<uint64_t> running_ids() const;
  std::vector<uint64_t> waiting_ids() const;  // in the order they will be admitted
  const KVCacheManager& kv_cache_manager() const { return kv_; }
  // Drops all cached prefixes; only when no request holds pages. Returns whether it was done.
  bool reset_prefix_cache() { return kv_.reset_prefix_cache(); }
  // The host KV tier (KVCacheManager::enable_host_tier): one KV partition, prefix caching on.
  void enable_host_kv_tier(int num_slots) { kv_.enable_host_tier(num_slots); }
  // KV cache events (sched/kv_event.h): off unless turned on; take_kv_events drains them.
  void set_kv_events_enabled(bool on) { kv_.block_pool().set_events_enabled(on); }
  std::vector<KvCacheEvent> take_kv_events() { return kv_.block_pool().take_events(); }

 private:
  // True when a goes before b in the waiting order / is kept over b when preempting.
  bool goes_before(const Request& a, const Request& b) const;
  void insert_waiting(Request* request, bool front);
  void remove_waiting(Request* request);
  void preempt(Request* request);
  // Extra positions to allocate for a step of num_new tokens after num_computed that reaches the
  // last known token (the draft's KV, speculative decoding); 0 otherwise.
  int lookahead(const Request& request, int num_computed, int num_new) const;
  int lookahead(const Request& request, int num_new) const {
    return lookahead(request, request.num_computed_tokens, num_new);
  }
  // Tokens one request can ever hold: one partition's pages.
  int64_t partition_tokens() const;
  // Finishes a request that is not running (or already removed from running) and queues its update.
  void finish(Request* request, RequestStatus status, FinishReason reason);
  // True when the request's tokens in flight, once appended, finish it by length (check_stop's
  // length rule over the counts with the in-flight samples).
  bool inflight_finishes_by_length(const Request& request) const;
  // Checks stop rules after appending one sampled token; returns the reason it finished, if any.
  FinishReason check_stop(Request& request, int32_t token) const;
  RequestUpdate make_update(const Request& request) const;

  SchedulerConfig config_;
  KVCacheManager kv_;
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::vector<Request*> running_;               // in admission order
  std::deque<Request*> waiting_;                // admission order (policy order for kPriority)
  std::vector<Request*> loading_;               // kWaitingForRemoteKv
  std::unordered_map<uint64_t, bool> held_kv_;  // pages kept by id: true held, false aborted
                                                // while loading (freed at finish_remote_kv)
  std::vector<RequestUpdate> pending_updates_;  // finished outside a step (abort, too long)
  std::vector<uint64_t> finished_since_schedule_;
  uint64_t next_arrival_seq_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t num_steps_ = 0;
};

}  // namespace m3::sched
