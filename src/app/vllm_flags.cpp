#include "app/vllm_flags.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>

#include "model/quantization.h"
#include "vision/image_processor.h"
#include "vision/video_processor.h"

extern char** environ;

namespace m3::app {
namespace {

using json = nlohmann::ordered_json;
constexpr bool kServeOnly = true;
constexpr bool kBoth = false;

// Shared reasons, so the same feature is described the same way under every flag.
constexpr std::string_view kWhyMediaIo =
    "m3serve's decoders (libjpeg, libpng, libwebp, libav) take no options; video frame sampling "
    "is set with --mm-processor-kwargs '{\"fps\": 2, \"min_frames\": 4, \"max_frames\": 64}' "
    "and the image pixel budget with '{\"max_pixels\": N}': drop the flag";
constexpr std::string_view kWhySpec =
    "vLLM removed this flag; give the draft in --speculative-config, e.g. '{\"method\": "
    "\"eagle3\", \"model\": \"DIR\", \"num_speculative_tokens\": 3}'";
constexpr std::string_view kWhyMultiNode =
    "data parallel over several nodes is coming (issue #22); today split the model over nodes "
    "with --tensor-parallel-size N --nnodes M --node-rank R --master-addr A --master-port P "
    "(--headless on nodes R > 0), or run --data-parallel-size on one node (docs/MULTI_NODE.md)";
constexpr std::string_view kWhyKernels =
    "m3serve runs its own attention, MSA and MoE kernels (plain C++ on the CPU, sm_90a CUDA on "
    "the GPU); there is no backend to choose";
constexpr std::string_view kWhyGraphs =
    "m3serve captures a CUDA graph per step size by itself (every size up to 256 tokens; "
    "--compilation-config '{\"cudagraph_capture_sizes\": [...]}' limits them to a list); "
    "--enforce-eager turns them off";
constexpr std::string_view kWhyNoLog =
    "m3serve logs one access line per request (--disable-uvicorn-access-log turns it off) and, "
    "with --enable-log-requests, each request's parameters and prompt length; never the "
    "requests' prompts or outputs";
constexpr std::string_view kWhyHub =
    "m3serve does not download from the Hugging Face Hub: download the checkpoint first "
    "(huggingface-cli download REPO --revision REV --local-dir DIR) and pass DIR";

// clang-format off
const std::vector<VllmFlag> kTable = {
  // ---- model and loading ----
  {"--trust-remote-code", false, FlagKind::kNoop, "",
   "m3serve runs no Python code from checkpoints (MiniMax-M3 is built in)", kBoth},
  {"--no-trust-remote-code", false, FlagKind::kNoop, "",
   "m3serve runs no Python code from checkpoints", kBoth},
  {"--dtype", true, FlagKind::kHandled, "", "", kBoth},
  {"--seed", true, FlagKind::kHandled, "", "", kBoth},
  {"--hf-overrides", true, FlagKind::kHandled, "", "", kBoth},
  {"--hf-config-path", true, FlagKind::kRefused, "",
   "the config is read from MODEL_DIR/config.json; adjust it with --hf-overrides", kBoth},
  {"--load-format", true, FlagKind::kRefused, "auto,safetensors",
   "m3serve reads safetensors checkpoints only: use --load-format auto", kBoth},
  {"--config-format", true, FlagKind::kRefused, "auto,hf",
   "m3serve reads the Hugging Face config.json: use --config-format auto", kBoth},
  {"--tokenizer-mode", true, FlagKind::kRefused, "auto,hf,slow",
   "m3serve has one tokenizer implementation (tokenizer.json): use --tokenizer-mode auto", kBoth},
  {"--skip-tokenizer-init", false, FlagKind::kRefused, "",
   "m3serve needs the tokenizer to render chat templates and parse outputs", kBoth},
  {"--revision", true, FlagKind::kRefused, "", kWhyHub, kBoth},
  {"--code-revision", true, FlagKind::kRefused, "", kWhyHub, kBoth},
  {"--tokenizer-revision", true, FlagKind::kRefused, "", kWhyHub, kBoth},
  {"--download-dir", true, FlagKind::kNoop, "",
   "m3serve does not download; it reads the model directory you pass", kBoth},
  {"--max-parallel-loading-workers", true, FlagKind::kNoop, "",
   "the checkpoint is memory-mapped, not loaded by workers", kBoth},
  {"--model-loader-extra-config", true, FlagKind::kNoop, "",
   "the safetensors reader has no extra options", kBoth},
  {"--ignore-patterns", true, FlagKind::kNoop, "",
   "only the tensors the model needs are read", kBoth},
  {"--use-tqdm-on-load", false, FlagKind::kNoop, "",
   "a loading line is printed on a terminal anyway", kBoth},
  {"--safetensors-load-strategy", true, FlagKind::kNoop, "",
   "the checkpoint is memory-mapped", kBoth},
  {"--model-impl", true, FlagKind::kNoop, "",
   "m3serve has one implementation of MiniMax-M3", kBoth},
  {"--runner", true, FlagKind::kRefused, "auto,generate",
   "MiniMax-M3 is served for generation only: use --runner generate", kBoth},
  {"--convert", true, FlagKind::kRefused, "auto,none",
   "MiniMax-M3 is served for generation only (no pooling or embedding conversion)", kBoth},
  {"--task", true, FlagKind::kRefused, "auto,generate",
   "MiniMax-M3 is served for generation only: use --task generate", kBoth},
  {"--rope-scaling", true, FlagKind::kRefused, "",
   "pass it through the config: --hf-overrides '{\"text_config\": {\"rope_scaling\": {...}}}'",
   kBoth},
  {"--rope-theta", true, FlagKind::kRefused, "",
   "pass it through the config: --hf-overrides '{\"text_config\": {\"rope_theta\": ...}}'", kBoth},
  {"--enable-sleep-mode", false, FlagKind::kRefused, "",
   "sleep mode (weights offloaded while idle) is not supported; stop and restart the server",
   kBoth},
  {"--cpu-offload-gb", true, FlagKind::kRefused, "0",
   "weight offload to host memory is not supported; spread the weights over more GPUs with "
   "--tensor-parallel-size or --data-parallel-size --enable-expert-parallel", kBoth},
  {"--enable-lora", false, FlagKind::kRefused, "",
   "LoRA adapters are not supported; serve a merged checkpoint", kBoth},
  {"--lora-modules", true, FlagKind::kRefused, "",
   "LoRA adapters are not supported; serve a merged checkpoint", kServeOnly},
  {"--max-loras", true, FlagKind::kRefused, "", "LoRA adapters are not supported", kBoth},
  {"--max-lora-rank", true, FlagKind::kRefused, "", "LoRA adapters are not supported", kBoth},
  {"--worker-cls", true, FlagKind::kRefused, "auto",
   "m3serve has no Python workers to replace", kBoth},
  {"--worker-extension-cls", true, FlagKind::kRefused, "",
   "m3serve has no Python workers to extend", kBoth},

  // ---- scheduling and execution ----
  {"--enable-chunked-prefill", false, FlagKind::kNoop, "",
   "prefill is always chunked, by --max-num-batched-tokens", kBoth},
  {"--no-enable-chunked-prefill", false, FlagKind::kNoop, "",
   "prefill is always chunked (the scheduler's one invariant); raise --max-num-batched-tokens "
   "for bigger prefill steps", kBoth},
  {"--async-scheduling", false, FlagKind::kHandled, "", "", kBoth},
  {"--no-async-scheduling", false, FlagKind::kHandled, "", "", kBoth},
  {"--max-num-partial-prefills", true, FlagKind::kNoop, "",
   "prefills share the step budget --max-num-batched-tokens", kBoth},
  {"--max-long-partial-prefills", true, FlagKind::kNoop, "",
   "prefills share the step budget --max-num-batched-tokens", kBoth},
  {"--long-prefill-token-threshold", true, FlagKind::kHandled, "", "", kBoth},
  {"--stream-interval", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--num-gpu-blocks-override", true, FlagKind::kRefused, "",
   "size the KV cache with --kv-cache-memory-bytes (or --gpu-memory-utilization)", kBoth},
  {"--swap-space", true, FlagKind::kNoop, "",
   "preempted requests are recomputed; nothing is swapped to host memory", kBoth},
  {"--prefix-caching-hash-algo", true, FlagKind::kNoop, "",
   "prefix-cache pages are keyed by m3serve's own chained hash", kBoth},
  {"--disable-hybrid-kv-cache-manager", false, FlagKind::kNoop, "",
   "K, V and index-K pages already move as one unit", kBoth},
  {"--kv-sharing-fast-prefill", false, FlagKind::kNoop, "",
   "MiniMax-M3 has no KV-sharing layers", kBoth},
  {"--max-num-queued-tokens", true, FlagKind::kNoop, "",
   "the queue is bounded in requests by --max-queue-len (--max-num-queued-reqs)", kServeOnly},

  // ---- kernels, graphs and backends ----
  {"--compilation-config,-O", true, FlagKind::kHandled, "", "", kBoth},
  {"--attention-config", true, FlagKind::kHandled, "", "", kBoth},
  {"--attention-backend", true, FlagKind::kNoop, "", kWhyKernels, kBoth},
  {"--linear-backend", true, FlagKind::kNoop, "",
   "GEMMs run m3serve's own kernels; --dtype (or --gemm-precision) picks their precision", kBoth},
  {"--moe-backend", true, FlagKind::kNoop, "", kWhyKernels, kBoth},
  {"--no-enable-flashinfer-autotune", false, FlagKind::kNoop, "",
   "m3serve does not use FlashInfer", kBoth},
  {"--disable-flashinfer-autotune", false, FlagKind::kNoop, "",
   "m3serve does not use FlashInfer", kBoth},
  {"--enable-flashinfer-autotune", false, FlagKind::kNoop, "",
   "m3serve does not use FlashInfer", kBoth},
  {"--max-seq-len-to-capture", true, FlagKind::kNoop, "", kWhyGraphs, kBoth},
  {"--cuda-graph-sizes", true, FlagKind::kHandled, "", "", kBoth},
  {"--max-cudagraph-capture-size", true, FlagKind::kNoop, "", kWhyGraphs, kBoth},
  {"--disable-custom-all-reduce", false, FlagKind::kNoop, "",
   "collectives are NCCL's on GPUs and in-process on the CPU", kBoth},
  {"--enable-dbo", false, FlagKind::kNoop, "",
   "m3serve does not split batches into overlapped micro-batches", kBoth},
  {"--logprobs-mode", true, FlagKind::kRefused, "raw_logprobs",
   "logprobs are always the raw model's (before sampling knobs): use --logprobs-mode "
   "raw_logprobs", kBoth},

  // ---- precision, quantization, KV dtype (other issues) ----
  {"--kv-cache-dtype", true, FlagKind::kHandled, "", "", kBoth},
  {"--calculate-kv-scales", false, FlagKind::kNoop, "",
   "fp8 K/V scales are the checkpoint's (self_attn.k_scale / v_scale) or 1.0, as vLLM's "
   "default; m3serve does not measure them from the first batches", kBoth},
  {"--quantization,-q", true, FlagKind::kHandled, "", "", kBoth},

  // ---- speculative decoding ----
  {"--speculative-config", true, FlagKind::kHandled, "", "", kBoth},
  {"--num-speculative-tokens", true, FlagKind::kRefused, "", kWhySpec, kBoth},
  {"--speculative-model", true, FlagKind::kRefused, "", kWhySpec, kBoth},

  // ---- multimodal ----
  {"--mm-encoder-tp-mode", true, FlagKind::kHandled, "", "", kBoth},
  {"--mm-encoder-attn-backend", true, FlagKind::kNoop, "",
   "the vision tower runs m3serve's own attention kernel (no attention backends to pick)", kBoth},
  {"--mm-processor-cache-type", true, FlagKind::kHandled, "", "", kBoth},
  {"--mm-processor-cache-gb", true, FlagKind::kHandled, "", "", kBoth},
  {"--mm-processor-kwargs", true, FlagKind::kHandled, "", "", kBoth},
  {"--limit-mm-per-prompt", true, FlagKind::kHandled, "", "", kBoth},
  {"--media-io-kwargs", true, FlagKind::kRefused, "", kWhyMediaIo, kBoth},
  {"--allowed-local-media-path", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--allowed-media-domains", true, FlagKind::kNoop, "",
   "m3serve fetches no remote media: http(s) image URLs get a 400; send data: URLs",
   kServeOnly},

  // ---- KV offload / transfer / events ----
  {"--kv-transfer-config", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--kv-events-config", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--kv-offloading-backend", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--kv-offloading-size", true, FlagKind::kHandled, "", "", kServeOnly},

  // ---- parallelism beyond one process ----
  {"--pipeline-parallel-size", true, FlagKind::kComing, "1",
   "pipeline parallelism is coming with multi-node serving (issue #22); today split the model "
   "with --tensor-parallel-size, or --data-parallel-size with --enable-expert-parallel", kBoth},
  {"--data-parallel-address", true, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-rpc-port", true, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-size-local", true, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-start-rank", true, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-hybrid-lb", false, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-external-lb", false, FlagKind::kComing, "", kWhyMultiNode, kBoth},
  {"--data-parallel-backend", true, FlagKind::kRefused, "mp",
   "data-parallel ranks are threads of this process (one GPU each over NCCL): use "
   "--data-parallel-backend mp", kBoth},
  {"--distributed-executor-backend", true, FlagKind::kRefused, "mp,uni",
   "ranks are threads of this one process: use --distributed-executor-backend mp (or leave it "
   "out)", kBoth},
  {"--enable-eplb", false, FlagKind::kNoop, "",
   "experts are placed statically (E / ranks each); there is no expert load balancer", kBoth},
  {"--eplb-config", true, FlagKind::kNoop, "",
   "experts are placed statically; there is no expert load balancer", kBoth},
  {"--num-redundant-experts", true, FlagKind::kNoop, "",
   "experts are placed statically, without replicas", kBoth},
  {"--expert-placement-strategy", true, FlagKind::kNoop, "",
   "experts are placed in contiguous ranges (E / ranks each)", kBoth},
  {"--all2all-backend", true, FlagKind::kNoop, "",
   "the MoE exchange is m3serve's own all-gather / reduce-scatter", kBoth},

  // ---- the HTTP server ----
  {"--max-logprobs", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--disable-log-requests", false, FlagKind::kHandled, "", "", kServeOnly},
  {"--enable-log-requests", false, FlagKind::kHandled, "", "", kServeOnly},
  {"--disable-log-stats", false, FlagKind::kHandled, "", "", kServeOnly},
  {"--enable-log-outputs", false, FlagKind::kNoop, "", kWhyNoLog, kServeOnly},
  {"--max-log-len", true, FlagKind::kNoop, "", kWhyNoLog, kServeOnly},
  {"--disable-uvicorn-access-log", false, FlagKind::kHandled, "", "", kServeOnly},
  {"--disable-access-log-for-endpoints", true, FlagKind::kNoop, "", kWhyNoLog, kServeOnly},
  {"--log-config-file", true, FlagKind::kNoop, "",
   "m3serve logs to stderr; --log-level sets how much", kServeOnly},
  {"--aggregate-engine-logging", false, FlagKind::kNoop, "",
   "there is one engine loop", kServeOnly},
  {"--show-hidden-metrics-for-version", true, FlagKind::kNoop, "",
   "/metrics has no hidden series", kServeOnly},
  {"--override-generation-config", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--allowed-origins", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--allowed-methods", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--allowed-headers", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--allow-credentials", false, FlagKind::kHandled, "", "", kServeOnly},
  {"--root-path", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--enable-prompt-tokens-details", false, FlagKind::kNoop, "",
   "usage.prompt_tokens_details.cached_tokens is always reported", kServeOnly},
  {"--exclude-tools-when-tool-choice-none", false, FlagKind::kNoop, "",
   "tools are always left out of the prompt when tool_choice is \"none\"", kServeOnly},
  {"--enable-force-include-usage", false, FlagKind::kNoop, "",
   "not applied yet: usage is sent in streams when stream_options.include_usage is set",
   kServeOnly},
  {"--enable-request-id-headers", false, FlagKind::kNoop, "",
   "not applied yet: responses carry no X-Request-Id header", kServeOnly},
  {"--enable-server-load-tracking", false, FlagKind::kNoop, "",
   "/load is always served", kServeOnly},
  {"--enable-reasoning", false, FlagKind::kNoop, "",
   "reasoning is split whenever --reasoning-parser is minimax_m3 (the default)", kServeOnly},
  {"--structured-outputs-config", true, FlagKind::kNoop, "",
   "m3serve has one structured-output engine; there is no backend to choose", kServeOnly},
  {"--guided-decoding-backend", true, FlagKind::kNoop, "",
   "m3serve has one structured-output engine; there is no backend to choose", kServeOnly},
  {"--chat-template-content-format", true, FlagKind::kRefused, "auto,string,openai",
   "message content is accepted both as a string and as a list of parts: use auto",
   kServeOnly},
  {"--trust-request-chat-template", false, FlagKind::kNoop, "",
   "requests cannot replace the chat template here", kServeOnly},
  {"--response-role", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--api-server-count", true, FlagKind::kNoop, "",
   "one process serves HTTP on --http-threads worker threads", kServeOnly},
  {"--disable-fastapi-docs", false, FlagKind::kNoop, "",
   "m3serve serves no /docs pages", kServeOnly},
  {"--h11-max-incomplete-event-size", true, FlagKind::kNoop, "",
   "m3serve's HTTP front caps a request's headers at 32 KiB", kServeOnly},
  {"--h11-max-header-count", true, FlagKind::kNoop, "",
   "m3serve's HTTP front caps a request at 100 headers", kServeOnly},
  {"--ssl-keyfile", true, FlagKind::kRefused, "",
   "TLS is not built in; put a TLS-terminating proxy (nginx, envoy, caddy) in front", kServeOnly},
  {"--ssl-certfile", true, FlagKind::kRefused, "",
   "TLS is not built in; put a TLS-terminating proxy in front", kServeOnly},
  {"--ssl-ca-certs", true, FlagKind::kRefused, "",
   "TLS is not built in; put a TLS-terminating proxy in front", kServeOnly},
  {"--ssl-cert-reqs", true, FlagKind::kRefused, "0",
   "TLS is not built in; put a TLS-terminating proxy in front", kServeOnly},
  {"--enable-ssl-refresh", false, FlagKind::kRefused, "",
   "TLS is not built in; put a TLS-terminating proxy in front", kServeOnly},
  {"--uds", true, FlagKind::kHandled, "", "", kServeOnly},
  {"--middleware", true, FlagKind::kRefused, "",
   "m3serve cannot load Python ASGI middleware; put a proxy in front", kServeOnly},
  {"--tool-server", true, FlagKind::kRefused, "",
   "built-in tool servers are not supported; run the tools in the client", kServeOnly},
  {"--tool-parser-plugin", true, FlagKind::kRefused, "",
   "parsers are built in: use --tool-call-parser minimax_m3", kServeOnly},
  {"--reasoning-parser-plugin", true, FlagKind::kRefused, "",
   "parsers are built in: use --reasoning-parser minimax_m3", kServeOnly},
  {"--otlp-traces-endpoint", true, FlagKind::kRefused, "",
   "OpenTelemetry tracing is not supported; scrape /metrics instead", kServeOnly},
  {"--collect-detailed-traces", true, FlagKind::kRefused, "",
   "OpenTelemetry tracing is not supported; scrape /metrics instead", kServeOnly},
};
// clang-format on

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string s) {
  const auto ws = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!s.empty() && ws(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && ws(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// The long name of an entry ("--pipeline-parallel-size" of "--pipeline-parallel-size").
std::string_view long_name(const VllmFlag& f) {
  return f.names.substr(0, f.names.find(','));
}

bool in_list(std::string_view list, const std::string& value) {
  const std::string v = lower(trim(value));
  size_t i = 0;
  while (i <= list.size() && !list.empty()) {
    size_t j = list.find(',', i);
    if (j == std::string_view::npos) j = list.size();
    if (lower(list.substr(i, j - i)) == v) return true;
    i = j + 1;
  }
  return false;
}

std::string shown(const VllmFlag& f, const std::string& value) {
  std::string s(long_name(f));
  if (f.takes_value) s += " " + value;
  return s;
}

tl::unexpected<Error> bad(const std::string& flag, const std::string& message) {
  return make_error(ErrorCode::kInvalidArgument, message, flag);
}

Result<json> parse_json_object(const std::string& flag, const std::string& text,
                               const std::string& example) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return make_error(
        ErrorCode::kInvalidArgument,
        flag + " must be a JSON object, e.g. '" + example + "'; got: " + text.substr(0, 200), flag);
  }
  return j;
}

// --mm-processor-kwargs: the keys of transformers' MiniMaxM3VL image and video processors that
// m3serve's processor honours. Values are checked here (the server applies them).
Status parse_mm_processor_kwargs(const json& j, CompatPlan& plan) {
  const std::string flag = "--mm-processor-kwargs";
  constexpr const char* kKnown =
      "min_pixels, max_pixels, size {shortest_edge, longest_edge} (images), fps, min_frames, "
      "max_frames (videos)";
  auto count = [&](const json& v, const std::string& key, int64_t lo) -> Result<int64_t> {
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > (int64_t{1} << 40))
      return bad(flag, flag + ": \"" + key + "\" must be an integer >= " + std::to_string(lo));
    return v.get<int64_t>();
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "min_pixels") {
      M3_TRY(plan.mm_min_pixels, count(it.value(), k, 1));
    } else if (k == "max_pixels") {
      M3_TRY(plan.mm_max_pixels, count(it.value(), k, 1));
    } else if (k == "size") {
      if (!it.value().is_object()) {
        return bad(flag, flag +
                             ": \"size\" must be an object with shortest_edge / longest_edge "
                             "(pixel counts, as transformers' processor takes them)");
      }
      for (auto e = it.value().begin(); e != it.value().end(); ++e) {
        if (e.key() == "shortest_edge") {
          M3_TRY(plan.mm_min_pixels, count(e.value(), "size.shortest_edge", 1));
        } else if (e.key() == "longest_edge") {
          M3_TRY(plan.mm_max_pixels, count(e.value(), "size.longest_edge", 1));
        } else {
          return bad(flag, flag + ": \"size." + e.key() +
                               "\" is unknown; accepted: shortest_edge, longest_edge");
        }
      }
    } else if (k == "fps") {
      if (!it.value().is_number() || !(it.value().get<double>() > 0) ||
          it.value().get<double>() > 1000) {
        return bad(flag, flag + ": \"fps\" must be a number of frames per second in (0, 1000]");
      }
      plan.mm_video_fps = it.value().get<double>();
    } else if (k == "min_frames") {
      M3_TRY(plan.mm_min_frames, count(it.value(), k, 1));
    } else if (k == "max_frames") {
      M3_TRY(plan.mm_max_frames, count(it.value(), k, 1));
    } else {
      return bad(flag, flag + ": \"" + k +
                           "\" is not a MiniMax-M3 processor option m3serve knows; " +
                           "accepted: " + kKnown);
    }
  }
  const int64_t lo = plan.mm_min_pixels.value_or(vision::ProcessorConfig{}.min_pixels);
  const int64_t hi = plan.mm_max_pixels.value_or(vision::ProcessorConfig{}.max_pixels);
  if (lo > hi) {
    return bad(flag, flag + ": min_pixels " + std::to_string(lo) + " is above max_pixels " +
                         std::to_string(hi));
  }
  const vision::VideoProcessorConfig vd;
  const int64_t flo = plan.mm_min_frames.value_or(vd.min_frames);
  const int64_t fhi = plan.mm_max_frames.value_or(vd.max_frames);
  if (flo > fhi) {
    return bad(flag, flag + ": min_frames " + std::to_string(flo) + " is above max_frames " +
                         std::to_string(fhi));
  }
  std::string what;
  if (plan.mm_min_pixels || plan.mm_max_pixels)
    what += "images resized within " + std::to_string(lo) + ".." + std::to_string(hi) + " pixels";
  if (plan.mm_video_fps || plan.mm_min_frames || plan.mm_max_frames) {
    char fps[32];
    std::snprintf(fps, sizeof(fps), "%g", plan.mm_video_fps.value_or(vd.fps));
    what += std::string(what.empty() ? "" : "; ") + "videos sampled at " + fps + " fps, " +
            std::to_string(flo) + ".." + std::to_string(fhi) + " frames";
  }
  if (!what.empty()) plan.notices.push_back(flag + ": " + what);
  return {};
}

// A list flag given as JSON ('["a","b"]') or as plain words.
std::vector<std::string> parse_list(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  std::vector<std::string> out;
  if (j.is_array()) {
    for (const auto& e : j) {
      if (e.is_string()) out.push_back(e.get<std::string>());
    }
    return out;
  }
  out.push_back(text);
  return out;
}

Result<uint64_t> parse_seed(const std::string& text) {
  const std::string t = trim(text);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (t.empty() || *end != '\0' || errno != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--seed '" + text + "' is not an integer; give e.g. --seed 0", "--seed");
  }
  return static_cast<uint64_t>(v);
}

// --dtype: on the GPU the GEMM precision (m3serve keeps fp32 activations; "float32" asks for
// GEMMs exact to fp32, "bfloat16" for activations rounded to bf16 once, as vLLM's bf16 does);
// on the CPU activations are fp32 whatever is asked.
Status review_dtype(const std::string& value, const std::string& device, bool precision_given,
                    CompatPlan& plan) {
  const std::string v = lower(trim(value));
  std::optional<std::string> precision;
  if (v == "float32" || v == "float" || v == "fp32") {
    precision = "exact";
  } else if (v == "bfloat16" || v == "bf16") {
    precision = "bf16";
  } else if (v == "half" || v == "float16" || v == "fp16") {
    return bad("--dtype", "--dtype " + value +
                              " is not supported: MiniMax-M3 runs in bf16 (fp16 overflows its "
                              "activations); use --dtype bfloat16, float32 or auto");
  } else if (v != "auto") {
    return bad("--dtype", "--dtype '" + value + "' is unknown; use auto, bfloat16 or float32");
  }
  if (device == "cpu") {
    if (v == "bfloat16" || v == "bf16") {
      plan.notices.push_back("--dtype " + value +
                             ": on --device cpu activations are fp32 (the reference path) and "
                             "weights are read as stored (bf16); it sets the GEMM precision "
                             "with --device cuda. The CPU KV cache is float32 unless "
                             "--kv-cache-dtype asks for bfloat16 or fp8");
    }
    return {};
  }
  if (precision) plan.gemm_precision = precision;
  (void)precision_given;
  return {};
}

// cudagraph_capture_sizes: a list of step sizes in [1, 256] (the GPU forward's graph limit).
Result<std::vector<int64_t>> capture_sizes(const std::string& flag, const json& j) {
  const std::string example = "e.g. [1, 2, 4, 8, 16, 32, 64]";
  if (!j.is_array() || j.empty())
    return bad(flag, flag + ": cudagraph_capture_sizes must be a non-empty list of step sizes, " +
                         example);
  std::vector<int64_t> out;
  for (const auto& x : j) {
    if (!x.is_number_integer() || x.get<int64_t>() < 1 || x.get<int64_t>() > 256)
      return bad(flag, flag + ": capture size " + x.dump() +
                           " is not an integer in [1, 256] (m3serve graphs steps of up to 256 "
                           "tokens), " +
                           example);
    out.push_back(x.get<int64_t>());
  }
  return out;
}

Status review_compilation(const std::string& value, CompatPlan& plan) {
  std::string text = trim(value);
  // `-O3` / `-O 3`: vLLM's optimisation level shorthand.
  if (!text.empty() &&
      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    plan.notices.push_back("--compilation-config / -O " + text +
                           " is ignored: m3serve compiles no graphs at start-up; CUDA graphs of "
                           "decode steps are captured by default (--enforce-eager turns them off)");
    return {};
  }
  M3_TRY(json j, parse_json_object("--compilation-config", text,
                                   "{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}"));
  const std::string flag = "--compilation-config";
  auto mode = j.find("cudagraph_mode");
  bool used = false;
  if (mode != j.end() && mode->is_string() && lower(mode->get<std::string>()) == "none") {
    plan.enforce_eager = true;
    used = true;
    plan.notices.push_back(
        "--compilation-config cudagraph_mode NONE: CUDA graphs are off "
        "(as --enforce-eager)");
  }
  if (auto sizes = j.find("cudagraph_capture_sizes"); sizes != j.end()) {
    M3_TRY(plan.cudagraph_capture_sizes, capture_sizes(flag, *sizes));
    used = true;
  }
  if (auto cap = j.find("max_cudagraph_capture_size"); cap != j.end()) {
    if (!cap->is_number_integer() || cap->get<int64_t>() < 1)
      return bad(flag, flag + ": max_cudagraph_capture_size must be a positive integer");
    const int64_t m = std::min<int64_t>(cap->get<int64_t>(), 256);
    if (plan.cudagraph_capture_sizes.empty())
      for (int64_t n = 1; n <= m; ++n) plan.cudagraph_capture_sizes.push_back(n);
    std::erase_if(plan.cudagraph_capture_sizes, [m](int64_t n) { return n > m; });
    if (plan.cudagraph_capture_sizes.empty())
      return bad(flag,
                 flag + ": no cudagraph_capture_sizes entry is <= max_cudagraph_capture_size");
    used = true;
  }
  if (!plan.cudagraph_capture_sizes.empty()) {
    plan.notices.push_back(
        "--compilation-config: CUDA graphs replay steps of exactly " +
        std::to_string(plan.cudagraph_capture_sizes.size()) + " sizes (up to " +
        std::to_string(*std::max_element(plan.cudagraph_capture_sizes.begin(),
                                         plan.cudagraph_capture_sizes.end())) +
        " tokens); steps of other sizes run eagerly (m3serve does not pad a step to a captured "
        "size)");
  }
  std::vector<std::string> other;
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "cudagraph_mode" && it.key() != "cudagraph_capture_sizes" &&
        it.key() != "max_cudagraph_capture_size")
      other.push_back(it.key());
  if (!other.empty() || !used) {
    std::string keys;
    for (const auto& k : other) keys += (keys.empty() ? "" : ", ") + k;
    plan.notices.push_back("--compilation-config" + (keys.empty() ? "" : " " + keys) +
                           " is ignored: " + std::string(kWhyGraphs));
  }
  return {};
}

// --kv-cache-dtype / indexer_kv_dtype values: "auto" (kept as is), or the KvDtype name the
// engine uses ("bfloat16", "fp8_e4m3", "float32"); anything else is refused with the choices.
Result<std::string> kv_dtype_value(const std::string& flag, const std::string& value) {
  const std::string v = lower(trim(value));
  if (v == "auto") return std::string("auto");
  if (v == "bfloat16" || v == "bf16") return std::string("bfloat16");
  if (v == "fp8" || v == "fp8_e4m3" || v == "fp8-e4m3") return std::string("fp8_e4m3");
  if (v == "float32" || v == "fp32" || v == "float") return std::string("float32");
  std::string why;
  if (v == "fp8_e5m2") {
    why = ": E5M2 keeps too few mantissa bits for MiniMax-M3's keys; use fp8 (E4M3)";
  } else if (v == "fp16" || v == "half" || v == "float16") {
    why = ": MiniMax-M3 runs in bf16 (fp16 overflows its activations)";
  } else if (v == "int8" || v == "fp8_inc" || v == "fp8_ds_mla" || v == "nvfp4" || v == "int4") {
    why = ": m3serve has no such KV format";
  } else {
    why = " is unknown";
  }
  return make_error(
      ErrorCode::kInvalidArgument,
      flag + " '" + value + "'" + why + "; accepted: auto, bfloat16, fp8 (= fp8_e4m3), float32",
      flag);
}

// vLLM's AttentionConfig keys. indexer_kv_dtype is applied; the others pick among vLLM's
// attention backends, which m3serve does not have (a notice says so).
constexpr std::string_view kAttentionConfigKeys[] = {
    "indexer_kv_dtype",
    "backend",
    "flash_attn_version",
    "use_prefill_decode_attention",
    "flash_attn_max_num_splits_for_cuda_graph",
    "use_cudnn_prefill",
    "use_trtllm_ragged_deepseek_prefill",
    "use_trtllm_attention",
    "disable_flashinfer_prefill",
    "disable_flashinfer_q_quantization",
    "use_prefill_query_quantization",
    "minimax_m3_msa_decode_backend",
};

Status review_attention_config(const std::string& value, CompatPlan& plan) {
  M3_TRY(json j, parse_json_object("--attention-config", value, "{\"indexer_kv_dtype\": \"fp8\"}"));
  std::vector<std::string> ignored;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const bool known = std::find(std::begin(kAttentionConfigKeys), std::end(kAttentionConfigKeys),
                                 it.key()) != std::end(kAttentionConfigKeys);
    if (!known) {
      std::string names;
      for (std::string_view k : kAttentionConfigKeys)
        names += (names.empty() ? "" : ", ") + std::string(k);
      return bad("--attention-config", "--attention-config key '" + it.key() +
                                           "' is unknown; the known keys are " + names);
    }
    if (it.key() == "indexer_kv_dtype") {
      const std::string d =
          it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
      M3_TRY(plan.index_kv_dtype, kv_dtype_value("--attention-config indexer_kv_dtype", d));
      continue;
    }
    ignored.push_back(it.key());
  }
  if (!ignored.empty()) {
    std::string keys;
    for (const auto& k : ignored) keys += (keys.empty() ? "" : ", ") + k;
    plan.notices.push_back("--attention-config (" + keys +
                           ") is ignored: " + std::string(kWhyKernels));
  }
  return {};
}

// vLLM's SpeculativeConfig keys that m3serve reads (vllm/config/speculative.py).
constexpr std::string_view kSpecKeys[] = {"method",
                                          "model",
                                          "num_speculative_tokens",
                                          "rejection_sample_method",
                                          "synthetic_acceptance_length",
                                          "draft_tensor_parallel_size",
                                          "use_local_argmax_reduction",
                                          "attention_backend"};

Status review_speculative_config(const std::string& value, const EnvList& env, CompatPlan& plan) {
  const std::string flag = "--speculative-config";
  M3_TRY(json j, parse_json_object(flag, value,
                                   "{\"method\": \"eagle3\", \"model\": \"DIR\", "
                                   "\"num_speculative_tokens\": 3}"));
  engine::SpeculativeConfig c;
  std::string method, rejection = "exact";
  std::optional<double> synthetic_len;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (std::find(std::begin(kSpecKeys), std::end(kSpecKeys), k) == std::end(kSpecKeys)) {
      std::string names;
      for (std::string_view n : kSpecKeys) names += (names.empty() ? "" : ", ") + std::string(n);
      return bad(flag, flag + " key '" + k + "' is unknown; the keys are " + names);
    }
    auto want = [&](const char* what) {
      return bad(flag, flag + " " + k + " must be " + what + "; got " + v.dump());
    };
    if (k == "method") {
      if (!v.is_string()) return want("a string (\"eagle3\")");
      method = v.get<std::string>();
    } else if (k == "model") {
      if (!v.is_string() || v.get<std::string>().empty()) return want("the draft's directory");
      c.model = v.get<std::string>();
    } else if (k == "num_speculative_tokens") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 ||
          v.get<int64_t>() > engine::kMaxSpeculativeTokens) {
        return bad(flag, flag + " num_speculative_tokens is " + v.dump() +
                             "; m3serve verifies 1 to " +
                             std::to_string(engine::kMaxSpeculativeTokens) +
                             " draft tokens per step (3 in the MiniMax-M3 recipe)");
      }
      c.num_speculative_tokens = v.get<int>();
    } else if (k == "rejection_sample_method") {
      if (!v.is_string()) return want("\"exact\" or \"synthetic\"");
      rejection = v.get<std::string>();
      if (rejection != "exact" && rejection != "synthetic") {
        return bad(flag, flag + " rejection_sample_method '" + rejection +
                             "' is unknown; use \"exact\" (the default: the target's output) "
                             "or \"synthetic\" (benchmarks at a fixed acceptance length)");
      }
    } else if (k == "synthetic_acceptance_length") {
      if (!v.is_number()) return want("a number, e.g. 2.78");
      synthetic_len = v.get<double>();
    } else if (k == "draft_tensor_parallel_size") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1) return want("a positive integer");
      if (v.get<int64_t>() != 1) {
        plan.notices.push_back(flag + " draft_tensor_parallel_size " + v.dump() +
                               ": the draft head runs whole (replicated) beside the target; "
                               "its one layer is not split");
      }
    } else if (k == "use_local_argmax_reduction") {
      if (!v.is_boolean()) return want("true or false");
      if (v.get<bool>()) {
        plan.notices.push_back(flag +
                               " use_local_argmax_reduction: not applicable, the draft's argmax "
                               "runs over its whole vocabulary on one device");
      }
    } else if (k == "attention_backend") {
      if (!v.is_string()) return want("a string");
      plan.notices.push_back(flag + " attention_backend " + v.dump() +
                             ": not applicable, the draft's attention runs m3serve's own paged "
                             "kernel (MHA and GQA, 128-token pages)");
    }
  }
  if (method.empty()) {
    return bad(flag, flag + " needs \"method\": \"eagle3\" (the one method m3serve runs)");
  }
  if (method != "eagle3") {
    return make_error(ErrorCode::kUnsupported,
                      flag + " method '" + method +
                          "' is not supported; the accepted method is \"eagle3\" (EAGLE-3 "
                          "draft heads, LlamaForCausalLMEagle3)",
                      flag);
  }
  if (c.model.empty()) {
    return bad(flag, flag +
                         " needs \"model\": the EAGLE-3 draft's directory (e.g. "
                         "models/demo-eagle3)");
  }
  if (c.num_speculative_tokens == 0) {
    return bad(flag, flag + " needs \"num_speculative_tokens\" (1 to " +
                         std::to_string(engine::kMaxSpeculativeTokens) + "; 3 in the recipe)");
  }
  std::string notice;
  // model::is_synthetic_draft's rule, spelled here: this file links without the model library.
  const bool synthetic_draft = c.model.rfind("synthetic:", 0) == 0;
  if (synthetic_draft) {
    // synthetic:mha / synthetic:gqa: random draft weights of M3's shapes on the GPU (the backend
    // checks the name; model/eagle3_draft.h).
    plan.notices.push_back(flag + " model " + c.model +
                           ": a SYNTHETIC draft of random weights, for benchmarks only (its "
                           "proposals are noise; pair it with rejection_sample_method "
                           "synthetic to time speculation at a fixed acceptance length)");
  } else {
    auto resolved = resolve_model_argument(c.model, env, &notice);
    if (!resolved) return bad(flag, flag + " model: " + resolved.error().message);
    c.model = *resolved;
    if (!notice.empty()) plan.notices.push_back(notice);
  }
  std::error_code ec;
  if (!synthetic_draft && !std::filesystem::is_directory(c.model, ec)) {
    return bad(flag, flag + " model " + c.model +
                         " is not a directory; give the EAGLE-3 draft's local directory");
  }
  if (rejection == "synthetic") {
    if (!synthetic_len) {
      return bad(flag, flag +
                           " rejection_sample_method \"synthetic\" needs "
                           "synthetic_acceptance_length (e.g. 2.78); it is never assumed");
    }
    const double hi = c.num_speculative_tokens + 1.0;
    if (!(*synthetic_len >= 1.0 && *synthetic_len <= hi)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%g", *synthetic_len);
      return bad(flag, flag + " synthetic_acceptance_length " + buf + " must be in [1, " +
                           std::to_string(c.num_speculative_tokens + 1) + "] (1 + " +
                           std::to_string(c.num_speculative_tokens) + " draft tokens)");
    }
    c.synthetic = true;
    c.synthetic_acceptance_length = *synthetic_len;
    plan.notices.push_back(flag +
                           " rejection_sample_method synthetic: BENCHMARK ONLY, drafts are "
                           "accepted at random for a mean acceptance length of " +
                           std::to_string(*synthetic_len).substr(0, 4) +
                           " and the output is NOT the target model's; never serve users so");
  } else if (synthetic_len) {
    return bad(flag, flag +
                         " synthetic_acceptance_length is only read with "
                         "\"rejection_sample_method\": \"synthetic\" (benchmarks); drop it "
                         "or set the method");
  }
  c.method = method;
  plan.speculative = c;
  return {};
}

