#include "runtime/kv_budget.h"

#include <cstdio>

#include "core/check.h"

namespace m3::runtime {

Status check_max_model_len_fits(int64_t max_model_len, const KvPoolFacts& pool) {
  M3_CHECK(pool.page_size > 0 && pool.num_pages >= 0 && pool.num_partitions >= 1);
  if (max_model_len <= 0) return {};
  const int64_t need = (max_model_len + pool.page_size - 1) / pool.page_size;
  const int64_t pages = pool.num_pages / pool.num_partitions;  // one sequence's reach
  if (need <= pages) return {};
  const int64_t tokens = pages * pool.page_size;
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f MiB", static_cast<double>(pool.page_bytes) / (1 << 20));
  std::string msg = "--max-model-len " + std::to_string(max_model_len) + " needs " +
                    std::to_string(need) + " KV pages of " + std::to_string(pool.page_size) +
                    " tokens (" + mib + " each) for one sequence, but the KV cache on " +
                    pool.where + " has " + std::to_string(pages) +
                    " pages = " + std::to_string(tokens) + " tokens";
  if (pool.num_partitions > 1) {
    msg += " in each of its " + std::to_string(pool.num_partitions) +
           " data-parallel partitions (a sequence cannot span partitions)";
  }
  if (!pool.sized_by.empty()) msg += " (" + pool.sized_by + ")";
  msg += "; lower --max-model-len to at most " + std::to_string(tokens) + ", or raise " + pool.flag;
  if (pool.flag == "--gpu-memory-utilization") msg += " or free GPU memory";
  return make_error(ErrorCode::kInvalidArgument, msg, "--max-model-len");
}

Status check_gpu_memory_utilization(double util) {
  if (util > 0.0 && util <= 1.0) return {};
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "--gpu-memory-utilization %g is outside (0, 1]; it is the fraction of the GPU "
                "memory free after the weights that the KV cache may take, e.g. 0.9",
                util);
  return make_error(ErrorCode::kInvalidArgument, buf, "--gpu-memory-utilization");
}

}  // namespace m3::runtime
