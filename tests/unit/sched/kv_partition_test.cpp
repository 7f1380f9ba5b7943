// KV page partitions (attention data parallel, one partition per rank): BlockPool keeps one LRU
// queue and one prefix-cache map per partition; KVCacheManager keeps every request's pages inside
// one partition, puts new requests in the partition with the most free pages and pins a prefix hit
// to its partition; the Scheduler preempts only inside the partition that ran out, limits a request
// to one partition's pages, and moves a hit request to another partition when its own is full.
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "sched/block_pool.h"
#include "sched/kv_cache_manager.h"
#include "sched/scheduler.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::expect_pages_balance;
using testing::fake_run;
using testing::iota_tokens;
using testing::make_request;

Request make(uint64_t id, std::vector<int32_t> prompt) {
  return Request(id, std::move(prompt), StopCriteria{});
}

// Every page the manager gives `r` lies in kv.partition_of(r) (or it holds none).
void expect_one_partition(const KVCacheManager& kv, const Request& r) {
  const auto& blocks = kv.block_ids(r.request_id);
  const int p = kv.partition_of(r);
  if (blocks.empty()) {
    EXPECT_EQ(p, -1) << "request " << r.request_id;
    return;
  }
  ASSERT_GE(p, 0);
  for (int32_t b : blocks)
    EXPECT_EQ(kv.block_pool().partition_of(b), p)
        << "request " << r.request_id << " page " << b << " left partition " << p;
}

// ---- BlockPool --------------------------------------------------------------------------------

