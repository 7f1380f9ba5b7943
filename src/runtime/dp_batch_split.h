// DpBatchSplit: the host half of attention data parallel (runtime/cpu_sharded_backend.cpp on the
// CPU, runtime/cuda/cuda_dp_backend.cpp on GPUs): one step's ForwardBatch split into one batch per
// DP rank by sequence owner, and the ranks' ForwardResults merged back into the caller's order. The
// owner is the rank whose page partition holds the sequence's pages (partitioned pools: pages [r *
// P, (r + 1) * P) live on rank r, and the rank sees them as [0, P)), or else ShardPlan::dp_owner of
// its first page (one shared page-id space, every rank allocating all of it). Host code only (no
// CUDA), so its bookkeeping can be checked without a GPU. Invariant: after split(b), batch(r) holds
// exactly b's tokens of the sequences rank r owns, in b's order, with only those sequences' block
// tables (renumbered densely, page ids made local to the rank's partition); merge(b, ...) reads the
// results of that split, each with M3Model::forward's contract (every logits row when the rank's
// batch has no device_samples, else only its host_logits_rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "model/config.h"
#include "model/m3_model.h"
#include "model/shard.h"

namespace m3::runtime {

using model::ForwardBatch;
using model::ForwardResult;
using model::M3Config;
using model::ShardPlan;

class DpBatchSplit {
 public:
  explicit DpBatchSplit(int world) : steps_(static_cast<size_t>(world)) {}

  int world() const { return static_cast<int>(steps_.size()); }
  ForwardBatch& batch(int r) { return steps_[r].batch; }
  ForwardResult& result(int r) { return steps_[r].result; }
  // The largest token count of any rank after split(): the rows every rank's MoE all-gathers.
  int64_t max_rank_tokens() const {
    int64_t n = 0;
    for (const RankStep& st : steps_)
      n = std::max<int64_t>(n, static_cast<int64_t>(st.batch.token_ids.size()));
    return n;
  }

