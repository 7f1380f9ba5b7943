// Tests for model/tensor_table.h, the one list of M3 text tensors: it names exactly the text
// tensors of every golden checkpoint (tests/golden/model) with their shapes; each rank's blocks
// over TP, TP+EP, DP and DP+EP plans tile every tensor (replicated tensors on every rank); the
// loaded weights' bytes are the table's; shard_weights gives each rank exactly its blocks; and
// load_weights, driven by the table, keeps its spellings (text-only root, dense MLP under mlp.),
// tied embeddings and errors naming the tensor and the expected shape.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/shard.h"
#include "model/synthetic_model.h"
#include "model/tensor_table.h"
#include "model/weights.h"

namespace m3::model {
namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kVision = {"vision_tower.", "multi_modal_projector.",
                                          "patch_merge_mlp."};

std::string golden_dir(const std::string& name) {
  return std::string(M3_SOURCE_DIR) + "/tests/golden/model/" + name;
}

std::vector<std::string> golden_names() {
  std::vector<std::string> r;
  for (const auto& e : fs::directory_iterator(std::string(M3_SOURCE_DIR) + "/tests/golden/model"))
    if (fs::exists(e.path() / "model.safetensors")) r.push_back(e.path().filename().string());
  std::sort(r.begin(), r.end());
  return r;
}

struct Golden {
  M3Config cfg;
  std::shared_ptr<Checkpoint> ckpt;
};

Golden open_golden(const std::string& name) {
  Golden g;
  auto cfg = load_config(golden_dir(name));
  EXPECT_TRUE(cfg) << cfg.error().message;
  if (cfg) g.cfg = *cfg;
  auto ck = Checkpoint::open(golden_dir(name), kVision);
  EXPECT_TRUE(ck) << ck.error().message;
  if (ck) g.ckpt = std::make_shared<Checkpoint>(std::move(*ck));
  return g;
}

TEST(TensorTable, GoldensArePresent) {
  EXPECT_GE(golden_names().size(), 3u);
}

// Every text tensor of each golden checkpoint is in the table (in one of its spellings, with the
// table's shape), and every tensor of the table is in the checkpoint.
TEST(TensorTable, NamesExactlyTheGoldenCheckpointsTextTensors) {
  for (const std::string& gname : golden_names()) {
    SCOPED_TRACE(gname);
    Golden g = open_golden(gname);
    ASSERT_TRUE(g.ckpt);
    std::set<std::string> in_ckpt;
    for (const std::string& n : g.ckpt->names()) in_ckpt.insert(n);
    std::set<std::string> in_table;
    for (const TensorSpec& t : m3_tensors(g.cfg)) {
      for (int64_t e = 0; e < std::max<int64_t>(t.experts, 1); ++e) {
        std::string found;
        for (size_t s = 0; s < t.names.size(); ++s)
          if (g.ckpt->has(t.name("language_model.", s, e))) found = t.name("language_model.", s, e);
        ASSERT_FALSE(found.empty()) << t.name("language_model.", 0, e) << " is not in " << gname;
        EXPECT_EQ(g.ckpt->find(found)->shape, t.shape()) << found;
        EXPECT_TRUE(in_table.insert(found).second) << found << " twice in the table";
      }
    }
    EXPECT_EQ(in_table, in_ckpt);
  }
}

// The table's order is fixed and starts with the globals (the synthetic generator numbers
// tensors in this order, and the loader finds the root by the first one).
TEST(TensorTable, OrderAndViewsOfTheSyntheticM3) {
  const M3Config cfg = synthetic_m3_config(4);
  const std::vector<TensorSpec> t = m3_tensors(cfg);
  ASSERT_GE(t.size(), 3u);
  EXPECT_EQ(t[0].model_mat, &M3Weights::embed_tokens);
  EXPECT_EQ(t[1].model_vec, &M3Weights::final_norm);
  EXPECT_EQ(t[2].model_mat, &M3Weights::lm_head);
  // 3 dense layers of 8 + 3 tensors, one MoE + MSA layer of 8 + 4 + 2 + 3 + 3.
  EXPECT_EQ(t.size(), 3u + 3 * 11 + 20);
  int64_t layer = -1;
  for (const TensorSpec& s : t) {
    EXPECT_GE(s.layer, layer) << s.names[0];
    layer = s.layer;
    const int views = (s.model_mat != nullptr) + (s.model_vec != nullptr) +
                      (s.layer_mat != nullptr) + (s.layer_vec != nullptr) +
                      (s.expert_mat != nullptr);
    EXPECT_EQ(views, 1) << s.names[0];
    EXPECT_EQ(s.vector, s.model_vec != nullptr || s.layer_vec != nullptr) << s.names[0];
    EXPECT_EQ(s.experts > 0, s.expert_mat != nullptr) << s.names[0];
    if (s.synthetic_dtype == DType::kF32) {
      EXPECT_EQ(s.split, SplitDim::kReplicated) << s.names[0];
    }
  }
}

std::vector<ShardSpec> plans_for(const M3Config& cfg) {
  std::vector<ShardSpec> r;
  for (int world : {1, 2, 4, 8}) {
    for (bool ep : {false, true}) {
      for (bool dp : {false, true}) {
        ShardSpec s;
        s.world = world;
        s.expert_parallel = ep;
        s.data_parallel = dp;
        bool ok = true;
        for (int rank = 0; rank < world && ok; ++rank) {
          s.rank = rank;
          ok = make_shard_plan(cfg, s).has_value();
        }
        s.rank = 0;
        if (ok) r.push_back(s);
      }
    }
  }
  return r;
}

std::string plan_name(const ShardSpec& s) {
  return std::string(s.data_parallel ? "DP" : "TP") + std::to_string(s.world) +
         (s.expert_parallel ? "+EP" : "");
}

// How many ranks hold each element: every rank for replicated tensors and, under attention
// data parallelism, everything but the routed experts; world / num_kv_heads for KV (and
// index-q) heads replicated beyond the model's KV heads; else exactly one.
int64_t expected_copies(const TensorSpec& t, const M3Config& cfg, const ShardSpec& s) {
  if (t.split == SplitDim::kReplicated) return s.world;
  if (s.data_parallel) return t.experts > 0 ? 1 : s.world;
  const bool kv = t.by == SplitBy::kKvHeads || t.by == SplitBy::kIndexHeads;
  if (kv && s.world > cfg.num_key_value_heads) return s.world / cfg.num_key_value_heads;
  return 1;
}

// Each element of each tensor (as [expert, split index]) is held by the expected number of
// ranks, so the ranks' blocks tile the tensor: a tensor sharded by the wrong range, or twice,
// or not at all, fails here.
void check_tiling(const M3Config& cfg, const std::string& what) {
  const std::vector<TensorSpec> table = m3_tensors(cfg);
  for (ShardSpec s : plans_for(cfg)) {
    for (const TensorSpec& t : table) {
      const int64_t ne = std::max<int64_t>(t.experts, 1);
      const int64_t n = t.split == SplitDim::kCols ? t.cols : t.rows;
      std::vector<int64_t> copies(static_cast<size_t>(ne * n), 0);
      size_t elements = 0;
      for (int rank = 0; rank < s.world; ++rank) {
        s.rank = rank;
        const ShardPlan p = *make_shard_plan(cfg, s);
        const TensorBlock b = shard_block(t, cfg, p);
        ASSERT_EQ(b.experts, ne);
        ASSERT_EQ(b.rows, t.rows);
        ASSERT_EQ(b.cols, t.cols);
        elements += b.size();
        const bool by_cols = t.split == SplitDim::kCols;
        // The dimension that is not split stays whole.
        EXPECT_EQ(by_cols ? b.row_count : b.col_count, by_cols ? t.rows : t.cols) << t.names[0];
        const int64_t begin = by_cols ? b.col_begin : b.row_begin;
        const int64_t count = by_cols ? b.col_count : b.row_count;
        for (int64_t e = b.expert_begin; e < b.expert_begin + b.expert_count; ++e)
          for (int64_t i = begin; i < begin + count; ++i) ++copies[static_cast<size_t>(e * n + i)];
      }
      const int64_t want = expected_copies(t, cfg, s);
      const std::string at = what + " " + plan_name(s) + " " + t.names[0];
      EXPECT_EQ(elements, static_cast<size_t>(want) * static_cast<size_t>(ne * t.rows * t.cols))
          << at;
      for (size_t i = 0; i < copies.size(); ++i) {
        if (copies[i] != want) {
          ADD_FAILURE() << at << ": element " << i << " held by " << copies[i] << " ranks, not "
                        << want;
          break;
        }
      }
    }
  }
}

TEST(TensorTable, RankBlocksTileEveryGoldenTensor) {
  for (const std::string& gname : golden_names()) check_tiling(open_golden(gname).cfg, gname);
}

// The synthetic M3 at the real shapes (the 128 x 3072 experts, 4 KV heads replicated on TP8).
TEST(TensorTable, RankBlocksTileTheRealGeometry) {
  check_tiling(synthetic_m3_config(4), "synthetic:layers=4");
}

// The loaded views hold exactly the checkpoint's text bytes (bf16/f32 goldens, read in place),
// and view_bytes counts them; shard_weights gives each rank its blocks of the loaded views.
TEST(TensorTable, LoadedAndShardedViewsAreTheTablesBlocks) {
  for (const std::string& gname : golden_names()) {
    SCOPED_TRACE(gname);
    Golden g = open_golden(gname);
    ASSERT_TRUE(g.ckpt);
    auto w = load_weights(g.ckpt, g.cfg);
    ASSERT_TRUE(w) << w.error().message;
    const std::vector<TensorSpec> table = m3_tensors(g.cfg);
    EXPECT_EQ(view_bytes(**w, table), (*w)->bytes_in_place + (*w)->bytes_owned);
    EXPECT_EQ(view_bytes(**w, table), g.ckpt->total_bytes());
    for (ShardSpec s : plans_for(g.cfg)) {
      size_t bytes = 0;
      for (int rank = 0; rank < s.world; ++rank) {
        s.rank = rank;
        const ShardPlan p = *make_shard_plan(g.cfg, s);
        auto v = shard_weights(**w, g.cfg, p);
        bytes += view_bytes(*v, table);
        const std::string at = plan_name(s) + " rank " + std::to_string(rank);
        for (const TensorSpec& t : table) {
          if (t.vector) {
            EXPECT_EQ(t.vec(*v).data, t.vec(**w).data) << at << " " << t.names[0];
            continue;
          }
          const TensorBlock b = shard_block(t, g.cfg, p);
          ASSERT_EQ(t.count_in(*v), b.expert_count) << at << " " << t.names[0];
          for (int64_t e = 0; e < b.expert_count; ++e) {
            const MatRef& got = t.mat(*v, e);
            const MatRef& from = t.mat(**w, b.expert_begin + e);
            ASSERT_EQ(got.rows, b.row_count) << at << " " << t.names[0];
            ASSERT_EQ(got.cols, b.col_count) << at << " " << t.names[0];
            ASSERT_EQ(got.dtype, from.dtype);
            const size_t es = dtype_size(from.dtype);
            for (int64_t r = 0; r < got.rows; ++r) {
              const auto* a = static_cast<const uint8_t*>(got.data) + r * got.cols * es;
              const auto* x = static_cast<const uint8_t*>(from.data) +
                              ((b.row_begin + r) * from.cols + b.col_begin) * es;
              ASSERT_EQ(std::memcmp(a, x, got.cols * es), 0)
                  << at << " " << t.names[0] << " expert " << e << " row " << r;
            }
          }
        }
      }
      // Each rank's bytes sum to the whole plus the copies of what several ranks hold.
      size_t want = 0;
      for (const TensorSpec& t : table) {
        s.rank = 0;
        const int64_t per =
            static_cast<int64_t>(t.vector ? t.vec(**w).n * dtype_size(t.vec(**w).dtype)
                                          : std::max<int64_t>(t.experts, 1) * t.rows * t.cols *
                                                dtype_size(t.mat(**w).dtype));
        want += static_cast<size_t>(per * expected_copies(t, g.cfg, s));
      }
      EXPECT_EQ(bytes, want) << plan_name(s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// load_weights over rewritten goldens: a safetensors file of chosen (renamed, dropped, reshaped)
// tensors of a golden, next to its config.json.

struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::map<std::string, RawTensor> golden_tensors(const Golden& g) {
  std::map<std::string, RawTensor> r;
  for (const std::string& n : g.ckpt->names()) {
    const TensorInfo* t = g.ckpt->find(n);
    r[n] = RawTensor{t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)};
  }
  return r;
}

class RewrittenGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/m3_tensor_table_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    g_ = open_golden("m3_ratio");
    ASSERT_TRUE(g_.ckpt);
    tensors_ = golden_tensors(g_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes tensors_ and the golden's config.json (tie_word_embeddings set when `tie`), loads both.
  Result<std::unique_ptr<M3Weights>> load(bool tie = false) {
    nlohmann::json header = nlohmann::json::object();
    size_t at = 0;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {at, at + t.bytes.size()}}};
      at += t.bytes.size();
    }
    const std::string h = header.dump();
    std::ofstream f(dir_ + "/model.safetensors", std::ios::binary);
    const uint64_t n = h.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& [name, t] : tensors_)
      f.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
    f.close();
    std::ifstream in(golden_dir("m3_ratio") + "/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    if (tie) {
      cfg["tie_word_embeddings"] = true;
      cfg["text_config"]["tie_word_embeddings"] = true;
    }
    std::ofstream(dir_ + "/config.json") << cfg.dump(2);
    auto c = load_config(dir_);
    if (!c) return tl::unexpected(c.error());
    cfg_ = *c;
    auto ck = Checkpoint::open(dir_, kVision);
    if (!ck) return tl::unexpected(ck.error());
    return load_weights(std::make_shared<Checkpoint>(std::move(*ck)), cfg_);
  }

