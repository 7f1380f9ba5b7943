// Shared fixtures for the tokenizer tests: loads goldens.json (made by
// tools/goldens/make_tokenizer_goldens.py with HF tokenizers) and the tokenizers it names, once
// per process. Suites marked "optional" (the Qwen3 tokenizer under ../shared/fixtures) are
// skipped by the tests when their file is absent.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

namespace m3::text::testing {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline const nlohmann::json& goldens() {
  static const nlohmann::json g = [] {
    const std::string text =
        read_file(std::string(M3_SOURCE_DIR) + "/tests/golden/text/tokenizer/goldens.json");
    return nlohmann::json::parse(text);
  }();
  return g;
}

inline std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// The input string of an encode case (valid text, or raw bytes given in hex).
inline std::string case_input(const nlohmann::json& c) {
  return c.contains("bytes_hex") ? from_hex(c["bytes_hex"].get<std::string>())
                                 : c["text"].get<std::string>();
}

// Loads the suite's tokenizer (applying its JSON patch). Returns nullptr if an optional
// tokenizer file is missing; fails the test on any load error.
inline std::shared_ptr<const Tokenizer> load_suite_tokenizer(const nlohmann::json& suite) {
  static std::map<std::string, std::shared_ptr<const Tokenizer>> cache;
  const std::string name = suite["name"].get<std::string>();
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const std::string path = std::string(M3_SOURCE_DIR) + "/" + suite["tokenizer"].get<std::string>();
  std::ifstream probe(path);
  if (!probe) {
    EXPECT_TRUE(suite.value("optional", false)) << "missing tokenizer " << path;
    return nullptr;
  }
  nlohmann::json j = nlohmann::json::parse(read_file(path));
  if (suite.contains("patch")) {
    for (const auto& [key, value] : suite["patch"].items()) {
      if (key.rfind("model.", 0) == 0) {
        j["model"][key.substr(6)] = value;
      } else {
        j[key] = value;
      }
    }
  }
  auto tok = Tokenizer::from_json_text(j.dump());
  EXPECT_TRUE(tok.has_value()) << name << ": " << (tok ? "" : tok.error().message);
  std::shared_ptr<const Tokenizer> t = tok ? *tok : nullptr;
  cache[name] = t;
  return t;
}

inline std::vector<int32_t> ids_of(const nlohmann::json& arr) {
  return arr.get<std::vector<int32_t>>();
}

}  // namespace m3::text::testing
