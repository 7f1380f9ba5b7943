// The tensor/expert-parallel forward on the CPU (model/shard.h, make_cpu_sharded_backend) against
// the unsharded forward and the transformers goldens: N = 2 and 4 ranks as threads, with tensor-
// parallel experts and with expert parallelism, including more ranks than KV heads (replicated
// KV, msa_small_blocks at N = 4) and an uneven vocabulary split.
//
// Tolerance (kShardTol) for sharded vs unsharded logprobs: both runs add the same fp32 products,
// grouped differently: o_proj and every down projection become N partial dot products of K/N
// terms plus an N-term all-reduce, and the MoE adds routed and shared outputs before the
// reduction instead of after it. Embedding (one non-zero term per element) and lm_head (whole
// rows per rank) are exact. This is the same rounding model as kLogprobTol's derivation in
// model_golden_test.cpp (a reordered fp32 sum of K <= 512 terms errs by <= K*2^-24 of the sum of
// |terms|, ~10 reductions a layer, 3-5 layers): worst case ~7.5e-3 on logits of magnitude ~5,
// random-walk expectation ~1e-5. We use 1e-3: a mis-sliced head, a missing all-reduce or a wrong
// expert moves logprobs by >= 1e-1, and measured differences are ~1e-6 (printed).
// Against the goldens the sharded run meets the same kLogprobTol as the unsharded one, and MSA
// block ids and greedy tokens must match exactly, skipping the recorded near-ties.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "core/check.h"
#include "dist/cpu_communicator.h"
#include "model/golden_util.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

using nlohmann::json;
using namespace golden;

constexpr double kShardTol = 1e-3;

std::unique_ptr<M3Model> load(const std::string& name) {
  auto m = M3Model::load(root() + "/" + name);
  M3_CHECK(m.has_value(), "%s", m ? "" : m.error().message.c_str());
  return std::move(*m);
}

// The unsharded model of a golden, loaded once per process.
// (By value: g++ 13's -Wdangling-reference flags a reference-returning call whose reference
// parameter binds a temporary string, though the result does not refer to it.)
const M3Model& unsharded(std::string_view name_view) {
  static std::map<std::string, std::unique_ptr<M3Model>> cache;
  const std::string name(name_view);
  auto& slot = cache[name];
  if (!slot) slot = load(name);
  return *slot;
}

// A backend plus the bump page allocator the model tests use.
struct Driver {
  std::unique_ptr<ForwardBackend> backend;
  std::unique_ptr<SequencePages> pages;
  ForwardResult step(const std::vector<SequenceChunk>& chunks, bool capture = false) {
    ForwardBatch b = pages->build_step(chunks);
    ForwardResult r;
    backend->forward(b, &r, capture);
    return r;
  }
};

Driver sharded_driver(const std::string& name, int tp, bool ep, int64_t tokens, int64_t seqs,
                      int dp = 1, MoeDispatch dispatch = MoeDispatch::kAuto) {
  auto model = load(name);
  const int64_t bs = model->config().sparse_block_size;
  const int64_t pages = SequencePages::pages_needed(tokens, seqs, bs);
  auto be = make_cpu_sharded_backend(std::move(model), pages, tp, ep, dp, false, dispatch);
  M3_CHECK(be.has_value(), "%s", be ? "" : be.error().message.c_str());
  Driver d;
  d.backend = std::move(*be);
  d.pages = std::make_unique<SequencePages>(d.backend->num_pages(), bs);
  return d;
}

struct ShardCase {
  std::string golden;
  int tp;
  bool ep;
  size_t max_prompt;  // cases with longer prompts are left to another instance (test time)
  int dp = 1;         // > 1: attention data parallel over dp ranks (tp is then 1)
};

std::string case_name(const ShardCase& c) {
  return c.golden + (c.dp > 1 ? "_dp" + std::to_string(c.dp) : "_tp" + std::to_string(c.tp)) +
         (c.ep ? "_ep" : "");
}

void PrintTo(const ShardCase& c, std::ostream* os) {
  *os << case_name(c);
}

class ShardedGolden : public ::testing::TestWithParam<ShardCase> {};

