// ChoiceOutput: turns one choice's engine outputs (token ids) into what the client sees:
// incremental detokenization, stop strings, and for chat the reasoning + tool-call parsers.
// Called by HttpServer's request loop on the HTTP worker thread, one per choice; not thread-safe.
// Invariant: the concatenated deltas equal the whole-output fields (text, reasoning, tool calls);
// a stop string or a stop token never reaches the client; once finished() nothing more is added.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/stop_matcher.h"
#include "text/chat_output_parser.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace m3::server {

struct ChoiceOptions {
  std::shared_ptr<const text::Tokenizer> tokenizer;
  bool skip_special_tokens = true;
  std::vector<std::string> stop;
  bool include_stop_str = false;
  std::vector<int32_t> eos_token_ids;  // a trailing one that ended the output is not shown
  bool tokens_as_ids = false;          // return_tokens_as_token_ids: logprob tokens "token_id:N"
  // parallel_tool_calls false (Messages: disable_parallel_tool_use): calls past this many are
  // dropped from the output and its stream. 0: no limit.
  int max_tool_calls = 0;
  // Chat output parsing (reasoning and/or tool calls); nullopt: plain text (completions).
  std::optional<text::ChatOutputOptions> chat;
};

// One token's logprob entry with the token texts the API shows.
struct TokenLogprob {
  int32_t token = 0;
  std::string text;
  float logprob = 0.f;
  std::vector<std::pair<std::string, float>> top;  // best first
};

struct ChoiceDelta {
  std::string text;  // completions text, or chat content
  std::string reasoning;
  std::vector<text::ToolCallDelta> tool_calls;
  std::vector<TokenLogprob> logprobs;
  std::vector<int32_t> token_ids;  // the output tokens this delta consumed (return_token_ids)
  bool empty() const {
    return text.empty() && reasoning.empty() && tool_calls.empty() && logprobs.empty() &&
           token_ids.empty();
  }
};

class ChoiceOutput {
 public:
  explicit ChoiceOutput(ChoiceOptions options);

  // Processes one engine output (ignored once finished()).
  ChoiceDelta add(const engine::RequestOutput& out);

  // The engine finished it, or a stop string matched (then the caller aborts the engine request).
  bool finished() const { return finished_; }
  bool stop_string_hit() const { return stop_.stopped(); }
  // "stop" | "length" | "tool_calls" | "abort" | "error" (valid once finished()).
  std::string finish_reason() const;
  const std::string& error() const { return error_; }
  // vLLM's stop_reason: the stop string that matched, or the stop_token_ids entry that ended the
  // output; neither for EOS, length or abort.
  const std::optional<std::string>& stop_string() const { return stop_string_; }
  std::optional<int32_t> stop_token() const { return stop_token_; }

  int num_prompt_tokens() const { return num_prompt_tokens_; }
  int num_cached_tokens() const { return num_cached_tokens_; }
  // P/D: the params a prefill worker's final output carried (kv_transfer_params of the response).
  const std::optional<engine::KvTransferParams>& kv_transfer_params() const {
    return kv_transfer_params_;
  }
  int num_output_tokens() const { return num_output_tokens_; }
  int64_t num_reasoning_tokens() const;
  const std::vector<int32_t>& output_token_ids() const { return output_ids_; }

  // Whole output so far (the sum of the deltas).
  const std::string& text() const { return result_.content; }
  const std::string& reasoning() const { return result_.reasoning; }
  const std::vector<text::ToolCall>& tool_calls() const { return result_.tool_calls; }
  const std::vector<TokenLogprob>& logprobs() const { return logprobs_; }
  // From the first output when prompt logprobs were asked for.
  const std::optional<std::vector<std::optional<engine::TokenLogprobOut>>>& prompt_logprobs()
      const {
    return prompt_logprobs_;
  }

  // Text for one token as the logprobs fields show it.
  static std::string token_text(const text::Tokenizer& tok, int32_t id);
  // The same, or "token_id:<id>" with return_tokens_as_token_ids.
  std::string logprob_token(int32_t id) const;

 private:
  void route(std::string_view text, ChoiceDelta& delta);
  void finish_text(ChoiceDelta& delta);
  bool is_marker(int32_t id) const;
  // A tag-like special token (`<filename>`) while the tool parser is inside a tool block.
  bool is_tool_tag(int32_t id) const;
  // Drops the tool-call deltas past ChoiceOptions::max_tool_calls.
  void limit_tool_calls(text::ChatOutputDelta& d) const;

  ChoiceOptions opt_;
  text::IncrementalDetokenizer detok_;
  StopMatcher stop_;
  std::optional<text::ChatOutputParser> parser_;
  std::vector<int32_t> marker_ids_;  // parser markers, always rendered as text for the parsers
  std::vector<int32_t> tag_ids_;     // tag-like special tokens (see is_tool_tag)
  text::ChatOutputResult result_;
  std::vector<TokenLogprob> logprobs_;
  std::optional<std::vector<std::optional<engine::TokenLogprobOut>>> prompt_logprobs_;
  std::vector<int32_t> output_ids_;
  bool finished_ = false;
  std::string engine_reason_;
  std::string error_;
  std::optional<std::string> stop_string_;
  std::optional<int32_t> stop_token_;
  int num_prompt_tokens_ = 0;
  int num_cached_tokens_ = 0;
  std::optional<engine::KvTransferParams> kv_transfer_params_;
  int num_output_tokens_ = 0;
};

}  // namespace m3::server
