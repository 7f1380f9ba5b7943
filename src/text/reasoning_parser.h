// MiniMax-M3 reasoning parser (`minimax_m3`): splits generated text into reasoning and content
// at the <mm:think> / </mm:think> markers, streaming (arbitrary deltas) or whole text.
// Called by ChatOutputParser (server output processing) once per request; it sees GENERATED text
// only, never the prompt (the prompt's thinking instructions contain both markers, vLLM #50549).
// Invariant: for any split of the output into deltas, the concatenated reasoning / content deltas
// equal parse() of the whole text; marker bytes are held back until disambiguated.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"

namespace m3::text {

// The chat template's `thinking_mode` kwarg. kEnabled means the prompt ended with <mm:think>, so
// the output starts inside reasoning.
enum class ThinkingMode { kEnabled, kDisabled, kAdaptive };

// "enabled" / "disabled" / "adaptive" (the request's chat_template_kwargs.thinking_mode).
Result<ThinkingMode> thinking_mode_from_string(std::string_view name);
const char* thinking_mode_name(ThinkingMode mode);

struct ReasoningDelta {
  std::string reasoning;
  std::string content;
};

struct ReasoningResult {
  std::string reasoning;
  std::string content;
};

// Rules (m3-model.md §6.5, made consistent between streaming and whole text):
//  * enabled: output starts inside reasoning; a redundant leading <mm:think> is dropped.
//  * not enabled: text is content until the first marker. <mm:think> opens reasoning; a
//    </mm:think> before any opener (e.g. the bare closer adaptive/disabled outputs start with)
//    is dropped and ends the reasoning phase.
//  * inside reasoning: text up to the first </mm:think> is reasoning (a missing closer means
//    reasoning runs to the end); the closer itself is dropped.
//  * after the first </mm:think> everything is content, verbatim (markers included).
//  * finish(): a held-back partial marker is flushed as text of the current channel.
class ReasoningParser {
 public:
  static constexpr std::string_view kThinkStart = "<mm:think>";
  static constexpr std::string_view kThinkEnd = "</mm:think>";

  explicit ReasoningParser(ThinkingMode mode);

  ReasoningDelta feed(std::string_view text);
  ReasoningDelta finish();

  static ReasoningResult parse(std::string_view text, ThinkingMode mode);

  // Inside a reasoning block right now (between the opener and the closer).
  bool in_reasoning() const { return state_ == State::kReasoning; }
  // The closer has been consumed (or the bare leading closer): no more reasoning will come.
  bool reasoning_ended() const { return state_ == State::kAfter; }
  // Number of feed() calls that were reasoning: the call began inside reasoning or produced
  // reasoning text. When the caller feeds one token's text per call (the server does), this is
  // the reasoning token count for `usage.completion_tokens_details.reasoning_tokens`.
  int64_t num_reasoning_feeds() const { return num_reasoning_feeds_; }

 private:
  enum class State { kContent, kReasoning, kAfter };

  void process(ReasoningDelta& out, bool eof);

  State state_;
  bool check_leading_opener_;  // just entered reasoning: a duplicate <mm:think> is dropped
  std::string pending_;        // unconsumed input (a possible partial marker)
  int64_t num_reasoning_feeds_ = 0;
};

}  // namespace m3::text