TEST(BlockPoolPartitions, OneQueuePerPartitionInIdOrder) {
  BlockPool pool(12, 4, true, 3);
  EXPECT_EQ(pool.num_partitions(), 3);
  EXPECT_EQ(pool.blocks_per_partition(), 4);
  EXPECT_EQ(pool.partition_of(0), 0);
  EXPECT_EQ(pool.partition_of(3), 0);
  EXPECT_EQ(pool.partition_of(4), 1);
  EXPECT_EQ(pool.partition_of(11), 2);
  EXPECT_EQ(pool.free_queue(1), (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(pool.get_new_blocks(3, 1), (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(pool.get_new_blocks(1, 2), (std::vector<int32_t>{8}));
  EXPECT_EQ(pool.num_free_blocks(0), 4);
  EXPECT_EQ(pool.num_free_blocks(1), 1);
  EXPECT_EQ(pool.num_free_blocks(2), 3);
  EXPECT_EQ(pool.num_free_blocks(), 8);
  EXPECT_DOUBLE_EQ(pool.usage(), 4.0 / 12.0);
  // Freed pages go back to the tail of their own partition's queue.
  pool.free_blocks(std::vector<int32_t>{6, 4, 8});
  EXPECT_EQ(pool.free_queue(0), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.free_queue(1), (std::vector<int32_t>{7, 6, 4}));
  EXPECT_EQ(pool.free_queue(2), (std::vector<int32_t>{9, 10, 11, 8}));
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{0, 1, 2, 3, 7, 6, 4, 9, 10, 11, 8}));
  pool.check_consistency();
}

TEST(BlockPoolPartitions, EvictionAndCacheMapsArePerPartition) {
  BlockPool pool(8, 4, true, 2);
  const std::vector<int32_t> a = pool.get_new_blocks(2, 0);  // 0, 1
  const std::vector<int32_t> b = pool.get_new_blocks(2, 1);  // 4, 5
  // The same chain hash can be cached once in each partition.
  EXPECT_TRUE(pool.cache_block(a[0], 42));
  EXPECT_TRUE(pool.cache_block(b[0], 42));
  EXPECT_FALSE(pool.cache_block(a[1], 42));  // a duplicate inside one partition keeps the first
  EXPECT_EQ(pool.get_cached_block(42, 0), a[0]);
  EXPECT_EQ(pool.get_cached_block(42, 1), b[0]);
  EXPECT_EQ(pool.get_cached_block(42), a[0]);  // any partition: lowest index first
  EXPECT_EQ(pool.num_cached_blocks(), 2);
  pool.free_blocks(std::vector<int32_t>{b[1], b[0], a[1], a[0]});
  // Pressure on partition 1 evicts only partition 1's pages: 6, 7 (never cached), 5, then 4.
  EXPECT_EQ(pool.get_new_blocks(4, 1), (std::vector<int32_t>{6, 7, 5, 4}));
  EXPECT_FALSE(pool.get_cached_block(42, 1).has_value());
  EXPECT_EQ(pool.get_cached_block(42, 0), a[0]);  // partition 0 keeps its copy
  EXPECT_EQ(pool.num_free_blocks(0), 4);
  EXPECT_EQ(pool.num_free_blocks(1), 0);
  pool.check_consistency();
}

TEST(BlockPoolPartitionsDeathTest, MisuseIsABug) {
  EXPECT_DEATH(BlockPool(7, 4, true, 2), "do not split into 2 equal partitions");
  BlockPool pool(8, 4, true, 2);
  EXPECT_DEATH(pool.get_new_blocks(1), "without a partition");
  EXPECT_DEATH(pool.get_new_blocks(5, 0), "asked for 5 blocks with 4 free");
}

// ---- KVCacheManager ---------------------------------------------------------------------------

TEST(KVCacheManagerPartitions, NewRequestsGoToTheMostFreePartition) {
  KVCacheManager kv(12, 4, false, 3);  // 3 partitions of 4 pages
  Request a = make(1, iota_tokens(12));
  ASSERT_TRUE(kv.allocate_slots(a, 12));  // all 4 free: ties go to the lowest index
  EXPECT_EQ(kv.partition_of(a), 0);
  Request b = make(2, iota_tokens(4));
  ASSERT_TRUE(kv.allocate_slots(b, 4));  // free 1, 4, 4
  EXPECT_EQ(kv.partition_of(b), 1);
  Request c = make(3, iota_tokens(8));
  ASSERT_TRUE(kv.allocate_slots(c, 8));  // free 1, 3, 4
  EXPECT_EQ(kv.partition_of(c), 2);
  Request d = make(4, iota_tokens(4));
  ASSERT_TRUE(kv.allocate_slots(d, 4));  // free 1, 3, 2
  EXPECT_EQ(kv.partition_of(d), 1);
  EXPECT_EQ(kv.most_free_partition(), 1);  // free 1, 2, 2: tie between 1 and 2
  Request none = make(9, iota_tokens(4));
  EXPECT_EQ(kv.partition_of(none), -1);
  for (const Request* r : {&a, &b, &c, &d}) expect_one_partition(kv, *r);
  kv.block_pool().check_consistency();
}

TEST(KVCacheManagerPartitions, GrowthStaysInThePartitionAndFailsWhenItIsFull) {
  KVCacheManager kv(8, 4, false, 2);
  Request a = make(1, iota_tokens(20));
  // 5 pages: 8 are free in total but no partition has 5, so it cannot be admitted at all.
  EXPECT_FALSE(kv.allocate_slots(a, 20));
  EXPECT_TRUE(kv.block_ids(1).empty());
  ASSERT_TRUE(kv.allocate_slots(a, 12));  // 3 pages in partition 0
  EXPECT_EQ(kv.partition_of(a), 0);
  a.num_computed_tokens = 12;
  ASSERT_TRUE(kv.allocate_slots(a, 4));  // the 4th page of partition 0
  a.num_computed_tokens = 16;
  EXPECT_EQ(kv.block_pool().num_free_blocks(0), 0);
  // Partition 1 is all free, but a's next page must come from partition 0.
  EXPECT_FALSE(kv.allocate_slots(a, 1));
  EXPECT_EQ(kv.block_ids(1).size(), 4u);
  EXPECT_EQ(kv.block_pool().num_free_blocks(1), 4);
  expect_one_partition(kv, a);
  kv.free(a);
  EXPECT_EQ(kv.partition_of(a), -1);
  kv.block_pool().check_consistency();
}

TEST(KVCacheManagerPartitions, APrefixHitPinsItsPartition) {
  KVCacheManager kv(16, 4, true, 2);  // 2 partitions of 8 pages
  Request a = make(1, iota_tokens(9));
  ComputedBlocks hit_a = kv.get_computed_blocks(a);
  EXPECT_EQ(hit_a.partition, -1);
  ASSERT_TRUE(kv.allocate_slots(a, 9, &hit_a));  // 3 pages, partition 0
  a.num_computed_tokens = 9;
  kv.cache_blocks(a, 9);
  EXPECT_EQ(kv.partition_of(a), 0);
  // Partition 1 now has more free pages, but b shares a's two full blocks: it joins partition 0.
  Request b = make(2, iota_tokens(10));
  ComputedBlocks hit = kv.get_computed_blocks(b);
  EXPECT_EQ(hit.partition, 0);
  EXPECT_EQ(hit.num_computed_tokens, 8);
  ASSERT_TRUE(kv.allocate_slots(b, 2, &hit));
  EXPECT_EQ(kv.partition_of(b), 0);
  EXPECT_EQ(kv.block_ids(2)[0], kv.block_ids(1)[0]);
  expect_one_partition(kv, b);
  // Looking only in partition 1 finds nothing there.
  Request c = make(3, iota_tokens(10));
  EXPECT_EQ(kv.get_computed_blocks(c, 1).num_computed_tokens, 0);
  EXPECT_EQ(kv.get_computed_blocks(c, 1).partition, -1);
  // A hit in partition 0 fails when partition 0 has no room, although partition 1 has some.
  Request e = make(4, iota_tokens(4, 7000));
  ASSERT_TRUE(kv.allocate_slots(e, 4));  // free 4 vs 8: partition 1
  EXPECT_EQ(kv.partition_of(e), 1);
  Request filler = make(5, iota_tokens(16, 8000));
  ASSERT_TRUE(kv.allocate_slots(filler, 16));  // free 4 vs 7: partition 1, 3 left there
  EXPECT_EQ(kv.partition_of(filler), 1);
  Request filler0 = make(6, iota_tokens(16, 9000));
  ASSERT_TRUE(kv.allocate_slots(filler0, 16));  // free 4 vs 3: partition 0, now full
  EXPECT_EQ(kv.partition_of(filler0), 0);
  EXPECT_EQ(kv.block_pool().num_free_blocks(0), 0);
  Request d = make(7, iota_tokens(13));
  ComputedBlocks hit_d = kv.get_computed_blocks(d);
  EXPECT_EQ(hit_d.partition, 0);
  EXPECT_FALSE(kv.allocate_slots(d, 5, &hit_d));
  EXPECT_TRUE(kv.block_ids(7).empty());
  kv.block_pool().check_consistency();
}

TEST(KVCacheManagerPartitions, LongestHitWinsThenTheMoreFreePartition) {
  KVCacheManager kv(16, 4, true, 2);
  // The same 12-token prefix computed in partition 0 (3 full blocks) and, as 8 tokens, in 1.
  Request a = make(1, iota_tokens(13));
  ASSERT_TRUE(kv.allocate_slots(a, 13));
  a.num_computed_tokens = 13;
  kv.cache_blocks(a, 13);
  Request b = make(2, iota_tokens(9));
  ASSERT_TRUE(kv.allocate_slots(b, 9));  // no hit asked: most free is partition 1
  ASSERT_EQ(kv.partition_of(b), 1);
  b.num_computed_tokens = 9;
  kv.cache_blocks(b, 9);
  // 3 blocks in partition 0 beat 2 in partition 1, even though partition 1 has more free pages.
  Request c = make(3, iota_tokens(14));
  ComputedBlocks hit = kv.get_computed_blocks(c);
  EXPECT_EQ(hit.partition, 0);
  EXPECT_EQ(hit.num_computed_tokens, 12);
  // Both partitions hold the first 2 blocks: a 9-token prompt ties, and partition 1 has more free.
  Request d = make(4, iota_tokens(9));
  ComputedBlocks hit_d = kv.get_computed_blocks(d);
  EXPECT_EQ(hit_d.num_computed_tokens, 8);
  EXPECT_EQ(hit_d.partition, 1);
  EXPECT_EQ(hit_d.block_ids, (std::vector<int32_t>{kv.block_ids(2)[0], kv.block_ids(2)[1]}));
  // Restricted to partition 0 it gets partition 0's copy.
  ComputedBlocks hit_d0 = kv.get_computed_blocks(d, 0);
  EXPECT_EQ(hit_d0.partition, 0);
  EXPECT_EQ(hit_d0.block_ids, (std::vector<int32_t>{kv.block_ids(1)[0], kv.block_ids(1)[1]}));
}

// Many random admissions (with shared prefixes), growth and frees: a request's pages never leave
// its partition, a request admitted without a hit lands in the partition that had the most free
// pages (lowest index on ties), one with a hit in the hit's partition, and the pool stays
// consistent with the references the requests hold.
TEST(KVCacheManagerPartitions, RandomPagesNeverLeaveTheirPartition) {
  int64_t admitted = 0, hits = 0, grown = 0, refused = 0;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uniform = [&rng](int lo, int hi) {
      return std::uniform_int_distribution<int>(lo, hi)(rng);
    };
    const int parts = uniform(2, 4);
    const int bs = 4;
    KVCacheManager kv(parts * uniform(3, 10), bs, uniform(0, 3) != 0, parts);
    std::vector<std::vector<int32_t>> families(3);
    for (auto& f : families)
      for (int i = 0; i < 24; ++i) f.push_back(uniform(100, 999));
    std::map<uint64_t, Request> live;
    uint64_t next_id = 1;
    for (int op = 0; op < 600; ++op) {
      const int kind = uniform(0, 9);
      if (kind < 4) {  // admit
        std::vector<int32_t> prompt;
        const int len = uniform(1, 30);
        const auto& fam = families[uniform(0, 2)];
        const int shared = std::min(len, uniform(0, 24));
        prompt.assign(fam.begin(), fam.begin() + shared);
        while (static_cast<int>(prompt.size()) < len) prompt.push_back(uniform(100, 999));
        Request r(next_id++, prompt, StopCriteria{});
        ComputedBlocks hit = kv.get_computed_blocks(r);
        std::vector<int> free_before(parts);
        for (int p = 0; p < parts; ++p) free_before[p] = kv.block_pool().num_free_blocks(p);
        const int num_new = uniform(1, r.num_tokens() - hit.num_computed_tokens);
        if (!kv.allocate_slots(r, num_new, &hit)) {
          ++refused;
          EXPECT_TRUE(kv.block_ids(r.request_id).empty());
          continue;
        }
        const int p = kv.partition_of(r);
        if (hit.partition >= 0) {
          EXPECT_EQ(p, hit.partition);
          ++hits;
        } else {
          const int best = static_cast<int>(
              std::max_element(free_before.begin(), free_before.end()) - free_before.begin());
          EXPECT_EQ(p, best);
        }
        r.num_computed_tokens = hit.num_computed_tokens + num_new;
        kv.cache_blocks(r, r.num_computed_tokens);
        live.emplace(r.request_id, std::move(r));
        ++admitted;
      } else if (kind < 8 && !live.empty()) {  // grow: finish the prompt or decode one token
        auto it = live.begin();
        std::advance(it, uniform(0, static_cast<int>(live.size()) - 1));
        Request& r = it->second;
        if (r.num_computed_tokens == r.num_tokens())
          r.output_token_ids.push_back(uniform(100, 999));
        const int before = kv.partition_of(r);
        const int num_new = uniform(1, r.num_tokens() - r.num_computed_tokens);
        if (kv.allocate_slots(r, num_new)) {
          r.num_computed_tokens += num_new;
          kv.cache_blocks(r, r.num_computed_tokens);
          ++grown;
        } else {
          r.output_token_ids.resize(r.num_computed_tokens - r.num_prompt_tokens() > 0
                                        ? r.num_computed_tokens - r.num_prompt_tokens()
                                        : 0);
        }
        EXPECT_EQ(kv.partition_of(r), before);
      } else if (!live.empty()) {  // free
        auto it = live.begin();
        std::advance(it, uniform(0, static_cast<int>(live.size()) - 1));
        kv.free(it->second);
        EXPECT_EQ(kv.partition_of(it->second), -1);
        live.erase(it);
      }
      std::vector<int> refs(kv.block_pool().num_blocks(), 0);
      for (const auto& [id, r] : live) {
        expect_one_partition(kv, r);
        EXPECT_EQ(static_cast<int>(kv.block_ids(id).size()), (r.num_computed_tokens + bs - 1) / bs);
        for (int32_t b : kv.block_ids(id)) ++refs[b];
      }
      for (int b = 0; b < kv.block_pool().num_blocks(); ++b)
        ASSERT_EQ(refs[b], kv.block_pool().ref_count(b)) << "block " << b;
      kv.block_pool().check_consistency();
      if (HasFailure()) return;
    }
  }
  // The run must exercise every path, or it proves little.
  EXPECT_GT(admitted, 500);
  EXPECT_GT(hits, 20);
  EXPECT_GT(grown, 500);
  EXPECT_GT(refused, 20);
}

// ---- Scheduler --------------------------------------------------------------------------------

SchedulerConfig partitioned_config(int num_blocks, int block_size, int partitions, bool caching) {
  SchedulerConfig c;
  c.max_num_seqs = 16;
  c.max_num_batched_tokens = 256;
  c.max_model_len = 4096;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.num_kv_partitions = partitions;
  c.enable_prefix_caching = caching;
  return c;
}

TEST(SchedulerPartitions, ConfigMustSplitThePool) {
  SchedulerConfig c = partitioned_config(9, 4, 2, false);
  auto status = c.validate();
  ASSERT_FALSE(status);
  EXPECT_NE(status.error().message.find("2 equal partitions"), std::string::npos);
  c.num_kv_partitions = 0;
  EXPECT_FALSE(c.validate());
  c.num_kv_partitions = 3;
  EXPECT_TRUE(c.validate());
}

TEST(SchedulerPartitions, PreemptionPicksAVictimOfTheSamePartition) {
  // 2 partitions of 4 pages of 4 tokens. FCFS: A (12 tokens, 3 pages) -> 0, B (11, 3 pages) -> 1,
  // C (1 token) -> 0 on the tie, D (1 token) -> 1. Every page is taken.
  Scheduler sched(partitioned_config(8, 4, 2, false));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(12), 50)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(11, 2000), 50)));
  ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(1, 3000), 50)));
  ASSERT_TRUE(sched.add_request(make_request(4, iota_tokens(1, 4000), 50)));
  SchedulerOutput out = sched.schedule();
  ASSERT_EQ(out.requests.size(), 4u);
  sched.update_from_output(out, fake_run(out));
  const KVCacheManager& kv = sched.kv_cache_manager();
  std::map<uint64_t, int> part;
  for (uint64_t id : {1, 2, 3, 4}) part[id] = kv.partition_of(*sched.find_request(id));
  EXPECT_EQ(part, (std::map<uint64_t, int>{{1, 0}, {2, 1}, {3, 0}, {4, 1}}));
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 0);
  const std::vector<int32_t> b_pages = kv.block_ids(2);
  const std::vector<int32_t> d_pages = kv.block_ids(4);

  // Step 2: A's 13th token needs a 4th page of partition 0. D arrived last, so the single-pool
  // rule would preempt D first, but D's page is in partition 1 and useless to A: C goes instead.
  out = sched.schedule();
  EXPECT_EQ(out.preempted_ids, (std::vector<uint64_t>{3}));
  EXPECT_EQ(sched.running_ids(), (std::vector<uint64_t>{1, 2, 4}));
  EXPECT_EQ(kv.block_ids(2), b_pages);
  EXPECT_EQ(kv.block_ids(4), d_pages);
  EXPECT_EQ(kv.block_ids(1).size(), 4u);
  EXPECT_EQ(kv.partition_of(*sched.find_request(1)), 0);
  sched.update_from_output(out, fake_run(out));
  expect_pages_balance(sched);

  // Everything still finishes: C runs again once partition 0 has room.
  for (int step = 0; step < 1000 && sched.has_unfinished(); ++step) {
    out = sched.schedule();
    for (const ScheduledRequest& s : out.requests) {
      const int p = sched.kv_cache_manager().block_pool().partition_of(s.block_ids.front());
      for (int32_t b : s.block_ids)
        ASSERT_EQ(sched.kv_cache_manager().block_pool().partition_of(b), p);
    }
    sched.update_from_output(out, fake_run(out));
    expect_pages_balance(sched);
  }
  EXPECT_FALSE(sched.has_unfinished());
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 8);
}

