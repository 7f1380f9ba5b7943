// Scheduler, by scripted steps with the fake runner: chunked prefill under a budget, shared budget,
// max_num_seqs, preemption and resume, prefix hits, aborts, priority order, stop conditions.
#include "sched/scheduler.h"

#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::expect_pages_balance;
using testing::fake_run;
using testing::fake_token;
using testing::iota_tokens;
using testing::make_request;

SchedulerConfig config(int num_blocks, int budget, int block_size = 128) {
  SchedulerConfig c;
  c.max_num_seqs = 16;
  c.max_num_batched_tokens = budget;
  c.max_model_len = 4096;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.enable_prefix_caching = true;
  return c;
}

// What one request got scheduled in a step: (start, num_new, will_sample).
struct Slice {
  int start;
  int n;
  bool sample;
  bool operator==(const Slice&) const = default;
};

std::map<uint64_t, Slice> slices(const SchedulerOutput& out) {
  std::map<uint64_t, Slice> m;
  for (const auto& s : out.requests)
    m[s.request_id] = {s.start_idx, s.num_new_tokens(), s.will_sample};
  return m;
}

// Runs steps to completion; returns every update in order and checks page balance each step.
std::vector<RequestUpdate> run_to_end(Scheduler& sched, int max_steps = 10000) {
  std::vector<RequestUpdate> all;
  for (int step = 0; step < max_steps && sched.has_unfinished(); ++step) {
    SchedulerOutput out = sched.schedule();
    auto ups = sched.update_from_output(out, fake_run(out));
    all.insert(all.end(), ups.begin(), ups.end());
    expect_pages_balance(sched);
  }
  EXPECT_FALSE(sched.has_unfinished());
  return all;
}

std::map<uint64_t, std::vector<int32_t>> outputs_of(const std::vector<RequestUpdate>& ups) {
  std::map<uint64_t, std::vector<int32_t>> m;
  for (const auto& u : ups)
    m[u.request_id].insert(m[u.request_id].end(), u.new_token_ids.begin(), u.new_token_ids.end());
  return m;
}

TEST(Scheduler, ChunkedPrefillUnderBudgetThenDecode) {
  Scheduler sched(config(16, 128));
  const std::vector<int32_t> prompt = iota_tokens(300);
  ASSERT_TRUE(sched.add_request(make_request(1, prompt, 3)));

  const int expected_n[] = {128, 128, 44};
  int start = 0;
  for (int step = 0; step < 3; ++step) {
    SchedulerOutput out = sched.schedule();
    ASSERT_EQ(out.requests.size(), 1u);
    const ScheduledRequest& s = out.requests[0];
    EXPECT_EQ(s.start_idx, start);
    EXPECT_EQ(s.num_new_tokens(), expected_n[step]);
    EXPECT_EQ(out.total_num_tokens, expected_n[step]);
    EXPECT_EQ(s.token_ids, std::vector<int32_t>(prompt.begin() + start,
                                                prompt.begin() + start + expected_n[step]));
    EXPECT_EQ(s.block_ids.size(), static_cast<size_t>(step + 1));  // pages grow with the chunks
    EXPECT_EQ(s.will_sample, step == 2);
    EXPECT_EQ(s.from_waiting, step == 0);
    auto ups = sched.update_from_output(out, fake_run(out));
    if (step < 2) {
      EXPECT_TRUE(ups.empty());  // nothing sampled mid-prefill
    } else {
      ASSERT_EQ(ups.size(), 1u);
      EXPECT_EQ(ups[0].new_token_ids, std::vector<int32_t>{fake_token(1, 300)});
      EXPECT_FALSE(ups[0].finished);
    }
    start += expected_n[step];
    expect_pages_balance(sched);
  }
  // Decode: one token per step, the token sampled last step is the one computed now.
  for (int k = 0; k < 2; ++k) {
    SchedulerOutput out = sched.schedule();
    ASSERT_EQ(out.requests.size(), 1u);
    EXPECT_EQ(out.requests[0].start_idx, 300 + k);
    EXPECT_EQ(out.requests[0].token_ids, std::vector<int32_t>{fake_token(1, 300 + k)});
    EXPECT_TRUE(out.requests[0].will_sample);
    auto ups = sched.update_from_output(out, fake_run(out));
    ASSERT_EQ(ups.size(), 1u);
    EXPECT_EQ(ups[0].finished, k == 1);  // max_tokens 3
  }
  EXPECT_FALSE(sched.has_unfinished());
  EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), 16);
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(out.finished_ids, std::vector<uint64_t>{1});
  EXPECT_TRUE(out.empty());
}

