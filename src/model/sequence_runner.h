// SequenceRunner: drives M3Model for a handful of sequences without a scheduler, giving each
// sequence pages from a simple bump allocator. Used by `m3serve generate` and the model tests
// (chunked prefill, prefill + decode, mixed batches). The server uses sched/ instead.
// Invariant: a sequence's tokens [0, length) are in the cache once a step containing them ran.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/kv_cache.h"
#include "model/m3_model.h"

namespace m3::model {

class SequenceRunner {
 public:
  // Room for `max_total_tokens` tokens over all sequences (rounded up to pages per sequence).
  SequenceRunner(const M3Model& model, int64_t max_total_tokens, int64_t max_seqs = 64);

  int add_sequence();
  int64_t length(int seq) const { return seqs_[seq].length; }

  struct Chunk {
    int seq;
    std::span<const int32_t> tokens;  // appended at positions [length(seq), ...)
    bool all_logits = false;          // logits for every token of the chunk, else the last only
  };
  // Runs one step over the chunks; returns the logits rows in chunk order
  // ([sum over chunks of rows, vocab]). Running out of pages is a bug (M3_CHECK): size the
  // runner for the work.
  ForwardResult step(const std::vector<Chunk>& chunks, bool capture_msa = false);

 private:
  struct Seq {
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  const M3Model& model_;
  KvCache cache_;
  int64_t next_page_ = 0;
  std::vector<Seq> seqs_;
};

}  // namespace m3::model
