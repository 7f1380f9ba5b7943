// M3Config: the model's geometry and options, read from config.json (model/config.cpp).
// Accepts the shipped form (text_config + sparse_attention_config, moe_layer_freq,
// sparse_attention_freq, rotary_dim, rope_theta) and the flat form transformers writes
// (index_* keys, layer_types, mlp_layer_types, rope_parameters). Key names are the checkpoint's.
// Invariant after load_config/parse_config succeeds: every field is set and validated, the
// per-layer vectors have num_hidden_layers entries, and the activation is always SwiGLU-OAI.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "kernels/views.h"

namespace m3::model {

// How the vision tower places its 3-D RoPE and which patches attend to each other.
//   kReference: the trained model as Automodel and SGLang run it (m3-model.md §7): per axis
//     (t, h, w) 2*floor(floor(head_dim/2)/3 / 2) rotary dims of frequencies theta^(-2i/axis),
//     concatenated t|h|w and duplicated NeoX-style over the first 3*axis dims; one attention
//     block per image.
//   kTransformers: transformers 5.17's MiniMaxM3VLVisionModel: head_dim/4 frequencies
//     theta^(-2i/(head_dim/2)) for the positions t and h (its axial RoPE reads only the first two
//     of the three position columns), duplicated over the whole head; every patch of one forward
//     attends to every other, across images.
// A config.json written by transformers (vision_config.model_type "minimax_m3_vl_vision") gets
// kTransformers, so its checkpoint runs as transformers runs it; the shipped config
// ("clip_vision_model") gets kReference.
enum class VisionRopeLayout { kReference, kTransformers };

// vision_config and the projector keys of the top level (m3-model.md §1.1, §1.4).
struct M3VisionConfig {
  bool present = false;  // config.json has a vision_config
  int64_t hidden_size = 1280;
  int64_t intermediate_size = 5120;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 16;
  int64_t num_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  double layer_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  VisionRopeLayout rope_layout = VisionRopeLayout::kReference;
  int64_t projector_hidden_size = 6144;
  bool projector_bias = true;  // multimodal_projector_bias
  int64_t image_token_index = 200025;
  int64_t video_token_index = 200026;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t patch_row_size() const {
    return num_channels * temporal_patch_size * patch_size * patch_size;
  }
};

struct M3Config {
  std::string model_type;  // top-level model_type as written ("minimax_m3_vl", ...)

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;         // routed expert intermediate
  int64_t dense_intermediate_size = 0;   // dense MLP (layers with layer_is_moe[i] == false)
  int64_t shared_intermediate_size = 0;  // shared expert intermediate (0: no shared expert)
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_shared_experts = 1;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 5000000.0;
  int64_t rotary_dim = 0;  // rotated dims per head (NeoX halves), <= head_dim
  // YaRN context extension (rope_type "yarn" in rope_scaling / rope_parameters; none when
  // factor <= 1). Applies to the attention and the MSA index RoPE alike. With it,
  // max_position_embeddings is at least original_max_position_embeddings x factor (vLLM's
  // derived max length).
  kernels::RopeScaling rope_scaling;
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  double swiglu_beta = 1.0;  // the "+1" on up; absent in the file means 1.0
  double routed_scaling_factor = 1.0;
  bool use_routing_bias = true;  // e_score_correction_bias present and used for selection
  bool tie_word_embeddings = false;

  // MiniMax Sparse Attention (used on layers with layer_is_sparse[i]).
  int64_t index_n_heads = 0;  // == num_key_value_heads (checked)
  int64_t index_head_dim = 0;
  int64_t sparse_block_size = 128;  // tokens per scored block == KV page size
  int64_t sparse_topk_blocks = 16;
  int64_t sparse_init_blocks = 0;   // leading blocks always selected
  int64_t sparse_local_blocks = 1;  // most recent blocks always selected (incl. the query's own)

  std::vector<bool> layer_is_sparse;  // [num_hidden_layers]: MSA (else full attention)
  std::vector<bool> layer_is_moe;     // [num_hidden_layers]: MoE (else dense MLP)

  int64_t bos_token_id = 200034;
  std::vector<int64_t> eos_token_ids = {200020};
  bool has_vision_config = false;
  M3VisionConfig vision;  // vision.present == has_vision_config

  // The paged KV cache's element formats (docs/KV_CACHE.md). A serving choice, not read from
  // config.json: set by M3Model::set_kv_cache_format before any cache is sized or made, so every
  // copy of the config (shards, the GPU model) carries it. kv_k_scale / kv_v_scale: the
  // per-layer scales of an fp8 K / V, from the checkpoint (self_attn.k_scale / v_scale) where
  // it has them; empty means 1.0 for every layer.
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kF32;
  kernels::KvDtype index_cache_dtype = kernels::KvDtype::kF32;
  std::vector<float> kv_k_scale, kv_v_scale;

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
  int64_t num_sparse_layers() const;
  bool any_sparse() const { return num_sparse_layers() > 0; }
  std::string summary() const;  // one line: layers, hidden, heads, experts, MSA geometry
  float k_scale(int64_t layer) const { return kv_k_scale.empty() ? 1.f : kv_k_scale[layer]; }
  float v_scale(int64_t layer) const { return kv_v_scale.empty() ? 1.f : kv_v_scale[layer]; }
};

// Parses config.json text. `source` names the file in error messages.
Result<M3Config> parse_config(std::string_view json_text, std::string_view source = "config.json");
// Reads <model_dir>/config.json.
Result<M3Config> load_config(const std::string& model_dir);

// The paged KV cache page must be the MSA block (design.md: "the KV page is the MSA block").
// Returns an error naming --block-size and the value that works when they differ.
Status check_kv_block_size(const M3Config& cfg, int64_t block_size);

}  // namespace m3::model