  void rename_prefix(const std::string& from, const std::string& to) {
    std::map<std::string, RawTensor> r;
    for (auto& [name, t] : tensors_)
      r[name.starts_with(from) ? to + name.substr(from.size()) : name] = std::move(t);
    tensors_ = std::move(r);
  }
  void rename(const std::string& from, const std::string& to) {
    auto node = tensors_.extract(from);
    ASSERT_FALSE(node.empty()) << from;
    node.key() = to;
    tensors_.insert(std::move(node));
  }

  std::string dir_;
  Golden g_;
  M3Config cfg_;
  std::map<std::string, RawTensor> tensors_;
};

TEST_F(RewrittenGolden, TextOnlyRootAndDenseMlpUnderMlp) {
  rename_prefix("language_model.model.", "model.");
  rename("language_model.lm_head.weight", "lm_head.weight");
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
    rename("model.layers.0.block_sparse_moe." + std::string(proj) + ".weight",
           "model.layers.0.mlp." + std::string(proj) + ".weight");
  auto w = load();
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(view_bytes(**w, m3_tensors(cfg_)), (*w)->bytes_in_place);
  EXPECT_EQ((*w)->layers[0].up_proj.rows, cfg_.dense_intermediate_size);
  EXPECT_NE((*w)->lm_head.data, (*w)->embed_tokens.data);
}

