// `m3serve plan [MODEL_OR_VARIANT] --gpus N [--max-model-len L] [--kv-cache-dtype D]
// [--quantization Q]`: the memory arithmetic of a deployment before launching it (issue #21,
// item 5): weights per GPU for TP, TP + EP and DP + EP, KV bytes per token, the tokens that fit,
// the largest --max-model-len, and the `m3serve serve` command of each. Reads only config.json
// (or M3's built-in geometry for a known variant name); no weights, no GPU.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "app/deploy_plan.h"
#include "app/device_backend.h"
#include "app/vllm_flags.h"
#include "model/config.h"
#include "model/synthetic_model.h"

namespace m3::app {

namespace {

struct PlanArgs {
  std::string model = "MiniMaxAI/MiniMax-M3";
  int gpus = 8;
  double gpu_memory_gib = 140.0;
  double gpu_memory_utilization = 0.9;
  std::string max_model_len;
  std::string kv_cache_dtype = "auto";
  std::string index_kv_dtype = "auto";
  std::string quantization;
};

// Published MiniMax-M3 checkpoints and the format their weights are stored in (m3-model.md
// §2.6-2.8). Their geometry is M3's (model/synthetic_model.h).
struct Variant {
  const char* name;
  WeightFormat format;
};
constexpr Variant kVariants[] = {
    {"MiniMaxAI/MiniMax-M3", WeightFormat::kBf16},
    {"MiniMaxAI/MiniMax-M3-MXFP8", WeightFormat::kMxfp8},
    {"nvidia/MiniMax-M3-NVFP4", WeightFormat::kNvfp4},
    {"Mapika/MiniMax-M3-NVFP4", WeightFormat::kNvfp4},
    {"amd/MiniMax-M3-MXFP4", WeightFormat::kMxfp4},
    {"olka-fi/MiniMax-M3-MXFP4", WeightFormat::kMxfp4},
};

// The stored format a checkpoint directory declares (config.json's quantization_config, or
// ModelOpt's hf_quant_config.json), bf16 when none.
WeightFormat stored_format(const std::string& dir) {
  namespace fs = std::filesystem;
  auto read = [](const fs::path& p) {
    std::ifstream f(p);
    return f ? nlohmann::json::parse(f, nullptr, false) : nlohmann::json();
  };
  WeightFormat f = WeightFormat::kBf16;
  const auto cfg = read(fs::path(dir) / "config.json");
  if (cfg.is_object() && cfg.contains("quantization_config") &&
      cfg["quantization_config"].is_object()) {
    const auto& q = cfg["quantization_config"];
    if (q.contains("quant_method") && q["quant_method"].is_string())
      parse_weight_format(q["quant_method"].get<std::string>(), f);
  }
  const auto mo = read(fs::path(dir) / "hf_quant_config.json");
  if (mo.is_object()) f = WeightFormat::kNvfp4;  // ModelOpt: NVFP4 experts, MXFP8 elsewhere
  return f;
}

kernels::KvDtype kv_dtype_of(const std::string& v, kernels::KvDtype automatic) {
  if (v == "bfloat16") return kernels::KvDtype::kBf16;
  if (v == "fp8_e4m3") return kernels::KvDtype::kFp8;
  if (v == "float32") return kernels::KvDtype::kF32;
  return automatic;
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

int run_plan(const PlanArgs& a) {
  auto max_len = parse_max_model_len(a.max_model_len.empty() ? "0" : a.max_model_len);
  if (!max_len) return fail(max_len.error().message);
  if (a.gpu_memory_utilization <= 0 || a.gpu_memory_utilization > 1)
    return fail("--gpu-memory-utilization must be in (0, 1]");
  if (a.gpu_memory_gib <= 0) return fail("--gpu-memory-gib must be positive");
  WeightFormat stored = WeightFormat::kBf16;
  model::M3Config cfg;
  std::string shown = a.model;
  bool known = false;
  for (const Variant& v : kVariants) {
    if (a.model == v.name) {
      cfg = model::synthetic_m3_config(model::kSyntheticMaxLayers);
      cfg.model_type = "minimax_m3_vl";
      stored = v.format;
      known = true;
    }
  }
  if (!known) {
    if (model::is_synthetic_model(a.model)) {
      auto spec = model::parse_synthetic_spec(a.model);
      if (!spec) return fail(spec.error().message);
      cfg = model::synthetic_m3_config(spec->layers);
      switch (spec->weights) {  // weights=F is the stored format (model/synthetic_model.h)
        case kernels::WeightQuant::kNone:
          break;
        case kernels::WeightQuant::kFp8Channel:
          stored = WeightFormat::kFp8PerChannel;
          break;
        case kernels::WeightQuant::kMxfp8:
          stored = WeightFormat::kMxfp8;
          break;
        case kernels::WeightQuant::kNvfp4:
          stored = WeightFormat::kNvfp4;
          break;
        case kernels::WeightQuant::kMxfp4:
          stored = WeightFormat::kMxfp4;
          break;
      }
    } else if (std::filesystem::is_directory(a.model)) {
      auto c = model::load_config(a.model);
      if (!c) return fail(c.error().message);
      cfg = *c;
      stored = stored_format(a.model);
    } else {
      std::string names;
      for (const Variant& v : kVariants) names += std::string(names.empty() ? "" : ", ") + v.name;
      return fail("'" + a.model + "' is neither a model directory, a synthetic:layers=N spec nor " +
                  "a known variant (" + names + ")");
    }
  }
  if (!a.quantization.empty() && !parse_weight_format(a.quantization, stored)) {
    return fail("--quantization '" + a.quantization +
                "' is unknown; use none, mxfp8, fp8_per_channel, nvfp4 or mxfp4");
  }
  // The GPU's formats: auto = bf16 (the serving default), the index-K following the KV except
  // under fp8 (app/device_backend.h resolve_kv_format).
  cfg.kv_cache_dtype = kv_dtype_of(a.kv_cache_dtype, kernels::KvDtype::kBf16);
  cfg.index_cache_dtype = kv_dtype_of(a.index_kv_dtype, cfg.kv_cache_dtype == kernels::KvDtype::kFp8
                                                            ? kernels::KvDtype::kBf16
                                                            : cfg.kv_cache_dtype);

  PlanInput in;
  in.gpus = a.gpus;
  in.gpu_memory_gib = a.gpu_memory_gib;
  in.gpu_memory_utilization = a.gpu_memory_utilization;
  in.max_model_len = *max_len;
  in.stored = stored;
  auto plans = plan_deployment(cfg, in);
  if (!plans) return fail(plans.error().message);

  std::printf("%s: %s\n", shown.c_str(), cfg.summary().c_str());
  std::printf(
      "weights stored as %s; KV cache %s, index-K %s; %d GPU(s) of %.1f GiB, "
      "--gpu-memory-utilization %.2f of what the weights leave (%.1f GiB kept for "
      "context and workspaces)\n\n",
      weight_format_name(stored), kernels::kv_dtype_name(cfg.kv_cache_dtype),
      kernels::kv_dtype_name(cfg.index_cache_dtype), a.gpus, a.gpu_memory_gib,
      a.gpu_memory_utilization, in.reserve_gib);
  std::printf("%-12s %12s %12s %10s %12s %14s %14s %14s\n", "strategy", "weights/GPU", "served/GPU",
              "KV GiB", "KV B/token", "tokens/GPU", "tokens total", "max-model-len");
  for (const StrategyPlan& p : *plans) {
    std::printf("%-12s %9.1f GiB %9.1f GiB %10.1f %12s %14s %14s %14s\n", p.name.c_str(),
                p.weights_stored_gib, p.weights_served_gib, p.kv_gib,
                with_commas(p.kv_bytes_per_token).c_str(), with_commas(p.tokens_per_gpu).c_str(),
                with_commas(p.tokens_total).c_str(),
                p.weights_fit ? with_commas(p.max_model_len).c_str() : "weights do not fit");
  }
  std::printf("\n");
  const std::string kv_flag =
      a.kv_cache_dtype == "auto" ? "" : " --kv-cache-dtype " + a.kv_cache_dtype;
  const std::string ik_flag =
      a.index_kv_dtype == "auto" ? "" : " --attention_config.indexer_kv_dtype " + a.index_kv_dtype;
  bool any = false;
  for (const StrategyPlan& p : *plans) {
    if (!p.weights_fit) continue;
    const int64_t len = *max_len > 0 ? *max_len : p.max_model_len;
    std::printf(
        "%s%s: m3serve serve %s %s --block-size 128%s%s --max-model-len %lld "
        "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 "
        "--enable-auto-tool-choice\n",
        p.name.c_str(), p.requested_fits ? "" : " (DOES NOT FIT the --max-model-len asked)",
        shown.c_str(), p.launch.c_str(), kv_flag.c_str(), ik_flag.c_str(),
        static_cast<long long>(len));
    any = any || p.requested_fits;
  }
  if (!any) {
    std::printf(
        "no strategy fits: more GPUs, --kv-cache-dtype fp8, a shorter --max-model-len or a "
        "lower precision of the weights (--quantization fp8_per_channel, an MXFP8 / NVFP4 / MXFP4 "
        "checkpoint) would\n");
    return 2;
  }
  return 0;
}

}  // namespace

RunFn register_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan",
      "Print a deployment's memory arithmetic (weights and KV per GPU, tokens that fit, "
      "the largest --max-model-len) and its launch commands");
  sub->add_option("model", a->model,
                  "A model directory, synthetic:layers=N, or a known variant "
                  "(MiniMaxAI/MiniMax-M3, MiniMaxAI/MiniMax-M3-MXFP8, nvidia/MiniMax-M3-NVFP4, "
                  "amd/MiniMax-M3-MXFP4, ...)")
      ->capture_default_str();
  sub->add_option("--gpus", a->gpus, "GPUs of the deployment")->capture_default_str();
  sub->add_option("--gpu-memory-gib", a->gpu_memory_gib, "Memory of one GPU (H200: 140)")
      ->capture_default_str();
  sub->add_option("--gpu-memory-utilization", a->gpu_memory_utilization,
                  "Fraction of the memory left after the weights that the KV cache takes")
      ->capture_default_str();
  sub->add_option("--max-model-len", a->max_model_len,
                  "Check this length fits (128k, 1M, ...); default: report the largest");
  sub->add_option("--quantization,-q", a->quantization,
                  "The checkpoint's weight format (none, mxfp8, fp8_per_channel, nvfp4, mxfp4); "
                  "default: the variant's or the directory's config");
  add_kv_dtype_options(sub, a->kv_cache_dtype, a->index_kv_dtype);
  return [a] { return run_plan(*a); };
}

}  // namespace m3::app
