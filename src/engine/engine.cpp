#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <thread>
#include <unordered_map>

#include "core/check.h"
#include "core/log.h"
#include "engine/model_runner.h"
#include "engine/pd_connector.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "runtime/kv_budget.h"
#include "sched/scheduler.h"

namespace m3::engine {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- Histogram, RequestStream

Histogram Histogram::with_bounds(std::vector<double> b) {
  Histogram h;
  h.bounds = std::move(b);
  h.counts.assign(h.bounds.size() + 1, 0);
  return h;
}

void Histogram::observe(double v) {
  const size_t i = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
  ++counts[i];
  sum += v;
  ++count;
}

std::optional<RequestOutput> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_taken_) return std::nullopt;
  if (!cv_.wait_for(lock, timeout, [&] { return !queue_.empty(); })) return std::nullopt;
  RequestOutput o = std::move(queue_.front());
  queue_.pop_front();
  if (o.finished) finished_taken_ = true;
  return o;
}

void RequestStream::push(RequestOutput out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_pushed_) return;  // exactly one finished output per request
    if (out.finished) finished_pushed_ = true;
    queue_.push_back(std::move(out));
  }
  cv_.notify_all();
  if (waker_) waker_->notify();
}

uint64_t StreamWaker::sequence() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequence_;
}

uint64_t StreamWaker::wait(uint64_t seen, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return sequence_ != seen; });
  return sequence_;
}

void StreamWaker::notify() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++sequence_;
  }
  cv_.notify_all();
}

bool RequestStream::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_taken_;
}

// ---------------------------------------------------------------- EngineImpl

class EngineImpl {
 public:
  EngineConfig cfg;
  ModelInfo info;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<sched::Scheduler> scheduler;

  // Shared with HTTP threads (guarded by mu).
  std::mutex mu;
  std::condition_variable cv;
  struct Pending {
    uint64_t id;
    GenerateRequest req;
    std::shared_ptr<RequestStream> stream;
    Clock::time_point arrival;
  };
  std::vector<Pending> incoming;
  std::vector<uint64_t> aborts;
  bool stopping = false;
  bool drain = true;
  bool abort_everything = false;  // Engine::abort_all(), handled once by the loop
  std::atomic<bool> accepting{true};
  std::atomic<bool> healthy{true};
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> num_waiting_total{0};  // the scheduler's waiting requests (admission bound)
  std::atomic<int> num_running_total{0};  // the scheduler's running requests (stats)
  // Requests submitted and not finished (incoming, waiting or running): the admission count.
  // Changed under `mu` on submit and by the engine thread when a request ends, so a request
  // moving from `incoming` into the scheduler is never missed between two stats refreshes.
  std::atomic<int> num_unfinished{0};

  mutable std::mutex stats_mu;
  EngineStats stats;

  // Engine-thread only.
  struct Live {
    std::shared_ptr<RequestStream> stream;
    Clock::time_point arrival;
    Clock::time_point first_scheduled;  // its first step (the end of its queue time)
    Clock::time_point first_token;
    Clock::time_point last_token;
    bool scheduled = false;
    bool got_first = false;
    bool prompt_logprobs_sent = false;
    int num_prompt_tokens = 0;
  };
  std::unordered_map<uint64_t, Live> live;
  std::unordered_map<uint64_t, RunnerRequestState> states;
  std::vector<std::unique_ptr<KvEventPublisher>> kv_publishers;  // one per KV partition
  // P/D disaggregation (declared after runner: destroyed first, while the pool it registered is
  // still there). remote_loads: consumer requests' peers until their pages are admitted.
  std::unique_ptr<PdConnector> pd;
  std::unordered_map<uint64_t, KvTransferParams> remote_loads;
  std::thread thread;
  bool async = false;  // loop_async (EngineConfig::async_scheduling, resolved against the backend)
  // The transformers vision layout attends across a request's images (model/config.h): each
  // image's embeddings then depend on all of them, so its cache key is the hash of them all.
  bool images_attend_across = false;

  // The backend's fault (a lost node), once seen by the loop: every request then ends with an
  // error naming it, and new ones are refused (guarded by mu).
  std::string fault;
  // When the backend reports a fault: ends every live request with an error naming it; true
  // when it did (the step just run is then not reported).
  bool fail_on_fault();
  // Ends live request `id` with `reason` ("abort"; "error" with a non-empty `error`) and drops
  // its state; counted as aborted or failed.
  void end_live(uint64_t id, const char* reason, const std::string& error);

  void loop();
  // Async scheduling's loop (EngineConfig::async_scheduling).
  void loop_async();
  // Takes new requests and aborts (waiting for work unless `busy`); true when the loop must end
  // (shutdown), everything live then aborted.
  bool intake(bool busy);
  void start_kv_loads(sched::SchedulerOutput& so);
  // update_from_output of a step, then its events, counters and outputs.
  void report(const sched::SchedulerOutput& so, const sched::RunnerOutput& ro);
  Status check_images(const GenerateRequest& req) const;
  Status check_kv_transfer(const GenerateRequest& req) const;
  void admit(Pending& p);
  void finish_abort(uint64_t id);
  void publish(const std::vector<sched::RequestUpdate>& updates);
  // Queue times of requests scheduled for the first time, and the step's token count.
  void observe_step(const sched::SchedulerOutput& so);
  void refresh_stats();
  void publish_kv_events();
  void apply_pd_events();
};

void EngineImpl::apply_pd_events() {
  if (!pd) return;
  PdConnector::Events ev = pd->take_events();
  for (uint64_t id : ev.released) scheduler->release_held_kv(id);
  for (const auto& [id, ok] : ev.loaded) scheduler->finish_remote_kv(id, ok);
}

