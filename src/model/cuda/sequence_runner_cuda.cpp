#include "model/cuda/sequence_runner_cuda.h"

namespace m3::model {

SequenceRunnerCuda::SequenceRunnerCuda(M3ModelCuda& model, int64_t max_total_tokens,
                                       int64_t max_seqs)
    : model_(model),
      cache_(model.config(), SequencePages::pages_needed(max_total_tokens, max_seqs,
                                                         model.config().sparse_block_size)),
      pages_(cache_.num_pages(), cache_.page_size()) {}

ForwardResult SequenceRunnerCuda::step(const std::vector<Chunk>& chunks, bool capture_msa) {
  ForwardBatch b = pages_.build_step(chunks);
  ForwardResult r;
  model_.forward(b, cache_, &r, capture_msa);
  return r;
}

}  // namespace m3::model
