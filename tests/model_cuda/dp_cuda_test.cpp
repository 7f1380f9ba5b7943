// Attention data parallel on GPUs (model/cuda/cuda_dp_backend.cpp): two DP ranks over NCCL, with
// and without expert parallelism, against one GPU (TP1) on the golden checkpoints. The same
// ForwardBatch goes to both backends, so their page ids are the same; every golden case is
// prefilled in ONE batch whose sequences are placed so that both ranks own some (the test checks
// the owners), then the cases decode together. Checked: prompt logprobs at every position of
// every case against TP1 and transformers, MSA block ids, device greedy samples, a step where one
// rank has no tokens (each rank in turn), and through the engine, greedy generations equal to
// TP1's; and `synthetic:layers=4` at M3's shapes. The refusals run everywhere; everything else
// skips with fewer than 2 GPUs.
//
// Tolerances:
// - kDpTol (DP2 vs TP1 logprobs, every vocabulary entry), derived as tp_cuda_test's kTpTol: both
//   runs are the GPU ops on the same fp32 activations and weights. A DP rank runs attention,
//   dense MLP, shared expert and lm_head unsharded but over fewer rows (its own sequences), and
//   the routed experts over the all-gathered rows of both ranks, as 2 partial sums (1/2 of each
//   expert's intermediate, or whole experts under EP) completed by a 2-term reduce-scatter; the
//   GEMMs / GEMVs may therefore pick another kernel or summation order than TP1. model_cuda_test
//   bounds any GPU summation order against the exact result by kGpuCpuTol = 2e-4; two such paths
//   differ by at most twice that, 4e-4, 5x under the golden tolerance and far under a routing
//   bug (a token meeting the wrong rank's experts, or a dropped reduce-scatter, moves logprobs
//   by >= 1e-1).
// - kSampleMargin: device greedy picks are compared only where TP1's top-2 logprob margin exceeds
//   2 x kDpTol (below it the two runs may legitimately pick different argmaxes).
// - kLogprobTol / kGreedyMarginFloor / kMsaMarginFloor: the golden tests' (golden_util.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "core/check.h"
#include "model/golden_util.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "model_cuda/multi_gpu_test_util.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/sequence_runner.h"
#ifdef M3_TEST_ENGINE
#include "engine/engine.h"
#include "unit/engine/engine_test_util.h"
#endif

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

using nlohmann::json;
using namespace golden;

constexpr double kDpTol = 4e-4;
constexpr double kSampleMargin = 2 * kDpTol;

using multi_gpu::gpu_count;
using multi_gpu::load;
using multi_gpu::max_logprob_diff;
using multi_gpu::top2_margin;

// dp == 1: one GPU, the reference. KV pool of `pages` whole-head pages; one page-id space for
// both ranks (SequencePages hands out the pages; DpEngine runs the partitioned pools).
std::unique_ptr<ForwardBackend> make_backend(const std::string& name, int dp, bool ep,
                                             int64_t pages, bool graphs = false) {
  return multi_gpu::make_backend(name, dp, multi_gpu::Split::kData, ep, pages, graphs);
}

// The DP2 rank of a sequence whose first KV page is `page` (ShardPlan::dp_owner: a hash of it).
int owner_of_page(int64_t page) {
  ShardPlan plan;
  plan.world = 2;
  plan.data_parallel = true;
  return plan.dp_owner(static_cast<int32_t>(page));
}

// The reference and the DP backend driven by the same batches (one page assignment), tracking
// the next page SequencePages will hand out (so a test can tell which rank a new sequence gets).
struct Pair : multi_gpu::BackendPair {
  int64_t next_page = 0;

  static int64_t pool(const std::string& name, int64_t tokens, int64_t seqs) {
    return SequencePages::pages_needed(tokens, seqs, load(name)->config().sparse_block_size);
  }
  Pair(const std::string& name, bool ep, int64_t tokens, int64_t seqs, bool graphs = false)
      : BackendPair(make_backend(name, 1, false, pool(name, tokens, seqs)),
                    make_backend(name, 2, ep, pool(name, tokens, seqs), graphs)) {}
  // The DP rank that will own a new sequence added to the next batch.
  int next_owner() const { return owner_of_page(next_page); }