TEST(Scheduler, RequestsShareTheBudgetRunningFirst) {
  Scheduler sched(config(32, 256));
  for (uint64_t id = 1; id <= 3; ++id)
    ASSERT_TRUE(sched.add_request(make_request(id, iota_tokens(100, id * 10000), 5)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{
                             {1, {0, 100, true}}, {2, {0, 100, true}}, {3, {0, 56, false}}}));
  EXPECT_EQ(out.total_num_tokens, 256);
  sched.update_from_output(out, fake_run(out));
  out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{
                             {1, {100, 1, true}}, {2, {100, 1, true}}, {3, {56, 44, true}}}));
  // Order: running requests in admission order.
  EXPECT_EQ(out.requests[0].request_id, 1u);
  EXPECT_EQ(out.requests[2].request_id, 3u);
  sched.update_from_output(out, fake_run(out));
  expect_pages_balance(sched);
  auto ups = run_to_end(sched);
  auto outs = outputs_of(ups);
  EXPECT_EQ(outs[1].size(), 3u);  // 2 sampled before run_to_end + 3 here = max_tokens 5
  EXPECT_EQ(outs[3].size(), 4u);
}

TEST(Scheduler, BudgetCutsARunningPrefillAndWaitingRequestsWait) {
  Scheduler sched(config(32, 64, 16));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(100), 2)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(10, 5000), 2)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {0, 64, false}}}));  // budget gone: 2 waits
  sched.update_from_output(out, fake_run(out));
  out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {64, 36, true}}, {2, {0, 10, true}}}));
  sched.update_from_output(out, fake_run(out));
  run_to_end(sched);
}

TEST(Scheduler, LongPrefillTokenThresholdCapsEachRequestsChunk) {
  // vLLM's --long-prefill-token-threshold: at most 40 prompt tokens per request and step, while
  // the step budget (256) would take them all; a decoding request beside it keeps one token per
  // step, and a short prompt (<= 40) is not cut.
  SchedulerConfig c = config(32, 256, 16);
  c.long_prefill_token_threshold = 40;
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(30), 6)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {0, 30, true}}}));
  sched.update_from_output(out, fake_run(out));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(100, 5000), 2)));
  const int chunks[] = {40, 40, 20};
  int start = 0;
  for (int step = 0; step < 3; ++step) {
    out = sched.schedule();
    EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {30 + step, 1, true}},
                                                      {2, {start, chunks[step], step == 2}}}));
    sched.update_from_output(out, fake_run(out));
    start += chunks[step];
    expect_pages_balance(sched);
  }
  run_to_end(sched);
  // Negative values are refused by name.
  c.long_prefill_token_threshold = -1;
  const Status st = c.validate();
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("--long-prefill-token-threshold"), std::string::npos);
}

TEST(Scheduler, MaxNumSeqsCapsRunningRequests) {
  SchedulerConfig c = config(64, 4096);
  c.max_num_seqs = 2;
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(10), 2)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(10, 3000), 4)));
  ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(10, 6000), 2)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(out.requests.size(), 2u);
  EXPECT_EQ(sched.num_running(), 2);
  EXPECT_EQ(sched.num_waiting(), 1);
  sched.update_from_output(out, fake_run(out));
  out = sched.schedule();
  EXPECT_EQ(slices(out).count(3), 0u);
  auto ups = sched.update_from_output(out, fake_run(out));  // request 1 reaches max_tokens 2
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_TRUE(ups[0].finished);
  out = sched.schedule();  // its slot goes to request 3
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{2, {11, 1, true}}, {3, {0, 10, true}}}));
  sched.update_from_output(out, fake_run(out));
  run_to_end(sched);
}

