// Engine: the one surface the server (and `m3serve chat`) uses to run requests. It owns the model,
// the scheduler and one engine-loop thread (schedule -> execute -> update); HTTP threads submit
// token-id requests and read per-request output streams. Plain data only: no JSON, no text.
// Invariants: every submitted request ends with exactly one output whose `finished` is true
// (stop, length, abort or error); aborting frees the request's pages within one step.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/kv_event_publisher.h"
#include "engine/kv_transfer.h"
#include "engine/sampling_params.h"
#include "engine/spec_decode.h"
#include "kernels/views.h"

namespace m3::model {
class M3Model;
}  // namespace m3::model
namespace m3::runtime {
class ForwardBackend;
}  // namespace m3::runtime

namespace m3::engine {

// Builds the device backend from the model the engine loaded on the host. `cpu_num_pages` is the
// pool the engine sized from kv_cache_memory_bytes (what the CPU backend gets); a GPU factory may
// size its own pool instead (runtime/cuda/cuda_backend.h). The engine never sees CUDA types.
using BackendFactory = std::function<Result<std::unique_ptr<runtime::ForwardBackend>>(
    std::unique_ptr<model::M3Model> host_model, int64_t cpu_num_pages)>;

struct EngineConfig {
  std::string model_dir;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int long_prefill_token_threshold = 0;  // --long-prefill-token-threshold (sched/scheduler.h)
  int max_model_len = 0;  // 0: the model's max_position_embeddings, capped by the KV pool
  int block_size = 128;   // must equal the model's sparse_block_size
  int64_t kv_cache_memory_bytes =
      0;  // 0: enough for max_num_seqs sequences of up to 4096 tokens, <= 4 GiB
  bool enable_prefix_caching = true;
  bool priority_scheduling = false;  // else first-come-first-served
  // Requests that cannot start at once (beyond the free --max-num-seqs slots) beyond this are
  // refused (kQueueFull).
  int max_queue_len = 1024;
  // Ids at or above this are never sampled (embedding rows past the tokenizer's vocabulary, e.g.
  // M3's padding rows 200061-200063). 0: the model's vocab_size.
  int64_t num_sampleable_tokens = 0;
  // Skip the vision tower (--language-model-only): image input is then refused.
  bool language_model_only = false;
  // --quantization (model/m3_model.h LoadOptions::quantization): "" reads the checkpoint as stored.
  std::string quantization;
  // Where the forward runs. Empty: the CPU backend (runtime::make_cpu_backend).
  BackendFactory backend_factory;
  // The KV cache's element formats (docs/KV_CACHE.md), set on the model right after it loads,
  // before the pool is sized (app/device_backend.h resolve_kv_format picks them per device).
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kF32;
  kernels::KvDtype index_cache_dtype = kernels::KvDtype::kF32;
  // vLLM's KV event stream (--kv-events-config): needs prefix caching. One publisher per KV
  // partition (data-parallel rank r on the endpoint's port + r).
  KvEventsConfig kv_events;
  // The host KV tier's size in bytes (vLLM's cpu_bytes_to_use): evicted prefix-cache pages are
  // kept there and restored on a prefix hit. 0: off. Needs prefix caching and one KV partition.
  int64_t host_kv_cache_bytes = 0;
  // --speculative-config (engine/spec_decode.h): EAGLE-3 drafts verified by the target.
  SpeculativeConfig speculative;
  // Prefill/decode disaggregation over NIXL (--kv-transfer-config NixlConnector): requests with
  // kv_transfer_params are served as vLLM's NixlConnector does. Unset: such requests are refused.
  std::optional<PdConfig> pd;
  // vLLM's --async-scheduling / --no-async-scheduling: schedule and launch step N+1 while step N
  // runs (its decode rows read step N's tokens on the device; outputs reach the streams one step
  // later, and a request that stops on a token has one extra step computed and dropped). The
  // tokens are the synchronous loop's. Unset: on where the backend's launch overlaps the host
  // (the GPU), off elsewhere. Steps with host-sampled rows (logprobs, penalties, structured
  // outputs) are reported before the next is scheduled. Not with --speculative-config, the host
  // KV tier or P/D disaggregation (then off, with a warning when it was asked for).
  std::optional<bool> async_scheduling;
};

// Histogram with fixed upper bounds (Prometheus style: counts are per bucket, not cumulative).
struct Histogram {
  std::vector<double> bounds;    // ascending upper bounds; an implicit +Inf bucket follows
  std::vector<uint64_t> counts;  // bounds.size() + 1
  double sum = 0.0;
  uint64_t count = 0;
  void observe(double v);
  static Histogram with_bounds(std::vector<double> b);
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  double kv_cache_usage = 0.0;  // 0..1 of the KV pages in use
  int64_t num_kv_blocks = 0;
  int64_t block_size = 0;
  std::string kv_cache_dtype;     // the KV cache's format (kernels::kv_dtype_name)
  std::string index_cache_dtype;  // the MSA index-K's ("" without sparse layers)
  int64_t kv_bytes_per_token = 0;
  int64_t prefix_cache_queries = 0;  // tokens
  int64_t prefix_cache_hits = 0;     // tokens
  int64_t num_preemptions = 0;
  int64_t kv_event_batches_published = 0;  // --kv-events-config, all publishers
  int64_t kv_event_batches_dropped = 0;
  int64_t num_host_kv_pages = 0;         // host KV tier capacity (0: off)
  int64_t num_host_kv_cached = 0;        // pages held there now
  int64_t kv_offloaded_pages_total = 0;  // device -> host copies
  int64_t kv_restored_pages_total = 0;   // host -> device copies (prefix hits)
  bool pd_enabled = false;               // --kv-transfer-config NixlConnector
  PdStats pd;
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t requests_finished_stop = 0;
  int64_t requests_finished_length = 0;
  int64_t requests_finished_abort = 0;
  int64_t requests_finished_error = 0;
  int64_t image_encodes = 0;  // vision tower runs (one per request whose images were computed)
  int64_t prompt_tokens_cached_total = 0;  // prompt tokens served from the prefix cache
  // Latencies (vLLM's bucket bounds, engine/engine.cpp). A request's phases: queued from its
  // arrival to its first scheduling, prefill from there to its first token, decode from the first
  // token to its end; inference is prefill + decode.
  Histogram time_to_first_token_s;
  Histogram inter_token_latency_s;
  Histogram e2e_request_latency_s;
  Histogram request_queue_time_s;
  Histogram request_prefill_time_s;
  Histogram request_decode_time_s;
  Histogram request_inference_time_s;
  Histogram request_time_per_output_token_s;  // decode time / (output tokens - 1), per request
  Histogram prompt_tokens_per_request;
  Histogram generation_tokens_per_request;
  Histogram max_tokens_per_request;               // the request's max_tokens
  Histogram prefill_computed_tokens_per_request;  // prompt tokens computed (not cache hits)
  Histogram iteration_tokens;                     // tokens scheduled per engine step
  SpecDecodeStats spec_decode;                    // enabled only with --speculative-config
  // Async scheduling: steps scheduled and launched while the step before them still ran, and
  // steps that finished with no successor launched behind them (host-sampled rows, a successor
  // that would have had to preempt, or nothing left to run).
  int64_t steps_launched_ahead = 0;
  int64_t steps_not_overlapped = 0;
};

struct ModelInfo {
  std::string model_dir;
  std::string summary;  // one line from M3Config::summary()
  int64_t vocab_size = 0;
  int max_model_len = 0;
  int block_size = 0;
  int64_t num_kv_blocks = 0;
  int64_t kv_tokens = 0;          // num_kv_blocks * block_size
  std::string kv_cache_dtype;     // kernels::kv_dtype_name: "bfloat16", ...
  std::string index_cache_dtype;  // "" when the model has no sparse layers
  int64_t kv_bytes_per_token = 0;
  bool enable_prefix_caching = true;
  std::string device;             // ForwardBackend::device_name(), e.g. "cpu"
  bool async_scheduling = false;  // EngineConfig::async_scheduling as resolved
  std::vector<int32_t> eos_token_ids;
  // The KV event sockets as bound, one per data-parallel rank (empty without --kv-events-config).
  std::vector<std::string> kv_events_endpoints;
  std::vector<std::string> kv_events_replay_endpoints;
  int64_t num_host_kv_pages = 0;  // the host KV tier (0: off)
  // Speculative decoding: SpecDecoder::summary() ("" off) and the drafts per step (0 off).
  std::string speculative;
  int num_speculative_tokens = 0;
  std::string kv_role;       // P/D: "kv_producer" / "kv_consumer" / "kv_both"; "" off
  std::string pd_engine_id;  // P/D: this engine's id in kv_transfer_params
  // Image input (issue #20): image_input says whether requests may carry images; when not,
  // image_refusal says why (no vision tower, --language-model-only, a backend without it).
  bool image_input = false;
  std::string image_refusal;
  int32_t image_token_id = -1;  // the placeholder token the images' embeddings replace
  int32_t video_token_id = -1;  // the placeholder token the videos' embeddings replace
  int64_t vision_patch_size = 14, vision_temporal_patch_size = 2, vision_merge_size = 2;
};

// One image of a request: the processor's patch rows (vision/image_processor.h) and the prompt
// tokens its embeddings replace. The prompt holds num_tokens image_token_id tokens from
// token_offset on; num_tokens == grid_t*grid_h*grid_w / merge^2.
// A video (video = true) is one of these too: its placeholder is ModelInfo::video_token_id and
// its tokens come as grid_t runs of num_tokens / grid_t (one per temporal pair of frames, with
// the timestamp text between them) starting at group_offsets[g] (token_offset ==
// group_offsets[0]). The tower runs a request's images as one call and its videos as another,
// as transformers' get_image_features / get_video_features do.
struct ImageInput {
  int64_t grid_t = 1, grid_h = 0, grid_w = 0;
  std::vector<float> patches;  // [grid_t*grid_h*grid_w, channels*temporal*patch*patch] f32
  int32_t token_offset = 0;
  int32_t num_tokens = 0;
  uint64_t content_hash = 0;  // of the image's bytes: the prefix-cache key of its tokens
  bool video = false;
  std::vector<int32_t> group_offsets;  // video only: grid_t run starts, ascending

