// Helpers shared by the sched tests: a deterministic fake model runner and a page-accounting
// check. The fake runner's token depends only on (request id, position), so a request recomputed
// after preemption must produce exactly the tokens it would have produced without it.
#pragma once

#include <cstdint>
#include <memory>
#include <numeric>
#include <unordered_map>
#include <vector>

#include <gtest/gtest.h>

#include "sched/scheduler.h"

namespace m3::sched::testing {

// Token the fake model samples for request `id` at sequence position `pos` (the index the new token
// gets). Never below 1000, so tests can use small ids as eos / stop tokens.
inline int32_t fake_token(uint64_t id, int pos) {
  return 1000 +
         static_cast<int32_t>((id * 1000003ULL + static_cast<uint64_t>(pos) * 7919ULL) % 50000ULL);
}

inline RunnerOutput fake_run(const SchedulerOutput& out) {
  RunnerOutput r;
  for (const ScheduledRequest& s : out.requests) {
    if (!s.will_sample) continue;
    r.sampled.push_back(
        {s.request_id, {fake_token(s.request_id, s.start_idx + s.num_new_tokens())}});
  }
  return r;
}

inline std::vector<int32_t> iota_tokens(int n, int32_t start = 1000) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

inline std::unique_ptr<Request> make_request(uint64_t id, std::vector<int32_t> prompt,
                                             int max_tokens, int priority = 0) {
  StopCriteria stop;
  stop.max_tokens = max_tokens;
  return std::make_unique<Request>(id, std::move(prompt), stop, priority);
}

// Full recount: the pool's own invariants, every reference held by exactly the running requests,
// each running request holding ceil(num_computed / block_size) pages, nobody else holding any.
inline void expect_pages_balance(const Scheduler& sched) {
  const KVCacheManager& kv = sched.kv_cache_manager();
  const BlockPool& pool = kv.block_pool();
  pool.check_consistency();
  std::vector<int> refs(pool.num_blocks(), 0);
  for (uint64_t id : sched.running_ids()) {
    const Request* r = sched.find_request(id);
    ASSERT_NE(r, nullptr);
    const auto& blocks = kv.block_ids(id);
    const int bs = pool.block_size();
    EXPECT_EQ(static_cast<int>(blocks.size()), (r->num_computed_tokens + bs - 1) / bs)
        << "request " << id;
    for (int32_t b : blocks) ++refs[b];
  }
  for (uint64_t id : sched.waiting_ids())
    EXPECT_TRUE(kv.block_ids(id).empty()) << "waiting request " << id;
  int in_use = 0;
  for (int b = 0; b < pool.num_blocks(); ++b) {
    EXPECT_EQ(refs[b], pool.ref_count(b)) << "block " << b;
    in_use += refs[b] > 0;
  }
  EXPECT_EQ(in_use + pool.num_free_blocks(), pool.num_blocks());
  EXPECT_LE(kv.num_requests_holding_blocks(), sched.num_running());
}

}  // namespace m3::sched::testing
