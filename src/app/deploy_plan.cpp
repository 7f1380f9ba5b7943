#include "app/deploy_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "model/kv_cache.h"
#include "model/shard.h"
#include "model/tensor_table.h"

namespace m3::app {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

bool is_embedding_or_head(const model::TensorSpec& t) {
  for (const auto& n : t.names)
    if (n.find("embed_tokens") != std::string::npos || n.find("lm_head") != std::string::npos)
      return true;
  return false;
}

// Bytes per element of one linear weight in `f` (its scales included): routed experts are the
// 4-bit part of the NVFP4 / MXFP4 checkpoints, every other quantized linear is MXFP8 there.
double linear_bytes_per_element(WeightFormat f, bool routed_expert, int64_t cols) {
  switch (f) {
    case WeightFormat::kBf16:
      return 2.0;
    case WeightFormat::kMxfp8:
      return 1.0 + 1.0 / 32;  // fp8 + one E8M0 exponent per 32
    case WeightFormat::kFp8PerChannel:
      return 1.0 + 4.0 / static_cast<double>(std::max<int64_t>(cols, 1));  // + an f32 per row
    case WeightFormat::kNvfp4:
      return routed_expert ? 0.5 + 1.0 / 16 : 1.0 + 1.0 / 32;  // e2m1 + an fp8 scale per 16
    case WeightFormat::kMxfp4:
      return routed_expert ? 0.5 + 1.0 / 32 : 1.0 + 1.0 / 32;  // e2m1 + an E8M0 per 32
  }
  return 2.0;
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kMxfp8:
      return "mxfp8";
    case WeightFormat::kFp8PerChannel:
      return "fp8_per_channel";
    case WeightFormat::kNvfp4:
      return "nvfp4";
    case WeightFormat::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

bool parse_weight_format(const std::string& s, WeightFormat& out) {
  std::string v;
  for (char c : s) v += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v.empty() || v == "none" || v == "auto" || v == "bf16" || v == "bfloat16") {
    out = WeightFormat::kBf16;
  } else if (v == "mxfp8" || v == "fp8") {
    out = WeightFormat::kMxfp8;
  } else if (v == "fp8_per_channel" || v == "ptpc_fp8") {
    out = WeightFormat::kFp8PerChannel;
  } else if (v == "nvfp4" || v == "modelopt_fp4" || v == "modelopt") {
    out = WeightFormat::kNvfp4;
  } else if (v == "mxfp4" || v == "quark") {
    out = WeightFormat::kMxfp4;
  } else {
    return false;
  }
  return true;
}

int64_t weight_bytes(const model::M3Config& cfg, const model::ShardPlan& plan,
                     WeightFormat format) {
  double bytes = 0;
  for (const model::TensorSpec& t : model::m3_tensors(cfg)) {
    if (t.may_tie && cfg.tie_word_embeddings) continue;  // the embedding's view, counted once
    const model::TensorBlock b = model::shard_block(t, cfg, plan);
    const double n = static_cast<double>(b.size());
    if (t.synthetic_dtype == DType::kF32) {
      bytes += 4 * n;  // router weight and bias stay f32 in every format
    } else if (t.vector || is_embedding_or_head(t)) {
      bytes += 2 * n;  // norms, embedding and lm_head stay bf16
    } else {
      bytes += n * linear_bytes_per_element(format, t.experts > 0, t.cols);
    }
  }
  return static_cast<int64_t>(std::llround(bytes));
}

Result<std::vector<StrategyPlan>> plan_deployment(const model::M3Config& cfg, const PlanInput& in) {
  if (in.gpus < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--gpus " + std::to_string(in.gpus) + ": give at least 1", "--gpus");
  }
  std::vector<StrategyPlan> out;
  const int64_t bs = cfg.sparse_block_size;
  for (Strategy s : {Strategy::kTp, Strategy::kTpEp, Strategy::kDpEp}) {
    StrategyPlan p;
    p.strategy = s;
    const std::string n = std::to_string(in.gpus);
    model::ShardSpec spec;
    spec.world = in.gpus;
    spec.expert_parallel = s != Strategy::kTp;
    spec.data_parallel = s == Strategy::kDpEp;
    if (s == Strategy::kTp) {
      p.name = "TP" + n;
      p.launch = in.gpus > 1 ? "--tensor-parallel-size " + n : "";
    } else if (s == Strategy::kTpEp) {
      p.name = "TP" + n + " + EP";
      p.launch = "--tensor-parallel-size " + n + " --enable-expert-parallel";
    } else {
      p.name = "DP" + n + " + EP";
      p.launch = "--data-parallel-size " + n + " --enable-expert-parallel";
    }
    if (in.gpus == 1 && s != Strategy::kTp) continue;  // one GPU: one strategy
    // A shard plan for every rank validates the split; rank 0 stands for all (their byte
    // counts differ by at most a vocabulary chunk).
    auto plan = model::make_shard_plan(cfg, spec);
    if (!plan) return tl::unexpected(plan.error());
    p.weights_stored_gib = static_cast<double>(weight_bytes(cfg, *plan, in.stored)) / kGiB;
    // The GPU holds quantized linears as stored (M3ModelCuda::upload_weights); M3's
    // tensor-parallel column splits lie on the block grid, so a rank holds its slice as stored.
    p.weights_served_gib = p.weights_stored_gib;
    const double left = in.gpu_memory_gib - in.reserve_gib - p.weights_served_gib;
    p.weights_fit = left > 0;
    p.kv_gib = p.weights_fit ? left * in.gpu_memory_utilization : 0.0;
    const int64_t page_bytes = model::KvCache::page_bytes(cfg, plan->num_kv_heads);
    p.kv_bytes_per_token = page_bytes / bs;
    const int64_t pages = static_cast<int64_t>(p.kv_gib * kGiB / static_cast<double>(page_bytes));
    p.tokens_per_gpu = pages * bs;
    p.tokens_total = s == Strategy::kDpEp ? p.tokens_per_gpu * in.gpus : p.tokens_per_gpu;
    p.max_model_len = std::min<int64_t>(p.tokens_per_gpu, cfg.max_position_embeddings);
    if (in.max_model_len > 0)
      p.requested_fits = p.weights_fit && in.max_model_len <= p.max_model_len;
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace m3::app
