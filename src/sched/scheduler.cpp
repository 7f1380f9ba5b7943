#include "sched/scheduler.h"

#include <algorithm>
#include <string>
#include <utility>

#include "core/check.h"

namespace m3::sched {

namespace {
bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}
}  // namespace

Status SchedulerConfig::validate() const {
  auto bad = [](std::string msg, std::string flag) {
    return make_error(ErrorCode::kInvalidArgument, std::move(msg), std::move(flag));
  };
  if (max_num_seqs < 1)
    return bad("--max-num-seqs is " + std::to_string(max_num_seqs) + "; it must be at least 1",
               "--max-num-seqs");
  if (max_num_batched_tokens < 1)
    return bad("--max-num-batched-tokens is " + std::to_string(max_num_batched_tokens) +
                   "; it must be at least 1",
               "--max-num-batched-tokens");
  if (max_model_len < 1)
    return bad("--max-model-len is " + std::to_string(max_model_len) + "; it must be at least 1",
               "--max-model-len");
  if (long_prefill_token_threshold < 0)
    return bad("--long-prefill-token-threshold is " + std::to_string(long_prefill_token_threshold) +
                   "; it must be 0 (no cap) or a token count",
               "--long-prefill-token-threshold");
  if (block_size < 1)
    return bad("--block-size is " + std::to_string(block_size) +
                   "; it must be positive (128 for MiniMax-M3)",
               "--block-size");
  if (num_blocks < 1)
    return bad(
        "the KV cache has " + std::to_string(num_blocks) +
            " pages; give it memory (raise --gpu-memory-utilization or lower --max-model-len)",
        "--gpu-memory-utilization");
  if (num_kv_partitions < 1 || num_blocks % num_kv_partitions != 0)
    return bad("the KV cache has " + std::to_string(num_blocks) +
                   " pages, which do not split into " + std::to_string(num_kv_partitions) +
                   " equal partitions (one per data-parallel rank); the backend must size its "
                   "pool as a multiple of --data-parallel-size",
               "--data-parallel-size");
  if (!enable_chunked_prefill && max_num_batched_tokens < max_model_len)
    return bad("without chunked prefill --max-num-batched-tokens (" +
                   std::to_string(max_num_batched_tokens) + ") must be at least --max-model-len (" +
                   std::to_string(max_model_len) + "); raise it or enable chunked prefill",
               "--max-num-batched-tokens");
  return {};
}

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      kv_(config.num_blocks, config.block_size, config.enable_prefix_caching,
          config.num_kv_partitions) {
  auto status = config.validate();
  M3_CHECK(status.has_value(), "invalid SchedulerConfig: %s",
           status ? "" : status.error().message.c_str());
}

int64_t Scheduler::partition_tokens() const {
  return static_cast<int64_t>(config_.num_blocks / config_.num_kv_partitions) * config_.block_size;
}

bool Scheduler::goes_before(const Request& a, const Request& b) const {
  if (config_.policy == Policy::kPriority && a.priority != b.priority)
    return a.priority < b.priority;
  return a.arrival_seq < b.arrival_seq;
}

Status Scheduler::add_request(std::unique_ptr<Request> request) {
  M3_CHECK(request != nullptr, "add_request(nullptr)");
  const uint64_t id = request->request_id;
  if (requests_.count(id) != 0)
    return make_error(
        ErrorCode::kInvalidArgument,
        "request id " + std::to_string(id) + " is already queued or running; use a fresh id",
        "request_id");
  if (request->num_prompt_tokens() == 0)
    return make_error(ErrorCode::kInvalidArgument, "the prompt has no tokens; send at least one",
                      "prompt");
  if (request->stop.max_tokens < 1)
    return make_error(
        ErrorCode::kInvalidArgument,
        "max_tokens is " + std::to_string(request->stop.max_tokens) + "; it must be at least 1",
        "max_tokens");
  Request* req = request.get();
  req->arrival_seq = next_arrival_seq_++;
  req->status = RequestStatus::kWaiting;
  req->num_computed_tokens = 0;
  requests_.emplace(id, std::move(request));
  // The engine rejects these before adding; if one slips through it must not wait forever.
  // A request's pages stay in one partition, so one partition's pages is all it can ever hold.
  const int64_t pool_tokens = partition_tokens();
  if (req->num_prompt_tokens() > config_.max_model_len || req->num_prompt_tokens() > pool_tokens) {
    finish(req, RequestStatus::kFinishedLength, FinishReason::kLength);
    return {};
  }
  insert_waiting(req, /*front=*/false);
  return {};
}