// vLLM's KVEventsConfig keys (vllm/config/kv_events.py).
constexpr std::string_view kKvEventsKeys[] = {"enable_kv_cache_events", "publisher",    "endpoint",
                                              "replay_endpoint",        "buffer_steps", "hwm",
                                              "max_queue_size",         "topic"};

Status review_kv_events_config(const std::string& value, CompatPlan& plan) {
  const std::string flag = "--kv-events-config";
  M3_TRY(json j, parse_json_object(flag, value,
                                   "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                   "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}"));
  engine::KvEventsConfig c;
  bool enable = false;
  std::string publisher;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (std::find(std::begin(kKvEventsKeys), std::end(kKvEventsKeys), k) ==
        std::end(kKvEventsKeys)) {
      std::string names;
      for (std::string_view n : kKvEventsKeys)
        names += (names.empty() ? "" : ", ") + std::string(n);
      return bad(flag, flag + " key '" + k + "' is unknown; the keys are " + names);
    }
    auto want = [&](const char* what) {
      return bad(flag, flag + " " + k + " must be " + what + "; got " + v.dump());
    };
    if (k == "enable_kv_cache_events") {
      if (!v.is_boolean()) return want("true or false");
      enable = v.get<bool>();
    } else if (k == "publisher") {
      if (!v.is_string()) return want("a string (\"zmq\" or \"null\")");
      publisher = v.get<std::string>();
      if (publisher != "zmq" && publisher != "null") {
        return make_error(ErrorCode::kUnsupported,
                          flag + " publisher '" + publisher +
                              "' is unknown; m3serve publishes over ZeroMQ: use \"zmq\" (or "
                              "\"null\" for no events)",
                          flag);
      }
    } else if (k == "endpoint" || k == "topic") {
      if (!v.is_string()) return want("a string");
      (k == "endpoint" ? c.endpoint : c.topic) = v.get<std::string>();
      if (k == "endpoint" && c.endpoint.empty())
        return want("a ZeroMQ address such as \"tcp://*:5557\"");
    } else if (k == "replay_endpoint") {
      if (v.is_null()) continue;
      if (!v.is_string()) return want("a string or null");
      c.replay_endpoint = v.get<std::string>();
    } else {  // buffer_steps, hwm, max_queue_size
      if (!v.is_number_integer()) return want("an integer");
      const int64_t n = v.get<int64_t>();
      const int64_t lo = k == "hwm" ? 0 : 1;
      if (n < lo || n > (int64_t{1} << 30)) {
        return want(lo == 0 ? "an integer from 0 (no limit) to 2^30" : "an integer from 1 to 2^30");
      }
      (k == "buffer_steps" ? c.buffer_steps
       : k == "hwm"        ? c.hwm
                           : c.max_queue_size) = static_cast<int>(n);
    }
  }
  for (const std::string* ep : {&c.endpoint, &c.replay_endpoint}) {
    if (ep->empty()) continue;
    if (ep->rfind("tcp://", 0) != 0 && ep->rfind("ipc://", 0) != 0 &&
        ep->rfind("inproc://", 0) != 0) {
      return bad(flag, flag + " " + (ep == &c.endpoint ? "endpoint" : "replay_endpoint") + " '" +
                           *ep +
                           "' is not a ZeroMQ address; give tcp://*:PORT (bound), "
                           "tcp://HOST:PORT (connected to a proxy) or ipc:///PATH");
    }
  }
  if (publisher.empty()) publisher = enable ? "zmq" : "null";
  if (!enable || publisher == "null") {
    plan.notices.push_back(flag + ": " +
                           (!enable ? std::string("enable_kv_cache_events is false")
                                    : std::string("publisher is \"null\"")) +
                           ", so no KV events are published");
    return {};
  }
  c.enabled = true;
  plan.kv_events = c;
  return {};
}

