#include "sched/host_block_pool.h"

#include "core/check.h"

namespace m3::sched {

HostBlockPool::HostBlockPool(int num_slots) : slots_(num_slots) {
  M3_CHECK(num_slots > 0, "HostBlockPool(%d slots)", num_slots);
  for (int32_t s = num_slots - 1; s >= 0; --s) free_.push_back(s);  // slot 0 first
}

std::optional<int32_t> HostBlockPool::find(BlockHash hash) const {
  auto it = map_.find(hash);
  if (it == map_.end()) return std::nullopt;
  return it->second;
}

void HostBlockPool::use(int32_t slot) {
  M3_CHECK(slot >= 0 && slot < num_slots() && slots_[slot].used, "host slot %d", slot);
  unlink(slot);
  push_back(slot);
  if (!slots_[slot].pinned) {
    slots_[slot].pinned = true;
    pinned_.push_back(slot);
  }
}

std::optional<int32_t> HostBlockPool::store(BlockHash hash, std::optional<BlockHash>* evicted) {
  M3_CHECK(!map_.count(hash), "hash already in the host tier");
  if (evicted) evicted->reset();
  int32_t s = -1;
  if (!free_.empty()) {
    s = free_.back();
    free_.pop_back();
  } else {
    for (int32_t c = head_; c != -1; c = slots_[c].next) {
      if (!slots_[c].pinned) {
        s = c;
        break;
      }
    }
    if (s < 0) return std::nullopt;
    unlink(s);
    map_.erase(slots_[s].hash);
    if (evicted) *evicted = slots_[s].hash;
  }
  Slot& slot = slots_[s];
  slot.used = true;
  slot.hash = hash;
  map_.emplace(hash, s);
  push_back(s);
  return s;
}

void HostBlockPool::end_step() {
  for (int32_t s : pinned_) slots_[s].pinned = false;
  pinned_.clear();
}

void HostBlockPool::clear() {
  for (int32_t s = 0; s < num_slots(); ++s) {
    if (slots_[s].used) unlink(s);
    slots_[s] = Slot{};
  }
  map_.clear();
  pinned_.clear();
  free_.clear();
  for (int32_t s = num_slots() - 1; s >= 0; --s) free_.push_back(s);
  head_ = tail_ = -1;
}

void HostBlockPool::unlink(int32_t s) {
  Slot& x = slots_[s];
  if (x.prev != -1)
    slots_[x.prev].next = x.next;
  else if (head_ == s)
    head_ = x.next;
  if (x.next != -1)
    slots_[x.next].prev = x.prev;
  else if (tail_ == s)
    tail_ = x.prev;
  x.prev = x.next = -1;
}

void HostBlockPool::push_back(int32_t s) {
  Slot& x = slots_[s];
  x.prev = tail_;
  x.next = -1;
  if (tail_ != -1)
    slots_[tail_].next = s;
  else
    head_ = s;
  tail_ = s;
}

}  // namespace m3::sched
