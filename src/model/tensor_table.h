// The tensor table: every text-model tensor of an M3 checkpoint, written down once. A TensorSpec
// says what the tensor is called in the checkpoint (with its alternative spellings), its shape,
// the dtype synthetic weights use, how a ShardPlan splits it, how synthetic weights initialise
// it, and which view of M3Weights holds it. Everything that walks the weights walks this table:
// load_weights (model/weights.cpp), shard_weights (model/shard.cpp), the GPU upload, its byte
// count and the synthetic generator (model/cuda/m3_model_cuda.cpp), and the synthetic parameter
// and byte counts (model/synthetic_model.cpp). A tensor added here appears in all of them.
// Invariant: m3_tensors(cfg) lists the tensors in one fixed order (globals, then layer by layer
// in checkpoint-module order); the synthetic generator numbers them in that order, so the seed
// -> weights mapping depends only on the table. For every plan of make_shard_plan(cfg, ...),
// shard_block() of every tensor lies inside the tensor and the ranks' blocks of a split tensor
// tile it exactly (replicated KV heads beyond num_kv_heads ranks excepted, by design).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "model/shard.h"
#include "model/weights.h"

namespace m3::model {

// How a plan splits a tensor: whole on every rank, or a range of its rows or its columns.
enum class SplitDim : uint8_t { kReplicated, kRows, kCols };

// Which of the plan's ranges the split dimension follows (ShardPlan fields, in elements):
//   kQHeads      [q_head_begin, + num_q_heads) x head_dim
//   kKvHeads     [kv_head_begin, + num_kv_heads) x head_dim (one replicated head beyond nkv ranks)
//   kIndexHeads  the KV heads' range x index_head_dim under tensor parallelism, else every head
//   kVocab       [vocab_begin, + vocab_count)
//   kDense       [dense_inter_begin, + dense_inter)
//   kShared      [shared_inter_begin, + shared_inter)
//   kExpertInter [expert_inter_begin, + expert_inter) (the whole intermediate under EP)
enum class SplitBy : uint8_t {
  kNone,
  kQHeads,
  kKvHeads,
  kIndexHeads,
  kVocab,
  kDense,
  kShared,
  kExpertInter
};

// How synthetic weights (model/cuda/synthetic_weights.h) draw a tensor: uniform of std
// 1/sqrt(cols of the whole matrix) (kLinear), std 1 (kEmbedding), small Gemma norm weights
// (kNorm: (1 + w) ~ 1), an f32 router of std 1/sqrt(hidden) (kRouter) and a small f32
// selection bias (kRouterBias).
enum class SyntheticInit : uint8_t { kLinear, kEmbedding, kNorm, kRouter, kRouterBias };

struct TensorSpec {
  // Checkpoint names after the root (kCheckpointRoots), preferred spelling first; "{e}" stands
  // for the expert index of a routed-expert tensor.
  std::vector<std::string> names;
  // >= 0: the index in the table of the tensor whose chosen spelling (index into `names`) this
  // one uses (the dense MLP's up/down follow its gate); -1: the first spelling present.
  int spelling_from = -1;
  int64_t layer = -1;   // -1: a global tensor
  int64_t experts = 0;  // > 0: one tensor per routed expert, [experts, rows, cols] stacked
  int64_t rows = 0;     // a vector's length
  int64_t cols = 1;     // 1 for a vector
  bool vector = false;  // a VecRef (norms, bias), else a MatRef
  DType synthetic_dtype = DType::kBF16;
  bool device_f32 = false;  // widened to f32 on the device (the router bias, read by router_topk)
  // A linear that --quantization fp8_per_channel quantizes at load (attention, index and MLP
  // projections, experts); false for the embedding, lm_head and router, which stay as stored.
  bool quantizable = true;
  // lm_head of a config with tie_word_embeddings: the embedding's view when the checkpoint has
  // no tensor of its own (and never a second copy on the device or in synthetic weights).
  bool may_tie = false;
  SplitDim split = SplitDim::kReplicated;
  SplitBy by = SplitBy::kNone;
  SyntheticInit init = SyntheticInit::kLinear;
  // Where its view lives: exactly one of these is set (expert_mat for routed experts, then in
  // layers[layer].experts[e]).
  MatRef M3Weights::*model_mat = nullptr;
  VecRef M3Weights::*model_vec = nullptr;
  MatRef LayerWeights::*layer_mat = nullptr;
  VecRef LayerWeights::*layer_vec = nullptr;
  MatRef ExpertWeights::*expert_mat = nullptr;