void EngineImpl::publish_kv_events() {
  if (kv_publishers.empty()) return;
  std::vector<sched::KvCacheEvent> events = scheduler->take_kv_events();
  if (events.empty()) return;
  if (kv_publishers.size() == 1) {
    kv_publishers[0]->publish(std::move(events));
    return;
  }
  std::vector<std::vector<sched::KvCacheEvent>> per(kv_publishers.size());
  for (auto& e : events) per[e.partition].push_back(std::move(e));
  for (size_t p = 0; p < per.size(); ++p) kv_publishers[p]->publish(std::move(per[p]));
}

Status EngineImpl::check_images(const GenerateRequest& req) const {
  if (req.images.empty()) return {};
  if (!info.image_input) {
    return make_error(ErrorCode::kInvalidArgument,
                      "image input is not available: " + info.image_refusal, "messages");
  }
  const int64_t m2 = info.vision_merge_size * info.vision_merge_size;
  const int64_t row =
      3 * info.vision_temporal_patch_size * info.vision_patch_size * info.vision_patch_size;
  int64_t end_prev = 0;
  const int64_t n_prompt = static_cast<int64_t>(req.prompt_token_ids.size());
  for (size_t i = 0; i < req.images.size(); ++i) {
    const ImageInput& im = req.images[i];
    const int64_t np = im.grid_t * im.grid_h * im.grid_w;
    const std::string which = (im.video ? "video " : "image ") + std::to_string(i);
    const int32_t placeholder = im.video ? info.video_token_id : info.image_token_id;
    if (im.grid_t < 1 || im.grid_h < 1 || im.grid_w < 1 || im.grid_h % info.vision_merge_size ||
        im.grid_w % info.vision_merge_size || np / m2 != im.num_tokens ||
        static_cast<int64_t>(im.patches.size()) != np * row ||
        (im.video && static_cast<int64_t>(im.group_offsets.size()) != im.grid_t) ||
        (!im.video && !im.group_offsets.empty())) {
      return make_error(ErrorCode::kInvalidArgument,
                        which + ": its patch grid does not match its token count", "messages");
    }
    for (const auto& [start, count] : im.spans()) {
      if (start < end_prev || start + count > n_prompt) {
        return make_error(ErrorCode::kInvalidArgument,
                          which + ": its placeholder tokens lie outside the prompt", "messages");
      }
      for (int32_t j = 0; j < count; ++j) {
        if (req.prompt_token_ids[start + j] != placeholder) {
          return make_error(ErrorCode::kInvalidArgument,
                            which + ": prompt token " + std::to_string(start + j) + " is not the " +
                                (im.video ? "video" : "image") + " placeholder " +
                                std::to_string(placeholder),
                            "messages");
        }
      }
      end_prev = start + count;
    }
  }
  return {};
}

Status EngineImpl::check_kv_transfer(const GenerateRequest& req) const {
  const KvTransferParams& k = *req.kv_transfer;
  const std::string param = "kv_transfer_params";
  auto bad = [&](const std::string& m) {
    return make_error(ErrorCode::kInvalidArgument, "kv_transfer_params: " + m, param);
  };
  auto role_hint = [](const char* role) {
    return std::string(
               "start it with --kv-transfer-config '{\"kv_connector\": "
               "\"NixlConnector\", \"kv_role\": \"") +
           role + "\"}'";
  };
  if (k.do_remote_decode && k.do_remote_prefill)
    return bad("do_remote_decode and do_remote_prefill are both true; a worker does one of them");
  if (k.do_remote_decode && (!pd || !pd->config().produces()))
    return bad("do_remote_decode needs a prefill worker, and this one is not: " +
               role_hint("kv_producer"));
  if (!k.do_remote_prefill) return {};
  if (!pd || !pd->config().consumes())
    return bad("do_remote_prefill needs a decode worker, and this one is not: " +
               role_hint("kv_consumer"));
  if (k.remote_engine_id.empty() || k.remote_host.empty() || k.remote_request_id.empty() ||
      k.remote_port < 1 || k.remote_port > 65535)
    return bad(
        "do_remote_prefill needs remote_engine_id, remote_request_id, remote_host and "
        "remote_port (1-65535) from the prefill worker's response");
  const size_t pages = (req.prompt_token_ids.size() + info.block_size - 1) / info.block_size;
  if (k.remote_block_ids.size() < pages)
    return bad("remote_block_ids has " + std::to_string(k.remote_block_ids.size()) +
               " pages, but the prompt needs " + std::to_string(pages) +
               ": send the same prompt the prefill worker computed");
  if (req.params.prompt_logprobs >= 0)
    return bad("prompt_logprobs needs the prompt computed here; drop it or do_remote_prefill");
  if (!req.images.empty()) {
    const bool video =
        std::any_of(req.images.begin(), req.images.end(), [](const auto& im) { return im.video; });
    return bad(std::string(video ? "video" : "image") +
               " input with do_remote_prefill is not supported yet; send it to one worker");
  }
  return {};
}

