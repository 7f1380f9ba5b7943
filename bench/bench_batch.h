// The ForwardBatch the model-level CUDA benches step (bench_layer, bench_step): `num_seqs`
// sequences, sequence s owning pages [s * pages_per_seq, (s + 1) * pages_per_seq), each with
// `new_tokens` tokens at positions [ctx, ctx + new_tokens) and deterministic token ids. No logits
// rows: callers that want the LM head and sampling add them. Header-only.
#pragma once

#include <cstdint>

#include "model/m3_model.h"

namespace m3::bench {

inline model::ForwardBatch make_batch(int num_seqs, int64_t ctx, int new_tokens,
                                      int64_t pages_per_seq, int64_t vocab) {
  model::ForwardBatch b;
  b.block_table_offsets.push_back(0);
  for (int s = 0; s < num_seqs; ++s) {
    for (int64_t p = 0; p < pages_per_seq; ++p)
      b.block_table.push_back(static_cast<int32_t>(s * pages_per_seq + p));
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
    for (int j = 0; j < new_tokens; ++j) {
      b.token_ids.push_back(static_cast<int32_t>((s * 7919 + j * 104729) % vocab));
      b.positions.push_back(static_cast<int32_t>(ctx + j));
      b.seq_ids.push_back(s);
    }
  }
  return b;
}

}  // namespace m3::bench