TEST(SchedulerPartitions, ARequestCanHoldOnlyOnePartition) {
  // 2 partitions of 4 pages of 4 tokens: 16 tokens per request although the pool has 32.
  Scheduler sched(partitioned_config(8, 4, 2, false));
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(17), 5)));
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(14, 2000), 50)));
  std::map<uint64_t, RequestUpdate> finished;
  for (int step = 0; step < 100 && sched.has_unfinished(); ++step) {
    SchedulerOutput out = sched.schedule();
    for (const RequestUpdate& u : sched.update_from_output(out, fake_run(out)))
      if (u.finished) finished[u.request_id] = u;
    expect_pages_balance(sched);
  }
  ASSERT_EQ(finished.size(), 2u);
  // Too long for a partition: refused at once, not left waiting forever.
  EXPECT_EQ(finished[1].finish_reason, FinishReason::kLength);
  EXPECT_EQ(finished[1].num_output_tokens, 0);
  // Grows until it holds one whole partition (16 computed tokens), then stops with length once
  // it samples the 17th token, which no page could hold.
  EXPECT_EQ(finished[2].finish_reason, FinishReason::kLength);
  EXPECT_EQ(finished[2].num_prompt_tokens + finished[2].num_output_tokens, 17);
  EXPECT_EQ(sched.stats().num_preemptions, 0);
}

