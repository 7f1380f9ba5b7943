// ToolCallParser: exact streaming granularity (what a client sees and when), UTF-8 split inside a
// streamed string, ids, and whole-text parse of the same parser.
#include <gtest/gtest.h>

#include "text/tool_parser.h"

namespace m3::text {
namespace {

constexpr std::string_view kNs = ToolCallParser::kNamespace;

std::string ns(std::string_view tag) {
  return std::string(kNs) + std::string(tag);
}

nlohmann::json weather_tools() {
  return nlohmann::json::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":
    {"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}])");
}

// The single call delta of `d` (fails the test if there is not exactly one).
const ToolCallDelta& only_call(const ToolDelta& d) {
  EXPECT_EQ(d.calls.size(), 1u);
  static const ToolCallDelta kNone;
  return d.calls.empty() ? kNone : d.calls.front();
}

TEST(ToolCallParser, StreamsNameThenArgumentsIncrementally) {
  ToolCallParser p = ToolCallParser::from_tools(weather_tools());
  ToolDelta d = p.feed("Sure.\n" + ns("<tool_call>\n"));
  EXPECT_EQ(d.content, "Sure.\n");
  EXPECT_TRUE(d.calls.empty());
  EXPECT_TRUE(p.in_tool_block());

  d = p.feed(ns("<invoke name=\"get_weather\">"));  // the name goes out as soon as the tag closes
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].index, 0);
  EXPECT_EQ(d.calls[0].id, "call_0");
  EXPECT_EQ(d.calls[0].name, "get_weather");
  EXPECT_EQ(d.calls[0].arguments_delta, "");

  d = p.feed(ns("<city>Par"));  // string values stream character by character
  EXPECT_EQ(only_call(d).arguments_delta, "{\"city\":\"Par");
  EXPECT_FALSE(only_call(d).name.has_value());
  EXPECT_FALSE(only_call(d).id.has_value());
  EXPECT_EQ(only_call(p.feed("is \"")).arguments_delta, "is \\\"");
  EXPECT_EQ(only_call(p.feed(ns("</city>"))).arguments_delta, "\"");
  EXPECT_TRUE(p.feed(ns("<days>3")).calls.empty());  // typed values go out when complete
  EXPECT_EQ(only_call(p.feed(ns("</days>"))).arguments_delta, ",\"days\":3");
  EXPECT_EQ(only_call(p.feed(ns("</invoke>"))).arguments_delta, "}");
  d = p.feed("\n" + ns("</tool_call>"));
  EXPECT_TRUE(d.empty());
  EXPECT_FALSE(p.in_tool_block());
  EXPECT_TRUE(p.finish().empty());
  EXPECT_EQ(p.num_calls(), 1);
}

TEST(ToolCallParser, ContentIsNotDelayedByUnrelatedText) {
  ToolCallParser p = ToolCallParser::from_tools(nlohmann::json());
  EXPECT_EQ(p.feed("Hello <b>world</b> ]").content, "Hello <b>world</b> ");  // `]` could start NS
  EXPECT_EQ(p.feed("x").content, "]x");
  EXPECT_EQ(p.feed(ns("<tool")).content, "");
  EXPECT_EQ(p.feed("s>").content, ns("<tools>"));
}

TEST(ToolCallParser, MultibyteCharacterSplitAcrossDeltas) {
  ToolCallParser p = ToolCallParser::from_tools(weather_tools());
  p.feed(ns("<tool_call>") + ns("<invoke name=\"get_weather\">") + ns("<city>Z"));
  EXPECT_TRUE(p.feed("\xC3").calls.empty());  // half of ü: nothing yet
  EXPECT_EQ(only_call(p.feed("\xBC")).arguments_delta, "\xC3\xBC");
  EXPECT_EQ(only_call(p.finish()).arguments_delta, "\"}");
}

TEST(ToolCallParser, InvalidUtf8InValuesIsRepaired) {
  ToolCallParser p = ToolCallParser::from_tools(weather_tools());
  const ToolParseResult r =
      p.parse(ns("<tool_call>") + ns("<invoke name=\"get_weather\">") + ns("<city>a\xFF") +
              ns("</city>") + ns("<x>\xC3") + ns("</x>") + ns("</invoke>"));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments_json, "{\"city\":\"a\xEF\xBF\xBD\",\"x\":\"\xEF\xBF\xBD\"}");
  EXPECT_TRUE(nlohmann::json::accept(r.calls[0].arguments_json));
}

TEST(ToolCallParser, IdPrefixAndIndexesAcrossBlocks) {
  ToolParserOptions opts;
  opts.id_prefix = "call_req7_";
  ToolCallParser p = ToolCallParser::from_tools(weather_tools(), opts);
  const std::string block =
      ns("<tool_call>") + ns("<invoke name=get_weather>") + ns("</invoke>") + ns("</tool_call>");
  const ToolParseResult r = p.parse(block + "mid" + block);
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].id, "call_req7_0");
  EXPECT_EQ(r.calls[1].id, "call_req7_1");
  EXPECT_EQ(r.calls[1].arguments_json, "{}");
  EXPECT_EQ(r.content, "mid");
  // parse() uses a fresh parser: the streaming parser p is untouched.
  EXPECT_EQ(p.num_calls(), 0);
}

TEST(ToolCallParser, SeveralTokensInOneDelta) {
  // vLLM #35895: several tokens per delta dropped arguments. Everything in one feed must still
  // produce all calls in order.
  ToolCallParser p = ToolCallParser::from_tools(weather_tools());
  const std::string text = "pre" + ns("<tool_call>\n") + ns("<invoke name=\"get_weather\">") +
                           ns("<city>A") + ns("</city>") + ns("</invoke>\n") +
                           ns("<invoke name=\"get_weather\">") + ns("<days>2") + ns("</days>") +
                           ns("</invoke>\n") + ns("</tool_call>") + "post";
  ToolDelta d = p.feed(text);
  EXPECT_EQ(d.content, "prepost");
  ASSERT_EQ(d.calls.size(), 2u);
  EXPECT_EQ(d.calls[0].arguments_delta, "{\"city\":\"A\"}");
  EXPECT_EQ(d.calls[1].arguments_delta, "{\"days\":2}");
  EXPECT_EQ(d.calls[1].index, 1);
}

}  // namespace
}  // namespace m3::text