  Out step(const std::vector<SequenceChunk>& chunks, bool capture = false,
           bool greedy_on_device = false) {
    Out o = BackendPair::step(chunks, capture, greedy_on_device);
    for (int32_t p : o.batch.block_table) next_page = std::max<int64_t>(next_page, p + 1);
    return o;
  }
};

// The owner rank (ShardPlan::dp_owner of its first page) of each sequence with tokens in the
// batch, in order of first appearance (the CSR also lists sequences not in this step).
std::vector<int> owners(const ForwardBatch& b) {
  std::vector<int> r;
  std::vector<bool> seen(b.block_table_offsets.size(), false);
  for (const int32_t s : b.seq_ids) {
    if (seen[s]) continue;
    seen[s] = true;
    r.push_back(owner_of_page(b.block_table[b.block_table_offsets[s]]));
  }
  return r;
}

// Spacer sequences at most before one golden case (a run of this many pages of one owner would
// be a broken hash).
constexpr int kMaxSpacers = 8;

struct DpCase {
  std::string golden;
  bool expert_parallel = false;
};
std::string case_name(const DpCase& c) {
  return c.golden + (c.expert_parallel ? "_ep" : "");
}
void PrintTo(const DpCase& c, std::ostream* os) {
  *os << case_name(c);
}

class DpGolden : public ::testing::TestWithParam<DpCase> {};

