// HttpServerImpl: the state one HttpServer shares between its parts, which are split by job:
// routes.cpp (routing, auth, the small routes, tokenize/detokenize), serve_completions.cpp,
// serve_chat.cpp, http_server.cpp (context fitting, submission, drain, the public class).
// Internal to server/; only those files include it.
// Invariant: every generation handler holds an InFlight guard for as long as its engine
// requests can run (the streamed body included), so a drain waits for exactly those.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/api_error.h"
#include "server/generation_stream.h"
#include "server/http_front.h"
#include "server/http_server.h"
#include "server/response_json.h"
#include "text/structured_output.h"

namespace m3::server {

std::string random_id(size_t len);
int64_t unix_now();
void send_error(HttpResponse& res, const Error& e);
void send_json(HttpResponse& res, const Json& j, int status = 200);
// The `a == b` of secrets: time depends on the lengths only, not on where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

class HttpServerImpl {
 public:
  HttpServerImpl(engine::Engine& engine, ServerAssets assets, ServerConfig config);

  engine::Engine& engine_;
  ServerAssets assets_;
  ServerConfig cfg_;
  std::unique_ptr<HttpFront> front_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> client_aborts_{0};  // requests aborted because their client went away
  // Upper bound of the bytes one token covers (the longest vocabulary entry): a text of more
  // than max_model_len * this many bytes (x2 for normalisation) cannot fit, so it is refused
  // before it is tokenized.
  size_t max_token_bytes_ = 1;
  // Compiles structured outputs with the tokenizer's vocabulary (output_constraints.cpp); caches.
  std::unique_ptr<text::StructuredOutputCompiler> structured_;
  // Processed images by content hash (--mm-processor-cache-gb); null when the size is 0.
  std::unique_ptr<MediaCache> media_cache_;
  // The ids of "]<]start of image[>[" / "]<]end of image[>[" (media_input.h).
  std::vector<int32_t> image_start_ids_, image_end_ids_;

  const std::string& model_name() const { return cfg_.served_model_names[0]; }

  struct InFlight {
    explicit InFlight(std::atomic<int64_t>& c) : c_(c) { ++c_; }
    ~InFlight() { --c_; }
    std::atomic<int64_t>& c_;
  };

  // routes.cpp
  void route(const HttpRequest& req, HttpResponse& res);
  bool is_inline(const HttpRequest& req) const;
  void route_inline(const HttpRequest& req, HttpResponse& res);
  // CORS headers for an admitted Origin; true when it answered a preflight (OPTIONS) itself.
  bool cors(const HttpRequest& req, HttpResponse& res) const;

  // server_log.cpp: the access log line of an answered request, and the periodic stats thread
  // (started by HttpServer::run, stopped by drain_and_stop / the destructor).
  void access_log(const HttpRequest& req, const HttpResponse& res) const;
  void start_stats();
  void stop_stats();
  std::thread stats_thread_;
  std::mutex stats_mu_;
  std::condition_variable stats_cv_;
  bool stats_stop_ = false;
  bool authorized(const HttpRequest& req, HttpResponse& res) const;
  void handle_tokenize(const HttpRequest& req, HttpResponse& res);
  void handle_detokenize(const HttpRequest& req, HttpResponse& res);
  // serve_completions.cpp / serve_chat.cpp
  void handle_completions(const HttpRequest& req, HttpResponse& res);
  void handle_chat(const HttpRequest& req, HttpResponse& res);

  // http_server.cpp
  Status check_model(const std::string& model) const;
  std::vector<int32_t> encode_prompt(const std::string& text) const;
  // Refuses a text too long to fit max_model_len tokens, before tokenizing it.
  Status check_text_fits(size_t text_bytes, const std::string& param) const;
  // Fills max_tokens and checks the context length; `param` names the prompt field.
  Status fit_context(engine::SamplingParams& sp, const CommonParams& p, size_t prompt_len,
                     const std::string& param) const;
  // output_constraints.cpp: fills sp's bad_words (tokenized) and, for `spec`, its grammar
  // constraint (the format after the reasoning `prefix`). Errors name the field.
  Status apply_output_controls(engine::SamplingParams& sp, const CommonParams& p,
                               const std::optional<text::StructuredOutputSpec>& spec,
                               text::ReasoningPrefix prefix) const;
  // Submits slots for every prompt x n; on error nothing stays submitted.
  Status submit_all(Generation& gen, const engine::SamplingParams& sp, const CommonParams& p,
                    const ChoiceOptions& base) const;
  // A non-streamed generation: waits for it, aborting when the client leaves. False: gone.
  bool wait_or_abort(Generation& gen, const HttpRequest& req);
};

}  // namespace m3::server
