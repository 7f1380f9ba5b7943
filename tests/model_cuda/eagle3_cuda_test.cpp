// The EAGLE-3 draft on the GPU (model/cuda/eagle3_draft_cuda.h) against the CPU draft
// (model/eagle3_draft.h) over the same host weights: the demo draft (models/demo-eagle3, GQA
// 8 heads / 2 KV heads, bf16 weights) on the golden prompt's aux states, and two random f32
// drafts over the demo target, one MHA and one GQA; propose() on the device equals the host
// proposer's greedy proposals; the synthetic M3-shaped drafts load with the sizes they claim.
// Label gpu; skips where no GPU is usable.
//
// Tolerance: the GPU GEMMs run in GemmPrecision::kExact (fp32 activations, fp32 accumulation,
// another summation order: ~1e-6 relative), but the GPU draft's KV cache is bf16 where the CPU's
// is f32: K and V are rounded by up to 2^-9 relative, which moves the attention output by at
// most 2^-9 of |V| and the scores by 2^-9 of |q||k|; through o_proj, the MLP and the LM head that
// stays within 1% of the largest magnitude of each output (seen: ~0.2%), so 1e-2 * max|ref|.
// Argmax ids are compared only on rows whose CPU top-2 gap exceeds twice that bound.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>

#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/eagle3_draft_cuda.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/eagle3_draft.h"
#include "model/m3_model.h"
#include "model/synthetic_model.h"

