// DpBatchSplit (model/dp_batch_split.h), the host bookkeeping of attention data parallel on
// GPUs, checked without a GPU: the CPU model stands in for each DP rank's GPU model (device
// sampling emulated by a greedy argmax with M3ModelCuda::forward's result contract), each rank
// with its own KV cache, and the merged results must equal the whole batch's on one cache.
// Exact equality: the CPU ops compute every token's row with the same arithmetic whatever else
// is in the batch (the batch only adds rows), so splitting a batch by sequence changes no number;
// a mis-mapped row, sequence or block table shows up as a different logit, id, MSA block or aux
// state (an EAGLE-3 draft's input).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/golden_util.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "runtime/dp_batch_split.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

using namespace golden;

// M3Model::forward, then what M3ModelCuda::forward returns when the batch has device samples:
// the sampled ids (greedy here) and only the host_logits_rows.
void rank_forward(const M3Model& m, const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                  bool capture) {
  m.forward(b, cache, out, capture);
  if (b.device_samples.empty()) return;
  const int64_t V = out->vocab_size;
  const std::vector<float> all = std::move(out->logits);
  out->sampled.clear();
  for (const auto& sr : b.device_samples) {
    const float* row = all.data() + sr.row * V;
    out->sampled.push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
  }
  out->logits_rows = b.host_logits_rows;
  out->logits.clear();
  for (int32_t r : b.host_logits_rows)
    out->logits.insert(out->logits.end(), all.begin() + r * V, all.begin() + (r + 1) * V);
}

struct Harness {
  std::unique_ptr<M3Model> model;
  std::unique_ptr<KvCache> whole;
  std::vector<std::unique_ptr<KvCache>> ranks;
  ShardPlan plan;
  std::unique_ptr<DpBatchSplit> split;
  std::unique_ptr<SequencePages> pages;
  std::vector<int64_t> rank_tokens;  // of the last step, per rank
  // Partitioned pools (pages_per_rank > 0): rank r's cache holds pages [r * P, (r + 1) * P) of
  // the whole numbering as its [0, P). SequencePages bump-allocates one numbering, so each new
  // page of sequence s is renumbered into partition s % world (what the scheduler's partitioned
  // pool does).
  int64_t pages_per_rank = 0;
  std::map<int32_t, int32_t> renumbered;
  std::vector<int32_t> next_in_partition;

  Harness(const std::string& name, int world, int64_t num_pages, bool partitioned = false) {
    auto m = M3Model::load(root() + "/" + name);
    M3_CHECK(m.has_value(), "%s", m ? "" : m.error().message.c_str());
    model = std::move(*m);
    const M3Config& cfg = model->config();
    whole = std::make_unique<KvCache>(cfg, num_pages);
    if (partitioned) {
      M3_CHECK(num_pages % world == 0);
      pages_per_rank = num_pages / world;
      next_in_partition.assign(world, 0);
    }
    for (int r = 0; r < world; ++r)
      ranks.push_back(std::make_unique<KvCache>(cfg, partitioned ? pages_per_rank : num_pages));
    ShardSpec spec;
    spec.world = world;
    spec.data_parallel = true;
    auto p = make_shard_plan(cfg, spec);
    M3_CHECK(p.has_value(), "%s", p ? "" : p.error().message.c_str());
    plan = *p;
    split = std::make_unique<DpBatchSplit>(world);
    pages = std::make_unique<SequencePages>(num_pages, cfg.sparse_block_size);
  }

