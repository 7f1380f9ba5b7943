// JSON-schema-driven typing of tool-call argument values (the M3 tool parser's `parameters`).
// Called by ToolCallParser: the request's OpenAI `tools` array becomes ToolSchemas once per
// request; each parsed parameter element (text and/or child elements) is converted to JSON here.
// Invariant: conversion never fails and never throws: an unknown parameter, an unrecognised
// schema or a failed coercion yields the raw text as a JSON string; every string placed in the
// result is valid UTF-8 (invalid bytes become U+FFFD), so dumping it cannot throw.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace m3::text {

// Argument JSON keeps the order the model wrote the parameters in (needed for streaming).
using OrderedJson = nlohmann::ordered_json;

enum class ParamKind { kString, kInteger, kNumber, kBoolean, kObject, kArray, kNull, kOneOf };

// A normalised JSON-schema type. Only what coercion of raw text needs is kept.
struct ParamType {
  ParamKind kind = ParamKind::kString;
  std::vector<ParamType> one_of;  // kOneOf: candidates, tried in listed order
  std::map<std::string, std::shared_ptr<const ParamType>, std::less<>> properties;  // kObject
  std::shared_ptr<const ParamType> additional;  // kObject: additionalProperties schema
  std::shared_ptr<const ParamType> items;       // kArray: element schema
};

// Normalises one property schema. nullopt when the schema says nothing usable (the value then
// stays a string). Accepts `type` (string or list, with aliases such as int64/float/dict/list),
// anyOf/oneOf, and shape hints (enum -> the type of its values, items -> array, properties ->
// object).
std::optional<ParamType> param_type_from_schema(const nlohmann::json& schema);

// One parsed parameter element: its text, and child elements in document order. A leaf has no
// children; mixed content has both.
struct ParamNode {
  std::string text;
  std::vector<std::pair<std::string, ParamNode>> children;
};

// Converts a parameter element to JSON with its schema type (nullptr = unknown -> string).
// Text rules: string keeps the text verbatim; literal `null` (case-insensitive, trimmed) is JSON
// null unless the type is exactly string; integer/number/boolean/object/array are coerced from
// the trimmed text, falling back to the raw string. Children: object schema -> object (repeated
// tag -> array), array schema -> array of all children, anything else -> untyped object; non-blank
// text next to children goes under "$text" ("$$text" ... on collision).
OrderedJson convert_param(const ParamNode& node, const ParamType* type);

// The per-request table of tool name -> parameter name -> type.
class ToolSchemas {
 public:
  ToolSchemas() = default;
  // `tools` is the OpenAI request array: [{"type":"function","function":{"name","parameters"}}]
  // (a bare {"name","parameters"} entry is accepted too). Malformed entries are skipped.
  static ToolSchemas from_openai_tools(const nlohmann::json& tools);

  // nullptr when the tool or parameter is unknown.
  const ParamType* find(std::string_view tool, std::string_view param) const;
  bool empty() const { return tools_.empty(); }

 private:
  std::map<std::string, std::map<std::string, ParamType, std::less<>>, std::less<>> tools_;
};

// UTF-8 repair: appends `in` to `out` with every byte that does not start a valid UTF-8
// sequence replaced by U+FFFD. When !final, a trailing sequence that could still become valid
// is left unconsumed. Returns the number of input bytes consumed. Prefix-stable: sanitising a
// text in pieces (final only on the last) gives the same bytes as sanitising it whole.
size_t utf8_sanitize_append(std::string_view in, bool final, std::string& out);
std::string utf8_sanitize(std::string_view in);

// Appends the JSON string-body escaping of valid UTF-8 `s` (no quotes), byte-identical to
// nlohmann::json::dump with ensure_ascii=false.
void json_escape_append(std::string_view s, std::string& out);

// Compact JSON text (`{"a":1,"b":[true]}`, separators without spaces, UTF-8 kept as is): the
// format of every arguments string we emit (what vLLM's Rust parser, serde_json::to_string,
// emits too).
std::string dump_compact(const OrderedJson& value);

}  // namespace m3::text