void Scheduler::abort_request(uint64_t request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end() || is_finished(it->second->status)) return;
  Request* req = it->second.get();
  if (req->status == RequestStatus::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), req));
    kv_.free(*req);
  } else if (req->status == RequestStatus::kWaitingForRemoteKv) {
    // A read into its pages is in flight: they are freed when finish_remote_kv reports its end.
    loading_.erase(std::find(loading_.begin(), loading_.end(), req));
    held_kv_[request_id] = false;
  } else {
    remove_waiting(req);
  }
  finish(req, RequestStatus::kFinishedAborted, FinishReason::kAbort);
}

void Scheduler::insert_waiting(Request* request, bool front) {
  if (config_.policy == Policy::kPriority) {
    auto pos = std::upper_bound(
        waiting_.begin(), waiting_.end(), request,
        [this](const Request* a, const Request* b) { return goes_before(*a, *b); });
    waiting_.insert(pos, request);
  } else if (front) {
    waiting_.push_front(request);
  } else {
    waiting_.push_back(request);
  }
}

void Scheduler::remove_waiting(Request* request) {
  auto it = std::find(waiting_.begin(), waiting_.end(), request);
  M3_CHECK(it != waiting_.end(), "request %llu is not waiting",
           static_cast<unsigned long long>(request->request_id));
  waiting_.erase(it);
}

int Scheduler::lookahead(const Request& request, int num_computed, int num_new) const {
  if (config_.num_lookahead_tokens == 0 || num_computed + num_new < request.num_tokens()) return 0;
  // Never past what one request may hold (the pool partition, the model length).
  const int64_t cap = std::min<int64_t>(partition_tokens(), config_.max_model_len);
  return static_cast<int>(
      std::clamp<int64_t>(cap - (num_computed + num_new), 0, config_.num_lookahead_tokens));
}

void Scheduler::preempt(Request* request) {
  M3_CHECK(request->num_inflight_tokens == 0 && request->num_inflight_samples == 0,
           "request %llu preempted with a step in flight",
           static_cast<unsigned long long>(request->request_id));
  request->spec_token_ids.clear();
  kv_.free(*request);
  request->status = RequestStatus::kPreempted;
  request->num_computed_tokens = 0;
  ++request->num_preemptions;
  ++num_preemptions_;
  insert_waiting(request, /*front=*/true);
}

void Scheduler::finish(Request* request, RequestStatus status, FinishReason reason) {
  request->status = status;
  RequestUpdate update = make_update(*request);
  update.finished = true;
  update.finish_reason = reason;
  pending_updates_.push_back(std::move(update));
  const uint64_t id = request->request_id;  // erase destroys *request; keep the key outside it
  finished_since_schedule_.push_back(id);
  requests_.erase(id);
}

RequestUpdate Scheduler::make_update(const Request& request) const {
  RequestUpdate u;
  u.request_id = request.request_id;
  u.stop_token_id = request.stop_token_id;
  u.num_prompt_tokens = request.num_prompt_tokens();
  u.num_output_tokens = request.num_output_tokens();
  u.num_cached_tokens = std::max(0, request.num_cached_tokens);
  u.num_preemptions = request.num_preemptions;
  return u;
}

bool Scheduler::inflight_finishes_by_length(const Request& request) const {
  const int tokens = request.num_tokens() + request.num_inflight_samples;
  return request.num_output_tokens() + request.num_inflight_samples >= request.stop.max_tokens ||
         tokens >= config_.max_model_len || tokens > partition_tokens();
}

