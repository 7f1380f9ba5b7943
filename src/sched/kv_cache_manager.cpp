#include "sched/kv_cache_manager.h"

#include <algorithm>

#include "core/check.h"

namespace m3::sched {

namespace {
const std::vector<int32_t> kNoBlocks;

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}
}  // namespace

KVCacheManager::KVCacheManager(int num_blocks, int block_size, bool enable_prefix_caching,
                               int num_partitions)
    : pool_(num_blocks, block_size, enable_prefix_caching, num_partitions) {}

int KVCacheManager::partition_of(const Request& request) const {
  auto it = req_blocks_.find(request.request_id);
  if (it == req_blocks_.end() || it->second.empty()) return -1;
  return pool_.partition_of(it->second.front());
}

int KVCacheManager::most_free_partition() const {
  int best = 0;
  for (int p = 1; p < pool_.num_partitions(); ++p)
    if (pool_.num_free_blocks(p) > pool_.num_free_blocks(best)) best = p;
  return best;
}

void KVCacheManager::update_block_hashes(Request& request, int num_full_blocks) const {
  const int bs = pool_.block_size();
  M3_CHECK(num_full_blocks * bs <= request.num_tokens(), "%d full blocks of %d tokens",
           num_full_blocks, request.num_tokens());
  std::vector<int32_t> tokens(bs);
  for (int b = static_cast<int>(request.block_hashes.size()); b < num_full_blocks; ++b) {
    for (int i = 0; i < bs; ++i) tokens[i] = request.token_at(b * bs + i);
    const BlockHash parent = b == 0 ? kRootBlockHash : request.block_hashes[b - 1];
    // Content spans (images) overlapping this block key it by their content hash too.
    uint64_t extra = request.cache_salt;
    for (const ContentSpan& sp : request.content_spans) {
      if (sp.start < (b + 1) * bs && sp.start + sp.length > b * bs)
        extra = (extra ^ sp.hash) * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
    }
    request.block_hashes.push_back(hash_block(parent, extra, tokens));
  }
}

ComputedBlocks KVCacheManager::get_computed_blocks(Request& request, int partition) {
  M3_CHECK(partition >= -1 && partition < pool_.num_partitions(), "partition %d of %d", partition,
           pool_.num_partitions());
  ComputedBlocks hit;
  if (!pool_.prefix_caching_enabled() || request.num_tokens() == 0) return hit;
  // (num_tokens - 1) / bs full blocks at most: the last token always stays to be computed.
  const int max_hit_blocks = (request.num_tokens() - 1) / pool_.block_size();
  update_block_hashes(request, max_hit_blocks);
  const int first = partition < 0 ? 0 : partition;
  const int last = partition < 0 ? pool_.num_partitions() - 1 : partition;
  std::vector<int32_t> ids;
  for (int p = first; p <= last; ++p) {
    ids.clear();
    for (int b = 0; b < max_hit_blocks; ++b) {
      auto id = pool_.get_cached_block(request.block_hashes[b], p);
      if (!id) break;  // the chain hash makes every later block a miss too
      ids.push_back(*id);
    }
    if (ids.empty()) continue;
    const bool longer = ids.size() > hit.block_ids.size();
    const bool tie_more_free = ids.size() == hit.block_ids.size() &&
                               pool_.num_free_blocks(p) > pool_.num_free_blocks(hit.partition);
    if (longer || tie_more_free) {
      hit.block_ids = ids;
      hit.partition = p;
    }
  }
  if (host_) {
    // One partition (enable_host_tier): the chain continues from the device hit into the host.
    hit.partition = 0;
    // It stops at a block the device holds after all (a later block than the device chain's
    // miss), so every restored hash is new to the device map and registers.
    for (int b = static_cast<int>(hit.block_ids.size()); b < max_hit_blocks; ++b) {
      if (pool_.get_cached_block(request.block_hashes[b], 0)) break;
      auto slot = host_->find(request.block_hashes[b]);
      if (!slot) break;
      hit.host_slots.push_back(*slot);
    }
    if (hit.block_ids.empty() && hit.host_slots.empty()) hit.partition = -1;
  }
  hit.num_computed_tokens =
      static_cast<int>(hit.block_ids.size() + hit.host_slots.size()) * pool_.block_size();
  return hit;
}