TEST(Scheduler, PreemptsLatestArrivalWhenPagesRunOutAndResumesExactly) {
  // Block size 4, 6 pages = 24 token slots. Two requests of 8 prompt tokens each decode 10 tokens:
  // each grows to 17 computed tokens = 5 pages, so both cannot hold their pages at once.
  auto run = [](int num_blocks, std::vector<uint64_t>* preempted) {
    Scheduler sched(config(num_blocks, 64, 4));
    EXPECT_TRUE(sched.add_request(make_request(1, iota_tokens(8), 10)));
    EXPECT_TRUE(sched.add_request(make_request(2, iota_tokens(8, 5000), 10)));
    std::vector<RequestUpdate> all;
    for (int step = 0; step < 1000 && sched.has_unfinished(); ++step) {
      SchedulerOutput out = sched.schedule();
      EXPECT_LE(out.total_num_tokens, 64);
      preempted->insert(preempted->end(), out.preempted_ids.begin(), out.preempted_ids.end());
      for (uint64_t id : out.preempted_ids) {
        const Request* r = sched.find_request(id);
        EXPECT_EQ(r->status, RequestStatus::kPreempted);
        EXPECT_EQ(r->num_computed_tokens, 0);
        EXPECT_TRUE(sched.kv_cache_manager().block_ids(id).empty());
      }
      auto ups = sched.update_from_output(out, fake_run(out));
      all.insert(all.end(), ups.begin(), ups.end());
      expect_pages_balance(sched);
    }
    EXPECT_FALSE(sched.has_unfinished());
    EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), num_blocks);
    return all;
  };
  std::vector<uint64_t> preempted_small, preempted_big;
  auto small = run(6, &preempted_small);
  auto big = run(64, &preempted_big);
  EXPECT_TRUE(preempted_big.empty());
  ASSERT_FALSE(preempted_small.empty());
  EXPECT_EQ(preempted_small[0], 2u);  // FCFS: the later arrival is preempted
  // Recompute resumes exactly: same tokens as without any preemption.
  EXPECT_EQ(outputs_of(small), outputs_of(big));
  EXPECT_EQ(outputs_of(small)[2].size(), 10u);
  int preemptions_reported = 0;
  for (const auto& u : small)
    if (u.finished && u.request_id == 2) preemptions_reported = u.num_preemptions;
  EXPECT_GE(preemptions_reported, 1);
}

TEST(Scheduler, ResumedRequestRecomputesPromptPlusOutputs) {
  // After preemption the resumed request feeds prompt ++ outputs-so-far as one prefill.
  SchedulerConfig c = config(5, 64, 4);
  c.enable_prefix_caching = false;  // so the whole sequence is recomputed
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(8), 20)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(8, 5000), 20)));
  bool checked = false;
  for (int step = 0; step < 200 && sched.has_unfinished() && !checked; ++step) {
    SchedulerOutput out = sched.schedule();
    for (const auto& s : out.requests) {
      const Request* r = sched.find_request(s.request_id);
      if (s.from_waiting && r->num_preemptions > 0) {
        EXPECT_EQ(s.start_idx, 0);
        ASSERT_EQ(s.num_new_tokens(), r->num_tokens());
        std::vector<int32_t> expected = r->prompt_token_ids;
        expected.insert(expected.end(), r->output_token_ids.begin(), r->output_token_ids.end());
        EXPECT_EQ(s.token_ids, expected);
        EXPECT_TRUE(s.will_sample);
        checked = true;
      }
    }
    sched.update_from_output(out, fake_run(out));
  }
  EXPECT_TRUE(checked);
}