TEST_P(ShardedGolden, MatchesUnshardedAndTransformers) {
  const ShardCase& sc = GetParam();
  const M3Model& ref = unsharded(sc.golden);
  const M3Config& cfg = ref.config();
  const int64_t V = cfg.vocab_size;
  const json g = read_json(root() + "/" + sc.golden + "/golden.json");
  int64_t tokens = 0, seqs = 0;
  for (const auto& c : g["cases"]) {
    if (c["prompt_ids"].size() > sc.max_prompt) continue;
    tokens += static_cast<int64_t>(c["prompt_ids"].size() + c["greedy_ids"].size()) + 1;
    ++seqs;
  }
  ASSERT_GT(seqs, 0);
  Driver d = sharded_driver(sc.golden, sc.tp, sc.ep, tokens, seqs, sc.dp);
  double max_vs_ref = 0, max_vs_golden = 0;
  int64_t msa_compared = 0;
  for (const auto& c : g["cases"]) {
    const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
    if (ids.size() > sc.max_prompt) continue;
    const std::string cname = c["name"].get<std::string>();
    const int s = d.pages->add_sequence();
    const ForwardResult res = d.step({{s, ids, true}}, /*capture=*/true);
    ASSERT_EQ(res.logits.size(), ids.size() * V);
    const auto lp = log_softmax_rows(res.logits, V);

    // 1. Against the unsharded forward, every logprob of every position (short prompts: the
    //    long one is compared with the goldens only, to keep the suite fast).
    if (ids.size() <= 256) {
      SequenceRunner r(ref, static_cast<int64_t>(ids.size()) + 1, 1);
      const int rs = r.add_sequence();
      const auto want = log_softmax_rows(r.step({{rs, ids, true}}).logits, V);
      for (size_t i = 0; i < lp.size(); ++i) {
        const double e = std::fabs(lp[i] - want[i]);
        max_vs_ref = std::max(max_vs_ref, e);
        ASSERT_LT(e, kShardTol) << cname << " position " << i / V << " token " << i % V;
      }
    }
    // 2. Against transformers: the prompt logprobs and their top entries.
    const auto& gl = c["prompt_logprobs"];
    for (size_t i = 1; i < ids.size(); ++i) {
      const float* row = lp.data() + (i - 1) * V;
      const double e = std::fabs(row[ids[i]] - gl[i]["logprob"].get<double>());
      max_vs_golden = std::max(max_vs_golden, e);
      EXPECT_LT(e, kLogprobTol) << cname << " position " << i;
      for (const auto& t : gl[i]["top"])
        EXPECT_NEAR(row[t[0].get<int32_t>()], t[1].get<double>(), kLogprobTol)
            << cname << " position " << i << " top " << t[0];
    }
    // 3. MSA block ids (all KV heads, gathered from the ranks) exactly as transformers chose.
    expect_msa_matches_golden(c, res.msa_blocks, cfg, ids.size(), cname, &msa_compared);
    // 4. Greedy continuation, decoding one token a step on the sharded cache.
    const auto want = c["greedy_ids"].get<std::vector<int32_t>>();
    const auto margin = c["greedy_margin"].get<std::vector<double>>();
    std::vector<float> last(res.logits.end() - V, res.logits.end());
    for (size_t step = 0; step < want.size(); ++step) {
      const auto l = log_softmax_rows(last, V);
      EXPECT_NEAR(l[want[step]], c["greedy_logprobs"][step]["logprob"].get<double>(), kLogprobTol)
          << cname << " step " << step;
      if (margin[step] < kGreedyMarginFloor) break;  // a recorded near-tie may flip
      const int32_t got =
          static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
      ASSERT_EQ(got, want[step]) << cname << " greedy step " << step;
      last = d.step({{s, std::span<const int32_t>(&want[step], 1), false}}).logits;
    }
  }
  if (cfg.any_sparse() && sc.max_prompt > 1000) {
    EXPECT_GT(msa_compared, 0);
  }
  std::printf(
      "  %s on %s: max |logprob - unsharded| %.3g, max |logprob - transformers| %.3g, "
      "%lld MSA selections compared\n",
      case_name(sc).c_str(), d.backend->device_name().c_str(), max_vs_ref, max_vs_golden,
      static_cast<long long>(msa_compared));
}

