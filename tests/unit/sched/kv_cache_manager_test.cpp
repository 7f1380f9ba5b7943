// KVCacheManager: prefix hits in full blocks (never the whole prompt), all-or-nothing allocation,
// caching of generated tokens, cache salt isolation, hit/query counters.
#include "sched/kv_cache_manager.h"

#include <vector>

#include <gtest/gtest.h>

#include "sched_test_util.h"

namespace m3::sched {
namespace {

using testing::iota_tokens;

Request make(uint64_t id, std::vector<int32_t> prompt, uint64_t salt = 0) {
  return Request(id, std::move(prompt), StopCriteria{}, 0, salt);
}

// Admits a request with its prefix hit and marks all of its prompt computed and cached, as the
// scheduler does after the runner finished the prefill.
ComputedBlocks admit_and_compute(KVCacheManager& kv, Request& r) {
  ComputedBlocks hit = kv.get_computed_blocks(r);
  EXPECT_TRUE(kv.allocate_slots(r, r.num_tokens() - hit.num_computed_tokens, &hit));
  r.num_computed_tokens = r.num_tokens();
  kv.cache_blocks(r, r.num_computed_tokens);
  return hit;
}

TEST(KVCacheManager, PrefixHitIsFullBlocksAndNeverTheWholePrompt) {
  KVCacheManager kv(16, 128, true);
  Request a = make(1, iota_tokens(300));
  ComputedBlocks hit_a = admit_and_compute(kv, a);
  EXPECT_EQ(hit_a.num_computed_tokens, 0);
  ASSERT_EQ(kv.block_ids(1).size(), 3u);  // ceil(300 / 128)

  // Same 300-token prompt: both full blocks hit, the 44-token tail is computed.
  Request b = make(2, iota_tokens(300));
  ComputedBlocks hit_b = kv.get_computed_blocks(b);
  EXPECT_EQ(hit_b.num_computed_tokens, 256);
  EXPECT_EQ(hit_b.block_ids, (std::vector<int32_t>{kv.block_ids(1)[0], kv.block_ids(1)[1]}));

  // A prompt of exactly two full cached blocks: the hit stops one block short, so the last token
  // is recomputed and produces logits.
  Request c = make(3, iota_tokens(256));
  ComputedBlocks hit_c = kv.get_computed_blocks(c);
  EXPECT_EQ(hit_c.num_computed_tokens, 128);
  EXPECT_LT(hit_c.num_computed_tokens, c.num_tokens());

  // One different token in the first block breaks the whole chain.
  std::vector<int32_t> p = iota_tokens(300);
  p[5] = 7;
  Request d = make(4, p);
  EXPECT_EQ(kv.get_computed_blocks(d).num_computed_tokens, 0);
  // A different token only in the second block keeps the first one.
  p = iota_tokens(300);
  p[200] = 7;
  Request e = make(5, p);
  EXPECT_EQ(kv.get_computed_blocks(e).num_computed_tokens, 128);
  // A different cache salt never shares.
  Request f = make(6, iota_tokens(300), /*salt=*/99);
  EXPECT_EQ(kv.get_computed_blocks(f).num_computed_tokens, 0);
}

// Content spans (images): blocks a span touches are keyed by its hash, and so is every later one.
TEST(KVCacheManager, ContentSpansKeyTheirBlocks) {
  KVCacheManager kv(16, 128, true);
  Request a = make(1, iota_tokens(500));
  a.content_spans.push_back({200, 100, 0xAAAA});  // inside block 1 (and reaching block 2)
  admit_and_compute(kv, a);
  Request same = make(2, iota_tokens(500));
  same.content_spans.push_back({200, 100, 0xAAAA});
  EXPECT_EQ(kv.get_computed_blocks(same).num_computed_tokens, 384);  // all 3 full blocks
  Request other = make(3, iota_tokens(500));
  other.content_spans.push_back({200, 100, 0xBBBB});  // another image, same placeholder ids
  EXPECT_EQ(kv.get_computed_blocks(other).num_computed_tokens, 128);  // block 0 only
  Request none = make(4, iota_tokens(500));  // the same ids without the image
  EXPECT_EQ(kv.get_computed_blocks(none).num_computed_tokens, 128);
}

TEST(KVCacheManager, SharedPagesAreReferenceCountedAndCountersTrackHits) {
  KVCacheManager kv(16, 128, true);
  Request a = make(1, iota_tokens(300));
  admit_and_compute(kv, a);
  Request b = make(2, iota_tokens(300));
  ComputedBlocks hit = admit_and_compute(kv, b);
  EXPECT_EQ(hit.num_computed_tokens, 256);
  EXPECT_EQ(kv.block_ids(2)[0], kv.block_ids(1)[0]);
  EXPECT_EQ(kv.block_ids(2)[1], kv.block_ids(1)[1]);
  EXPECT_NE(kv.block_ids(2)[2], kv.block_ids(1)[2]);  // the partial tail is private
  EXPECT_EQ(kv.block_pool().ref_count(kv.block_ids(1)[0]), 2);
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 16 - 4);
  EXPECT_EQ(kv.prefix_cache_queries(), 600);
  EXPECT_EQ(kv.prefix_cache_hits(), 256);
  EXPECT_EQ(kv.num_held_references(), 6);

