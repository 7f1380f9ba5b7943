// What `--model` / MODEL_DIR names for serve, chat and generate: a checkpoint directory or a
// synthetic model (`synthetic:layers=N[,seed=S]`, model/synthetic_model.h), plus the directory the
// tokenizer, chat template and generation defaults come from (`--tokenizer DIR`, vLLM's flag;
// for a synthetic model the demo model's). Pure (no model is read), so tests/unit/model
// covers it on the CPU. Invariant: a resolved synthetic choice always has device "cuda".
#pragma once

#include <string>

#include "core/error.h"
#include "model/synthetic_model.h"

namespace m3::app {

struct ModelChoice {
  std::string model;  // as given: a directory or the synthetic spec
  bool synthetic = false;
  model::SyntheticSpec spec;  // when synthetic
  std::string tokenizer_dir;  // tokenizer.json (+ chat template, generation_config.json)
};

// `model` non-empty; `tokenizer_flag` is --tokenizer ("" when not given); `demo_dir` is the
// embedded demo model ("" when none was found). Errors (each one line naming the flag): a bad
// synthetic spec, a synthetic model with a device other than cuda, no tokenizer directory for a
// synthetic model, a tokenizer directory without tokenizer.json.
Result<ModelChoice> resolve_model(const std::string& model, const std::string& tokenizer_flag,
                                  const std::string& device, const std::string& demo_dir);

}  // namespace m3::app
