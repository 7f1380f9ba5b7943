// OutputBlocks: a choice's deltas as consecutive typed blocks (the Messages / Responses streams).
#include "server/output_blocks.h"

#include <gtest/gtest.h>

namespace m3::server {
namespace {

using T = BlockEvent::Type;

ChoiceDelta delta(std::string reasoning, std::string text) {
  ChoiceDelta d;
  d.reasoning = std::move(reasoning);
  d.text = std::move(text);
  return d;
}

TEST(OutputBlocks, ReasoningTextAndCallsOpenAndCloseInTurn) {
  OutputBlocks b;
  std::vector<BlockEvent> ev;
  auto take = [&](std::vector<BlockEvent> e) { ev.insert(ev.end(), e.begin(), e.end()); };
  take(b.feed(delta("think ", "")));
  take(b.feed(delta("more", "")));
  take(b.feed(delta("", "answer")));  // closes the reasoning block, opens text
  ChoiceDelta calls;
  calls.tool_calls.push_back({0, std::string("c0"), std::string("f"), "{\"a\":"});
  calls.tool_calls.push_back({0, std::nullopt, std::nullopt, "1}"});
  calls.tool_calls.push_back({1, std::string("c1"), std::string("g"), ""});
  take(b.feed(calls));
  take(b.feed(ChoiceDelta{}));  // nothing new: no events
  take(b.finish());
  take(b.finish());  // idempotent

  const std::vector<std::pair<T, int>> want = {
      {T::kOpen, 0},  {T::kDelta, 0}, {T::kDelta, 0}, {T::kClose, 0}, {T::kOpen, 1},
      {T::kDelta, 1}, {T::kClose, 1}, {T::kOpen, 2},  {T::kDelta, 2}, {T::kDelta, 2},
      {T::kClose, 2}, {T::kOpen, 3},  {T::kClose, 3}};
  ASSERT_EQ(ev.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(ev[i].type, want[i].first) << i;
    EXPECT_EQ(ev[i].block, want[i].second) << i;
  }
  EXPECT_EQ(ev[3].kind, BlockKind::kReasoning);
  EXPECT_EQ(ev[3].text, "think more");  // a close carries the whole block
  EXPECT_EQ(ev[6].text, "answer");
  EXPECT_EQ(ev[7].kind, BlockKind::kToolCall);
  EXPECT_EQ(ev[7].tool_id, "c0");
  EXPECT_EQ(ev[10].text, "{\"a\":1}");
  EXPECT_EQ(ev[10].tool_name, "f");
  EXPECT_EQ(ev[12].tool_name, "g");
  EXPECT_EQ(ev[12].text, "");  // a call without arguments still opens and closes
  EXPECT_EQ(b.num_blocks(), 4);
}

TEST(OutputBlocks, TextAfterReasoningInOneDeltaKeepsTheOrder) {
  OutputBlocks b;
  auto ev = b.feed(delta("r", "t"));
  ASSERT_EQ(ev.size(), 5u);  // open r, delta r, close r, open t, delta t
  EXPECT_EQ(ev[0].kind, BlockKind::kReasoning);
  EXPECT_EQ(ev[3].kind, BlockKind::kText);
  EXPECT_EQ(ev[4].text, "t");
  EXPECT_TRUE(b.feed(delta("", "")).empty());
}

}  // namespace
}  // namespace m3::server
