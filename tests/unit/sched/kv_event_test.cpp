// KV cache events from the block pool and the KV cache manager: a full block is reported stored
// once with its chain parent and its tokens, an evicted hashed page is reported removed once, a
// reset clears every partition, and a random workload keeps the stream equal to the cache maps.
#include "sched/kv_event.h"

#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "sched/kv_cache_manager.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::iota_tokens;

Request make(uint64_t id, std::vector<int32_t> prompt) {
  return Request(id, std::move(prompt), StopCriteria{}, 0, 0);
}

void admit_and_compute(KVCacheManager& kv, Request& r) {
  ComputedBlocks hit = kv.get_computed_blocks(r);
  ASSERT_TRUE(kv.allocate_slots(r, r.num_tokens() - hit.num_computed_tokens, &hit));
  r.num_computed_tokens = r.num_tokens();
  kv.cache_blocks(r, r.num_computed_tokens);
}

TEST(KvEvents, OffByDefault) {
  KVCacheManager kv(8, 4, true);
  Request a = make(1, iota_tokens(10));
  admit_and_compute(kv, a);
  EXPECT_TRUE(kv.block_pool().take_events().empty());
}

TEST(KvEvents, StoredCarriesParentAndTokensRemovedOnEviction) {
  KVCacheManager kv(4, 4, true);
  kv.block_pool().set_events_enabled(true);
  Request a = make(1, iota_tokens(10));  // 2 full blocks + 2 tokens
  admit_and_compute(kv, a);
  std::vector<KvCacheEvent> ev = kv.block_pool().take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvCacheEvent::Kind::kStored);
  EXPECT_EQ(ev[0].medium, KvMedium::kDevice);
  ASSERT_EQ(ev[0].block_hashes.size(), 2u);
  EXPECT_EQ(ev[0].block_hashes[0], a.block_hashes[0]);
  EXPECT_EQ(ev[0].block_hashes[1], a.block_hashes[1]);
  EXPECT_FALSE(ev[0].parent_block_hash.has_value());  // the sequence's first block
  EXPECT_EQ(ev[0].token_ids,
            (std::vector<int32_t>(a.prompt_token_ids.begin(), a.prompt_token_ids.begin() + 8)));
  // Two more tokens complete block 2: one store whose parent is block 1.
  a.output_token_ids = {5000, 5001};
  ASSERT_TRUE(kv.allocate_slots(a, 2));
  a.num_computed_tokens = 12;
  kv.cache_blocks(a, 12);
  ev = kv.block_pool().take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].block_hashes, std::vector<BlockHash>{a.block_hashes[2]});
  ASSERT_TRUE(ev[0].parent_block_hash.has_value());
  EXPECT_EQ(*ev[0].parent_block_hash, a.block_hashes[1]);
  EXPECT_EQ(ev[0].token_ids, (std::vector<int32_t>{1008, 1009, 5000, 5001}));
  // Freed, then a different 16-token prompt takes all 4 pages: the 3 hashed ones are evicted in
  // one removal (the unhashed page carries no hash to report).
  kv.free(a);
  EXPECT_TRUE(kv.block_pool().take_events().empty());  // freeing keeps the cache
  Request b = make(2, iota_tokens(16, 9000));
  ASSERT_TRUE(kv.allocate_slots(b, 16));
  ev = kv.block_pool().take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvCacheEvent::Kind::kRemoved);
  std::set<BlockHash> removed(ev[0].block_hashes.begin(), ev[0].block_hashes.end());
  EXPECT_EQ(removed,
            (std::set<BlockHash>{a.block_hashes[0], a.block_hashes[1], a.block_hashes[2]}));
}

TEST(KvEvents, SharedPrefixIsStoredOnceAndResetClearsEveryPartition) {
  KVCacheManager kv(8, 4, true, /*num_partitions=*/2);
  kv.block_pool().set_events_enabled(true);
  Request a = make(1, iota_tokens(9));
  admit_and_compute(kv, a);
  Request b = make(2, iota_tokens(9));  // hits a's two blocks: nothing new to store
  admit_and_compute(kv, b);
  std::vector<KvCacheEvent> ev = kv.block_pool().take_events();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].block_hashes.size(), 2u);
  EXPECT_EQ(ev[0].partition, kv.partition_of(a));
  kv.free(a);
  kv.free(b);
  ASSERT_TRUE(kv.block_pool().reset_prefix_cache());
  ev = kv.block_pool().take_events();
  ASSERT_EQ(ev.size(), 2u);
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(ev[p].kind, KvCacheEvent::Kind::kAllCleared);
    EXPECT_EQ(ev[p].partition, p);
  }
}

// Random admissions, growth and frees over a small pool: replaying the event stream gives
// exactly the pool's set of cached hashes after every step, and no hash is stored twice without
// a removal in between.
TEST(KvEvents, StreamReplaysToThePoolsCache) {
  std::mt19937 rng(7);
  KVCacheManager kv(12, 4, true);
  kv.block_pool().set_events_enabled(true);
  std::set<BlockHash> live;
  std::vector<Request> reqs;
  reqs.reserve(400);
  std::vector<size_t> running;
  for (int step = 0; step < 300; ++step) {
    if (!running.empty() && rng() % 3 == 0) {
      const size_t k = rng() % running.size();
      kv.free(reqs[running[k]]);
      running.erase(running.begin() + static_cast<long>(k));
    } else {
      // Prompts from a few shared prefixes, so hits, duplicates and evictions all happen.
      std::vector<int32_t> p = iota_tokens(4 * static_cast<int>(1 + rng() % 3), 1000);
      const int32_t tail = static_cast<int32_t>(rng() % 4);
      for (int i = 0; i < 1 + static_cast<int>(rng() % 5); ++i) p.push_back(2000 + tail + i);
      reqs.push_back(make(static_cast<uint64_t>(reqs.size() + 1), p));
      Request& r = reqs.back();
      ComputedBlocks hit = kv.get_computed_blocks(r);
      if (kv.allocate_slots(r, r.num_tokens() - hit.num_computed_tokens, &hit)) {
        r.num_computed_tokens = r.num_tokens();
        kv.cache_blocks(r, r.num_computed_tokens);
        running.push_back(reqs.size() - 1);
      }
    }
    for (const KvCacheEvent& e : kv.block_pool().take_events()) {
      if (e.kind == KvCacheEvent::Kind::kStored) {
        EXPECT_EQ(e.token_ids.size(), e.block_hashes.size() * 4);
        for (BlockHash h : e.block_hashes) EXPECT_TRUE(live.insert(h).second) << "stored twice";
      } else if (e.kind == KvCacheEvent::Kind::kRemoved) {
        for (BlockHash h : e.block_hashes) EXPECT_EQ(live.erase(h), 1u) << "removed unstored";
      }
    }
    std::set<BlockHash> cached;
    for (int32_t id = 0; id < kv.block_pool().num_blocks(); ++id)
      if (auto h = kv.block_pool().block_hash(id)) cached.insert(*h);
    ASSERT_EQ(live, cached) << "step " << step;
  }
}

}  // namespace
}  // namespace m3::sched