TEST(SchedulerPartitions, AHitWhosePartitionIsFullMovesToAnotherPartition) {
  // 2 partitions of 4 pages of 4 tokens, prefix caching on.
  Scheduler sched(partitioned_config(8, 4, 2, true));
  // X: 9-token prompt -> partition 0 (3 pages; its 2 full blocks get cached there).
  ASSERT_TRUE(sched.add_request(make_request(1, iota_tokens(9), 3)));
  SchedulerOutput out = sched.schedule();
  sched.update_from_output(out, fake_run(out));
  const KVCacheManager& kv = sched.kv_cache_manager();
  ASSERT_EQ(kv.partition_of(*sched.find_request(1)), 0);
  // Y (no shared prefix, 1 token) -> partition 1 (4 free vs 1); it stays within 1 page.
  ASSERT_TRUE(sched.add_request(make_request(2, iota_tokens(1, 5000), 3)));
  // Z shares X's 8-token prefix: its hit is in partition 0, which has 1 free page, enough for its
  // tail. It joins partition 0 although partition 1 has more free pages.
  ASSERT_TRUE(sched.add_request(make_request(3, iota_tokens(10), 30)));
  out = sched.schedule();
  sched.update_from_output(out, fake_run(out));
  ASSERT_EQ(kv.partition_of(*sched.find_request(2)), 1);
  ASSERT_EQ(kv.partition_of(*sched.find_request(3)), 0);
  EXPECT_EQ(sched.find_request(3)->num_cached_tokens, 8);
  EXPECT_EQ(kv.block_pool().num_free_blocks(0), 0);
  // W shares the prefix too, but partition 0 is full: rather than wait, it goes to partition 1
  // (3 free pages, W needs 3) and recomputes the prefix there (no copy in partition 1 yet).
  ASSERT_TRUE(sched.add_request(make_request(4, iota_tokens(11), 30)));
  out = sched.schedule();
  EXPECT_TRUE(out.preempted_ids.empty());
  auto w = std::find_if(out.requests.begin(), out.requests.end(),
                        [](const ScheduledRequest& s) { return s.request_id == 4; });
  ASSERT_NE(w, out.requests.end());
  EXPECT_EQ(w->start_idx, 0);
  EXPECT_EQ(w->num_new_tokens(), 11);
  for (int32_t b : w->block_ids) EXPECT_EQ(kv.block_pool().partition_of(b), 1);
  sched.update_from_output(out, fake_run(out));
  expect_pages_balance(sched);
  // Now the prefix is cached in both partitions.
  Request probe(99, iota_tokens(9), StopCriteria{});
  EXPECT_EQ(const_cast<KVCacheManager&>(kv).get_computed_blocks(probe, 1).num_computed_tokens, 8);
  EXPECT_EQ(const_cast<KVCacheManager&>(kv).get_computed_blocks(probe, 0).num_computed_tokens, 8);
}

