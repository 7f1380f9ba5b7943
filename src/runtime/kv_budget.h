// The start-up checks of the KV budget, each with the one message users see: one sequence of
// --max-model-len tokens fits in the KV page pool (the GPU backends before they allocate it, the
// engine for every backend), and --gpu-memory-utilization is a fraction in (0, 1] (app, the GPU
// backends). Pure arithmetic, tested on the CPU.
// Invariant: check_max_model_len_fits returns ok exactly when max_model_len <= 0 (not given) or
// ceil(max_model_len / page_size) <= num_pages / num_partitions.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"

namespace m3::runtime {

struct KvPoolFacts {
  int64_t num_pages = 0;   // pages the pool will have
  int64_t page_size = 0;   // tokens per page (the MSA block, 128 for M3)
  int64_t page_bytes = 0;  // bytes of one page over all layers
  std::string where;       // e.g. "cuda:0 (NVIDIA H200)"
  std::string sized_by;    // how the pool was sized, e.g. "120.3 GiB free after the weights x 0.9"
  std::string flag;        // the flag that sizes the pool, e.g. "--gpu-memory-utilization"
  int64_t num_partitions = 1;  // attention DP: a sequence's pages stay in one of these
};

// Errors (kInvalidArgument, naming --max-model-len): the pages one sequence needs, the pages and
// tokens the pool holds, the largest --max-model-len that fits, and the flags to change.
Status check_max_model_len_fits(int64_t max_model_len, const KvPoolFacts& pool);

// Errors (kInvalidArgument, naming --gpu-memory-utilization) unless 0 < util <= 1.
Status check_gpu_memory_utilization(double util);

}  // namespace m3::runtime