  kv.free(a);
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 16 - 3);
  kv.free(b);
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 16);
  EXPECT_EQ(kv.num_held_references(), 0);
  kv.block_pool().check_consistency();

  // Freed pages keep their hashes: a third request still hits them.
  Request c = make(3, iota_tokens(300));
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 256);
}

TEST(KVCacheManager, AllocationIsAllOrNothing) {
  KVCacheManager kv(4, 4, true);
  Request a = make(1, iota_tokens(13));  // needs 4 pages
  Request b = make(2, iota_tokens(5, 5000));
  ASSERT_TRUE(kv.allocate_slots(b, 1));  // b holds one page
  EXPECT_FALSE(kv.allocate_slots(a, 13));
  EXPECT_TRUE(kv.block_ids(1).empty());
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 3);
  EXPECT_TRUE(kv.allocate_slots(a, 12));  // 3 pages fit
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 0);
  a.num_computed_tokens = 12;
  EXPECT_FALSE(kv.allocate_slots(a, 1));  // a 4th page is not there
  EXPECT_EQ(kv.block_ids(1).size(), 3u);
  // Growing inside the last page needs no new one.
  b.num_computed_tokens = 1;
  EXPECT_TRUE(kv.allocate_slots(b, 3));
  EXPECT_EQ(kv.block_ids(2).size(), 1u);
  kv.block_pool().check_consistency();
}

TEST(KVCacheManager, HitOnFreeCachedPagesDoesNotDoubleCountThem) {
  // 3 pages of 4 tokens. a fills all three and finishes; b hits a's two full pages (now free) and
  // needs one more: 3 free - 2 taken by the hit = 1 available, exactly enough.
  KVCacheManager kv(3, 4, true);
  Request a = make(1, iota_tokens(9));
  admit_and_compute(kv, a);
  kv.free(a);
  Request b = make(2, iota_tokens(10));
  ComputedBlocks hit = kv.get_computed_blocks(b);
  EXPECT_EQ(hit.num_computed_tokens, 8);
  EXPECT_TRUE(kv.allocate_slots(b, 2, &hit));
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 0);
  kv.free(b);
  // c hits two free pages but would need two new ones: only one is left after the hit.
  Request c = make(3, iota_tokens(13));
  ComputedBlocks hit_c = kv.get_computed_blocks(c);
  EXPECT_EQ(hit_c.num_computed_tokens, 8);
  EXPECT_FALSE(kv.allocate_slots(c, 5, &hit_c));
  EXPECT_EQ(kv.block_pool().num_free_blocks(), 3);
  EXPECT_EQ(kv.block_pool().ref_count(hit_c.block_ids[0]), 0);
  kv.block_pool().check_consistency();
}

TEST(KVCacheManager, GeneratedTokensAreCachedOnceComputed) {
  KVCacheManager kv(8, 4, true);
  Request a = make(1, iota_tokens(3));
  ASSERT_TRUE(kv.allocate_slots(a, 3));
  a.num_computed_tokens = 3;
  kv.cache_blocks(a, 3);
  EXPECT_EQ(kv.block_pool().num_cached_blocks(), 0);  // no full block yet
  // Decode: sample 2000, 2001, 2002, computing each on the next step.
  for (int32_t t = 2000; t < 2003; ++t) {
    a.output_token_ids.push_back(t);
    ASSERT_TRUE(kv.allocate_slots(a, 1));
    a.num_computed_tokens += 1;
    kv.cache_blocks(a, a.num_computed_tokens);
  }
  EXPECT_EQ(a.num_computed_tokens, 6);
  EXPECT_EQ(kv.block_pool().num_cached_blocks(), 1);  // block 0 = prompt + first output token
  // A new prompt equal to prompt + outputs hits that block.
  Request b = make(2, {1000, 1001, 1002, 2000, 2001, 2002});
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 4);
  // Caching uses only computed tokens: the uncomputed sampled token never enters a hash.
  a.output_token_ids.push_back(2003);
  a.output_token_ids.push_back(2004);  // num_tokens 8, computed 6
  kv.cache_blocks(a, a.num_computed_tokens);
  EXPECT_EQ(kv.block_pool().num_cached_blocks(), 1);
}

TEST(KVCacheManager, FreeReturnsTheTailFirstSoItIsEvictedFirst) {
  KVCacheManager kv(6, 4, true);
  Request a = make(1, iota_tokens(12));
  admit_and_compute(kv, a);
  const std::vector<int32_t> blocks = kv.block_ids(1);  // 3 cached pages
  kv.free(a);
  EXPECT_EQ(kv.block_pool().free_queue(),
            (std::vector<int32_t>{3, 4, 5, blocks[2], blocks[1], blocks[0]}));
  // Pressure for 4 new pages evicts the untouched ones, then a's last page; its prefix survives.
  Request b = make(2, iota_tokens(16, 5000));
  ASSERT_TRUE(kv.allocate_slots(b, 16));
  Request c = make(3, iota_tokens(12));
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 8);
}

TEST(KVCacheManager, DisabledCachingNeverHits) {
  KVCacheManager kv(8, 4, false);
  Request a = make(1, iota_tokens(9));
  admit_and_compute(kv, a);
  Request b = make(2, iota_tokens(9));
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
  EXPECT_EQ(kv.prefix_cache_queries(), 0);
}

}  // namespace
}  // namespace m3::sched
