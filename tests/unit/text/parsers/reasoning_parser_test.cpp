// ReasoningParser: streaming behaviour beyond the golden cases (state, token counting, errors).
#include <gtest/gtest.h>

#include "text/chat_output_parser.h"
#include "text/reasoning_parser.h"

namespace m3::text {
namespace {

TEST(ThinkingMode, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(*thinking_mode_from_string("enabled"), ThinkingMode::kEnabled);
  EXPECT_EQ(*thinking_mode_from_string("disabled"), ThinkingMode::kDisabled);
  EXPECT_EQ(*thinking_mode_from_string("adaptive"), ThinkingMode::kAdaptive);
  auto bad = thinking_mode_from_string("on");
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.error().message.find("adaptive"), std::string::npos);
  EXPECT_EQ(bad.error().param, "chat_template_kwargs.thinking_mode");
  EXPECT_STREQ(thinking_mode_name(ThinkingMode::kEnabled), "enabled");
}

TEST(ReasoningParser, TokenByTokenStateAndCount) {
  ReasoningParser p(ThinkingMode::kAdaptive);
  EXPECT_FALSE(p.in_reasoning());
  auto d = p.feed("<mm:think>");
  EXPECT_TRUE(d.reasoning.empty() && d.content.empty());
  EXPECT_TRUE(p.in_reasoning());
  EXPECT_EQ(p.feed("Hmm").reasoning, "Hmm");
  EXPECT_EQ(p.feed(", ok").reasoning, ", ok");
  d = p.feed("</mm:think>");
  EXPECT_TRUE(d.reasoning.empty() && d.content.empty());
  EXPECT_TRUE(p.reasoning_ended());
  EXPECT_EQ(p.feed("Hi").content, "Hi");
  EXPECT_TRUE(p.finish().content.empty());
  // "Hmm", ", ok" and the closer were fed while reasoning; the opener and "Hi" were not.
  EXPECT_EQ(p.num_reasoning_feeds(), 3);
}

TEST(ReasoningParser, HoldsBackOnlyWhatCouldBeAMarker) {
  ReasoningParser p(ThinkingMode::kEnabled);
  EXPECT_EQ(p.feed("a</mm:th").reasoning, "a");
  EXPECT_EQ(p.feed("x").reasoning, "</mm:thx");
  EXPECT_EQ(p.feed("</mm:think>b<").content, "b<");  // after the closer nothing is held
}

TEST(ReasoningParser, DeltaWithBothMarkersIsSplit) {
  ReasoningParser p(ThinkingMode::kAdaptive);
  auto d = p.feed("pre<mm:think>r</mm:think>post");
  EXPECT_EQ(d.content, "prepost");
  EXPECT_EQ(d.reasoning, "r");
}

TEST(ReasoningParser, FinishFlushesPartialMarkerAsText) {
  ReasoningParser p(ThinkingMode::kAdaptive);
  EXPECT_EQ(p.feed("x <mm:thi").content, "x ");
  EXPECT_EQ(p.finish().content, "<mm:thi");
  ReasoningParser q(ThinkingMode::kEnabled);
  EXPECT_EQ(q.feed("y </mm:").reasoning, "y ");
  EXPECT_EQ(q.finish().reasoning, "</mm:");
}

}  // namespace
}  // namespace m3::text

namespace m3::text {
namespace {

TEST(ChatOutputParser, CountsReasoningTokensFedOneByOne) {
  ChatOutputOptions o;
  o.thinking_mode = ThinkingMode::kEnabled;
  o.parse_tool_calls = true;
  ChatOutputParser p(o);
  ChatOutputResult r;
  for (const char* token :
       {"I", " should", " call", "</mm:think>", "Ok", "]<]minimax[>[", "<tool_call>"})
    r.append(p.feed(token));
  r.append(p.finish());
  ASSERT_NE(p.reasoning(), nullptr);
  EXPECT_EQ(p.reasoning()->num_reasoning_feeds(), 4);  // three text tokens + the closer
  EXPECT_EQ(r.reasoning, "I should call");
  EXPECT_EQ(r.content, "Ok");
  EXPECT_TRUE(r.tool_calls.empty());
  ChatOutputOptions off;
  off.parse_reasoning = false;
  EXPECT_EQ(ChatOutputParser(off).reasoning(), nullptr);
}

}  // namespace
}  // namespace m3::text