TEST(Scheduler, PriorityPolicyPreemptsTheLowestPriority) {
  SchedulerConfig c = config(6, 64, 4);
  c.policy = Policy::kPriority;
  Scheduler sched(c);
  ASSERT_TRUE(
      sched.add_request(make_request(1, iota_tokens(8), 10, /*priority=*/5)));  // arrives first
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(8, 5000), 10, /*priority=*/0)));
  std::vector<uint64_t> preempted;
  for (int step = 0; step < 1000 && sched.has_unfinished(); ++step) {
    SchedulerOutput out = sched.schedule();
    preempted.insert(preempted.end(), out.preempted_ids.begin(), out.preempted_ids.end());
    sched.update_from_output(out, fake_run(out));
    expect_pages_balance(sched);
  }
  ASSERT_FALSE(preempted.empty());
  EXPECT_EQ(preempted[0], 1u);
}

TEST(Scheduler, WaitingOrderFollowsPolicy) {
  for (Policy policy : {Policy::kFcfs, Policy::kPriority}) {
    SchedulerConfig c = config(64, 4096);
    c.max_num_seqs = 1;
    c.policy = policy;
    Scheduler sched(c);
    ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(5), 1, 5)));
    ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(5), 1, 0)));
    ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(5), 1, 5)));
    ASSERT_TRUE(sched.add_request(make_request(4, iota_tokens(5), 1, -1)));
    std::vector<uint64_t> order;
    for (int step = 0; step < 20 && sched.has_unfinished(); ++step) {
      SchedulerOutput out = sched.schedule();
      for (const auto& s : out.requests) order.push_back(s.request_id);
      sched.update_from_output(out, fake_run(out));
    }
    if (policy == Policy::kFcfs)
      EXPECT_EQ(order, (std::vector<uint64_t>{1, 2, 3, 4}));
    else
      EXPECT_EQ(order, (std::vector<uint64_t>{4, 2, 1, 3}));
  }
}

TEST(Scheduler, PrefixHitsThroughTheScheduler) {
  Scheduler sched(config(32, 4096));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(300), 2)));
  run_to_end(sched);
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(300), 2)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{2, {256, 44, true}}}));
  auto ups = sched.update_from_output(out, fake_run(out));
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].num_cached_tokens, 256);
  EXPECT_EQ(ups[0].new_token_ids, std::vector<int32_t>{fake_token(2, 300)});
  run_to_end(sched);

  // Exactly two full blocks: one block short of a full hit, the last token is recomputed.
  ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(256), 1)));
  out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{3, {128, 128, true}}}));
  sched.update_from_output(out, fake_run(out));
  const SchedulerStats st = sched.stats();
  EXPECT_EQ(st.prefix_cache_queries, 300 + 300 + 256);
  EXPECT_EQ(st.prefix_cache_hits, 256 + 128);
  run_to_end(sched);
}

TEST(Scheduler, AbortFreesPagesImmediately) {
  SchedulerConfig c = config(32, 4096, 16);
  c.max_num_seqs = 1;
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(40), 50)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(40, 5000), 50)));  // stays waiting
  SchedulerOutput out = sched.schedule();
  sched.update_from_output(out, fake_run(out));
  EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), 32 - 3);

  sched.abort_request(1);  // running
  EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), 32);
  EXPECT_EQ(sched.num_running(), 0);
  sched.abort_request(2);  // waiting
  EXPECT_EQ(sched.num_waiting(), 0);
  sched.abort_request(2);               // already finished: no-op
  sched.abort_request(99);              // unknown: no-op
  EXPECT_TRUE(sched.has_unfinished());  // the abort updates are still to be reported

  out = sched.schedule();
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(out.finished_ids, (std::vector<uint64_t>{1, 2}));
  auto ups = sched.update_from_output(out, fake_run(out));
  ASSERT_EQ(ups.size(), 2u);
  for (const auto& u : ups) {
    EXPECT_TRUE(u.finished);
    EXPECT_EQ(u.finish_reason, FinishReason::kAbort);
    EXPECT_TRUE(u.new_token_ids.empty());
  }
  EXPECT_EQ(ups[0].num_output_tokens, 1);
  EXPECT_FALSE(sched.has_unfinished());
  expect_pages_balance(sched);
}