SchedulerOutput Scheduler::schedule(bool ahead) {
  SchedulerOutput out;
  ++num_steps_;

  struct Entry {
    Request* request;
    int num_new_tokens;
    bool from_waiting;
  };
  std::vector<Entry> entries;
  int budget = config_.max_num_batched_tokens;
  bool preempted_any = false;

  // Running requests first, in admission order.
  size_t i = 0;
  while (i < running_.size() && budget > 0) {
    Request* req = running_[i];
    // With a step in flight (ahead): its tokens count as computed and its sample as known.
    if (req->num_inflight_samples > 0 && inflight_finishes_by_length(*req)) {
      ++i;
      continue;
    }
    const int num_known = req->num_tokens() + req->num_inflight_samples -
                          (req->num_computed_tokens + req->num_inflight_tokens);
    const int num_spec = static_cast<int>(req->spec_token_ids.size());
    int num_new = std::min(num_known + num_spec, budget);
    const int cap = config_.long_prefill_token_threshold;
    if (cap > 0 && num_new > cap) num_new = cap;
    if (num_new <= 0) {
      ++i;
      continue;
    }
    // Drafts that do not fit the budget are dropped (the step verifies the rest).
    if (num_new < num_known + num_spec)
      req->spec_token_ids.resize(std::max(0, num_new - num_known));
    const int look = num_new >= num_known ? lookahead(*req, num_new) : 0;
    bool scheduled = false;
    while (true) {
      if (kv_.allocate_slots(*req, num_new, nullptr, look)) {
        scheduled = true;
        break;
      }
      // Never with a step in flight: its requests' outputs are not in yet. The caller reports
      // that step and schedules again (pages allocated above stay with their requests, which
      // need them next step anyway).
      if (ahead) {
        SchedulerOutput deferred;
        deferred.deferred = true;
        return deferred;
      }
      // Out of pages: recompute-preempt the running request served last under the policy, among
      // those of req's partition (pages freed elsewhere are of no use to req). req is one of them.
      const int partition = kv_.partition_of(*req);
      M3_CHECK(partition >= 0, "running request %llu holds no pages",
               static_cast<unsigned long long>(req->request_id));
      auto victim_it = running_.end();
      for (auto r = running_.begin(); r != running_.end(); ++r) {
        if (kv_.partition_of(**r) != partition) continue;
        if (victim_it == running_.end() || goes_before(**victim_it, **r)) victim_it = r;
      }
      Request* victim = *victim_it;
      const size_t victim_idx = static_cast<size_t>(victim_it - running_.begin());
      running_.erase(victim_it);
      if (victim_idx < i) {
        // Already scheduled this step (possible under kPriority): give its budget back.
        auto e = std::find_if(entries.begin(), entries.end(),
                              [victim](const Entry& x) { return x.request == victim; });
        M3_CHECK(e != entries.end(), "preempted request was not scheduled");
        budget += e->num_new_tokens;
        entries.erase(e);
        --i;
      }
      preempt(victim);
      out.preempted_ids.push_back(victim->request_id);
      preempted_any = true;
      if (victim == req) break;
    }
    // Preempted itself: it left running_, so index i already names the next request, which may
    // fit in the pages just freed.
    if (!scheduled) continue;
    entries.push_back({req, num_new, false});
    budget -= num_new;
    ++i;
  }

  // Then waiting requests in policy order, unless this step had to preempt (no room to grow).
  if (!preempted_any) {
    while (!waiting_.empty() && budget > 0 &&
           static_cast<int>(running_.size() + loading_.size()) < config_.max_num_seqs) {
      Request* req = waiting_.front();
      if (req->load_remote_kv && req->num_preemptions == 0) {
        // Pages for the whole prompt, to be filled by the prefill worker; no compute this step.
        // Full blocks this worker already caches (a shared prefix) stay and are not read; at
        // least the prompt's last block is read (its read also tells the producer to let go).
        ComputedBlocks hit = kv_.get_computed_blocks(*req);
        const int bs = kv_.block_size();
        const int nblocks = (req->num_prompt_tokens() + bs - 1) / bs;
        // Device hits only (host tier hits would be restores racing the read).
        const int keep = std::min({static_cast<int>(hit.block_ids.size()),
                                   hit.num_computed_tokens / bs, std::max(0, nblocks - 1)});
        hit.block_ids.resize(static_cast<size_t>(keep));
        hit.host_slots.clear();
        hit.num_computed_tokens = keep * bs;
        if (keep == 0) hit.partition = -1;
        if (!kv_.allocate_slots(*req, req->num_prompt_tokens() - keep * bs, &hit))
          break;  // waits for pages
        waiting_.pop_front();
        req->status = RequestStatus::kWaitingForRemoteKv;
        req->num_computed_tokens = keep * bs;  // what a failed read falls back to
        loading_.push_back(req);
        out.kv_loads.push_back({req->request_id, kv_.block_ids(req->request_id), keep});
        continue;
      }
      ComputedBlocks hit = kv_.get_computed_blocks(*req);
      int num_new = req->num_tokens() - hit.num_computed_tokens;
      if (!config_.enable_chunked_prefill && num_new > budget) break;
      num_new = std::min(num_new, budget);
      if (config_.long_prefill_token_threshold > 0)
        num_new = std::min(num_new, config_.long_prefill_token_threshold);
      if (!kv_.allocate_slots(*req, num_new, &hit,
                              lookahead(*req, hit.num_computed_tokens, num_new))) {
        // A hit pins the request to the hit's partition. When that one is full but another
        // partition has more free pages, take that one with its own hit (maybe none) rather than
        // wait: otherwise a prefix every request shares (a system prompt) cached in one partition
        // would send all traffic there and leave the others idle.
        const int other = kv_.most_free_partition();
        if (hit.partition < 0 || other == hit.partition) break;  // waits; pages will free up
        hit = kv_.get_computed_blocks(*req, other);
        num_new = req->num_tokens() - hit.num_computed_tokens;
        if (!config_.enable_chunked_prefill && num_new > budget) break;
        num_new = std::min(num_new, budget);
        if (!kv_.allocate_slots(*req, num_new, &hit,
                                lookahead(*req, hit.num_computed_tokens, num_new)))
          break;
      }
      waiting_.pop_front();
      req->num_computed_tokens = hit.num_computed_tokens;
      if (req->num_cached_tokens < 0) req->num_cached_tokens = hit.num_computed_tokens;
      req->status = RequestStatus::kRunning;
      running_.push_back(req);
      entries.push_back({req, num_new, true});
      budget -= num_new;
    }
  }

  out.finished_ids = std::move(finished_since_schedule_);
  finished_since_schedule_.clear();
  out.requests.reserve(entries.size());
  for (const Entry& e : entries) {
    Request& req = *e.request;
    ScheduledRequest s;
    s.request_id = req.request_id;
    s.start_idx = req.num_computed_tokens + req.num_inflight_tokens;
    s.token_ids.reserve(e.num_new_tokens);
    const int end = s.start_idx + e.num_new_tokens;
    // Known tokens, then the in-flight samples (ids unknown here), then drafts.
    const int known = req.num_tokens() + req.num_inflight_samples;
    for (int p = s.start_idx; p < std::min(end, req.num_tokens()); ++p)
      s.token_ids.push_back(req.token_at(p));
    for (int p = std::max(s.start_idx, req.num_tokens()); p < std::min(end, known); ++p)
      s.token_ids.push_back(kPlaceholderToken);
    for (int p = known; p < end; ++p) s.token_ids.push_back(req.spec_token_ids[p - known]);
    s.num_spec_tokens = std::max(0, end - known);
    s.block_ids = kv_.block_ids(req.request_id);
    s.will_sample = end >= known;
    s.from_waiting = e.from_waiting;
    out.total_num_tokens += e.num_new_tokens;
    req.num_inflight_tokens += e.num_new_tokens;
    if (s.will_sample) ++req.num_inflight_samples;
    out.requests.push_back(std::move(s));
  }
  M3_CHECK(out.total_num_tokens <= config_.max_num_batched_tokens, "scheduled %d tokens",
           out.total_num_tokens);
  kv_.take_copies(&out.kv_offloads, &out.kv_restores);
  return out;
}

