// KVCacheManager: which KV pages each request holds, prefix-cache lookups and registration.
// Called by Scheduler each step (lookup + allocate when admitting, allocate for running requests,
// cache after the runner computed tokens, free on finish / abort / preemption).
// Invariants: a request's block list covers exactly ceil(tokens allocated / block_size) pages in
// position order, all in ONE partition of the pool (attention data parallel: one rank's memory);
// its first num_cached_blocks pages are registered in the prefix cache and were computed; a prefix
// hit is full blocks only, inside one partition, and never covers the last token of the request.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "sched/block_pool.h"
#include "sched/host_block_pool.h"
#include "sched/request.h"
#include "sched/scheduler_output.h"

namespace m3::sched {

// A prefix-cache hit: pages to share, in position order, and the tokens they cover.
struct ComputedBlocks {
  std::vector<int32_t> block_ids;
  int num_computed_tokens = 0;  // device and host hits together
  int partition = -1;           // partition of block_ids; -1 when there is no hit
  // The host tier's slots of the blocks right after block_ids (restored into fresh pages).
  std::vector<int32_t> host_slots;
};

class KVCacheManager {
 public:
  // num_blocks % num_partitions == 0 (M3_CHECK).
  KVCacheManager(int num_blocks, int block_size, bool enable_prefix_caching,
                 int num_partitions = 1);

  // Longest cached prefix of the request's tokens in full blocks, capped so that at least the last
  // token is recomputed (the model must run it to produce logits). Takes no reference; pass the
  // result to allocate_slots in the same step. Grows request.block_hashes. Each partition has its
  // own cache; partition -1 picks the longest hit over all of them (ties: the partition with more
  // free pages, then the lowest index), partition p looks only in p.
  ComputedBlocks get_computed_blocks(Request& request, int partition = -1);

  // Makes room for num_new_tokens more tokens after request.num_computed_tokens (+ the hit, for a
  // request being admitted). All or nothing: returns false and changes nothing when pages run out.
  // Counts the hit in the prefix-cache counters when `computed` is given and allocation succeeds.
  // The partition: the one of the pages the request holds; else the hit's; else
  // most_free_partition(). Only that partition's free pages count.
  // num_new_tokens may include the request's draft tokens (spec_token_ids); num_lookahead_tokens
  // more positions get pages too (where a draft model writes its KV past the step's tokens).
  bool allocate_slots(Request& request, int num_new_tokens,
                      const ComputedBlocks* computed = nullptr, int num_lookahead_tokens = 0);

  int num_partitions() const { return pool_.num_partitions(); }
  // The partition of the request's pages; -1 when it holds none.
  int partition_of(const Request& request) const;
  // The partition with the most free pages (ties: the lowest index); where new requests go.
  int most_free_partition() const;

  // Registers the request's full blocks of computed tokens (prompt and generated) in the prefix
  // cache. Called after the runner computed them: num_computed_tokens is the request's new total.
  void cache_blocks(Request& request, int num_computed_tokens);

  // Returns the request's pages to the pool, last page first, so the tail is evicted first.
  void free(const Request& request);
  // The same by id: pages kept after their request object is gone (held for a decode worker).
  void free(uint64_t request_id);

  // The request's block table (empty when it holds none).
  const std::vector<int32_t>& block_ids(uint64_t request_id) const;

  // Total references held by requests (== sum of ref counts over the pool).
  int64_t num_held_references() const;
  int num_requests_holding_blocks() const { return static_cast<int>(req_blocks_.size()); }

  const BlockPool& block_pool() const { return pool_; }
  BlockPool& block_pool() { return pool_; }
  int block_size() const { return pool_.block_size(); }
  double usage() const { return pool_.usage(); }

  // Prefix-cache counters (tokens): queried at admission, and hit. Only counted when caching is on.
  int64_t prefix_cache_queries() const { return prefix_cache_queries_; }
  int64_t prefix_cache_hits() const { return prefix_cache_hits_; }

  // The host KV tier (sched/host_block_pool.h): evicted hashed pages are copied to it and prefix
  // hits continue into it. One partition only (M3_CHECK). Off unless enabled.
  void enable_host_tier(int num_slots);
  bool host_tier_enabled() const { return host_ != nullptr; }
  const HostBlockPool* host_tier() const { return host_.get(); }
  // The copies this step needs, in SchedulerOutput's order; also ends the step's host pins.
  void take_copies(std::vector<KvPageCopy>* offloads, std::vector<KvPageCopy>* restores);
  int64_t num_offloaded_pages() const { return num_offloaded_; }
  int64_t num_restored_pages() const { return num_restored_; }
  // Drops the device cache's hashes (BlockPool::reset_prefix_cache) and the host tier's.
  bool reset_prefix_cache();

 private:
  void update_block_hashes(Request& request, int num_full_blocks) const;
  // After get_new_blocks: copies the evicted hashed pages to the host tier.
  void offload_evicted();
  // Records a BlockStored of consecutive blocks [first, last) of the request (device medium).
  void record_stored(const Request& request, int first, int last, int partition);

  BlockPool pool_;
  std::unordered_map<uint64_t, std::vector<int32_t>> req_blocks_;
  std::unordered_map<uint64_t, int> num_cached_blocks_;
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
  std::unique_ptr<HostBlockPool> host_;
  std::vector<KvPageCopy> offloads_;
  std::vector<KvPageCopy> restores_;
  int64_t num_offloaded_ = 0;
  int64_t num_restored_ = 0;
};

}  // namespace m3::sched
