#include "text/tool_parser.h"

#include <algorithm>
#include <utility>

#include "core/check.h"
#include "text/marker_scan.h"

namespace m3::text {
namespace {

constexpr std::string_view kNs = ToolCallParser::kNamespace;
constexpr std::string_view kInvokeEnd = "]<]minimax[>[</invoke>";

bool is_ws(char c) { return is_ascii_ws(c); }
std::string_view trim(std::string_view s) { return trim_ascii_ws(s); }

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

enum class TagStatus { kIncomplete, kJunk, kTag };

struct Tag {
  TagStatus status = TagStatus::kJunk;
  bool closing = false;
  std::string_view name;  // raw text between `<` or `</` and `>`
  size_t length = 0;      // bytes from the start of NS through `>`
};

// Reads `NS<name>` or `NS</name>` at the start of `s` (which starts with NS). A tag is junk if
// the byte after NS is not `<`, the name is blank, contains `<` (a following NS would), or has no
// `>` within kMaxTagBytes; it is incomplete while more input could still make it a tag.
Tag read_tag(std::string_view s) {
  Tag tag;
  size_t i = kNs.size();
  if (i >= s.size()) return Tag{TagStatus::kIncomplete};
  if (s[i] != '<') return tag;
  ++i;
  if (i >= s.size()) return Tag{TagStatus::kIncomplete};
  if (s[i] == '/') {
    tag.closing = true;
    ++i;
  }
  const size_t name_start = i;
  const size_t limit = std::min(s.size(), kNs.size() + ToolCallParser::kMaxTagBytes);
  for (; i < limit; ++i) {
    if (s[i] == '<') return tag;
    if (s[i] == '>') {
      tag.name = s.substr(name_start, i - name_start);
      if (trim(tag.name).empty()) return Tag{};
      tag.status = TagStatus::kTag;
      tag.length = i + 1;
      return tag;
    }
  }
  if (limit == kNs.size() + ToolCallParser::kMaxTagBytes) return Tag{};
  return Tag{TagStatus::kIncomplete};
}

// `invoke name="f"` / `invoke name='f'` / `invoke name=f` -> "f" (trimmed); nullopt otherwise.
std::optional<std::string> invoke_name(std::string_view raw) {
  constexpr std::string_view kInvoke = "invoke";
  if (!starts_with(raw, kInvoke) || raw.size() == kInvoke.size() || !is_ws(raw[kInvoke.size()]))
    return std::nullopt;
  std::string_view rest = trim(raw.substr(kInvoke.size()));
  if (!starts_with(rest, "name")) return std::nullopt;
  rest = trim(rest.substr(4));
  if (!starts_with(rest, "=")) return std::nullopt;
  rest = trim(rest.substr(1));
  std::string_view value = rest;
  if (!rest.empty() && (rest.front() == '"' || rest.front() == '\'')) {
    const size_t close = rest.find(rest.front(), 1);
    if (close == std::string_view::npos) return std::nullopt;
    value = rest.substr(1, close - 1);
  }
  value = trim(value);
  if (value.empty()) return std::nullopt;
  return std::string(value);
}

std::string quoted_key(std::string_view key) {
  std::string out = "\"";
  json_escape_append(utf8_sanitize(key), out);
  out += '"';
  return out;
}

}  // namespace

ToolCallParser::ToolCallParser(ToolSchemas schemas, ToolParserOptions options)
    : schemas_(std::move(schemas)), options_(std::move(options)) {}

ToolCallParser ToolCallParser::from_tools(const nlohmann::json& tools, ToolParserOptions options) {
  return ToolCallParser(ToolSchemas::from_openai_tools(tools), std::move(options));
}

ToolDelta ToolCallParser::feed(std::string_view text) {
  buf_.append(text);
  ToolDelta out;
  while (step(out, /*eof=*/false)) {
  }
  return out;
}

ToolDelta ToolCallParser::finish() {
  ToolDelta out;
  while (step(out, /*eof=*/true)) {
  }
  switch (state_) {
    case State::kText:
    case State::kBlock:
      break;
    case State::kString:
      emit_args(out, "\"");
      end_call(out);
      break;
    case State::kTree:
      stack_.clear();  // unfinished non-string value: never streamed, dropped
      end_call(out);
      break;
    case State::kParams:
    case State::kSkip:
      end_call(out);
      break;
  }
  state_ = State::kText;
  buf_.clear();
  return out;
}

ToolParseResult ToolCallParser::parse(std::string_view text) const {
  ToolCallParser p(schemas_, options_);
  ToolParseResult result;
  const auto absorb = [&result](const ToolDelta& d) {
    result.content += d.content;
    for (const auto& c : d.calls) {
      if (c.name.has_value()) {
        ToolCall call;
        call.id = c.id.value_or(std::string());
        call.name = *c.name;
        result.calls.push_back(std::move(call));
      }
      M3_CHECK(c.index >= 0 && static_cast<size_t>(c.index) < result.calls.size(),
               "arguments for unannounced tool call %d", c.index);
      result.calls[static_cast<size_t>(c.index)].arguments_json += c.arguments_delta;
    }
  };
  absorb(p.feed(text));
  absorb(p.finish());
  return result;
}

bool ToolCallParser::step(ToolDelta& out, bool eof) {
  if (buf_.empty()) return false;
  switch (state_) {
    case State::kText:
      return step_text(out, eof);
    case State::kBlock:
      return step_block(out, eof);
    case State::kParams:
      return step_params(out, eof);
    case State::kString:
      return step_string(out, eof);
    case State::kTree:
      return step_tree(out, eof);
    case State::kSkip:
      return step_skip(out, eof);
  }
  return false;
}

bool ToolCallParser::step_text(ToolDelta& out, bool eof) {
  const size_t start = buf_.find(kToolCallStart);
  if (start != std::string::npos) {
    out.content.append(buf_, 0, start);
    buf_.erase(0, start + kToolCallStart.size());
    state_ = State::kBlock;
    return true;
  }
  const size_t hold = eof ? 0 : partial_marker_len(buf_, kToolCallStart);
  out.content.append(buf_, 0, buf_.size() - hold);
  buf_.erase(0, buf_.size() - hold);
  return false;
}

bool ToolCallParser::step_block(ToolDelta& out, bool eof) {
  size_t ws = 0;
  while (ws < buf_.size() && is_ws(buf_[ws])) ++ws;
  buf_.erase(0, ws);  // whitespace between invokes is layout
  if (buf_.empty()) return false;
  if (!starts_with(buf_, kNs)) {
    if (is_proper_prefix(buf_, kNs)) {
      if (eof) buf_.clear();  // a truncated marker
      return false;
    }
    state_ = State::kText;  // junk ends the block; it is content
    return true;
  }
  const Tag tag = read_tag(buf_);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  if (tag.status == TagStatus::kTag) {
    if (tag.closing && tag.name == "tool_call") {
      buf_.erase(0, tag.length);
      state_ = State::kText;
      return true;
    }
    if (!tag.closing) {
      if (auto name = invoke_name(tag.name)) {
        start_call(out, std::move(*name));
        buf_.erase(0, tag.length);
        state_ = State::kParams;
        return true;
      }
    }
  }
  state_ = State::kText;
  return true;
}

bool ToolCallParser::step_params(ToolDelta& out, bool eof) {
  size_t ws = 0;
  while (ws < buf_.size() && is_ws(buf_[ws])) ++ws;
  buf_.erase(0, ws);
  if (buf_.empty()) return false;
  if (!starts_with(buf_, kNs)) {
    if (is_proper_prefix(buf_, kNs)) {
      if (eof) buf_.clear();
      return false;
    }
    state_ = State::kSkip;  // text at a parameter boundary: drop the rest of this invoke
    return true;
  }
  const Tag tag = read_tag(buf_);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  if (tag.status == TagStatus::kJunk) {
    state_ = State::kSkip;
    return true;
  }
  if (tag.closing) {
    if (tag.name == "invoke" || tag.name == "tool_call") {
      const bool block_end = tag.name == "tool_call";
      buf_.erase(0, tag.length);
      end_call(out);
      state_ = block_end ? State::kText : State::kBlock;
      return true;
    }
    state_ = State::kSkip;
    return true;
  }
  if (auto name = invoke_name(tag.name)) {  // the previous invoke was never closed
    buf_.erase(0, tag.length);
    end_call(out);
    start_call(out, std::move(*name));
    return true;
  }
  param_name_ = std::string(tag.name);
  buf_.erase(0, tag.length);
  const bool duplicate =
      std::find(param_names_.begin(), param_names_.end(), param_name_) != param_names_.end();
  const ParamType* type = schemas_.find(call_name_, param_name_);
  if (!duplicate && type != nullptr && type->kind == ParamKind::kString) {
    begin_param_key(out, param_name_);
    emit_args(out, "\"");
    state_ = State::kString;
  } else {
    stack_.clear();
    stack_.push_back(Frame{param_name_, {}});
    state_ = State::kTree;
  }
  return true;
}

bool ToolCallParser::step_string(ToolDelta& out, bool eof) {
  const size_t ns = buf_.find(kNs);
  size_t text_end = ns;
  if (ns == std::string::npos) text_end = buf_.size() - partial_marker_len(buf_, kNs);
  if (text_end > 0) {
    // Bytes before a (possible) marker are final; at the very end of the buffer a UTF-8
    // sequence may still be incomplete and waits for the next delta.
    const bool final = eof || text_end < buf_.size();
    std::string clean;
    const size_t consumed =
        utf8_sanitize_append(std::string_view(buf_).substr(0, text_end), final, clean);
    std::string escaped;
    json_escape_append(clean, escaped);
    if (!escaped.empty()) emit_args(out, escaped);
    buf_.erase(0, consumed);
    if (consumed < text_end) return false;
  }
  if (ns == std::string::npos) {
    if (eof) buf_.clear();  // a truncated marker
    return false;
  }
  // buf_ starts with NS.
  const std::string close_tag = std::string(kNs) + "</" + param_name_ + ">";
  bool maybe_marker = false;
  for (std::string_view end : {std::string_view(close_tag), kInvokeEnd, kToolCallEnd}) {
    if (starts_with(buf_, end)) {
      buf_.erase(0, end.size());
      emit_args(out, "\"");
      if (end == close_tag) {
        state_ = State::kParams;
      } else {
        end_call(out);
        state_ = end == kToolCallEnd ? State::kText : State::kBlock;
      }
      return true;
    }
    maybe_marker = maybe_marker || is_proper_prefix(buf_, end);
  }
  if (maybe_marker) {
    if (eof) buf_.clear();
    return false;
  }
  // Any other NS tag inside a string value is literal text (it was the model's value).
  std::string escaped;
  json_escape_append(kNs, escaped);
  emit_args(out, escaped);
  buf_.erase(0, kNs.size());
  return true;
}

bool ToolCallParser::step_tree(ToolDelta& out, bool eof) {
  const size_t ns = buf_.find(kNs);
  if (ns != 0) {
    size_t text_end = ns;
    if (ns == std::string::npos) text_end = buf_.size() - partial_marker_len(buf_, kNs);
    stack_.back().node.text.append(buf_, 0, text_end);
    buf_.erase(0, text_end);
    if (ns == std::string::npos) {
      if (eof) buf_.clear();
      return false;
    }
  }
  const Tag tag = read_tag(buf_);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  const auto discard = [&] {
    stack_.clear();
    state_ = State::kSkip;
    return true;
  };
  if (tag.status == TagStatus::kJunk) return discard();
  // Folds the innermost open element into its parent.
  const auto pop = [&] {
    Frame f = std::move(stack_.back());
    stack_.pop_back();
    stack_.back().node.children.emplace_back(std::move(f.name), std::move(f.node));
  };
  if (tag.closing) {
    size_t k = stack_.size();
    while (k > 0 && stack_[k - 1].name != tag.name) --k;
    if (k > 0) {  // closes element k-1 (and any unclosed ones inside it)
      buf_.erase(0, tag.length);
      while (stack_.size() > k) pop();
      if (stack_.size() > 1) {
        pop();
      } else {
        finish_tree_param(out);
        state_ = State::kParams;
      }
      return true;
    }
    if (tag.name == "invoke" || tag.name == "tool_call") {
      buf_.erase(0, tag.length);
      while (stack_.size() > 1) pop();
      finish_tree_param(out);
      end_call(out);
      state_ = tag.name == "tool_call" ? State::kText : State::kBlock;
      return true;
    }
    return discard();
  }
  if (auto name = invoke_name(tag.name)) {  // param and invoke left open: a new call starts
    buf_.erase(0, tag.length);
    while (stack_.size() > 1) pop();
    finish_tree_param(out);
    end_call(out);
    start_call(out, std::move(*name));
    state_ = State::kParams;
    return true;
  }
  if (stack_.size() >= kMaxDepth) return discard();
  stack_.push_back(Frame{std::string(tag.name), {}});
  buf_.erase(0, tag.length);
  return true;
}

bool ToolCallParser::step_skip(ToolDelta& out, bool eof) {
  const size_t ns = buf_.find(kNs);
  if (ns == std::string::npos) {
    const size_t hold = eof ? 0 : partial_marker_len(buf_, kNs);
    buf_.erase(0, buf_.size() - hold);
    return false;
  }
  buf_.erase(0, ns);
  for (std::string_view end : {kInvokeEnd, kToolCallEnd}) {
    if (starts_with(buf_, end)) {
      buf_.erase(0, end.size());
      end_call(out);
      state_ = end == kToolCallEnd ? State::kText : State::kBlock;
      return true;
    }
  }
  if (is_proper_prefix(buf_, kInvokeEnd) || is_proper_prefix(buf_, kToolCallEnd)) {
    if (eof) buf_.clear();
    return false;
  }
  buf_.erase(0, kNs.size());
  return true;
}

void ToolCallParser::start_call(ToolDelta& out, std::string name) {
  // Filled in place: moving a ToolCallDelta trips a GCC 12 maybe-uninitialized false positive.
  ToolCallDelta& d = out.calls.emplace_back();
  d.index = next_index_++;
  d.id = options_.id_prefix + std::to_string(d.index);
  d.name = name;
  call_name_ = std::move(name);
  num_params_ = 0;
  param_names_.clear();
}

void ToolCallParser::end_call(ToolDelta& out) {
  emit_args(out, num_params_ == 0 ? "{}" : "}");
  call_name_.clear();
  num_params_ = 0;
  param_names_.clear();
  stack_.clear();
}

void ToolCallParser::emit_args(ToolDelta& out, std::string_view piece) {
  const int index = next_index_ - 1;
  if (out.calls.empty() || out.calls.back().index != index) out.calls.emplace_back().index = index;
  out.calls.back().arguments_delta.append(piece);
}

void ToolCallParser::begin_param_key(ToolDelta& out, std::string_view key) {
  std::string piece = num_params_ == 0 ? "{" : ",";
  piece += quoted_key(key);
  piece += ':';
  emit_args(out, piece);
  ++num_params_;
  param_names_.emplace_back(key);
}

void ToolCallParser::finish_tree_param(ToolDelta& out) {
  Frame root = std::move(stack_.front());
  stack_.clear();
  if (std::find(param_names_.begin(), param_names_.end(), root.name) != param_names_.end())
    return;  // a repeated parameter: the first value stands
  const OrderedJson value = convert_param(root.node, schemas_.find(call_name_, root.name));
  begin_param_key(out, root.name);
  emit_args(out, dump_compact(value));
}

}  // namespace m3::text