TEST_F(RewrittenGolden, DenseMlpSpellingFollowsTheGate) {
  // The gate under mlp. decides the spelling of up and down: an up left under
  // block_sparse_moe. is reported missing under mlp.
  rename("language_model.model.layers.1.block_sparse_moe.gate_proj.weight",
         "language_model.model.layers.1.mlp.gate_proj.weight");
  auto w = load();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code, ErrorCode::kNotFound);
  EXPECT_EQ(w.error().param, "language_model.model.layers.1.mlp.up_proj.weight");
  EXPECT_NE(w.error().message.find("expected shape [96, 64]"), std::string::npos)
      << w.error().message;
}

TEST_F(RewrittenGolden, TiedEmbeddingsShareTheView) {
  tensors_.erase("language_model.lm_head.weight");
  auto w = load(/*tie=*/true);
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ((*w)->lm_head.data, (*w)->embed_tokens.data);
  const std::vector<TensorSpec> table = m3_tensors(cfg_);
  EXPECT_EQ(view_bytes(**w, table), (*w)->bytes_in_place);  // the embedding counted once
  // Untied, a missing lm_head is an error naming it.
  auto u = load(/*tie=*/false);
  ASSERT_FALSE(u);
  EXPECT_EQ(u.error().param, "language_model.lm_head.weight");
}