TEST_P(DpGolden, Dp2OneBatchMatchesTp1AndTransformers) {
  SKIP_UNLESS_TWO_GPUS();
  const DpCase& tc = GetParam();
  const json g = read_json(root() + "/" + tc.golden + "/golden.json");
  int64_t tokens = 0, seqs = 0;
  for (const auto& c : g["cases"]) {
    tokens += static_cast<int64_t>(c["prompt_ids"].size() + c["greedy_ids"].size()) + 1;
    seqs += 1 + kMaxSpacers;  // the case and the spacers before it
  }
  Pair p(tc.golden, tc.expert_parallel, tokens + seqs, seqs);
  const M3Config& cfg = p.config();
  const int64_t V = cfg.vocab_size, bs = cfg.sparse_block_size;
  EXPECT_NE(p.test->device_name().find("data parallel 2"), std::string::npos)
      << p.test->device_name();

  // 1. One prefill batch of every case (all logits, MSA captured). Case i goes to rank i % 2:
  //    one-token spacer sequences (one page each) first while the next page belongs to the other
  //    rank.
  struct Seq {
    int seq = 0;
    std::vector<int32_t> ids;
    int64_t row0 = 0, tok0 = 0;  // its first logits row and token in the batch
  };
  std::vector<Seq> cs;
  cs.reserve(g["cases"].size());  // chunks point into cs and spacer_ids: no reallocation
  std::vector<std::vector<int32_t>> spacer_ids;
  spacer_ids.reserve(g["cases"].size() * kMaxSpacers);
  std::vector<SequenceChunk> chunks;
  int64_t rows = 0, page = 0, toks = 0;
  int ci = 0;
  for (const auto& c : g["cases"]) {
    for (int n = 0; owner_of_page(page) != ci % 2; ++n) {
      ASSERT_LT(n, kMaxSpacers) << "pages " << page - n << ".." << page << " all on one rank";
      spacer_ids.push_back({c["prompt_ids"][0].get<int32_t>()});
      chunks.push_back({p.pages->add_sequence(), spacer_ids.back(), false});
      rows += 1;
      toks += 1;
      page += 1;
    }
    Seq s;
    s.seq = p.pages->add_sequence();
    s.ids = c["prompt_ids"].get<std::vector<int32_t>>();
    s.row0 = rows;
    s.tok0 = toks;
    cs.push_back(std::move(s));
    chunks.push_back({cs.back().seq, cs.back().ids, true});
    rows += static_cast<int64_t>(cs.back().ids.size());
    toks += static_cast<int64_t>(cs.back().ids.size());
    page += (static_cast<int64_t>(cs.back().ids.size()) + bs - 1) / bs;
    ++ci;
  }
  const auto pre = p.step(chunks, /*capture=*/true);
  const std::vector<int> own = owners(pre.batch);
  ASSERT_NE(std::count(own.begin(), own.end(), 0), 0) << "rank 0 got no sequence";
  ASSERT_NE(std::count(own.begin(), own.end(), 1), 0) << "rank 1 got no sequence";
  ASSERT_EQ(pre.got.logits.size(), static_cast<size_t>(rows * V));
  double max_vs_tp1 = max_logprob_diff(pre.got, pre.want, V), max_vs_golden = 0;
  EXPECT_LT(max_vs_tp1, kDpTol) << "prefill of " << cs.size() << " cases in one batch";
  const auto lp = log_softmax_rows(pre.got.logits, V);
  int64_t msa_compared = 0, greedy_compared = 0;
  const int64_t width = cfg.num_key_value_heads * cfg.sparse_topk_blocks;
  ci = 0;
  for (const auto& c : g["cases"]) {
    const Seq& s = cs[ci++];
    const std::string cname = c["name"].get<std::string>();
    const auto& gl = c["prompt_logprobs"];
    for (size_t i = 1; i < s.ids.size(); ++i) {
      const double e =
          std::fabs(lp[(s.row0 + i - 1) * V + s.ids[i]] - gl[i]["logprob"].get<double>());
      max_vs_golden = std::max(max_vs_golden, e);
      EXPECT_LT(e, kLogprobTol) << cname << " position " << i;
    }
    // MSA block ids of this case's tokens (a slice of the batch's) against the golden and TP1.
    if (cfg.any_sparse()) {
      std::vector<std::vector<int32_t>> mine(cfg.num_hidden_layers), ref(cfg.num_hidden_layers);
      for (int64_t li = 0; li < cfg.num_hidden_layers; ++li) {
        if (!cfg.layer_is_sparse[li]) continue;
        const auto& a = pre.got.msa_blocks.at(li);
        const auto& b = pre.want.msa_blocks.at(li);
        ASSERT_EQ(a.size(), static_cast<size_t>(toks * width)) << "layer " << li;
        ASSERT_EQ(b.size(), a.size()) << "layer " << li;
        mine[li].assign(a.begin() + s.tok0 * width, a.begin() + (s.tok0 + s.ids.size()) * width);
        ref[li].assign(b.begin() + s.tok0 * width, b.begin() + (s.tok0 + s.ids.size()) * width);
      }
      expect_msa_matches_golden(c, mine, cfg, s.ids.size(), cname, &msa_compared, nullptr, &ref);
    }
  }

  // 2. Greedy decode of every case together, one token per case per step (the golden tokens fed
  //    back), sampled on the DP ranks' devices; every row's logits within kDpTol of TP1's.
  size_t steps = 0;
  for (const auto& c : g["cases"]) steps = std::max(steps, c["greedy_ids"].size());
  for (size_t step = 0; step + 1 < steps; ++step) {
    std::vector<SequenceChunk> dc;
    std::vector<size_t> which;
    std::vector<std::vector<int32_t>> feed;
    feed.reserve(cs.size());
    ci = 0;
    for (const auto& c : g["cases"]) {
      const auto gw = c["greedy_ids"].get<std::vector<int32_t>>();
      if (step + 1 < gw.size()) {
        feed.push_back({gw[step]});
        dc.push_back({cs[ci].seq, feed.back(), false});
        which.push_back(static_cast<size_t>(ci));
      }
      ++ci;
    }
    const auto d = p.step(dc, false, /*greedy_on_device=*/true);
    ASSERT_EQ(d.got.sampled.size(), dc.size());
    ASSERT_EQ(d.want.sampled.size(), dc.size());
    ASSERT_EQ(d.got.logits_rows, d.batch.host_logits_rows);
    const double e = max_logprob_diff(d.got, d.want, V);
    max_vs_tp1 = std::max(max_vs_tp1, e);
    EXPECT_LT(e, kDpTol) << "decode step " << step;
    for (size_t j = 0; j < dc.size(); ++j) {
      const auto& c = g["cases"][which[j]];
      const auto gw = c["greedy_ids"].get<std::vector<int32_t>>();
      const auto margin = c["greedy_margin"].get<std::vector<double>>();
      if (top2_margin(d.want.logits, static_cast<int64_t>(j), V) > kSampleMargin) {
        EXPECT_EQ(d.got.sampled[j], d.want.sampled[j])
            << c["name"].get<std::string>() << " decode step " << step;
      }
      if (margin[step + 1] >= kGreedyMarginFloor) {
        EXPECT_EQ(d.got.sampled[j], gw[step + 1])
            << c["name"].get<std::string>() << " greedy step " << step + 1;
        ++greedy_compared;
      }
    }
  }
  EXPECT_GT(greedy_compared, 0);
  if (cfg.any_sparse()) {
    EXPECT_GT(msa_compared, 0);
  }
  std::printf("  %s on %s: %zu sequences in one batch (owners of the prefill:",
              case_name(tc).c_str(), p.test->device_name().c_str(), own.size());
  for (int o : own) std::printf(" %d", o);
  std::printf(
      "), max |logprob DP2 - TP1| %.3g, max |logprob DP2 - transformers| %.3g, "
      "%lld MSA selections and %lld device-greedy tokens compared\n",
      max_vs_tp1, max_vs_golden, static_cast<long long>(msa_compared),
      static_cast<long long>(greedy_compared));
}

