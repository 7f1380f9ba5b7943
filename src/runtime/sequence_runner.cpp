#include "runtime/sequence_runner.h"

#include "core/check.h"

namespace m3::runtime {

int64_t SequencePages::pages_needed(int64_t max_total_tokens, int64_t max_seqs, int64_t page_size) {
  return (max_total_tokens + page_size - 1) / page_size + max_seqs;
}

int SequencePages::add_sequence() {
  seqs_.emplace_back();
  return static_cast<int>(seqs_.size()) - 1;
}

ForwardBatch SequencePages::build_step(const std::vector<SequenceChunk>& chunks) {
  ForwardBatch b;
  for (const SequenceChunk& c : chunks) {
    Seq& s = seqs_[c.seq];
    const int64_t tokens = s.length + static_cast<int64_t>(c.tokens.size());
    const int64_t need = (tokens + page_size_ - 1) / page_size_;
    while (static_cast<int64_t>(s.pages.size()) < need) {
      M3_CHECK(next_page_ < num_pages_, "SequencePages: out of KV pages");
      s.pages.push_back(static_cast<int32_t>(next_page_++));
    }
  }
  // Every sequence gets a CSR slot; seq_ids index it directly.
  b.block_table_offsets.push_back(0);
  for (const Seq& s : seqs_) {
    b.block_table.insert(b.block_table.end(), s.pages.begin(), s.pages.end());
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
  }
  for (const SequenceChunk& c : chunks) {
    Seq& s = seqs_[c.seq];
    const int64_t n = static_cast<int64_t>(c.tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      if (c.all_logits || i == n - 1)
        b.logits_indices.push_back(static_cast<int32_t>(b.token_ids.size()));
      b.token_ids.push_back(c.tokens[i]);
      b.positions.push_back(static_cast<int32_t>(s.length + i));
      b.seq_ids.push_back(c.seq);
    }
    s.length += n;
  }
  return b;
}

SequenceRunner::SequenceRunner(std::unique_ptr<ForwardBackend> backend)
    : owned_(std::move(backend)),
      backend_(owned_.get()),
      pages_(backend_->num_pages(), backend_->config().sparse_block_size) {}

SequenceRunner::SequenceRunner(ForwardBackend& backend)
    : backend_(&backend), pages_(backend.num_pages(), backend.config().sparse_block_size) {}

SequenceRunner::SequenceRunner(const model::M3Model& model, int64_t max_total_tokens,
                               int64_t max_seqs)
    : SequenceRunner(borrow_cpu_backend(
          model, SequencePages::pages_needed(max_total_tokens, max_seqs,
                                             model.config().sparse_block_size))) {}

ForwardResult SequenceRunner::step(const std::vector<Chunk>& chunks, bool capture_msa) {
  ForwardBatch b = pages_.build_step(chunks);
  ForwardResult r;
  backend_->forward(b, &r, capture_msa);
  return r;
}

}  // namespace m3::runtime
