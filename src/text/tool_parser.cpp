#include "text/tool_parser.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "core/check.h"
#include "text/marker_scan.h"

namespace m3::text {
namespace {

constexpr std::string_view kNs = ToolCallParser::kNamespace;
// Openers real outputs write besides NS<tool_call>: the block tag without NS, or an invoke with
// or without NS and no block tag at all.
constexpr std::string_view kBareToolCallStart = "<tool_call>";
constexpr std::string_view kNsInvoke = "]<]minimax[>[<invoke";
constexpr std::string_view kBareInvoke = "<invoke ";
constexpr std::string_view kBareInvokeEnd = "</invoke>";
constexpr std::string_view kBareToolCallEnd = "</tool_call>";

bool is_ws(char c) {
  return is_ascii_ws(c);
}
std::string_view trim(std::string_view s) {
  return trim_ascii_ws(s);
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

enum class TagStatus { kIncomplete, kJunk, kTag };

struct Tag {
  TagStatus status = TagStatus::kJunk;
  bool closing = false;
  std::string name;   // raw text between `<` or `</` and `>` (a copy: buf_ is erased under it)
  size_t length = 0;  // bytes from the start of NS through `>`
};

// Reads `NS<name>` / `NS</name>` at the start of `s` (prefix = NS size), or the same tag written
// without the namespace token (prefix = 0). A tag is junk if the byte after the prefix is not
// `<`, the name is blank, contains `<` (a following NS would), or has no `>` within kMaxTagBytes;
// it is incomplete while more input could still make it a tag.
Tag read_tag(std::string_view s, size_t prefix = kNs.size()) {
  Tag tag;
  size_t i = prefix;
  if (i >= s.size()) return Tag{TagStatus::kIncomplete, false, {}, 0};
  if (s[i] != '<') return tag;
  ++i;
  if (i >= s.size()) return Tag{TagStatus::kIncomplete, false, {}, 0};
  if (s[i] == '/') {
    tag.closing = true;
    ++i;
  }
  const size_t name_start = i;
  const size_t limit = std::min(s.size(), prefix + ToolCallParser::kMaxTagBytes);
  for (; i < limit; ++i) {
    if (s[i] == '<') return tag;
    if (s[i] == '>') {
      tag.name = std::string(s.substr(name_start, i - name_start));
      if (trim(tag.name).empty()) return Tag{};
      tag.status = TagStatus::kTag;
      tag.length = i + 1;
      return tag;
    }
  }
  if (limit == prefix + ToolCallParser::kMaxTagBytes) return Tag{};
  return Tag{TagStatus::kIncomplete, false, {}, 0};
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

// The earliest of `markers` in `s` that is safe to act on, and how many bytes before it are
// plain text. A marker found at `pos` is only acted on when no longer marker could still start
// before it (a partial match at the end of `s` that begins earlier): then `found` stays empty and
// `text_end` stops where that partial begins. At eof nothing is partial.
struct Scan {
  size_t text_end = 0;
  std::string_view found;  // empty: no marker (yet)
};

Scan scan(std::string_view s, std::initializer_list<std::string_view> markers, bool eof) {
  size_t pos = std::string_view::npos;
  std::string_view found;
  for (std::string_view m : markers) {
    const size_t at = s.find(m);
    if (at < pos || (at == pos && at != std::string_view::npos && m.size() > found.size())) {
      pos = at;
      found = m;
    }
  }
  const size_t hold = eof ? 0 : partial_marker_len(s, markers);
  const size_t safe = s.size() - hold;
  if (pos != std::string_view::npos && pos <= safe) return Scan{pos, found};
  return Scan{std::min(safe, pos), {}};
}

// Whether a closing tag written without NS, ending at `end` in `s`, is structure. In an invoke
// written with NS tags a bare `</key>` is usually value text (code, HTML: vLLM #44060), so it
// counts only when NS (or the end of the output) comes next, possibly after bare </invoke> /
// </tool_call> closers; in an invoke opened without NS
// (`<invoke name=..>`) it always counts. `s` starts with the bare tag. Followed by the same tag
// with NS (`Paris</city>NS</city>`), the bare one was the value's text.
enum class Verdict { kMore, kYes, kNo };
Verdict bare_close_counts(std::string_view s, size_t end, bool eof, bool bare_invoke) {
  if (bare_invoke) return Verdict::kYes;
  const std::string own = std::string(kNs) + std::string(s.substr(0, end));
  while (end < s.size() && is_ws(s[end])) ++end;
  std::string_view rest = s.substr(end);
  if (rest.empty()) return eof ? Verdict::kYes : Verdict::kMore;
  if (starts_with(rest, own)) return Verdict::kNo;
  if (!eof && is_proper_prefix(rest, own)) return Verdict::kMore;
  // The invoke's or the block's closer written without NS too (`<days>40</days></invoke>\nNS`):
  // structure when NS or the end of the output follows the bare closers (value text that merely
  // contains `</key></invoke>` goes on with more text).
  bool chained = false;
  for (;;) {
    bool advanced = false;
    for (std::string_view closer : {kBareInvokeEnd, kBareToolCallEnd}) {
      if (starts_with(rest, closer)) {
        size_t at = closer.size();
        while (at < rest.size() && is_ws(rest[at])) ++at;
        rest.remove_prefix(at);
        advanced = chained = true;
        break;
      }
      if (!eof && is_proper_prefix(rest, closer)) return Verdict::kMore;
    }
    if (!advanced) break;
    if (rest.empty()) return eof ? Verdict::kYes : Verdict::kMore;
  }
  if (starts_with(rest, kNs)) return Verdict::kYes;
  if (chained && !eof && is_proper_prefix(rest, kNs)) return Verdict::kMore;
  return Verdict::kNo;
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
      break;
    case State::kBlock:
      // Cut inside (or right after) the opener: markup, dropped. After calls, text held
      // between the last invoke and the end was the model's content.
      if (calls_in_block_ > 0) out.content += held_junk_;
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
    case State::kOrphan:  // a value that never met its closing tag: dropped
      end_call(out);
      break;
  }
  reset_block();
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
    case State::kOrphan:
      return step_orphan(out, eof);
  }
  return false;
}

void ToolCallParser::reset_block() {
  block_text_.clear();
  held_junk_.clear();
  calls_in_block_ = 0;
  invoke_opener_ = 0;
}

void ToolCallParser::end_block(ToolDelta& out) {
  if (calls_in_block_ > 0) out.content += held_junk_;
  reset_block();
  state_ = State::kText;
}

bool ToolCallParser::step_text(ToolDelta& out, bool eof) {
  // eof=false even at eof: what a partial opener left at the end is, is decided below.
  const Scan s =
      scan(buf_, {kToolCallStart, kToolCallEnd, kBareToolCallStart, kNsInvoke, kBareInvoke}, false);
  out.content.append(buf_, 0, s.text_end);
  buf_.erase(0, s.text_end);
  if (s.found.empty()) {
    // At eof the held bytes are a cut-off opener. NS and <tool_call> are single tokens, so a
    // partial of either is the model's text; once NS is complete it is markup and dropped.
    if (eof && buf_.size() <= kNs.size()) out.content += buf_;
    if (eof) buf_.clear();
    return false;
  }
  reset_block();
  if (s.found == kToolCallEnd) {  // a stray block end is markup
    buf_.erase(0, s.found.size());
    return true;
  }
  if (s.found == kNsInvoke || s.found == kBareInvoke) {
    invoke_opener_ = s.found.size();  // the invoke tag itself is read by step_block
  } else {
    block_text_.assign(s.found);  // given back to content if no call follows
    buf_.erase(0, s.found.size());
  }
  state_ = State::kBlock;
  return true;
}

bool ToolCallParser::fail_block(ToolDelta& out) {
  // What followed the opener is not a call: the opener and that text are content, whole.
  out.content += block_text_;
  if (invoke_opener_ > 0) {  // buf_ still starts with the invoke opener: step past it
    out.content.append(buf_, 0, invoke_opener_);
    buf_.erase(0, invoke_opener_);
  }
  reset_block();
  state_ = State::kText;
  return true;
}

bool ToolCallParser::step_block(ToolDelta& out, bool eof) {
  size_t ws = 0;
  while (ws < buf_.size() && is_ws(buf_[ws])) ++ws;
  if (calls_in_block_ == 0) block_text_.append(buf_, 0, ws);
  // Whitespace between invokes is layout, but inside held text it is text (whatever the split).
  if (!held_junk_.empty()) held_junk_.append(buf_, 0, ws);
  buf_.erase(0, ws);
  if (buf_.empty()) return false;
  const bool ns = starts_with(buf_, kNs);
  if (!ns && buf_[0] != '<') {
    if (is_proper_prefix(buf_, kNs)) {
      if (eof) buf_.clear();  // a truncated marker
      return false;
    }
    if (calls_in_block_ == 0) return fail_block(out);
    // Text after an invoke: held; dropped if another invoke follows, content otherwise.
    const Scan s = scan(buf_, {kNs, "<"}, eof);
    held_junk_.append(buf_, 0, s.text_end);
    buf_.erase(0, s.text_end);
    return s.text_end > 0;
  }
  const Tag tag = read_tag(buf_, ns ? kNs.size() : 0);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();  // cut inside a tag: markup, dropped
    return false;
  }
  if (tag.status == TagStatus::kTag) {
    if (tag.name == "tool_call") {
      const std::string_view raw = std::string_view(buf_).substr(0, tag.length);
      if (tag.closing) {
        buf_.erase(0, tag.length);
        end_block(out);
        return true;
      }
      if (calls_in_block_ == 0) block_text_.append(raw);  // a repeated opener is layout
      buf_.erase(0, tag.length);
      return true;
    }
    if (!tag.closing) {
      if (auto name = invoke_name(tag.name)) {
        start_call(out, std::move(*name), !ns);
        buf_.erase(0, tag.length);
        block_text_.clear();
        held_junk_.clear();
        invoke_opener_ = 0;
        ++calls_in_block_;
        state_ = State::kParams;
        return true;
      }
    }
  }
  if (calls_in_block_ == 0) return fail_block(out);
  // A stray tag or NS between invokes is markup and dropped; a bare `<` that is no tag is text.
  if (tag.status == TagStatus::kTag) {
    buf_.erase(0, tag.length);
  } else if (ns) {
    buf_.erase(0, kNs.size());
  } else {
    held_junk_ += buf_[0];
    buf_.erase(0, 1);
  }
  return true;
}

bool ToolCallParser::step_params(ToolDelta& out, bool eof) {
  size_t ws = 0;
  while (ws < buf_.size() && is_ws(buf_[ws])) ++ws;
  buf_.erase(0, ws);
  if (buf_.empty()) return false;
  const bool ns = starts_with(buf_, kNs);
  if (!ns && buf_[0] != '<') {
    if (is_proper_prefix(buf_, kNs)) {
      if (eof) buf_.clear();
      return false;
    }
    // Text where a parameter should open: a value whose opening tag was left out (vLLM #51073),
    // or junk; step_orphan decides at the next tag.
    orphan_.clear();
    state_ = State::kOrphan;
    return true;
  }
  if (ns && buf_.size() > kNs.size() && buf_[kNs.size()] != '<') {
    buf_.erase(0, kNs.size());  // NS then text: the same, with the value's NS kept
    orphan_.clear();
    state_ = State::kOrphan;
    return true;
  }
  const Tag tag = read_tag(buf_, ns ? kNs.size() : 0);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  if (tag.status == TagStatus::kJunk) {
    if (!ns) {  // `<` that starts no tag: text
      orphan_.clear();
      state_ = State::kOrphan;
      return true;
    }
    state_ = State::kSkip;
    return true;
  }
  if (tag.closing) {
    buf_.erase(0, tag.length);
    if (tag.name == "invoke") {
      end_call(out);
      state_ = State::kBlock;
    } else if (tag.name == "tool_call") {
      end_call(out);
      end_block(out);
    }
    return true;  // a stray closing tag between parameters is markup, dropped
  }
  if (auto name = invoke_name(tag.name)) {  // the previous invoke was never closed
    buf_.erase(0, tag.length);
    end_call(out);
    start_call(out, std::move(*name), !ns);
    ++calls_in_block_;
    return true;
  }
  if (tag.name == "tool_call") {  // a repeated block opener
    buf_.erase(0, tag.length);
    return true;
  }
  if (!ns && schemas_.find(call_name_, tag.name) == nullptr) {
    // A bare tag opens a parameter only when it names one of the tool's: otherwise it is text.
    orphan_.clear();
    state_ = State::kOrphan;
    return true;
  }
  std::string name(tag.name);
  buf_.erase(0, tag.length);
  open_param(out, std::move(name));
  return true;
}

void ToolCallParser::open_param(ToolDelta& out, std::string name) {
  param_name_ = std::move(name);
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
}

bool ToolCallParser::step_orphan(ToolDelta& out, bool eof) {
  // Text up to the next tag; a closing tag names the parameter the text was the value of.
  const Scan s = scan(buf_, {kNs, "<"}, eof);
  orphan_.append(buf_, 0, s.text_end);
  buf_.erase(0, s.text_end);
  if (s.found.empty()) {
    if (eof) buf_.clear();
    return false;
  }
  const bool ns = s.found == kNs;
  if (ns && buf_.size() > kNs.size() && buf_[kNs.size()] != '<') {
    buf_.erase(0, kNs.size());  // a stray NS inside the value is markup
    return true;
  }
  const Tag tag = read_tag(buf_, ns ? kNs.size() : 0);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  const bool is_tag = tag.status == TagStatus::kTag;
  const bool ends_call = tag.closing && (tag.name == "invoke" || tag.name == "tool_call");
  if (is_tag && tag.closing && !ns) {
    const Verdict v = bare_close_counts(buf_, tag.length, eof, bare_invoke_);
    if (v == Verdict::kMore) return false;
    if (v == Verdict::kNo) {  // value text
      orphan_.append(buf_, 0, tag.length);
      buf_.erase(0, tag.length);
      return true;
    }
  }
  const bool names_param =
      is_tag && tag.closing && !ends_call && (ns || schemas_.find(call_name_, tag.name) != nullptr);
  if (names_param) {
    std::string name(tag.name);
    buf_.erase(0, tag.length);
    if (std::find(param_names_.begin(), param_names_.end(), name) == param_names_.end()) {
      stack_.clear();
      stack_.push_back(Frame{std::move(name), {}});
      stack_.back().node.text = std::move(orphan_);
      finish_tree_param(out);
    }
    orphan_.clear();
    state_ = State::kParams;
    return true;
  }
  // Exactly the tags step_params consumes (anything else would bounce back here).
  const bool structural =
      is_tag && (ns || ends_call ||
                 (!tag.closing && (tag.name == "tool_call" || invoke_name(tag.name).has_value() ||
                                   schemas_.find(call_name_, tag.name) != nullptr)));
  if (!structural) {  // `a < b`, `<b>`: value text
    if (tag.status == TagStatus::kTag) {
      orphan_.append(buf_, 0, tag.length);
      buf_.erase(0, tag.length);
    } else {
      orphan_ += buf_[0];
      buf_.erase(0, 1);
    }
    return true;
  }
  // Any other tag: the text was junk between parameters; the tag is read as usual.
  orphan_.clear();
  state_ = State::kParams;
  return true;
}

bool ToolCallParser::step_string(ToolDelta& out, bool eof) {
  // A string value ends at its closing tag (with NS, or without when bare_close_counts says so),
  // or where it runs into markup that starts something else: a tag opening another parameter
  // of the tool, an invoke or the block (its closing tag was dropped). Other NS tags and a stray
  // NS inside the value are markup and dropped; the value's text goes on.
  const std::string bare_close = "</" + param_name_ + ">";
  // eof=false even at eof: a partial marker left at the very end is a cut tag, dropped below.
  const Scan s = scan(buf_, {kNs, bare_close, kBareInvokeEnd, kBareToolCallEnd}, false);
  const size_t text_end = s.text_end;
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
  if (s.found.empty()) {
    if (eof) buf_.clear();  // a truncated marker
    return false;
  }
  std::string name;  // what the tag closes or opens
  size_t length = s.found.size();
  bool closing = true;
  if (s.found == kNs) {
    Tag tag = read_tag(buf_);
    if (tag.status == TagStatus::kIncomplete) {
      if (eof) buf_.clear();
      return false;
    }
    if (tag.status == TagStatus::kJunk) {
      buf_.erase(0, kNs.size());  // a stray NS is markup, not part of the value
      return true;
    }
    name = std::move(tag.name);
    length = tag.length;
    closing = tag.closing;
  } else {
    const Verdict v = bare_close_counts(buf_, length, eof, bare_invoke_);
    if (v == Verdict::kMore) return false;
    if (v == Verdict::kNo) {  // value text that looks like a closing tag
      std::string escaped;
      json_escape_append(s.found, escaped);
      emit_args(out, escaped);
      buf_.erase(0, length);
      return true;
    }
    name = std::string(s.found.substr(2, s.found.size() - 3));  // `</name>` -> name
  }
  const bool ends = closing ? (name == param_name_ || name == "invoke" || name == "tool_call")
                            : (name == "tool_call" || invoke_name(name).has_value() ||
                               (name != param_name_ && schemas_.find(call_name_, name) != nullptr));
  if (!ends) {
    buf_.erase(0, length);  // markup inside the value: dropped
    return true;
  }
  emit_args(out, "\"");
  if (!closing) {
    state_ = State::kParams;  // the tag is read again at the parameter boundary
    return true;
  }
  buf_.erase(0, length);
  if (name == param_name_) {
    state_ = State::kParams;
  } else {
    end_call(out);
    if (name == "tool_call") {
      end_block(out);
    } else {
      state_ = State::kBlock;
    }
  }
  return true;
}

bool ToolCallParser::step_tree(ToolDelta& out, bool eof) {
  // Structure: NS tags, and closing tags without NS that close an open element or the call.
  std::vector<std::string> bare;
  bare.reserve(stack_.size());
  for (const Frame& f : stack_) bare.push_back("</" + f.name + ">");
  size_t at = std::string::npos;
  size_t hold = 0;
  std::string_view found;
  const auto consider = [&](std::string_view m) {
    const size_t pos = buf_.find(m);
    if (pos < at || (pos == at && pos != std::string::npos && m.size() > found.size())) {
      at = pos;
      found = m;
    }
    if (!eof) hold = std::max(hold, partial_marker_len(buf_, m));
  };
  consider(kNs);
  consider(kBareInvokeEnd);
  consider(kBareToolCallEnd);
  for (const std::string& m : bare) consider(m);
  const size_t safe = buf_.size() - hold;
  if (at != std::string::npos && at > safe) {
    at = std::string::npos;
    found = {};
  }
  const size_t text_end = std::min(at, safe);
  stack_.back().node.text.append(buf_, 0, text_end);
  buf_.erase(0, text_end);
  if (found.empty()) {
    if (eof) buf_.clear();
    return false;
  }
  const bool ns = found == kNs;
  const Tag tag = ns ? read_tag(buf_) : read_tag(buf_, 0);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  if (!ns) {  // a bare closing tag (found is one): structure or value text?
    const Verdict v = bare_close_counts(buf_, tag.length, eof, bare_invoke_);
    if (v == Verdict::kMore) return false;
    if (v == Verdict::kNo) {
      stack_.back().node.text.append(buf_, 0, tag.length);
      buf_.erase(0, tag.length);
      return true;
    }
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
      if (tag.name == "tool_call") {
        end_block(out);
      } else {
        state_ = State::kBlock;
      }
      return true;
    }
    return discard();
  }
  if (auto name = invoke_name(tag.name)) {  // param and invoke left open: a new call starts
    buf_.erase(0, tag.length);
    while (stack_.size() > 1) pop();
    finish_tree_param(out);
    end_call(out);
    start_call(out, std::move(*name), !ns);
    ++calls_in_block_;
    state_ = State::kParams;
    return true;
  }
  // A dropped closing tag: an element that already holds text (and no children) cannot also
  // hold elements, so it was closed; at the top, a tag naming another parameter of the tool
  // starts that parameter.
  const Frame& top = stack_.back();
  if (top.node.children.empty() && !trim(top.node.text).empty()) {
    if (stack_.size() > 1) {
      pop();
    } else if (tag.name != top.name && schemas_.find(call_name_, tag.name) != nullptr) {
      finish_tree_param(out);
      state_ = State::kParams;
      return true;  // the tag is read again at the parameter boundary
    }
  }
  if (stack_.size() >= kMaxDepth) return discard();
  stack_.push_back(Frame{std::string(tag.name), {}});
  buf_.erase(0, tag.length);
  return true;
}

