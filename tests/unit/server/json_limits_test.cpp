// Bounded JSON (server/json_limits.h) and the Jinja conversion bound: depth is refused before
// any recursive code sees it, whatever the nesting is hidden in.
#include <gtest/gtest.h>

#include <string>

#include "server/chat_prompt.h"
#include "server/json_limits.h"
#include "server/openai_request.h"
#include "text/jinja/template.h"

namespace m3::server {
namespace {

std::string nested(int depth, const std::string& inner = "") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonLimits, DepthCountsBracketsOutsideStringsOnly) {
  EXPECT_EQ(json_nesting_depth("{}", 100), 1);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": []}]})", 100), 4);
  EXPECT_EQ(json_nesting_depth(R"({"a": "[[[[[[\"[[[["})", 100), 1);  // brackets in a string
  EXPECT_EQ(json_nesting_depth(nested(1000), 64), 65);                // stops past the limit
  EXPECT_EQ(json_nesting_depth("]]]]{", 10), 1);                      // unbalanced: never negative
}

TEST(JsonLimits, ParseRefusesDeepTextWithoutRecursing) {
  // 2,000,000 levels: a recursive parse or copy would overflow any thread's stack.
  auto r = parse_json_bounded(nested(2'000'000), "the request body");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message.find("levels deep"), std::string::npos);
  EXPECT_TRUE(parse_json_bounded(nested(kMaxJsonDepth), "x"));
  EXPECT_FALSE(parse_json_bounded(nested(kMaxJsonDepth + 1), "x"));
  auto bad = parse_json_bounded("{\"a\": ", "the request body");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("not valid JSON"), std::string::npos);
}

TEST(JsonLimits, ObjectMembersAreCountedPerObject) {
  EXPECT_EQ(
      json_max_object_members(R"({"a": 1, "b": {"c": 2}, "d": [{"e": 1, "f": 2, "g": ":"}]})", 100),
      3u);
  std::string big = "{";
  for (int i = 0; i < 20000; ++i)
    big += std::string(i ? "," : "") + "\"k" + std::to_string(i) + "\": 0";
  big += "}";
  EXPECT_GT(json_max_object_members(big, kMaxObjectMembers), kMaxObjectMembers);
  auto r = parse_json_bounded(big, "the request body");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("members"), std::string::npos);
}

TEST(JsonLimits, NodeCountStopsPastTheLimit) {
  const auto j = nlohmann::ordered_json::parse(R"({"a": [1, 2, {"b": null}], "c": "x"})");
  EXPECT_EQ(json_node_count(j, 100), 7u);
  EXPECT_LE(json_node_count(j, 3), 4u);
}

TEST(JsonLimits, RequestsWithDeepValuesAre400) {
  const std::string deep = nested(50'000);
  for (
      const std::string& body : {
          R"({"messages": [{"role": "user", "content": "hi", "x": )" + deep + "}]}",
          R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": )" +
              deep + "}}",
          R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"p": )" +
              deep + "}}}]}",
      }) {
    auto r = parse_chat_request(body);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  }
  // Tool-call arguments arrive as a JSON string: their nesting is checked before they are parsed.
  std::string args = std::string(50'000, '[');
  const std::string body =
      R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": ")" +
      args + R"("}}]}, {"role": "user", "content": "x"}]})";
  auto r = parse_chat_request(body);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().param, "messages[0].tool_calls[0].function.arguments");
}

TEST(JsonLimits, CountCapsNameTheField) {
  std::string many = R"({"messages": [)";
  for (size_t i = 0; i <= kMaxMessages; ++i)
    many += std::string(i ? "," : "") + R"({"role": "user", "content": "x"})";
  many += "]}";
  auto r = parse_chat_request(many);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().param, "messages");

  std::string props;
  for (size_t i = 0; i <= kMaxToolSchemaNodes; ++i)
    props += std::string(i ? "," : "") + "\"p" + std::to_string(i) + "\": {}";
  auto t = parse_chat_request(
      R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {)" +
      props + "}}}}]}");
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().code, ErrorCode::kInvalidArgument);

  auto s = parse_completion_request(
      R"({"prompt": "x", "stop": [)" + std::string("\"a\",") + std::string(40, ' ') +
      R"("b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]})");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().param, "stop");
  auto n = parse_completion_request(R"({"prompt": ["a", "b", "c"], "n": 100})");
  ASSERT_FALSE(n);
  EXPECT_EQ(n.error().param, "n");
}

TEST(JsonLimits, JinjaConversionIsBounded) {
  // from_json refuses what is deeper than its bound with an error, not a stack overflow.
  auto tpl = text::jinja::Template::parse("{{ x }}");
  ASSERT_TRUE(tpl);
  nlohmann::ordered_json v = nlohmann::ordered_json::array();
  for (int i = 0; i < text::jinja::kMaxFromJsonDepth + 10; ++i)
    v = nlohmann::ordered_json::array({v});
  auto r = tpl->render(nlohmann::ordered_json{{"x", v}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("levels deep"), std::string::npos);
}

}  // namespace
}  // namespace m3::server