// 2 and 4 ranks, TP experts and EP, over the goldens whose shapes allow them. real_geometry's
// 2450-token prompt (the MSA selections past top-k) runs once, at N = 4 with EP; its other
// instance keeps to the short prompt.
INSTANTIATE_TEST_SUITE_P(
    Shards, ShardedGolden,
    ::testing::Values(
        ShardCase{"dense_only", 2, false, 1u << 20}, ShardCase{"dense_only", 2, true, 1u << 20},
        ShardCase{"m3_ratio", 2, false, 1u << 20}, ShardCase{"m3_ratio", 4, true, 1u << 20},
        ShardCase{"m3_ratio", 4, false, 100}, ShardCase{"msa_small_blocks", 2, true, 1u << 20},
        ShardCase{"msa_small_blocks", 4, false, 1u << 20},
        ShardCase{"real_geometry", 2, false, 100}, ShardCase{"real_geometry", 4, true, 1u << 20},
        // attention data parallel: each case is one sequence, so each runs on
        // one rank while the others join only the MoE collectives
        ShardCase{"dense_only", 1, true, 1u << 20, 2}, ShardCase{"m3_ratio", 1, true, 1u << 20, 4},
        ShardCase{"msa_small_blocks", 1, false, 1u << 20, 2},
        ShardCase{"real_geometry", 1, true, 100, 2},
        ShardCase{"msa_small_blocks", 1, true, 1u << 20, 8}),
    [](const auto& info) { return case_name(info.param); });

// Every rank of the group ends with bitwise the same logits (the all-gather of lm_head chunks
// and the rank-ordered all-reduce), and world 1 through make_shard is the unsharded model exactly.
TEST(ShardedModel, EveryRankHoldsTheSameLogitsAndWorldOneIsExact) {
  const M3Model& ref = unsharded("msa_small_blocks");
  const M3Config& cfg = ref.config();
  std::vector<int32_t> ids;
  for (int i = 0; i < 70; ++i) ids.push_back((i * 37 + 11) % static_cast<int32_t>(cfg.vocab_size));
  const int64_t pages =
      SequencePages::pages_needed(static_cast<int64_t>(ids.size()), 1, cfg.sparse_block_size);
  SequencePages sp(pages, cfg.sparse_block_size);
  const ForwardBatch b = sp.build_step({{sp.add_sequence(), ids, true}});

  auto one = ref.make_shard(ShardSpec{});
  ASSERT_TRUE(one.has_value()) << one.error().message;
  KvCache c1(cfg, pages), c2(cfg, pages);
  ForwardResult r_ref, r_one;
  ref.forward(b, c1, &r_ref, true);
  (*one)->forward(b, c2, &r_one, true);
  EXPECT_EQ(r_ref.logits, r_one.logits);
  EXPECT_EQ(r_ref.msa_blocks, r_one.msa_blocks);

  const int W = 4;  // > 2 KV heads: KV replicated on 2 ranks each
  std::vector<ForwardResult> out(W);
  dist::run_cpu_ranks(W, [&](int r, dist::Communicator& comm) {
    ShardSpec spec{r, W, false, &comm};
    auto shard = ref.make_shard(spec);
    M3_CHECK(shard.has_value());
    EXPECT_TRUE((*shard)->shard_plan().kv_replicated);
    KvCache cache(cfg, pages, (*shard)->cache_kv_heads());
    (*shard)->forward(b, cache, &out[r], true);
  });
  for (int r = 1; r < W; ++r) {
    EXPECT_EQ(out[r].logits, out[0].logits) << "rank " << r;
    EXPECT_EQ(out[r].msa_blocks, out[0].msa_blocks) << "rank " << r;
  }
  const auto a = log_softmax_rows(out[0].logits, cfg.vocab_size);
  const auto want = log_softmax_rows(r_ref.logits, cfg.vocab_size);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], want[i], kShardTol) << i;
}