  // The prompt spans {first position, tokens} of its placeholder tokens, in order.
  std::vector<std::pair<int32_t, int32_t>> spans() const {
    if (!video || group_offsets.empty()) return {{token_offset, num_tokens}};
    std::vector<std::pair<int32_t, int32_t>> out;
    const int32_t per = num_tokens / static_cast<int32_t>(group_offsets.size());
    for (int32_t o : group_offsets) out.push_back({o, per});
    return out;
  }
};

struct TokenLogprobOut {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
  int64_t rank = 1;  // 1 + the number of tokens ranked above `token` (ties: lower id first)
};

// One increment of a request's output.
struct RequestOutput {
  std::vector<int32_t> new_token_ids;
  std::vector<TokenLogprobOut> logprobs;  // one per new token when SamplingParams::logprobs >= 0
  // First output only, when prompt_logprobs >= 0: entry 0 is empty (token 0 has no context).
  std::optional<std::vector<std::optional<TokenLogprobOut>>> prompt_logprobs;
  bool finished = false;
  std::string finish_reason;             // "stop" | "length" | "abort" | "error"
  std::optional<int32_t> stop_token_id;  // the stop_token_ids entry that ended it
  std::string error;                     // finish_reason == "error"
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_cached_tokens = 0;
  // The final output of a request with do_remote_decode whose pages are held for a decode
  // worker: the kv_transfer_params to send back (vLLM's response field).
  std::optional<KvTransferParams> kv_transfer_params;
};

// Wakes one consumer that reads several RequestStreams (the n choices of one HTTP request): every
// push to a stream made with this waker bumps its sequence number, so the consumer sleeps until
// the engine produced something instead of polling each stream in turn.
class StreamWaker {
 public:
  uint64_t sequence() const;
  // Blocks until the sequence differs from `seen` or `timeout` passes; returns the sequence.
  uint64_t wait(uint64_t seen, std::chrono::milliseconds timeout) const;
  void notify();  // engine side

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t sequence_ = 0;
};

// The consumer end of one request's outputs. Thread-safe; the engine thread produces.
class RequestStream {
 public:
  explicit RequestStream(uint64_t id, std::shared_ptr<StreamWaker> waker = nullptr)
      : id_(id), waker_(std::move(waker)) {}
  uint64_t id() const { return id_; }
  // Blocks up to `timeout` for the next output; nullopt on timeout. After the finished output
  // has been returned, returns nullopt at once.
  std::optional<RequestOutput> next(std::chrono::milliseconds timeout);
  void push(RequestOutput out);  // engine side
  bool done() const;