FinishReason Scheduler::check_stop(Request& request, int32_t token) const {
  const StopCriteria& stop = request.stop;
  if (request.num_output_tokens() >= stop.min_tokens) {
    if (!stop.ignore_eos && contains(stop.eos_token_ids, token)) return FinishReason::kStop;
    if (contains(stop.stop_token_ids, token)) {
      request.stop_token_id = token;
      return FinishReason::kStop;
    }
  }
  const int64_t pool_tokens = partition_tokens();
  // The next step would compute this token at position num_tokens - 1: it must fit the model and
  // the request's pool partition, otherwise the request could never run again.
  if (request.num_output_tokens() >= stop.max_tokens ||
      request.num_tokens() >= config_.max_model_len || request.num_tokens() > pool_tokens)
    return FinishReason::kLength;
  return FinishReason::kNone;
}

std::vector<RequestUpdate> Scheduler::update_from_output(const SchedulerOutput& scheduler_output,
                                                         const RunnerOutput& runner_output) {
  std::vector<RequestUpdate> updates = std::move(pending_updates_);
  pending_updates_.clear();

  std::unordered_map<uint64_t, const SampledTokens*> sampled;
  sampled.reserve(runner_output.sampled.size());
  for (const SampledTokens& s : runner_output.sampled) sampled.emplace(s.request_id, &s);

  for (const ScheduledRequest& s : scheduler_output.requests) {
    auto it = requests_.find(s.request_id);
    // Aborted between schedule() and now: its pages are already free, its output is dropped.
    if (it == requests_.end() || it->second->status != RequestStatus::kRunning) continue;
    Request* req = it->second.get();
    M3_CHECK(
        req->num_computed_tokens == s.start_idx, "request %llu: computed %d, step started at %d",
        static_cast<unsigned long long>(req->request_id), req->num_computed_tokens, s.start_idx);
    req->num_inflight_tokens -= s.num_new_tokens();
    if (s.will_sample) --req->num_inflight_samples;
    M3_CHECK(req->num_inflight_tokens >= 0 && req->num_inflight_samples >= 0,
             "request %llu: step reported twice", static_cast<unsigned long long>(s.request_id));
    req->num_computed_tokens += s.num_new_tokens();
    req->spec_token_ids.clear();
    if (!s.will_sample) {
      kv_.cache_blocks(*req, req->num_computed_tokens);
      continue;
    }

    auto sit = sampled.find(s.request_id);
    M3_CHECK(sit != sampled.end() && !sit->second->token_ids.empty() &&
                 static_cast<int>(sit->second->token_ids.size()) <= s.num_spec_tokens + 1,
             "runner returned %zu tokens for request %llu (%d drafts)",
             sit == sampled.end() ? size_t{0} : sit->second->token_ids.size(),
             static_cast<unsigned long long>(s.request_id), s.num_spec_tokens);
    // Rejected drafts: their KV is stale; the next step overwrites those positions. Only
    // verified tokens are computed, so the prefix cache below never holds a draft token.
    const int num_accepted = static_cast<int>(sit->second->token_ids.size()) - 1;
    req->num_computed_tokens -= s.num_spec_tokens - num_accepted;
    std::vector<int32_t> new_tokens;
    FinishReason reason = FinishReason::kNone;
    for (int32_t token : sit->second->token_ids) {
      req->output_token_ids.push_back(token);
      new_tokens.push_back(token);
      reason = check_stop(*req, token);
      if (reason != FinishReason::kNone) break;
    }
    // A stop inside the accepted drafts drops the tokens after it: computed never runs past them.
    req->num_computed_tokens = std::min(req->num_computed_tokens, req->num_tokens() - 1);
    kv_.cache_blocks(*req, req->num_computed_tokens);
    if (reason == FinishReason::kNone && sit->second->stop) reason = FinishReason::kStop;
    if (reason == FinishReason::kNone) {
      req->spec_token_ids = sit->second->spec_token_ids;
      if (static_cast<int>(req->spec_token_ids.size()) > config_.num_lookahead_tokens)
        req->spec_token_ids.resize(config_.num_lookahead_tokens);
      RequestUpdate u = make_update(*req);
      u.new_token_ids = std::move(new_tokens);
      updates.push_back(std::move(u));
      continue;
    }
    running_.erase(std::find(running_.begin(), running_.end(), req));
    std::vector<int32_t> held;
    if (req->hold_kv_on_finish) {
      held = kv_.block_ids(req->request_id);
      held_kv_[req->request_id] = true;
    } else {
      kv_.free(*req);
    }
    finish(req,
           reason == FinishReason::kStop ? RequestStatus::kFinishedStopped
                                         : RequestStatus::kFinishedLength,
           reason);
    pending_updates_.back().new_token_ids = std::move(new_tokens);
    pending_updates_.back().held_block_ids = std::move(held);
    updates.push_back(std::move(pending_updates_.back()));
    pending_updates_.pop_back();
  }
  return updates;
}