namespace m3::model {
namespace {

const std::string kRepo = M3_SOURCE_DIR;

nlohmann::json golden() {
  std::ifstream in(kRepo + "/tests/golden/eagle3/demo_draft.json");
  return nlohmann::json::parse(in);
}

std::unique_ptr<M3Model> demo() {
  auto m = M3Model::load(kRepo + "/models/demo");
  EXPECT_TRUE(m.has_value()) << (m ? "" : m.error().message);
  return std::move(*m);
}

struct Pair {
  std::unique_ptr<M3Model> host;         // the CPU draft's target (shared embedding, LM head)
  std::unique_ptr<M3ModelCuda> gpu;      // the GPU draft's target
  std::unique_ptr<Eagle3Draft> cpu;      // the CPU draft
  std::unique_ptr<Eagle3DraftCuda> dev;  // the same weights on the GPU
};

Pair make_pair(Eagle3Config cfg, std::unique_ptr<Eagle3Weights> w, int64_t pages) {
  Pair p;
  p.host = demo();
  auto g = M3ModelCuda::from_host(demo(), 0);
  EXPECT_TRUE(g.has_value()) << (g ? "" : g.error().message);
  p.gpu = std::move(*g);
  p.dev = std::make_unique<Eagle3DraftCuda>(cfg, *w, *p.gpu, 0);
  p.dev->allocate_kv(pages);
  p.cpu = std::make_unique<Eagle3Draft>(std::move(cfg), std::move(w),
                                        p.host->config().sparse_block_size, pages);
  return p;
}

Pair demo_pair(int64_t pages) {
  Pair p;
  p.host = demo();
  auto d = Eagle3Draft::load(kRepo + "/models/demo-eagle3", p.host->config(),
                             p.host->base_weights(), pages);
  EXPECT_TRUE(d.has_value()) << (d ? "" : d.error().message);
  p.cpu = std::move(*d);
  auto g = M3ModelCuda::from_host(demo(), 0);
  EXPECT_TRUE(g.has_value()) << (g ? "" : g.error().message);
  p.gpu = std::move(*g);
  // The CPU draft's weights view the host target's embedding and LM head; the GPU draft swaps
  // them for the device target's.
  p.dev = std::make_unique<Eagle3DraftCuda>(p.cpu->config(), p.cpu->weights(), *p.gpu, 0);
  p.dev->allocate_kv(pages);
  return p;
}

// A random draft over the demo target (hidden 256): f32 weights, std 1/sqrt(fan_in).
std::unique_ptr<Eagle3Weights> random_weights(const Eagle3Config& c, const M3Model& target,
                                              uint32_t seed) {
  auto w = std::make_unique<Eagle3Weights>();
  std::mt19937 rng(seed);
  auto mat = [&](int64_t rows, int64_t cols) {
    auto& v = w->owned_f32.emplace_back(static_cast<size_t>(rows * cols));
    std::normal_distribution<float> nd(0.f, 1.f / std::sqrt(static_cast<float>(cols)));
    for (float& x : v) x = nd(rng);
    return kernels::MatRef{v.data(), DType::kF32, rows, cols};
  };
  auto norm = [&](int64_t n) {
    auto& v = w->owned_f32.emplace_back(static_cast<size_t>(n));
    std::uniform_real_distribution<float> ud(-0.2f, 0.2f);
    for (float& x : v) x = ud(rng);
    return kernels::VecRef{v.data(), DType::kF32, n};
  };
  const int64_t H = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  w->fc = mat(H, static_cast<int64_t>(c.aux_layer_ids.size()) * c.target_hidden_size);
  w->q_proj = mat(q, 2 * H);
  w->k_proj = mat(kv, 2 * H);
  w->v_proj = mat(kv, 2 * H);
  w->o_proj = mat(H, q);
  w->gate_proj = mat(c.intermediate_size, H);
  w->up_proj = mat(c.intermediate_size, H);
  w->down_proj = mat(H, c.intermediate_size);
  w->input_norm = norm(H);
  w->hidden_norm = norm(H);
  w->post_attention_norm = norm(H);
  w->final_norm = norm(H);
  w->target = target.base_weights();
  w->embed_tokens = target.base_weights()->embed_tokens;
  w->lm_head = target.base_weights()->lm_head;
  return w;
}

Eagle3Config random_config(const M3Config& t, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  Eagle3Config c;
  c.hidden_size = t.hidden_size;
  c.target_hidden_size = t.hidden_size;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate_size = 384;
  c.vocab_size = c.draft_vocab_size = t.vocab_size;
  c.aux_layer_ids = {1, 2, 3};
  return c;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// The golden prompt as one context chunk (rows: the token after each position, the target's aux
// states there), then two one-token draft steps continuing it from the chunk's pre-norm rows.
void compare(Pair& p, const std::vector<float>& aux, const std::vector<int32_t>& ids) {
  const int64_t S = static_cast<int64_t>(ids.size()) - 1, H = p.cpu->config().hidden_size;
  const int64_t V = p.cpu->config().draft_vocab_size;
  DraftBatch b;
  b.hidden = aux;
  for (int32_t i = 0; i < S; ++i) {
    b.token_ids.push_back(ids[i + 1]);
    b.positions.push_back(i);
    b.seq_ids.push_back(0);
    b.logits_indices.push_back(i);
  }
  // Pages 1, 2, ... (not from page 0: the table is honoured), enough for the chunk and the draft
  // steps after it.
  const int64_t bs = p.host->config().sparse_block_size;
  std::vector<int32_t> table;
  for (int64_t pg = 0; pg * bs < S + 3; ++pg) table.push_back(static_cast<int32_t>(pg + 1));
  b.block_table_offsets = {0, static_cast<int32_t>(table.size())};
  b.block_table = table;
  for (int step = 0; step < 3; ++step) {
    DraftResult r;
    p.cpu->forward(b, &r);
    // The CPU draft's logits: recomputed from its argmax rows is not possible, so compare the
    // GPU logits' argmax against the CPU's ids and the pre-norm rows by value.
    std::vector<float> pre, lg;
    p.dev->forward_for_test(b, &pre, &lg);
    ASSERT_EQ(pre.size(), r.prenorm.size());
    const double tol = 1e-2 * max_abs(r.prenorm);
    double worst = 0;
    for (size_t i = 0; i < pre.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(pre[i] - r.prenorm[i])));
    EXPECT_LE(worst, tol) << "step " << step << ": pre-norm rows, largest |x| "
                          << max_abs(r.prenorm);
    const int64_t R = static_cast<int64_t>(b.logits_indices.size());
    ASSERT_EQ(lg.size(), static_cast<size_t>(R * V));
    const double ltol = 1e-2 * max_abs(lg);
    int compared = 0;
    for (int64_t row = 0; row < R; ++row) {
      const float* l = lg.data() + row * V;
      std::vector<float> sorted(l, l + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      if (sorted[0] - sorted[1] <= 2 * ltol) {
        // A near tie may flip, but the CPU's pick must be one of the GPU's near-best.
        EXPECT_GE(l[r.argmax_tokens[row]], sorted[0] - 2 * ltol)
            << "step " << step << " row " << row << ": the CPU's token is not near the GPU's best";
        continue;
      }
      const int64_t best = std::max_element(l, l + V) - l;
      EXPECT_EQ(static_cast<int32_t>(best), r.argmax_tokens[row])
          << "step " << step << " row " << row;
      ++compared;
    }
    // The context chunk has many rows: most must be clear of ties. A one-row draft step may be
    // a near tie (then only the check above applies).
    if (R > 1) {
      EXPECT_GE(compared, 1) << "step " << step << ": every row a near tie";
    }
    // Next: one draft step from the last row, at the next position.
    DraftBatch d;
    d.hidden_is_aux = false;
    d.token_ids = {r.argmax_tokens.back()};
    d.positions = {b.positions.back() + 1};
    d.seq_ids = {0};
    d.block_table_offsets = b.block_table_offsets;
    d.block_table = b.block_table;
    d.hidden.assign(r.prenorm.end() - H, r.prenorm.end());
    d.logits_indices = {0};
    b = d;
  }
}

class Eagle3Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    kernels::cuda::set_gemm_precision(kernels::cuda::GemmPrecision::kExact);
  }
};

TEST_F(Eagle3Cuda, DemoDraftMatchesTheCpuDraft) {
  const auto g = golden();
  Pair p = demo_pair(4);
  compare(p, g["aux_hidden"].get<std::vector<float>>(), g["tokens"].get<std::vector<int32_t>>());
}

std::vector<float> random_aux(int64_t rows, int64_t width, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(rows * width));
  for (float& x : v) x = nd(rng);
  return v;
}