  // Splits b over plan.world ranks (plan: a data-parallel shard's). logits_indices,
  // device_samples' rows and host_logits_rows are renumbered to each rank's own rows.
  // pages_per_rank > 0: partitioned pools (see the header comment); every page of a sequence
  // must lie in its first page's partition (the scheduler keeps it so; a page outside is a bug).
  void split(const ForwardBatch& b, const ShardPlan& plan, int64_t pages_per_rank = 0) {
    M3_CHECK(plan.data_sharded() && plan.world == static_cast<int>(steps_.size()));
    const int64_t T = static_cast<int64_t>(b.token_ids.size());
    M3_CHECK(T > 0 && b.positions.size() == static_cast<size_t>(T) &&
             b.seq_ids.size() == static_cast<size_t>(T));
    M3_CHECK(!b.block_table_offsets.empty());
    const int64_t S = static_cast<int64_t>(b.block_table_offsets.size()) - 1;
    for (RankStep& st : steps_) {
      ForwardBatch& lb = st.batch;
      lb.token_ids.clear();
      lb.positions.clear();
      lb.seq_ids.clear();
      lb.block_table_offsets.assign(1, 0);
      lb.block_table.clear();
      lb.logits_indices.clear();
      lb.device_samples.clear();
      lb.host_logits_rows.clear();
      lb.num_sampleable = b.num_sampleable;
      // An EAGLE-3 draft's aux states: every rank captures them for its own tokens (merge puts
      // them back in b's order).
      lb.aux_layers = b.aux_layers;
      lb.aux_on_device = b.aux_on_device;
    }
    // Sequences: their owner and their id on it (only the owner gets their block table, so a
    // rank's batch stays proportional to its own sequences).
    seq_owner_.assign(S, -1);
    seq_local_.assign(S, -1);
    tok_owner_.resize(T);
    tok_local_.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      const int32_t s = b.seq_ids[t];
      M3_CHECK(s >= 0 && s < S, "token %lld has sequence %d of %lld", static_cast<long long>(t), s,
               static_cast<long long>(S));
      if (seq_owner_[s] < 0) {
        const int32_t p0 = b.block_table_offsets[s], p1 = b.block_table_offsets[s + 1];
        M3_CHECK(p1 > p0, "sequence %d has no pages", s);
        const int32_t first = b.block_table[p0];
        const int r =
            pages_per_rank > 0 ? static_cast<int>(first / pages_per_rank) : plan.dp_owner(first);
        M3_CHECK(r >= 0 && r < plan.world,
                 "sequence %d: page %d is outside the %d partitions of "
                 "%lld pages",
                 s, first, plan.world, static_cast<long long>(pages_per_rank));
        ForwardBatch& lb = steps_[r].batch;
        seq_owner_[s] = r;
        seq_local_[s] = static_cast<int32_t>(lb.block_table_offsets.size()) - 1;
        const int64_t base = pages_per_rank > 0 ? r * pages_per_rank : 0;
        for (int32_t p = p0; p < p1; ++p) {
          const int32_t page = b.block_table[p];
          M3_CHECK(pages_per_rank == 0 || (page >= base && page < base + pages_per_rank),
                   "sequence %d has pages in two data-parallel partitions (%d and %d, %lld "
                   "pages each)",
                   s, first, page, static_cast<long long>(pages_per_rank));
          lb.block_table.push_back(static_cast<int32_t>(page - base));
        }
        lb.block_table_offsets.push_back(static_cast<int32_t>(lb.block_table.size()));
      }
      const int r = seq_owner_[s];
      ForwardBatch& lb = steps_[r].batch;
      tok_owner_[t] = r;
      tok_local_[t] = static_cast<int32_t>(lb.token_ids.size());
      lb.token_ids.push_back(b.token_ids[t]);
      lb.positions.push_back(b.positions[t]);
      lb.seq_ids.push_back(seq_local_[s]);
    }
    // Logits rows, in the caller's order within each rank.
    const int64_t R = static_cast<int64_t>(b.logits_indices.size());
    row_owner_.resize(R);
    row_local_.resize(R);
    for (int64_t g = 0; g < R; ++g) {
      const int32_t t = b.logits_indices[g];
      M3_CHECK(t >= 0 && t < T, "logits index %d of %lld", t, static_cast<long long>(T));
      ForwardBatch& lb = steps_[tok_owner_[t]].batch;
      row_owner_[g] = tok_owner_[t];
      row_local_[g] = static_cast<int32_t>(lb.logits_indices.size());
      lb.logits_indices.push_back(tok_local_[t]);
    }
    // Device samples and the rows still wanted on the host, renumbered to the owner's rows
    // (host_logits_rows stay ascending: a rank's rows keep the caller's order).
    sample_local_.resize(b.device_samples.size());
    for (size_t i = 0; i < b.device_samples.size(); ++i) {
      kernels::cpu::SampleRow sr = b.device_samples[i];
      M3_CHECK(sr.row >= 0 && sr.row < R, "device sample row %d of %lld", sr.row,
               static_cast<long long>(R));
      ForwardBatch& lb = steps_[row_owner_[sr.row]].batch;
      sample_local_[i] = static_cast<int32_t>(lb.device_samples.size());
      sr.row = row_local_[sr.row];
      lb.device_samples.push_back(sr);
    }
    for (const int32_t g : b.host_logits_rows) {
      M3_CHECK(g >= 0 && g < R, "host logits row %d of %lld", g, static_cast<long long>(R));
      steps_[row_owner_[g]].batch.host_logits_rows.push_back(row_local_[g]);
    }
  }

