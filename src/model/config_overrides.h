// `--hf-overrides` (vLLM's flag): a JSON object merged into config.json's object before it is
// parsed, so the override reaches every reader of the config (block size, max length, RoPE).
// Set once by the app (app/cmd_serve.cpp, cmd_chat.cpp) before the model loads; load_config
// applies it. Invariant: objects merge key by key (recursively), any other value replaces the
// one in the file; an empty override leaves the file's text untouched.
#pragma once

#include <string>
#include <string_view>

#include "core/error.h"

namespace m3::model {

// Checks that `json_text` is a JSON object and stores it for every later load_config (the
// process serves one model). An empty string clears it. Errors name --hf-overrides.
Status set_config_overrides(std::string_view json_text);
// The stored override as compact JSON ("" when none).
std::string config_overrides();

// config.json text with the stored override merged in (the text unchanged when there is none).
// `source` names the file in errors (a config.json that is not a JSON object).
Result<std::string> apply_config_overrides(std::string_view config_text, std::string_view source);
// The same merge with an explicit override (tests, and the app's own look at the config).
Result<std::string> merge_config_json(std::string_view config_text, std::string_view override_text,
                                      std::string_view source);

}  // namespace m3::model