// vLLM's KV connectors by what they are for; m3serve runs the host-memory offloading ones.
constexpr std::string_view kOffloadConnectors[] = {"OffloadingConnector",
                                                   "SimpleCPUOffloadConnector"};
// Prefill/decode disaggregation: m3serve runs vLLM's NIXL one (engine/pd_connector.h).
constexpr std::string_view kPdConnectors[] = {"NixlConnector"};
constexpr std::string_view kTransferConnectors[] = {
    "MooncakeConnector",    "MooncakeConnectorV1", "P2pNcclConnector",       "LMCacheConnectorV1",
    "LMCacheMPConnector",   "MultiConnector",      "SharedStorageConnector", "MoRIIOConnector",
    "DecodeBenchConnector", "ExampleConnector"};
constexpr std::string_view kKvRoles[] = {"kv_producer", "kv_consumer", "kv_both"};

std::string joined(std::span<const std::string_view> names) {
  std::string out;
  for (std::string_view n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

template <size_t N>
bool one_of(const std::string& v, const std::string_view (&names)[N]) {
  return std::find(std::begin(names), std::end(names), v) != std::end(names);
}

// A byte count given as a JSON number (vLLM takes int(...) of it).
Result<int64_t> byte_count(const std::string& what, const json& v) {
  if (!v.is_number() || !(v.get<double>() >= 0) || v.get<double>() > 9.0e18)
    return bad("--kv-transfer-config", "--kv-transfer-config " + what +
                                           " must be a number of bytes, e.g. 68719476736 (64 "
                                           "GiB); got " +
                                           v.dump());
  return static_cast<int64_t>(v.get<double>());
}

// vLLM's NixlConnector config: kv_role producer / consumer / both; kv_connector_extra_config
// backends ["UCX"] (the one m3serve loads). The side channel comes from VLLM_NIXL_* variables.
Status review_nixl_config(const json& j, CompatPlan& plan) {
  const std::string flag = "--kv-transfer-config";
  if (!j.contains("kv_role") || !j["kv_role"].is_string())
    return bad(flag, flag +
                         " needs kv_role with kv_connector 'NixlConnector': \"kv_producer\" "
                         "(prefill worker), \"kv_consumer\" (decode worker) or \"kv_both\"");
  const std::string role = j["kv_role"].get<std::string>();
  if (!one_of(role, kKvRoles)) {
    return bad(
        flag, flag + " kv_role '" + role + "' is unknown; NixlConnector takes " + joined(kKvRoles));
  }
  engine::PdConfig pd;
  pd.role = role == "kv_producer"   ? engine::KvRole::kProducer
            : role == "kv_consumer" ? engine::KvRole::kConsumer
                                    : engine::KvRole::kBoth;
  std::vector<std::string> ignored;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "kv_connector" || k == "kv_role" || k == "kv_connector_extra_config") continue;
    // Placement and buffer knobs of vLLM's transfer machinery: nothing to set here.
    ignored.push_back(k);
  }
  json extra = j.value("kv_connector_extra_config", json::object());
  if (!extra.is_object())
    return bad(flag, flag + " kv_connector_extra_config must be a JSON object");
  for (auto it = extra.begin(); it != extra.end(); ++it) {
    if (it.key() == "backends") {
      const json& b = it.value();
      if (!b.is_array() || b.size() != 1 || !b[0].is_string() || b[0].get<std::string>() != "UCX")
        return bad(flag, flag +
                             " kv_connector_extra_config.backends must be [\"UCX\"]: the NIXL "
                             "backend m3serve uses; got " +
                             b.dump());
    } else {
      ignored.push_back("kv_connector_extra_config." + it.key());
    }
  }
  if (!ignored.empty()) {
    std::string keys;
    for (const auto& k : ignored) keys += (keys.empty() ? "" : ", ") + k;
    plan.notices.push_back(flag + " keys " + keys +
                           " are ignored: NixlConnector here reads kv_role and "
                           "kv_connector_extra_config.backends");
  }
  plan.pd = pd;
  return {};
}