TEST_F(Eagle3Cuda, RandomMhaDraftMatchesTheCpuDraft) {
  auto t = demo();
  const Eagle3Config c = random_config(t->config(), 8, 8, 32);
  Pair p = make_pair(c, random_weights(c, *t, 7), 4);
  std::vector<int32_t> ids(41);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 5) % 2000);
  compare(p, random_aux(40, 3 * c.target_hidden_size, 11), ids);
}

TEST_F(Eagle3Cuda, RandomGqaDraftMatchesTheCpuDraft) {
  auto t = demo();
  const Eagle3Config c = random_config(t->config(), 16, 4, 16);
  Pair p = make_pair(c, random_weights(c, *t, 8), 4);
  std::vector<int32_t> ids(141);  // past one 128-token page
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 53 + 3) % 2000);
  compare(p, random_aux(140, 3 * c.target_hidden_size, 12), ids);
}

// propose() with the draft steps in CUDA graphs gives the eager steps' proposals exactly (the
// same kernels over the same inputs), over repeated calls of two batch shapes (so each graph is
// run eagerly once, captured, then replayed) after a target step that left its aux states on the
// device: two sequences, prefixes of 12 and 20 golden ids, proposing 3 and 3, then 2 and 3
// (the last draft step has one row).
TEST_F(Eagle3Cuda, DraftStepGraphsGiveTheEagerProposals) {
  const auto ids = golden()["tokens"].get<std::vector<int32_t>>();
  ASSERT_GE(ids.size(), 20u);
  Pair p = demo_pair(4);
  const int64_t bs = p.gpu->config().sparse_block_size;
  ASSERT_GE(bs, 24);  // one page holds each sequence and its drafts
  KvCacheCuda cache(p.gpu->config(), 4);
  const std::vector<size_t> lens = {12, 20};
  const std::vector<int32_t> pages = {1, 2};
  ForwardBatch b;
  for (size_t s = 0; s < lens.size(); ++s) {
    for (size_t i = 0; i < lens[s]; ++i) {
      b.token_ids.push_back(ids[i]);
      b.positions.push_back(static_cast<int32_t>(i));
      b.seq_ids.push_back(static_cast<int32_t>(s));
    }
    b.block_table_offsets.push_back(static_cast<int32_t>(s));
    b.block_table.push_back(pages[s]);
  }
  b.block_table_offsets.push_back(static_cast<int32_t>(lens.size()));
  b.aux_layers = p.dev->config().aux_layer_ids;
  b.aux_on_device = true;
  p.gpu->forward(b, cache, nullptr);
  auto seqs_of = [&](std::vector<int> num_propose) {
    std::vector<DraftSeq> seqs(lens.size());
    int row = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      DraftSeq& d = seqs[s];
      d.request_id = s + 1;
      d.block_table = std::span<const int32_t>(&pages[s], 1);
      d.first_row = row;
      d.start_pos = 0;
      d.num_valid = static_cast<int>(lens[s]) - 1;  // positions whose next token is known
      d.next_tokens.assign(ids.begin() + 1, ids.begin() + static_cast<ptrdiff_t>(lens[s]));
      d.num_propose = num_propose[s];
      d.capacity = static_cast<int>(bs);
      row += static_cast<int>(lens[s]);
    }
    return seqs;
  };
  const std::vector<std::vector<int>> shapes = {{3, 3}, {2, 3}};
  p.dev->set_use_graphs(false);
  std::vector<std::vector<std::vector<int32_t>>> ref;
  for (const auto& sh : shapes) ref.push_back(p.dev->propose(seqs_of(sh), {}, 3));
  EXPECT_EQ(p.dev->graph_replays(), 0);
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_EQ(ref[i].size(), 2u);
    EXPECT_EQ(ref[i][0].size(), static_cast<size_t>(shapes[i][0]));
    EXPECT_EQ(ref[i][1].size(), 3u);
  }
  p.dev->set_use_graphs(true);
  for (int rep = 0; rep < 4; ++rep)
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_EQ(p.dev->propose(seqs_of(shapes[i]), {}, 3), ref[i]) << "call " << rep;
  // Graphs: (2 rows, first step), (2 rows, later step), (1 row, later step); each replayed from
  // its second call on.
  EXPECT_EQ(p.dev->graph_captures(), 3);
  EXPECT_GE(p.dev->graph_replays(), 9);
}

