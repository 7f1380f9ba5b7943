// OpenAI response JSON pieces and the SSE framing: usage, logprobs (chat and completions shapes),
// tool calls, chat deltas. Called by HttpServer when it assembles responses and stream chunks.
// Invariant: pure functions of their inputs; dump() never throws (invalid UTF-8 is replaced), so
// a model emitting broken bytes cannot crash a handler.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/choice_output.h"

namespace m3::server {

using Json = nlohmann::ordered_json;

// JSON text that never throws on invalid UTF-8.
std::string dump_json(const Json& j);

// "data: <json>\n\n"
std::string sse_event(const Json& j);
// "data: [DONE]\n\n"
std::string sse_done();
// "event: <name>\ndata: <json>\n\n" (the Anthropic Messages and OpenAI Responses streams).
std::string sse_named_event(const std::string& name, const Json& j);
// One SSE event carrying the OpenAI error body (sent when a stream fails after it began).
std::string sse_error(const Error& error);

struct UsageCounts {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t reasoning_tokens = 0;
};
Json usage_json(const UsageCounts& u);

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}
Json chat_logprobs_json(const std::vector<TokenLogprob>& lps);

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; `prompt` entries
// (echo) come first, the first of them with null logprob. text_offset starts at `offset0`.
struct CompletionLogprobs {
  Json tokens = Json::array();
  Json token_logprobs = Json::array();
  Json top_logprobs = Json::array();
  Json text_offset = Json::array();
  int64_t next_offset = 0;

  void add(const std::string& token, std::optional<float> logprob,
           const std::vector<std::pair<std::string, float>>& top);
  Json to_json() const;
};

// {"id", "type": "function", "function": {"name", "arguments"}}
Json tool_call_json(const text::ToolCall& call);
// Streaming form: {"index", "id"?, "type"?, "function": {"name"?, "arguments"}}
Json tool_call_delta_json(const text::ToolCallDelta& delta);

// The chat `delta` object for one ChoiceDelta: content, reasoning (both `reasoning` and
// `reasoning_content`), tool_calls; keys only for what is present.
Json chat_delta_json(const ChoiceDelta& delta);

// UTF-8 bytes of a token's text (the `bytes` field).
Json bytes_json(const std::string& s);

}  // namespace m3::server
