#include "text/reasoning_parser.h"

#include "text/marker_scan.h"

namespace m3::text {

Result<ThinkingMode> thinking_mode_from_string(std::string_view name) {
  if (name == "enabled") return ThinkingMode::kEnabled;
  if (name == "disabled") return ThinkingMode::kDisabled;
  if (name == "adaptive") return ThinkingMode::kAdaptive;
  return make_error(ErrorCode::kInvalidArgument,
                    "thinking_mode '" + std::string(name) +
                        "' is not supported; use \"enabled\", \"disabled\" or \"adaptive\"",
                    "chat_template_kwargs.thinking_mode");
}

const char* thinking_mode_name(ThinkingMode mode) {
  switch (mode) {
    case ThinkingMode::kEnabled:
      return "enabled";
    case ThinkingMode::kDisabled:
      return "disabled";
    case ThinkingMode::kAdaptive:
      return "adaptive";
  }
  return "adaptive";
}

ReasoningParser::ReasoningParser(ThinkingMode mode)
    : state_(mode == ThinkingMode::kEnabled ? State::kReasoning : State::kContent),
      check_leading_opener_(mode == ThinkingMode::kEnabled) {}

ReasoningDelta ReasoningParser::feed(std::string_view text) {
  const bool was_reasoning = state_ == State::kReasoning;
  pending_.append(text);
  ReasoningDelta out;
  process(out, /*eof=*/false);
  if (was_reasoning || !out.reasoning.empty()) ++num_reasoning_feeds_;
  return out;
}

ReasoningDelta ReasoningParser::finish() {
  ReasoningDelta out;
  process(out, /*eof=*/true);
  return out;
}

ReasoningResult ReasoningParser::parse(std::string_view text, ThinkingMode mode) {
  ReasoningParser p(mode);
  ReasoningDelta a = p.feed(text);
  ReasoningDelta b = p.finish();
  return ReasoningResult{a.reasoning + b.reasoning, a.content + b.content};
}

void ReasoningParser::process(ReasoningDelta& out, bool eof) {
  while (!pending_.empty()) {
    const std::string_view buf = pending_;
    if (state_ == State::kAfter) {
      out.content.append(buf);
      pending_.clear();
      return;
    }
    if (state_ == State::kContent) {
      const size_t open = buf.find(kThinkStart);
      const size_t close = buf.find(kThinkEnd);
      const size_t at = std::min(open, close);
      if (at != std::string_view::npos) {
        out.content.append(buf.substr(0, at));
        const bool is_open = at == open;
        pending_.erase(0, at + (is_open ? kThinkStart.size() : kThinkEnd.size()));
        state_ = is_open ? State::kReasoning : State::kAfter;
        check_leading_opener_ = is_open;
        continue;
      }
      const size_t hold = eof ? 0 : partial_marker_len(buf, {kThinkStart, kThinkEnd});
      out.content.append(buf.substr(0, buf.size() - hold));
      pending_.erase(0, buf.size() - hold);
      return;
    }
    // kReasoning
    if (check_leading_opener_) {
      if (buf.substr(0, kThinkStart.size()) == kThinkStart) {
        pending_.erase(0, kThinkStart.size());
        continue;  // a second opener right after the first (or after the prompt's) is noise
      }
      if (!eof && is_proper_prefix(buf, kThinkStart)) return;
      check_leading_opener_ = false;
    }
    const size_t close = buf.find(kThinkEnd);
    if (close != std::string_view::npos) {
      out.reasoning.append(buf.substr(0, close));
      pending_.erase(0, close + kThinkEnd.size());
      state_ = State::kAfter;
      continue;
    }
    const size_t hold = eof ? 0 : partial_marker_len(buf, kThinkEnd);
    out.reasoning.append(buf.substr(0, buf.size() - hold));
    pending_.erase(0, buf.size() - hold);
    return;
  }
}

}  // namespace m3::text
