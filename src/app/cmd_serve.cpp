// `m3serve serve [MODEL_DIR]`: the OpenAI-compatible server (vLLM's flag names). Loads the model
// into an Engine, the tokenizer / chat template / generation defaults into the server, binds,
// prints one start-up line, and serves until SIGTERM/SIGINT, which drains: new requests get 503,
// running ones finish, then the process exits. A second signal exits at once. vLLM's other
// serving flags and VLLM_* variables go through app/vllm_flags.h: each works, is a no-op with a
// notice, or is refused with the reason before anything is loaded.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "app/commands.h"
#include "app/device_backend.h"
#include "app/model_choice.h"
#include "app/vllm_flags.h"
#include "core/log.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/config_overrides.h"
#include "model/quantization.h"
#include "server/http_server.h"
#include "vision/video_decode.h"

namespace m3::app {

// <repo>/models/demo, found from $M3SERVE_MODELS_DIR or next to / above the executable.
std::string find_demo_model() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("M3SERVE_MODELS_DIR")) {
    fs::path p = fs::path(env) / "demo";
    if (fs::exists(p / "config.json")) return p.string();
  }
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  fs::path dir = exe.parent_path();
  for (int up = 0; up < 5 && !dir.empty(); ++up) {
    fs::path p = dir / "models" / "demo";
    if (fs::exists(p / "config.json")) return p.string();
    dir = dir.parent_path();
  }
  return {};
}

namespace {

struct ServeArgs {
  std::string model_dir;
  std::string model_flag;
  std::string tokenizer;
  std::string host = "0.0.0.0";
  int port = 8000;
  std::vector<std::string> served_model_names;
  std::string max_model_len;  // vLLM's forms: 65536, 128k, 1M, auto
  int max_num_seqs = 64;
  int max_num_batched_tokens = 0;  // 0: 8192 on the GPU (vLLM's default there), 2048 on the CPU
  int block_size = 0;              // 0: the checkpoint's MSA block (sparse_block_size)
  bool enable_prefix_caching = true;
  bool no_enable_prefix_caching = false;
  std::vector<std::string> api_keys;
  std::string tool_call_parser = "minimax_m3";
  std::string reasoning_parser = "minimax_m3";
  bool enable_auto_tool_choice = false;
  std::string chat_template;
  std::string default_chat_template_kwargs;
  std::string generation_config = "auto";
  int max_queue_len = 1024;
  bool language_model_only = false;
  std::string kv_cache_memory_bytes;
  std::string scheduling_policy = "fcfs";
  std::string log_level = "info";
  int http_threads = 0;
  double shutdown_timeout = 20.0;
  int max_connections = 4096;
  int max_connections_per_client = 2048;
  double header_timeout = 10.0;
  double body_timeout = 60.0;
  DeviceArgs device;
  VllmFlagValues vllm;                // the vLLM flags m3serve has no option of its own for
  bool gemm_precision_given = false;  // set after parsing (a --dtype must not contradict it)
  bool log_level_given = false;
};

// Where config.json keeps max_position_embeddings: under text_config in the shipped form.
Result<std::string> max_len_override(const std::string& model_dir, int64_t max_len) {
  std::ifstream in(std::filesystem::path(model_dir) / "config.json");
  const auto root = nlohmann::json::parse(in, nullptr, false);
  nlohmann::json over = {{"max_position_embeddings", max_len}};
  if (!root.is_discarded() && root.contains("text_config") && root["text_config"].is_object())
    over = {{"text_config", over}};
  return over.dump();
}

// True when the JSON override touches rope_scaling / rope_parameters at any depth.
bool touches_rope(const nlohmann::json& j) {
  if (!j.is_object()) return false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "rope_scaling" || it.key() == "rope_parameters" || touches_rope(it.value()))
      return true;
  }
  return false;
}

