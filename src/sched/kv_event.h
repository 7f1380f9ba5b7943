// KV cache events: what the prefix cache gained and lost, in the order it happened, in vLLM's
// terms (BlockStored / BlockRemoved / AllBlocksCleared, vllm/distributed/kv_events.py). Recorded
// by BlockPool (removals, clears) and KVCacheManager (stores, which need the request's tokens)
// only when events are enabled; the engine drains them once per step and publishes them
// (engine/kv_event_publisher.h). Invariant: a hash is reported stored before it is reported
// removed, and reported removed at most once per store, per partition and medium.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sched/block_hash.h"

namespace m3::sched {

// Where the pages are: the serving device's pool ("GPU" in vLLM's events, whatever the device)
// or the host-memory tier behind it ("CPU").
enum class KvMedium { kDevice, kHost };

// vLLM's medium string: "GPU" for the device pool, "CPU" for the host tier.
const char* kv_medium_name(KvMedium medium);

struct KvCacheEvent {
  enum class Kind { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  int partition = 0;  // attention data-parallel rank of the pages
  KvMedium medium = KvMedium::kDevice;
  // Stored: the chain hashes of consecutive full blocks, first to last. Removed: evicted hashes.
  std::vector<BlockHash> block_hashes;
  // Stored only: the hash of the block before the first one; none for a sequence's first block.
  std::optional<BlockHash> parent_block_hash;
  // Stored only: the blocks' tokens, block_hashes.size() * block_size of them. A host-tier store
  // carries no tokens, no parent and block_size 0 (vLLM's offloading events do the same).
  std::vector<int32_t> token_ids;
  int block_size = 0;
};

}  // namespace m3::sched