bool KVCacheManager::allocate_slots(Request& request, int num_new_tokens,
                                    const ComputedBlocks* computed, int num_lookahead_tokens) {
  M3_CHECK(num_new_tokens >= 0, "num_new_tokens %d", num_new_tokens);
  const int bs = pool_.block_size();
  auto it = req_blocks_.find(request.request_id);
  const int num_held = it == req_blocks_.end() ? 0 : static_cast<int>(it->second.size());
  const int num_hit_blocks = computed ? static_cast<int>(computed->block_ids.size()) : 0;
  const int num_host_blocks = computed ? static_cast<int>(computed->host_slots.size()) : 0;
  const int num_hit_tokens = computed ? computed->num_computed_tokens : 0;
  M3_CHECK(num_hit_blocks + num_host_blocks == 0 || num_held == 0,
           "request %llu: prefix hit while holding pages",
           static_cast<unsigned long long>(request.request_id));
  // Tokens of a step in flight count as computed, its sample as known (async scheduling).
  const int total_tokens =
      request.num_computed_tokens + request.num_inflight_tokens + num_hit_tokens + num_new_tokens;
  const int num_known = request.num_tokens() + request.num_inflight_samples +
                        static_cast<int>(request.spec_token_ids.size());
  M3_CHECK(total_tokens <= num_known && num_lookahead_tokens >= 0,
           "request %llu: %d slots (+%d lookahead) for %d tokens",
           static_cast<unsigned long long>(request.request_id), total_tokens, num_lookahead_tokens,
           num_known);
  const int num_new_blocks =
      std::max(0, ceil_div(total_tokens + num_lookahead_tokens, bs) - num_held - num_hit_blocks);

  // Every page of a request lives in one partition (one data-parallel rank's memory).
  int partition = 0;
  if (num_held > 0) {
    partition = pool_.partition_of(it->second.front());
  } else if (num_hit_blocks + num_host_blocks > 0) {
    partition = computed->partition;
  } else {
    partition = most_free_partition();
  }
  // Hit pages at ref count 0 sit in the free queue; touching them takes them out of it, so they
  // cannot also serve as new pages.
  int num_hit_free = 0;
  for (int i = 0; i < num_hit_blocks; ++i) {
    const int32_t id = computed->block_ids[i];
    M3_CHECK(pool_.partition_of(id) == partition,
             "request %llu: hit page %d is not in the hit's partition %d",
             static_cast<unsigned long long>(request.request_id), id, partition);
    num_hit_free += pool_.ref_count(id) == 0;
  }
  if (num_new_blocks > pool_.num_free_blocks(partition) - num_hit_free) return false;

  if (num_new_blocks == 0 && num_hit_blocks == 0 && it != req_blocks_.end()) return true;
  std::vector<int32_t>& blocks =
      it == req_blocks_.end() ? req_blocks_[request.request_id] : it->second;
  if (num_hit_blocks > 0) {
    pool_.touch(computed->block_ids);
    blocks.insert(blocks.end(), computed->block_ids.begin(), computed->block_ids.end());
    // Hit pages already carry their hashes.
    num_cached_blocks_[request.request_id] = num_hit_blocks;
  }
  // Host hits are pinned before any page is taken, so this step's offloads cannot reuse the
  // slots its restores read.
  for (int i = 0; i < num_host_blocks; ++i) host_->use(computed->host_slots[i]);
  std::vector<int32_t> fresh = pool_.get_new_blocks(num_new_blocks, partition);
  if (host_) offload_evicted();
  blocks.insert(blocks.end(), fresh.begin(), fresh.end());
  if (num_host_blocks > 0) {
    // The first fresh pages take the host blocks: restored before the forward, then cached on
    // the device under their hashes like any computed block.
    M3_CHECK(static_cast<int>(fresh.size()) >= num_host_blocks,
             "%zu fresh pages for %d host blocks", fresh.size(), num_host_blocks);
    for (int i = 0; i < num_host_blocks; ++i) {
      restores_.push_back({fresh[i], computed->host_slots[i]});
      ++num_restored_;
      const bool registered = pool_.cache_block(fresh[i], request.block_hashes[num_hit_blocks + i]);
      M3_CHECK(registered, "restored block %d of request %llu was already cached",
               num_hit_blocks + i, static_cast<unsigned long long>(request.request_id));
    }
    record_stored(request, num_hit_blocks, num_hit_blocks + num_host_blocks, partition);
    num_cached_blocks_[request.request_id] = num_hit_blocks + num_host_blocks;
  }
  if (computed && pool_.prefix_caching_enabled()) {
    prefix_cache_queries_ += request.num_tokens();
    prefix_cache_hits_ += num_hit_tokens;
  }
  return true;
}

