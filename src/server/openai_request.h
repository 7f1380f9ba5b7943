// OpenAI request types for /v1/completions and /v1/chat/completions, parsed and validated from
// the JSON body, plus the mapping to engine::SamplingParams with the model's defaults.
// Called by HttpServer's handlers (HTTP worker threads). Invariant: a parsed request has every
// value in range; every rejection is a kInvalidArgument/kUnsupported Error whose `param` names
// the offending field (dotted path, e.g. "messages[2].content") and whose message says the fix.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/kv_transfer.h"
#include "engine/sampling_params.h"
#include "text/structured_output.h"

namespace m3::server {

using OrderedJson = nlohmann::ordered_json;

// obj[key] when obj is an object and that member is a string, else `dflt` (never throws on a
// member of another type, as nlohmann's value() does).
std::string string_member(const OrderedJson& obj, const char* key, const std::string& dflt = "");

// Sampling defaults from the model's generation_config.json (used when the request omits them).
struct GenerationDefaults {
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int32_t> top_k;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<float> presence_penalty;
  std::optional<float> frequency_penalty;
  std::optional<int32_t> max_new_tokens;

  // Reads the keys above from generation_config.json text (unknown keys ignored).
  static Result<GenerationDefaults> from_json_text(std::string_view text, std::string_view source);
  // <dir>/generation_config.json; an absent file gives empty defaults.
  static Result<GenerationDefaults> from_dir(const std::string& dir);
};

// What both endpoints share. Sampling knobs stay optional so the model defaults can fill them.
struct CommonParams {
  std::string model;  // empty: not given
  int32_t n = 1;
  bool stream = false;
  bool include_usage = false;           // stream_options.include_usage
  bool continuous_usage_stats = false;  // stream_options.continuous_usage_stats (vLLM)
  std::optional<int32_t> max_tokens;    // max_tokens / max_completion_tokens
  int32_t min_tokens = 0;
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int32_t> top_k;
  std::optional<float> min_p;
  std::optional<float> presence_penalty;
  std::optional<float> frequency_penalty;
  std::optional<float> repetition_penalty;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;  // non-empty strings
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
  int32_t priority = 0;
  int32_t logprobs = -1;  // -1 none; k >= 0: chosen token + top k
  // Structured outputs: response_format (json_object / json_schema), structured_outputs {json,
  // regex, choice, grammar, json_object}, or the deprecated guided_* fields; at most one.
  std::optional<text::StructuredOutputSpec> structured;
  std::vector<std::pair<int32_t, float>> logit_bias;  // clamped to [-100, 100]
  std::vector<int32_t> allowed_token_ids;
  std::vector<std::string> bad_words;  // tokenized by the handler
  // vLLM's extra fields. truncate_prompt_tokens: keep only the last k prompt tokens (-1: the
  // last max_model_len); checked against max_model_len by the handler.
  std::optional<int64_t> truncate_prompt_tokens;
  int32_t prompt_logprobs = -1;             // -1 none; k >= 0: each prompt token's + top k
  bool return_token_ids = false;            // prompt_token_ids and token_ids in the response
  bool return_tokens_as_token_ids = false;  // logprob tokens written "token_id:<id>"
  // vLLM's kv_transfer_params (P/D disaggregation): set when do_remote_decode or
  // do_remote_prefill is true; the other fields as the prefill worker's response gave them.
  std::optional<engine::KvTransferParams> kv_transfer;
};

// kv_transfer_params as a response carries it (vLLM's NixlConnector field names).
OrderedJson kv_transfer_params_json(const engine::KvTransferParams& k);

// One completions prompt: text, or token ids.
struct PromptInput {
  bool is_text = true;
  std::string text;
  std::vector<int32_t> token_ids;
};

struct CompletionRequest {
  CommonParams common;
  std::vector<PromptInput> prompts;  // at least one
  bool echo = false;
};

enum class ToolChoiceKind { kAuto, kNone, kRequired, kNamed };

struct ToolChoice {
  ToolChoiceKind kind = ToolChoiceKind::kAuto;
  std::string name;  // kNamed
};

// An image or video content part of a chat message (vision input, server/media_input.h).
struct MediaPart {
  std::string kind;   // "image" or "video"
  std::string url;    // data: URL, file:// URL or path, or a remote URL (refused)
  std::string param;  // where it was, e.g. "messages[0].content[1]"
};

struct ChatRequest {
  CommonParams common;
  OrderedJson messages;  // validated array of {role, content, ...}; content normalised to string
  OrderedJson tools;     // null or a validated array of {"type":"function","function":{...}}
  ToolChoice tool_choice;
  bool tool_choice_given = false;
  OrderedJson chat_template_kwargs = OrderedJson::object();
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  bool logprobs = false;
  int32_t top_logprobs = 0;
  std::vector<MediaPart> media;                  // image / video parts of every message, in order
  bool include_reasoning = true;                 // false: reasoning is parsed out, not returned
  std::optional<int32_t> thinking_token_budget;  // reasoning tokens before </mm:think> is forced
  bool echo = false;  // prepend the final message's content when it is the reply's role
  // false: at most one tool call is returned (the first the model makes; later ones are dropped
  // from content and the stream alike, ChoiceOptions::max_tool_calls).
  bool parallel_tool_calls = true;
};

// Default maximum of logprobs / top_logprobs / prompt_logprobs (vLLM's --max-logprobs 20).
inline constexpr int32_t kMaxLogprobs = 20;
inline constexpr int32_t kMaxN = 128;

// `max_logprobs` (the server's --max-logprobs) bounds logprobs, top_logprobs and
// prompt_logprobs; above it the request is refused with vLLM's message.
Result<CompletionRequest> parse_completion_request(std::string_view body,
                                                   int32_t max_logprobs = kMaxLogprobs);
Result<ChatRequest> parse_chat_request(std::string_view body, int32_t max_logprobs = kMaxLogprobs);

// Request values first, then the model's generation_config defaults, then OpenAI defaults
// (temperature 1, top_p 1). max_tokens is filled by the caller (it depends on the prompt).
engine::SamplingParams make_sampling_params(const CommonParams& params,
                                            const GenerationDefaults& defaults);

}  // namespace m3::server
