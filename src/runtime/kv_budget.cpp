#include "runtime/kv_budget.h"

#include <cstdio>

#include "core/check.h"

namespace m3::runtime {

Status check_max_model_len_fits(int64_t max_model_len, const KvPoolFacts& pool) {
  M3_CHECK(pool.page_size > 0 && pool.num_pages >= 0);
  if (max_model_len <= 0) return {};
  const int64_t need = (max_model_len + pool.page_size - 1) / pool.page_size;
  if (need <= pool.num_pages) return {};
  const int64_t tokens = pool.num_pages * pool.page_size;
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f MiB", static_cast<double>(pool.page_bytes) / (1 << 20));
  std::string msg = "--max-model-len " + std::to_string(max_model_len) + " needs " +
                    std::to_string(need) + " KV pages of " + std::to_string(pool.page_size) +
                    " tokens (" + mib + " each) for one sequence, but the KV cache on " +
                    pool.where + " has " + std::to_string(pool.num_pages) + " pages = " +
                    std::to_string(tokens) + " tokens";
  if (!pool.sized_by.empty()) msg += " (" + pool.sized_by + ")";
  msg += "; lower --max-model-len to at most " + std::to_string(tokens) + ", or raise " +
         pool.flag + " or free GPU memory";
  return make_error(ErrorCode::kInvalidArgument, msg, "--max-model-len");
}

}  // namespace m3::runtime
