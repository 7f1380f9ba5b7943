#include "server/stop_matcher.h"

#include <algorithm>

namespace m3::server {

StopMatcher::StopMatcher(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

std::string StopMatcher::feed(std::string_view text) {
  if (stopped_) return {};
  if (stops_.empty()) return std::string(text);
  pending_.append(text);
  // Every occurrence starts inside pending_: earlier text was emitted only when no suffix of it
  // could begin a stop string. The earliest start wins (then the longest string).
  size_t best_pos = std::string::npos;
  const std::string* best = nullptr;
  for (const auto& s : stops_) {
    const size_t pos = pending_.find(s);
    if (pos == std::string::npos) continue;
    if (pos < best_pos || (pos == best_pos && s.size() > best->size())) {
      best_pos = pos;
      best = &s;
    }
  }
  if (best) {
    stopped_ = true;
    matched_ = *best;
    std::string out = pending_.substr(0, best_pos + (include_stop_ ? best->size() : 0));
    pending_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    const size_t max_len = std::min(s.size() - 1, pending_.size());
    for (size_t len = max_len; len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace m3::server