INSTANTIATE_TEST_SUITE_P(Dp2, DpGolden,
                         ::testing::Values(DpCase{"m3_ratio"}, DpCase{"msa_small_blocks"},
                                           DpCase{"dense_only"}, DpCase{"real_geometry"},
                                           DpCase{"m3_ratio", true},
                                           DpCase{"msa_small_blocks", true},
                                           DpCase{"dense_only", true},
                                           DpCase{"real_geometry", true}),
                         [](const auto& info) { return case_name(info.param); });

// Steps in which one rank has no tokens at all (it still joins every MoE layer's collectives):
// one sequence alone on one rank, single-page spacers alone on it until the next page belongs to
// the other rank, one sequence alone on that one, then both in one step; prefill and
// device-greedy decode, against TP1.
// (expert parallel, DP ranks replaying CUDA graphs of their decode steps)
using EpGraphs = std::tuple<bool, bool>;
std::string ep_graphs_name(const ::testing::TestParamInfo<EpGraphs>& info) {
  return std::string(std::get<0>(info.param) ? "ep" : "sliced") +
         (std::get<1>(info.param) ? "_graphs" : "_eager");
}

class DpIdle : public ::testing::TestWithParam<EpGraphs> {};

TEST_P(DpIdle, OneRankWithoutTokens) {
  SKIP_UNLESS_TWO_GPUS();
  const auto [ep, graphs] = GetParam();
  const std::string name = "msa_small_blocks";
  const json g = read_json(root() + "/" + name + "/golden.json");
  const auto prompt = longest_prompt(g);
  Pair p(name, ep, 2048, 8, graphs);
  const M3Config& cfg = p.config();
  const int64_t V = cfg.vocab_size, bs = cfg.sparse_block_size;
  ASSERT_GE(static_cast<int64_t>(prompt.size()), 4 * bs + 5);
  double worst = 0;
  int compared = 0;
  auto check = [&](const Pair::Out& o, const char* what) {
    const double e = max_logprob_diff(o.got, o.want, V);
    worst = std::max(worst, e);
    EXPECT_LT(e, kDpTol) << what;
    if (!o.batch.device_samples.empty()) {
      ASSERT_EQ(o.got.sampled.size(), o.batch.device_samples.size()) << what;
      for (size_t j = 0; j < o.got.sampled.size(); ++j) {
        if (top2_margin(o.want.logits, static_cast<int64_t>(j), V) <= kSampleMargin) continue;
        EXPECT_EQ(o.got.sampled[j], o.want.sampled[j]) << what << " row " << j;
        ++compared;
      }
    }
  };
  // A: 2 pages minus 4 tokens (pages 0-1, on page 0's owner), then 3 decode steps inside its
  // second page: every step has one idle rank.
  const int a = p.pages->add_sequence();
  const std::vector<int32_t> pa(prompt.begin(), prompt.begin() + 2 * bs - 4);
  const int ra = p.next_owner();
  auto o = p.step({{a, pa, true}});
  ASSERT_EQ(owners(o.batch), std::vector<int>({ra}));
  check(o, "A prefill alone");
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> t = {prompt[2 * bs - 4 + i]};
    check(p.step({{a, t, false}}, false, true), "A decode alone");
  }
  // While a new sequence would land on A's rank too: single-page sequences C (each a step with
  // the other rank idle), so that B starts on the other rank.
  std::vector<int> cs;
  std::vector<std::vector<int32_t>> pcs;
  pcs.reserve(kMaxSpacers);
  while (p.next_owner() == ra) {
    ASSERT_LT(cs.size(), static_cast<size_t>(kMaxSpacers));
    cs.push_back(p.pages->add_sequence());
    pcs.emplace_back(prompt.begin() + 5 + cs.size(), prompt.begin() + 5 + cs.size() + bs);
    o = p.step({{cs.back(), pcs.back(), true}});
    ASSERT_EQ(owners(o.batch), std::vector<int>({ra}));
    check(o, "C prefill alone");
  }
  const int b = p.pages->add_sequence();
  const std::vector<int32_t> pb(prompt.begin() + 1, prompt.begin() + 1 + 3 * bs);
  o = p.step({{b, pb, true}});
  ASSERT_EQ(owners(o.batch), std::vector<int>({1 - ra}));
  check(o, "B prefill alone on the other rank");
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> t = {prompt[1 + 3 * bs + i]};
    check(p.step({{b, t, false}}, false, true), "B decode alone on the other rank");
  }
  // Both ranks again, uneven row counts (A's rank: A (and a C) decode; B's: B prefills a chunk).
  const std::vector<int32_t> ta = {prompt[2 * bs - 1]}, tc = {prompt[7 + bs]};
  const std::vector<int32_t> tb(prompt.begin() + 4 + 3 * bs, prompt.begin() + 4 + 3 * bs + 5);
  std::vector<SequenceChunk> mixed = {{a, ta, false}, {b, tb, true}};
  if (!cs.empty()) mixed.push_back({cs[0], tc, false});
  check(p.step(mixed, false, true), "A, B (5 tokens), C in one step");
  EXPECT_GT(compared, 0);
  std::printf(
      "  idle-rank steps (%s, %s): max |logprob DP2 - TP1| %.3g, %d device samples "
      "compared\n",
      ep ? "expert parallel" : "sliced experts", graphs ? "graphs" : "eager", worst, compared);
}

