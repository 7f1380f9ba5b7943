// HttpServerImpl: the state one HttpServer shares between its parts, which are split by job:
// routes.cpp (routing, auth, the small routes, tokenize/detokenize), serve_completions.cpp,
// serve_chat.cpp (the chat pipeline, start_chat, and /v1/chat/completions' own JSON and SSE),
// serve_messages.cpp (/v1/messages), serve_responses.cpp (/v1/responses), both on start_chat,
// http_server.cpp (context fitting, submission, drain, the public class).
// Internal to server/; only those files include it.
// Invariant: every generation handler holds an InFlight guard for as long as its engine
// requests can run (the streamed body included), so a drain waits for exactly those.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "server/api_error.h"
#include "server/generation_stream.h"
#include "server/http_front.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/response_json.h"
#include "text/structured_output.h"

namespace m3::server {

std::string random_id(size_t len);
int64_t unix_now();
void send_error(HttpResponse& res, const Error& e);
// Anthropic's error shape {"type": "error", "error": {type, message}} (serve_messages.cpp).
void send_anthropic_error(HttpResponse& res, const Error& e);
// The error in the shape the route's clients read: Anthropic's under /v1/messages, else OpenAI's.
void send_error_for(const HttpRequest& req, HttpResponse& res, const Error& e);
void send_json(HttpResponse& res, const Json& j, int status = 200);
// The `a == b` of secrets: time depends on the lengths only, not on where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

struct ResponseStore;  // serve_responses.cpp: stored Responses conversations
// Cancels the background responses still running and waits for their threads (bounded).
void stop_background_responses(ResponseStore& store);

// A chat request submitted to the engine (start_chat): its generation and what the output
// formatting of each chat-shaped API needs.
struct ChatJob {
  std::shared_ptr<Generation> gen;
  // The tool_choice the output is checked against (auto when tools are off for the request).
  ToolChoice tool_choice;
  bool wants_tools = false;  // tools given and tool_choice is not "none": calls are parsed
  text::ThinkingMode thinking_mode = text::ThinkingMode::kAdaptive;
  // Chat `echo` (/v1/chat/completions only): the final message's content the reply continues.
  std::string echo;
  // The reply's role (vLLM's): --response-role after a generation prompt, else the final
  // message's role (add_generation_prompt false continues that message).
  std::string role = "assistant";
  UsageCounts usage() const;
};

// Required / named tool_choice are enforced by a grammar, so an output that ended by itself
// always holds the call; an error here is a broken invariant (500, "please report").
std::optional<Error> check_tool_choice(const ToolChoice& tc, const ChoiceOutput& out);

// vLLM's stop_reason of a finished choice: the matched stop string, the stop token id, or null.
Json stop_reason_json(const ChoiceOutput& out);
// vLLM's prompt_logprobs: null for the first token, then per position a map from token id to
// {logprob, rank, decoded_token} holding the prompt's token and the top k.
Json prompt_logprobs_json(const ChoiceOutput& out, const std::vector<int32_t>& ids);

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
  // routes.cpp: counts an answered request for /metrics' http_requests_total (by method, status
  // class and route, "none" for a path that is not one).
  void count_request(const HttpRequest& req, const HttpResponse& res) const;
  std::vector<HttpRequestCount> http_request_counts() const;
  mutable std::mutex http_counts_mu_;
  mutable std::map<std::tuple<std::string, std::string, std::string>, int64_t> http_counts_;
  void handle_tokenize(const HttpRequest& req, HttpResponse& res);
  void handle_detokenize(const HttpRequest& req, HttpResponse& res);
  // serve_completions.cpp / serve_chat.cpp
  void handle_completions(const HttpRequest& req, HttpResponse& res);
  void handle_chat(const HttpRequest& req, HttpResponse& res);
  // The chat pipeline every chat-shaped API shares: model and tool checks, the template,
  // tokenization, truncation, context fit, tool_choice grammars, the thinking budget, masks,
  // submission (the request log line names `request_id`).
  Result<ChatJob> start_chat(const ChatRequest& r, const std::string& request_id) const;
  // serve_messages.cpp (Anthropic) and serve_responses.cpp (OpenAI Responses).
  void handle_messages(const HttpRequest& req, HttpResponse& res);
  void handle_count_tokens(const HttpRequest& req, HttpResponse& res);
  void handle_responses(const HttpRequest& req, HttpResponse& res);
  void handle_get_response(const HttpRequest& req, HttpResponse& res);  // GET /v1/responses/{id}
  void handle_delete_response(const HttpRequest& req, HttpResponse& res);
  void handle_cancel_response(const HttpRequest& req, HttpResponse& res);  // POST .../cancel
  void handle_response_input_items(const HttpRequest& req, HttpResponse& res);
  std::shared_ptr<ResponseStore> response_store();  // made on first use
  std::mutex responses_mu_;                         // guards the creation of responses_
  std::shared_ptr<ResponseStore> responses_;        // previous_response_id's conversations
  // Cancels the background responses still running and waits (bounded) for their threads.
  ~HttpServerImpl();

  // http_server.cpp
  Status check_model(const std::string& model) const;
  std::vector<int32_t> encode_prompt(const std::string& text) const;
  // Refuses a text too long to fit max_model_len tokens, before tokenizing it.
  Status check_text_fits(size_t text_bytes, const std::string& param) const;
  // Fills max_tokens and checks the context length; `param` names the prompt field. An explicit
  // max_tokens larger than the room the prompt leaves is clamped to it (vLLM's rule: the
  // smallest of the request's max_tokens and max_model_len - prompt tokens).
  Status fit_context(engine::SamplingParams& sp, const CommonParams& p, size_t prompt_len,
                     const std::string& param) const;
  // truncate_prompt_tokens: keeps the last k ids (-1: max_model_len); k over max_model_len is
  // refused as vLLM does.
  Status truncate_prompt(std::vector<int32_t>& ids, const CommonParams& p) const;
  // output_constraints.cpp: fills sp's bad_words (tokenized) and, for `spec`, its grammar
  // constraint (the format after the reasoning `prefix`). Errors name the field.
  Status apply_output_controls(engine::SamplingParams& sp, const CommonParams& p,
                               const std::optional<text::StructuredOutputSpec>& spec,
                               text::ReasoningPrefix prefix) const;
  // thinking_token_budget: wraps sp's constraint so that </mm:think> is forced after `budget`
  // reasoning tokens (nothing to do when thinking is disabled).
  Status apply_thinking_budget(engine::SamplingParams& sp, int32_t budget,
                               text::ThinkingMode mode) const;
  // Submits slots for every prompt x n; on error nothing stays submitted. Applies --seed to
  // unseeded requests and writes the --enable-log-requests line for `request_id`.
  Status submit_all(Generation& gen, const engine::SamplingParams& sp, const CommonParams& p,
                    const ChoiceOptions& base, const std::string& request_id) const;
  // server_log.cpp: the --enable-log-requests line.
  void log_request(const std::string& request_id, const Generation& gen,
                   const engine::SamplingParams& sp, const CommonParams& p) const;
  mutable std::atomic<uint64_t> num_seeded_{0};  // unseeded requests given a --seed draw
  // A non-streamed generation: waits for it, aborting when the client leaves. False: gone.
  bool wait_or_abort(Generation& gen, const HttpRequest& req);
};

}  // namespace m3::server
