// Eagle3Draft: an EAGLE-3 draft head (`LlamaForCausalLMEagle3`, m3-model.md §5.2) for speculative
// decoding: its config and weights read from the draft checkpoint, validated against the target
// model it drafts for, and its forward (model/eagle3_forward.h) over the CPU ops with its own
// paged KV cache (one layer, the target's page size and page ids). Loaded by the engine when
// --speculative-config names a draft; driven by engine/spec_decode.h.
// The draft's layer: fc over the concatenated target hidden states of the aux layers (the
// residual stream entering each of them), then one Llama decoder layer whose attention reads
// concat(input_norm(embed(token)), hidden_norm(hidden)), residual on the hidden branch, SiLU MLP,
// final norm and an LM head (the target's embedding and LM head unless the draft ships its own;
// a draft vocabulary maps to target ids through d2t). The pre-norm output feeds the next
// draft step in place of the fc output.
// Invariant: forward() writes the draft K/V of every step token into its page before attention
// reads the cache (causal within a step), exactly like M3Forward.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/weights.h"

namespace m3::model {

struct Eagle3Config {
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;        // the target vocabulary (embedding rows)
  int64_t draft_vocab_size = 0;  // LM head rows (== vocab_size without a d2t map)
  int64_t target_hidden_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // Target layers whose input residual stream the draft reads, in fc column order. From the
  // draft's eagle_config.eagle_aux_hidden_state_layer_ids, else vLLM's default rule
  // (2, L / 2, L - 3) for an L-layer target.
  std::vector<int32_t> aux_layer_ids;
  bool aux_layers_from_config = false;
  std::string summary() const;  // one line: heads (MHA/GQA), hidden, aux layers, vocab
};

// Reads <dir>/config.json of an EAGLE-3 draft for `target` (the aux layers default from its layer
// count). Errors: not an EAGLE-3 draft (architectures), missing or bad keys, aux layer ids outside
// [0, target layers], a rope_scaling the draft layer does not implement.
Result<Eagle3Config> load_eagle3_config(const std::string& dir, const M3Config& target);

struct Eagle3Weights {
  using MatRef = kernels::MatRef;
  using VecRef = kernels::VecRef;
  MatRef fc;  // [hidden, aux * target_hidden]
  MatRef q_proj, k_proj, v_proj, o_proj;
  MatRef gate_proj, up_proj, down_proj;
  // Llama RMSNorm weights w stored as w - 1 in f32, so the Gemma-form op (1 + w') reads them.
  VecRef input_norm, hidden_norm, post_attention_norm, final_norm;
  MatRef embed_tokens;  // [vocab, hidden]: the draft's own or the target's
  MatRef lm_head;       // [draft_vocab, hidden]: the draft's own or the target's
  bool own_embed = false, own_lm_head = false;
  std::vector<int32_t> draft_to_target;  // [draft_vocab] target id of each draft id (d2t)
  std::shared_ptr<Checkpoint> checkpoint;
  std::shared_ptr<const M3Weights> target;  // keeps the shared embedding / LM head alive
  std::vector<std::vector<float>> owned_f32;
};

class CpuOps;
template <class Ops>
class Eagle3Forward;

// One draft step's tokens, laid out like a ForwardBatch (positions absolute, block tables CSR
// over the same page ids as the target), and the hidden input of each token: rows of
// aux * target_hidden (the target's aux states, through fc) or of hidden (the draft's own
// pre-norm output of the previous draft step).
struct DraftBatch {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_ids;
  std::vector<int32_t> block_table_offsets;
  std::vector<int32_t> block_table;
  std::vector<float> hidden;  // [T, aux * target_hidden] or [T, hidden] f32
  bool hidden_is_aux = true;
  std::vector<int32_t> logits_indices;  // rows whose next token is proposed
};

struct DraftResult {
  std::vector<float> prenorm;          // [T, hidden] f32: the next draft step's hidden input
  std::vector<int32_t> argmax_tokens;  // per logits row, a target id (greedy drafting)
};

// One request's part of a draft pass (engine/spec_decode.h builds them after each target step):
// its verified positions of this step and what to propose after them.
struct DraftSeq {
  uint64_t request_id = 0;
  std::span<const int32_t> block_table;  // the request's pages (the target's page ids)
  int first_row = 0;                 // its first token's row in the target step (aux hidden rows)
  int start_pos = 0;                 // position of that token
  int num_valid = 0;                 // verified positions [start_pos, start_pos + num_valid)
  std::vector<int32_t> next_tokens;  // [num_valid]: the token after each of those positions
  int num_propose = 0;               // draft tokens to propose after the last one (0: none)
  int capacity = 0;                  // positions its pages hold
};

// What runs an EAGLE-3 draft for the engine: the host draft (host_draft_proposer below, the CPU
// ops) or a backend's device draft (model/cuda/eagle3_draft_cuda.h). propose() runs the context
// pass over every seq's verified positions (the target's aux states there), then up to k - 1
// autoregressive draft steps, and returns per seq its greedy proposals (num_propose tokens, fewer
// where its pages run out), as target ids.
class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  virtual const Eagle3Config& config() const = 0;
  virtual int64_t kv_bytes_per_token() const = 0;
  // Where it runs, for the start-up line ("host" or e.g. "cuda:0").
  virtual std::string where() const = 0;
  // True: it reads the target step's aux states where the backend left them on the device
  // (ForwardBatch::aux_on_device), and propose()'s aux_hidden is empty.
  virtual bool aux_on_device() const { return false; }
  // aux_hidden: [target step tokens, aux * target_hidden] f32 on the host (empty when
  // aux_on_device()).
  virtual std::vector<std::vector<int32_t>> propose(const std::vector<DraftSeq>& seqs,
                                                    std::span<const float> aux_hidden, int k) = 0;
};

