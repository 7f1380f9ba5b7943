// Prefill/decode disaggregation in the scheduler (Scheduler::release_held_kv, finish_remote_kv):
// a producer request keeps its pages after it finishes until released; a consumer request holds
// pages for its prompt while they are filled, then decodes only the last prompt token; failed
// loads recompute; aborts during a load free the pages only when the load ends. Every page is
// accounted for at each step and the pool is whole at the end (no leak).
#include <algorithm>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "sched/scheduler.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::fake_run;
using testing::fake_token;
using testing::iota_tokens;
using testing::make_request;

SchedulerConfig config(int num_blocks, int budget) {
  SchedulerConfig c;
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = budget;
  c.max_model_len = 4096;
  c.block_size = 16;
  c.num_blocks = num_blocks;
  c.enable_prefix_caching = true;
  return c;
}

// References = pages of running requests + `extra` (held or loading page lists).
void expect_refs(const Scheduler& s, const std::vector<std::vector<int32_t>>& extra) {
  const KVCacheManager& kv = s.kv_cache_manager();
  const BlockPool& pool = kv.block_pool();
  pool.check_consistency();
  std::vector<int> refs(pool.num_blocks(), 0);
  for (uint64_t id : s.running_ids())
    for (int32_t b : kv.block_ids(id)) ++refs[b];
  for (const auto& list : extra)
    for (int32_t b : list) ++refs[b];
  for (int b = 0; b < pool.num_blocks(); ++b) EXPECT_EQ(refs[b], pool.ref_count(b)) << "page " << b;
}

TEST(PdScheduler, ProducerHoldsPagesUntilReleased) {
  Scheduler s(config(16, 64));
  auto r = make_request(1, iota_tokens(40), 1);
  r->hold_kv_on_finish = true;
  ASSERT_TRUE(s.add_request(std::move(r)));
  std::vector<int32_t> held;
  for (int step = 0; step < 10 && s.has_unfinished(); ++step) {
    SchedulerOutput out = s.schedule();
    for (const RequestUpdate& u : s.update_from_output(out, fake_run(out))) {
      if (u.finished) {
        EXPECT_EQ(u.new_token_ids, std::vector<int32_t>{fake_token(1, 40)});
        held = u.held_block_ids;
      }
    }
  }
  ASSERT_EQ(held.size(), 3u);  // 40 prompt tokens, 16 per page
  EXPECT_EQ(s.num_held_kv(), 1);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 13);
  expect_refs(s, {held});
  s.release_held_kv(1);
  s.release_held_kv(1);  // twice: a no-op
  s.release_held_kv(99);
  EXPECT_EQ(s.num_held_kv(), 0);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
  expect_refs(s, {});
}

TEST(PdScheduler, AbortedProducerIsNotHeld) {
  Scheduler s(config(16, 16));
  auto r = make_request(1, iota_tokens(40), 1);
  r->hold_kv_on_finish = true;
  ASSERT_TRUE(s.add_request(std::move(r)));
  SchedulerOutput out = s.schedule();  // first chunk of the prompt
  s.update_from_output(out, fake_run(out));
  s.abort_request(1);
  out = s.schedule();
  s.update_from_output(out, fake_run(out));
  EXPECT_EQ(s.num_held_kv(), 0);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
}

