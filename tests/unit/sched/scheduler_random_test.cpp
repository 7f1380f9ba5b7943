// Randomized scheduler run (fixed seeds): random arrivals, aborts, lengths, priorities, policies,
// small pools. Every step it checks the budget, max_num_seqs, that the scheduled tokens are the
// request's own next tokens, that written pages are private, and that page accounting balances;
// at the end every request has finished exactly once with a reason its tokens justify.
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "sched/scheduler.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

constexpr int32_t kEos = 1;

// Deterministic per (request, position), so recompute after preemption must reproduce it.
// About 1 in 40 samples is eos.
int32_t model_token(uint64_t id, int pos) {
  const int32_t t = testing::fake_token(id, pos);
  return (t % 40 == 0) ? kEos : t;
}

struct Tracked {
  std::vector<int32_t> tokens;  // prompt ++ outputs as reported
  int num_prompt = 0;
  StopCriteria stop;
  int num_finished_updates = 0;
  FinishReason reason = FinishReason::kNone;
  bool abort_requested = false;
};

struct Totals {
  int64_t steps = 0;
  int64_t preemptions = 0;
  int64_t prefix_hits = 0;
  int64_t aborts = 0;
};

void run_random(uint32_t seed, Totals* totals) {
  std::mt19937 rng(seed);
  auto uniform = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto chance = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };

  // Block sizes 4 and 16 keep runs short; 128 (the real page) with token counts scaled to match.
  SchedulerConfig c;
  const int kind = uniform(0, 2);
  c.block_size = kind == 0 ? 4 : kind == 1 ? 16 : 128;
  const int scale = kind == 2 ? 16 : 1;
  c.num_blocks = kind == 0 ? uniform(10, 40) : uniform(4, 12);
  c.max_model_len = uniform(24, 120) * scale;
  c.max_num_seqs = uniform(1, 8);
  c.enable_prefix_caching = chance(0.7);
  c.enable_chunked_prefill = chance(0.8);
  c.max_num_batched_tokens =
      c.enable_chunked_prefill ? uniform(1, 96) * scale : c.max_model_len + uniform(0, 32) * scale;
  c.policy = chance(0.5) ? Policy::kPriority : Policy::kFcfs;
  ASSERT_TRUE(c.validate());
  Scheduler sched(c);
  const int pool_tokens = c.num_blocks * c.block_size;

  // Shared prefixes so that prefix hits happen.
  std::vector<std::vector<int32_t>> families(3);
  for (auto& f : families)
    for (int i = 0; i < 64 * scale; ++i) f.push_back(uniform(100, 999));

  constexpr int kNumRequests = 120;
  std::map<uint64_t, Tracked> tracked;
  std::set<uint64_t> live;
  uint64_t next_id = 1;
  int step = 0;
  for (; step < 50000; ++step) {
    if (next_id > kNumRequests && !sched.has_unfinished()) break;
    // Arrivals (sometimes bursts).
    int arrivals = chance(0.3) ? uniform(1, 3) : 0;
    for (; arrivals > 0 && next_id <= kNumRequests; --arrivals) {
      Tracked t;
      const int len = uniform(1, std::min(c.max_model_len + 4, 70 * scale));  // a few are too long
      const auto& fam = families[uniform(0, 2)];
      const int shared = chance(0.6) ? std::min(len, uniform(0, 64 * scale)) : 0;
      t.tokens.assign(fam.begin(), fam.begin() + shared);
      while (static_cast<int>(t.tokens.size()) < len) t.tokens.push_back(uniform(100, 999));
      t.num_prompt = len;
      t.stop.max_tokens = uniform(1, 40);
      t.stop.min_tokens = chance(0.2) ? uniform(0, 5) : 0;
      t.stop.eos_token_ids = {kEos};
      t.stop.ignore_eos = chance(0.1);
      const uint64_t id = next_id++;
      auto req = std::make_unique<Request>(id, t.tokens, t.stop, uniform(-2, 2));
      ASSERT_TRUE(sched.add_request(std::move(req)));
      tracked[id] = t;
      live.insert(id);
    }
    // Aborts of live requests (running or waiting), and now and then of unknown ids.
    if (!live.empty() && chance(0.02)) {
      auto it = live.begin();
      std::advance(it, uniform(0, static_cast<int>(live.size()) - 1));
      tracked[*it].abort_requested = true;
      sched.abort_request(*it);
      live.erase(it);
      ++totals->aborts;
      testing::expect_pages_balance(sched);
    }
    if (chance(0.01)) sched.abort_request(1000000 + step);

    SchedulerOutput out = sched.schedule();
    ASSERT_LE(out.total_num_tokens, c.max_num_batched_tokens);
    ASSERT_LE(sched.num_running(), c.max_num_seqs);
    int sum = 0;
    std::set<uint64_t> seen;
    const BlockPool& pool = sched.kv_cache_manager().block_pool();
    RunnerOutput runner;
    for (const ScheduledRequest& s : out.requests) {
      ASSERT_TRUE(seen.insert(s.request_id).second) << "scheduled twice in one step";
      const Tracked& t = tracked.at(s.request_id);
      const int end = s.start_idx + s.num_new_tokens();
      ASSERT_GT(s.num_new_tokens(), 0);
      ASSERT_LE(end, static_cast<int>(t.tokens.size()));
      ASSERT_EQ(s.will_sample, end == static_cast<int>(t.tokens.size()));
      ASSERT_TRUE(
          std::equal(s.token_ids.begin(), s.token_ids.end(), t.tokens.begin() + s.start_idx));
      ASSERT_GE(static_cast<int>(s.block_ids.size()), (end + c.block_size - 1) / c.block_size);
      // Pages written this step belong to this request alone and are not in the prefix cache.
      for (int b = s.start_idx / c.block_size; b < (end + c.block_size - 1) / c.block_size; ++b) {
        ASSERT_EQ(pool.ref_count(s.block_ids[b]), 1) << "writing into a shared page";
        ASSERT_FALSE(pool.block_hash(s.block_ids[b]).has_value()) << "writing into a cached page";
      }
      sum += s.num_new_tokens();
      if (s.will_sample) runner.sampled.push_back({s.request_id, {model_token(s.request_id, end)}});
    }
    ASSERT_EQ(sum, out.total_num_tokens);

    for (const RequestUpdate& u : sched.update_from_output(out, runner)) {
      Tracked& t = tracked.at(u.request_id);
      ASSERT_EQ(t.num_finished_updates, 0) << "update after finish for " << u.request_id;
      for (int32_t tok : u.new_token_ids) {
        ASSERT_EQ(tok, model_token(u.request_id, static_cast<int>(t.tokens.size())))
            << "request " << u.request_id << " skipped or repeated a position";
        t.tokens.push_back(tok);
      }
      ASSERT_EQ(u.num_output_tokens, static_cast<int>(t.tokens.size()) - t.num_prompt);
      if (u.finished) {
        ++t.num_finished_updates;
        t.reason = u.finish_reason;
        live.erase(u.request_id);
      }
    }
    testing::expect_pages_balance(sched);
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_FALSE(sched.has_unfinished()) << "requests left after " << step << " steps (starvation?)";
  EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), c.num_blocks);

  for (const auto& [id, t] : tracked) {
    SCOPED_TRACE("request " + std::to_string(id));
    ASSERT_EQ(t.num_finished_updates, 1);
    const int num_out = static_cast<int>(t.tokens.size()) - t.num_prompt;
    EXPECT_LE(num_out, t.stop.max_tokens);
    switch (t.reason) {
      case FinishReason::kAbort:
        EXPECT_TRUE(t.abort_requested);
        break;
      case FinishReason::kStop:
        EXPECT_FALSE(t.stop.ignore_eos);
        EXPECT_EQ(t.tokens.back(), kEos);
        EXPECT_GE(num_out, std::max(1, t.stop.min_tokens));
        break;
      case FinishReason::kLength: {
        const int n = static_cast<int>(t.tokens.size());
        EXPECT_TRUE(num_out == t.stop.max_tokens || n >= c.max_model_len || n > pool_tokens) << n;
        // Nothing before the last token should have stopped it.
        for (int p = t.num_prompt; p + 1 < n; ++p) {
          if (!t.stop.ignore_eos && p - t.num_prompt + 1 >= t.stop.min_tokens) {
            EXPECT_NE(t.tokens[p], kEos);
          }
        }
        break;
      }
      case FinishReason::kNone:
        ADD_FAILURE() << "finished without a reason";
    }
  }
  const SchedulerStats st = sched.stats();
  totals->steps += step;
  totals->preemptions += st.num_preemptions;
  totals->prefix_hits += st.prefix_cache_hits;
}

TEST(SchedulerRandom, PagesBalanceAndEveryRequestFinishes) {
  Totals totals;
  for (uint32_t seed = 1; seed <= 48; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    run_random(seed, &totals);
    if (HasFatalFailure()) return;
  }
  // The run must actually exercise the interesting paths, or it proves little.
  EXPECT_GT(totals.steps, 5000);
  EXPECT_GT(totals.preemptions, 0);
  EXPECT_GT(totals.prefix_hits, 0);
  EXPECT_GT(totals.aborts, 0);
  std::printf(
      "random scheduler run: %lld steps, %lld preemptions, %lld prefix-hit tokens, %lld aborts\n",
      static_cast<long long>(totals.steps), static_cast<long long>(totals.preemptions),
      static_cast<long long>(totals.prefix_hits), static_cast<long long>(totals.aborts));
}

}  // namespace
}  // namespace m3::sched