void EngineImpl::admit(Pending& p) {
  sched::StopCriteria stop;
  const SamplingParams& sp = p.req.params;
  stop.max_tokens = sp.max_tokens;
  stop.min_tokens = sp.min_tokens;
  stop.eos_token_ids = info.eos_token_ids;
  stop.stop_token_ids = sp.stop_token_ids;
  stop.ignore_eos = sp.ignore_eos;
  // Prompt logprobs need every prompt position computed: a unique salt keeps this request off
  // the prefix cache (no hits, and its pages are not shared).
  const uint64_t salt = sp.prompt_logprobs >= 0 ? (p.id | (1ull << 63)) : 0;
  auto r =
      std::make_unique<sched::Request>(p.id, p.req.prompt_token_ids, stop, p.req.priority, salt);
  RunnerRequestState st;
  st.params = sp;
  st.seed = Sampler::make_rng(sp).seed;
  st.history = p.req.prompt_token_ids;
  st.num_prompt_tokens = static_cast<int>(p.req.prompt_token_ids.size());
  if (sp.prompt_logprobs >= 0) st.prompt_logprobs.assign(st.num_prompt_tokens, std::nullopt);
  if (sp.constraint) st.constraint = sp.constraint->make();
  if (!p.req.images.empty()) {
    // The tower runs when a step first computes one of the image positions (ModelRunner), so an
    // image whose pages all come from the prefix cache is never encoded.
    uint64_t all_hash = 0x7669736e00000000ULL;
    for (const ImageInput& im : p.req.images)
      all_hash = (all_hash ^ im.content_hash) * 0x9e3779b97f4a7c15ULL + 1;
    for (const ImageInput& im : p.req.images) {
      for (const auto& [start, count] : im.spans()) {
        st.image_spans.push_back({start, count});
        r->content_spans.push_back(
            {start, count, images_attend_across ? all_hash : im.content_hash});
      }
    }
    st.images = std::move(p.req.images);
  }
  if (p.req.kv_transfer) {
    r->hold_kv_on_finish = p.req.kv_transfer->do_remote_decode;
    r->load_remote_kv = p.req.kv_transfer->do_remote_prefill;
  }
  const bool remote = r->load_remote_kv;
  auto added = scheduler->add_request(std::move(r));
  if (added && remote) remote_loads[p.id] = *p.req.kv_transfer;
  if (!added) {
    RequestOutput o;
    o.finished = true;
    o.finish_reason = "error";
    o.error = added.error().message;
    p.stream->push(std::move(o));
    --num_unfinished;
    return;
  }
  states.emplace(p.id, std::move(st));
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.max_tokens_per_request.observe(sp.max_tokens);
  }
  Live l;
  l.stream = p.stream;
  l.arrival = p.arrival;
  l.num_prompt_tokens = static_cast<int>(p.req.prompt_token_ids.size());
  live.emplace(p.id, std::move(l));
}

void EngineImpl::finish_abort(uint64_t id) {
  end_live(id, "abort", "");
}

void EngineImpl::end_live(uint64_t id, const char* reason, const std::string& error) {
  auto it = live.find(id);
  if (it == live.end()) return;
  scheduler->abort_request(id);
  RequestOutput o;
  o.finished = true;
  o.finish_reason = reason;
  o.error = error;
  o.num_prompt_tokens = it->second.num_prompt_tokens;
  it->second.stream->push(std::move(o));
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++(error.empty() ? stats.requests_finished_abort : stats.requests_finished_error);
  }
  live.erase(it);
  states.erase(id);
  remote_loads.erase(id);
  --num_unfinished;
}

bool EngineImpl::fail_on_fault() {
  const std::string why = runner->fault();
  if (why.empty()) return false;
  const std::string msg =
      "the model's ranks on another node are lost (" + why +
      "); this server cannot run steps any more: restart every node of the group";
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    first = fault.empty();
    if (first) fault = msg;
  }
  if (first) M3_LOG_ERROR("%s", msg.c_str());
  healthy = false;
  std::vector<uint64_t> ids;
  for (auto& [id, l] : live) ids.push_back(id);
  for (uint64_t id : ids) end_live(id, "error", msg);
  refresh_stats();
  return true;
}

void EngineImpl::publish(const std::vector<sched::RequestUpdate>& updates) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> slock(stats_mu);
  for (const auto& u : updates) {
    auto it = live.find(u.request_id);
    if (it == live.end() || (!u.held_block_ids.empty() && !pd)) {
      // No one to hand held pages to: give them back now rather than leak them.
      if (!u.held_block_ids.empty()) scheduler->release_held_kv(u.request_id);
      if (it == live.end()) continue;  // aborted by us already
    }
    Live& l = it->second;
    RunnerRequestState& st = states.at(u.request_id);
    RequestOutput o;
    o.new_token_ids = u.new_token_ids;
    if (st.params.logprobs >= 0) {
      o.logprobs = st.step_logprobs;
      o.logprobs.resize(o.new_token_ids.size());
    }
    if (st.params.prompt_logprobs >= 0 && !l.prompt_logprobs_sent && !u.new_token_ids.empty()) {
      o.prompt_logprobs = st.prompt_logprobs;
      l.prompt_logprobs_sent = true;
    }
    o.num_prompt_tokens = u.num_prompt_tokens;
    o.num_output_tokens = u.num_output_tokens;
    o.num_cached_tokens = u.num_cached_tokens;
    if (!u.new_token_ids.empty()) {
      stats.generation_tokens_total += static_cast<int64_t>(u.new_token_ids.size());
      if (!l.got_first) {
        l.got_first = true;
        l.first_token = now;
        stats.time_to_first_token_s.observe(std::chrono::duration<double>(now - l.arrival).count());
        stats.prompt_tokens_total += u.num_prompt_tokens;
        stats.prompt_tokens_cached_total += u.num_cached_tokens;
        stats.prefill_computed_tokens_per_request.observe(u.num_prompt_tokens -
                                                          u.num_cached_tokens);
      } else {
        stats.inter_token_latency_s.observe(
            std::chrono::duration<double>(now - l.last_token).count());
      }
      l.last_token = now;
    }
    if (u.finished) {
      o.finished = true;
      switch (u.finish_reason) {
        case sched::FinishReason::kStop:
          o.finish_reason = "stop";
          ++stats.requests_finished_stop;
          break;
        case sched::FinishReason::kLength:
          o.finish_reason = "length";
          ++stats.requests_finished_length;
          break;
        default:
          o.finish_reason = "abort";
          ++stats.requests_finished_abort;
          break;
      }
      o.stop_token_id = u.stop_token_id;
      if (!u.held_block_ids.empty() && pd)  // freed at the consumer's read or the deadline
        o.kv_transfer_params = pd->hold(u.request_id, u.held_block_ids);
      auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
      stats.e2e_request_latency_s.observe(secs(now - l.arrival));
      if (l.scheduled) {
        stats.request_inference_time_s.observe(secs(now - l.first_scheduled));
        if (l.got_first) {
          stats.request_prefill_time_s.observe(secs(l.first_token - l.first_scheduled));
          stats.request_decode_time_s.observe(secs(now - l.first_token));
          if (u.num_output_tokens > 1) {
            stats.request_time_per_output_token_s.observe(secs(now - l.first_token) /
                                                          (u.num_output_tokens - 1));
          }
        }
      }
      stats.prompt_tokens_per_request.observe(u.num_prompt_tokens);
      stats.generation_tokens_per_request.observe(u.num_output_tokens);
    }
    if (o.new_token_ids.empty() && !o.finished) continue;
    l.stream->push(std::move(o));
    if (u.finished) {
      live.erase(it);
      states.erase(u.request_id);
      remote_loads.erase(u.request_id);
      --num_unfinished;
    }
  }
}