  // The checkpoint name in spelling `spelling` under `root`, for expert `expert`.
  std::string name(std::string_view root, size_t spelling = 0, int64_t expert = 0) const;
  // The whole tensor's shape as the checkpoint stores it (one expert's for routed experts).
  std::vector<int64_t> shape() const;
  // Its view in `w` (expert `expert`: an index into w.layers[layer].experts).
  MatRef& mat(M3Weights& w, int64_t expert = 0) const;
  const MatRef& mat(const M3Weights& w, int64_t expert = 0) const;
  VecRef& vec(M3Weights& w) const;
  const VecRef& vec(const M3Weights& w) const;
  // How many views it has in `w` (the layer's experts, else 1).
  int64_t count_in(const M3Weights& w) const;
};

// Checkpoint roots in the order tried: shipped VL checkpoints use "language_model.", text-only
// exports none. load_weights takes the first under which the table's first tensor (the
// embedding) is present.
inline constexpr std::string_view kCheckpointRoots[] = {"language_model.", ""};

// Every text-model tensor `cfg` implies, in the fixed order: embed_tokens, final norm, lm_head,
// then per layer the norms, attention (with MSA's index projections on sparse layers), and the
// dense MLP or the MoE (router, routing bias when use_routing_bias, w1/w3/w2 of every expert,
// the shared expert when present).
std::vector<TensorSpec> m3_tensors(const M3Config& cfg);

// The block of a tensor one rank of `plan` holds, in the whole tensor's [experts, rows, cols]
// coordinates (experts = 1 and cols = 1 where the tensor has no such dimension).
struct TensorBlock {
  int64_t experts = 1, rows = 0, cols = 1;  // the whole tensor
  int64_t expert_begin = 0, expert_count = 1;
  int64_t row_begin = 0, row_count = 0;
  int64_t col_begin = 0, col_count = 1;
  size_t size() const {
    return static_cast<size_t>(expert_count) * static_cast<size_t>(row_count) *
           static_cast<size_t>(col_count);
  }
};
// Routed experts: the plan's [expert_begin, + num_experts); the split dimension: the range its
// SplitBy names; everything else whole.
TensorBlock shard_block(const TensorSpec& t, const M3Config& cfg, const ShardPlan& plan);

// Sizes `w` for the table's views: cfg.num_hidden_layers layers, `experts_per_layer` experts on
// every layer that has routed-expert tensors, has_shared_expert where the table has a shared
// expert. Views themselves are left as they are.
void size_views(M3Weights& w, const M3Config& cfg, const std::vector<TensorSpec>& table,
                int64_t experts_per_layer);

// Whether M3ModelCuda keeps a quantized matrix quantized on the GPU: its kernels
// (kernels/cuda/quant.h quant_op_supported) read whole 16-column units, so cols % 16 == 0; other
// quantized matrices are uploaded as their values in f32.
bool uploads_quantized(const MatRef& m);
// The same for a MoE layer's routed experts, which the GPU op reads as one format: every w1, w3
// and w2 of the layer quantized in expert 0's w1 format and uploads_quantized (else the layer's
// experts are all uploaded as f32).
bool experts_upload_quantized(const LayerWeights& L);

// Bytes of the table's views in `w` (the dtype of each view, a quantized view's codes and scales;
// a tied lm_head, the embedding's own view, counted once). as_uploaded: as M3ModelCuda stores them
// (device_f32 tensors at 4 bytes, quantized matrices as codes and scales where uploads_quantized /
// experts_upload_quantized, else dequantised to f32).
size_t view_bytes(const M3Weights& w, const std::vector<TensorSpec>& table,
                  bool as_uploaded = false);

}  // namespace m3::model