Status review_kv_transfer_config(const std::string& value, CompatPlan& plan) {
  const std::string flag = "--kv-transfer-config";
  M3_TRY(json j,
         parse_json_object(flag, value,
                           "{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                           "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 68719476736}}"));
  if (!j.contains("kv_connector") || j["kv_connector"].is_null()) {
    plan.notices.push_back(flag + " has no kv_connector, so nothing is offloaded or transferred");
    return {};
  }
  if (!j["kv_connector"].is_string())
    return bad(flag, flag + " kv_connector must be a string, e.g. \"OffloadingConnector\"");
  const std::string connector = j["kv_connector"].get<std::string>();
  const std::string accepted = joined(kOffloadConnectors) + " (the host-memory KV tier) and " +
                               joined(kPdConnectors) + " (prefill/decode disaggregation)";
  if (one_of(connector, kTransferConnectors)) {
    return make_error(ErrorCode::kUnsupported,
                      flag + " kv_connector '" + connector + "' is not available: m3serve runs " +
                          accepted +
                          ", e.g. '{\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                          "\"kv_producer\"}'",
                      flag);
  }
  if (one_of(connector, kPdConnectors)) return review_nixl_config(j, plan);
  if (!one_of(connector, kOffloadConnectors)) {
    return make_error(ErrorCode::kUnsupported,
                      flag + " kv_connector '" + connector + "' is unknown; m3serve runs " +
                          accepted +
                          ", e.g. '{\"kv_connector\": "
                          "\"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                          "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 68719476736}}'",
                      flag);
  }
  if (!j.contains("kv_role") || !j["kv_role"].is_string()) {
    return bad(flag, flag + " needs kv_role with kv_connector '" + connector +
                         "' (as vLLM does): give \"kv_role\": \"kv_both\"");
  }
  const std::string role = j["kv_role"].get<std::string>();
  if (!one_of(role, kKvRoles)) {
    return bad(flag, flag + " kv_role '" + role + "' is unknown; vLLM's roles are " +
                         joined(kKvRoles) + " (the offloading connector takes kv_both)");
  }
  if (role != "kv_both") {
    return make_error(ErrorCode::kUnsupported,
                      flag + " kv_role '" + role +
                          "' is a prefill/decode disaggregation role, which the "
                          "offloading connector does not take: " +
                          connector +
                          " takes \"kv_role\": \"kv_both\" (P/D disaggregation is "
                          "kv_connector \"NixlConnector\")",
                      flag);
  }
  std::vector<std::string> ignored;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "kv_connector" && it.key() != "kv_role" &&
        it.key() != "kv_connector_extra_config")
      ignored.push_back(it.key());
  }
  json extra = j.value("kv_connector_extra_config", json::object());
  if (!extra.is_object())
    return bad(flag, flag + " kv_connector_extra_config must be a JSON object");
  std::optional<int64_t> bytes;
  bool lazy = false;  // vLLM's default: store every computed block
  for (auto it = extra.begin(); it != extra.end(); ++it) {
    const std::string& k = it.key();
    if (k == "cpu_bytes_to_use") {
      M3_TRY(int64_t b, byte_count("kv_connector_extra_config.cpu_bytes_to_use", it.value()));
      if (!bytes) bytes = b;
    } else if (k == "cpu_bytes_to_use_per_rank") {
      // Per rank wins over the server-wide value (the host tier runs on one rank here).
      M3_TRY(bytes, byte_count("kv_connector_extra_config.cpu_bytes_to_use_per_rank", it.value()));
    } else if (k == "lazy_offload") {
      if (!it.value().is_boolean())
        return bad(flag, flag + " kv_connector_extra_config.lazy_offload must be true or false");
      lazy = it.value().get<bool>();
    } else {
      ignored.push_back("kv_connector_extra_config." + k);
    }
  }
  if (!lazy) {
    plan.notices.push_back(flag +
                           " lazy_offload false (vLLM's default when not given): m3serve copies "
                           "a page to the host tier when the device pool evicts it (as "
                           "lazy_offload true), not after every step");
  }
  if (!bytes) {
    if (connector == "OffloadingConnector") {
      return bad(flag, flag +
                           " OffloadingConnector needs kv_connector_extra_config."
                           "cpu_bytes_to_use (the host tier's size in bytes, as vLLM "
                           "requires), e.g. 68719476736 for 64 GiB");
    }
    bytes = int64_t{8} << 30;  // SimpleCPUOffloadConnector's default capacity
    plan.notices.push_back(flag +
                           " SimpleCPUOffloadConnector without cpu_bytes_to_use: the "
                           "host KV tier gets vLLM's default of 8 GiB");
  }
  if (*bytes < 1) {
    return bad(flag, flag +
                         " cpu_bytes_to_use is 0: the host KV tier needs room for at least "
                         "one KV page");
  }
  if (!ignored.empty()) {
    std::string keys;
    for (const auto& k : ignored) keys += (keys.empty() ? "" : ", ") + k;
    plan.notices.push_back(flag + " keys " + keys +
                           " are ignored: they tune vLLM's transfer machinery, which m3serve's "
                           "host tier does not have");
  }
  plan.host_kv_cache_bytes = *bytes;
  return {};
}

}  // namespace

