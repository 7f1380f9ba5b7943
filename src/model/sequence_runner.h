// SequenceRunner: drives M3Model for a handful of sequences without a scheduler, giving each
// sequence pages from a simple bump allocator. Used by `m3serve generate` and the model tests
// (chunked prefill, prefill + decode, mixed batches). The server uses sched/ instead.
// SequencePages is the device-independent half (page assignment and the step's ForwardBatch),
// shared with the GPU runner (model/cuda/sequence_runner_cuda.h) so both build the same batch.
// Invariant: a sequence's tokens [0, length) are in the cache once a step containing them ran.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/kv_cache.h"
#include "model/m3_model.h"

namespace m3::model {

struct SequenceChunk {
  int seq;
  std::span<const int32_t> tokens;  // appended at positions [length(seq), ...)
  bool all_logits = false;          // logits for every token of the chunk, else the last only
};

// Sequences, their pages (bump-allocated from [0, num_pages)) and lengths.
class SequencePages {
 public:
  // Pages for `max_total_tokens` tokens over up to `max_seqs` sequences (each rounds up).
  static int64_t pages_needed(int64_t max_total_tokens, int64_t max_seqs, int64_t page_size);
  SequencePages(int64_t num_pages, int64_t page_size) : num_pages_(num_pages), page_size_(page_size) {}

  int add_sequence();
  int64_t length(int seq) const { return seqs_[seq].length; }
  // The ForwardBatch of one step over `chunks` (pages assigned, lengths advanced); logits rows
  // come out in chunk order. Running out of pages is a bug (M3_CHECK): size for the work.
  ForwardBatch build_step(const std::vector<SequenceChunk>& chunks);

 private:
  struct Seq {
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  int64_t num_pages_;
  int64_t page_size_;
  int64_t next_page_ = 0;
  std::vector<Seq> seqs_;
};

class SequenceRunner {
 public:
  using Chunk = SequenceChunk;

  // Room for `max_total_tokens` tokens over all sequences (rounded up to pages per sequence).
  SequenceRunner(const M3Model& model, int64_t max_total_tokens, int64_t max_seqs = 64);

  int add_sequence() { return pages_.add_sequence(); }
  int64_t length(int seq) const { return pages_.length(seq); }

  // Runs one step over the chunks; returns the logits rows in chunk order
  // ([sum over chunks of rows, vocab]).
  ForwardResult step(const std::vector<Chunk>& chunks, bool capture_msa = false);

 private:
  const M3Model& model_;
  KvCache cache_;
  SequencePages pages_;
};

}  // namespace m3::model
