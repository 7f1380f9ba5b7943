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
// NS-prefixed tags are structure; `<`, `&` and tags without NS are value text, except the bare
// tags listed under Recovery (a dropped NS). NAME may be "..", '..' or unquoted; it is trimmed.
// Text after NS</tool_call> is content again (another block may follow; call indexes continue).
//
// Streaming granularity: the call (id, name, "") as soon as the invoke tag is complete; then for a
// parameter whose schema type is exactly string, `{"key":"` at its open tag and its escaped
// characters as they arrive, `"` at its close tag; every other parameter (numbers, objects,
// unknown parameters...) as one `,"key":value` fragment when its close tag arrives; `}` at
// NS</invoke>. A string-typed value is text up to its closing tag or the next NS tag, decided
// only once that tag is complete, so that streamed characters are never taken back. A value
// whose opening tag was left out goes out whole when its closing tag arrives.
//
// Recovery (never crashes, never throws). Real MiniMax-M3 outputs (vLLM #51073, #51075, #47001,
// vllm-gaudi #1724) drop tags and namespace tokens; every call and well-formed parameter is kept
// and no protocol markup is left in content:
//  * openers: NS<tool_call>, <tool_call> without NS, and NS<invoke / <invoke without a block tag.
//    If what follows the opener is not an invoke, the opener and that text go back to content
//    whole. Output cut inside the opener (or right after it) is markup: dropped. A partial NS at
//    the very end is text (NS is one token, it cannot be cut).
//  * closing tags without NS close what they name: `</key>` the open parameter (or an open
//    nested element), `</invoke>`, `</tool_call>`. A bare open tag opens a parameter only when
//    it names one of the tool's (schema) parameters.
//  * text at a parameter boundary is held: if a closing tag follows, it was the value of that
//    parameter (its opening tag left out: `<invoke name="f">NSa.docxNS</filename>`); if another
//    tag follows, it was junk and is dropped; the rest of the invoke is parsed as usual.
//  * a value that runs into raw markup ends there and does not keep it: a string value ends at
//    any NS tag (a stray NS inside it is dropped); in a nested value, a tag after an element's
//    text closes that element (its closing tag was dropped), and at the top a tag naming another
//    parameter of the tool starts that parameter.
//  * junk (stray NS, unknown close tag) inside a non-string value: the unfinished parameter is
//    discarded and the invoke is skipped up to NS</invoke>, NS</tool_call> or the next invoke;
//    parameters already parsed are kept.
//  * between invokes, stray tags and NS are dropped and text is held: dropped if another invoke
//    follows (junk never loses the next call), content when the block ends.
//  * NS</invoke> or NS</tool_call> while elements are open closes them (the value is kept).
//  * a close tag naming an outer open element closes the inner ones.
//  * a new NS<invoke name=...> inside an invoke closes the current call first.
//  * a repeated top-level parameter name: the first value is kept, later ones are skipped.
//  * a stray NS</tool_call> in content is dropped.
//  * tags longer than kMaxTagBytes or nesting deeper than kMaxDepth count as junk.
// finish() (end of output, e.g. max_tokens): an open call is closed with `}` (`{}` if it has no
// parameters); complete parameters are kept; an unfinished string parameter is kept with the
// text received so far (a trailing partial NS is dropped); any other unfinished parameter is
// dropped; an invoke whose tag is incomplete produces no call.
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
    kOrphan,  // text at a parameter boundary: a value whose opening tag was left out, or junk
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
  bool step_orphan(ToolDelta& out, bool eof);
  bool fail_block(ToolDelta& out);
  void end_block(ToolDelta& out);
  void reset_block();
  void open_param(ToolDelta& out, std::string name);

  void start_call(ToolDelta& out, std::string name, bool bare);
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
  bool call_open_ = false;
  bool bare_invoke_ = false;  // its invoke tag had no NS: bare closing tags always count
  std::string call_name_;
  int num_params_ = 0;
  std::vector<std::string> param_names_;
  // The open parameter.
  std::string param_name_;
  std::vector<Frame> stack_;  // kTree: open elements, [0] is the parameter itself
  // The open block. Until its first invoke, the opener and the layout after it are kept so that
  // a block that turns out not to be one goes back to content whole.
  std::string block_text_;
  size_t invoke_opener_ = 0;  // opened by an invoke tag (no block tag): its opener's length
  int calls_in_block_ = 0;
  std::string held_junk_;  // text after an invoke: dropped if another invoke follows
  std::string orphan_;     // kOrphan: the text so far
};

}  // namespace m3::text