const std::vector<VllmFlag>& vllm_flag_table() {
  return kTable;
}

void add_vllm_flags(CLI::App* sub, VllmFlagValues& v, VllmCommand cmd) {
  v.options.assign(kTable.size(), nullptr);
  v.values.assign(kTable.size(), std::string());
  for (size_t i = 0; i < kTable.size(); ++i) {
    const VllmFlag& f = kTable[i];
    if (f.serve_only && cmd != VllmCommand::kServe) continue;
    const std::string names(f.names);
    std::string help;
    switch (f.kind) {
      case FlagKind::kNoop:
        help = "vLLM flag, no effect here: " + std::string(f.why);
        break;
      case FlagKind::kRefused:
      case FlagKind::kComing:
        help = "vLLM flag, refused" +
               (f.noop_values.empty() ? std::string() : " unless " + std::string(f.noop_values)) +
               ": " + std::string(f.why);
        break;
      case FlagKind::kHandled:
        help = "";  // set below
        break;
    }
    const std::string ln(long_name(f));
    if (ln == "--dtype") {
      help =
          "auto | bfloat16 | float32. With --device cuda it sets the GEMM precision: float32 "
          "= --gemm-precision exact (the oracle mode), bfloat16 and auto = --gemm-precision "
          "bf16 (the default). On the CPU activations are always fp32";
    } else if (ln == "--seed") {
      help =
          "Seed for requests that give none: the same sequence of unseeded requests gets the "
          "same answers after a restart";
    } else if (ln == "--hf-overrides") {
      help =
          "JSON object merged into config.json before it is read, e.g. "
          "'{\"text_config\": {\"max_position_embeddings\": 262144}}'";
    } else if (ln == "--limit-mm-per-prompt") {
      help =
          "JSON object of per-prompt limits, e.g. '{\"image\": 4, \"video\": 1}' (defaults: 16 "
          "images, 4 videos)";
    } else if (ln == "--mm-processor-kwargs") {
      help =
          "JSON object of MiniMax-M3 processor options: min_pixels / max_pixels (or size "
          "{shortest_edge, longest_edge}) for images, fps / min_frames / max_frames for videos";
    } else if (ln == "--mm-processor-cache-gb") {
      help = "GiB of processed images cached by content hash (default 4; 0: off)";
    } else if (ln == "--mm-processor-cache-type") {
      help = "lru (shm is treated as lru: one server process)";
    } else if (ln == "--mm-encoder-tp-mode") {
      help = "weights | data (accepted; the vision tower runs unsharded)";
    } else if (ln == "--allowed-local-media-path") {
      help = "Directory whose files image parts may name as file:// URLs";
    } else if (ln == "--compilation-config") {
      help =
          "vLLM compilation config: cudagraph_capture_sizes [N, ...] are the step sizes that "
          "replay CUDA graphs (default: every size up to 256), max_cudagraph_capture_size caps "
          "them, cudagraph_mode NONE turns graphs off (as --enforce-eager); the rest has no "
          "effect here";
    } else if (ln == "--cuda-graph-sizes") {
      help = "Step sizes that replay CUDA graphs (as cudagraph_capture_sizes), e.g. 1 2 4 8";
    } else if (ln == "--async-scheduling") {
      help =
          "Schedule and launch step N+1 while the GPU runs step N (the default on the GPU; on "
          "the CPU it runs the same pipeline without overlap)";
    } else if (ln == "--no-async-scheduling") {
      help = "The synchronous engine loop: each step is scheduled after the one before returned";
    } else if (ln == "--attention-config") {
      help =
          "vLLM attention config (also --attention-config.KEY VALUE): indexer_kv_dtype "
          "auto|bfloat16|fp8|float32 is the MSA index-K cache format (docs/KV_CACHE.md); "
          "backend keys have no effect here";
    } else if (ln == "--kv-cache-dtype") {
      help =
          "auto | bfloat16 | fp8 (fp8_e4m3) | float32: the KV cache format (docs/KV_CACHE.md). "
          "auto = bfloat16 on the GPU (float32 with --dtype float32), float32 on the CPU";
    } else if (ln == "--long-prefill-token-threshold") {
      help =
          "Most prompt tokens one request gets per step (default 0: only "
          "--max-num-batched-tokens limits a chunk); smaller chunks of a long prompt keep the "
          "streams decoding beside it stepping, at some cost in its time to first token";
    } else if (ln == "--stream-interval") {
      help =
          "Tokens per streamed chunk (default 1): a stream's first token and its end are sent "
          "at once, the tokens between in chunks of N (fewer SSE writes under load)";
    } else if (ln == "--max-logprobs") {
      help =
          "Most logprobs / top_logprobs / prompt_logprobs a request may ask for (default 20; "
          "-1: no limit)";
    } else if (ln == "--kv-transfer-config") {
      help =
          "vLLM's KV connector config. m3serve runs the host-memory KV tier: "
          "'{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
          "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": BYTES}}' keeps evicted "
          "prefix-cache pages in host memory and restores them on a prefix hit (CPU backend)";
    } else if (ln == "--kv-offloading-size") {
      help =
          "Host KV tier size in GiB (vLLM's native CPU offloading; same as the "
          "OffloadingConnector config with cpu_bytes_to_use)";
    } else if (ln == "--kv-offloading-backend") {
      help = "native (the only one here); used with --kv-offloading-size";
    } else if (ln == "--kv-events-config") {
      help =
          "vLLM's KV event stream over ZeroMQ, e.g. '{\"enable_kv_cache_events\": true, "
          "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
          "\"tcp://*:5558\", \"topic\": \"kv-events\"}' (keys: buffer_steps, hwm, "
          "max_queue_size too); needs prefix caching";
    } else if (ln == "--override-generation-config") {
      help =
          "JSON object of sampling defaults over generation_config.json, e.g. "
          "'{\"temperature\": 1.0, \"top_p\": 0.95, \"top_k\": 40}'";
    } else if (f.kind == FlagKind::kHandled) {
      help = "vLLM flag; start-up prints what it does here";
    }
    // add_flag(name, std::string) would bind the string as the flag's result: set the help apart.
    CLI::Option* opt = f.takes_value ? sub->add_option(names, v.values[i], help)
                                     : sub->add_flag(names)->description(help);
    if (f.kind != FlagKind::kHandled) opt->group("vLLM compatibility");
    v.options[i] = opt;
  }
}

