// MiniMax-M3 tool-call parser (`minimax_m3`): finds the namespace-marked tool block in generated
// content and turns each <invoke> into an OpenAI tool call with schema-typed JSON arguments,
// streaming (arbitrary deltas) or whole text.
// Called by ChatOutputParser (server output processing) on the content channel, one per request.
// Invariant: for any split of the input into deltas, the concatenated content deltas and, per
// call, the concatenated arguments deltas equal parse() of the whole text byte for byte; nothing
// streamed is ever retracted. Arguments are compact JSON objects (`{"a":1}`), keys in the order
// the model wrote them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/json_schema_types.h"

namespace m3::text {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments_json;
};

struct ToolParseResult {
  std::string content;
  std::vector<ToolCall> calls;
};

// One streamed piece of tool call `index`. id and name are set only on the call's first delta
// (sent as soon as the <invoke name=...> tag is complete, with arguments_delta possibly empty).
struct ToolCallDelta {
  int index = 0;
  std::optional<std::string> id;
  std::optional<std::string> name;
  std::string arguments_delta;
};

struct ToolDelta {
  std::string content;
  std::vector<ToolCallDelta> calls;
  bool empty() const { return content.empty() && calls.empty(); }
};

struct ToolParserOptions {
  // Call ids are id_prefix + index ("call_0", ...). The server passes a per-request unique prefix.
  std::string id_prefix = "call_";
};

// Grammar (NS = "]<]minimax[>["):
//   content* NS<tool_call> ws* ( NS<invoke name=NAME> ws* param* NS</invoke> ws* )* NS</tool_call>
//   param = NS<key>VALUE NS</key>; VALUE = raw text and/or nested param elements.
// Only NS-prefixed tags are structure: `<`, `&`, `</key>` without NS are value text. NAME may be
// "..", '..' or unquoted; it is trimmed. Text after NS</tool_call> is content again (another block
// may follow; call indexes continue).
//
// Streaming granularity: the call (id, name, "") as soon as the invoke tag is complete; then for a
// parameter whose schema type is exactly string, `{"key":"` at its open tag and its escaped
// characters as they arrive, `"` at its close tag; every other parameter (numbers, objects,
// unknown parameters...) as one `,"key":value` fragment when its close tag arrives; `}` at
// NS</invoke>. A string-typed value is taken literally up to NS</key> (other NS tags inside it
// are text) so that streamed characters are never taken back.
//
// Recovery (never crashes, never throws):
//  * junk (non-tag text, stray NS, unknown close tag) at a parameter boundary or inside a
//    non-string value: the unfinished parameter is discarded and the rest of the invoke up to
//    NS</invoke> (or NS</tool_call>) is skipped; parameters already parsed are kept.
//  * NS</invoke> or NS</tool_call> while elements are open closes them (the value is kept).
//  * a close tag naming an outer open element closes the inner ones.
//  * a new NS<invoke name=...> inside an invoke closes the current call first.
//  * a repeated top-level parameter name: the first value is kept, later ones are skipped.
//  * junk where an invoke or the block end is expected (incl. an invoke tag without a name)
//    ends the block; that text and what follows it are content.
//  * tags longer than kMaxTagBytes or nesting deeper than kMaxDepth count as junk.
// finish() (end of output, e.g. max_tokens): an open call is closed with `}` (`{}` if it has no
// parameters); complete parameters are kept; an unfinished string parameter is kept with the
// text received so far (a trailing partial NS is dropped); any other unfinished parameter is
// dropped; an invoke whose tag is incomplete produces no call; a partial block-start marker in
// content is flushed as content.
class ToolCallParser {
 public:
  static constexpr std::string_view kNamespace = "]<]minimax[>[";
  static constexpr std::string_view kToolCallStart = "]<]minimax[>[<tool_call>";
  static constexpr std::string_view kToolCallEnd = "]<]minimax[>[</tool_call>";
  static constexpr size_t kMaxTagBytes = 256;
  static constexpr size_t kMaxDepth = 128;

  explicit ToolCallParser(ToolSchemas schemas, ToolParserOptions options = {});
  // `tools` is the request's OpenAI tools array (may be null/empty: all values become strings).
  static ToolCallParser from_tools(const nlohmann::json& tools, ToolParserOptions options = {});

  ToolDelta feed(std::string_view text);
  ToolDelta finish();

  // Whole text, with a fresh parser of the same schemas and options.
  ToolParseResult parse(std::string_view text) const;

  // Inside a tool block (the server may want to know that content has stopped for now).
  bool in_tool_block() const { return state_ != State::kText; }
  int num_calls() const { return next_index_; }

 private:
  enum class State {
    kText,    // content, watching for NS<tool_call>
    kBlock,   // between invokes
    kParams,  // inside an invoke, at a parameter boundary
    kString,  // inside a string-typed top-level parameter, streaming its characters
    kTree,    // inside any other parameter, collecting its element tree
    kSkip,    // dropping the rest of a malformed invoke
  };
  struct Frame {
    std::string name;
    ParamNode node;
  };

  // One step of the state machine; false when it needs more input.
  bool step(ToolDelta& out, bool eof);
  bool step_text(ToolDelta& out, bool eof);
  bool step_block(ToolDelta& out, bool eof);
  bool step_params(ToolDelta& out, bool eof);
  bool step_string(ToolDelta& out, bool eof);
  bool step_tree(ToolDelta& out, bool eof);
  bool step_skip(ToolDelta& out, bool eof);

  void start_call(ToolDelta& out, std::string name);
  void end_call(ToolDelta& out);
  void emit_args(ToolDelta& out, std::string_view piece);
  void begin_param_key(ToolDelta& out, std::string_view key);
  void finish_tree_param(ToolDelta& out);

  ToolSchemas schemas_;
  ToolParserOptions options_;
  State state_ = State::kText;
  std::string buf_;  // unconsumed input
  int next_index_ = 0;
  // The open call.
  std::string call_name_;
  int num_params_ = 0;
  std::vector<std::string> param_names_;
  // The open parameter.
  std::string param_name_;
  std::vector<Frame> stack_;  // kTree: open elements, [0] is the parameter itself
};

}  // namespace m3::text