void EngineImpl::observe_step(const sched::SchedulerOutput& so) {
  if (so.empty()) return;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.iteration_tokens.observe(so.total_num_tokens);
  for (const auto& r : so.requests) {
    auto it = live.find(r.request_id);
    if (it == live.end() || it->second.scheduled) continue;
    it->second.scheduled = true;
    it->second.first_scheduled = now;
    stats.request_queue_time_s.observe(
        std::chrono::duration<double>(now - it->second.arrival).count());
  }
}

void EngineImpl::refresh_stats() {
  const sched::SchedulerStats s = scheduler->stats();
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.num_running = s.num_running;
  stats.num_waiting = s.num_waiting;
  stats.kv_cache_usage = s.kv_cache_usage;
  stats.prefix_cache_queries = s.prefix_cache_queries;
  stats.prefix_cache_hits = s.prefix_cache_hits;
  stats.num_preemptions = s.num_preemptions;
  stats.num_host_kv_cached = s.num_host_kv_cached;
  stats.kv_offloaded_pages_total = s.num_kv_offloaded_pages;
  stats.kv_restored_pages_total = s.num_kv_restored_pages;
  num_waiting_total = s.num_waiting;
  num_running_total = s.num_running;
}

bool EngineImpl::intake(bool busy) {
  std::vector<Pending> in;
  std::vector<uint64_t> ab;
  bool stop_now = false;
  bool abort_every = false;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] {
      return busy || !incoming.empty() || !aborts.empty() || stopping || abort_everything ||
             scheduler->has_unfinished() || (pd && pd->has_events());
    });
    in.swap(incoming);
    ab.swap(aborts);
    abort_every = abort_everything;
    abort_everything = false;
    stop_now = stopping && (!drain || (!scheduler->has_unfinished() && in.empty()));
    if (stopping && !drain) {
      // Abort everything still queued or running.
      for (auto& p : in) ab.push_back(p.id);
    }
  }
  for (auto& p : in) {
    if ((stopping && !drain) || abort_every) {
      RequestOutput o;
      o.finished = true;
      o.finish_reason = "abort";
      p.stream->push(std::move(o));
      --num_unfinished;
      continue;
    }
    admit(p);
  }
  for (uint64_t id : ab) finish_abort(id);
  if (abort_every) {
    std::vector<uint64_t> ids;
    for (auto& [id, l] : live) ids.push_back(id);
    for (uint64_t id : ids) finish_abort(id);
  }
  if (stop_now) {
    std::vector<uint64_t> ids;
    for (auto& [id, l] : live) ids.push_back(id);
    for (uint64_t id : ids) finish_abort(id);
    refresh_stats();
    return true;
  }
  apply_pd_events();
  return false;
}