EnvList process_environment() {
  EnvList out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) out.emplace_back(*e);
  return out;
}

Result<CompatPlan> review_vllm_flags(const VllmFlagValues& v, VllmCommand cmd,
                                     const std::string& device, bool gemm_precision_given,
                                     const EnvList& env) {
  CompatPlan plan;
  bool enable_log_requests = false, disable_log_requests = false;
  bool transfer_given = false, offloading_size_given = false;
  std::string offloading_backend;
  for (size_t i = 0; i < kTable.size() && i < v.options.size(); ++i) {
    const CLI::Option* opt = v.options[i];
    if (opt == nullptr || opt->count() == 0) continue;
    const VllmFlag& f = kTable[i];
    const std::string ln(long_name(f));
    const std::string& value = v.values[i];
    if (f.kind != FlagKind::kHandled) {
      const bool noop_value = f.takes_value && in_list(f.noop_values, value);
      if (f.kind == FlagKind::kNoop) {
        plan.notices.push_back(shown(f, value) + " is ignored: " + std::string(f.why));
      } else if (noop_value) {
        plan.notices.push_back(shown(f, value) + " is what m3serve does anyway: accepted");
      } else {
        const std::string lead =
            f.kind == FlagKind::kComing ? " is not available yet: " : " is not supported: ";
        return make_error(ErrorCode::kUnsupported, shown(f, value) + lead + std::string(f.why), ln);
      }
      continue;
    }
    if (ln == "--dtype") {
      M3_TRY_STATUS(review_dtype(value, device, gemm_precision_given, plan));
      if (plan.gemm_precision && gemm_precision_given) {
        return bad("--dtype", "--dtype " + value +
                                  " and --gemm-precision are both given; "
                                  "--dtype float32 is --gemm-precision exact and --dtype bfloat16 "
                                  "is --gemm-precision bf16: give one of them");
      }
    } else if (ln == "--seed") {
      M3_TRY(plan.seed, parse_seed(value));
      if (cmd == VllmCommand::kServe) {
        plan.notices.push_back("--seed " + value +
                               ": requests that give no 'seed' draw theirs from it and their "
                               "arrival number (the same requests in the same order sample the "
                               "same tokens after a restart)");
      }
    } else if (ln == "--hf-overrides") {
      M3_TRY(json j, parse_json_object(ln, value,
                                       "{\"text_config\": {\"max_position_embeddings\": 262144}}"));
      plan.hf_overrides = j.dump();
    } else if (ln == "--limit-mm-per-prompt") {
      M3_TRY(json j, parse_json_object(ln, value, "{\"image\": 4, \"video\": 0}"));
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
          return bad(ln, "--limit-mm-per-prompt: \"" + it.key() +
                             "\" must be a non-negative integer, e.g. '{\"image\": 4}'");
        }
        const int n = static_cast<int>(std::min<int64_t>(it.value().get<int64_t>(), 1 << 20));
        if (it.key() == "image") {
          plan.mm_limit_images = n;
        } else if (it.key() == "video") {
          plan.mm_limit_videos = n;  // cmd_serve says so when this build cannot decode video
        } else {
          return bad(ln, "--limit-mm-per-prompt: \"" + it.key() +
                             "\" is not a modality of MiniMax-M3 (image, video)");
        }
      }
    } else if (ln == "--mm-processor-kwargs") {
      M3_TRY(json j, parse_json_object(ln, value, "{\"max_pixels\": 1003520, \"fps\": 2}"));
      M3_TRY_STATUS(parse_mm_processor_kwargs(j, plan));
    } else if (ln == "--mm-processor-cache-gb") {
      const std::string t = trim(value);
      char* end = nullptr;
      const double gb = std::strtod(t.c_str(), &end);
      if (t.empty() || *end != '\0' || !(gb >= 0) || gb > 1e6) {
        return bad(ln, "--mm-processor-cache-gb '" + value +
                           "' is not a size in GiB >= 0, e.g. --mm-processor-cache-gb 4 (0: off)");
      }
      plan.mm_cache_gb = gb;
    } else if (ln == "--mm-processor-cache-type") {
      if (value != "lru" && value != "shm") {
        return bad(ln, "--mm-processor-cache-type '" + value + "': use lru or shm");
      }
      if (value == "shm") {
        plan.notices.push_back(
            "--mm-processor-cache-type shm: the server is one process, so its processed-image "
            "cache is the in-process LRU (lru)");
      }
    } else if (ln == "--mm-encoder-tp-mode") {
      if (value != "weights" && value != "data") {
        return bad(ln, "--mm-encoder-tp-mode '" + value + "': use weights or data");
      }
      plan.notices.push_back("--mm-encoder-tp-mode " + value +
                             ": the vision tower runs whole (unsharded) once per request on the "
                             "CPU backend; a tensor- or data-parallel tower is not implemented");
    } else if (ln == "--allowed-local-media-path") {
      std::error_code ec;
      if (!std::filesystem::is_directory(value, ec)) {
        return bad(ln, "--allowed-local-media-path " + value + " is not a directory");
      }
      plan.allowed_local_media_path = value;
    } else if (ln == "--compilation-config") {
      M3_TRY_STATUS(review_compilation(value, plan));
    } else if (ln == "--cuda-graph-sizes") {
      // A list: "1,2,4,8" (or space-separated in one argument).
      std::string t = trim(value);
      std::replace(t.begin(), t.end(), ' ', ',');
      M3_TRY(plan.cudagraph_capture_sizes,
             capture_sizes(ln, json::parse("[" + t + "]", nullptr, false)));
    } else if (ln == "--async-scheduling" || ln == "--no-async-scheduling") {
      const bool on = ln == "--async-scheduling";
      if (plan.async_scheduling && *plan.async_scheduling != on)
        return bad(ln, "--async-scheduling and --no-async-scheduling are both given; give one");
      plan.async_scheduling = on;
    } else if (ln == "--attention-config") {
      M3_TRY_STATUS(review_attention_config(value, plan));
    } else if (ln == "--kv-cache-dtype") {
      M3_TRY(plan.kv_cache_dtype, kv_dtype_value("--kv-cache-dtype", value));
    } else if (ln == "--quantization") {
      // Checked against the checkpoint's quantization_config when the model loads.
      if (!model::is_quantization_value(value)) {
        return bad(ln, "--quantization '" + value +
                           "' is unknown; accepted: " + std::string(model::kQuantizationValues));
      }
      plan.quantization = value;
    } else if (ln == "--kv-events-config") {
      M3_TRY_STATUS(review_kv_events_config(value, plan));
    } else if (ln == "--speculative-config") {
      M3_TRY_STATUS(review_speculative_config(value, env, plan));
    } else if (ln == "--kv-transfer-config") {
      if (offloading_size_given)
        return bad(ln, "--kv-transfer-config and --kv-offloading-size are both given; give one");
      transfer_given = true;
      M3_TRY_STATUS(review_kv_transfer_config(value, plan));
    } else if (ln == "--kv-offloading-size") {
      if (transfer_given)
        return bad(ln, "--kv-transfer-config and --kv-offloading-size are both given; give one");
      offloading_size_given = true;
      char* end = nullptr;
      const std::string t = trim(value);
      const double gib = std::strtod(t.c_str(), &end);
      if (t.empty() || *end != '\0' || !(gib > 0) || gib > 1e6) {
        return bad(ln, "--kv-offloading-size '" + value +
                           "' is not a size in GiB; e.g. --kv-offloading-size 64 (vLLM's "
                           "native CPU offloading of 64 GiB)");
      }
      plan.host_kv_cache_bytes = static_cast<int64_t>(gib * 1073741824.0);
    } else if (ln == "--kv-offloading-backend") {
      offloading_backend = lower(trim(value));
      if (offloading_backend != "native") {
        return make_error(ErrorCode::kUnsupported,
                          "--kv-offloading-backend '" + value +
                              "' is not supported; m3serve's host KV tier is the native one: "
                              "use --kv-offloading-backend native (or leave it out)",
                          ln);
      }
    } else if (ln == "--max-logprobs") {
      const std::string t = trim(value);
      char* end = nullptr;
      const long n = std::strtol(t.c_str(), &end, 10);
      if (t.empty() || *end != '\0') {
        return bad(ln, "--max-logprobs '" + value + "' is not an integer; e.g. --max-logprobs 20");
      }
      // As vLLM: -1 lifts the limit (the whole vocabulary may be asked for).
      if (n < -1 || n > (1L << 30)) {
        return bad(ln, "--max-logprobs " + value + " must be -1 (no limit) or a count >= 0");
      }
      plan.max_logprobs = n == -1 ? (1 << 30) : static_cast<int32_t>(n);
    } else if (ln == "--long-prefill-token-threshold") {
      const std::string t = trim(value);
      char* end = nullptr;
      const long n = std::strtol(t.c_str(), &end, 10);
      if (t.empty() || *end != '\0' || n < 0 || n > (1L << 30)) {
        return bad(ln, "--long-prefill-token-threshold '" + value +
                           "' must be a token count >= 0 (0: no cap), e.g. 2048");
      }
      plan.long_prefill_token_threshold = static_cast<int>(n);
    } else if (ln == "--stream-interval") {
      const std::string t = trim(value);
      char* end = nullptr;
      const long n = std::strtol(t.c_str(), &end, 10);
      if (t.empty() || *end != '\0' || n < 1 || n > 4096) {
        return bad(ln, "--stream-interval '" + value +
                           "' must be a token count from 1 to 4096 (1: a chunk per token)");
      }
      plan.stream_interval = static_cast<int>(n);
    } else if (ln == "--disable-log-requests") {
      disable_log_requests = true;
    } else if (ln == "--enable-log-requests") {
      enable_log_requests = true;
    } else if (ln == "--disable-log-stats") {
      plan.log_stats = false;
    } else if (ln == "--disable-uvicorn-access-log") {
      plan.access_log = false;
    } else if (ln == "--override-generation-config") {
      M3_TRY(json j, parse_json_object(ln, value, "{\"temperature\": 1.0, \"top_p\": 0.95}"));
      plan.generation_overrides = j.dump();
    } else if (ln == "--allowed-origins" || ln == "--allowed-methods" ||
               ln == "--allowed-headers" || ln == "--allow-credentials") {
      if (ln == "--allowed-origins") plan.allowed_origins = parse_list(value);
      if (ln == "--allow-credentials") plan.allow_credentials = true;
      if (ln == "--allowed-methods" || ln == "--allowed-headers") {
        plan.notices.push_back(shown(f, value) +
                               ": CORS preflights are answered with GET, POST, OPTIONS and the "
                               "headers the browser asks for");
      }
    } else if (ln == "--response-role") {
      const std::string role = trim(value);
      if (role.empty()) return bad(ln, "--response-role needs a role name, e.g. assistant");
      plan.response_role = role;
    } else if (ln == "--uds") {
      const std::string path = trim(value);
      if (path.empty() || path.size() >= 108) {  // sockaddr_un's sun_path, with its NUL
        return bad(ln, "--uds '" + value +
                           "' is not a Unix socket path (1 to 107 bytes), e.g. --uds /tmp/m3.sock");
      }
      plan.uds = path;
    } else if (ln == "--root-path") {
      plan.root_path = trim(value);
      plan.notices.push_back("--root-path " + value +
                             ": routes stay at /v1/...; the proxy in front must strip the "
                             "prefix (as with vLLM behind a path-stripping proxy)");
    }
  }
  if (!offloading_backend.empty() && !offloading_size_given) {
    plan.notices.push_back("--kv-offloading-backend " + offloading_backend +
                           " has no effect without --kv-offloading-size (as in vLLM)");
  }
  if (enable_log_requests && disable_log_requests) {
    return bad("--enable-log-requests",
               "--enable-log-requests and --disable-log-requests are both given; give one");
  }
  plan.log_requests = enable_log_requests;
  if (disable_log_requests) {
    plan.notices.push_back(
        "--disable-log-requests is what m3serve does anyway: requests are logged only with "
        "--enable-log-requests");
  }

  // VLLM_* variables of the recipe: the ones m3serve honours, and one line for the rest.
  std::vector<std::string> ignored;
  std::optional<std::string> nixl_host;
  std::optional<double> nixl_port, nixl_timeout;
  for (const std::string& kv : env) {
    if (kv.rfind("VLLM_", 0) != 0) continue;
    const size_t eq = kv.find('=');
    const std::string name = kv.substr(0, eq);
    const std::string val = eq == std::string::npos ? "" : kv.substr(eq + 1);
    if (name == "VLLM_API_KEY") continue;  // read by serve as a fallback for --api-key
    if (name == "VLLM_ALLOW_LONG_MAX_MODEL_LEN") {
      plan.allow_long_max_model_len = val == "1" || lower(val) == "true";
      continue;
    }
    if (name == "VLLM_LOGGING_LEVEL") {
      plan.log_level = lower(val);
      continue;
    }
    if (name == "VLLM_NIXL_SIDE_CHANNEL_HOST") {
      if (val.empty()) return bad(name, name + " is empty; give the host decode workers reach");
      nixl_host = val;
      continue;
    }
    if (name == "VLLM_NIXL_SIDE_CHANNEL_PORT" || name == "VLLM_NIXL_ABORT_REQUEST_TIMEOUT") {
      char* end = nullptr;
      const double v = std::strtod(val.c_str(), &end);
      const bool port = name == "VLLM_NIXL_SIDE_CHANNEL_PORT";
      if (val.empty() || *end != '\0' || !(v > 0) || (port && (v > 65535 || v != std::floor(v))))
        return bad(name, name + "='" + val + "' is not " +
                             (port ? "a port number (1-65535)" : "a positive number of seconds"));
      (port ? nixl_port : nixl_timeout) = v;
      continue;
    }
    if (name == "VLLM_VIDEO_FETCH_TIMEOUT") {
      char* end = nullptr;
      const double v = std::strtod(val.c_str(), &end);
      if (val.empty() || *end != '\0' || !(v > 0) || v > 86400) {
        return bad(name, name + "='" + val + "' is not a positive number of seconds");
      }
      plan.video_timeout_s = v;  // m3serve fetches nothing: the bound of decoding a video part
      continue;
    }
    if (name == "VLLM_LOG_STATS_INTERVAL") {
      char* end = nullptr;
      const double v = std::strtod(val.c_str(), &end);
      if (val.empty() || *end != '\0' || !(v > 0)) {
        return bad("VLLM_LOG_STATS_INTERVAL",
                   "VLLM_LOG_STATS_INTERVAL='" + val + "' is not a positive number of seconds");
      }
      plan.stats_interval_s = v;
      continue;
    }
    ignored.push_back(name);
  }
  if (plan.pd) {
    if (nixl_host) plan.pd->host = *nixl_host;
    if (nixl_port) plan.pd->port = static_cast<int>(*nixl_port);
    if (nixl_timeout) plan.pd->abort_timeout_s = *nixl_timeout;
  } else if (nixl_host || nixl_port || nixl_timeout) {
    plan.notices.push_back(
        "environment VLLM_NIXL_* is ignored: it configures the NixlConnector, and "
        "--kv-transfer-config does not name it");
  }
  std::sort(ignored.begin(), ignored.end());
  if (!ignored.empty()) {
    std::string names;
    for (const auto& n : ignored) names += (names.empty() ? "" : ", ") + n;
    plan.notices.push_back(
        "environment " + names + (ignored.size() == 1 ? " is" : " are") +
        " ignored: vLLM kernel and runtime switches have no effect on "
        "m3serve (honoured: VLLM_API_KEY, VLLM_ALLOW_LONG_MAX_MODEL_LEN, "
        "VLLM_LOGGING_LEVEL, VLLM_LOG_STATS_INTERVAL, VLLM_NIXL_SIDE_CHANNEL_HOST, "
        "VLLM_NIXL_SIDE_CHANNEL_PORT, VLLM_NIXL_ABORT_REQUEST_TIMEOUT, VLLM_VIDEO_FETCH_TIMEOUT)");
  }
  return plan;
}

