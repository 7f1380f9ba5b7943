#include "model/cuda/sequence_runner_cuda.h"

#include "core/check.h"

namespace m3::model {

namespace {
int64_t pages_for(int64_t tokens, int64_t page) { return (tokens + page - 1) / page; }
}  // namespace

SequenceRunnerCuda::SequenceRunnerCuda(M3ModelCuda& model, int64_t max_total_tokens,
                                       int64_t max_seqs)
    : model_(model),
      cache_(model.config(),
             pages_for(max_total_tokens, model.config().sparse_block_size) + max_seqs) {}

int SequenceRunnerCuda::add_sequence() {
  seqs_.emplace_back();
  return static_cast<int>(seqs_.size()) - 1;
}

ForwardResult SequenceRunnerCuda::step(const std::vector<Chunk>& chunks, bool capture_msa) {
  ForwardBatch b;
  const int64_t page = cache_.page_size();
  for (const Chunk& c : chunks) {
    Seq& s = seqs_[c.seq];
    const int64_t need = pages_for(s.length + static_cast<int64_t>(c.tokens.size()), page);
    while (static_cast<int64_t>(s.pages.size()) < need) {
      M3_CHECK(next_page_ < cache_.num_pages(), "SequenceRunnerCuda: out of KV pages");
      s.pages.push_back(static_cast<int32_t>(next_page_++));
    }
  }
  // Every sequence in the runner gets a CSR slot; seq_ids index it directly.
  b.block_table_offsets.push_back(0);
  for (const Seq& s : seqs_) {
    b.block_table.insert(b.block_table.end(), s.pages.begin(), s.pages.end());
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
  }
  for (const Chunk& c : chunks) {
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
  ForwardResult r;
  model_.forward(b, cache_, &r, capture_msa);
  return r;
}

}  // namespace m3::model
