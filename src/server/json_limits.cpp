#include "server/json_limits.h"

#include <climits>
#include <cstdint>
#include <vector>

namespace m3::server {

JsonShape json_shape(std::string_view text, int depth_limit, size_t member_limit) {
  // One pass: a stack of open containers (is_object, members so far); arrays keep 0 members
  // (the colons inside them belong to their objects). Strings (with escapes) are skipped.
  std::vector<std::pair<bool, size_t>> open;
  JsonShape shape;
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
      case '[':
        open.emplace_back(c == '{', 0);
        if (static_cast<int>(open.size()) > shape.depth) {
          shape.depth = static_cast<int>(open.size());
          if (shape.depth > depth_limit) return shape;
        }
        break;
      case '}':
      case ']':
        // Unbalanced text is the parser's to reject; never go negative here.
        if (!open.empty()) open.pop_back();
        break;
      case ':':
        if (!open.empty() && open.back().first && ++open.back().second > shape.max_members) {
          shape.max_members = open.back().second;
          if (shape.max_members > member_limit) return shape;
        }
        break;
      default:
        break;
    }
  }
  return shape;
}

int json_nesting_depth(std::string_view text, int limit) {
  return json_shape(text, limit, SIZE_MAX).depth;
}

size_t json_max_object_members(std::string_view text, size_t limit) {
  return json_shape(text, INT_MAX, limit).max_members;
}

Result<nlohmann::ordered_json> parse_json_bounded(std::string_view text, const std::string& what,
                                                  const std::string& param) {
  const JsonShape shape = json_shape(text, kMaxJsonDepth, kMaxObjectMembers);
  if (shape.depth > kMaxJsonDepth) {
    return make_error(ErrorCode::kInvalidArgument,
                      what + " nests objects/arrays more than " + std::to_string(kMaxJsonDepth) +
                          " levels deep; flatten it",
                      param);
  }
  if (shape.max_members > kMaxObjectMembers) {
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
  std::vector<const nlohmann::ordered_json*> pending{&j};
  while (!pending.empty() && n <= limit) {
    const nlohmann::ordered_json* v = pending.back();
    pending.pop_back();
    ++n;
    if (v->is_structured()) {
      for (const auto& e : *v) pending.push_back(&e);
    }
  }
  return n;
}

}  // namespace m3::server