bool ToolCallParser::step_skip(ToolDelta& out, bool eof) {
  const Scan s = scan(buf_, {kNs, kBareInvokeEnd, kBareToolCallEnd, kBareInvoke}, eof);
  buf_.erase(0, s.text_end);
  if (s.found.empty()) {
    if (eof) buf_.clear();
    return false;
  }
  const bool ns = s.found == kNs;
  const Tag tag = read_tag(buf_, ns ? kNs.size() : 0);
  if (tag.status == TagStatus::kIncomplete) {
    if (eof) buf_.clear();
    return false;
  }
  if (tag.status == TagStatus::kTag && tag.closing &&
      (tag.name == "invoke" || tag.name == "tool_call")) {
    if (!ns) {
      const Verdict v = bare_close_counts(buf_, tag.length, eof, bare_invoke_);
      if (v == Verdict::kMore) return false;
      if (v == Verdict::kNo) {
        buf_.erase(0, tag.length);
        return true;
      }
    }
    buf_.erase(0, tag.length);
    end_call(out);
    if (tag.name == "tool_call") {
      end_block(out);
    } else {
      state_ = State::kBlock;
    }
    return true;
  }
  if (tag.status == TagStatus::kTag && !tag.closing) {
    // Junk inside an invoke must not lose the next invoke.
    if (auto name = invoke_name(tag.name)) {
      buf_.erase(0, tag.length);
      end_call(out);
      start_call(out, std::move(*name), !ns);
      ++calls_in_block_;
      state_ = State::kParams;
      return true;
    }
  }
  buf_.erase(0, ns ? kNs.size() : 1);
  return true;
}

void ToolCallParser::start_call(ToolDelta& out, std::string name, bool bare) {
  // Filled in place: moving a ToolCallDelta trips a GCC 12 maybe-uninitialized false positive.
  ToolCallDelta& d = out.calls.emplace_back();
  d.index = next_index_++;
  d.id = options_.id_prefix + std::to_string(d.index);
  d.name = name;
  call_name_ = std::move(name);
  call_open_ = true;
  bare_invoke_ = bare;
  num_params_ = 0;
  param_names_.clear();
}

void ToolCallParser::end_call(ToolDelta& out) {
  if (!call_open_) return;
  emit_args(out, num_params_ == 0 ? "{}" : "}");
  call_open_ = false;
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
