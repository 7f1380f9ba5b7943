#include "model/config_overrides.h"

#include <mutex>

#include <nlohmann/json.hpp>

namespace m3::model {
namespace {

using json = nlohmann::ordered_json;  // keeps the file's key order in what we hand the parser

std::mutex g_mu;
std::string g_override;  // compact JSON object text, or ""

// RFC 7386-like, except that null is a value (a config key set to null) rather than a deletion:
// vLLM's hf_overrides updates the config recursively and sets what it is given.
void merge_into(json& dst, const json& src) {
  for (auto it = src.begin(); it != src.end(); ++it) {
    auto d = dst.find(it.key());
    if (d != dst.end() && d->is_object() && it.value().is_object()) {
      merge_into(*d, it.value());
    } else {
      dst[it.key()] = it.value();
    }
  }
}

Result<json> parse_override(std::string_view text) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--hf-overrides must be a JSON object, e.g. '{\"text_config\": "
                      "{\"max_position_embeddings\": 1048576}}'; got: " +
                          std::string(text.substr(0, 200)),
                      "--hf-overrides");
  }
  return j;
}

}  // namespace

Status set_config_overrides(std::string_view json_text) {
  std::string compact;
  if (!json_text.empty()) {
    M3_TRY(json j, parse_override(json_text));
    if (!j.empty()) compact = j.dump();
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_override = std::move(compact);
  return {};
}

std::string config_overrides() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_override;
}

Result<std::string> merge_config_json(std::string_view config_text, std::string_view override_text,
                                      std::string_view source) {
  if (override_text.empty()) return std::string(config_text);
  M3_TRY(json over, parse_override(override_text));
  json root = json::parse(config_text.begin(), config_text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object()) {
    return make_error(ErrorCode::kFormat, std::string(source) +
                                              " is not a JSON object, so --hf-overrides cannot be "
                                              "merged into it");
  }
  merge_into(root, over);
  return root.dump();
}

Result<std::string> apply_config_overrides(std::string_view config_text, std::string_view source) {
  return merge_config_json(config_text, config_overrides(), source);
}

}  // namespace m3::model
