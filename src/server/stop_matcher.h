// StopMatcher: applies a request's stop strings to streamed text. Text that could still turn out
// to be the start of a stop string is held back, so a stream never emits bytes that a later
// match would have to take back; on a match the output ends before (or, with include_stop, after)
// the stop string. Called by ChoiceOutput, one per choice (HTTP worker thread; not thread-safe).
// Invariant: concat(feed results) + flush() == the text up to the first match (trimmed) or the
// whole text when nothing matched, for any split of the input.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace m3::server {

class StopMatcher {
 public:
  StopMatcher(std::vector<std::string> stops, bool include_stop);

  // Appends `text`; returns what is safe to emit now ("" once stopped).
  std::string feed(std::string_view text);
  // End of output without a match: releases the held-back text.
  std::string flush();

  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }
  size_t held_bytes() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;
  bool include_stop_;
  bool stopped_ = false;
  std::string matched_;
  std::string pending_;  // not yet emitted; a suffix of it may be a stop prefix
};

}  // namespace m3::server