TEST(PdScheduler, ConsumerDecodesOnlyTheLastPromptTokenAfterALoad) {
  Scheduler s(config(16, 64));
  auto r = make_request(7, iota_tokens(40), 3);
  r->load_remote_kv = true;
  ASSERT_TRUE(s.add_request(std::move(r)));
  SchedulerOutput out = s.schedule();
  EXPECT_TRUE(out.requests.empty());
  ASSERT_EQ(out.kv_loads.size(), 1u);
  EXPECT_EQ(out.kv_loads[0].request_id, 7u);
  EXPECT_EQ(out.kv_loads[0].block_ids.size(), 3u);
  EXPECT_TRUE(s.update_from_output(out, fake_run(out)).empty());
  EXPECT_TRUE(s.has_unfinished());
  EXPECT_EQ(s.num_loading_kv(), 1);
  expect_refs(s, {out.kv_loads[0].block_ids});
  // Until the load ends nothing is scheduled for it.
  SchedulerOutput idle = s.schedule();
  EXPECT_TRUE(idle.requests.empty() && idle.kv_loads.empty());
  s.update_from_output(idle, fake_run(idle));

  s.finish_remote_kv(7, /*loaded=*/true);
  out = s.schedule();
  ASSERT_EQ(out.requests.size(), 1u);
  EXPECT_EQ(out.requests[0].start_idx, 39);
  EXPECT_EQ(out.requests[0].token_ids, std::vector<int32_t>{1039});
  EXPECT_TRUE(out.requests[0].will_sample);
  std::vector<int32_t> tokens;
  int cached = -1;
  for (int step = 0; step < 10; ++step) {
    for (const RequestUpdate& u : s.update_from_output(out, fake_run(out))) {
      tokens.insert(tokens.end(), u.new_token_ids.begin(), u.new_token_ids.end());
      cached = u.num_cached_tokens;
    }
    if (!s.has_unfinished()) break;
    out = s.schedule();
  }
  EXPECT_EQ(tokens,
            (std::vector<int32_t>{fake_token(7, 40), fake_token(7, 41), fake_token(7, 42)}));
  EXPECT_EQ(cached, 39);
  // The loaded full pages were registered in the prefix cache: a second request with the same
  // prompt hits them.
  ASSERT_TRUE(s.add_request(make_request(8, iota_tokens(40), 1)));
  out = s.schedule();
  ASSERT_EQ(out.requests.size(), 1u);
  EXPECT_EQ(out.requests[0].start_idx, 32);
  s.update_from_output(out, fake_run(out));
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
}

// A consumer that already caches the prompt's leading full blocks (a shared prefix) keeps them and
// reads only the rest; a failed read then recomputes from the first block it did not have.
TEST(PdScheduler, ConsumerReadsOnlyBlocksItDoesNotCache) {
  for (bool loaded : {true, false}) {
    SCOPED_TRACE(loaded ? "read" : "read failed");
    Scheduler s(config(16, 64));
    // A local request caches 40 tokens: blocks 0 and 1 full (32 tokens).
    ASSERT_TRUE(s.add_request(make_request(1, iota_tokens(40), 1)));
    SchedulerOutput out = s.schedule();
    const std::vector<int32_t> local = s.kv_cache_manager().block_ids(1);
    s.update_from_output(out, fake_run(out));
    ASSERT_FALSE(s.has_unfinished());
    // The remote request shares those 32 tokens, then goes on to 50 tokens (4 blocks).
    std::vector<int32_t> prompt = iota_tokens(32);
    for (int32_t t : iota_tokens(18, 5000)) prompt.push_back(t);
    auto r = make_request(2, prompt, 2);
    r->load_remote_kv = true;
    ASSERT_TRUE(s.add_request(std::move(r)));
    out = s.schedule();
    ASSERT_EQ(out.kv_loads.size(), 1u);
    const KvLoad& l = out.kv_loads[0];
    EXPECT_EQ(l.first_block, 2);
    ASSERT_EQ(l.block_ids.size(), 4u);
    EXPECT_EQ(l.block_ids[0], local[0]);  // the cached pages themselves
    EXPECT_EQ(l.block_ids[1], local[1]);
    const std::vector<int32_t> pages = l.block_ids;
    s.update_from_output(out, fake_run(out));
    expect_refs(s, {pages});
    s.finish_remote_kv(2, loaded);
    out = s.schedule();
    ASSERT_EQ(out.requests.size(), 1u);
    EXPECT_EQ(out.requests[0].start_idx, loaded ? 49 : 32);
    int cached = -1;
    while (true) {
      for (const RequestUpdate& u : s.update_from_output(out, fake_run(out)))
        cached = u.num_cached_tokens;
      if (!s.has_unfinished()) break;
      out = s.schedule();
    }
    EXPECT_EQ(cached, loaded ? 49 : 32);
    EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
  }
}