// Random arrivals on partitioned pools: every scheduled request's pages lie in one partition (its
// partition_of, unchanged while it runs), victims are the last requests of the partition that ran
// short, pages balance, and every request finishes (none waits forever for a partition).
TEST(SchedulerPartitions, RandomRunsKeepPartitionsAndFinish) {
  int64_t preemptions = 0, steps = 0, hits = 0, victims_checked = 0;
  for (uint32_t seed = 1; seed <= 24; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uniform = [&rng](int lo, int hi) {
      return std::uniform_int_distribution<int>(lo, hi)(rng);
    };
    SchedulerConfig c;
    c.num_kv_partitions = uniform(2, 4);
    c.block_size = 4;
    c.num_blocks = c.num_kv_partitions * uniform(4, 10);
    c.max_model_len = uniform(16, 60);
    c.max_num_seqs = uniform(2, 10);
    c.max_num_batched_tokens = uniform(8, 64);
    c.enable_prefix_caching = uniform(0, 2) != 0;
    c.policy = uniform(0, 1) ? Policy::kPriority : Policy::kFcfs;
    ASSERT_TRUE(c.validate());
    Scheduler sched(c);
    std::vector<int32_t> family;
    for (int i = 0; i < 32; ++i) family.push_back(uniform(100, 999));
    uint64_t next_id = 1;
    std::set<uint64_t> finished;
    int step = 0;
    for (; step < 20000; ++step) {
      if (next_id > 80 && !sched.has_unfinished()) break;
      if (next_id <= 80 && uniform(0, 2) == 0) {
        const int len = uniform(1, 44);
        std::vector<int32_t> prompt(family.begin(), family.begin() + std::min(len, uniform(0, 32)));
        while (static_cast<int>(prompt.size()) < len) prompt.push_back(uniform(100, 999));
        ASSERT_TRUE(
            sched.add_request(make_request(next_id, prompt, uniform(1, 30), uniform(0, 2))));
        ++next_id;
      }
      const KVCacheManager& kv = sched.kv_cache_manager();
      std::map<uint64_t, int> part_before;
      std::map<uint64_t, size_t> blocks_before;
      for (uint64_t id : sched.running_ids()) {
        part_before[id] = kv.partition_of(*sched.find_request(id));
        blocks_before[id] = kv.block_ids(id).size();
      }
      SchedulerOutput out = sched.schedule();
      // Victims come only from the partition that ran short. In a victim's partition every
      // request still running goes before every victim (victims are the last ones under the
      // policy there), and some request of that partition was refused a page: one that stayed got
      // more pages, or a victim could have needed one (its tokens overflow the pages it held).
      // Requests of other partitions are never considered, whatever their order.
      auto goes_before = [&c](const Request& a, const Request& b) {
        if (c.policy == Policy::kPriority && a.priority != b.priority)
          return a.priority < b.priority;
        return a.arrival_seq < b.arrival_seq;
      };
      const std::set<uint64_t> victims(out.preempted_ids.begin(), out.preempted_ids.end());
      for (uint64_t v : out.preempted_ids) {
        ASSERT_TRUE(part_before.count(v)) << "preempted request " << v << " was not running";
        const int p = part_before[v];
        const Request* vr = sched.find_request(v);
        ASSERT_NE(vr, nullptr);
        bool someone_short = false;
        for (const auto& [id, q] : part_before) {
          if (q != p) continue;
          const Request* r = sched.find_request(id);
          if (victims.count(id)) {
            const size_t pages_wanted = (r->num_tokens() + c.block_size - 1) / c.block_size;
            if (pages_wanted > blocks_before[id]) someone_short = true;
            continue;
          }
          EXPECT_TRUE(goes_before(*r, *vr))
              << "kept " << id << " over victim " << v << " in partition " << p;
          if (kv.block_ids(id).size() > blocks_before[id]) someone_short = true;
        }
        EXPECT_TRUE(someone_short)
            << "victim " << v << " freed pages no one in partition " << p << " needed";
        ++victims_checked;
      }
      for (const ScheduledRequest& s : out.requests) {
        const Request* r = sched.find_request(s.request_id);
        ASSERT_NE(r, nullptr);
        const int p = kv.partition_of(*r);
        ASSERT_GE(p, 0);
        for (int32_t b : s.block_ids) ASSERT_EQ(kv.block_pool().partition_of(b), p);
        if (part_before.count(s.request_id)) {
          ASSERT_EQ(p, part_before[s.request_id]);
        }
      }
      for (const RequestUpdate& u : sched.update_from_output(out, fake_run(out))) {
        if (u.finished) {
          ASSERT_TRUE(finished.insert(u.request_id).second);
        }
      }
      expect_pages_balance(sched);
      if (HasFatalFailure()) return;
    }
    ASSERT_FALSE(sched.has_unfinished()) << "requests left after " << step << " steps";
    EXPECT_EQ(finished.size(), 80u);
    EXPECT_EQ(sched.kv_cache_manager().block_pool().num_free_blocks(), c.num_blocks);
    preemptions += sched.stats().num_preemptions;
    hits += sched.stats().prefix_cache_hits;
    steps += step;
  }
  EXPECT_GT(preemptions, 0);
  EXPECT_EQ(victims_checked, preemptions);
  EXPECT_GT(hits, 0);
  std::printf("partitioned random run: %lld steps, %lld preemptions, %lld prefix-hit tokens\n",
              static_cast<long long>(steps), static_cast<long long>(preemptions),
              static_cast<long long>(hits));
}

}  // namespace
}  // namespace m3::sched