TEST_F(RewrittenGolden, MissingExpertAndMisShapedTensorsNameTheTensor) {
  tensors_.erase("language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight");
  auto w = load();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code, ErrorCode::kNotFound);
  EXPECT_EQ(w.error().message,
            "tensor 'language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight' not "
            "found in " +
                dir_ +
                "; expected shape [24, 64] BF16 or F32 or F16, or quantized (F8_E4M3 with its "
                "scales, or packed E2M1 codes: docs/QUANTIZATION.md)");

  tensors_ = golden_tensors(g_);
  tensors_["language_model.model.layers.2.self_attn.index_k_proj.weight"].shape = {8, 128};
  w = load();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code, ErrorCode::kFormat);
  EXPECT_EQ(w.error().param, "language_model.model.layers.2.self_attn.index_k_proj.weight");
  EXPECT_NE(w.error().message.find("has shape [8, 128], expected [16, 64]"), std::string::npos)
      << w.error().message;

  tensors_ = golden_tensors(g_);
  tensors_.erase("language_model.model.layers.2.block_sparse_moe.e_score_correction_bias");
  w = load();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().param,
            "language_model.model.layers.2.block_sparse_moe.e_score_correction_bias");
  EXPECT_NE(w.error().message.find("expected shape [16]"), std::string::npos) << w.error().message;
}

}  // namespace
}  // namespace m3::model