 private:
  uint64_t id_;
  std::shared_ptr<StreamWaker> waker_;  // may be null
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestOutput> queue_;
  bool finished_pushed_ = false;
  bool finished_taken_ = false;
};

struct GenerateRequest {
  std::vector<int32_t> prompt_token_ids;
  SamplingParams params;
  int priority = 0;                    // lower first, with EngineConfig::priority_scheduling
  std::shared_ptr<StreamWaker> waker;  // optional: notified on every output of this request
  std::vector<ImageInput> images;      // in prompt order (ModelInfo::image_input must be true)
  // vLLM's kv_transfer_params (P/D disaggregation; needs EngineConfig::pd with the matching role).
  std::optional<KvTransferParams> kv_transfer;
};

class EngineImpl;

class Engine {
 public:
  // Loads the model, builds its backend (config.backend_factory, or the CPU one) and starts the
  // engine thread. Errors: bad model, the factory's error, KV pool too small for one sequence of
  // max_model_len tokens (names the backend's flag to change), bad block size.
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& config);
  ~Engine();

  // Validates and queues a request. Errors: empty prompt / ids outside the vocabulary, images
  // the model cannot take or whose placeholders do not match (kInvalidArgument), prompt +
  // max_tokens over max_model_len (kContextLength, with the numbers), queue full (kQueueFull),
  // shutting down (kUnavailable).
  Result<std::shared_ptr<RequestStream>> submit(GenerateRequest request);
  // Aborts a request (no-op when it already finished). Its stream gets a finished "abort" output.
  void abort(uint64_t request_id);
  // Aborts every request queued or running now (the end of a drain that ran out of time).
  void abort_all();

  const ModelInfo& model_info() const;
  EngineStats stats() const;
  bool healthy() const;
  // Stop accepting; with drain, finish running and waiting requests first; then stop the thread.
  void shutdown(bool drain);

 private:
  explicit Engine(std::unique_ptr<EngineImpl> impl);
  std::unique_ptr<EngineImpl> impl_;
};

// The one prompt-length check (the server before it submits, the engine's submit, `m3serve
// generate`): ok when prompt + max_tokens fits max_model_len (max_tokens < 0: not given, then the
// prompt must leave room for one token), else kContextLength with the numbers, naming
// `prompt_param` when the prompt alone is too long and max_tokens otherwise (OpenAI's wording,
// as vLLM answers).
Status check_context_length(int64_t prompt_tokens, int64_t max_tokens, int64_t max_model_len,
                            const std::string& prompt_param);

}  // namespace m3::engine
