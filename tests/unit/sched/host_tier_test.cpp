// The host KV tier in the KV cache manager: evicted hashed pages are copied out (offloads), a
// prefix hit continues into the host tier and its pages are copied back (restores) into fresh
// pages, and a random workload over a simulated memory (each page and slot holds the hash of
// the block whose KV it has) shows every hit page holds its block's KV once the step's copies
// ran in SchedulerOutput's order.
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "sched/host_block_pool.h"
#include "sched/kv_cache_manager.h"
#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::iota_tokens;

Request make(uint64_t id, std::vector<int32_t> prompt) {
  return Request(id, std::move(prompt), StopCriteria{}, 0, 0);
}

// The memory the copies act on: what block (by hash) each device page and host slot holds.
struct Memory {
  std::vector<BlockHash> device, host;
  void run(const std::vector<KvPageCopy>& offloads, const std::vector<KvPageCopy>& restores) {
    for (const auto& c : offloads) host[c.host_slot] = device[c.device_page];
    for (const auto& c : restores) device[c.device_page] = host[c.host_slot];
  }
};

TEST(HostBlockPool, LruSkipsPinnedSlots) {
  HostBlockPool host(2);
  std::optional<BlockHash> dropped;
  const int32_t a = *host.store(1, &dropped);
  const int32_t b = *host.store(2, &dropped);
  EXPECT_FALSE(dropped.has_value());
  host.use(a);  // a is now the most recent and pinned: b is evicted
  EXPECT_EQ(*host.store(3, &dropped), b);
  EXPECT_EQ(dropped, BlockHash{2});
  host.use(b);
  EXPECT_FALSE(host.store(4, &dropped).has_value()) << "every slot is pinned";
  host.end_step();
  EXPECT_EQ(*host.store(4, &dropped), a);  // unpinned: the least recently used goes
  EXPECT_EQ(dropped, BlockHash{1});
  EXPECT_EQ(host.find(3), b);
  EXPECT_FALSE(host.find(1).has_value());
}

TEST(HostTier, EvictedPrefixComesBackFromHost) {
  KVCacheManager kv(4, 4, true);
  kv.enable_host_tier(8);
  kv.block_pool().set_events_enabled(true);
  std::vector<KvPageCopy> off, res;
  Request a = make(1, iota_tokens(9));  // blocks 0, 1 full + 1 token
  ComputedBlocks hit = kv.get_computed_blocks(a);
  ASSERT_TRUE(kv.allocate_slots(a, 9, &hit));
  a.num_computed_tokens = 9;
  kv.cache_blocks(a, 9);
  kv.free(a);
  kv.take_copies(&off, &res);
  EXPECT_TRUE(off.empty() && res.empty());
  (void)kv.block_pool().take_events();
  // b takes all 4 pages: a's two hashed pages are evicted and copied out.
  Request b = make(2, iota_tokens(16, 5000));
  ASSERT_TRUE(kv.allocate_slots(b, 16));
  kv.take_copies(&off, &res);
  EXPECT_EQ(off.size(), 2u);
  EXPECT_TRUE(res.empty());
  EXPECT_EQ(kv.num_offloaded_pages(), 2);
  int host_stored = 0;
  for (const KvCacheEvent& e : kv.block_pool().take_events())
    if (e.kind == KvCacheEvent::Kind::kStored && e.medium == KvMedium::kHost) {
      ++host_stored;
      EXPECT_TRUE(e.token_ids.empty());
      EXPECT_EQ(e.block_size, 0);
    }
  EXPECT_EQ(host_stored, 2);
  kv.free(b);
  // a again: nothing on the device, both blocks in the host tier.
  Request a2 = make(3, iota_tokens(9));
  hit = kv.get_computed_blocks(a2);
  EXPECT_TRUE(hit.block_ids.empty());
  EXPECT_EQ(hit.host_slots.size(), 2u);
  EXPECT_EQ(hit.num_computed_tokens, 8);
  ASSERT_TRUE(kv.allocate_slots(a2, 1, &hit));
  kv.take_copies(&off, &res);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[0].device_page, kv.block_ids(3)[0]);
  EXPECT_EQ(res[1].device_page, kv.block_ids(3)[1]);
  EXPECT_EQ(kv.num_restored_pages(), 2);
  // Restored pages are cached on the device again under their hashes.
  EXPECT_EQ(kv.block_pool().block_hash(res[0].device_page), a2.block_hashes[0]);
}

TEST(HostTier, RandomWorkloadReadsTheRightKv) {
  std::mt19937 rng(11);
  const int bs = 4;
  KVCacheManager kv(10, bs, true);
  kv.enable_host_tier(6);
  Memory mem{std::vector<BlockHash>(10, 0), std::vector<BlockHash>(6, 0)};
  std::vector<Request> reqs;
  reqs.reserve(2000);
  std::vector<size_t> running;
  int64_t restored_hits = 0;
  for (int step = 0; step < 1500; ++step) {
    if (!running.empty() && (rng() % 2 == 0 || running.size() > 2)) {
      const size_t k = rng() % running.size();
      kv.free(reqs[running[k]]);
      running.erase(running.begin() + static_cast<long>(k));
      continue;
    }
    const int family = static_cast<int>(rng() % 6);
    std::vector<int32_t> p = iota_tokens(bs * (1 + family % 3), 1000 + 100 * family);
    for (int i = 0; i < 1 + static_cast<int>(rng() % 3); ++i) p.push_back(3 + i);
    reqs.push_back(make(static_cast<uint64_t>(reqs.size() + 1), p));
    Request& r = reqs.back();
    ComputedBlocks hit = kv.get_computed_blocks(r);
    if (!kv.allocate_slots(r, r.num_tokens() - hit.num_computed_tokens, &hit)) continue;
    std::vector<KvPageCopy> off, res;
    kv.take_copies(&off, &res);
    mem.run(off, res);
    const auto& pages = kv.block_ids(r.request_id);
    const int num_hit = hit.num_computed_tokens / bs;
    restored_hits += static_cast<int64_t>(hit.host_slots.size());
    for (int b = 0; b < num_hit; ++b)
      ASSERT_EQ(mem.device[pages[b]], r.block_hashes[b]) << "step " << step << " block " << b;
    // The forward writes the rest; then the full blocks are cached.
    r.num_computed_tokens = r.num_tokens();
    kv.cache_blocks(r, r.num_computed_tokens);
    for (int b = num_hit; b < r.num_tokens() / bs; ++b) mem.device[pages[b]] = r.block_hashes[b];
    running.push_back(reqs.size() - 1);
  }
  EXPECT_GT(kv.num_offloaded_pages(), 50);
  EXPECT_GT(restored_hits, 50) << "the workload should hit the host tier";
}

}  // namespace
}  // namespace m3::sched
