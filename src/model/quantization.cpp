#include "model/quantization.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>

namespace m3::model {

namespace {

using json = nlohmann::json;
using kernels::WeightQuant;

json read_json_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) return json();
  return json::parse(f, nullptr, false);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The checkpoint methods m3serve reads.
bool known_method(const std::string& m) {
  return m.empty() || m == "mxfp8" || m == "modelopt" || m == "quark" || m == "compressed-tensors";
}

// The checkpoint methods a --quantization value names (empty: fp8_per_channel / none).
std::vector<std::string> methods_of_flag(const std::string& v) {
  if (v == "mxfp8" || v == "fp8") return {"mxfp8"};
  if (v == "modelopt" || v == "modelopt_fp4" || v == "modelopt_mixed") return {"modelopt"};
  if (v == "nvfp4") return {"modelopt", "compressed-tensors"};
  if (v == "quark") return {"quark"};
  if (v == "mxfp4") return {"quark", "compressed-tensors"};
  if (v == "compressed-tensors" || v == "compressed_tensors") return {"compressed-tensors"};
  return {};
}

}  // namespace

CheckpointQuant read_checkpoint_quant(const std::string& model_dir) {
  namespace fs = std::filesystem;
  CheckpointQuant q;
  const json cfg = read_json_file(fs::path(model_dir) / "config.json");
  if (cfg.is_object()) {
    for (const json* node : {&cfg, cfg.contains("text_config") ? &cfg["text_config"] : nullptr}) {
      if (node == nullptr || !node->is_object() || !node->contains("quantization_config")) continue;
      const json& qc = (*node)["quantization_config"];
      if (!qc.is_object()) continue;
      if (qc.contains("quant_method") && qc["quant_method"].is_string()) {
        q.method = lower(qc["quant_method"].get<std::string>());
        q.source = std::string("config.json ") + (node == &cfg ? "" : "text_config.") +
                   "quantization_config";
        if (q.method == "compressed_tensors") q.method = "compressed-tensors";
        break;
      }
    }
  }
  // ModelOpt writes hf_quant_config.json ({"quantization": {"quant_algo": "NVFP4" |
  // "MIXED_PRECISION", ...}}) and may also write quant_method "modelopt" into config.json.
  const json mo = read_json_file(fs::path(model_dir) / "hf_quant_config.json");
  if (mo.is_object() && (q.method.empty() || q.method == "modelopt")) {
    q.method = "modelopt";
    if (q.source.empty()) q.source = "hf_quant_config.json";
  }
  return q;
}

bool is_quantization_value(const std::string& v) {
  const std::string l = lower(v);
  return l.empty() || l == "none" || l == "auto" || l == "fp8_per_channel" ||
         !methods_of_flag(l).empty();
}

Result<QuantPlan> resolve_quantization(const std::string& flag, const CheckpointQuant& ckpt) {
  QuantPlan plan;
  plan.checkpoint = ckpt;
  const std::string v = lower(flag);
  const std::string declared = ckpt.method.empty() ? std::string("none (a bf16 checkpoint)")
                                                   : "'" + ckpt.method + "' (" + ckpt.source + ")";
  if (!known_method(ckpt.method)) {
    return make_error(
        ErrorCode::kUnsupported,
        "the checkpoint's quantization method '" + ckpt.method + "' (" + ckpt.source +
            ") is not supported; m3serve reads bf16 checkpoints and the mxfp8, "
            "modelopt (NVFP4), quark (MXFP4) and compressed-tensors (MXFP4, NVFP4, MXFP8, "
            "fp8 per channel) ones",
        "--quantization");
  }
  if (v.empty() || v == "none" || v == "auto") return plan;
  if (v == "fp8_per_channel") {
    if (!ckpt.method.empty()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--quantization fp8_per_channel quantizes a bf16 checkpoint at load, but "
                        "this checkpoint is already quantized: quant_method " +
                            declared + "; drop --quantization",
                        "--quantization");
    }
    plan.online_fp8_per_channel = true;
    return plan;
  }
  const std::vector<std::string> methods = methods_of_flag(v);
  if (methods.empty()) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "--quantization '" + flag + "' is unknown; accepted: " + std::string(kQuantizationValues),
        "--quantization");
  }
  if (std::find(methods.begin(), methods.end(), ckpt.method) == methods.end()) {
    std::string fix = ckpt.method.empty()
                          ? "drop --quantization, or use --quantization fp8_per_channel to "
                            "quantize this bf16 checkpoint at load"
                          : "drop --quantization (the checkpoint's own is used)";
    return make_error(ErrorCode::kInvalidArgument,
                      "--quantization " + flag + " does not match the checkpoint: quant_method " +
                          declared + "; " + fix,
                      "--quantization");
  }
  return plan;
}

bool method_allows(const std::string& method, WeightQuant q) {
  if (q == WeightQuant::kNone || method.empty()) return true;
  if (method == "mxfp8") return q == WeightQuant::kMxfp8;
  if (method == "modelopt") return q == WeightQuant::kNvfp4 || q == WeightQuant::kMxfp8;
  if (method == "quark") return q == WeightQuant::kMxfp4 || q == WeightQuant::kMxfp8;
  if (method == "compressed-tensors")
    return q == WeightQuant::kMxfp4 || q == WeightQuant::kNvfp4 || q == WeightQuant::kMxfp8 ||
           q == WeightQuant::kFp8Channel;
  return false;
}

}  // namespace m3::model
