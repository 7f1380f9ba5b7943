// HttpServer: the OpenAI-compatible HTTP server over one Engine: /v1/chat/completions,
// /v1/completions, /v1/responses, Anthropic's /v1/messages (JSON and SSE), /v1/models,
// /tokenize, /detokenize, /health, /ping, /load, /version, /metrics. Called by `m3serve serve`
// (app/cmd_serve.cpp). HTTP itself is HttpFront (http_front.h): an event loop that enforces
// deadlines and caps before a worker sees a request. Threads (design.md §1): each HTTP worker
// parses, renders, tokenizes, submits, then reads its RequestStreams and writes the response; the
// engine thread never waits on a socket. Invariant: every request submitted to the engine is
// finished or aborted before its handler returns, including when the client disconnects (streamed
// or not) or a drain times out.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/engine.h"
#include "server/chat_prompt.h"
#include "server/media_input.h"
#include "server/openai_request.h"
#include "text/tokenizer.h"

namespace m3::server {

struct ServerConfig {
  std::string host = "0.0.0.0";
  int port = 8000;
  std::string uds;  // non-empty: listen on this Unix domain socket (host and port unused)
  std::string response_role = "assistant";      // --response-role: chat replies' role
  std::vector<std::string> served_model_names;  // [0] is reported in responses
  std::vector<std::string> api_keys;            // empty: no auth; any one of them admits
  bool parse_reasoning = true;                  // --reasoning-parser minimax_m3
  bool parse_tool_calls = true;                 // --tool-call-parser minimax_m3
  bool enable_auto_tool_choice = true;
  std::string version = "0.0.0";
  int num_http_threads = 0;  // 0: from max_num_seqs
  int max_num_seqs = 64;
  // A drain (SIGTERM) waits this long for running requests, then aborts what is left.
  double shutdown_timeout_s = 20.0;
  int max_connections = 4096;
  int max_connections_per_client = 2048;
  double header_timeout_s = 10.0;
  double body_timeout_s = 60.0;
  double keep_alive_timeout_s = 5.0;
  size_t max_body_bytes = size_t{32} << 20;
  // CORS (--allowed-origins): empty: off (no CORS headers, preflights get 405); "*": any origin;
  // else the exact origins admitted. Browsers then get Access-Control-Allow-* on every route.
  std::vector<std::string> allowed_origins;
  bool allow_credentials = false;  // --allow-credentials
  // One line per answered request (`ADDR - "METHOD PATH HTTP/1.1" STATUS`, as vLLM's access
  // log); off with --disable-uvicorn-access-log.
  bool access_log = true;
  // Every this many seconds with work, a line of throughput, queue and KV usage (vLLM's stats
  // line; VLLM_LOG_STATS_INTERVAL); 0 (--disable-log-stats): none.
  double stats_interval_s = 10.0;
  // Image input (server/media_input.h): --allowed-local-media-path, --limit-mm-per-prompt,
  // --mm-processor-cache-gb.
  MediaConfig media;
  // --max-logprobs: the most logprobs / top_logprobs / prompt_logprobs a request may ask for.
  int32_t max_logprobs = 20;
  // --seed: requests without a 'seed' get one drawn from this seed and the request's arrival
  // number, so a server restarted with the same --seed answers the same sequence of unseeded
  // requests the same way (vLLM seeds its global generator with it). nullopt: fresh randomness.
  std::optional<uint64_t> seed;
  // --enable-log-requests: one line per generation request (id, sampling params, prompt length).
  bool log_requests = false;
  // --stream-interval: a stream's tokens are sent in chunks of this many (its first token and
  // its end at once), as vLLM; 1: a chunk per engine output.
  int stream_interval = 1;
};

// What the server reads from the model directory besides the weights.
struct ServerAssets {
  std::shared_ptr<const text::Tokenizer> tokenizer;
  std::shared_ptr<const ChatPrompt> chat;
  GenerationDefaults defaults;
};

// tokenizer.json, the chat template and generation_config.json from `model_dir`.
// `generation_config`: "auto"/"" (the model dir), "vllm" (none: OpenAI defaults), or a directory.
Result<ServerAssets> load_server_assets(const std::string& model_dir,
                                        const std::string& chat_template_path,
                                        const OrderedJson& default_chat_template_kwargs,
                                        const std::string& generation_config);

class HttpServerImpl;

class HttpServer {
 public:
  HttpServer(engine::Engine& engine, ServerAssets assets, ServerConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (port 0 picks a free one). Errors name --host / --port; a port in use is
  // "address in use", never shared.
  Status bind();
  int bound_port() const;
  // Serves until drain_and_stop(); blocks the calling thread.
  Status run();
  // Stops accepting generation requests (503), waits up to shutdown_timeout_s for the ones in
  // flight, aborts what is left, stops listening.
  void drain_and_stop();
  bool draining() const;

 private:
  std::unique_ptr<HttpServerImpl> impl_;
};

}  // namespace m3::server