TEST(PdScheduler, FailedLoadRecomputesThePrompt) {
  Scheduler s(config(16, 16));
  auto r = make_request(3, iota_tokens(40), 2);
  r->load_remote_kv = true;
  ASSERT_TRUE(s.add_request(std::move(r)));
  SchedulerOutput out = s.schedule();
  ASSERT_EQ(out.kv_loads.size(), 1u);
  s.update_from_output(out, fake_run(out));
  s.finish_remote_kv(3, /*loaded=*/false);
  std::vector<int> starts;
  std::vector<int32_t> tokens;
  while (s.has_unfinished()) {
    out = s.schedule();
    for (const auto& q : out.requests) starts.push_back(q.start_idx);
    for (const RequestUpdate& u : s.update_from_output(out, fake_run(out)))
      tokens.insert(tokens.end(), u.new_token_ids.begin(), u.new_token_ids.end());
  }
  EXPECT_EQ(starts, (std::vector<int>{0, 16, 32, 40}));  // the prompt in 16-token chunks
  EXPECT_EQ(tokens, (std::vector<int32_t>{fake_token(3, 40), fake_token(3, 41)}));
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
}

TEST(PdScheduler, AbortDuringALoadFreesPagesWhenTheLoadEnds) {
  Scheduler s(config(16, 64));
  auto r = make_request(5, iota_tokens(20), 4);
  r->load_remote_kv = true;
  ASSERT_TRUE(s.add_request(std::move(r)));
  SchedulerOutput out = s.schedule();
  ASSERT_EQ(out.kv_loads.size(), 1u);
  const std::vector<int32_t> pages = out.kv_loads[0].block_ids;
  s.update_from_output(out, fake_run(out));
  s.abort_request(5);
  out = s.schedule();
  auto ups = s.update_from_output(out, fake_run(out));
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_TRUE(ups[0].finished);
  EXPECT_EQ(ups[0].finish_reason, FinishReason::kAbort);
  EXPECT_FALSE(s.has_unfinished());
  // The read may still be writing into them: still referenced.
  expect_refs(s, {pages});
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 14);
  s.release_held_kv(5);  // not a producer hold: does not free them
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 14);
  s.finish_remote_kv(5, true);
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
  s.finish_remote_kv(5, true);  // again: a no-op
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 16);
}

TEST(PdScheduler, LoadsWaitForPagesAndCountAgainstMaxNumSeqs) {
  SchedulerConfig c = config(4, 64);
  c.max_num_seqs = 1;
  Scheduler s(c);
  auto a = make_request(1, iota_tokens(40), 1);  // 3 pages
  a->load_remote_kv = true;
  ASSERT_TRUE(s.add_request(std::move(a)));
  ASSERT_TRUE(s.add_request(make_request(2, iota_tokens(8, 5000), 1)));
  SchedulerOutput out = s.schedule();
  EXPECT_EQ(out.kv_loads.size(), 1u);
  EXPECT_TRUE(out.requests.empty());  // the one sequence slot is taken by the load
  s.update_from_output(out, fake_run(out));
  s.finish_remote_kv(1, true);
  while (s.has_unfinished()) {
    out = s.schedule();
    s.update_from_output(out, fake_run(out));
  }
  EXPECT_EQ(s.kv_cache_manager().block_pool().num_free_blocks(), 4);

  // A prompt that needs more pages than are free waits instead of failing.
  Scheduler t(config(4, 64));
  auto big = make_request(3, iota_tokens(60), 1);
  big->hold_kv_on_finish = true;
  ASSERT_TRUE(t.add_request(std::move(big)));
  while (t.has_unfinished()) {
    out = t.schedule();
    t.update_from_output(out, fake_run(out));
  }
  EXPECT_EQ(t.num_held_kv(), 1);  // 4 pages held
  auto c2 = make_request(4, iota_tokens(20, 7000), 1);
  c2->load_remote_kv = true;
  ASSERT_TRUE(t.add_request(std::move(c2)));
  out = t.schedule();
  EXPECT_TRUE(out.kv_loads.empty());
  t.update_from_output(out, fake_run(out));
  t.release_held_kv(3);
  out = t.schedule();
  EXPECT_EQ(out.kv_loads.size(), 1u);
  t.update_from_output(out, fake_run(out));
  t.finish_remote_kv(4, true);
  while (t.has_unfinished()) {
    out = t.schedule();
    t.update_from_output(out, fake_run(out));
  }
  EXPECT_EQ(t.kv_cache_manager().block_pool().num_free_blocks(), 4);
}

}  // namespace
}  // namespace m3::sched
