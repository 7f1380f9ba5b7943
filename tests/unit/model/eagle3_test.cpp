// The EAGLE-3 draft (model/eagle3_draft.h) and the target's aux hidden states against
// transformers: tests/golden/eagle3/demo_draft.json was written by tools/demo_model/train_eagle3.py
// on the GPU machine (torch and transformers versions inside) from models/demo and the
// models/demo-eagle3 it exported: a prompt's residual streams entering target layers 1-3 (forward
// pre-hooks on transformers' decoder layers), and the draft's pre-norm output and logits over
// them (the script's own PyTorch draft layer, fp32 from the exported bf16 weights). Also: a draft
// run one token at a time over its KV cache equals the same tokens in one chunk.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "model/eagle3_draft.h"
#include "model/m3_model.h"

namespace m3::model {
namespace {

const std::string kRepo = M3_SOURCE_DIR;

nlohmann::json golden() {
  std::ifstream in(kRepo + "/tests/golden/eagle3/demo_draft.json");
  return nlohmann::json::parse(in);
}

struct Loaded {
  std::unique_ptr<M3Model> target;
  std::unique_ptr<Eagle3Draft> draft;
};

Loaded load(int64_t pages = 4) {
  Loaded l;
  auto m = M3Model::load(kRepo + "/models/demo");
  EXPECT_TRUE(m.has_value()) << (m ? "" : m.error().message);
  l.target = std::move(*m);
  auto d = Eagle3Draft::load(kRepo + "/models/demo-eagle3", l.target->config(),
                             l.target->base_weights(), pages);
  EXPECT_TRUE(d.has_value()) << (d ? "" : d.error().message);
  l.draft = std::move(*d);
  return l;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

TEST(Eagle3Golden, TargetAuxHiddenStatesMatchTransformers) {
  const auto g = golden();
  Loaded l = load();
  const std::vector<int32_t> ids = g["tokens"].get<std::vector<int32_t>>();
  const int64_t S = static_cast<int64_t>(ids.size()) - 1, H = l.target->config().hidden_size;
  EXPECT_EQ(l.draft->config().aux_layer_ids, g["aux_layers"].get<std::vector<int32_t>>());
  KvCache cache(l.target->config(), 1);
  ForwardBatch b;
  b.token_ids = ids;
  for (int32_t p = 0; p < static_cast<int32_t>(ids.size()); ++p) {
    b.positions.push_back(p);
    b.seq_ids.push_back(0);
  }
  b.block_table_offsets = {0, 1};
  b.block_table = {0};
  b.aux_layers = l.draft->config().aux_layer_ids;
  ForwardResult r;
  l.target->forward(b, cache, &r);
  const std::vector<float> want = g["aux_hidden"].get<std::vector<float>>();  // [S, 3H]
  ASSERT_EQ(r.aux_hidden.size(), static_cast<size_t>((S + 1) * 3 * H));
  // Both sides compute in fp32 from the same bf16 weights; only summation order differs (dot
  // products of <= 768 terms, relative error ~ 768 * 2^-24 ~ 5e-5 per layer, three layers deep):
  // 1e-3 of the largest magnitude bounds it with room.
  const double tol = 1e-3 * max_abs(want);
  double worst = 0;
  for (int64_t i = 0; i < S * 3 * H; ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(r.aux_hidden[i] - want[i])));
  EXPECT_LT(worst, tol) << "largest |aux| " << max_abs(want);
}

TEST(Eagle3Golden, DraftOutputsMatchThePyTorchDraft) {
  const auto g = golden();
  Loaded l = load();
  const std::vector<int32_t> ids = g["tokens"].get<std::vector<int32_t>>();
  const int64_t S = static_cast<int64_t>(ids.size()) - 1, H = l.draft->config().hidden_size;
  DraftBatch b;
  b.hidden = g["aux_hidden"].get<std::vector<float>>();
  for (int32_t i = 0; i < S; ++i) {
    b.token_ids.push_back(ids[i + 1]);  // row i: the token after position i
    b.positions.push_back(i);
    b.seq_ids.push_back(0);
  }
  b.block_table_offsets = {0, 1};
  b.block_table = {0};
  for (int32_t i = 0; i < S; ++i) b.logits_indices.push_back(i);
  DraftResult r;
  l.draft->forward(b, &r);
  const std::vector<float> pre = g["draft_prenorm"].get<std::vector<float>>();
  ASSERT_EQ(r.prenorm.size(), pre.size());
  // One layer in fp32 on both sides, inputs identical: 1e-4 of the largest magnitude (the
  // (1 + (w - 1)) norm weights add one rounding of 2^-24 relative).
  const double tol = 1e-4 * max_abs(pre);
  double worst = 0;
  for (size_t i = 0; i < pre.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(r.prenorm[i] - pre[i])));
  EXPECT_LT(worst, tol) << "largest |prenorm| " << max_abs(pre);
  EXPECT_EQ(r.argmax_tokens, g["draft_argmax"].get<std::vector<int32_t>>());
  (void)H;
}

TEST(Eagle3Draft, OneTokenAtATimeEqualsOneChunk) {
  const auto g = golden();
  Loaded a = load(), b1 = load();
  const std::vector<int32_t> ids = g["tokens"].get<std::vector<int32_t>>();
  const int64_t S = static_cast<int64_t>(ids.size()) - 1;
  const std::vector<float> aux = g["aux_hidden"].get<std::vector<float>>();
  const int64_t W = static_cast<int64_t>(aux.size()) / S, H = a.draft->config().hidden_size;
  DraftBatch chunk;
  chunk.hidden = aux;
  for (int32_t i = 0; i < S; ++i) {
    chunk.token_ids.push_back(ids[i + 1]);
    chunk.positions.push_back(i);
    chunk.seq_ids.push_back(0);
  }
  chunk.block_table_offsets = {0, 1};
  chunk.block_table = {2};  // another page than page 0: the table is honoured
  chunk.logits_indices = {static_cast<int32_t>(S - 1)};
  DraftResult rc;
  a.draft->forward(chunk, &rc);
  DraftResult ri;
  for (int32_t i = 0; i < S; ++i) {
    DraftBatch one;
    one.token_ids = {ids[i + 1]};
    one.positions = {i};
    one.seq_ids = {0};
    one.block_table_offsets = {0, 1};
    one.block_table = {2};
    one.hidden.assign(aux.begin() + i * W, aux.begin() + (i + 1) * W);
    one.logits_indices = {0};
    b1.draft->forward(one, &ri);
  }
  // The last row: the same attention over the same cached keys, summed in another blocking.
  for (int64_t j = 0; j < H; ++j)
    EXPECT_NEAR(ri.prenorm[j], rc.prenorm[(S - 1) * H + j], 1e-4 * (1 + std::fabs(ri.prenorm[j])));
  EXPECT_EQ(ri.argmax_tokens, rc.argmax_tokens);
}

// The synthetic benchmark drafts' shapes (model/eagle3_draft.h): M3's hidden and vocabulary,
// 48 x 128 heads, MHA or 3 KV heads, MLP 4 x hidden; 3.29 B parameters with the shared
// embedding and LM head (m3-model.md §5.2: ~3.3 B).
TEST(Eagle3Draft, SyntheticDraftsHaveM3Shapes) {
  M3Config t;
  t.hidden_size = 6144;
  t.vocab_size = 200064;
  t.num_hidden_layers = 60;
  for (const char* name : {"synthetic:mha", "synthetic:gqa"}) {
    ASSERT_TRUE(is_synthetic_draft(name));
    auto c = synthetic_eagle3_config(name, t);
    ASSERT_TRUE(c.has_value()) << c.error().message;
    const bool mha = std::string(name) == "synthetic:mha";
    EXPECT_EQ(c->num_attention_heads, 48);
    EXPECT_EQ(c->head_dim, 128);
    EXPECT_EQ(c->num_key_value_heads, mha ? 48 : 3);
    EXPECT_EQ(c->aux_layer_ids, (std::vector<int32_t>{2, 30, 57}));
    const int64_t H = 6144, kv = c->num_key_value_heads * 128;
    const int64_t own = 3 * H * H + (H + 2 * kv) * 2 * H + H * H + 3 * H * c->intermediate_size;
    const double total = static_cast<double>(own + 2 * t.vocab_size * H);
    if (mha) {
      EXPECT_NEAR(total / 1e9, 3.29, 0.01);
    }
  }
  EXPECT_FALSE(is_synthetic_draft("models/demo-eagle3"));
  auto bad = synthetic_eagle3_config("synthetic:mqa", t);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("synthetic:mha or synthetic:gqa"), std::string::npos);
}

}  // namespace
}  // namespace m3::model