TEST(Scheduler, AbortBetweenScheduleAndUpdateDropsTheOutput) {
  Scheduler sched(config(8, 4096, 16));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(20), 5)));
  SchedulerOutput out = sched.schedule();
  sched.abort_request(1);
  auto ups = sched.update_from_output(out, fake_run(out));
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(ups[0].new_token_ids.empty());
  EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), 8);
  EXPECT_FALSE(sched.has_unfinished());
}

// Runs one request whose runner output is scripted token by token.
std::vector<RequestUpdate> run_scripted(const StopCriteria& stop,
                                        const std::vector<int32_t>& script,
                                        int max_model_len = 4096) {
  SchedulerConfig c = config(16, 4096, 16);
  c.max_model_len = max_model_len;
  Scheduler sched(c);
  EXPECT_TRUE(sched.add_request(std::make_unique<Request>(7, iota_tokens(10), stop)));
  std::vector<RequestUpdate> all;
  size_t next = 0;
  while (sched.has_unfinished()) {
    SchedulerOutput out = sched.schedule();
    RunnerOutput r;
    for (const auto& s : out.requests)
      if (s.will_sample) {
        EXPECT_LT(next, script.size()) << "ran past the script";
        if (next >= script.size()) return all;
        r.sampled.push_back({s.request_id, {script[next++]}});
      }
    auto ups = sched.update_from_output(out, r);
    all.insert(all.end(), ups.begin(), ups.end());
  }
  return all;
}

TEST(Scheduler, StopsOnEosIncludingTheToken) {
  StopCriteria stop;
  stop.max_tokens = 10;
  stop.eos_token_ids = {2, 3};
  auto ups = run_scripted(stop, {50, 51, 3, 52});
  ASSERT_EQ(ups.size(), 3u);
  EXPECT_TRUE(ups.back().finished);
  EXPECT_EQ(ups.back().finish_reason, FinishReason::kStop);
  EXPECT_EQ(ups.back().new_token_ids, std::vector<int32_t>{3});
  EXPECT_FALSE(ups.back().stop_token_id.has_value());  // eos is not a stop_token_ids match
  EXPECT_EQ(ups.back().num_output_tokens, 3);
}

TEST(Scheduler, IgnoreEosRunsToMaxTokens) {
  StopCriteria stop;
  stop.max_tokens = 4;
  stop.eos_token_ids = {2};
  stop.ignore_eos = true;
  auto ups = run_scripted(stop, {2, 2, 2, 2});
  ASSERT_EQ(ups.size(), 4u);
  EXPECT_EQ(ups.back().finish_reason, FinishReason::kLength);
}

TEST(Scheduler, StopTokenIdsAreReported) {
  StopCriteria stop;
  stop.max_tokens = 10;
  stop.stop_token_ids = {77};
  stop.ignore_eos = true;  // stop ids are honoured even then
  auto ups = run_scripted(stop, {50, 77});
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_EQ(ups.back().finish_reason, FinishReason::kStop);
  EXPECT_EQ(ups.back().stop_token_id, 77);
}

TEST(Scheduler, MinTokensSuppressesEosAndStopIds) {
  StopCriteria stop;
  stop.max_tokens = 10;
  stop.min_tokens = 3;
  stop.eos_token_ids = {2};
  stop.stop_token_ids = {77};
  auto ups = run_scripted(stop, {2, 77, 2});
  ASSERT_EQ(ups.size(), 3u);
  EXPECT_FALSE(ups[0].finished);
  EXPECT_FALSE(ups[1].finished);
  EXPECT_TRUE(ups[2].finished);  // the 3rd output token may stop
  EXPECT_EQ(ups[2].finish_reason, FinishReason::kStop);
}

