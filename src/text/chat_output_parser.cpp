#include "text/chat_output_parser.h"

#include "core/check.h"

namespace m3::text {

void ChatOutputResult::append(const ChatOutputDelta& delta) {
  reasoning += delta.reasoning;
  content += delta.content;
  for (const auto& d : delta.tool_calls) {
    if (d.name) {
      M3_CHECK(static_cast<size_t>(d.index) == tool_calls.size(), "tool call index %d out of order",
               d.index);
      tool_calls.push_back(ToolCall{d.id.value_or(""), *d.name, ""});
    }
    M3_CHECK(d.index >= 0 && static_cast<size_t>(d.index) < tool_calls.size(),
             "arguments for unknown tool call %d", d.index);
    tool_calls[static_cast<size_t>(d.index)].arguments_json += d.arguments_delta;
  }
}

ChatOutputParser::ChatOutputParser(const ChatOutputOptions& options) {
  if (options.parse_reasoning) reasoning_.emplace(options.thinking_mode);
  if (options.parse_tool_calls)
    tools_.emplace(ToolCallParser::from_tools(options.tools, options.tool_options));
}

void ChatOutputParser::route_content(std::string_view content, ChatOutputDelta& out) {
  if (!tools_) {
    out.content.append(content);
    return;
  }
  ToolDelta d = tools_->feed(content);
  out.content += d.content;
  for (auto& c : d.calls) out.tool_calls.push_back(std::move(c));
}

ChatOutputDelta ChatOutputParser::feed(std::string_view text) {
  ChatOutputDelta out;
  if (reasoning_) {
    ReasoningDelta r = reasoning_->feed(text);
    out.reasoning = std::move(r.reasoning);
    route_content(r.content, out);
  } else {
    route_content(text, out);
  }
  return out;
}

ChatOutputDelta ChatOutputParser::finish() {
  ChatOutputDelta out;
  if (reasoning_) {
    ReasoningDelta r = reasoning_->finish();
    out.reasoning = std::move(r.reasoning);
    route_content(r.content, out);
  }
  if (tools_) {
    ToolDelta d = tools_->finish();
    out.content += d.content;
    for (auto& c : d.calls) out.tool_calls.push_back(std::move(c));
  }
  return out;
}

ChatOutputResult ChatOutputParser::parse(std::string_view text, const ChatOutputOptions& options) {
  ChatOutputParser p(options);
  ChatOutputResult result;
  result.append(p.feed(text));
  result.append(p.finish());
  return result;
}

}  // namespace m3::text