TEST_F(Eagle3Cuda, SyntheticDraftsHaveM3Shapes) {
  const M3Config cfg =
      synthetic_m3_config(1);  // one layer: the draft needs only the target's embedding and LM head
  auto g = M3ModelCuda::synthetic(cfg, 1, 0);
  ASSERT_TRUE(g.has_value()) << g.error().message;
  for (const char* name : {"synthetic:mha", "synthetic:gqa"}) {
    auto d = Eagle3DraftCuda::load(name, **g, 0, 2);
    ASSERT_TRUE(d.has_value()) << d.error().message;
    const Eagle3Config& c = (*d)->config();
    EXPECT_EQ(c.hidden_size, 6144);
    EXPECT_EQ(c.num_attention_heads, 48);
    EXPECT_EQ(c.num_key_value_heads, std::string(name) == "synthetic:mha" ? 48 : 3);
    // Own weights (fc, attention, MLP) in bf16; the embedding and LM head are the target's.
    const int64_t H = 6144, kv = c.num_key_value_heads * 128;
    const int64_t n = H * 3 * H + (H + 2 * kv) * 2 * H + H * H + 3 * H * 4 * H;
    EXPECT_EQ((*d)->weight_bytes(), static_cast<size_t>(2 * n + 4 * 4 * H));
    (*d)->allocate_kv(2);
    EXPECT_EQ((*d)->kv_bytes_per_token(), 2 * kv * 2);
  }
  auto bad = Eagle3DraftCuda::load("synthetic:mqa", **g, 0, 2);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("synthetic:gqa"), std::string::npos);
}

}  // namespace
}  // namespace m3::model
