// Shared by the CPU and GPU model tests: where the transformers goldens live, how to read them,
// and the tolerances (derived in tests/model/model_golden_test.cpp) both must meet.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"

namespace m3::model::golden {

// Logprobs against transformers (derivation in model_golden_test.cpp).
constexpr double kLogprobTol = 2e-3;
// Greedy steps whose golden top-2 logit margin is below this may legitimately flip.
constexpr double kGreedyMarginFloor = 4e-3;
// MSA block choices whose k-th vs (k+1)-th block-score margin is below this may flip.
constexpr double kMsaMarginFloor = 3e-4;

inline std::string root() { return std::string(M3_SOURCE_DIR) + "/tests/golden/model"; }

// Names of the golden model directories (those with a golden.json), sorted.
inline std::vector<std::string> names() {
  namespace fs = std::filesystem;
  std::vector<std::string> r;
  if (!fs::exists(root())) return r;
  for (const auto& e : fs::directory_iterator(root()))
    if (fs::exists(e.path() / "golden.json")) r.push_back(e.path().filename().string());
  std::sort(r.begin(), r.end());
  return r;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

inline std::vector<float> log_softmax_rows(const std::vector<float>& logits, int64_t vocab) {
  std::vector<float> out(logits.size());
  kernels::cpu::log_softmax(logits.data(), static_cast<int64_t>(logits.size()) / vocab, vocab,
                            out.data());
  return out;
}

}  // namespace m3::model::golden