Result<int64_t> parse_bytes(const std::string& s) {
  if (s.empty()) return int64_t{0};
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (...) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--kv-cache-memory-bytes '" + s + "' is not a size like 4294967296 or 4GiB",
                      "--kv-cache-memory-bytes");
  }
  std::string unit = s.substr(pos);
  double mul = 1;
  if (unit.empty() || unit == "B")
    mul = 1;
  else if (unit == "K" || unit == "KB")
    mul = 1e3;
  else if (unit == "M" || unit == "MB")
    mul = 1e6;
  else if (unit == "G" || unit == "GB")
    mul = 1e9;
  else if (unit == "KiB" || unit == "k")
    mul = 1024.0;
  else if (unit == "MiB" || unit == "m")
    mul = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "g")
    mul = 1024.0 * 1024 * 1024;
  else {
    return make_error(
        ErrorCode::kInvalidArgument,
        "--kv-cache-memory-bytes unit '" + unit + "' is unknown; use B, KiB, MiB, GiB (or K, M, G)",
        "--kv-cache-memory-bytes");
  }
  if (v <= 0)
    return make_error(ErrorCode::kInvalidArgument, "--kv-cache-memory-bytes must be positive",
                      "--kv-cache-memory-bytes");
  return static_cast<int64_t>(v * mul);
}

