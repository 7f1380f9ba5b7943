// ChatOutputParser: the server's per-request output pipeline for chat completions: the reasoning
// parser first, then the tool-call parser on the content channel only (tool calls are never
// parsed inside reasoning).
// Called by the server's output processing, one instance per choice; feed() takes detokenized
// text (special tokens rendered as text) in any pieces.
// Invariant: the concatenated deltas of any split equal parse() of the whole text.
// Two output rules live here, above both parsers: the EOS token's text `[e~[` is removed from the
// stream (it may be rendered when special tokens are detokenized as text), and when tool parsing
// is on, content that is only whitespace is held and dropped if the output made a tool call (the
// server then sends `content: null`, as vLLM does).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/reasoning_parser.h"
#include "text/tool_parser.h"

namespace m3::text {

struct ChatOutputOptions {
  bool parse_reasoning = true;  // --reasoning-parser minimax_m3
  ThinkingMode thinking_mode = ThinkingMode::kAdaptive;
  bool parse_tool_calls = false;  // tools present and tool_choice != "none"
  nlohmann::json tools;           // the request's tools array (schemas type the arguments)
  ToolParserOptions tool_options;
};

struct ChatOutputDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ChatOutputResult {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;

  // Accumulates a streamed delta (what a non-streaming response built from deltas does).
  void append(const ChatOutputDelta& delta);
};

class ChatOutputParser {
 public:
  static constexpr std::string_view kEosText = "[e~[";

  explicit ChatOutputParser(const ChatOutputOptions& options);

  ChatOutputDelta feed(std::string_view text);
  ChatOutputDelta finish();

  static ChatOutputResult parse(std::string_view text, const ChatOutputOptions& options);

  // nullptr when reasoning parsing is off. Its num_reasoning_feeds() counts reasoning tokens
  // when feed() is called once per token.
  const ReasoningParser* reasoning() const { return reasoning_ ? &*reasoning_ : nullptr; }
  const ToolCallParser* tool_calls() const { return tools_ ? &*tools_ : nullptr; }

 private:
  void route_content(std::string_view content, ChatOutputDelta& out);
  // The input minus every `[e~[`; a trailing partial `[e~[` waits in eos_hold_ until eof.
  std::string strip_eos(std::string_view text, bool eof);
  // Holds content while all of it so far is whitespace (see the header comment).
  void hold_blank_content(ChatOutputDelta& out, bool eof);

  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
  std::string eos_hold_;
  std::string blank_content_;     // content so far while it is all whitespace
  bool content_visible_ = false;  // some non-whitespace content has been sent
};

}  // namespace m3::text
