#include "server/choice_output.h"

#include <algorithm>
#include <array>

namespace m3::server {

ChoiceOutput::ChoiceOutput(ChoiceOptions options)
    : opt_(std::move(options)),
      // Special tokens are filtered here (parser markers must stay), so the detokenizer keeps all.
      detok_(opt_.tokenizer, /*skip_special_tokens=*/false),
      stop_(opt_.stop, opt_.include_stop_str) {
  if (opt_.chat) {
    parser_.emplace(*opt_.chat);
    static constexpr std::array<std::string_view, 5> kMarkers = {
        "<mm:think>", "</mm:think>", "]<]minimax[>[", "<tool_call>", "</tool_call>"};
    for (auto m : kMarkers) {
      if (auto id = opt_.tokenizer->token_to_id(m)) marker_ids_.push_back(*id);
    }
    // Special tokens written like a tag (`<filename>`, `<commit_msg>`: M3's code markers) are
    // also parameter tags when a tool has a parameter of that name; inside a tool block they are
    // text for the parser even when special tokens are skipped.
    if (opt_.chat->parse_tool_calls) {
      for (const auto& t : opt_.tokenizer->added_tokens()) {
        if (t.special && t.content.size() > 2 && t.content.front() == '<' &&
            t.content.back() == '>' && !is_marker(t.id))
          tag_ids_.push_back(t.id);
      }
    }
  }
}

bool ChoiceOutput::is_tool_tag(int32_t id) const {
  return parser_ && parser_->tool_calls() && parser_->tool_calls()->in_tool_block() &&
         std::find(tag_ids_.begin(), tag_ids_.end(), id) != tag_ids_.end();
}

bool ChoiceOutput::is_marker(int32_t id) const {
  return std::find(marker_ids_.begin(), marker_ids_.end(), id) != marker_ids_.end();
}

std::string ChoiceOutput::token_text(const text::Tokenizer& tok, int32_t id) {
  const int32_t ids[1] = {id};
  return tok.decode(std::span<const int32_t>(ids, 1), false);
}

std::string ChoiceOutput::logprob_token(int32_t id) const {
  if (opt_.tokens_as_ids) return "token_id:" + std::to_string(id);
  return token_text(*opt_.tokenizer, id);
}

void ChoiceOutput::limit_tool_calls(text::ChatOutputDelta& d) const {
  if (opt_.max_tool_calls <= 0) return;
  std::erase_if(d.tool_calls,
                [&](const text::ToolCallDelta& c) { return c.index >= opt_.max_tool_calls; });
}

void ChoiceOutput::route(std::string_view text, ChoiceDelta& delta) {
  if (!parser_) {
    delta.text.append(text);
    result_.content.append(text);
    return;
  }
  text::ChatOutputDelta d = parser_->feed(text);
  limit_tool_calls(d);
  result_.append(d);
  delta.reasoning += d.reasoning;
  delta.text += d.content;
  for (auto& c : d.tool_calls) delta.tool_calls.push_back(std::move(c));
}

void ChoiceOutput::finish_text(ChoiceDelta& delta) {
  if (!stop_.stopped()) {
    std::string rest = stop_.feed(detok_.flush());
    rest += stop_.flush();
    if (!rest.empty()) route(rest, delta);
  }
  if (parser_) {
    text::ChatOutputDelta d = parser_->finish();
    limit_tool_calls(d);
    result_.append(d);
    delta.reasoning += d.reasoning;
    delta.text += d.content;
    for (auto& c : d.tool_calls) delta.tool_calls.push_back(std::move(c));
  }
}

ChoiceDelta ChoiceOutput::add(const engine::RequestOutput& out) {
  ChoiceDelta delta;
  if (finished_) return delta;
  if (out.prompt_logprobs && !prompt_logprobs_) prompt_logprobs_ = out.prompt_logprobs;
  if (out.num_prompt_tokens > 0) num_prompt_tokens_ = out.num_prompt_tokens;
  num_cached_tokens_ = std::max(num_cached_tokens_, out.num_cached_tokens);
  if (out.kv_transfer_params) kv_transfer_params_ = out.kv_transfer_params;
  const size_t n = out.new_token_ids.size();
  for (size_t i = 0; i < n && !stop_.stopped(); ++i) {
    const int32_t id = out.new_token_ids[i];
    ++num_output_tokens_;
    output_ids_.push_back(id);
    delta.token_ids.push_back(id);
    if (i < out.logprobs.size()) {
      const auto& lp = out.logprobs[i];
      TokenLogprob t;
      t.token = lp.token;
      t.text = logprob_token(lp.token);
      t.logprob = lp.logprob;
      for (const auto& [tid, l] : lp.top) t.top.emplace_back(logprob_token(tid), l);
      delta.logprobs.push_back(t);
      logprobs_.push_back(std::move(t));
    }
    // The token that ended the output (EOS or a stop_token_ids entry) is not text.
    const bool last = i + 1 == n;
    if (last && out.finished && out.finish_reason == "stop") {
      const bool eos = std::find(opt_.eos_token_ids.begin(), opt_.eos_token_ids.end(), id) !=
                       opt_.eos_token_ids.end();
      if (eos || (out.stop_token_id && *out.stop_token_id == id)) {
        if (parser_) route("", delta);  // keeps the per-token feed count (reasoning tokens)
        continue;
      }
    }
    std::string piece;
    if (!(opt_.skip_special_tokens && opt_.tokenizer->skipped_when_skipping_special(id) &&
          !is_marker(id) && !is_tool_tag(id))) {
      piece = detok_.step(id);
    }
    std::string visible = stop_.feed(piece);
    // One parser feed per token, even when empty: the reasoning parser counts tokens by feeds.
    if (parser_ || !visible.empty()) route(visible, delta);
  }
  if (stop_.stopped()) {
    finished_ = true;
    engine_reason_ = "stop";
    stop_string_ = stop_.matched();
    finish_text(delta);
    return delta;
  }
  if (out.finished) {
    finished_ = true;
    engine_reason_ = out.finish_reason;
    error_ = out.error;
    if (out.finish_reason == "stop") stop_token_ = out.stop_token_id;
    finish_text(delta);
  }
  return delta;
}

std::string ChoiceOutput::finish_reason() const {
  if (engine_reason_ == "stop" && !result_.tool_calls.empty()) return "tool_calls";
  return engine_reason_;
}

int64_t ChoiceOutput::num_reasoning_tokens() const {
  if (!parser_ || !parser_->reasoning()) return 0;
  return parser_->reasoning()->num_reasoning_feeds();
}

}  // namespace m3::server