INSTANTIATE_TEST_SUITE_P(Dp2, DpIdle,
                         ::testing::Values(EpGraphs{false, false}, EpGraphs{true, false},
                                           EpGraphs{true, true}),
                         ep_graphs_name);

// `synthetic:layers=4` (M3's real shapes: 6144 hidden, 128 experts, the grouped MoE path at
// decode), each DP rank generating its slices (its expert halves, everything else whole): one
// sequence per rank in one batch, a 300- and a 170-token prefill, then 12 decode steps of both.
// Tolerance kSynthTol, derived as tp_cuda_test's: logits reach |z| ~ 5 through fp32 sums of 6144
// and 12288 terms; regrouping a sum into per-rank partials + a reduce-scatter (or running it over
// another row count) changes it by ~n * 2^-24 relative in the worst case (~1e-3 of |z| for 12288
// terms, typically sqrt(n) * 2^-24 ~ 1e-5), compounded over four layers: 2e-3, while a token
// meeting the wrong experts moves logprobs by O(1) with random weights.
constexpr double kSynthTol = 2e-3;

class DpSynthetic : public ::testing::TestWithParam<EpGraphs> {};

TEST_P(DpSynthetic, Dp2MatchesTp1AtM3Shapes) {
  SKIP_UNLESS_TWO_GPUS();
  const auto [ep, graphs] = GetParam();
  Pair p("synthetic:layers=4", ep, 1024, 4, graphs);
  // The 300-token sequence fills pages 0-2, so the second starts on page 3, whose owner differs
  // from page 0's: one sequence per rank.
  ASSERT_NE(owner_of_page(0), owner_of_page(3));
  multi_gpu::expect_synthetic_decode_matches(
      p, kSynthTol,
      std::string("synthetic:layers=4 DP2") + (ep ? "+EP" : "") + (graphs ? " graphs" : " eager"),
      [](const multi_gpu::BackendPair::Out& o) {
        EXPECT_EQ(owners(o.batch), std::vector<int>({owner_of_page(0), owner_of_page(3)}));
      });
}