void KVCacheManager::cache_blocks(Request& request, int num_computed_tokens) {
  if (!pool_.prefix_caching_enabled()) return;
  auto it = req_blocks_.find(request.request_id);
  if (it == req_blocks_.end()) return;
  const int num_full = num_computed_tokens / pool_.block_size();
  int& num_cached = num_cached_blocks_[request.request_id];
  if (num_full <= num_cached) return;
  M3_CHECK(num_full <= static_cast<int>(it->second.size()),
           "request %llu: %d full blocks, %zu pages",
           static_cast<unsigned long long>(request.request_id), num_full, it->second.size());
  update_block_hashes(request, num_full);
  // With events on, each run of consecutive newly registered blocks is one BlockStored (a block
  // another request registered first stays unhashed here and is not reported again).
  const bool events = pool_.events_enabled();
  const int bs = pool_.block_size();
  KvCacheEvent stored;
  auto flush = [&] {
    if (stored.block_hashes.empty()) return;
    pool_.record_event(std::move(stored));
    stored = KvCacheEvent{};
  };
  for (int b = num_cached; b < num_full; ++b) {
    const int32_t block = it->second[b];
    const bool registered = pool_.cache_block(block, request.block_hashes[b]);
    if (!events) continue;
    if (!registered) {
      flush();
      continue;
    }
    if (stored.block_hashes.empty()) {
      stored.kind = KvCacheEvent::Kind::kStored;
      stored.block_size = bs;
      stored.partition = pool_.partition_of(block);
      if (b > 0) stored.parent_block_hash = request.block_hashes[b - 1];
    }
    stored.block_hashes.push_back(request.block_hashes[b]);
    for (int i = 0; i < bs; ++i) stored.token_ids.push_back(request.token_at(b * bs + i));
  }
  flush();
  num_cached = num_full;
}

void KVCacheManager::record_stored(const Request& request, int first, int last, int partition) {
  if (!pool_.events_enabled() || first >= last) return;
  const int bs = pool_.block_size();
  KvCacheEvent stored;
  stored.kind = KvCacheEvent::Kind::kStored;
  stored.block_size = bs;
  stored.partition = partition;
  if (first > 0) stored.parent_block_hash = request.block_hashes[first - 1];
  for (int b = first; b < last; ++b) {
    stored.block_hashes.push_back(request.block_hashes[b]);
    for (int i = 0; i < bs; ++i) stored.token_ids.push_back(request.token_at(b * bs + i));
  }
  pool_.record_event(std::move(stored));
}

void KVCacheManager::enable_host_tier(int num_slots) {
  M3_CHECK(pool_.num_partitions() == 1, "the host KV tier needs one KV partition, not %d",
           pool_.num_partitions());
  M3_CHECK(pool_.prefix_caching_enabled(), "the host KV tier needs prefix caching");
  host_ = std::make_unique<HostBlockPool>(num_slots);
  pool_.set_track_evictions(true);
}

void KVCacheManager::offload_evicted() {
  for (const auto& [page, hash] : pool_.take_evictions()) {
    if (auto slot = host_->find(hash)) {
      host_->use(*slot);  // already there (restored earlier): no copy
      continue;
    }
    std::optional<BlockHash> dropped;
    auto slot = host_->store(hash, &dropped);
    if (!slot) continue;  // every slot is a restore source this step: the page is lost
    offloads_.push_back({page, *slot});
    ++num_offloaded_;
    if (pool_.events_enabled()) {
      if (dropped) {
        KvCacheEvent removed;
        removed.kind = KvCacheEvent::Kind::kRemoved;
        removed.medium = KvMedium::kHost;
        removed.block_hashes = {*dropped};
        pool_.record_event(std::move(removed));
      }
      KvCacheEvent stored;
      stored.kind = KvCacheEvent::Kind::kStored;
      stored.medium = KvMedium::kHost;
      stored.block_hashes = {hash};
      pool_.record_event(std::move(stored));
    }
  }
}

void KVCacheManager::take_copies(std::vector<KvPageCopy>* offloads,
                                 std::vector<KvPageCopy>* restores) {
  offloads->swap(offloads_);
  restores->swap(restores_);
  offloads_.clear();
  restores_.clear();
  if (host_) host_->end_step();
}

bool KVCacheManager::reset_prefix_cache() {
  if (!pool_.reset_prefix_cache()) return false;
  if (host_) host_->clear();
  return true;
}

void KVCacheManager::free(const Request& request) {
  free(request.request_id);
}

void KVCacheManager::free(uint64_t request_id) {
  auto it = req_blocks_.find(request_id);
  if (it == req_blocks_.end()) return;
  std::vector<int32_t> reversed(it->second.rbegin(), it->second.rend());
  pool_.free_blocks(reversed);
  req_blocks_.erase(it);
  num_cached_blocks_.erase(request_id);
}

const std::vector<int32_t>& KVCacheManager::block_ids(uint64_t request_id) const {
  auto it = req_blocks_.find(request_id);
  return it == req_blocks_.end() ? kNoBlocks : it->second;
}

int64_t KVCacheManager::num_held_references() const {
  int64_t n = 0;
  for (const auto& [id, blocks] : req_blocks_) n += static_cast<int64_t>(blocks.size());
  return n;
}

}  // namespace m3::sched
