#include "app/model_choice.h"

#include <filesystem>

namespace m3::app {

Result<ModelChoice> resolve_model(const std::string& model, const std::string& tokenizer_flag,
                                  const std::string& device, const std::string& demo_dir) {
  ModelChoice c;
  c.model = model;
  c.synthetic = model::is_synthetic_model(model);
  if (c.synthetic) {
    M3_TRY(c.spec, model::parse_synthetic_spec(model));
    if (device != "cuda") {
      return make_error(ErrorCode::kUnsupported, model::synthetic_needs_cuda_message(model),
                        "--device");
    }
    c.tokenizer_dir = tokenizer_flag.empty() ? demo_dir : tokenizer_flag;
    if (c.tokenizer_dir.empty()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--model " + model +
                            " has no tokenizer and the demo model (whose tokenizer it uses by "
                            "default) was not found; pass --tokenizer DIR (a directory with "
                            "tokenizer.json) or set $M3SERVE_MODELS_DIR",
                        "--tokenizer");
    }
  } else {
    c.tokenizer_dir = tokenizer_flag.empty() ? model : tokenizer_flag;
  }
  if (!tokenizer_flag.empty() &&
      !std::filesystem::exists(std::filesystem::path(tokenizer_flag) / "tokenizer.json")) {
    return make_error(ErrorCode::kNotFound,
                      "--tokenizer " + tokenizer_flag +
                          " has no tokenizer.json; give a model directory that has one",
                      "--tokenizer");
  }
  return c;
}

}  // namespace m3::app
