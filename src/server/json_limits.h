// Bounded JSON: the one way the server turns untrusted text (request bodies, tool-call argument
// strings) into JSON, plus the size caps that every request field is checked against.
// Called by openai_request.cpp and the route handlers (HTTP worker threads).
// Invariant: no text whose nesting exceeds kMaxJsonDepth reaches nlohmann's parser, so every
// later recursive walk (copies, dumps, Jinja value conversion, schema walks) is bounded by it;
// the depth is counted by one iterative pass over the bytes, never by recursion.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace m3::server {

// Caps on what one request may hold. Each is far above what a real client sends (OpenAI allows
// 4 stop strings and 128 tools) and low enough that a rejected request costs little.
inline constexpr int kMaxJsonDepth = 64;              // objects/arrays nested in any JSON text
inline constexpr size_t kMaxMessages = 8192;          // chat messages
inline constexpr size_t kMaxContentParts = 4096;      // parts of one message's content
inline constexpr size_t kMaxToolCalls = 1024;         // tool_calls of one message
inline constexpr size_t kMaxTools = 512;              // tools of one request
inline constexpr size_t kMaxToolSchemaNodes = 16384;  // JSON values in all tools together
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 1024;
// logit_bias entries in one request (OpenAI accepts up to 300; vLLM has no limit).
inline constexpr size_t kMaxLogitBias = 1024;
inline constexpr size_t kMaxStopTokenIds = 1024;
inline constexpr size_t kMaxPrompts = 256;       // /v1/completions prompt list
inline constexpr int kMaxChoices = 256;          // prompts x n per request
inline constexpr size_t kMaxKwargsNodes = 4096;  // chat_template_kwargs values
// Members of one JSON object: nlohmann's ordered_json checks each new key against the ones
// before it, so parsing an object costs members^2 (100,000 keys took seconds).
inline constexpr size_t kMaxObjectMembers = 8192;

// The nesting depth and the most members any object has (counted by its top-level colons) of
// JSON text, in one iterative pass that stops as soon as either passes its limit. Strings (with
// escapes) are skipped, so brackets and colons inside them do not count.
struct JsonShape {
  int depth = 0;
  size_t max_members = 0;
};
JsonShape json_shape(std::string_view text, int depth_limit, size_t member_limit);

// Nesting depth of JSON text, stopping as soon as it passes `limit` (returns limit + 1 then).
// Strings (with escapes) are skipped, so brackets inside them do not count.
int json_nesting_depth(std::string_view text, int limit);

// The most members any object in `text` has (counted by its top-level colons), stopping once
// past `limit`. Iterative; meant for text whose depth was checked.
size_t json_max_object_members(std::string_view text, size_t limit);

// Parses `text` after checking its depth and object sizes. `what` names the text in errors
// ("request body", "messages[0].tool_calls[1].function.arguments"); `param` is the error's param.
Result<nlohmann::ordered_json> parse_json_bounded(std::string_view text, const std::string& what,
                                                  const std::string& param = "");

// Number of JSON values in `j` (containers and leaves), counted without recursion and stopping
// once past `limit`.
size_t json_node_count(const nlohmann::ordered_json& j, size_t limit);

}  // namespace m3::server
