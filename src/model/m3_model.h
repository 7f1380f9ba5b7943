// M3Model: the MiniMax-M3 text model (m3-model.md §3-4) on the CPU: its config, the weights
// read in place from the checkpoint, and the one forward pass (model/m3_forward.h) over the CPU
// ops (model/cpu_ops.h). One forward() serves whole-prompt prefill, chunked prefill and batched
// decode alike: a step is a flat list of tokens, each with its sequence and absolute position,
// plus each sequence's block table. Called by the CPU backends (runtime/forward_backend.h),
// `m3serve generate` and the model tests; M3ModelCuda uploads its weights.
// Invariant: forward() writes K, V and index-K of every step token into its page before any
// attention reads the cache, so tokens of the same step see each other causally.
// Sharding (model/shard.h): make_shard gives one rank of a tensor/expert-parallel or attention
// data-parallel group. Tensor parallel: every rank runs forward() on the same batch at the same
// time and gets the same logits. Data parallel: the host splits each step by sequence owner
// (runtime/dp_batch_split.h); every rank runs forward() on its own sequences, or forward_dp_idle()
// when it has none, after set_dp_step_rows(). An unsharded model (world 1, no communicator) runs
// exactly the single-device code path.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/sample.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/safetensors.h"
#include "model/shard.h"
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
  // Sampling on the device (backends whose samples_on_device() is true; others ignore both
  // fields): each entry samples logits row `row` (an index into logits_indices) and its token
  // comes back in ForwardResult::sampled, in the same order. Only the logits rows listed in
  // `host_logits_rows` (indices into logits_indices, ascending) are then copied to the host.
  std::vector<kernels::cpu::SampleRow> device_samples;
  std::vector<int32_t> host_logits_rows;
  int64_t num_sampleable = 0;  // ids >= this are never sampled on the device (0: vocab size)
  // Async scheduling (runtime::ForwardBackend::launch only): token prev_sample_tokens[i] takes
  // the id that the previously launched step sampled in its device_samples entry
  // prev_sample_slots[i] (token_ids holds a placeholder there); read on the device, so the host
  // needs not have that step's results yet.
  std::vector<int32_t> prev_sample_tokens;
  std::vector<int32_t> prev_sample_slots;
  // Rows of token_ids whose input embedding is given here instead of looked up (the image
  // placeholder tokens, model/vision_tower.h): ascending indices, and embed_values
  // [embed_rows.size(), hidden] f32. Only backends whose supports_image_input() is true read it.
  std::vector<int32_t> embed_rows;
  std::vector<float> embed_values;
  // Speculative decoding (EAGLE-3): target layers whose input residual stream comes back in
  // ForwardResult::aux_hidden for every token of the step (model/m3_forward.h AuxCapture).
  std::vector<int32_t> aux_layers;
  // With aux_layers: the states stay in the backend's device memory for its device draft
  // (runtime::ForwardBackend::make_draft) and ForwardResult::aux_hidden stays empty.
  bool aux_on_device = false;
};

struct ForwardResult {
  int64_t vocab_size = 0;
  // [logits_indices.size(), vocab] fp32; when the batch had device_samples, only the rows
  // `logits_rows` of logits_indices (== the batch's host_logits_rows), in that order.
  std::vector<float> logits;
  std::vector<int32_t> logits_rows;
  std::vector<int32_t> sampled;  // one token per ForwardBatch::device_samples entry
  // When capture_msa: per layer, the selected blocks [T, num_kv_heads, topk] (-1 padded);
  // empty for full-attention layers.
  std::vector<std::vector<int32_t>> msa_blocks;
  // [T, aux_layers.size() * hidden] f32 when the batch asked for aux_layers, else empty.
  std::vector<float> aux_hidden;
};

struct LoadOptions {
  bool language_model_only = true;  // vision tensors are not read (no tower: no image input)
  // --quantization (model/quantization.h): "" / none reads the checkpoint as stored;
  // fp8_per_channel quantizes a bf16 checkpoint's linears at load; a method name must match the
  // checkpoint's quantization_config.
  std::string quantization;
};

// Reads the per-layer fp8 K/V scales (model.layers.N.self_attn.k_scale / v_scale, or under
// k_proj. / v_proj.) into cfg.kv_k_scale / kv_v_scale when the checkpoint has any (missing ones
// are 1.0). Errors name the tensor: a scale that is not one value, or not positive and finite.
Status load_kv_scales(const Checkpoint& ck, M3Config& cfg);

// Checks user-supplied ids against a config: non-empty and inside [0, vocab_size).
Status validate_prompt_ids(const M3Config& cfg, std::span<const int32_t> ids);

