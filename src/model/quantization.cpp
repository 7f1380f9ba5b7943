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

// Why m3serve cannot read a compressed-tensors group ("" when it can): the schemes it reads are
// the ones whose tensors load_weights knows (docs/QUANTIZATION.md).
std::string unreadable_group(const CheckpointQuant::Group& g) {
  const std::string& f = g.format;
  const bool fp = g.type.empty() || g.type == "float";
  if (f == "mxfp4-pack-quantized" && fp && g.num_bits == 4 && g.group_size == 32) return "";
  if (f == "nvfp4-pack-quantized" && fp && g.num_bits == 4 && g.group_size == 16) return "";
  if (f == "mxfp8-quantized" && fp && g.num_bits == 8 && g.group_size == 32) return "";
  if (f == "float-quantized" && fp && g.num_bits == 8 &&
      (g.strategy == "channel" || (g.strategy == "group" && g.group_size == 32)))
    return "";
  if (f == "dense") return "";  // stored unquantized
  // No format of its own (older configs, or a mixed-precision config without per-group ones):
  // the weights' scheme decides, and load_weights identifies each tensor's form.
  if ((f.empty() || f == "mixed-precision") && fp &&
      ((g.num_bits == 4 && (g.group_size == 32 || g.group_size == 16)) ||
       (g.num_bits == 8 && (g.strategy == "channel" || g.group_size == 32))))
    return "";
  if (!fp || f == "int-quantized" || f == "pack-quantized")
    return "integer weights (W" + std::to_string(g.num_bits) +
           "A16 / W8A8 int schemes) are not read";
  if (f == "float-quantized" && g.strategy == "block")
    return "fp8 with 2-D block scales is not read (the per-output-channel and 1x32 forms are)";
  if (f == "float-quantized" && g.strategy == "tensor")
    return "fp8 with one per-tensor scale is not read (serve the bf16 checkpoint with "
           "--quantization fp8_per_channel instead)";
  return "this scheme is not one m3serve reads";
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
        if (q.method == "compressed-tensors" && qc.contains("config_groups") &&
            qc["config_groups"].is_object()) {
          const std::string top = qc.value("format", std::string());
          for (const auto& [name, g] : qc["config_groups"].items()) {
            CheckpointQuant::Group grp;
            grp.name = name;
            grp.format = g.is_object() && g.contains("format") && g["format"].is_string()
                             ? g["format"].get<std::string>()
                             : top;
            const json w = g.is_object() && g.contains("weights") ? g["weights"] : json();
            if (w.is_object()) {
              grp.type = w.value("type", std::string());
              grp.strategy = w.value("strategy", std::string());
              if (w.contains("num_bits") && w["num_bits"].is_number_integer())
                grp.num_bits = w["num_bits"].get<int>();
              if (w.contains("group_size") && w["group_size"].is_number_integer())
                grp.group_size = w["group_size"].get<int>();
            }
            grp.activations = g.is_object() && g.contains("input_activations") &&
                              g["input_activations"].is_object();
            q.groups.push_back(std::move(grp));
          }
        }
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
  for (const CheckpointQuant::Group& g : ckpt.groups) {
    const std::string why = unreadable_group(g);
    if (why.empty()) continue;
    return make_error(
        ErrorCode::kUnsupported,
        "the checkpoint's compressed-tensors group '" + g.name + "' (" + ckpt.source +
            ") has format '" + g.format + "' with " + (g.type.empty() ? "?" : g.type) + " " +
            std::to_string(g.num_bits) + "-bit weights, strategy '" + g.strategy +
            "', group_size " + std::to_string(g.group_size) + ": " + why +
            "; m3serve reads mxfp4-pack-quantized (group 32), nvfp4-pack-quantized (group 16), "
            "mxfp8-quantized (group 32) and float-quantized fp8 per channel: serve one of those, "
            "or the bf16 checkpoint (with --quantization fp8_per_channel for fp8 weights)",
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
