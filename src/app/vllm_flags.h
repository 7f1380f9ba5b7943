// vLLM's serving flags and environment on `m3serve serve` and `chat` (issue #14, item 1): every
// flag of the MiniMax-M3 recipe and of vLLM's common serving set that m3serve does not implement
// under its own option is in one table here, each one either a no-op for m3serve (accepted, one
// notice line naming it), refused with the reason and what to use instead, or handled (its value
// is turned into a CompatPlan the command applies). Also: vLLM's argv spellings (`--max_model_len`,
// `--attention_config.indexer_kv_dtype fp8`), `VLLM_*` variables, and hub ids given as the model.
// Called by main.cpp (normalize_vllm_argv), cmd_serve.cpp and cmd_chat.cpp.
// Invariant: a table flag never reaches CLI11's "argument was not expected"; a flag that is
// accepted but changes nothing always prints a notice saying so.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "engine/kv_event_publisher.h"
#include "engine/kv_transfer.h"
#include "engine/spec_decode.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace m3::app {

enum class VllmCommand { kServe, kChat };

// What a table flag is for m3serve.
enum class FlagKind {
  kNoop,     // accepted; a notice says why it changes nothing here
  kRefused,  // refused: not supported, with what to use instead
  kComing,   // refused for now: another open issue brings it; the message says what works today
  kHandled,  // its value is applied (review_vllm_flags fills the CompatPlan)
};

struct VllmFlag {
  std::string_view names;  // CLI11 spelling: "--pipeline-parallel-size,-pp"
  bool takes_value;
  FlagKind kind;
  // Values that make the flag a no-op even when its kind refuses ("1" for the pipeline size,
  // "auto" for the KV dtype): comma-separated, compared case-insensitively.
  std::string_view noop_values;
  std::string_view why;  // the notice (kNoop) or the reason and the alternative (refusals)
  bool serve_only;       // HTTP-server flags are not registered on `chat`
};

// The table (tests walk it).
const std::vector<VllmFlag>& vllm_flag_table();

// The values given for the table flags on one subcommand after parsing.
struct VllmFlagValues {
  std::vector<CLI::Option*> options;  // parallel to vllm_flag_table(); null when not registered
  std::vector<std::string> values;    // last value given (argparse: a repeated flag, last wins)
};

// Registers every table flag valid for `cmd` on `sub`.
void add_vllm_flags(CLI::App* sub, VllmFlagValues& v, VllmCommand cmd);

