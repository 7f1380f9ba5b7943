// Marker matching for the streaming text parsers (reasoning, tool calls).
// Called by ReasoningParser and ToolCallParser when deciding how much buffered text is safe to
// emit. Invariant: a byte is only emitted once no marker can start at or before it, so the
// output never depends on where the input was split into deltas.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string_view>

namespace m3::text {

// ASCII whitespace as Python's str.strip() sees it in the markup the parsers read.
inline bool is_ascii_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

inline std::string_view trim_ascii_ws(std::string_view s) {
  while (!s.empty() && is_ascii_ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ascii_ws(s.back())) s.remove_suffix(1);
  return s;
}

// Length of the longest suffix of `s` that is a proper prefix of `marker` (0 if none): those
// bytes must be held back until the next delta shows whether the marker follows.
inline size_t partial_marker_len(std::string_view s, std::string_view marker) {
  const size_t max_len = std::min(s.size(), marker.size() - 1);
  for (size_t len = max_len; len > 0; --len) {
    if (s.substr(s.size() - len) == marker.substr(0, len)) return len;
  }
  return 0;
}

inline size_t partial_marker_len(std::string_view s,
                                 std::initializer_list<std::string_view> markers) {
  size_t best = 0;
  for (std::string_view m : markers) best = std::max(best, partial_marker_len(s, m));
  return best;
}

// True when `s` is a proper (shorter) prefix of `marker`: more input could complete it.
inline bool is_proper_prefix(std::string_view s, std::string_view marker) {
  return s.size() < marker.size() && marker.substr(0, s.size()) == s;
}

}  // namespace m3::text