// A vocabulary that N does not divide: ranks hold ceil(V / N) rows, the last fewer. The goldens'
// vocabularies are all multiples of 4, so this derives a model with V - 3 rows (the same
// checkpoint, embedding and lm_head views cut short) and compares 2/4 ranks against it.
TEST(ShardedModel, UnevenVocabularySplit) {
  const M3Model& base = unsharded("m3_ratio");
  M3Config cfg = base.config();
  cfg.vocab_size -= 3;  // 1533 = 3 x 511: neither 2 nor 4 divides it
  auto w = std::make_unique<M3Weights>();
  const M3Weights& bw = base.weights();
  w->embed_tokens = bw.embed_tokens.slice_rows(0, cfg.vocab_size);
  w->lm_head = bw.lm_head.slice_rows(0, cfg.vocab_size);
  w->final_norm = bw.final_norm;
  w->layers = bw.layers;
  M3Model small(cfg, std::move(w));
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 101 + 7) % static_cast<int32_t>(cfg.vocab_size));
  ids.back() = static_cast<int32_t>(cfg.vocab_size) - 1;  // a token of the short last chunk
  const int64_t pages = SequencePages::pages_needed(40, 1, cfg.sparse_block_size);
  SequencePages sp(pages, cfg.sparse_block_size);
  const ForwardBatch b = sp.build_step({{sp.add_sequence(), ids, true}});
  KvCache c_ref(cfg, pages);
  ForwardResult ref;
  small.forward(b, c_ref, &ref);
  for (int W : {2, 4}) {
    std::vector<ForwardResult> out(W);
    dist::run_cpu_ranks(W, [&](int r, dist::Communicator& comm) {
      auto shard = small.make_shard(ShardSpec{r, W, true, &comm});
      M3_CHECK(shard.has_value());
      const ShardPlan& p = (*shard)->shard_plan();
      EXPECT_EQ(p.vocab_chunk, (cfg.vocab_size + W - 1) / W);
      if (r == W - 1) {
        EXPECT_LT(p.vocab_count, p.vocab_chunk);
      }
      KvCache cache(cfg, pages, (*shard)->cache_kv_heads());
      (*shard)->forward(b, cache, &out[r]);
    });
    ASSERT_EQ(out[0].logits.size(), ref.logits.size());
    EXPECT_EQ(out[0].vocab_size, cfg.vocab_size);
    const auto a = log_softmax_rows(out[0].logits, cfg.vocab_size);
    const auto e = log_softmax_rows(ref.logits, cfg.vocab_size);
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(a[i], e[i], kShardTol) << "W " << W << " " << i;
  }
}

// Attention data parallel with several sequences per step: prefills, decodes and chunks spread
// over the ranks by first page (some ranks idle in some steps), against the unsharded model
// driven through the same page allocation.
TEST(ShardedModel, DataParallelMixedBatchesEqualUnsharded) {
  const std::string name = "msa_small_blocks";
  const M3Model& ref = unsharded(name);
  const M3Config& cfg = ref.config();
  const int64_t V = cfg.vocab_size;
  auto toks = [&](int n, int salt) {
    std::vector<int32_t> v;
    for (int i = 0; i < n; ++i) v.push_back((i * 53 + salt * 17 + 5) % static_cast<int32_t>(V));
    return v;
  };
  const auto a = toks(150, 1), b = toks(20, 2), c = toks(40, 3);
  const int32_t one = 7, two = 9;
  for (const auto& [D, ep] : {std::pair{2, false}, std::pair{4, true}}) {
    Driver d = sharded_driver(name, 1, ep, 400, 3, D);
    KvCache cache(cfg, d.backend->num_pages());
    SequencePages rp(d.backend->num_pages(), cfg.sparse_block_size);
    std::vector<std::vector<SequenceChunk>> steps;
    const int sa = d.pages->add_sequence(), sb = d.pages->add_sequence(),
              sc = d.pages->add_sequence();
    rp.add_sequence(), rp.add_sequence(), rp.add_sequence();
    steps.push_back(
        {{sa, a, true}, {sb, b, false}, {sc, std::span<const int32_t>(c.data(), 5), false}});
    steps.push_back({{sa, std::span<const int32_t>(&one, 1), false},
                     {sb, std::span<const int32_t>(&two, 1), false},
                     {sc, std::span<const int32_t>(c.data() + 5, 35), true}});
    steps.push_back({{sb, std::span<const int32_t>(&one, 1), false}});
    for (size_t i = 0; i < steps.size(); ++i) {
      const ForwardResult got = d.step(steps[i]);
      ForwardResult want;
      ref.forward(rp.build_step(steps[i]), cache, &want);
      ASSERT_EQ(got.logits.size(), want.logits.size()) << "D " << D << " step " << i;
      const auto lg = log_softmax_rows(got.logits, V), lw = log_softmax_rows(want.logits, V);
      for (size_t j = 0; j < lg.size(); ++j)
        ASSERT_NEAR(lg[j], lw[j], kShardTol) << "D " << D << " step " << i << " row " << j / V;
    }
  }
}