TEST(Scheduler, MaxModelLenFinishesWithLength) {
  StopCriteria stop;
  stop.max_tokens = 100;
  auto ups = run_scripted(stop, {50, 51, 52, 53, 54}, /*max_model_len=*/13);  // prompt 10 + 3
  ASSERT_EQ(ups.size(), 3u);
  EXPECT_EQ(ups.back().finish_reason, FinishReason::kLength);
  EXPECT_EQ(ups.back().num_output_tokens, 3);
}

TEST(Scheduler, PromptThatCanNeverFitFinishesWithLength) {
  SchedulerConfig c = config(4, 4096, 16);  // pool holds 64 tokens
  c.max_model_len = 100;
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(101), 5)));  // over max_model_len
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(65), 5)));   // over the pool
  ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(60), 50)));  // fits, then hits the pool
  auto ups = run_to_end(sched);
  std::map<uint64_t, RequestUpdate> last;
  for (const auto& u : ups) last[u.request_id] = u;
  EXPECT_EQ(last[1].finish_reason, FinishReason::kLength);
  EXPECT_EQ(last[1].num_output_tokens, 0);
  EXPECT_EQ(last[2].finish_reason, FinishReason::kLength);
  EXPECT_EQ(last[3].finish_reason, FinishReason::kLength);
  // 64 slots: positions 0..63 computed, the 65th token is sampled and ends the request.
  EXPECT_EQ(last[3].num_output_tokens, 5);
}

TEST(Scheduler, WithoutChunkedPrefillAPromptWaitsForTheWholeBudget) {
  SchedulerConfig c = config(64, 128, 16);
  c.max_model_len = 128;
  c.enable_chunked_prefill = false;
  Scheduler sched(c);
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(100), 3)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(100, 5000), 3)));
  SchedulerOutput out = sched.schedule();
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {0, 100, true}}}));
  sched.update_from_output(out, fake_run(out));
  out = sched.schedule();  // 127 left after request 1's decode token: request 2 fits whole
  EXPECT_EQ(slices(out), (std::map<uint64_t, Slice>{{1, {100, 1, true}}, {2, {0, 100, true}}}));
  sched.update_from_output(out, fake_run(out));
  run_to_end(sched);
}

TEST(Scheduler, AddRequestRejectsBadInput) {
  Scheduler sched(config(8, 64, 16));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(4), 1)));
  auto dup = sched.add_request(make_request(1, iota_tokens(4), 1));
  ASSERT_FALSE(dup);
  EXPECT_NE(dup.error().message.find("already"), std::string::npos);
  EXPECT_FALSE(sched.add_request(make_request(2, {}, 1)));
  auto zero = sched.add_request(make_request(3, iota_tokens(4), 0));
  ASSERT_FALSE(zero);
  EXPECT_EQ(zero.error().param, "max_tokens");
}

TEST(SchedulerConfig, ValidateNamesTheFlag) {
  SchedulerConfig c = config(8, 64, 16);
  EXPECT_TRUE(c.validate());
  c.num_blocks = 0;
  EXPECT_FALSE(c.validate());
  c = config(8, 64, 16);
  c.max_num_seqs = 0;
  ASSERT_FALSE(c.validate());
  EXPECT_EQ(c.validate().error().param, "--max-num-seqs");
  c = config(8, 64, 16);
  c.enable_chunked_prefill = false;  // 64 < max_model_len 4096
  ASSERT_FALSE(c.validate());
  EXPECT_EQ(c.validate().error().param, "--max-num-batched-tokens");
}

}  // namespace
}  // namespace m3::sched

