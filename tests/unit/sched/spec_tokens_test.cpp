// Speculative decoding in the scheduler, by scripted steps: draft tokens are scheduled after the
// last known token with lookahead pages, dropped from the end when the budget is short, rolled
// back when rejected, and the prefix cache registers only verified tokens (a later prompt that
// continues with the accepted tokens hits those pages; one that continues with the rejected
// drafts does not).
#include <gtest/gtest.h>

#include "sched/scheduler.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::make_request;

SchedulerConfig spec_config(int budget) {
  SchedulerConfig c;
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = budget;
  c.max_model_len = 256;
  c.block_size = 4;
  c.num_blocks = 32;
  c.enable_prefix_caching = true;
  c.num_lookahead_tokens = 3;
  return c;
}

RunnerOutput sampled(uint64_t id, std::vector<int32_t> toks, std::vector<int32_t> spec) {
  RunnerOutput r;
  r.sampled.push_back({id, std::move(toks), false, std::move(spec)});
  return r;
}

TEST(SchedulerSpecTokens, RejectedDraftsAreRolledBackAndNeverCached) {
  Scheduler s(spec_config(64));
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15};
  ASSERT_TRUE(s.add_request(make_request(1, prompt, 20)));
  // Step 1: the prompt; token 100 sampled, drafts 201 202 203 proposed.
  auto o1 = s.schedule();
  ASSERT_EQ(o1.requests.size(), 1u);
  EXPECT_EQ(o1.requests[0].num_spec_tokens, 0);
  // Pages for the 5 prompt tokens + 3 lookahead positions (the draft's KV): 2 pages of 4.
  EXPECT_EQ(o1.requests[0].block_ids.size(), 2u);
  s.update_from_output(o1, sampled(1, {100}, {201, 202, 203}));
  const Request* r = s.find_request(1);
  EXPECT_EQ(r->num_computed_tokens, 5);
  EXPECT_EQ(r->spec_token_ids, (std::vector<int32_t>{201, 202, 203}));
  // Step 2: the last token and the 3 drafts at positions 5-8; pages up to 5 + 4 + 3 = 12.
  auto o2 = s.schedule();
  ASSERT_EQ(o2.requests.size(), 1u);
  EXPECT_EQ(o2.requests[0].start_idx, 5);
  EXPECT_EQ(o2.requests[0].token_ids, (std::vector<int32_t>{100, 201, 202, 203}));
  EXPECT_EQ(o2.requests[0].num_spec_tokens, 3);
  EXPECT_TRUE(o2.requests[0].will_sample);
  EXPECT_EQ(o2.requests[0].block_ids.size(), 3u);
  // The first draft is rejected: 300 instead; drafts 401 402 403 next.
  auto u2 = s.update_from_output(o2, sampled(1, {300}, {401, 402, 403}));
  ASSERT_EQ(u2.size(), 1u);
  EXPECT_EQ(u2[0].new_token_ids, (std::vector<int32_t>{300}));
  EXPECT_EQ(r->num_computed_tokens, 6);  // positions 6-8 (drafts) rolled back
  EXPECT_EQ(r->num_tokens(), 7);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_cached_blocks(), 1);  // tokens 0-3 only
  // Step 3: all three drafts accepted plus a bonus token 500.
  auto o3 = s.schedule();
  EXPECT_EQ(o3.requests[0].token_ids, (std::vector<int32_t>{300, 401, 402, 403}));
  auto u3 = s.update_from_output(o3, sampled(1, {401, 402, 403, 500}, {}));
  EXPECT_EQ(u3[0].new_token_ids, (std::vector<int32_t>{401, 402, 403, 500}));
  EXPECT_EQ(r->num_computed_tokens, 10);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_cached_blocks(), 2);  // 0-3 and 4-7
  // A prompt that continues with the verified tokens hits both pages; one that continues with
  // the rejected drafts hits only the first.
  ASSERT_TRUE(s.add_request(make_request(2, {11, 12, 13, 14, 15, 100, 300, 401, 402}, 1)));
  ASSERT_TRUE(s.add_request(make_request(3, {11, 12, 13, 14, 15, 100, 201, 202, 203}, 1)));
  auto o4 = s.schedule();
  std::map<uint64_t, int> start;
  for (const auto& q : o4.requests) start[q.request_id] = q.start_idx;
  EXPECT_EQ(start[2], 8);
  EXPECT_EQ(start[3], 4);
}

TEST(SchedulerSpecTokens, DraftsPastTheBudgetAreDroppedAndStopsEndTheDrafts) {
  Scheduler s(spec_config(3));
  ASSERT_TRUE(s.add_request(make_request(1, {1, 2}, 20)));
  auto o1 = s.schedule();
  s.update_from_output(o1, sampled(1, {7}, {8, 9, 10}));
  auto o2 = s.schedule();  // budget 3: the last token and 2 of the 3 drafts
  EXPECT_EQ(o2.requests[0].token_ids, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(o2.requests[0].num_spec_tokens, 2);
  s.update_from_output(o2, sampled(1, {8, 9, 11}, {12}));
  EXPECT_EQ(s.find_request(1)->num_computed_tokens, 5);
  // max_tokens inside the accepted tokens: the request ends there, the rest is dropped.
  Scheduler t(spec_config(64));
  ASSERT_TRUE(t.add_request(make_request(1, {1, 2}, 3)));
  auto p1 = t.schedule();
  t.update_from_output(p1, sampled(1, {7}, {8, 9, 10}));
  auto p2 = t.schedule();
  auto u = t.update_from_output(p2, sampled(1, {8, 9, 10, 11}, {}));
  ASSERT_EQ(u.size(), 1u);
  EXPECT_TRUE(u[0].finished);
  EXPECT_EQ(u[0].finish_reason, FinishReason::kLength);
  EXPECT_EQ(u[0].new_token_ids, (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(t.kv_cache_manager().block_pool().num_free_blocks(), 32);
}

}  // namespace
}  // namespace m3::sched
