#include "sched/block_pool.h"

#include "core/check.h"

namespace m3::sched {

const char* kv_medium_name(KvMedium medium) {
  return medium == KvMedium::kHost ? "CPU" : "GPU";
}

BlockPool::BlockPool(int num_blocks, int block_size, bool enable_prefix_caching, int num_partitions)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      blocks_per_partition_(num_partitions > 0 ? num_blocks / num_partitions : 0) {
  M3_CHECK(num_blocks > 0 && block_size > 0, "BlockPool(%d blocks, block size %d)", num_blocks,
           block_size);
  M3_CHECK(num_partitions > 0 && num_blocks % num_partitions == 0,
           "BlockPool: %d blocks do not split into %d equal partitions", num_blocks,
           num_partitions);
  blocks_.resize(num_blocks);
  parts_.resize(num_partitions);
  // Ids in order: each partition's queue starts as its ids ascending (one partition: 0..n-1).
  for (int32_t id = 0; id < num_blocks; ++id) queue_push_back(id);
}

int BlockPool::partition_of(int32_t block) const {
  check_id(block);
  return block / blocks_per_partition_;
}

int BlockPool::num_free_blocks(int partition) const {
  check_partition(partition);
  return parts_[partition].num_free;
}

double BlockPool::usage() const {
  return 1.0 - static_cast<double>(num_free_) / static_cast<double>(num_blocks_);
}

int BlockPool::num_cached_blocks() const {
  size_t n = 0;
  for (const Partition& p : parts_) n += p.cached.size();
  return static_cast<int>(n);
}

std::optional<int32_t> BlockPool::get_cached_block(BlockHash hash, int partition) const {
  check_partition(partition);
  if (!enable_prefix_caching_) return std::nullopt;
  const auto& cached = parts_[partition].cached;
  auto it = cached.find(hash);
  if (it == cached.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> BlockPool::get_cached_block(BlockHash hash) const {
  for (int p = 0; p < num_partitions(); ++p)
    if (auto id = get_cached_block(hash, p)) return id;
  return std::nullopt;
}

std::vector<int32_t> BlockPool::get_new_blocks(int n, int partition) {
  check_partition(partition);
  const int num_free = parts_[partition].num_free;
  M3_CHECK(n >= 0 && n <= num_free, "asked for %d blocks with %d free (partition %d)", n, num_free,
           partition);
  std::vector<int32_t> ids;
  ids.reserve(n);
  KvCacheEvent removed;
  removed.kind = KvCacheEvent::Kind::kRemoved;
  removed.partition = partition;
  for (int i = 0; i < n; ++i) {
    const int32_t id = queue_pop_front(partition);
    Block& b = blocks_[id];
    M3_CHECK(b.ref_cnt == 0, "block %d in the free queue has ref count %d", id, b.ref_cnt);
    if (drop_hash(id)) {
      if (events_enabled_) removed.block_hashes.push_back(b.hash);
      if (track_evictions_) evictions_.emplace_back(id, b.hash);
    }
    b.ref_cnt = 1;
    ids.push_back(id);
  }
  if (!removed.block_hashes.empty()) events_.push_back(std::move(removed));
  return ids;
}

std::vector<int32_t> BlockPool::get_new_blocks(int n) {
  M3_CHECK(num_partitions() == 1,
           "get_new_blocks(%d) without a partition on a pool of %d partitions", n,
           num_partitions());
  return get_new_blocks(n, 0);
}

void BlockPool::touch(std::span<const int32_t> block_ids) {
  for (int32_t id : block_ids) {
    check_id(id);
    Block& b = blocks_[id];
    if (b.ref_cnt == 0) queue_remove(id);
    ++b.ref_cnt;
  }
}

void BlockPool::free_blocks(std::span<const int32_t> block_ids) {
  for (int32_t id : block_ids) {
    check_id(id);
    Block& b = blocks_[id];
    M3_CHECK(b.ref_cnt > 0, "freeing block %d with ref count 0 (double free)", id);
    if (--b.ref_cnt == 0) queue_push_back(id);
  }
}

bool BlockPool::cache_block(int32_t block_id, BlockHash hash) {
  if (!enable_prefix_caching_) return false;
  check_id(block_id);
  Block& b = blocks_[block_id];
  M3_CHECK(b.ref_cnt > 0, "caching free block %d", block_id);
  M3_CHECK(!b.has_hash, "block %d is already cached", block_id);
  if (!parts_[partition_of(block_id)].cached.emplace(hash, block_id).second) return false;
  b.has_hash = true;
  b.hash = hash;
  return true;
}

bool BlockPool::reset_prefix_cache() {
  if (num_free_ != num_blocks_) return false;
  for (Partition& p : parts_) {
    for (auto& [hash, id] : p.cached) blocks_[id].has_hash = false;
    p.cached.clear();
  }
  if (events_enabled_) {
    for (int p = 0; p < num_partitions(); ++p) {
      KvCacheEvent cleared;
      cleared.kind = KvCacheEvent::Kind::kAllCleared;
      cleared.partition = p;
      events_.push_back(std::move(cleared));
    }
  }
  return true;
}

void BlockPool::record_event(KvCacheEvent event) {
  if (events_enabled_) events_.push_back(std::move(event));
}

std::vector<std::pair<int32_t, BlockHash>> BlockPool::take_evictions() {
  std::vector<std::pair<int32_t, BlockHash>> out;
  out.swap(evictions_);
  return out;
}

std::vector<KvCacheEvent> BlockPool::take_events() {
  std::vector<KvCacheEvent> out;
  out.swap(events_);
  return out;
}

int BlockPool::ref_count(int32_t block_id) const {
  check_id(block_id);
  return blocks_[block_id].ref_cnt;
}

std::optional<BlockHash> BlockPool::block_hash(int32_t block_id) const {
  check_id(block_id);
  const Block& b = blocks_[block_id];
  if (!b.has_hash) return std::nullopt;
  return b.hash;
}

std::vector<int32_t> BlockPool::free_queue(int partition) const {
  check_partition(partition);
  std::vector<int32_t> ids;
  ids.reserve(parts_[partition].num_free);
  for (int32_t id = parts_[partition].head; id != -1; id = blocks_[id].next) ids.push_back(id);
  return ids;
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> ids;
  ids.reserve(num_free_);
  for (int p = 0; p < num_partitions(); ++p) {
    std::vector<int32_t> part = free_queue(p);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

void BlockPool::check_consistency() const {
  std::vector<int> zero_ref(parts_.size(), 0);
  int num_hashed = 0;
  for (int32_t id = 0; id < num_blocks_; ++id) {
    const Block& b = blocks_[id];
    const int p = partition_of(id);
    M3_CHECK(b.ref_cnt >= 0, "block %d ref count %d", id, b.ref_cnt);
    M3_CHECK((b.ref_cnt == 0) == b.in_free_queue, "block %d: ref %d, in free queue %d", id,
             b.ref_cnt, static_cast<int>(b.in_free_queue));
    if (b.ref_cnt == 0) ++zero_ref[p];
    if (b.has_hash) {
      ++num_hashed;
      const auto& cached = parts_[p].cached;
      auto it = cached.find(b.hash);
      M3_CHECK(it != cached.end() && it->second == id,
               "block %d hash not in the cache map of its partition %d", id, p);
    }
  }
  M3_CHECK(num_hashed == num_cached_blocks(), "%d hashed blocks, %d map entries", num_hashed,
           num_cached_blocks());
  int total_free = 0;
  for (int p = 0; p < num_partitions(); ++p) {
    const Partition& part = parts_[p];
    M3_CHECK(zero_ref[p] == part.num_free, "partition %d: %d blocks at ref 0 but %d counted free",
             p, zero_ref[p], part.num_free);
    total_free += part.num_free;
    for (const auto& [hash, id] : part.cached)
      M3_CHECK(partition_of(id) == p, "partition %d maps a hash to block %d of partition %d", p, id,
               partition_of(id));
    int walked = 0;
    int32_t prev = -1;
    for (int32_t id = part.head; id != -1; id = blocks_[id].next) {
      M3_CHECK(blocks_[id].prev == prev, "free queue links broken at block %d", id);
      M3_CHECK(partition_of(id) == p, "block %d of partition %d in the free queue of %d", id,
               partition_of(id), p);
      M3_CHECK(++walked <= part.num_free, "free queue of partition %d longer than %d (cycle?)", p,
               part.num_free);
      prev = id;
    }
    M3_CHECK(prev == part.tail && walked == part.num_free,
             "partition %d free queue walk %d blocks, expected %d", p, walked, part.num_free);
  }
  M3_CHECK(total_free == num_free_, "partitions hold %d free blocks, total says %d", total_free,
           num_free_);
}

void BlockPool::check_id(int32_t id) const {
  M3_CHECK(id >= 0 && id < num_blocks_, "block id %d", id);
}

void BlockPool::check_partition(int partition) const {
  M3_CHECK(partition >= 0 && partition < num_partitions(), "partition %d of %d", partition,
           num_partitions());
}

void BlockPool::queue_remove(int32_t id) {
  Block& b = blocks_[id];
  M3_CHECK(b.in_free_queue, "block %d is not in the free queue", id);
  Partition& part = parts_[partition_of(id)];
  if (b.prev != -1)
    blocks_[b.prev].next = b.next;
  else
    part.head = b.next;
  if (b.next != -1)
    blocks_[b.next].prev = b.prev;
  else
    part.tail = b.prev;
  b.prev = b.next = -1;
  b.in_free_queue = false;
  --part.num_free;
  --num_free_;
}

void BlockPool::queue_push_back(int32_t id) {
  Block& b = blocks_[id];
  M3_CHECK(!b.in_free_queue, "block %d is already in the free queue", id);
  Partition& part = parts_[partition_of(id)];
  b.prev = part.tail;
  b.next = -1;
  if (part.tail != -1)
    blocks_[part.tail].next = id;
  else
    part.head = id;
  part.tail = id;
  b.in_free_queue = true;
  ++part.num_free;
  ++num_free_;
}

int32_t BlockPool::queue_pop_front(int partition) {
  const int32_t id = parts_[partition].head;
  M3_CHECK(id != -1, "free queue of partition %d is empty", partition);
  queue_remove(id);
  return id;
}

bool BlockPool::drop_hash(int32_t id) {
  Block& b = blocks_[id];
  if (!b.has_hash) return false;
  auto& cached = parts_[partition_of(id)].cached;
  auto it = cached.find(b.hash);
  if (it != cached.end() && it->second == id) cached.erase(it);
  b.has_hash = false;
  return true;
}

}  // namespace m3::sched
