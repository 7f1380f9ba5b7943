// `m3serve plan`'s arithmetic (issue #21, item 5): for a model config, a GPU count and size, a
// KV format and a weight format, what each deployment strategy (TP, TP+EP, DP+EP) puts on one
// GPU, how many KV tokens then fit, and the largest --max-model-len, so the "not enough memory
// for the KV cache" start-up failure is found before launching. Pure arithmetic over the tensor
// table (model/tensor_table.h) and the KV page size (model/kv_cache.h); cmd_plan.cpp prints it.
// Invariant: the KV pool follows the serving rule of runtime/cuda/cuda_backend.cpp: the fraction
// --gpu-memory-utilization of the memory left after the weights (and a fixed reserve).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/shard.h"

namespace m3::app {

// Weight formats, by the bytes a quantized linear's element takes (scales included) and which
// linears are quantized (m3-model.md §2.6-2.8).
enum class WeightFormat { kBf16, kMxfp8, kFp8PerChannel, kNvfp4, kMxfp4 };
const char* weight_format_name(WeightFormat f);  // "bf16", "mxfp8", ...
// --quantization spellings (vLLM's plus the variants' names); none/auto/"" = bf16.
bool parse_weight_format(const std::string& s, WeightFormat& out);

enum class Strategy { kTp, kTpEp, kDpEp };

struct PlanInput {
  int gpus = 8;
  double gpu_memory_gib = 140.0;              // an H200 (141 GB, 140.4 GiB usable)
  double gpu_memory_utilization = 0.9;        // of the memory left after the weights
  double reserve_gib = 2.0;                   // CUDA context, workspaces, graphs (per GPU)
  int64_t max_model_len = 0;                  // 0: report the largest that fits
  WeightFormat stored = WeightFormat::kBf16;  // the checkpoint's format
};

struct StrategyPlan {
  Strategy strategy = Strategy::kTp;
  std::string name;               // "TP8", "TP8 + EP", "DP8 + EP"
  double weights_stored_gib = 0;  // per GPU, in the checkpoint's format
  double weights_served_gib = 0;  // per GPU, as m3serve holds them (the stored format)
  bool weights_fit = false;
  double kv_gib = 0;               // the KV pool per GPU
  int64_t kv_bytes_per_token = 0;  // per GPU
  int64_t tokens_per_gpu = 0;      // pool tokens on one GPU (whole pages)
  int64_t tokens_total = 0;        // what the deployment holds (DP: one pool per rank)
  int64_t max_model_len = 0;       // the largest a sequence may have (one rank's pool, capped)
  bool requested_fits = true;      // PlanInput::max_model_len fits (true when none asked)
  std::string launch;              // the `m3serve serve` flags of the strategy
};

// Bytes one rank holds of each tensor of m3_tensors(cfg) under `plan` in `format` (the GPU holds
// quantized linears in their stored format, docs/QUANTIZATION.md).
int64_t weight_bytes(const model::M3Config& cfg, const model::ShardPlan& plan, WeightFormat format);

// The three strategies for `cfg` (with its KV formats set) on in.gpus GPUs. Errors: gpus < 1,
// a GPU count the model's heads or experts cannot split.
Result<std::vector<StrategyPlan>> plan_deployment(const model::M3Config& cfg, const PlanInput& in);

}  // namespace m3::app
