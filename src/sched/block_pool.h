// BlockPool: the paged KV memory as ids — num_blocks pages of block_size tokens (K, V and the
// index-K of every layer move together), ref counts, LRU free queues and the prefix-cache maps.
// The ids split into num_partitions equal partitions, partition p = [p*P, (p+1)*P) with
// P = num_blocks / num_partitions (attention data parallel: partition p lives on rank p), each with
// its own free queue and its own prefix-cache map; one partition is the plain single pool.
// Called only by KVCacheManager (and tests). Invariants: free + in-use == num_blocks (in total and
// per partition); a block is in its partition's free queue iff its ref count is 0; each free queue
// is in eviction order (head = evicted first, blocks freed last at the tail); a partition's map
// holds hash -> block only for blocks of that partition whose hash field equals the key, and a
// block keeps its hash while free until it is reused.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sched/block_hash.h"
#include "sched/kv_event.h"

namespace m3::sched {

class BlockPool {
 public:
  // num_blocks % num_partitions == 0 (M3_CHECK).
  BlockPool(int num_blocks, int block_size, bool enable_prefix_caching, int num_partitions = 1);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  bool prefix_caching_enabled() const { return enable_prefix_caching_; }
  int num_partitions() const { return static_cast<int>(parts_.size()); }
  int blocks_per_partition() const { return blocks_per_partition_; }
  // The partition a block id lives in: block / blocks_per_partition().
  int partition_of(int32_t block) const;
  int num_free_blocks() const { return num_free_; }  // all partitions
  int num_free_blocks(int partition) const;
  // Fraction of pages held by requests, 0..1 (free cached pages count as free).
  double usage() const;
  // Number of blocks registered in the prefix-cache maps (in use or free), all partitions.
  int num_cached_blocks() const;

  // The block of `partition` holding the prefix that ends with this hash, if cached (it may be
  // free). The one-argument form looks in every partition, lowest index first.
  std::optional<int32_t> get_cached_block(BlockHash hash, int partition) const;
  std::optional<int32_t> get_cached_block(BlockHash hash) const;

  // Pops n blocks from the head of the partition's free queue with ref count 1; a popped block
  // that still carries a cached hash loses it (eviction). The caller checks num_free_blocks(p)
  // first. The one-argument form is only valid with a single partition (M3_CHECK).
  std::vector<int32_t> get_new_blocks(int n, int partition);
  std::vector<int32_t> get_new_blocks(int n);

  // Takes one more reference on each block; a block at ref count 0 leaves the free queue (a
  // prefix-cache hit on a free page).
  void touch(std::span<const int32_t> block_ids);

  // Drops one reference on each block, in the given order; blocks reaching 0 join their
  // partition's free queue tail in that order, so the first one given is evicted first.
  void free_blocks(std::span<const int32_t> block_ids);

  // Registers a full, computed, in-use block under its chain hash in its partition's map. If
  // another block of that partition already holds this hash (two requests computed the same prefix
  // at once) the map keeps the first one and this block stays unhashed. Returns whether the block
  // was registered. No-op when caching is off.
  bool cache_block(int32_t block_id, BlockHash hash);

  // Drops every cached hash; only possible when no page is in use. Returns whether it was done.
  // Records one AllBlocksCleared event per partition when events are on.
  bool reset_prefix_cache();

  // KV cache events (sched/kv_event.h). Off by default. When on, evictions of hashed pages
  // (get_new_blocks) record one BlockRemoved per call and partition, and reset_prefix_cache an
  // AllBlocksCleared per partition; record_event adds the stores KVCacheManager builds.
  void set_events_enabled(bool on) { events_enabled_ = on; }
  bool events_enabled() const { return events_enabled_; }
  void record_event(KvCacheEvent event);
  // Hashed pages evicted by get_new_blocks since the last call, as (page id, hash), when tracking
  // is on (the host KV tier copies them out before the step writes the pages).
  void set_track_evictions(bool on) { track_evictions_ = on; }
  std::vector<std::pair<int32_t, BlockHash>> take_evictions();
  // The events recorded since the last call, oldest first.
  std::vector<KvCacheEvent> take_events();

  // Introspection for tests and metrics.
  int ref_count(int32_t block_id) const;
  std::optional<BlockHash> block_hash(int32_t block_id) const;
  // Block ids in free-queue order (head first): of one partition, or of all, partition 0 first.
  std::vector<int32_t> free_queue(int partition) const;
  std::vector<int32_t> free_queue() const;
  // Aborts (M3_CHECK) if any invariant in the header comment is broken. O(num_blocks).
  void check_consistency() const;

 private:
  struct Block {
    int32_t ref_cnt = 0;
    bool has_hash = false;
    BlockHash hash = 0;
    // Intrusive doubly linked free queue, so a cache hit removes a block from the middle in O(1).
    int32_t prev = -1;
    int32_t next = -1;
    bool in_free_queue = false;
  };
  struct Partition {
    int32_t head = -1;  // next block to evict / reuse
    int32_t tail = -1;
    int num_free = 0;
    std::unordered_map<BlockHash, int32_t> cached;
  };

  void check_id(int32_t id) const;
  void check_partition(int partition) const;
  void queue_remove(int32_t id);
  void queue_push_back(int32_t id);
  int32_t queue_pop_front(int partition);
  // Unregisters the block's hash; returns whether it had one (the hash field keeps the value).
  bool drop_hash(int32_t id);

  int num_blocks_;
  int block_size_;
  bool enable_prefix_caching_;
  int blocks_per_partition_;
  std::vector<Block> blocks_;
  std::vector<Partition> parts_;
  int num_free_ = 0;
  bool events_enabled_ = false;
  bool track_evictions_ = false;
  std::vector<std::pair<int32_t, BlockHash>> evictions_;
  std::vector<KvCacheEvent> events_;
};

}  // namespace m3::sched
