// Quantized checkpoints and `--quantization` (docs/QUANTIZATION.md): what a checkpoint declares
// (config.json's quantization_config, ModelOpt's hf_quant_config.json), whether the flag matches
// it, and which per-tensor formats (kernels/views.h WeightQuant) each method may contain.
// Called by M3Model::load before any tensor is read, and by load_weights per tensor.
// Invariant: a method that resolve_quantization accepts is one load_weights can read; every
// refusal names the flag's value, the checkpoint's method and what to do.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/views.h"

namespace m3::model {

// The quantization a checkpoint directory declares.
struct CheckpointQuant {
  // "" (none: a bf16/f32 checkpoint), "mxfp8", "modelopt" (NVFP4, or ModelOpt MIXED_PRECISION:
  // NVFP4 experts + MXFP8 elsewhere), "quark" (AMD Quark MXFP4), "compressed-tensors", or any
  // other method name as written (refused by resolve_quantization).
  std::string method;
  std::string source;  // where it was read: "config.json quantization_config", ...
  // compressed-tensors' config_groups, as declared: the group's name, its format (the group's
  // own, else the config's), and its weights' type ("float" / "int"), num_bits, strategy and
  // group_size (0 when absent). resolve_quantization refuses the schemes m3serve cannot read.
  struct Group {
    std::string name, format, type, strategy;
    int num_bits = 0, group_size = 0;
    bool activations = false;  // declares quantized input activations (W4A4 / W8A8)
  };
  std::vector<Group> groups;
};

// Reads config.json (top level, or text_config) and hf_quant_config.json of `model_dir`. A
// missing or unreadable file counts as no declaration (load_config reports bad JSON).
CheckpointQuant read_checkpoint_quant(const std::string& model_dir);

// What load_weights does with the checkpoint's linears.
struct QuantPlan {
  CheckpointQuant checkpoint;
  bool online_fp8_per_channel = false;  // --quantization fp8_per_channel of a bf16 checkpoint
};

// The --quantization values accepted, for messages and --help.
inline constexpr const char* kQuantizationValues =
    "none, fp8_per_channel, mxfp8, fp8, modelopt, modelopt_fp4, nvfp4, quark, mxfp4, "
    "compressed-tensors";

// Whether `v` is one of kQuantizationValues (case-insensitive; "" and "auto" too).
bool is_quantization_value(const std::string& v);

// `flag` is --quantization's value ("" or none/auto: read the checkpoint as it is). Errors: an
// unknown value (naming the accepted ones), a value that does not match the checkpoint's
// declaration (naming both), fp8_per_channel of an already quantized checkpoint, and a
// checkpoint method m3serve cannot read (naming the ones it can), and a compressed-tensors group
// whose scheme it cannot read (naming the group, its scheme and the schemes it reads).
Result<QuantPlan> resolve_quantization(const std::string& flag, const CheckpointQuant& ckpt);

// Whether a tensor stored in `q` may appear in a checkpoint declaring `method` ("" allows every
// format the tensors' dtypes identify).
bool method_allows(const std::string& method, kernels::WeightQuant q);

}  // namespace m3::model
