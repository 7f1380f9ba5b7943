// HostBlockPool: the host-memory KV tier behind the device pool (`--kv-transfer-config` with an
// offloading connector, `--kv-offloading-size`): num_slots page-sized slots of host memory, each
// holding one evicted prefix-cache page (K, V and index-K of every layer) under its chain hash,
// kept in LRU order. Only ids and hashes live here; the backend holds the bytes and copies them
// when the scheduler's step says so (SchedulerOutput::kv_offloads / kv_restores). Called by
// KVCacheManager. Invariants: a hash maps to at most one slot; a slot pinned in the current step
// (a restore source) is never reassigned before end_step(), so one step's copies never overwrite
// what the same step reads.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "sched/block_hash.h"

namespace m3::sched {

class HostBlockPool {
 public:
  explicit HostBlockPool(int num_slots);

  int num_slots() const { return static_cast<int>(slots_.size()); }
  int num_cached() const { return static_cast<int>(map_.size()); }

  // The slot holding this hash, if any (no LRU change).
  std::optional<int32_t> find(BlockHash hash) const;
  // Marks the slot most recently used and pins it for this step.
  void use(int32_t slot);
  // A slot for a new hash: a free one, else the least recently used unpinned one, whose hash is
  // dropped (returned in *evicted). nullopt when every slot is pinned this step.
  std::optional<int32_t> store(BlockHash hash, std::optional<BlockHash>* evicted);
  // Unpins every slot (the step's copies are done).
  void end_step();
  // Drops every hash (the device pool's reset).
  void clear();

 private:
  struct Slot {
    bool used = false;
    bool pinned = false;
    BlockHash hash = 0;
    int32_t prev = -1;  // LRU list, head = least recently used
    int32_t next = -1;
  };
  void unlink(int32_t s);
  void push_back(int32_t s);

  std::vector<Slot> slots_;
  std::unordered_map<BlockHash, int32_t> map_;
  std::vector<int32_t> free_;
  std::vector<int32_t> pinned_;
  int32_t head_ = -1;
  int32_t tail_ = -1;
};

}  // namespace m3::sched