class CpuOps;
template <class Ops>
class M3Forward;
class VisionTower;
struct VisionImage;

class M3Model {
 public:
  // `model_dir` may also be a synthetic spec ("synthetic:layers=N[,seed=S]",
  // model/synthetic_model.h): the result is then config-only (has_weights() false), which the
  // engine hands to a GPU backend that generates the weights there; the CPU backend refuses it.
  static Result<std::unique_ptr<M3Model>> load(const std::string& model_dir,
                                               const LoadOptions& opts = {});
  M3Model(M3Config cfg, std::unique_ptr<M3Weights> w);
  ~M3Model();
  // A model with a config and no weights (forward() must not be called).
  static std::unique_ptr<M3Model> config_only(M3Config cfg);
  bool has_weights() const { return !w_->layers.empty(); }
  // A config-only synthetic model's weight format (SyntheticSpec::weights): the GPU backend
  // generates the linears in it. kNone (bf16) otherwise.
  kernels::WeightQuant synthetic_weights() const { return synthetic_weights_; }

  // Rank spec.rank of a sharded group over this model's weights (shared, not copied, except the
  // column slices shard.h lists). The shard keeps the weights alive; this model may go away.
  // Errors: a split that does not divide (make_shard_plan), or a config-only model.
  Result<std::unique_ptr<M3Model>> make_shard(const ShardSpec& spec) const;

  const M3Config& config() const { return cfg_; }
  // The KV cache's element formats (docs/KV_CACHE.md), before any cache is sized or made and
  // before the model is sharded or uploaded (those copy the config).
  void set_kv_cache_format(kernels::KvDtype kv, kernels::KvDtype index);
  // The views forward() reads: the whole model, or this rank's slices when sharded.
  const M3Weights& weights() const { return *w_; }
  // The unsharded weights, shared (an EAGLE-3 draft keeps the embedding and LM head it reads).
  std::shared_ptr<const M3Weights> base_weights() const { return base_; }
  const ShardPlan& shard_plan() const { return plan_; }
  // KV heads this model's KvCache must hold (all of them unless sharded).
  int64_t cache_kv_heads() const { return plan_.num_kv_heads; }

  // Checks user-supplied ids: non-empty and inside the vocabulary.
  Status validate_prompt(std::span<const int32_t> ids) const;

  // When tensor sharded, every rank must call forward with the same batch and capture_msa (the
  // collectives pair up), and `cache` holds cache_kv_heads() heads; each rank's `out` (may be
  // null) gets the full logits and MSA selections. Not reentrant: one forward at a time (the
  // model owns its scratch buffers).
  void forward(const ForwardBatch& batch, KvCache& cache, ForwardResult* out,
               bool capture_msa = false) const;
  // Attention data parallel only (see the header comment): the largest token count of any rank
  // in the coming step, set on every rank before forward() / forward_dp_idle().
  void set_dp_step_rows(int64_t max_rows) const;
  // Attention data parallel: the step of a rank with no tokens (joins the MoE collectives).
  void forward_dp_idle() const;
  // Attention data parallel: the bytes this rank's MoE dispatch has sent to other ranks so far
  // (M3Forward::moe_dispatch_bytes; 0 otherwise).
  int64_t moe_dispatch_bytes() const;

  // The vision tower, loaded unless LoadOptions::language_model_only (null: no image input).
  // A shard shares its base model's tower.
  const VisionTower* vision() const { return vision_.get(); }
  // Image embeddings [sum of tokens, hidden] for one request's images (VisionTower::encode).
  // Not reentrant with forward() (one engine thread calls both).
  void encode_images(std::span<const VisionImage> images, std::vector<float>* embeds) const;

 private:
  M3Model(M3Config cfg, std::shared_ptr<const M3Weights> base, std::unique_ptr<M3Weights> views,
          ShardPlan plan, dist::Communicator* comm);
  void init_forward();

  M3Config cfg_;
  std::shared_ptr<const M3Weights> base_;  // the unsharded weights (owner of in-place views)
  std::shared_ptr<const M3Weights> w_;     // what forward reads: base_ itself, or rank views
  ShardPlan plan_;
  dist::Communicator* comm_ = nullptr;  // non-null iff plan_.sharded(); not owned
  // The forward pass and its ops (scratch buffers, the communicator); forward() is const to its
  // callers (weights and config do not change) while the scratch behind these pointers does.
  std::unique_ptr<CpuOps> ops_;
  std::unique_ptr<M3Forward<CpuOps>> fw_;
  std::shared_ptr<const VisionTower> vision_;
  kernels::WeightQuant synthetic_weights_ = kernels::WeightQuant::kNone;
};

}  // namespace m3::model
