// Schema normalisation, value conversion, UTF-8 repair and JSON escaping.
#include <random>

#include <gtest/gtest.h>

#include "text/json_schema_types.h"

namespace m3::text {
namespace {

ParamNode leaf(std::string text) {
  return ParamNode{std::move(text), {}};
}

std::string convert(const nlohmann::json& schema, const ParamNode& node) {
  auto t = param_type_from_schema(schema);
  return dump_compact(convert_param(node, t ? &*t : nullptr));
}

TEST(ParamType, NormalisesTypesAliasesAndShapes) {
  using nlohmann::json;
  EXPECT_EQ(param_type_from_schema(json{{"type", "string"}})->kind, ParamKind::kString);
  EXPECT_EQ(param_type_from_schema(json{{"type", "int32"}})->kind, ParamKind::kInteger);
  EXPECT_EQ(param_type_from_schema(json{{"type", "unsigned long"}})->kind, ParamKind::kInteger);
  EXPECT_EQ(param_type_from_schema(json{{"type", "Float64"}})->kind, ParamKind::kNumber);
  EXPECT_EQ(param_type_from_schema(json{{"type", "dict[str, int]"}})->kind, ParamKind::kObject);
  EXPECT_EQ(param_type_from_schema(json{{"type", "list[int]"}})->kind, ParamKind::kArray);
  EXPECT_EQ(param_type_from_schema(json{{"type", "binary"}})->kind, ParamKind::kBoolean);
  EXPECT_EQ(param_type_from_schema(json{{"enum", {"a"}}})->kind, ParamKind::kString);
  EXPECT_EQ(param_type_from_schema(json{{"items", json::object()}})->kind, ParamKind::kArray);
  EXPECT_EQ(param_type_from_schema(json{{"properties", json::object()}})->kind, ParamKind::kObject);
  EXPECT_EQ(param_type_from_schema(json{{"type", {"string", "null"}}})->kind, ParamKind::kOneOf);
  EXPECT_EQ(param_type_from_schema(json{{"type", {"integer"}}})->kind, ParamKind::kInteger);
  // An unreadable union is read as an object (JSON text), as vLLM does.
  EXPECT_EQ(param_type_from_schema(json{{"oneOf", {{{"type", "mystery"}}}}})->kind,
            ParamKind::kObject);
  EXPECT_FALSE(param_type_from_schema(json{{"type", "mystery"}}).has_value());
  EXPECT_FALSE(param_type_from_schema(json{{"description", "x"}}).has_value());
  EXPECT_FALSE(param_type_from_schema(json(true)).has_value());
  EXPECT_FALSE(param_type_from_schema(json{{"type", 5}}).has_value());
}

TEST(ParamType, DeepSchemaDoesNotRecurseForever) {
  nlohmann::json s = {{"type", "string"}};
  for (int i = 0; i < 10000; ++i) s = nlohmann::json{{"type", "array"}, {"items", std::move(s)}};
  auto t = param_type_from_schema(s);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->kind, ParamKind::kArray);
}

TEST(ConvertParam, LeafCoercions) {
  using nlohmann::json;
  EXPECT_EQ(convert(json{{"type", "integer"}}, leaf("42")), "42");
  EXPECT_EQ(convert(json{{"type", "integer"}}, leaf("-9223372036854775808")),
            "-9223372036854775808");
  EXPECT_EQ(convert(json{{"type", "integer"}}, leaf("9223372036854775808")),
            "\"9223372036854775808\"");
  EXPECT_EQ(convert(json{{"type", "number"}}, leaf("5.0")), "5.0");
  EXPECT_EQ(convert(json{{"type", "number"}}, leaf("nan")), "\"nan\"");
  EXPECT_EQ(convert(json{{"type", "number"}}, leaf("inf")), "\"inf\"");
  EXPECT_EQ(convert(json{{"type", "boolean"}}, leaf(" FALSE ")), "false");
  EXPECT_EQ(convert(json{{"type", "string"}}, leaf(" 7 ")), "\" 7 \"");
  EXPECT_EQ(convert(json{{"type", "string"}}, leaf("Null")), "\"Null\"");
  EXPECT_EQ(convert(json{{"type", "integer"}}, leaf("Null")), "null");
  EXPECT_EQ(convert(json{{"type", {"null", "string"}}}, leaf("null")), "null");
  EXPECT_EQ(convert(json(nullptr), leaf("x")), "\"x\"");
  EXPECT_EQ(convert(json{{"type", "object"}}, leaf("{\"b\":1,\"a\":2}")),
            "{\"b\":1,\"a\":2}");  // order kept
}

TEST(ConvertParam, ChildrenUseNestedSchemas) {
  const nlohmann::json schema = nlohmann::json::parse(R"({"type":"object","properties":{
      "ids":{"type":"array","items":{"type":"integer"}},"flag":{"type":"boolean"}},
      "additionalProperties":{"type":"number"}})");
  ParamNode node;
  node.children = {{"ids", leaf("1")}, {"ids", leaf("2")}, {"flag", leaf("1")}, {"w", leaf("0.5")}};
  EXPECT_EQ(convert(schema, node), R"({"ids":[1,2],"flag":true,"w":0.5})");
  // An array schema collects every child whatever its tag.
  ParamNode arr;
  arr.children = {{"item", leaf("1")}, {"x", leaf("2")}};
  EXPECT_EQ(convert(nlohmann::json{{"type", "array"}, {"items", {{"type", "integer"}}}}, arr),
            "[1,2]");
  // A scalar schema with children: untyped object.
  EXPECT_EQ(convert(nlohmann::json{{"type", "integer"}}, arr), R"({"item":"1","x":"2"})");
}