// What the handled flags and the environment ask the command to do.
struct CompatPlan {
  std::vector<std::string> notices;           // printed once at start-up, "m3serve: note: ..." each
  std::optional<std::string> gemm_precision;  // --dtype on the GPU: "exact" / "bf16"
  // --kv-cache-dtype and --attention-config indexer_kv_dtype: "auto", "bfloat16", "fp8_e4m3"
  // or "float32" (app/device_backend.h resolves auto per device).
  std::optional<std::string> kv_cache_dtype;
  std::optional<std::string> index_kv_dtype;
  // --quantization as given (model/quantization.h; "" when absent), checked at model load.
  std::string quantization;
  // --kv-events-config with enable_kv_cache_events and publisher "zmq" (else unset).
  std::optional<engine::KvEventsConfig> kv_events;
  // --speculative-config (EAGLE-3 drafts), validated; the draft itself loads with the engine.
  std::optional<engine::SpeculativeConfig> speculative;
  // The host KV tier in bytes (--kv-transfer-config offloading, --kv-offloading-size); 0 off.
  int64_t host_kv_cache_bytes = 0;
  // --kv-transfer-config NixlConnector (prefill/decode disaggregation), with VLLM_NIXL_* applied.
  std::optional<engine::PdConfig> pd;
  bool enforce_eager = false;  // --compilation-config cudagraph_mode NONE
  // --compilation-config cudagraph_capture_sizes / max_cudagraph_capture_size, --cuda-graph-sizes:
  // the step sizes that replay CUDA graphs (empty: every size up to 256).
  std::vector<int64_t> cudagraph_capture_sizes;
  // --async-scheduling / --no-async-scheduling (unset: the backend's default).
  std::optional<bool> async_scheduling;
  std::string hf_overrides;               // JSON object text ("" none)
  std::string generation_overrides;       // --override-generation-config JSON ("" none)
  std::optional<uint64_t> seed;           // --seed
  bool allow_long_max_model_len = false;  // VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
  std::optional<std::string> log_level;   // VLLM_LOGGING_LEVEL when --log-level is absent
  // For the server's request log / stats / CORS / root path work (item 5 and the server
  // owners): what the user asked for, kept so nothing is lost when the server grows them.
  bool log_requests = false;                 // --enable-log-requests
  std::optional<int32_t> max_logprobs;       // --max-logprobs (-1 given: a huge limit)
  int stream_interval = 1;                   // --stream-interval: tokens per streamed chunk
  int long_prefill_token_threshold = 0;      // --long-prefill-token-threshold (0: no cap)
  bool log_stats = true;                     // --disable-log-stats: false
  bool access_log = true;                    // --disable-uvicorn-access-log: false
  double stats_interval_s = 10;              // VLLM_LOG_STATS_INTERVAL
  std::vector<std::string> allowed_origins;  // CORS, applied (ServerConfig::allowed_origins)
  bool allow_credentials = false;
  std::string root_path;
  std::string uds;            // --uds: listen on this Unix socket instead of --host / --port
  std::string response_role;  // --response-role ("" : assistant)
  // Image and video input (issue #20), applied to the server's MediaConfig.
  std::optional<int> mm_limit_images;  // --limit-mm-per-prompt '{"image": N}'
  std::optional<int> mm_limit_videos;  // --limit-mm-per-prompt '{"video": M}'
  std::optional<double> mm_cache_gb;   // --mm-processor-cache-gb
  // --mm-processor-kwargs (the MiniMax-M3 processor's own keyword arguments): the image pixel
  // budget and the video sampling; unset: the processor's defaults.
  std::optional<int64_t> mm_min_pixels, mm_max_pixels;
  std::optional<double> mm_video_fps;
  std::optional<int64_t> mm_min_frames, mm_max_frames;
  std::optional<double> video_timeout_s;  // VLLM_VIDEO_FETCH_TIMEOUT: decoding one video part
  std::string allowed_local_media_path;   // --allowed-local-media-path ("" none)
};

// Environment variables as `NAME=value` strings (environ, or a test's list).
using EnvList = std::vector<std::string>;
EnvList process_environment();

// Validates the given table flags and the VLLM_* environment for `cmd` on `device` ("cpu",
// "cuda"). Errors (one line, naming the flag and what to do) for refused flags and bad values.
// `gemm_precision_given`: --gemm-precision was on the command line (a --dtype that disagrees
// with it is refused rather than silently losing one of them).
Result<CompatPlan> review_vllm_flags(const VllmFlagValues& v, VllmCommand cmd,
                                     const std::string& device, bool gemm_precision_given,
                                     const EnvList& env);

// vLLM spellings rewritten to ours before CLI11 sees them: `--foo_bar` -> `--foo-bar`, and the
// dotted config keys `--attention-config.KEY VALUE` (any `--X.Y[.Z] V`, `=` form too) folded into
// one `--X '{"Y": V}'` JSON argument per X (V parsed as JSON when it is JSON, else a string).
std::vector<std::string> normalize_vllm_argv(const std::vector<std::string>& args);

// The model argument when it is not a directory: a hub id (`org/name`) found in the local
// Hugging Face cache resolves to its snapshot directory (`notice` says so); otherwise an error
// that says m3serve does not download and how to pass a local directory. Anything else (a
// directory, a synthetic spec, a path that is not `org/name`) comes back unchanged.
Result<std::string> resolve_model_argument(const std::string& model, const EnvList& env,
                                           std::string* notice);

// `--max-model-len` as vLLM reads it: an integer, or with a k/m/g (x1000) or K/M/G (x1024)
// suffix ("128k", "1M"); -1 and "auto" mean "from the model and KV pool" (0 here).
Result<int64_t> parse_max_model_len(const std::string& text);

}  // namespace m3::app