// The all-to-all MoE dispatch (MoeDispatch::kAllToAll, the CPU default under data + expert
// parallelism) against the all-gather one at D = 2, 4, 8 over mixed batches (prefills, decodes,
// chunks; some ranks idle in some steps; uneven per-rank rows): the logits are bitwise equal
// (each row's expert sum depends on that row alone, and the source adds the ranks' results in
// the reduce-scatter's rank order; the all-gather path's other terms are exact zeros), and both
// match the unsharded model within kShardTol with the same greedy tokens where the unsharded
// top-2 margin exceeds 2 x kShardTol. The bytes each path sent between ranks are printed per
// step; from D = 4 the all-to-all must send fewer (at D = 2 a token of m3_ratio meets the other
// rank's experts 96% of the time and the 64-wide rows make its picks and weights a 12% overhead,
// so it may not).
TEST(ShardedModel, AllToAllDispatchEqualsAllGatherBitwise) {
  const std::string name = "m3_ratio";  // 16 experts, top-4: 8, 4 or 2 experts per rank
  const M3Model& ref = unsharded(name);
  const M3Config& cfg = ref.config();
  const int64_t V = cfg.vocab_size;
  auto toks = [&](int n, int salt) {
    std::vector<int32_t> v;
    for (int i = 0; i < n; ++i) v.push_back((i * 31 + salt * 7 + 3) % static_cast<int32_t>(V));
    return v;
  };
  const int nseq = 6;
  std::vector<std::vector<int32_t>> prompt;
  for (int i = 0; i < nseq; ++i) prompt.push_back(toks(9 + 13 * i, i));
  const int32_t next = 11;
  for (int D : {2, 4, 8}) {
    Driver a2a = sharded_driver(name, 1, true, 800, nseq, D, MoeDispatch::kAllToAll);
    Driver ag = sharded_driver(name, 1, true, 800, nseq, D, MoeDispatch::kAllGather);
    KvCache cache(cfg, a2a.backend->num_pages());
    SequencePages rp(a2a.backend->num_pages(), cfg.sparse_block_size);
    std::vector<int> ids;
    for (int i = 0; i < nseq; ++i) {
      ids.push_back(a2a.pages->add_sequence());
      ag.pages->add_sequence();
      rp.add_sequence();
    }
    std::vector<std::vector<SequenceChunk>> steps;
    std::vector<SequenceChunk> s0, s1, s2;
    for (int i = 0; i < nseq; ++i) {
      const auto& p = prompt[i];
      if (i % 2 == 0) {
        s0.push_back({ids[i], p, true});
      } else {  // chunked: half now, the rest with the decodes
        s0.push_back({ids[i], std::span<const int32_t>(p.data(), p.size() / 2), false});
        s1.push_back({ids[i],
                      std::span<const int32_t>(p.data() + p.size() / 2, p.size() - p.size() / 2),
                      true});
      }
    }
    for (int i = 0; i < nseq; i += 2)
      s1.push_back({ids[i], std::span<const int32_t>(&next, 1), true});
    s2.push_back({ids[1], std::span<const int32_t>(&next, 1), true});  // most ranks idle
    steps = {s0, s1, s2};
    int64_t bytes_a2a = 0, bytes_ag = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const ForwardResult got = a2a.step(steps[i]);
      const ForwardResult other = ag.step(steps[i]);
      ForwardResult want;
      ref.forward(rp.build_step(steps[i]), cache, &want);
      ASSERT_EQ(got.logits, other.logits) << "D " << D << " step " << i;
      ASSERT_EQ(got.logits.size(), want.logits.size()) << "D " << D << " step " << i;
      const auto lg = log_softmax_rows(got.logits, V), lw = log_softmax_rows(want.logits, V);
      double worst = 0;
      for (size_t j = 0; j < lg.size(); ++j) {
        ASSERT_NEAR(lg[j], lw[j], kShardTol) << "D " << D << " step " << i << " row " << j / V;
        worst = std::max(worst, static_cast<double>(std::abs(lg[j] - lw[j])));
      }
      for (size_t r = 0; r * V < lw.size(); ++r) {
        const auto w0 = lw.begin() + r * V, g0 = lg.begin() + r * V;
        std::vector<double> top(w0, w0 + V);
        std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
        if (top[0] - top[1] <= 2 * kShardTol) continue;
        EXPECT_EQ(std::max_element(g0, g0 + V) - g0, std::max_element(w0, w0 + V) - w0)
            << "D " << D << " step " << i << " row " << r;
      }
      const int64_t da = a2a.backend->moe_dispatch_bytes() - bytes_a2a;
      const int64_t dg = ag.backend->moe_dispatch_bytes() - bytes_ag;
      bytes_a2a += da;
      bytes_ag += dg;
      std::printf(
          "[ moe dispatch ] D %d step %zu (%zu chunks): all-gather %lld B, all-to-all %lld B "
          "(%.2fx); max |dlogprob| vs unsharded %.2e\n",
          D, i, steps[i].size(), static_cast<long long>(dg), static_cast<long long>(da),
          dg > 0 ? static_cast<double>(da) / static_cast<double>(dg) : 0.0, worst);
      EXPECT_GT(da, 0);
      EXPECT_GT(dg, 0);
    }
    if (D >= 4) {
      EXPECT_LT(bytes_a2a, bytes_ag) << "D " << D;
    }
  }
}

