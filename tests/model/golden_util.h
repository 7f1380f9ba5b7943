// Shared by the CPU and GPU model tests: where the transformers goldens live, how to read them,
// and the tolerances (derived in tests/model/model_golden_test.cpp) both must meet.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/config.h"

namespace m3::model::golden {

// Logprobs against transformers (derivation in model_golden_test.cpp).
constexpr double kLogprobTol = 2e-3;
// Greedy steps whose golden top-2 logit margin is below this may legitimately flip.
constexpr double kGreedyMarginFloor = 4e-3;

// Tokens of a golden case's greedy continuation before its first recorded near-tie (a margin
// below kGreedyMarginFloor): what two correct implementations must generate alike.
inline size_t greedy_tokens_before_near_tie(const nlohmann::json& c) {
  const auto margin = c["greedy_margin"].get<std::vector<double>>();
  size_t n = 0;
  while (n < margin.size() && margin[n] >= kGreedyMarginFloor) ++n;
  return n;
}
// MSA block choices whose k-th vs (k+1)-th block-score margin is below this may flip.
constexpr double kMsaMarginFloor = 3e-4;

inline std::string root() {
  return std::string(M3_SOURCE_DIR) + "/tests/golden/model";
}

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

// The longest prompt of a golden set.
inline std::vector<int32_t> longest_prompt(const nlohmann::json& g) {
  std::vector<int32_t> best;
  for (const auto& c : g["cases"]) {
    auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
    if (ids.size() > best.size()) best = ids;
  }
  return best;
}

// The blocks KV head h of position p selected ([T, nkv, k] rows, -1 padded), as a set.
inline std::set<int32_t> selected_blocks(const std::vector<int32_t>& sel, int64_t p, int64_t h,
                                         int64_t nkv, int64_t k) {
  std::set<int32_t> out;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t b = sel[(p * nkv + h) * k + j];
    if (b >= 0) out.insert(b);
  }
  return out;
}

// Golden case `c`'s recorded MSA selections against `msa_blocks` (ForwardResult::msa_blocks of
// its num_tokens-token prefill): equal sets for every layer, recorded position and KV head,
// except positions whose recorded margin is a near-tie (kMsaMarginFloor; counted in *skipped).
// With `also`, those selections must equal also's too (e.g. the unsharded run's).
inline void expect_msa_matches_golden(const nlohmann::json& c,
                                      const std::vector<std::vector<int32_t>>& msa_blocks,
                                      const M3Config& cfg, size_t num_tokens,
                                      const std::string& label, int64_t* compared,
                                      int64_t* skipped = nullptr,
                                      const std::vector<std::vector<int32_t>>* also = nullptr) {
  if (!c.contains("msa")) return;
  const int64_t nkv = cfg.num_key_value_heads, k = cfg.sparse_topk_blocks;
  for (const auto& [layer_str, rec] : c["msa"].items()) {
    const int layer = std::stoi(layer_str);
    ASSERT_TRUE(cfg.layer_is_sparse[layer]) << label << " layer " << layer;
    const auto& sel = msa_blocks[layer];
    ASSERT_EQ(sel.size(), num_tokens * nkv * k) << label << " layer " << layer;
    if (also) {
      ASSERT_EQ((*also)[layer].size(), sel.size()) << label << " layer " << layer;
    }
    const auto& positions = rec["positions"];
    for (size_t i = 0; i < positions.size(); ++i) {
      if (rec.contains("margin") && !rec["margin"][i].is_null() &&
          rec["margin"][i].get<double>() < kMsaMarginFloor) {
        if (skipped) ++*skipped;
        continue;
      }
      const int64_t p = positions[i].get<int64_t>();
      for (int64_t h = 0; h < nkv; ++h) {
        const std::set<int32_t> got = selected_blocks(sel, p, h, nkv, k);
        const auto w = rec["blocks"][i][h].get<std::vector<int32_t>>();
        EXPECT_EQ(got, std::set<int32_t>(w.begin(), w.end()))
            << label << " layer " << layer << " position " << p << " kv head " << h;
        if (also) {
          EXPECT_EQ(got, selected_blocks((*also)[layer], p, h, nkv, k))
              << label << " layer " << layer << " position " << p << " kv head " << h;
        }
        ++*compared;
      }
    }
  }
}

}  // namespace m3::model::golden
