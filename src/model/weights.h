// M3Weights: views of every text-model tensor (model/tensor_table.h lists them), taken from a
// Checkpoint with the checkpoint's own names (m3-model.md §2). bf16/f32 tensors are used in place
// from the mapping, and so are quantized linears (MXFP8, NVFP4, MXFP4, per-channel fp8: codes and
// scales as stored, kernels/views.h WeightQuant, docs/QUANTIZATION.md); f16 is widened to f32,
// and --quantization fp8_per_channel quantizes a bf16 checkpoint's linears at load, into storage
// owned here. Vision tensors are never touched.
// Invariant: after load_weights succeeds every view has the shape the config implies.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "model/config.h"
#include "model/quantization.h"
#include "model/safetensors.h"

namespace m3::model {

using kernels::cpu::MatRef;
using kernels::cpu::VecRef;

struct ExpertWeights {
  MatRef w1;  // gate [inter, hidden]
  MatRef w3;  // up   [inter, hidden]
  MatRef w2;  // down [hidden, inter]
};

struct LayerWeights {
  VecRef input_norm, post_attention_norm;  // [hidden]
  MatRef q_proj, k_proj, v_proj, o_proj;   // [q,h] [kv,h] [kv,h] [h,q]
  VecRef q_norm, k_norm;                   // [head_dim]
  // MSA (sparse layers only)
  MatRef index_q_proj, index_k_proj;  // [index_heads*index_dim, h], [index_dim, h]
  VecRef index_q_norm, index_k_norm;  // [index_dim]
  // dense MLP (dense layers only)
  MatRef gate_proj, up_proj, down_proj;
  // MoE (moe layers only)
  MatRef router;       // [experts, hidden], f32 in M3 checkpoints
  VecRef router_bias;  // [experts] f32 (n == 0 when use_routing_bias is false)
  std::vector<ExpertWeights> experts;
  // The GPU model's NVFP4 experts: their global scales on the device, f32 [3, experts] (w1's,
  // w3's, w2's; kernels::MoeExpertWeights::global_scales). Null on the host.
  const float* expert_global_scales = nullptr;
  bool has_shared_expert = false;
  MatRef shared_gate, shared_up, shared_down;
};

struct M3Weights {
  MatRef embed_tokens;  // [vocab, hidden]
  VecRef final_norm;    // [hidden]
  MatRef lm_head;       // [vocab, hidden]
  std::vector<LayerWeights> layers;

  std::shared_ptr<Checkpoint> checkpoint;        // keeps the mappings alive
  std::vector<std::vector<uint16_t>> owned_u16;  // dequantised bf16 copies
  std::vector<std::vector<float>> owned_f32;     // widened f16 copies, fp8_per_channel scales
  std::vector<std::vector<uint8_t>> owned_u8;    // fp8_per_channel codes
  size_t bytes_in_place = 0;                     // weight bytes read from the mapping
  size_t bytes_owned = 0;                        // weight bytes converted at load
  // Linears per stored format (index: kernels::WeightQuant), and the bytes of the bf16/f32
  // tensors that fp8_per_channel replaced.
  size_t num_quantized[5] = {0, 0, 0, 0, 0};
  size_t online_source_bytes = 0;
};

// `m` (any format) as an f32 matrix in `storage` (resized): each value dequantised exactly
// (kernels::cpu::dequantize_row). What the GPU upload holds of a quantized matrix its quantized
// kernels cannot read (model/tensor_table.h uploads_quantized): the CPU's values, exactly.
MatRef dequantize_to_f32(const MatRef& m, std::vector<float>& storage);

// Loads and checks every text tensor the config implies (the tensor table, model/tensor_table.h,
// in its order; a layer's routed experts expert by expert). Errors name the tensor, what was found
// and the expected shape and dtype (a scale tensor: its name, its shape and the expected one).
// `quant` (model/quantization.h): the checkpoint's declared method, which every quantized tensor
// must fit, and whether fp8_per_channel quantizes the linears at load.
Result<std::unique_ptr<M3Weights>> load_weights(std::shared_ptr<Checkpoint> ckpt,
                                                const M3Config& cfg, const QuantPlan& quant = {});

}  // namespace m3::model
