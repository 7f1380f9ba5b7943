// The start-up check that one sequence of --max-model-len tokens fits in the KV page pool, with
// the message users see (issue #5 "Bad input"). Called by the CUDA backend before it allocates
// the pool (runtime/cuda/cuda_backend.cpp); pure arithmetic so it is tested on the CPU.
// Invariant: returns ok exactly when max_model_len <= 0 (not given) or
// ceil(max_model_len / page_size) <= num_pages.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"

namespace m3::runtime {

struct KvPoolFacts {
  int64_t num_pages = 0;    // pages the pool will have
  int64_t page_size = 0;    // tokens per page (the MSA block, 128 for M3)
  int64_t page_bytes = 0;   // bytes of one page over all layers
  std::string where;        // e.g. "cuda:0 (NVIDIA H200)"
  std::string sized_by;     // how the pool was sized, e.g. "120.3 GiB free after the weights x 0.9"
  std::string flag;         // the flag that sizes the pool, e.g. "--gpu-memory-utilization"
};

// Errors (kInvalidArgument, naming --max-model-len): the pages one sequence needs, the pages and
// tokens the pool holds, the largest --max-model-len that fits, and the flags to change.
Status check_max_model_len_fits(int64_t max_model_len, const KvPoolFacts& pool);

}  // namespace m3::runtime
