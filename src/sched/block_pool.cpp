#include "sched/block_pool.h"

#include "core/check.h"

namespace m3::sched {

BlockPool::BlockPool(int num_blocks, int block_size, bool enable_prefix_caching)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching) {
  M3_CHECK(num_blocks > 0 && block_size > 0, "BlockPool(%d blocks, block size %d)", num_blocks,
           block_size);
  blocks_.resize(num_blocks);
  for (int32_t id = 0; id < num_blocks; ++id) queue_push_back(id);
}

double BlockPool::usage() const {
  return 1.0 - static_cast<double>(num_free_) / static_cast<double>(num_blocks_);
}

std::optional<int32_t> BlockPool::get_cached_block(BlockHash hash) const {
  if (!enable_prefix_caching_) return std::nullopt;
  auto it = cached_.find(hash);
  if (it == cached_.end()) return std::nullopt;
  return it->second;
}

std::vector<int32_t> BlockPool::get_new_blocks(int n) {
  M3_CHECK(n >= 0 && n <= num_free_, "asked for %d blocks with %d free", n, num_free_);
  std::vector<int32_t> ids;
  ids.reserve(n);
  for (int i = 0; i < n; ++i) {
    const int32_t id = queue_pop_front();
    Block& b = blocks_[id];
    M3_CHECK(b.ref_cnt == 0, "block %d in the free queue has ref count %d", id, b.ref_cnt);
    drop_hash(id);
    b.ref_cnt = 1;
    ids.push_back(id);
  }
  return ids;
}

void BlockPool::touch(std::span<const int32_t> block_ids) {
  for (int32_t id : block_ids) {
    M3_CHECK(id >= 0 && id < num_blocks_, "block id %d", id);
    Block& b = blocks_[id];
    if (b.ref_cnt == 0) queue_remove(id);
    ++b.ref_cnt;
  }
}

void BlockPool::free_blocks(std::span<const int32_t> block_ids) {
  for (int32_t id : block_ids) {
    M3_CHECK(id >= 0 && id < num_blocks_, "block id %d", id);
    Block& b = blocks_[id];
    M3_CHECK(b.ref_cnt > 0, "freeing block %d with ref count 0 (double free)", id);
    if (--b.ref_cnt == 0) queue_push_back(id);
  }
}

bool BlockPool::cache_block(int32_t block_id, BlockHash hash) {
  if (!enable_prefix_caching_) return false;
  M3_CHECK(block_id >= 0 && block_id < num_blocks_, "block id %d", block_id);
  Block& b = blocks_[block_id];
  M3_CHECK(b.ref_cnt > 0, "caching free block %d", block_id);
  M3_CHECK(!b.has_hash, "block %d is already cached", block_id);
  if (!cached_.emplace(hash, block_id).second) return false;
  b.has_hash = true;
  b.hash = hash;
  return true;
}

bool BlockPool::reset_prefix_cache() {
  if (num_free_ != num_blocks_) return false;
  for (auto& [hash, id] : cached_) blocks_[id].has_hash = false;
  cached_.clear();
  return true;
}

int BlockPool::ref_count(int32_t block_id) const {
  M3_CHECK(block_id >= 0 && block_id < num_blocks_, "block id %d", block_id);
  return blocks_[block_id].ref_cnt;
}

std::optional<BlockHash> BlockPool::block_hash(int32_t block_id) const {
  M3_CHECK(block_id >= 0 && block_id < num_blocks_, "block id %d", block_id);
  const Block& b = blocks_[block_id];
  if (!b.has_hash) return std::nullopt;
  return b.hash;
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> ids;
  ids.reserve(num_free_);
  for (int32_t id = head_; id != -1; id = blocks_[id].next) ids.push_back(id);
  return ids;
}

void BlockPool::check_consistency() const {
  int num_zero_ref = 0;
  int num_hashed = 0;
  for (int32_t id = 0; id < num_blocks_; ++id) {
    const Block& b = blocks_[id];
    M3_CHECK(b.ref_cnt >= 0, "block %d ref count %d", id, b.ref_cnt);
    M3_CHECK((b.ref_cnt == 0) == b.in_free_queue, "block %d: ref %d, in free queue %d", id,
             b.ref_cnt, static_cast<int>(b.in_free_queue));
    if (b.ref_cnt == 0) ++num_zero_ref;
    if (b.has_hash) {
      ++num_hashed;
      auto it = cached_.find(b.hash);
      M3_CHECK(it != cached_.end() && it->second == id, "block %d hash not in the cache map", id);
    }
  }
  M3_CHECK(num_zero_ref == num_free_, "%d blocks at ref 0 but %d counted free", num_zero_ref,
           num_free_);
  M3_CHECK(num_hashed == static_cast<int>(cached_.size()), "%d hashed blocks, %zu map entries",
           num_hashed, cached_.size());
  int walked = 0;
  int32_t prev = -1;
  for (int32_t id = head_; id != -1; id = blocks_[id].next) {
    M3_CHECK(blocks_[id].prev == prev, "free queue links broken at block %d", id);
    M3_CHECK(++walked <= num_free_, "free queue longer than %d (cycle?)", num_free_);
    prev = id;
  }
  M3_CHECK(prev == tail_ && walked == num_free_, "free queue walk %d blocks, expected %d", walked,
           num_free_);
}

void BlockPool::queue_remove(int32_t id) {
  Block& b = blocks_[id];
  M3_CHECK(b.in_free_queue, "block %d is not in the free queue", id);
  if (b.prev != -1)
    blocks_[b.prev].next = b.next;
  else
    head_ = b.next;
  if (b.next != -1)
    blocks_[b.next].prev = b.prev;
  else
    tail_ = b.prev;
  b.prev = b.next = -1;
  b.in_free_queue = false;
  --num_free_;
}

void BlockPool::queue_push_back(int32_t id) {
  Block& b = blocks_[id];
  M3_CHECK(!b.in_free_queue, "block %d is already in the free queue", id);
  b.prev = tail_;
  b.next = -1;
  if (tail_ != -1)
    blocks_[tail_].next = id;
  else
    head_ = id;
  tail_ = id;
  b.in_free_queue = true;
  ++num_free_;
}

int32_t BlockPool::queue_pop_front() {
  M3_CHECK(head_ != -1, "free queue is empty");
  const int32_t id = head_;
  queue_remove(id);
  return id;
}

void BlockPool::drop_hash(int32_t id) {
  Block& b = blocks_[id];
  if (!b.has_hash) return;
  auto it = cached_.find(b.hash);
  if (it != cached_.end() && it->second == id) cached_.erase(it);
  b.has_hash = false;
}

}  // namespace m3::sched
