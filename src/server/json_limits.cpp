#include "server/json_limits.h"

#include <vector>

namespace m3::server {

int json_nesting_depth(std::string_view text, int limit) {
  int depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          max_depth = depth;
          if (max_depth > limit) return limit + 1;
        }
        break;
      case ']':
      case '}':
        // Unbalanced text is the parser's to reject; never go negative here.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return max_depth;
}

size_t json_max_object_members(std::string_view text, size_t limit) {
  // One counter per open container; arrays keep theirs at 0 (their colons are inside members).
  std::vector<std::pair<bool, size_t>> open;  // (is_object, members)
  size_t best = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '{':
        open.emplace_back(true, 0);
        break;
      case '[':
        open.emplace_back(false, 0);
        break;
      case '}':
      case ']':
        if (!open.empty()) open.pop_back();
        break;
      case ':':
        if (!open.empty() && open.back().first && ++open.back().second > best) {
          best = open.back().second;
          if (best > limit) return best;
        }
        break;
      default:
        break;
    }
  }
  return best;
}

Result<nlohmann::ordered_json> parse_json_bounded(std::string_view text, const std::string& what,
                                                  const std::string& param) {
  if (json_nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return make_error(ErrorCode::kInvalidArgument,
                      what + " nests objects/arrays more than " + std::to_string(kMaxJsonDepth) +
                          " levels deep; flatten it",
                      param);
  }
  if (const size_t m = json_max_object_members(text, kMaxObjectMembers); m > kMaxObjectMembers) {
    return make_error(ErrorCode::kInvalidArgument,
                      what + " has an object with more than " + std::to_string(kMaxObjectMembers) +
                          " members; send fewer keys",
                      param);
  }
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorCode::kInvalidArgument, what + " is not valid JSON: " + e.what(), param);
  }
  return j;
}

size_t json_node_count(const nlohmann::ordered_json& j, size_t limit) {
  size_t n = 0;
  std::vector<const nlohmann::ordered_json*> todo{&j};
  while (!todo.empty() && n <= limit) {
    const nlohmann::ordered_json* v = todo.back();
    todo.pop_back();
    ++n;
    if (v->is_structured()) {
      for (const auto& e : *v) todo.push_back(&e);
    }
  }
  return n;
}

}  // namespace m3::server