  // One step on the whole cache and, split, on the ranks' caches; the two results must agree.
  void step(ForwardBatch b, bool capture, const std::string& what) {
    if (pages_per_rank > 0) {
      const int world = static_cast<int>(ranks.size());
      for (size_t s = 0; s + 1 < b.block_table_offsets.size(); ++s) {
        const int part = static_cast<int>(s) % world;
        for (int32_t i = b.block_table_offsets[s]; i < b.block_table_offsets[s + 1]; ++i) {
          auto [it, fresh] = renumbered.try_emplace(b.block_table[i], 0);
          if (fresh) {
            M3_CHECK(next_in_partition[part] < pages_per_rank, "partition %d is full", part);
            it->second = static_cast<int32_t>(part * pages_per_rank + next_in_partition[part]++);
          }
          b.block_table[i] = it->second;
        }
      }
    }
    ForwardResult want, got;
    rank_forward(*model, b, *whole, &want, capture);
    split->split(b, plan, pages_per_rank);
    rank_tokens.assign(ranks.size(), 0);
    for (int r = 0; r < split->world(); ++r) {
      const ForwardBatch& rb = split->batch(r);
      rank_tokens[r] = static_cast<int64_t>(rb.token_ids.size());
      EXPECT_EQ(rb.block_table_offsets.size(),
                std::set<int32_t>(rb.seq_ids.begin(), rb.seq_ids.end()).size() + 1)
          << what << ": rank " << r << " carries block tables of sequences it does not run";
      if (pages_per_rank > 0) {
        // Page ids local to the rank's partition (its cache has pages_per_rank pages).
        for (int32_t page : rb.block_table)
          ASSERT_TRUE(page >= 0 && page < pages_per_rank)
              << what << ": rank " << r << " page " << page;
      }
      if (rb.token_ids.empty()) {
        split->result(r) = ForwardResult{};
      } else {
        rank_forward(*model, rb, *ranks[r], &split->result(r), capture);
      }
    }
    split->merge(b, model->config(), &got, capture);
    EXPECT_EQ(split->max_rank_tokens(), *std::max_element(rank_tokens.begin(), rank_tokens.end()));
    EXPECT_EQ(got.vocab_size, want.vocab_size) << what;
    EXPECT_EQ(got.sampled, want.sampled) << what;
    EXPECT_EQ(got.logits_rows, want.logits_rows) << what;
    ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
    EXPECT_TRUE(got.logits == want.logits) << what;
    ASSERT_EQ(got.msa_blocks.size(), want.msa_blocks.size()) << what;
    for (size_t l = 0; l < got.msa_blocks.size(); ++l)
      EXPECT_EQ(got.msa_blocks[l], want.msa_blocks[l]) << what << " layer " << l;
    EXPECT_EQ(got.aux_hidden.size(), b.aux_layers.size() * b.token_ids.size() *
                                         static_cast<size_t>(model->config().hidden_size))
        << what;
    EXPECT_TRUE(got.aux_hidden == want.aux_hidden) << what << ": the aux states";
  }
};

// Every golden prompt of msa_small_blocks in one prefill batch (all logits, MSA captured), then
// decode steps over all or every other sequence with device samples whose rows are permuted and
// only some rows copied back (the last two with aux states captured), then steps in which one rank
// has nothing.
class DpBatchSplitTest : public ::testing::TestWithParam<bool> {};

TEST_P(DpBatchSplitTest, SplitRanksMergeToTheWholeBatch) {
  const std::string name = "msa_small_blocks";
  const auto g = read_json(root() + "/" + name + "/golden.json");
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& c : g["cases"]) prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
  ASSERT_GE(prompts.size(), 3u);
  Harness h(name, 2, 400, /*partitioned=*/GetParam());
  std::vector<int> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) seqs.push_back(h.pages->add_sequence());

  std::vector<SequenceChunk> pre;
  for (size_t i = 0; i < prompts.size(); ++i) pre.push_back({seqs[i], prompts[i], true});
  h.step(h.pages->build_step(pre), true, "prefill of every prompt");
  ASSERT_GT(h.rank_tokens[0], 0);
  ASSERT_GT(h.rank_tokens[1], 0);

  for (int s = 0; s < 4; ++s) {
    std::vector<SequenceChunk> d;
    std::vector<std::vector<int32_t>> feed(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (s % 2 == 1 && i % 2 == 0) continue;
      feed[i] = {prompts[i][s % prompts[i].size()]};
      d.push_back({seqs[i], feed[i], false});
    }
    ForwardBatch b = h.pages->build_step(d);
    if (s >= 2) b.aux_layers = {0, 1};  // what a speculative step asks for its draft
    const int32_t R = static_cast<int32_t>(b.logits_indices.size());
    for (int32_t r = 0; r < R; ++r) {
      kernels::cpu::SampleRow sr;
      sr.row = (r * 7 + 3) % R;  // samples not in row order
      sr.temperature = 0.f;
      b.device_samples.push_back(sr);
      if (r % 2 == 0) b.host_logits_rows.push_back(r);
    }
    h.step(std::move(b), s == 3, "decode step " + std::to_string(s));
  }

  // Steps with one sequence: its owner runs, the other rank has no tokens.
  const std::vector<int32_t> one = {5};
  for (int i : {0, 1}) {
    ForwardBatch b = h.pages->build_step({{seqs[i], one, true}});
    kernels::cpu::SampleRow sr;
    sr.temperature = 0.f;
    b.device_samples.push_back(sr);
    h.step(std::move(b), true, "sequence " + std::to_string(i) + " alone");
    EXPECT_TRUE(h.rank_tokens[0] == 0 || h.rank_tokens[1] == 0);
  }
}

// Shared page ids (owner = ShardPlan::dp_owner of the first page, every rank caching all pages) and
// partitioned pools (owner = the partition of its pages, page ids made local to the rank).
INSTANTIATE_TEST_SUITE_P(Pools, DpBatchSplitTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "partitioned" : "shared"; });

}  // namespace
}  // namespace m3::model