// Prints an updating "loading" line on a terminal while the model loads.
class LoadProgress {
 public:
  explicit LoadProgress(std::string what) : what_(std::move(what)), tty_(isatty(2) != 0) {
    if (!tty_) {
      std::fprintf(stderr, "m3serve: loading %s ...\n", what_.c_str());
      return;
    }
    thread_ = std::thread([this] {
      const auto t0 = std::chrono::steady_clock::now();
      static const char kSpin[] = "|/-\\";
      int i = 0;
      while (!done_) {
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "\r\033[Km3serve: loading %s %c %.1fs", what_.c_str(), kSpin[i++ % 4],
                     s);
        std::fflush(stderr);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      std::fprintf(stderr, "\r\033[K");
      std::fflush(stderr);
    });
  }
  ~LoadProgress() { stop(); }
  void stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::string what_;
  bool tty_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

int run_serve(ServeArgs a) {
  const EnvList env = process_environment();
  auto plan =
      review_vllm_flags(a.vllm, VllmCommand::kServe, a.device.device, a.gemm_precision_given, env);
  if (!plan) return fail(plan.error().message);
  for (const auto& n : plan->notices) std::fprintf(stderr, "m3serve: note: %s\n", n.c_str());
  if (plan->gemm_precision) a.device.gemm_precision = *plan->gemm_precision;
  if (plan->kv_cache_dtype) a.device.kv_cache_dtype = *plan->kv_cache_dtype;
  if (plan->index_kv_dtype) a.device.index_kv_dtype = *plan->index_kv_dtype;
  if (plan->enforce_eager) a.device.enforce_eager = true;
  a.device.cudagraph_capture_sizes = plan->cudagraph_capture_sizes;
  if (plan->log_level && !a.log_level_given) a.log_level = *plan->log_level;
  auto max_model_len = parse_max_model_len(a.max_model_len.empty() ? "0" : a.max_model_len);
  if (!max_model_len) return fail(max_model_len.error().message);
  if (!a.model_flag.empty()) {
    if (!a.model_dir.empty() && a.model_dir != a.model_flag)
      return fail("give the model directory once (positional or --model)");
    a.model_dir = a.model_flag;
  }
  if (!a.model_dir.empty()) {
    std::string notice;
    auto resolved = resolve_model_argument(a.model_dir, env, &notice);
    if (!resolved) return fail(resolved.error().message);
    if (*resolved != a.model_dir) {
      std::fprintf(stderr, "m3serve: note: %s\n", notice.c_str());
      if (a.served_model_names.empty()) a.served_model_names.push_back(a.model_dir);  // the hub id
      a.model_dir = *resolved;
    }
  }
  if (a.model_dir.empty()) {
    a.model_dir = find_demo_model();
    if (a.model_dir.empty()) {
      return fail(
          "no MODEL_DIR given and no demo model found (looked in $M3SERVE_MODELS_DIR/demo and "
          "models/demo above the executable); run `m3serve serve /path/to/model`");
    }
    if (a.served_model_names.empty()) a.served_model_names.push_back("demo");
  }
  auto choice = resolve_model(a.model_dir, a.tokenizer, a.device.device, find_demo_model());
  if (!choice) return fail(choice.error().message);
  if (!choice->synthetic &&
      !std::filesystem::exists(std::filesystem::path(a.model_dir) / "config.json")) {
    return fail("model directory '" + a.model_dir + "' has no config.json");
  }
  if (auto st = model::set_config_overrides(plan->hf_overrides); !st)
    return fail(st.error().message);
  if (!choice->synthetic) {
    // The checkpoint's own config (with --hf-overrides) gives the block size and the length
    // limit before the weights are read.
    auto cfg = model::load_config(a.model_dir);
    if (!cfg) {
      std::string msg = cfg.error().message;
      if (touches_rope(nlohmann::json::parse(plan->hf_overrides, nullptr, false))) {
        msg +=
            " (set by --hf-overrides: m3serve extends the context with rope_type \"yarn\"; "
            "leave rope_scaling out to serve the native window of max_position_embeddings)";
      }
      return fail(msg);
    }
    if (a.block_size == 0) a.block_size = static_cast<int>(cfg->sparse_block_size);
    if (auto st = model::check_kv_block_size(*cfg, a.block_size); !st)
      return fail(st.error().message);
    const int64_t native = cfg->max_position_embeddings;
    if (*max_model_len > native) {
      if (!plan->allow_long_max_model_len) {
        return fail("--max-model-len " + std::to_string(*max_model_len) +
                    " is above the model's max_position_embeddings (" + std::to_string(native) +
                    "); use --max-model-len " + std::to_string(native) +
                    " or less, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to go past it");
      }
      std::fprintf(stderr,
                   "m3serve: warning: --max-model-len %lld is above the model's "
                   "max_position_embeddings (%lld), allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: "
                   "positions past %lld were not trained and may give wrong output\n",
                   static_cast<long long>(*max_model_len), static_cast<long long>(native),
                   static_cast<long long>(native));
      auto extra = max_len_override(a.model_dir, *max_model_len);
      auto merged = model::merge_config_json(plan->hf_overrides.empty() ? "{}" : plan->hf_overrides,
                                             *extra, "--hf-overrides");
      if (!merged) return fail(merged.error().message);
      if (auto st = model::set_config_overrides(*merged); !st) return fail(st.error().message);
    }
  } else if (a.block_size == 0) {
    a.block_size = 128;  // the synthetic model has M3's geometry
  }
  if (a.log_level == "debug")
    set_log_level(LogLevel::kDebug);
  else if (a.log_level == "info")
    set_log_level(LogLevel::kInfo);
  else if (a.log_level == "warning" || a.log_level == "warn")
    set_log_level(LogLevel::kWarn);
  else if (a.log_level == "error" || a.log_level == "critical")
    set_log_level(LogLevel::kError);
  else if (a.log_level != "trace")
    return fail("--log-level must be debug, info, warning, error or critical");
  if (a.tool_call_parser != "minimax_m3" && a.tool_call_parser != "none") {
    return fail("--tool-call-parser '" + a.tool_call_parser +
                "' is not supported; this server speaks the MiniMax-M3 format: use minimax_m3");
  }
  if (a.reasoning_parser != "minimax_m3" && a.reasoning_parser != "none" &&
      !a.reasoning_parser.empty()) {
    return fail("--reasoning-parser '" + a.reasoning_parser +
                "' is not supported; use minimax_m3 (or none)");
  }
  if (a.scheduling_policy != "fcfs" && a.scheduling_policy != "priority") {
    return fail("--scheduling-policy must be fcfs or priority");
  }
  if (a.max_num_seqs < 1) return fail("--max-num-seqs must be at least 1");
  if (a.max_queue_len < 1) return fail("--max-queue-len must be at least 1");
  if (a.port < 0 || a.port > 65535) return fail("--port must be in 0..65535");
  auto kv_bytes = parse_bytes(a.kv_cache_memory_bytes);
  if (!kv_bytes) return fail(kv_bytes.error().message);
  if (!model::is_synthetic_model(a.model_dir)) {
    // --quantization against the checkpoint's declaration, before anything is loaded.
    auto q =
        model::resolve_quantization(plan->quantization, model::read_checkpoint_quant(a.model_dir));
    if (!q) return fail(q.error().message);
  }
  auto backend_factory =  // probes the GPU for cuda
      make_backend_factory(a.device, *kv_bytes, *max_model_len, choice->spec.seed,
                           a.max_num_batched_tokens > 0 ? a.max_num_batched_tokens : 8192,
                           plan->speculative ? plan->speculative->model : std::string());
  if (!backend_factory) return fail(backend_factory.error().message);
  auto kv_format = resolve_kv_format(a.device);
  if (!kv_format) return fail(kv_format.error().message);
  if (a.device.parallel.headless) {
    // A node R > 0 of a group over processes: no API server, tokenizer or engine; its ranks run
    // the steps node 0 sends (app/device_backend.h run_headless_node).
    signal(SIGPIPE, SIG_IGN);
    engine::EngineConfig hc;
    hc.model_dir = a.model_dir;
    hc.language_model_only = a.language_model_only;
    hc.quantization = plan->quantization;
    hc.kv_cache_dtype = kv_format->kv;
    hc.index_cache_dtype = kv_format->index;
    const auto& p = a.device.parallel;
    std::fprintf(stderr,
                 "m3serve %s: node %d of %d (--headless): ranks %d-%d of --tensor-parallel-size "
                 "%d; joining node 0 at %s:%d\n",
                 M3_VERSION, p.node_rank, p.nnodes, p.node_rank * p.tensor_parallel_size / p.nnodes,
                 (p.node_rank + 1) * p.tensor_parallel_size / p.nnodes - 1, p.tensor_parallel_size,
                 p.master_addr.c_str(), p.master_port);
    auto st = run_headless_node(a.device, hc, *kv_bytes, *max_model_len, choice->spec.seed);
    if (!st) return fail(st.error().message);
    std::fprintf(stderr, "m3serve: node %d: node 0 shut down; exiting\n", p.node_rank);
    return 0;
  }
  server::OrderedJson default_kwargs = server::OrderedJson::object();
  if (!a.default_chat_template_kwargs.empty()) {
    default_kwargs = server::OrderedJson::parse(a.default_chat_template_kwargs, nullptr, false);
    if (default_kwargs.is_discarded() || !default_kwargs.is_object()) {
      return fail(
          "--default-chat-template-kwargs must be a JSON object, e.g. '{\"thinking_mode\": "
          "\"disabled\"}'");
    }
  }
  // vLLM takes several keys (--api-key K1 K2): a request with any one of them is admitted.
  std::sort(a.api_keys.begin(), a.api_keys.end());
  a.api_keys.erase(std::unique(a.api_keys.begin(), a.api_keys.end()), a.api_keys.end());
  a.api_keys.erase(std::remove(a.api_keys.begin(), a.api_keys.end(), std::string()),
                   a.api_keys.end());
  if (a.api_keys.empty()) {
    if (const char* k = std::getenv("M3SERVE_API_KEY"); k && *k)
      a.api_keys.push_back(k);
    else if (const char* k2 = std::getenv("VLLM_API_KEY"); k2 && *k2)
      a.api_keys.push_back(k2);
  }
  if (a.served_model_names.empty()) a.served_model_names.push_back(a.model_dir);

  // Signals are taken by one thread (sigwait); every thread started below inherits the mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that went away must not kill the server

  auto assets = server::load_server_assets(choice->tokenizer_dir, a.chat_template, default_kwargs,
                                           a.generation_config);
  if (!assets) return fail(assets.error().message);
  if (!plan->generation_overrides.empty()) {
    // vLLM's --override-generation-config: its keys over generation_config.json's.
    auto over = server::GenerationDefaults::from_json_text(plan->generation_overrides,
                                                           "--override-generation-config");
    if (!over) return fail(over.error().message);
    auto& d = assets->defaults;
    if (over->temperature) d.temperature = over->temperature;
    if (over->top_p) d.top_p = over->top_p;
    if (over->top_k) d.top_k = over->top_k;
    if (over->min_p) d.min_p = over->min_p;
    if (over->repetition_penalty) d.repetition_penalty = over->repetition_penalty;
    if (over->presence_penalty) d.presence_penalty = over->presence_penalty;
    if (over->frequency_penalty) d.frequency_penalty = over->frequency_penalty;
    if (over->max_new_tokens) d.max_new_tokens = over->max_new_tokens;
    std::string unknown;
    static const std::vector<std::string> kKnown = {"temperature",
                                                    "top_p",
                                                    "top_k",
                                                    "min_p",
                                                    "repetition_penalty",
                                                    "presence_penalty",
                                                    "frequency_penalty",
                                                    "max_new_tokens"};
    const auto over_json = nlohmann::json::parse(plan->generation_overrides);
    for (auto it = over_json.begin(); it != over_json.end(); ++it) {
      if (std::find(kKnown.begin(), kKnown.end(), it.key()) == kKnown.end())
        unknown += (unknown.empty() ? "" : ", ") + it.key();
    }
    if (!unknown.empty()) {
      std::fprintf(stderr,
                   "m3serve: note: --override-generation-config keys %s are ignored (m3serve "
                   "reads temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, "
                   "frequency_penalty, max_new_tokens)\n",
                   unknown.c_str());
    }
  }

  engine::EngineConfig ec;
  ec.async_scheduling = plan->async_scheduling;
  ec.long_prefill_token_threshold = plan->long_prefill_token_threshold;
  ec.model_dir = a.model_dir;  // a synthetic spec loads config-only (M3Model::load)
  ec.max_num_seqs = a.max_num_seqs;
  // The step budget: vLLM's default on a large GPU (8192) where steps are fast; smaller on the
  // CPU, whose long prefill steps would stall every decoding stream for seconds.
  ec.max_num_batched_tokens = a.max_num_batched_tokens > 0 ? a.max_num_batched_tokens
                              : a.device.device == "cuda"  ? 8192
                                                           : 2048;
  ec.max_model_len = static_cast<int>(*max_model_len);
  ec.block_size = a.block_size;
  ec.kv_cache_memory_bytes = *kv_bytes;
  ec.enable_prefix_caching = a.enable_prefix_caching && !a.no_enable_prefix_caching;
  ec.priority_scheduling = a.scheduling_policy == "priority";
  ec.max_queue_len = a.max_queue_len;
  ec.num_sampleable_tokens = assets->tokenizer->vocab_size();  // never sample padding rows
  ec.backend_factory = std::move(*backend_factory);
  ec.language_model_only = a.language_model_only;
  ec.quantization = plan->quantization;
  ec.kv_cache_dtype = kv_format->kv;
  ec.index_cache_dtype = kv_format->index;
  if (plan->kv_events) ec.kv_events = *plan->kv_events;
  if (plan->speculative) ec.speculative = *plan->speculative;
  ec.host_kv_cache_bytes = plan->host_kv_cache_bytes;
  ec.pd = plan->pd;
  std::unique_ptr<engine::Engine> eng;
  {
    LoadProgress progress(a.model_dir);
    auto e = engine::Engine::create(ec);
    progress.stop();
    if (!e) return fail(e.error().message);
    eng = std::move(*e);
  }

  server::ServerConfig sc;
  sc.host = a.host;
  sc.uds = plan->uds;
  if (!plan->response_role.empty()) sc.response_role = plan->response_role;
  sc.port = a.port;
  sc.served_model_names = a.served_model_names;
  sc.api_keys = a.api_keys;
  sc.allowed_origins = plan->allowed_origins;
  if (plan->mm_limit_images) sc.media.max_images_per_prompt = *plan->mm_limit_images;
  if (plan->mm_limit_videos) sc.media.max_videos_per_prompt = *plan->mm_limit_videos;
  if (plan->mm_min_pixels) sc.media.image.min_pixels = *plan->mm_min_pixels;
  if (plan->mm_max_pixels) sc.media.image.max_pixels = *plan->mm_max_pixels;
  if (plan->mm_video_fps) sc.media.video.fps = *plan->mm_video_fps;
  if (plan->mm_min_frames) sc.media.video.min_frames = *plan->mm_min_frames;
  if (plan->mm_max_frames) sc.media.video.max_frames = *plan->mm_max_frames;
  if (plan->video_timeout_s) sc.media.video_timeout_s = *plan->video_timeout_s;
  if (!vision::video_decoding_available()) {
    std::fprintf(stderr,
                 "m3serve: note: this build has no video decoding (built without libavformat/"
                 "libavcodec/libswscale); video_url parts get a 400\n");
  }
  if (plan->mm_cache_gb)
    sc.media.processor_cache_bytes = static_cast<int64_t>(*plan->mm_cache_gb * (1 << 30));
  sc.media.allowed_local_media_path = plan->allowed_local_media_path;
  sc.access_log = plan->access_log;
  sc.stats_interval_s = plan->log_stats ? plan->stats_interval_s : 0.0;
  sc.seed = plan->seed;
  sc.log_requests = plan->log_requests;
  if (plan->max_logprobs) sc.max_logprobs = *plan->max_logprobs;
  sc.stream_interval = plan->stream_interval;
  sc.allow_credentials = plan->allow_credentials;
  sc.parse_reasoning = a.reasoning_parser == "minimax_m3";
  sc.parse_tool_calls = a.tool_call_parser == "minimax_m3";
  // Auto tool choice is on by default (the only parser is M3's); the vLLM flag is accepted.
  sc.enable_auto_tool_choice = true;
  sc.version = M3_VERSION;
  sc.num_http_threads = a.http_threads;
  sc.max_num_seqs = a.max_num_seqs;
  sc.shutdown_timeout_s = a.shutdown_timeout;
  sc.max_connections = a.max_connections;
  sc.max_connections_per_client = a.max_connections_per_client;
  sc.header_timeout_s = a.header_timeout;
  sc.body_timeout_s = a.body_timeout;
  auto http = std::make_unique<server::HttpServer>(*eng, std::move(*assets), sc);
  if (auto st = http->bind(); !st) {
    eng->shutdown(false);
    return fail(st.error().message);
  }
  const auto& info = eng->model_info();
  const std::string listening = !sc.uds.empty()
                                    ? "unix:" + sc.uds
                                    : "http://" + a.host + ":" + std::to_string(http->bound_port());
  std::printf(
      "m3serve %s: serving %s as '%s' (%s) on %s | KV cache: %lld tokens (%lld pages of %d, "
      "%s%s%s, %lld B/token) | max-model-len %d | prefix caching %s%s%s | listening on %s\n",
      M3_VERSION, a.model_dir.c_str(), a.served_model_names[0].c_str(), info.summary.c_str(),
      info.device.c_str(), static_cast<long long>(info.kv_tokens),
      static_cast<long long>(info.num_kv_blocks), info.block_size, info.kv_cache_dtype.c_str(),
      info.index_cache_dtype.empty() ? "" : ", index-K ", info.index_cache_dtype.c_str(),
      static_cast<long long>(info.kv_bytes_per_token), info.max_model_len,
      ec.enable_prefix_caching ? "on" : "off",
      info.speculative.empty() ? "" : " | speculative decoding: ", info.speculative.c_str(),
      listening.c_str());
  std::fflush(stdout);
  if (info.num_host_kv_pages > 0) {
    std::fprintf(stderr, "m3serve: host KV tier: %lld pages (%lld tokens) in host memory\n",
                 static_cast<long long>(info.num_host_kv_pages),
                 static_cast<long long>(info.num_host_kv_pages * info.block_size));
  }
  for (size_t r = 0; r < info.kv_events_endpoints.size(); ++r) {
    // stderr: the first stdout line stays the one start-up line scripts read.
    std::fprintf(stderr, "m3serve: KV events (data-parallel rank %zu) on %s%s%s\n", r,
                 info.kv_events_endpoints[r].c_str(),
                 r < info.kv_events_replay_endpoints.size() ? ", replay on " : "",
                 r < info.kv_events_replay_endpoints.size()
                     ? info.kv_events_replay_endpoints[r].c_str()
                     : "");
  }

  std::thread signals([&http, sigs] {
    int sig = 0;
    sigwait(&sigs, &sig);
    std::fprintf(
        stderr,
        "m3serve: %s received: draining (new requests get 503; send it again to exit now)\n",
        sig == SIGTERM ? "SIGTERM" : "SIGINT");
    std::thread second([sigs] {
      int s2 = 0;
      sigwait(&sigs, &s2);
      std::fprintf(stderr, "m3serve: second signal: exiting now\n");
      std::_Exit(130);
    });
    second.detach();
    http->drain_and_stop();
  });
  auto st = http->run();
  if (!http->draining()) {
    // The listener failed on its own: wake the signal thread so it can be joined.
    kill(getpid(), SIGTERM);
  }
  signals.join();
  eng->shutdown(/*drain=*/true);
  if (!st) return fail(st.error().message);
  std::fprintf(stderr, "m3serve: drained, exiting\n");
  return 0;
}

}  // namespace