// Splits the model cannot take are refused with the flag and the reason, before any thread runs.
TEST(ShardedModel, ImpossibleSplitsAreRefused) {
  struct Bad {
    std::string golden;
    int tp;
    bool ep;
    std::string says;
    int64_t expert_inter = 0;  // > 0: the config with this routed intermediate (plan only)
  };
  const std::vector<Bad> bad = {
      {"dense_only", 4, false, "query heads (6)"},  // 6 heads over 4 ranks
      {"dense_only", 3, false, "not a multiple"},   // 3 ranks > 2 KV heads, 3 % 2 != 0
      {"dense_only", 2, false, ""},                 // (fine: the control)
      {"m3_ratio", 3, false, "query heads (64)"},
      {"m3_ratio", 16, false, "shared-expert intermediate size (24)"},
      {"real_geometry", 64, false, "dense MLP intermediate size (96)"},
      {"real_geometry", 16, true, "routed experts (8)"},
      {"real_geometry", 16, false, "routed experts' intermediate size (20)", 20},
      {"msa_small_blocks", 0, false, "must be >= 1"},
  };
  for (const Bad& x : bad) {
    M3Config cfg = unsharded(x.golden).config();
    if (x.expert_inter > 0) cfg.intermediate_size = x.expert_inter;
    ShardSpec spec;
    spec.world = x.tp;
    spec.expert_parallel = x.ep;
    auto plan = make_shard_plan(cfg, spec);
    if (x.says.empty()) {
      EXPECT_TRUE(plan.has_value()) << plan.error().message;
      EXPECT_TRUE(make_cpu_sharded_backend(load(x.golden), 4, x.tp, x.ep).has_value());
      continue;
    }
    ASSERT_FALSE(plan.has_value()) << x.golden << " tp " << x.tp;
    EXPECT_NE(plan.error().message.find(x.says), std::string::npos) << plan.error().message;
    EXPECT_EQ(plan.error().param, "--tensor-parallel-size");
    if (x.expert_inter > 0) continue;
    // The backend refuses the same way, before any rank thread starts.
    auto be = make_cpu_sharded_backend(load(x.golden), 4, x.tp, x.ep);
    ASSERT_FALSE(be.has_value());
    EXPECT_EQ(be.error().message, plan.error().message);
  }
}

// The start-up line states the replicated KV heads and the per-rank KV memory.
TEST(ShardedModel, DescribeStatesReplicationCost) {
  const M3Config& cfg = unsharded("msa_small_blocks").config();  // 2 KV heads
  auto p = make_shard_plan(cfg, ShardSpec{1, 4, false, nullptr});
  ASSERT_TRUE(p.has_value());
  EXPECT_TRUE(p->kv_replicated);
  EXPECT_EQ(p->num_kv_heads, 1);
  EXPECT_EQ(p->kv_head_begin, 0);  // rank 1's query heads [2, 4) use KV head 0
  EXPECT_EQ(p->kv_head_begin_of(2), 1);
  const std::string s = p->describe(cfg);
  EXPECT_NE(s.find("replicated on 2 ranks"), std::string::npos) << s;
  EXPECT_NE(s.find("B/token on this rank"), std::string::npos) << s;
}

}  // namespace
}  // namespace m3::model
