// BlockPool and hash_block: accounting, LRU eviction order of free cached pages, cache map rules.
#include "sched/block_pool.h"

#include <vector>

#include <gtest/gtest.h>

#include "sched/block_hash.h"

namespace m3::sched {
namespace {

TEST(BlockHash, ChainParentExtraAndTokensAllMatter) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {1, 2, 3, 5};
  const BlockHash h = hash_block(kRootBlockHash, 0, a);
  EXPECT_EQ(h, hash_block(kRootBlockHash, 0, a));  // deterministic
  EXPECT_NE(h, hash_block(kRootBlockHash, 0, b));  // tokens
  EXPECT_NE(h, hash_block(h, 0, a));               // parent: same block after another prefix
  EXPECT_NE(h, hash_block(kRootBlockHash, 7, a));  // extra key (cache salt / LoRA / multimodal)
  // Token order matters, not just the multiset.
  EXPECT_NE(hash_block(kRootBlockHash, 0, std::vector<int32_t>{4, 3, 2, 1}), h);
}

TEST(BlockPool, StartsAllFreeInIdOrder) {
  BlockPool pool(8, 128, true);
  EXPECT_EQ(pool.num_free_blocks(), 8);
  EXPECT_DOUBLE_EQ(pool.usage(), 0.0);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  pool.check_consistency();
}

TEST(BlockPool, AllocateAndFreeBalance) {
  BlockPool pool(8, 128, true);
  std::vector<int32_t> got = pool.get_new_blocks(3);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.num_free_blocks(), 5);
  EXPECT_DOUBLE_EQ(pool.usage(), 3.0 / 8.0);
  for (int32_t id : got) EXPECT_EQ(pool.ref_count(id), 1);
  pool.touch(std::vector<int32_t>{1});  // a second request shares block 1
  EXPECT_EQ(pool.ref_count(1), 2);
  pool.free_blocks(std::vector<int32_t>{2, 1, 0});
  EXPECT_EQ(pool.num_free_blocks(), 7);  // block 1 still held once
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{3, 4, 5, 6, 7, 2, 0}));
  pool.free_blocks(std::vector<int32_t>{1});
  EXPECT_EQ(pool.num_free_blocks(), 8);
  pool.check_consistency();
}

TEST(BlockPool, EvictsFreeCachedBlocksInLruOrder) {
  BlockPool pool(6, 4, true);
  std::vector<int32_t> ids = pool.get_new_blocks(4);  // 0..3
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(pool.cache_block(ids[i], 100 + i));
  // The manager frees a request's pages last-first, so its tail is evicted first.
  pool.free_blocks(std::vector<int32_t>{3, 2, 1, 0});
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{4, 5, 3, 2, 1, 0}));
  EXPECT_EQ(pool.num_cached_blocks(), 4);
  EXPECT_EQ(pool.get_cached_block(102), 2);  // cached pages stay findable while free

  // Never-cached free pages go first, then the cached ones in free order.
  EXPECT_EQ(pool.get_new_blocks(2), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(pool.num_cached_blocks(), 4);
  EXPECT_EQ(pool.get_new_blocks(1), (std::vector<int32_t>{3}));
  EXPECT_FALSE(pool.get_cached_block(103).has_value());  // evicted: its hash entry is gone
  EXPECT_FALSE(pool.block_hash(3).has_value());
  EXPECT_EQ(pool.get_cached_block(100), 0);
  EXPECT_EQ(pool.num_cached_blocks(), 3);

  // A hit on a free cached page takes it out of the middle of the queue.
  pool.touch(std::vector<int32_t>{1});
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.block_hash(1), BlockHash{101});
  pool.check_consistency();

  // Freed again later, it is now the most recently used: evicted last.
  pool.free_blocks(std::vector<int32_t>{1});
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{2, 0, 1}));
  pool.check_consistency();
}

TEST(BlockPool, DuplicateHashKeepsFirstBlock) {
  BlockPool pool(4, 4, true);
  std::vector<int32_t> ids = pool.get_new_blocks(2);
  EXPECT_TRUE(pool.cache_block(ids[0], 42));
  EXPECT_FALSE(pool.cache_block(ids[1], 42));
  EXPECT_EQ(pool.get_cached_block(42), ids[0]);
  EXPECT_FALSE(pool.block_hash(ids[1]).has_value());
  // Evicting the unregistered duplicate must not drop the entry of the first block.
  pool.free_blocks(std::vector<int32_t>{ids[1]});
  pool.get_new_blocks(3);  // 2, 3, then ids[1]
  EXPECT_EQ(pool.get_cached_block(42), ids[0]);
  pool.check_consistency();
}

TEST(BlockPool, ResetPrefixCacheOnlyWhenIdle) {
  BlockPool pool(4, 4, true);
  std::vector<int32_t> ids = pool.get_new_blocks(1);
  pool.cache_block(ids[0], 7);
  EXPECT_FALSE(pool.reset_prefix_cache());
  pool.free_blocks(ids);
  EXPECT_TRUE(pool.get_cached_block(7).has_value());
  EXPECT_TRUE(pool.reset_prefix_cache());
  EXPECT_FALSE(pool.get_cached_block(7).has_value());
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  pool.check_consistency();
}

TEST(BlockPool, CachingDisabledRegistersNothing) {
  BlockPool pool(4, 4, false);
  std::vector<int32_t> ids = pool.get_new_blocks(1);
  EXPECT_FALSE(pool.cache_block(ids[0], 7));
  EXPECT_FALSE(pool.get_cached_block(7).has_value());
  pool.check_consistency();
}

TEST(BlockPoolDeathTest, DoubleFreeIsABug) {
  BlockPool pool(2, 4, true);
  std::vector<int32_t> ids = pool.get_new_blocks(1);
  pool.free_blocks(ids);
  EXPECT_DEATH(pool.free_blocks(ids), "double free");
}

TEST(BlockPoolDeathTest, OverAllocationIsABug) {
  BlockPool pool(2, 4, true);
  EXPECT_DEATH(pool.get_new_blocks(3), "asked for 3 blocks with 2 free");
}

}  // namespace
}  // namespace m3::sched