  // `out` as M3Model::forward of the whole of b would fill it (with device samples: sampled in
  // b.device_samples' order, logits of b.host_logits_rows only), from the ranks' results.
  void merge(const ForwardBatch& b, const M3Config& cfg, ForwardResult* out, bool capture_msa) {
    const int64_t V = cfg.vocab_size, T = static_cast<int64_t>(b.token_ids.size());
    out->vocab_size = V;
    out->logits.clear();
    out->logits_rows.clear();
    out->sampled.clear();
    out->msa_blocks.clear();
    out->aux_hidden.clear();
    // Where each rank's local logits row is in its result: every row when the rank sampled
    // nothing on the device, else only its host_logits_rows (M3Model / M3ModelCuda::forward).
    for (RankStep& st : steps_) {
      const int64_t rr = static_cast<int64_t>(st.batch.logits_indices.size());
      st.result_pos.assign(rr, -1);
      if (st.batch.device_samples.empty()) {
        M3_CHECK(st.result.logits.size() == static_cast<size_t>(rr * V),
                 "a data-parallel rank returned %zu logits for %lld rows", st.result.logits.size(),
                 static_cast<long long>(rr));
        for (int64_t j = 0; j < rr; ++j) st.result_pos[j] = static_cast<int32_t>(j);
      } else {
        M3_CHECK(st.result.sampled.size() == st.batch.device_samples.size() &&
                 st.result.logits.size() == st.result.logits_rows.size() * V);
        for (size_t j = 0; j < st.result.logits_rows.size(); ++j)
          st.result_pos[st.result.logits_rows[j]] = static_cast<int32_t>(j);
      }
    }
    auto copy_row = [&](int64_t g, float* dst) {
      const RankStep& st = steps_[row_owner_[g]];
      const int32_t p = st.result_pos[row_local_[g]];
      M3_CHECK(p >= 0, "logits row %lld was not copied back by its rank",
               static_cast<long long>(g));
      std::copy_n(st.result.logits.begin() + p * V, V, dst);
    };
    if (b.device_samples.empty()) {
      const int64_t R = static_cast<int64_t>(b.logits_indices.size());
      out->logits.resize(R * V);
      for (int64_t g = 0; g < R; ++g) copy_row(g, out->logits.data() + g * V);
    } else {
      out->sampled.resize(b.device_samples.size());
      for (size_t i = 0; i < b.device_samples.size(); ++i)
        out->sampled[i] =
            steps_[row_owner_[b.device_samples[i].row]].result.sampled[sample_local_[i]];
      out->logits_rows = b.host_logits_rows;
      out->logits.resize(b.host_logits_rows.size() * V);
      for (size_t j = 0; j < b.host_logits_rows.size(); ++j)
        copy_row(b.host_logits_rows[j], out->logits.data() + j * V);
    }
    if (!b.aux_layers.empty() && !b.aux_on_device) {
      // [T, aux layers x hidden]: each token's row from its owner.
      const int64_t width = static_cast<int64_t>(b.aux_layers.size()) * cfg.hidden_size;
      out->aux_hidden.resize(T * width);
      for (int64_t t = 0; t < T; ++t) {
        const RankStep& st = steps_[tok_owner_[t]];
        M3_CHECK(st.result.aux_hidden.size() == st.batch.token_ids.size() * width,
                 "a data-parallel rank returned %zu aux values for %zu tokens (%lld each)",
                 st.result.aux_hidden.size(), st.batch.token_ids.size(),
                 static_cast<long long>(width));
        std::copy_n(st.result.aux_hidden.begin() + tok_local_[t] * width, width,
                    out->aux_hidden.begin() + t * width);
      }
    }
    if (!capture_msa) return;
    // Per sparse layer [T, all KV heads, topk]: each token's row from its owner (whose cache
    // holds every KV head).
    out->msa_blocks.resize(cfg.num_hidden_layers);
    const int64_t width = cfg.num_key_value_heads * cfg.sparse_topk_blocks;
    for (int64_t li = 0; li < cfg.num_hidden_layers; ++li) {
      if (!cfg.layer_is_sparse[li]) continue;
      auto& dst = out->msa_blocks[li];
      dst.assign(T * width, -1);
      for (int64_t t = 0; t < T; ++t) {
        const RankStep& st = steps_[tok_owner_[t]];
        const auto& src = st.result.msa_blocks.at(li);
        M3_CHECK(src.size() == st.batch.token_ids.size() * width,
                 "layer %lld: a rank's MSA selections have %zu ids for %zu tokens",
                 static_cast<long long>(li), src.size(), st.batch.token_ids.size());
        std::copy_n(src.begin() + tok_local_[t] * width, width, dst.begin() + t * width);
      }
    }
  }

 private:
  // One rank's part of a step: its tokens, its sequences' block tables (local sequence ids), its
  // logits rows and device samples (rows renumbered to its own logits rows), and its result.
  struct RankStep {
    ForwardBatch batch;
    ForwardResult result;
    std::vector<int32_t> result_pos;  // local logits row -> row of result.logits (-1: not copied)
  };
  std::vector<RankStep> steps_;  // per rank, reused across steps
  // The current step's maps (caller's numbering -> owner rank and index there).
  std::vector<int32_t> seq_owner_, seq_local_, tok_owner_, tok_local_, row_owner_, row_local_,
      sample_local_;
};

}  // namespace m3::runtime
