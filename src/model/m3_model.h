// M3Model: the MiniMax-M3 text model (m3-model.md §3-4) on the CPU ops. One forward() serves
// whole-prompt prefill, chunked prefill and batched decode alike: a step is a flat list of
// tokens, each with its sequence and absolute position, plus each sequence's block table.
// Called by the engine's model runner, `m3serve generate` and the model tests.
// Invariant: forward() writes K, V and index-K of every step token into its page before any
// attention reads the cache, so tokens of the same step see each other causally.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/weights.h"

namespace m3::model {

// One step's tokens. Sequence s owns logical blocks
// block_table[block_table_offsets[s] .. block_table_offsets[s+1]), enough to hold every position
// of its tokens in this step.
struct ForwardBatch {
  std::vector<int32_t> token_ids;            // [T]
  std::vector<int32_t> positions;            // [T] absolute, from 0 per sequence
  std::vector<int32_t> seq_ids;              // [T] index into the block-table CSR
  std::vector<int32_t> block_table_offsets;  // [S + 1]
  std::vector<int32_t> block_table;          // physical page ids
  std::vector<int32_t> logits_indices;       // rows of T whose logits are wanted, in order
};

struct ForwardResult {
  int64_t vocab_size = 0;
  std::vector<float> logits;  // [logits_indices.size(), vocab] fp32
  // When capture_msa: per layer, the selected blocks [T, num_kv_heads, topk] (-1 padded);
  // empty for full-attention layers.
  std::vector<std::vector<int32_t>> msa_blocks;
};

struct LoadOptions {
  bool language_model_only = true;  // vision tensors are not read
};

class M3Model {
 public:
  static Result<std::unique_ptr<M3Model>> load(const std::string& model_dir,
                                               const LoadOptions& opts = {});
  M3Model(M3Config cfg, std::unique_ptr<M3Weights> w);

  const M3Config& config() const { return cfg_; }
  const M3Weights& weights() const { return *w_; }

  // Checks user-supplied ids: non-empty and inside the vocabulary.
  Status validate_prompt(std::span<const int32_t> ids) const;

  void forward(const ForwardBatch& batch, KvCache& cache, ForwardResult* out,
               bool capture_msa = false) const;

 private:
  void moe(const LayerWeights& L, const float* x, int64_t n, float* out) const;
  void dense_mlp(const MatRef& gate, const MatRef& up, const MatRef& down, const float* x,
                 int64_t n, float* out) const;

  M3Config cfg_;
  std::unique_ptr<M3Weights> w_;
};

}  // namespace m3::model
