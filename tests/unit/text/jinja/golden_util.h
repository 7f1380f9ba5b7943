// Shared helpers for the text_jinja tests: loading the jinja2/transformers goldens made by
// tools/goldens/make_template_goldens.py. Invariant: paths come from M3_SOURCE_DIR only.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace m3::text::test {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string golden_dir() {
  return std::string(M3_SOURCE_DIR) + "/tests/golden/text/templates";
}

inline const nlohmann::ordered_json& goldens() {
  static const nlohmann::ordered_json g =
      nlohmann::ordered_json::parse(read_text(golden_dir() + "/goldens.json"));
  return g;
}

// The Qwen3 tokenizer fixture (real-world template); tests skip its cases when it is absent.
inline std::string qwen3_dir() {
  const char* env = std::getenv("M3_QWEN3_FIXTURE");
  return env ? env : "/work/shared/fixtures/qwen3-tokenizer";
}

}  // namespace m3::text::test