// An EAGLE-3 checkpoint read and checked against the target (load_eagle3_checkpoint).
struct Eagle3Checkpoint {
  Eagle3Config config;
  std::unique_ptr<Eagle3Weights> weights;
};
// Reads the draft in `dir` for `target`: its config, its tensors (host views into the mapped
// checkpoint) and, where the draft shares them, the target's embedding and LM head from
// `target_weights` (null: left empty for a caller that fills them, the GPU draft from the
// target's device weights). Errors: see Eagle3Draft::load.
Result<Eagle3Checkpoint> load_eagle3_checkpoint(const std::string& dir, const M3Config& target,
                                                std::shared_ptr<const M3Weights> target_weights);

// Benchmark drafts of M3's shapes with random weights (no checkpoint): `synthetic:mha` and
// `synthetic:gqa` as the speculative config's "model". Only a backend that holds the target's
// weights on a device makes them (the CUDA backend).
bool is_synthetic_draft(const std::string& model);
// The config of such a draft for `target`: one Llama layer of the target's hidden size, 48 heads
// x 128 (MHA; gqa: 3 KV heads, a 16x smaller draft KV), intermediate 4 x hidden, the target's
// vocabulary, embedding and LM head shared, aux layers (2, L/2, L-3). With M3's hidden 6144 and
// vocab 200064 that is 3.29 B parameters with the shared embedding and LM head (m3-model.md §5.2
// reports ~3.3 B; the real head counts and intermediate size are unpublished, these are ours).
// Errors: an unknown name (the accepted ones listed).
Result<Eagle3Config> synthetic_eagle3_config(const std::string& model, const M3Config& target);

class Eagle3Draft {
 public:
  // Loads the draft in `dir` for `target` (its config, and the weights the draft shares).
  // `num_pages` pages of its own KV cache, the target's page size. Errors name the problem with
  // both numbers: hidden size or vocabulary different from the target's, fc width not aux layers
  // x target hidden, a tensor missing or of the wrong shape.
  static Result<std::unique_ptr<Eagle3Draft>> load(const std::string& dir, const M3Config& target,
                                                   std::shared_ptr<const M3Weights> target_weights,
                                                   int64_t num_pages);
  // A draft over given weights (tests, the synthetic benchmark draft).
  Eagle3Draft(Eagle3Config cfg, std::unique_ptr<Eagle3Weights> w, int64_t page_size,
              int64_t num_pages);
  ~Eagle3Draft();

  const Eagle3Config& config() const { return cfg_; }
  int64_t num_pages() const { return cache_->num_pages(); }
  int64_t kv_bytes_per_token() const;
  // Runs one step; not reentrant (one engine thread).
  void forward(const DraftBatch& batch, DraftResult* out);
  // The host weights (tests compare the GPU draft's numbers over the same ones).
  const Eagle3Weights& weights() const { return *w_; }

 private:
  Eagle3Config cfg_;
  M3Config cache_cfg_;  // a one-layer, full-attention layout for the KvCache
  std::unique_ptr<Eagle3Weights> w_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<CpuOps> ops_;
  std::unique_ptr<Eagle3Forward<CpuOps>> fw_;
};

// The draft on the host CPU ops as a DraftProposer (the CPU backend's, and any backend without a
// device draft): the context pass and each draft step are one Eagle3Draft::forward each.
std::unique_ptr<DraftProposer> host_draft_proposer(std::unique_ptr<Eagle3Draft> draft);

}  // namespace m3::model
