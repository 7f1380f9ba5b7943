#include "text/chat_output_parser.h"

#include <algorithm>

#include "core/check.h"
#include "text/marker_scan.h"

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

std::string ChatOutputParser::strip_eos(std::string_view text, bool eof) {
  eos_hold_.append(text);
  std::string out;
  size_t pos = 0;
  for (size_t at; (at = eos_hold_.find(kEosText, pos)) != std::string::npos;
       pos = at + kEosText.size()) {
    out.append(eos_hold_, pos, at - pos);
  }
  const std::string_view rest = std::string_view(eos_hold_).substr(pos);
  const size_t hold = eof ? 0 : partial_marker_len(rest, kEosText);
  out.append(rest.substr(0, rest.size() - hold));
  eos_hold_.erase(0, eos_hold_.size() - hold);
  return out;
}

void ChatOutputParser::hold_blank_content(ChatOutputDelta& out, bool eof) {
  // Without tool parsing there is no call for blank content to stand beside: nothing is held.
  if (!tools_ || content_visible_) return;
  blank_content_ += out.content;
  out.content.clear();
  const bool blank = std::all_of(blank_content_.begin(), blank_content_.end(), is_ascii_ws);
  if (!blank) {
    content_visible_ = true;
    out.content = std::move(blank_content_);
    blank_content_.clear();
  } else if (eof) {
    if (tools_->num_calls() == 0) out.content = std::move(blank_content_);
    blank_content_.clear();
  }
}

ChatOutputDelta ChatOutputParser::feed(std::string_view text) {
  const std::string clean = strip_eos(text, /*eof=*/false);
  ChatOutputDelta out;
  if (reasoning_) {
    ReasoningDelta r = reasoning_->feed(clean);
    out.reasoning = std::move(r.reasoning);
    route_content(r.content, out);
  } else {
    route_content(clean, out);
  }
  hold_blank_content(out, /*eof=*/false);
  return out;
}

ChatOutputDelta ChatOutputParser::finish() {
  const std::string rest = strip_eos("", /*eof=*/true);  // a partial `[e~[` is text
  ChatOutputDelta out;
  if (reasoning_) {
    // Fed only when non-empty: an extra feed() would count as one more reasoning token.
    ReasoningDelta a = rest.empty() ? ReasoningDelta{} : reasoning_->feed(rest);
    ReasoningDelta r = reasoning_->finish();
    out.reasoning = std::move(a.reasoning) + r.reasoning;
    route_content(a.content + r.content, out);
  } else {
    route_content(rest, out);
  }
  if (tools_) {
    ToolDelta d = tools_->finish();
    out.content += d.content;
    for (auto& c : d.calls) out.tool_calls.push_back(std::move(c));
  }
  hold_blank_content(out, /*eof=*/true);
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