std::vector<std::string> normalize_vllm_argv(const std::vector<std::string>& in) {
  // vLLM's multi-letter short aliases (argparse allows them; CLI11 short names are one letter).
  static const std::map<std::string, std::string> kShort = {
      {"-tp", "--tensor-parallel-size"},      {"-pp", "--pipeline-parallel-size"},
      {"-dp", "--data-parallel-size"},        {"-dpl", "--data-parallel-size-local"},
      {"-dpa", "--data-parallel-address"},    {"-dpp", "--data-parallel-rpc-port"},
      {"-dpr", "--data-parallel-start-rank"}, {"-dpb", "--data-parallel-backend"},
      {"-asc", "--api-server-count"},         {"-ep", "--enable-expert-parallel"}};
  std::vector<std::string> args;
  args.reserve(in.size());
  for (const std::string& a : in) {
    const size_t eq = a.find('=');
    auto it = kShort.find(a.substr(0, eq));
    if (it == kShort.end()) {
      args.push_back(a);
    } else {
      args.push_back(eq == std::string::npos ? it->second : it->second + a.substr(eq));
    }
  }
  std::vector<std::string> out;
  // Dotted keys of one config flag are merged into one JSON object at its first position.
  std::map<std::string, size_t> dotted_slot;  // flag -> index in `out` of its JSON value
  std::map<std::string, json> dotted;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.size() < 3 || a.rfind("--", 0) != 0) {
      out.push_back(std::move(a));
      continue;
    }
    const size_t eq = a.find('=');
    std::string name = a.substr(0, eq);
    std::optional<std::string> inline_value;
    if (eq != std::string::npos) inline_value = a.substr(eq + 1);
    std::replace(name.begin(), name.end(), '_', '-');
    const size_t dot = name.find('.');
    if (dot == std::string::npos) {
      out.push_back(inline_value ? name + "=" + *inline_value : name);
      continue;
    }
    // `--attention-config.indexer-kv-dtype fp8`: the key keeps vLLM's underscores.
    const std::string flag = name.substr(0, dot);
    std::string key_path = a.substr(dot, eq == std::string::npos ? std::string::npos : eq - dot);
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < args.size()) {
      value = args[++i];
    }
    json v = json::parse(value, nullptr, false);
    if (v.is_discarded()) v = value;
    json* node = &dotted[flag];
    if (!node->is_object()) *node = json::object();
    size_t p = 1;  // key_path starts with '.'
    while (true) {
      const size_t next = key_path.find('.', p);
      const std::string key = key_path.substr(p, next == std::string::npos ? next : next - p);
      if (next == std::string::npos) {
        (*node)[key] = v;
        break;
      }
      json& child = (*node)[key];
      if (!child.is_object()) child = json::object();
      node = &child;
      p = next + 1;
    }
    if (!dotted_slot.count(flag)) {
      out.push_back(flag);
      dotted_slot[flag] = out.size();
      out.emplace_back();  // filled below
    }
  }
  for (const auto& [flag, slot] : dotted_slot) out[slot] = dotted[flag].dump();
  return out;
}