void EngineImpl::loop() {
  if (async) {
    loop_async();
    return;
  }
  for (;;) {
    if (intake(/*busy=*/false)) return;
    if (!scheduler->has_unfinished()) {
      refresh_stats();
      continue;
    }
    sched::SchedulerOutput so = scheduler->schedule();
    start_kv_loads(so);
    observe_step(so);
    sched::RunnerOutput ro;
    if (!so.empty()) ro = runner->execute(so, states);
    // A step that ran while a node was lost has no result: its requests fail instead (the
    // scheduler drops them at the next schedule()).
    if (!so.empty() && fail_on_fault()) continue;
    report(so, ro);
    if (so.empty()) {
      // Nothing could run (all waiting for pages that running requests hold cannot happen, but
      // never spin): wait for new work or an abort.
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
}

void EngineImpl::start_kv_loads(sched::SchedulerOutput& so) {
  for (sched::KvLoad& l : so.kv_loads) {
    auto rl = remote_loads.find(l.request_id);
    M3_CHECK(pd && rl != remote_loads.end(), "request %llu loads remote KV without a peer",
             static_cast<unsigned long long>(l.request_id));
    l.block_ids.erase(l.block_ids.begin(), l.block_ids.begin() + l.first_block);
    pd->start_load(l.request_id, std::move(l.block_ids), std::move(rl->second), l.first_block);
    remote_loads.erase(rl);
  }
}

void EngineImpl::report(const sched::SchedulerOutput& so, const sched::RunnerOutput& ro) {
  std::vector<sched::RequestUpdate> updates = scheduler->update_from_output(so, ro);
  // Events and counters first: a client (or a router reading /metrics and the event stream)
  // that sees a response sees the cache state of the step that produced it.
  publish_kv_events();
  refresh_stats();
  publish(updates);
}

// Async scheduling: while the backend runs step N, the next step is scheduled (its decode rows
// read step N's samples on the device) and launched behind it; then step N's tokens are
// reported. A step with host-sampled rows, or one whose successor would have to preempt, is
// reported before the next one is scheduled, as in loop().
void EngineImpl::loop_async() {
  std::unique_ptr<LaunchedStep> inflight;
  for (;;) {
    if (intake(/*busy=*/inflight != nullptr)) {
      if (inflight) {  // its requests were just aborted: nothing of it is reported
        const sched::RunnerOutput ro = runner->finish(*inflight, states);
        scheduler->update_from_output(inflight->out, ro);
      }
      return;
    }
    if (inflight && !runner->fault().empty()) {
      // A lost node: nothing more is launched; the step in flight is dropped.
      runner->finish(*inflight, states);
      inflight.reset();
      fail_on_fault();
      continue;
    }
    if (inflight) {
      std::unique_ptr<LaunchedStep> next;
      bool empty_ahead = false;
      sched::SchedulerOutput ahead;
      if (!inflight->host_samples && scheduler->has_unfinished()) {
        ahead = scheduler->schedule(/*ahead=*/true);
        if (!ahead.deferred) {
          start_kv_loads(ahead);
          observe_step(ahead);
          if (!ahead.requests.empty()) {
            next = runner->launch(std::move(ahead), states);
          } else {
            // Host KV tier copies without a forward (ordered after the step in flight).
            if (!ahead.kv_offloads.empty() || !ahead.kv_restores.empty())
              runner->execute(ahead, states);
            empty_ahead = true;
          }
        }
      }
      {
        std::lock_guard<std::mutex> lock(stats_mu);
        ++(next ? stats.steps_launched_ahead : stats.steps_not_overlapped);
      }
      const sched::RunnerOutput ro = runner->finish(*inflight, states);
      if (!runner->fault().empty()) {
        if (next) runner->finish(*next, states);
        inflight.reset();
        fail_on_fault();
        continue;
      }
      report(inflight->out, ro);
      if (empty_ahead) report(ahead, {});
      inflight = std::move(next);
      continue;
    }
    if (!scheduler->has_unfinished()) {
      refresh_stats();
      continue;
    }
    sched::SchedulerOutput so = scheduler->schedule();
    start_kv_loads(so);
    observe_step(so);
    if (!so.requests.empty()) {
      inflight = runner->launch(std::move(so), states);
      continue;
    }
    sched::RunnerOutput ro;
    if (!so.empty()) ro = runner->execute(so, states);
    // A step that ran while a node was lost has no result: its requests fail instead (the
    // scheduler drops them at the next schedule()).
    if (!so.empty() && fail_on_fault()) continue;
    report(so, ro);
    if (so.empty()) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
}

// ---------------------------------------------------------------- Engine

Engine::Engine(std::unique_ptr<EngineImpl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  shutdown(false);
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  auto impl = std::make_unique<EngineImpl>();
  impl->cfg = config;
  model::LoadOptions lo;
  lo.language_model_only = config.language_model_only;
  lo.quantization = config.quantization;
  M3_TRY(auto model, model::M3Model::load(config.model_dir, lo));
  model->set_kv_cache_format(config.kv_cache_dtype, config.index_cache_dtype);
  const model::M3Config& mc = model->config();
  M3_TRY_STATUS(model::check_kv_block_size(mc, config.block_size));
  // A host draft shares the target's embedding and LM head: keep the host weights it reads
  // (null for a synthetic model, whose draft the GPU backend makes from its device weights).
  const std::shared_ptr<const model::M3Weights> target_weights = model->base_weights();
  const int64_t bs = mc.sparse_block_size;
  const int64_t page_bytes = model::KvCache::page_bytes(mc);
  int64_t max_len = config.max_model_len > 0 ? config.max_model_len : mc.max_position_embeddings;
  if (config.max_model_len > mc.max_position_embeddings) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--max-model-len " + std::to_string(config.max_model_len) +
                          " is above the model's max_position_embeddings (" +
                          std::to_string(mc.max_position_embeddings) + ")",
                      "--max-model-len");
  }
  int64_t bytes = config.kv_cache_memory_bytes;
  if (bytes <= 0) {
    const int64_t want_tokens = std::min<int64_t>(max_len, 4096) * std::max(1, config.max_num_seqs);
    bytes = std::min<int64_t>(((want_tokens + bs - 1) / bs) * page_bytes, int64_t{4} << 30);
  }
  const int64_t cpu_num_pages = bytes / page_bytes;
  const bool max_len_given = config.max_model_len > 0;
  // One sequence of max_len tokens must fit in the pool; with no --max-model-len the pool caps it.
  // With KV partitions (attention data parallel) a sequence's pages stay in one partition, so the
  // limit is one partition's pages (runtime/kv_budget.h has the check and its message).
  auto check_fit = [&](int64_t num_pages, const std::string& where, const std::string& flag,
                       int64_t num_partitions = 1) -> Status {
    const int64_t part_pages = num_pages / num_partitions;
    if (!max_len_given) max_len = std::min<int64_t>(max_len, part_pages * bs);
    runtime::KvPoolFacts pool;
    pool.num_pages = num_pages;
    pool.page_size = bs;
    pool.page_bytes = page_bytes;
    pool.where = where;
    pool.flag = flag;
    pool.num_partitions = num_partitions;
    // A pool without one page holds no sequence at all, --max-model-len given or not.
    return runtime::check_max_model_len_fits(std::max<int64_t>(max_len, 1), pool);
  };
  std::unique_ptr<runtime::ForwardBackend> backend;
  if (config.backend_factory) {
    M3_TRY(backend, config.backend_factory(std::move(model), cpu_num_pages));
    M3_CHECK(backend != nullptr, "engine: the backend factory returned null");
  } else {
    // Refuse before allocating: the CPU pool is exactly the requested bytes.
    M3_TRY_STATUS(check_fit(cpu_num_pages, "cpu", "--kv-cache-memory-bytes"));
    M3_TRY(backend, runtime::make_cpu_backend(std::move(model), cpu_num_pages));
  }
  const int64_t num_pages = backend->num_pages();
  const model::M3Config& bc = backend->config();  // `mc` went with the model into the backend
  M3_CHECK(bc.sparse_block_size == bs && num_pages <= INT32_MAX,
           "engine: backend %s has block size %lld and %lld pages", backend->device_name().c_str(),
           static_cast<long long>(bc.sparse_block_size), static_cast<long long>(num_pages));
  const int num_kv_partitions = backend->num_kv_partitions();
  M3_CHECK(num_kv_partitions >= 1 && num_pages % num_kv_partitions == 0,
           "engine: backend %s has %lld pages in %d partitions", backend->device_name().c_str(),
           static_cast<long long>(num_pages), num_kv_partitions);
  M3_TRY_STATUS(
      check_fit(num_pages, backend->device_name(), backend->kv_cache_flag(), num_kv_partitions));
  sched::SchedulerConfig sc;
  sc.max_num_seqs = config.max_num_seqs;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.long_prefill_token_threshold = config.long_prefill_token_threshold;
  sc.max_model_len = static_cast<int>(max_len);
  sc.block_size = static_cast<int>(bs);
  sc.num_blocks = static_cast<int>(num_pages);
  sc.num_kv_partitions = num_kv_partitions;
  sc.enable_prefix_caching = config.enable_prefix_caching;
  sc.policy = config.priority_scheduling ? sched::Policy::kPriority : sched::Policy::kFcfs;
  M3_TRY_STATUS(sc.validate());
  std::unique_ptr<SpecDecoder> spec;
  if (config.speculative.enabled()) {
    const std::string why = backend->speculative_refusal();
    if (!why.empty()) return make_error(ErrorCode::kUnsupported, why, "--speculative-config");
    M3_TRY(spec, SpecDecoder::create(config.speculative, *backend, target_weights));
    sc.num_lookahead_tokens = config.speculative.num_speculative_tokens;
  }

  ModelInfo& info = impl->info;
  if (spec) {
    info.speculative = spec->summary();
    info.num_speculative_tokens = spec->num_speculative_tokens();
  }
  info.model_dir = config.model_dir;
  info.summary = bc.summary();
  info.vocab_size = bc.vocab_size;
  info.max_model_len = static_cast<int>(max_len);
  info.block_size = static_cast<int>(bs);
  info.num_kv_blocks = num_pages;
  info.kv_tokens = num_pages * bs;
  info.kv_cache_dtype = kernels::kv_dtype_name(bc.kv_cache_dtype);
  info.index_cache_dtype = bc.any_sparse() ? kernels::kv_dtype_name(bc.index_cache_dtype) : "";
  info.kv_bytes_per_token = model::KvCache::page_bytes(bc) / bs;
  info.device = backend->device_name();
  info.enable_prefix_caching = config.enable_prefix_caching;
  for (int64_t e : bc.eos_token_ids) info.eos_token_ids.push_back(static_cast<int32_t>(e));
  info.image_input = backend->supports_image_input();
  if (!info.image_input) info.image_refusal = backend->image_refusal();
  info.image_token_id = static_cast<int32_t>(bc.vision.image_token_index);
  info.video_token_id = static_cast<int32_t>(bc.vision.video_token_index);
  info.vision_patch_size = bc.vision.patch_size;
  info.vision_temporal_patch_size = bc.vision.temporal_patch_size;
  info.vision_merge_size = bc.vision.spatial_merge_size;
  impl->images_attend_across = bc.vision.rope_layout == model::VisionRopeLayout::kTransformers;

  int64_t host_slots = 0;
  if (config.host_kv_cache_bytes > 0) {
    const std::string flag = "--kv-transfer-config";
    if (!config.enable_prefix_caching) {
      return make_error(ErrorCode::kInvalidArgument,
                        "the host KV tier keeps evicted prefix-cache pages, but prefix caching is "
                        "off: drop --no-enable-prefix-caching (or the offloading config)",
                        flag);
    }
    if (num_kv_partitions != 1) {
      return make_error(ErrorCode::kUnsupported,
                        "the host KV tier works with one KV partition so far; with "
                        "--data-parallel-size " +
                            std::to_string(num_kv_partitions) + " drop the offloading config",
                        flag);
    }
    const int64_t pb = model::KvCache::page_bytes(bc);
    host_slots = config.host_kv_cache_bytes / pb;
    if (host_slots < 1) {
      return make_error(ErrorCode::kInvalidArgument,
                        "the host KV tier of " + std::to_string(config.host_kv_cache_bytes) +
                            " bytes is smaller than one KV page (" + std::to_string(pb) +
                            " bytes with this model and KV format); give cpu_bytes_to_use of at "
                            "least " +
                            std::to_string(pb),
                        flag);
    }
    host_slots = std::min<int64_t>(host_slots, INT32_MAX);
    M3_TRY_STATUS(backend->enable_host_kv_tier(host_slots));
    info.num_host_kv_pages = host_slots;
  }
  const int64_t sampleable = config.num_sampleable_tokens > 0
                                 ? std::min<int64_t>(config.num_sampleable_tokens, bc.vocab_size)
                                 : bc.vocab_size;
  if (config.pd) {
    const std::string flag = "--kv-transfer-config";
    if (config.speculative.enabled() && config.pd->consumes()) {
      // The draft model keeps its own state of every computed position; a decode worker
      // computes only a prompt's last token, so the draft would run without the prompt.
      return make_error(ErrorCode::kUnsupported,
                        "--speculative-config on a P/D decode worker (kv_role " +
                            std::string(kv_role_name(config.pd->role)) +
                            ") is not supported yet: the draft model never sees the prompt the "
                            "prefill worker computed; drop one of them (a kv_producer may keep "
                            "it)",
                        flag);
    }
    std::vector<runtime::KvRegion> regions = backend->kv_regions();
    if (regions.empty() || num_kv_partitions != 1) {
      return make_error(ErrorCode::kUnsupported,
                        "NixlConnector (prefill/decode disaggregation) works with the single-rank "
                        "CPU backend so far; the " +
                            backend->device_name() +
                            " backend cannot hand its KV pages to NIXL yet: drop the NixlConnector "
                            "config (or serve with --device cpu)",
                        flag);
    }
    EngineImpl* raw = impl.get();
    M3_TRY(impl->pd,
           PdConnector::create(*config.pd, std::move(regions), static_cast<int>(bs), [raw] {
             { std::lock_guard<std::mutex> lock(raw->mu); }  // no lost wake-up vs the loop's wait
             raw->cv.notify_all();
           }));
    info.kv_role = kv_role_name(config.pd->role);
    info.pd_engine_id = impl->pd->engine_id();
  }
  {
    // Async scheduling: the default follows the backend; what the pipeline cannot do turns it off.
    const bool asked = config.async_scheduling.has_value();
    bool on = config.async_scheduling.value_or(backend->launch_overlaps());
    std::string why_not;
    if (!backend->samples_on_device())
      why_not = "the " + backend->device_name() + " backend samples on the host only";
    else if (spec)
      why_not =
          "speculative decoding decides each step's tokens and drafts on the host from the "
          "step before";
    else if (config.pd)
      why_not = "P/D disaggregation (NixlConnector) runs with the synchronous loop";
    if (on && !why_not.empty()) {
      if (asked) {
        M3_LOG_WARN("--async-scheduling is off: %s", why_not.c_str());
      } else {
        // Off although the backend defaults to it: said once, never silently.
        M3_LOG_INFO("async scheduling off (the %s backend's default): %s",
                    backend->device_name().c_str(), why_not.c_str());
      }
      on = false;
    }
    impl->async = on;
    info.async_scheduling = on;
    if (on) M3_LOG_INFO("async scheduling on (--no-async-scheduling turns it off)");
  }
  impl->runner = std::make_unique<ModelRunner>(std::move(backend), sampleable, std::move(spec),
                                               static_cast<int>(max_len));
  impl->scheduler = std::make_unique<sched::Scheduler>(sc);
  if (host_slots > 0) impl->scheduler->enable_host_kv_tier(static_cast<int>(host_slots));
  if (config.kv_events.enabled) {
    if (!config.enable_prefix_caching) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--kv-events-config publishes the prefix cache's blocks, but prefix "
                        "caching is off: drop --no-enable-prefix-caching (or the KV events)",
                        "--kv-events-config");
    }
    for (int p = 0; p < num_kv_partitions; ++p) {
      M3_TRY(auto pub, KvEventPublisher::create(config.kv_events, p, static_cast<int>(bs)));
      info.kv_events_endpoints.push_back(pub->endpoint());
      if (!pub->replay_endpoint().empty())
        info.kv_events_replay_endpoints.push_back(pub->replay_endpoint());
      impl->kv_publishers.push_back(std::move(pub));
    }
    impl->scheduler->set_kv_events_enabled(true);
  }
  auto& st = impl->stats;
  // vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up.
  st.time_to_first_token_s = Histogram::with_bounds(
      {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
       1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0});
  const std::vector<double> itl = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                   0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
  st.inter_token_latency_s = Histogram::with_bounds(itl);
  st.request_time_per_output_token_s = Histogram::with_bounds(itl);
  const std::vector<double> req = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                   5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  st.e2e_request_latency_s = Histogram::with_bounds(req);
  st.request_queue_time_s = Histogram::with_bounds(req);
  st.request_prefill_time_s = Histogram::with_bounds(req);
  st.request_decode_time_s = Histogram::with_bounds(req);
  st.request_inference_time_s = Histogram::with_bounds(req);
  // 1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets).
  std::vector<double> toks;
  for (double p = 1; p <= static_cast<double>(max_len); p *= 10) {
    for (double m : {1.0, 2.0, 5.0})
      if (m * p <= static_cast<double>(max_len)) toks.push_back(m * p);
  }
  st.prompt_tokens_per_request = Histogram::with_bounds(toks);
  st.generation_tokens_per_request = Histogram::with_bounds(toks);
  st.max_tokens_per_request = Histogram::with_bounds(toks);
  st.prefill_computed_tokens_per_request = Histogram::with_bounds(toks);
  // vLLM: the CUDA-graph capture sizes up to max_num_batched_tokens.
  std::vector<double> steps = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
  while (!steps.empty() && steps.back() > config.max_num_batched_tokens) steps.pop_back();
  if (steps.empty() || steps.back() < config.max_num_batched_tokens)
    steps.push_back(config.max_num_batched_tokens);
  st.iteration_tokens = Histogram::with_bounds(steps);
  st.num_kv_blocks = num_pages;
  st.block_size = bs;
  st.kv_cache_dtype = info.kv_cache_dtype;
  st.index_cache_dtype = info.index_cache_dtype;
  st.kv_bytes_per_token = info.kv_bytes_per_token;
  st.num_host_kv_pages = host_slots;
  st.pd_enabled = impl->pd != nullptr;
  EngineImpl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->loop(); });
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<std::shared_ptr<RequestStream>> Engine::submit(GenerateRequest req) {
  EngineImpl& e = *impl_;
  if (!e.accepting) {
    return make_error(ErrorCode::kUnavailable,
                      "the server is shutting down; retry on another replica");
  }
  const auto& p = req.params;
  if (req.prompt_token_ids.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "the prompt is empty; give at least one token",
                      "prompt");
  }
  for (size_t i = 0; i < req.prompt_token_ids.size(); ++i) {
    const int32_t t = req.prompt_token_ids[i];
    if (t < 0 || t >= e.info.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "prompt token " + std::to_string(i) + " has id " + std::to_string(t) +
                            ", outside the vocabulary [0, " + std::to_string(e.info.vocab_size) +
                            ")",
                        "prompt");
    }
  }
  if (p.max_tokens < 1) {
    return make_error(ErrorCode::kInvalidArgument, "max_tokens must be at least 1", "max_tokens");
  }
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < e.info.vocab_size; };
  const std::string vocab = "[0, " + std::to_string(e.info.vocab_size) + ")";
  for (const auto& [t, bias] : p.logit_bias) {
    if (!in_vocab(t)) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "logit_bias has token id " + std::to_string(t) + ", outside the vocabulary " + vocab,
          "logit_bias");
    }
  }
  for (int32_t t : p.allowed_token_ids) {
    if (!in_vocab(t)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "allowed_token_ids has token id " + std::to_string(t) +
                            ", outside the vocabulary " + vocab,
                        "allowed_token_ids");
    }
  }
  M3_TRY_STATUS(check_context_length(static_cast<int64_t>(req.prompt_token_ids.size()),
                                     p.max_tokens, e.info.max_model_len, "messages"));
  M3_TRY_STATUS(e.check_images(req));
  if (req.kv_transfer) M3_TRY_STATUS(e.check_kv_transfer(req));

  const uint64_t id = e.next_id++;
  auto stream = std::make_shared<RequestStream>(id, req.waker);
  {
    std::lock_guard<std::mutex> lock(e.mu);
    // Only requests that cannot start count against the queue: those the free sequence slots
    // (--max-num-seqs minus running) will take at the next step are not waiting.
    const int waiting = std::max(0, e.num_unfinished.load() - e.cfg.max_num_seqs);
    if (waiting >= e.cfg.max_queue_len) {
      return make_error(ErrorCode::kQueueFull,
                        "the request queue is full (" + std::to_string(waiting) +
                            " waiting for one of " + std::to_string(e.cfg.max_num_seqs) +
                            " running slots, --max-queue-len " +
                            std::to_string(e.cfg.max_queue_len) + "); retry later");
    }
    if (e.stopping) {
      return make_error(ErrorCode::kUnavailable, "the server is shutting down");
    }
    if (!e.fault.empty()) return make_error(ErrorCode::kUnavailable, e.fault);
    e.incoming.push_back({id, std::move(req), stream, Clock::now()});
    ++e.num_unfinished;
  }
  e.cv.notify_all();
  return stream;
}