void Scheduler::release_held_kv(uint64_t request_id) {
  auto it = held_kv_.find(request_id);
  if (it == held_kv_.end() || !it->second) return;  // unknown, or an aborted load (not ours)
  held_kv_.erase(it);
  kv_.free(request_id);
}

void Scheduler::finish_remote_kv(uint64_t request_id, bool loaded) {
  auto held = held_kv_.find(request_id);
  if (held != held_kv_.end() && !held->second) {  // aborted while its read ran
    held_kv_.erase(held);
    kv_.free(request_id);
    return;
  }
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second->status != RequestStatus::kWaitingForRemoteKv) return;
  Request* req = it->second.get();
  loading_.erase(std::find(loading_.begin(), loading_.end(), req));
  // A failed read recomputes the prompt after the blocks that were already here.
  if (loaded) req->num_computed_tokens = req->num_prompt_tokens() - 1;
  if (loaded) kv_.cache_blocks(*req, req->num_computed_tokens);
  // The tokens read from the prefill worker count as cached (vLLM counts external hits too).
  req->num_cached_tokens = req->num_computed_tokens;
  req->status = RequestStatus::kRunning;
  running_.push_back(req);
}

bool Scheduler::has_unfinished() const {
  return !running_.empty() || !waiting_.empty() || !loading_.empty() || !pending_updates_.empty();
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.num_running = num_running();
  s.num_waiting = num_waiting() + num_loading_kv();
  s.num_free_blocks = kv_.block_pool().num_free_blocks();
  s.kv_cache_usage = kv_.usage();
  s.prefix_cache_queries = kv_.prefix_cache_queries();
  s.prefix_cache_hits = kv_.prefix_cache_hits();
  s.num_preemptions = num_preemptions_;
  s.num_kv_offloaded_pages = kv_.num_offloaded_pages();
  s.num_kv_restored_pages = kv_.num_restored_pages();
  if (const HostBlockPool* host = kv_.host_tier()) {
    s.num_host_kv_slots = host->num_slots();
    s.num_host_kv_cached = host->num_cached();
  }
  s.num_steps = num_steps_;
  return s;
}

const Request* Scheduler::find_request(uint64_t request_id) const {
  auto it = requests_.find(request_id);
  return it == requests_.end() ? nullptr : it->second.get();
}

std::vector<uint64_t> Scheduler::running_ids() const {
  std::vector<uint64_t> ids;
  for (const Request* r : running_) ids.push_back(r->request_id);
  return ids;
}

std::vector<uint64_t> Scheduler::waiting_ids() const {
  std::vector<uint64_t> ids;
  for (const Request* r : waiting_) ids.push_back(r->request_id);
  return ids;
}

}  // namespace m3::sched
