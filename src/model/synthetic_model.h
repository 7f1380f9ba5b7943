// Synthetic MiniMax-M3 models: `--model synthetic:layers=N[,seed=S]` names a model with M3's real
// geometry (m3-model.md §1-2) and N layers whose weights are generated on the GPU
// (model/cuda/synthetic_weights.h), for benchmarks at the real shapes without the checkpoint.
// Called by src/app (flag parsing), M3Model::load (a config-only host model for the engine) and
// the CUDA backend. Invariant: a parsed spec has 1 <= layers <= 60; the config is M3's with
// num_hidden_layers = layers and the per-layer vectors cut to that length.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/shard.h"

namespace m3::model {

struct TensorSpec;

struct SyntheticSpec {
  int64_t layers = 0;
  uint64_t seed = 0;
  // weights=bf16|fp8|mxfp8|nvfp4|mxfp4 (docs/QUANTIZATION.md): the format the linears would be
  // stored in, as the published checkpoints store them: fp8 = per-output-channel e4m3 of every
  // quantizable linear (--quantization fp8_per_channel), mxfp8 = MXFP8 of every one, nvfp4 /
  // mxfp4 = the routed experts in 4 bits and the other linears MXFP8. Byte counts and `m3serve
  // plan` follow it; serving one is refused until the GPU has FP8/FP4 kernels.
  kernels::WeightQuant weights = kernels::WeightQuant::kNone;
  // vision=1: the config gets M3's vision_config (hidden 1280, 32 layers, 16 x 80 heads, MLP
  // 5120, projector 6144; the shipped reference RoPE layout) and the GPU backend generates a
  // tower of those shapes (model/cuda/vision_cuda.h), so image input runs at M3's shapes.
  bool vision = false;
};

inline constexpr std::string_view kSyntheticPrefix = "synthetic:";
inline constexpr int64_t kSyntheticMaxLayers = 60;  // M3 has 60 decoder layers

// Whether a --model value names a synthetic model (starts with "synthetic:").
bool is_synthetic_model(std::string_view model);

// Parses "synthetic:layers=N[,seed=S][,weights=F]" (keys in any order, each once). Errors name the
// bad part and show the accepted form.
Result<SyntheticSpec> parse_synthetic_spec(std::string_view model);

// M3's text config (hidden 6144, 64q/4kv x 128, rotary 64, 128 experts top-4 of 3072 with sigmoid
// + bias + scale 2.0, shared expert 3072, dense 12288 on layers 0-2, MSA from layer 3, index
// 4 x 128, block 128, top-16, vocab 200064) with `layers` layers. model_type is
// "minimax_m3_synthetic" so logs and /v1/models show it is not the checkpoint.
M3Config synthetic_m3_config(int64_t layers);

// Parameters and bytes of the synthetic weights: the tensors of m3_tensors(cfg) in their
// synthetic dtypes (model/tensor_table.h: bf16 everywhere except the f32 router weight and
// router bias, as in M3 checkpoints). For 60 layers the count is M3's text total,
// 426,174,572,928 (m3-model.md §1.5).
int64_t synthetic_param_count(const M3Config& cfg);
int64_t synthetic_weight_bytes(const M3Config& cfg);
// The bytes one rank of `plan` holds (its slices, plus what every rank replicates: norms, router,
// index-K); the unsharded plan gives synthetic_weight_bytes(cfg).
int64_t synthetic_weight_bytes(const M3Config& cfg, const ShardPlan& plan);
// The same in a stored format (SyntheticSpec::weights): each quantizable linear's codes and
// scales (kernels::MatRef::bytes of its block), everything else as above.
int64_t synthetic_weight_bytes(const M3Config& cfg, const ShardPlan& plan,
                               kernels::WeightQuant weights);
// The format a synthetic spec's weights=F gives `t` (kNone: as synthetic_dtype).
kernels::WeightQuant synthetic_format_of(const TensorSpec& t, kernels::WeightQuant weights);

// The message for `--device cpu` with a synthetic model (too big for the CPU path).
std::string synthetic_needs_cuda_message(std::string_view model);

}  // namespace m3::model