TEST(ToolSchemas, ReadsOpenAiToolsAndSkipsMalformedEntries) {
  const nlohmann::json tools = nlohmann::json::parse(R"([
    {"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}},
    {"name":"g","parameters":{"properties":{"b":{"type":"boolean"}}}},
    {"type":"function","function":{"parameters":{}}},
    7, "x", {"function": 3},
    {"type":"function","function":{"name":"h","parameters":[1,2]}}])");
  const ToolSchemas s = ToolSchemas::from_openai_tools(tools);
  ASSERT_NE(s.find("f", "a"), nullptr);
  EXPECT_EQ(s.find("f", "a")->kind, ParamKind::kInteger);
  ASSERT_NE(s.find("g", "b"), nullptr);
  EXPECT_EQ(s.find("g", "b")->kind, ParamKind::kBoolean);
  EXPECT_EQ(s.find("f", "zz"), nullptr);
  EXPECT_EQ(s.find("h", "a"), nullptr);
  EXPECT_EQ(s.find("nope", "a"), nullptr);
  EXPECT_TRUE(ToolSchemas::from_openai_tools(nlohmann::json(nullptr)).empty());
  EXPECT_TRUE(ToolSchemas::from_openai_tools(nlohmann::json::object()).empty());
}

TEST(Utf8, InvalidBytesBecomeReplacementCharacters) {
  EXPECT_EQ(utf8_sanitize("ok é 🚀"), "ok é 🚀");
  EXPECT_EQ(utf8_sanitize("a\xff"
                          "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(utf8_sanitize("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_EQ(utf8_sanitize("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8_sanitize("x\xE2\x82"), "x\xEF\xBF\xBD\xEF\xBF\xBD");  // truncated at the end
  std::string out;
  EXPECT_EQ(utf8_sanitize_append("x\xE2\x82", /*final=*/false, out), 1u);  // waits for the 3rd byte
  EXPECT_EQ(out, "x");
}

TEST(Utf8, SanitizingInPiecesEqualsWhole) {
  std::mt19937 rng(7);
  const std::string alphabet[] = {"a",        "\xC3",     "\xA9", "\xE6\x9D", "\xB1",
                                  "\xF0\x9F", "\x9A\x80", "\xFF", "\x80",     "\xED\xA0"};
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s;
    const size_t n = rng() % 24;
    for (size_t i = 0; i < n; ++i) s += alphabet[rng() % std::size(alphabet)];
    std::string pieces, pending;
    size_t pos = 0;
    while (pos < s.size()) {
      const size_t len = 1 + rng() % 4;
      pending += s.substr(pos, len);
      pos += len;
      const size_t used = utf8_sanitize_append(pending, pos >= s.size(), pieces);
      pending.erase(0, used);
    }
    utf8_sanitize_append(pending, true, pieces);
    EXPECT_EQ(pieces, utf8_sanitize(s));
  }
}

TEST(JsonEscape, MatchesNlohmannDump) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s;
    const size_t n = rng() % 40;
    for (size_t i = 0; i < n; ++i) {
      const unsigned r = rng() % 6;
      if (r == 0)
        s += static_cast<char>(rng() % 0x20);  // every control character
      else if (r == 1)
        s += "\"\\/\x7f";
      else if (r == 2)
        s += "é東🚀";
      else
        s += static_cast<char>(0x20 + rng() % 0x5f);
    }
    std::string mine = "\"";
    json_escape_append(s, mine);
    mine += '"';
    EXPECT_EQ(mine, nlohmann::json(s).dump(-1, ' ', false));
  }
}

}  // namespace
}  // namespace m3::text

namespace m3::text {
namespace {

TEST(ConvertParam, DeeplyNestedJsonTextStaysAString) {
  const auto t = param_type_from_schema(nlohmann::json{{"type", "array"}});
  const std::string ok = std::string(128, '[') + std::string(128, ']');
  EXPECT_TRUE(convert_param(ParamNode{ok, {}}, &*t).is_array());
  // Brackets inside strings do not count.
  const std::string quoted = "[\"" + std::string(500, '[') + "\"]";
  EXPECT_TRUE(convert_param(ParamNode{quoted, {}}, &*t).is_array());
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const OrderedJson v = convert_param(ParamNode{deep, {}}, &*t);
  ASSERT_TRUE(v.is_string());
  EXPECT_EQ(v.get<std::string>().size(), deep.size());
}

}  // namespace
}  // namespace m3::text
