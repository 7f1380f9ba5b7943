// SequenceRunnerCuda: SequenceRunner for the GPU model. Drives M3ModelCuda for a handful of
// sequences without a scheduler, giving each sequence pages of a device KV cache from a bump
// allocator. Used by `m3serve generate --device cuda` and tests/model_cuda.
// Invariant: a sequence's tokens [0, length) are in the cache once a step containing them ran;
// the batch it builds is exactly the one SequenceRunner builds for the same chunks.
#pragma once

#include <cstdint>
#include <vector>

#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/sequence_runner.h"

namespace m3::model {

class SequenceRunnerCuda {
 public:
  using Chunk = SequenceRunner::Chunk;

  // Room for `max_total_tokens` tokens over all sequences (rounded up to pages per sequence).
  SequenceRunnerCuda(M3ModelCuda& model, int64_t max_total_tokens, int64_t max_seqs = 64);

  int add_sequence() { return pages_.add_sequence(); }
  int64_t length(int seq) const { return pages_.length(seq); }

  // As SequenceRunner::step: logits rows in chunk order. Running out of pages is a bug.
  ForwardResult step(const std::vector<Chunk>& chunks, bool capture_msa = false);

 private:
  M3ModelCuda& model_;
  KvCacheCuda cache_;
  SequencePages pages_;  // same page assignment and batch as the CPU runner
};

}  // namespace m3::model