namespace m3::sched {
namespace {

// Async scheduling's driver: step N+1 is scheduled (ahead) before step N is reported; a deferred
// step is scheduled again once step N is in. Returns every update in order.
std::vector<RequestUpdate> run_pipelined(Scheduler& sched, int* num_deferred,
                                         int* num_placeholders) {
  std::vector<RequestUpdate> all;
  SchedulerOutput cur = sched.schedule();
  for (int step = 0; step < 10000 && sched.has_unfinished(); ++step) {
    SchedulerOutput next = sched.schedule(/*ahead=*/true);
    for (const auto& s : next.requests)
      for (int32_t t : s.token_ids) *num_placeholders += t == kPlaceholderToken;
    auto ups = sched.update_from_output(cur, fake_run(cur));
    all.insert(all.end(), ups.begin(), ups.end());
    if (next.deferred) {
      ++*num_deferred;
      expect_pages_balance(sched);  // nothing in flight here
      next = sched.schedule();
    }
    cur = std::move(next);
  }
  auto ups = sched.update_from_output(cur, fake_run(cur));
  all.insert(all.end(), ups.begin(), ups.end());
  EXPECT_FALSE(sched.has_unfinished());
  return all;
}

TEST(SchedulerAhead, PipelinedStepsGiveTheSynchronousOutputs) {
  for (int num_blocks : {64, 7}) {  // roomy, and tight enough to preempt
    auto add_all = [](Scheduler& s) {
      for (uint64_t id = 1; id <= 5; ++id)
        ASSERT_TRUE(s.add_request(make_request(id, iota_tokens(20 + 13 * id), 3 + 4 * id)));
    };
    Scheduler sync(config(num_blocks, 48, 16));
    add_all(sync);
    const auto want = outputs_of(run_to_end(sync));
    Scheduler ahead(config(num_blocks, 48, 16));
    add_all(ahead);
    int deferred = 0, placeholders = 0;
    const auto got = outputs_of(run_pipelined(ahead, &deferred, &placeholders));
    EXPECT_EQ(got, want) << num_blocks << " pages";
    EXPECT_GT(placeholders, 20) << "decode rows scheduled ahead read the sample in flight";
    if (num_blocks == 7) {
      EXPECT_GT(deferred, 0) << "a step that must preempt is deferred";
      EXPECT_GT(ahead.stats().num_preemptions, 0);
    }
    EXPECT_EQ(ahead.kv_cache_manager().num_held_references(), 0);
  }
}

TEST(SchedulerAhead, ARequestItsSampleInFlightFinishesIsNotScheduled) {
  Scheduler s(config(16, 64, 16));
  ASSERT_TRUE(s.add_request(make_request(1, iota_tokens(10), 2)));
  ASSERT_TRUE(s.add_request(make_request(2, iota_tokens(12, 50), 5)));
  SchedulerOutput prefill = s.schedule();
  ASSERT_EQ(prefill.requests.size(), 2u);
  // Ahead of the prefill step: both decode their first sample; neither is finished by it.
  SchedulerOutput d1 = s.schedule(/*ahead=*/true);
  ASSERT_EQ(d1.requests.size(), 2u);
  for (const auto& r : d1.requests) {
    EXPECT_EQ(r.token_ids, std::vector<int32_t>{kPlaceholderToken});
    EXPECT_TRUE(r.will_sample);
  }
  EXPECT_EQ(d1.requests[0].start_idx, 10);
  s.update_from_output(prefill, fake_run(prefill));
  // Request 1's sample in flight is its 2nd and last token: the next step leaves it out.
  SchedulerOutput d2 = s.schedule(/*ahead=*/true);
  ASSERT_EQ(d2.requests.size(), 1u);
  EXPECT_EQ(d2.requests[0].request_id, 2u);
  EXPECT_EQ(d2.requests[0].start_idx, 13);
  auto ups = s.update_from_output(d1, fake_run(d1));
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_TRUE(ups[0].finished);
  EXPECT_EQ(ups[0].finish_reason, FinishReason::kLength);
  EXPECT_EQ(ups[0].num_output_tokens, 2);
  EXPECT_FALSE(ups[1].finished);
  // An abort while its step is in flight: that step's output is dropped, the pages are free.
  s.abort_request(2);
  auto last = s.update_from_output(d2, fake_run(d2));
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].finish_reason, FinishReason::kAbort);
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.kv_cache_manager().num_held_references(), 0);
}

}  // namespace
}  // namespace m3::sched