Result<std::string> resolve_model_argument(const std::string& model, const EnvList& env,
                                           std::string* notice) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (model.empty() || fs::exists(model, ec) || model.rfind("synthetic:", 0) == 0) return model;
  // `org/name`: exactly one slash, no leading '/' or '.', characters a hub id may have.
  const size_t slash = model.find('/');
  const bool hub_like = slash != std::string::npos && slash > 0 && slash + 1 < model.size() &&
                        model.find('/', slash + 1) == std::string::npos && model[0] != '.' &&
                        std::all_of(model.begin(), model.end(), [](char c) {
                          return std::isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                                 c == '_' || c == '.' || c == '/';
                        });
  if (!hub_like) return model;  // the caller reports a missing directory
  const auto getenv_of = [&](const std::string& name) -> std::string {
    for (const auto& kv : env) {
      if (kv.rfind(name + "=", 0) == 0) return kv.substr(name.size() + 1);
    }
    return {};
  };
  std::vector<fs::path> caches;
  if (auto c = getenv_of("HF_HUB_CACHE"); !c.empty()) caches.emplace_back(c);
  if (auto h = getenv_of("HF_HOME"); !h.empty()) caches.push_back(fs::path(h) / "hub");
  if (auto home = getenv_of("HOME"); !home.empty())
    caches.push_back(fs::path(home) / ".cache" / "huggingface" / "hub");
  const std::string repo_dir = "models--" + model.substr(0, slash) + "--" + model.substr(slash + 1);
  for (const auto& cache : caches) {
    const fs::path repo = cache / repo_dir;
    std::ifstream ref(repo / "refs" / "main");
    std::string commit;
    if (ref && std::getline(ref, commit)) {
      const fs::path snap = repo / "snapshots" / trim(commit);
      if (fs::exists(snap / "config.json", ec)) {
        if (notice) *notice = model + " resolved to the local Hugging Face cache: " + snap.string();
        return snap.string();
      }
    }
  }
  return make_error(ErrorCode::kNotFound,
                    "'" + model +
                        "' is not a directory. m3serve does not download from the Hugging Face Hub "
                        "and found no copy in the local cache ($HF_HUB_CACHE, $HF_HOME/hub, "
                        "~/.cache/huggingface/hub). Download it (huggingface-cli download " +
                        model + " --local-dir /data/" + model.substr(slash + 1) +
                        ") and pass the directory: m3serve "
                        "serve /data/" +
                        model.substr(slash + 1) + " --served-model-name " + model,
                    "model");
}

Result<int64_t> parse_max_model_len(const std::string& text) {
  const std::string t = trim(text);
  if (t == "-1" || lower(t) == "auto") return int64_t{0};
  const auto fail = [&] {
    return make_error(ErrorCode::kInvalidArgument,
                      "--max-model-len '" + text +
                          "' is not a token count; give e.g. 65536, 128k (x1000), 128K (x1024) "
                          "or auto",
                      "--max-model-len");
  };
  if (t.empty()) return fail();
  double mul = 1;
  std::string num = t;
  const char last = t.back();
  if (std::isalpha(static_cast<unsigned char>(last))) {
    num.pop_back();
    switch (last) {
      case 'k':
        mul = 1e3;
        break;
      case 'm':
        mul = 1e6;
        break;
      case 'g':
        mul = 1e9;
        break;
      case 'K':
        mul = 1024.0;
        break;
      case 'M':
        mul = 1024.0 * 1024;
        break;
      case 'G':
        mul = 1024.0 * 1024 * 1024;
        break;
      default:
        return fail();
    }
  }
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (num.empty() || *end != '\0' || !std::isfinite(v) || v < 0) return fail();
  const double tokens = v * mul;
  if (tokens != std::floor(tokens) || tokens > 2147483647.0) return fail();
  return static_cast<int64_t>(tokens);
}

}  // namespace m3::app