INSTANTIATE_TEST_SUITE_P(Synthetic, DpSynthetic,
                         ::testing::Values(EpGraphs{false, false}, EpGraphs{true, false},
                                           EpGraphs{false, true}, EpGraphs{true, true}),
                         ep_graphs_name);

TEST(DpCuda, MoreRanksThanGpusIsRefusedWithTheCount) {
  const int n = gpu_count();
  auto be = make_cuda_data_parallel_backend(load("m3_ratio"), CudaBackendOptions{}, n + 2);
  ASSERT_FALSE(be.has_value());
  const std::string& msg = be.error().message;
  EXPECT_NE(msg.find("--data-parallel-size " + std::to_string(n + 2)), std::string::npos) << msg;
  EXPECT_NE(msg.find("has " + std::to_string(n) + " visible"), std::string::npos) << msg;
}

TEST(DpCuda, AnUndividedExpertSplitIsRefusedBeforeAnyGpuWork) {
  // m3_ratio has 16 experts: 3 ranks of whole experts do not divide them (checked before the
  // GPU count, so this runs on any machine).
  auto be = make_cuda_data_parallel_backend(load("m3_ratio"), CudaBackendOptions{}, 3, true);
  ASSERT_FALSE(be.has_value());
  EXPECT_NE(be.error().message.find("does not divide the routed experts"), std::string::npos)
      << be.error().message;
}

#ifdef M3_TEST_ENGINE
// The engine on the DP2 backend (what `serve --device cuda --data-parallel-size 2` runs): greedy
// generations of every golden case, submitted at once (batched steps over both ranks), equal the
// TP1 engine's token for token, up to the golden near-ties; with partitioned pools (serve's
// default: the scheduler keeps each sequence in one rank's partition) and with one shared
// page-id space. Partitioned, the engine sees twice the pages of one GPU's pool.
class DpEngine : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(DpEngine, GreedyDp2EqualsTp1) {
  SKIP_UNLESS_TWO_GPUS();
  const auto [ep, partitioned] = GetParam();
  const std::string name = "msa_small_blocks";
  const json g = read_json(root() + "/" + name + "/golden.json");
  const auto reqs = engine::testing::golden_greedy_requests(g);
  ASSERT_FALSE(reqs.empty());
  auto run = [&](int dp, int64_t* kv_blocks) {
    engine::EngineConfig ec;
    ec.model_dir = root() + "/" + name;
    ec.block_size = 8;  // msa_small_blocks' sparse_block_size
    ec.max_model_len = 256;
    CudaBackendOptions opts;
    opts.kv_cache_memory_bytes = 4096 * KvCache::page_bytes(load(name)->config());  // per GPU
    opts.dp_kv_partitions = partitioned;
    ec.backend_factory = [opts, dp, ep](std::unique_ptr<M3Model> host, int64_t) {
      return make_cuda_data_parallel_backend(std::move(host), opts, dp, ep);
    };
    auto e = engine::Engine::create(ec);
    M3_CHECK(e.has_value(), "%s", e ? "" : e.error().message.c_str());
    *kv_blocks = (*e)->model_info().num_kv_blocks;
    return engine::testing::generate_all(**e, reqs);  // batched steps spread over the ranks
  };
  int64_t blocks1 = 0, blocks2 = 0;
  const auto one = run(1, &blocks1), two = run(2, &blocks2);
  EXPECT_EQ(blocks1, 4096);
  EXPECT_EQ(blocks2, partitioned ? 2 * 4096 : 4096);
  ASSERT_EQ(one.size(), reqs.size());
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_EQ(two[i], one[i]) << "case " << i;
}

INSTANTIATE_TEST_SUITE_P(Dp2, DpEngine,
                         ::testing::Values(std::make_tuple(false, true),
                                           std::make_tuple(true, true),
                                           std::make_tuple(true, false)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "ep" : "sliced") +
                                  (std::get<1>(info.param) ? "_partitioned" : "_shared");
                         });
#endif

}  // namespace
}  // namespace m3::model