RunFn register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* sub = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  sub->add_option("model_dir", a->model_dir, "Model directory (default: the embedded demo model)");
  sub->add_option(
      "--model", a->model_flag,
      "Model directory (same as the positional argument), or synthetic:layers=N[,seed=S] "
      "[,vision=1] (M3's shapes, weights generated on the GPU; vision=1 adds a tower of M3's "
      "vision shapes; needs --device cuda)");
  sub->add_option("--tokenizer", a->tokenizer,
                  "Directory with tokenizer.json, chat template and generation_config.json "
                  "(default: the model's; for a synthetic model, the demo model's)");
  sub->add_option("--host", a->host, "Address to listen on")->capture_default_str();
  sub->add_option("--port", a->port, "TCP port (0: pick a free one)")->capture_default_str();
  sub->add_option("--served-model-name", a->served_model_names,
                  "Model name(s) clients use (default: MODEL_DIR)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--max-model-len", a->max_model_len,
                  "Max tokens per sequence (prompt + output): 65536, 128k (x1000), 1M (x1024); "
                  "auto/-1/0: from the model and KV pool. Past max_position_embeddings only with "
                  "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1");
  sub->add_option("--max-num-seqs", a->max_num_seqs, "Max sequences per engine step")
      ->capture_default_str();
  sub->add_option("--max-num-batched-tokens", a->max_num_batched_tokens,
                  "Token budget per engine step: prompts prefill in chunks of at most this many "
                  "tokens beside the decoding streams (default 8192 with --device cuda, 2048 on "
                  "the CPU)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--block-size", a->block_size,
                  "KV page size in tokens: must be the checkpoint's MSA block (sparse_block_size, "
                  "128 for MiniMax-M3), which is the default");
  sub->add_flag("--enable-prefix-caching", a->enable_prefix_caching,
                "Reuse KV pages of shared prompt prefixes (default)");
  sub->add_flag("--no-enable-prefix-caching", a->no_enable_prefix_caching,
                "Turn prefix caching off");
  sub->add_option(
         "--api-key", a->api_keys,
         "Require 'Authorization: Bearer KEY' on /v1 (also $M3SERVE_API_KEY, $VLLM_API_KEY)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--tool-call-parser", a->tool_call_parser, "minimax_m3 (default) or none")
      ->capture_default_str();
  sub->add_option("--reasoning-parser", a->reasoning_parser, "minimax_m3 (default) or none")
      ->capture_default_str();
  sub->add_flag("--enable-auto-tool-choice", a->enable_auto_tool_choice,
                "Accepted for vLLM compatibility (always on)");
  sub->add_option("--chat-template", a->chat_template,
                  "Jinja chat template file (default: the model's)");
  sub->add_option("--default-chat-template-kwargs", a->default_chat_template_kwargs,
                  "JSON object of chat template kwargs applied to every request, e.g. "
                  "'{\"thinking_mode\":\"disabled\"}'");
  sub->add_option("--generation-config", a->generation_config,
                  "Sampling defaults: auto (the model's generation_config.json), vllm (none), or a "
                  "directory")
      ->capture_default_str();
  sub->add_option("--max-queue-len,--max-num-queued-reqs", a->max_queue_len,
                  "Waiting requests beyond this get HTTP 429")
      ->capture_default_str();
  sub->add_flag("--language-model-only", a->language_model_only,
                "Skip loading the vision tower; requests with images get a 400");
  sub->add_option("--kv-cache-memory-bytes", a->kv_cache_memory_bytes,
                  "KV cache size (bytes, or with KiB/MiB/GiB)");
  sub->add_option("--scheduling-policy", a->scheduling_policy, "fcfs or priority")
      ->capture_default_str();
  CLI::Option* log_level = sub->add_option("--log-level,--uvicorn-log-level", a->log_level,
                                           "debug, info, warning, error")
                               ->capture_default_str();
  sub->add_option("--http-threads", a->http_threads,
                  "HTTP worker threads (0: from --max-num-seqs)");
  sub->add_option("--shutdown-timeout", a->shutdown_timeout,
                  "Seconds a drain (SIGTERM) waits for running requests before aborting them")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  sub->add_option("--max-connections", a->max_connections, "Open HTTP connections in all")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("--max-connections-per-client", a->max_connections_per_client,
                  "Open HTTP connections from one client address")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("--request-header-timeout", a->header_timeout,
                  "Seconds a client has to send a request's headers")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  sub->add_option("--request-body-timeout", a->body_timeout,
                  "Seconds a client has to send a request's body after its headers")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  add_device_options(sub, a->device);
  sub->add_flag("--headless", a->device.parallel.headless,
                "A node R > 0 of --nnodes: no API server; runs its ranks of each step node 0 "
                "sends (node 0 at --master-addr:--master-port), until node 0 shuts down");
  a->device.serve_command = true;
  add_vllm_flags(sub, a->vllm, VllmCommand::kServe);
  return [a, sub, log_level] {
    a->gemm_precision_given = sub->get_option("--gemm-precision")->count() > 0;
    a->log_level_given = log_level->count() > 0;
    return run_serve(*a);
  };
}

}  // namespace m3::app