void Engine::abort(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->aborts.push_back(request_id);
  }
  impl_->cv.notify_all();
}

void Engine::abort_all() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->abort_everything = true;
  }
  impl_->cv.notify_all();
}

const ModelInfo& Engine::model_info() const {
  return impl_->info;
}

EngineStats Engine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(impl_->stats_mu);
    s = impl_->stats;
  }
  if (impl_->pd) s.pd = impl_->pd->stats();  // its own lock: current even when the loop idles
  s.image_encodes = impl_->runner->num_image_encodes();  // atomic, bumped before the outputs
  if (const SpecDecoder* sd = impl_->runner->spec_decoder()) s.spec_decode = sd->stats();
  // Counted by the publisher threads as they send (the list is fixed after create()).
  for (const auto& pub : impl_->kv_publishers) {
    s.kv_event_batches_published += pub->num_batches_published();
    s.kv_event_batches_dropped += pub->num_batches_dropped();
  }
  return s;
}

bool Engine::healthy() const {
  // A lost node turns /health to 503 at once, even while no step runs.
  return impl_->healthy && impl_->accepting && impl_->runner->fault().empty();
}

void Engine::shutdown(bool drain) {
  if (!impl_) return;
  impl_->accepting = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    impl_->drain = drain;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->pd) impl_->pd->shutdown();  // no READ into the pool after this
}

Status check_context_length(int64_t prompt_tokens, int64_t max_tokens, int64_t max_model_len,
                            const std::string& prompt_param) {
  if (max_tokens < 0) {
    if (prompt_tokens < max_model_len) return {};
    return make_error(ErrorCode::kContextLength,
                      "This model's maximum context length is " + std::to_string(max_model_len) +
                          " tokens. However, your prompt has " + std::to_string(prompt_tokens) +
                          " tokens, which leaves no room for the completion. Please shorten the "
                          "prompt.",
                      prompt_param);
  }
  const int64_t total = prompt_tokens + max_tokens;
  if (total <= max_model_len) return {};
  return make_error(ErrorCode::kContextLength,
                    "This model's maximum context length is " + std::to_string(max_model_len) +
                        " tokens. However, you requested " + std::to_string(total) + " tokens (" +
                        std::to_string(prompt_tokens) + " in the prompt, " +
                        std::to_string(max_tokens) +
                        " for the completion). Please reduce the prompt or max_tokens.",
                    prompt_tokens >= max_model_len ? prompt_param : "max_tokens");
}

}  // namespace m3::engine
