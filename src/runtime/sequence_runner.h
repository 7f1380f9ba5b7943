// SequenceRunner: drives any ForwardBackend (CPU, GPU, sharded) for a handful of sequences
// without a scheduler, giving each sequence pages from a simple bump allocator (SequencePages).
// Used by `m3serve generate`, the model tests and the benchmarks; the server uses sched/ instead.
// Invariant: a sequence's tokens [0, length) are in the cache once a step containing them ran;
// the batch of a step depends only on the chunks (not on the backend), so every backend is
// driven with exactly the same ForwardBatch.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/m3_model.h"
#include "runtime/forward_backend.h"

namespace m3::runtime {

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
  SequencePages(int64_t num_pages, int64_t page_size)
      : num_pages_(num_pages), page_size_(page_size) {}
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
  // Over a backend it owns, or one the caller keeps alive; pages: all of the backend's.
  explicit SequenceRunner(std::unique_ptr<ForwardBackend> backend);
  explicit SequenceRunner(ForwardBackend& backend);
  // Over a CPU model the caller keeps alive (a borrowed CPU backend, runtime/forward_backend.h),
  // with room for `max_total_tokens` tokens over `max_seqs` sequences.
  SequenceRunner(const model::M3Model& model, int64_t max_total_tokens, int64_t max_seqs = 64);

  ForwardBackend& backend() { return *backend_; }
  int add_sequence() { return pages_.add_sequence(); }
  int64_t length(int seq) const { return pages_.length(seq); }
  // Runs one step over the chunks; returns the logits rows in chunk order
  // ([sum over chunks of rows, vocab]).
  ForwardResult step(const std::vector<Chunk>& chunks, bool capture_msa = false);

 private:
  std::unique_ptr<ForwardBackend> owned_;
  ForwardBackend* backend_;
  SequencePages pages_;
};

}  // namespace m3::runtime
