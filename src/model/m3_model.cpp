#include "model/m3_model.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "kernels/cpu/ops.h"
#include "model/synthetic_model.h"

namespace m3::model {

namespace ops = kernels::cpu;

Result<std::unique_ptr<M3Model>> M3Model::load(const std::string& model_dir,
                                               const LoadOptions& opts) {
  if (is_synthetic_model(model_dir)) {
    M3_TRY(SyntheticSpec spec, parse_synthetic_spec(model_dir));
    return config_only(synthetic_m3_config(spec.layers));
  }
  M3_TRY(M3Config cfg, load_config(model_dir));
  std::vector<std::string> skip;
  if (opts.language_model_only) {
    skip = {"vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
            "model.multi_modal_projector."};
  }
  M3_TRY(Checkpoint ck, Checkpoint::open(model_dir, skip));
  auto ckpt = std::make_shared<Checkpoint>(std::move(ck));
  M3_TRY(auto w, load_weights(ckpt, cfg));
  return std::make_unique<M3Model>(std::move(cfg), std::move(w));
}

namespace {
ShardPlan unsharded_plan(const M3Config& cfg) {
  auto p = make_shard_plan(cfg, ShardSpec{});
  M3_CHECK(p.has_value(), "unsharded plan: %s", p ? "" : p.error().message.c_str());
  return *p;
}
}  // namespace

M3Model::M3Model(M3Config cfg, std::unique_ptr<M3Weights> w)
    : cfg_(std::move(cfg)), base_(std::move(w)), w_(base_), plan_(unsharded_plan(cfg_)) {}

M3Model::M3Model(M3Config cfg, std::shared_ptr<const M3Weights> base,
                 std::unique_ptr<M3Weights> views, ShardPlan plan, dist::Communicator* comm)
    : cfg_(std::move(cfg)), base_(std::move(base)), w_(std::move(views)), plan_(plan),
      comm_(comm) {}

Result<std::unique_ptr<M3Model>> M3Model::make_shard(const ShardSpec& spec) const {
  if (!has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "a config-only (synthetic) model has no host weights to shard",
                      "--tensor-parallel-size");
  }
  M3_CHECK(!plan_.sharded(), "make_shard on a model that is already a shard");
  M3_CHECK(spec.world == 1 || spec.comm != nullptr, "a sharded model needs a communicator");
  M3_TRY(ShardPlan plan, make_shard_plan(cfg_, spec));
  auto views = shard_weights(*base_, cfg_, plan);
  return std::unique_ptr<M3Model>(
      new M3Model(cfg_, base_, std::move(views), plan, plan.sharded() ? spec.comm : nullptr));
}

void M3Model::all_reduce(std::vector<float>& v, int64_t n) const {
  if (plan_.tensor_sharded()) comm_->all_reduce_sum(v.data(), n);
}

void M3Model::embed(const ForwardBatch& b, float* x) const {
  const int64_t T = static_cast<int64_t>(b.token_ids.size()), H = cfg_.hidden_size;
  if (!plan_.tensor_sharded()) {
    ops::embedding(w_->embed_tokens, b.token_ids.data(), T, x);
    return;
  }
  // This rank's vocabulary rows; other tokens' rows stay zero and arrive through the all-reduce
  // (one non-zero term per element, so the sum is exact).
  std::fill(x, x + T * H, 0.f);
  const int64_t v0 = plan_.vocab_begin, v1 = v0 + plan_.vocab_count;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = b.token_ids[t];
    M3_CHECK(id >= 0 && id < cfg_.vocab_size, "embedding id %d out of range", id);
    if (id < v0 || id >= v1) continue;
    const int32_t local = static_cast<int32_t>(id - v0);
    ops::embedding(w_->embed_tokens, &local, 1, x + t * H);
  }
  comm_->all_reduce_sum(x, T * H);
}

std::vector<int32_t> M3Model::gather_msa(const std::vector<int32_t>& sel, int64_t T) const {
  if (!plan_.tensor_sharded()) return sel;
  // Each rank selected blocks for its KV heads; lay them out as [T, num_kv_heads, topk]. With
  // replicated KV heads several ranks hold the same head and the same selection.
  const int64_t k = cfg_.sparse_topk_blocks, nl = plan_.num_kv_heads,
                nkv = cfg_.num_key_value_heads, W = plan_.world;
  std::vector<int32_t> all(W * T * nl * k);
  comm_->all_gather(sel.data(), T * nl * k, all.data());
  std::vector<int32_t> full(T * nkv * k, -1);
  for (int w = 0; w < W; ++w) {
    const int64_t g0 = plan_.kv_head_begin_of(w);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < nl; ++j)
        std::copy_n(all.begin() + ((w * T + t) * nl + j) * k, k,
                    full.begin() + (t * nkv + g0 + j) * k);
  }
  return full;
}

void M3Model::lm_head(const float* hs, int64_t R, float* logits) const {
  const int64_t V = cfg_.vocab_size;
  if (!plan_.tensor_sharded()) {
    ops::linear(hs, R, w_->lm_head, logits);  // logits: [R, vocab] f32
    return;
  }
  // Each rank scores its vocabulary chunk (padded to vocab_chunk columns so the all-gather has
  // one size), then the chunks are laid side by side.
  const int64_t C = plan_.vocab_chunk, W = plan_.world;
  std::vector<float> mine(R * C, 0.f), local(R * plan_.vocab_count);
  if (plan_.vocab_count > 0) ops::linear(hs, R, w_->lm_head, local.data());
  for (int64_t r = 0; r < R; ++r)
    std::copy(local.begin() + r * plan_.vocab_count, local.begin() + (r + 1) * plan_.vocab_count,
              mine.begin() + r * C);
  std::vector<float> all(W * R * C);
  comm_->all_gather(mine.data(), R * C, all.data());
  for (int64_t w = 0; w < W; ++w) {
    const int64_t v0 = std::min(V, w * C), n = std::min(V, v0 + C) - v0;
    for (int64_t r = 0; r < R; ++r)
      std::copy(all.begin() + (w * R + r) * C, all.begin() + (w * R + r) * C + n,
                logits + r * V + v0);
  }
}

std::unique_ptr<M3Model> M3Model::config_only(M3Config cfg) {
  return std::make_unique<M3Model>(std::move(cfg), std::make_unique<M3Weights>());
}

Status M3Model::validate_prompt(std::span<const int32_t> ids) const {
  return validate_prompt_ids(cfg_, ids);
}

Status validate_prompt_ids(const M3Config& cfg, std::span<const int32_t> ids) {
  if (ids.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the prompt is empty; give at least one token", "prompt");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= cfg.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "prompt token " + std::to_string(i) + " has id " + std::to_string(ids[i]) +
                            ", outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")",
                        "prompt");
    }
  }
  return {};
}

void M3Model::dense_mlp(const MatRef& gate, const MatRef& up, const MatRef& down, const float* x,
                        int64_t n, float* out) const {
  const int64_t inter = gate.rows;
  std::vector<float> g(n * inter), u(n * inter);
  ops::linear(x, n, gate, g.data());  // g: [n, inter] f32
  ops::linear(x, n, up, u.data());    // u: [n, inter] f32
  ops::swiglu_oai(g.data(), u.data(), n, inter, static_cast<float>(cfg_.swiglu_alpha),
                  static_cast<float>(cfg_.swiglu_limit), static_cast<float>(cfg_.swiglu_beta),
                  g.data());
  ops::linear(g.data(), n, down, out);  // out: [n, hidden] f32
}

void M3Model::routed_experts(const LayerWeights& L, const float* x, int64_t n,
                             float* routed) const {
  const int64_t h = cfg_.hidden_size, ne = cfg_.num_local_experts, k = cfg_.num_experts_per_tok;
  // Router in fp32 (the router weight is f32 in M3 checkpoints), bias for selection only.
  std::vector<float> logits(n * ne);  // [n, experts] f32
  ops::linear(x, n, L.router, logits.data());
  std::vector<float> bias;
  if (L.router_bias.n > 0) {
    bias.resize(ne);
    L.router_bias.to_f32(bias.data());
  }
  std::vector<int32_t> ids(n * k);
  std::vector<float> wts(n * k);
  ops::router_topk(logits.data(), n, ne, bias.empty() ? nullptr : bias.data(), k,
                   static_cast<float>(cfg_.routed_scaling_factor), ids.data(), wts.data());
  // Group tokens by expert, run each expert once over its tokens, scatter back weighted.
  std::vector<std::vector<std::pair<int32_t, float>>> by_expert(ne);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) by_expert[ids[t * k + j]].push_back({(int32_t)t, wts[t * k + j]});
  std::fill(routed, routed + n * h, 0.f);  // [n, hidden] f32
  std::vector<float> xe, ye;
  // This rank's experts: all of them (unsharded, or sliced by TP), or [e0, e0 + n) under EP.
  const int64_t e0 = plan_.expert_begin;
  for (int64_t e = e0; e < e0 + plan_.num_experts; ++e) {
    const auto& toks = by_expert[e];
    if (toks.empty()) continue;
    const ExpertWeights& E = L.experts[e - e0];
    const int64_t m = static_cast<int64_t>(toks.size());
    xe.resize(m * h);
    ye.resize(m * h);
    for (int64_t i = 0; i < m; ++i)
      std::copy(x + toks[i].first * h, x + (toks[i].first + 1) * h, xe.begin() + i * h);
    dense_mlp(E.w1, E.w3, E.w2, xe.data(), m, ye.data());
    for (int64_t i = 0; i < m; ++i) {
      float* r = routed + toks[i].first * h;
      const float wgt = toks[i].second;
      for (int64_t c = 0; c < h; ++c) r[c] += wgt * ye[i * h + c];
    }
  }
}

void M3Model::routed_experts_dp(const LayerWeights& L, const float* x, int64_t n,
                                float* routed) const {
  // Attention data parallel: every rank's tokens meet every rank's experts. All-gather the
  // tokens (padded to the largest rank's count), apply this rank's experts to all of them, and
  // reduce-scatter the partial outputs back to the ranks that own the tokens. Every rank joins,
  // also with n == 0.
  const int64_t h = cfg_.hidden_size, W = plan_.world;
  const int32_t mine = static_cast<int32_t>(n);
  std::vector<int32_t> counts(W);
  comm_->all_gather(&mine, 1, counts.data());
  const int64_t nmax = *std::max_element(counts.begin(), counts.end());
  if (nmax == 0) return;
  std::vector<float> send(nmax * h, 0.f), all(W * nmax * h);
  if (n > 0) std::copy(x, x + n * h, send.begin());
  comm_->all_gather(send.data(), nmax * h, all.data());
  int64_t total = 0;
  for (int64_t w = 0; w < W; ++w) total += counts[w];
  std::vector<float> xc(total * h), rc(total * h);  // compacted [total, hidden]
  for (int64_t w = 0, o = 0; w < W; o += counts[w], ++w)
    std::copy_n(all.begin() + w * nmax * h, counts[w] * h, xc.begin() + o * h);
  routed_experts(L, xc.data(), total, rc.data());
  std::fill(all.begin(), all.end(), 0.f);  // reused as the padded partial outputs
  for (int64_t w = 0, o = 0; w < W; o += counts[w], ++w)
    std::copy_n(rc.begin() + o * h, counts[w] * h, all.begin() + w * nmax * h);
  comm_->reduce_scatter_sum(all.data(), nmax * h, send.data());
  if (n > 0) std::copy_n(send.begin(), n * h, routed);
}

void M3Model::moe(const LayerWeights& L, const float* x, int64_t n, float* out) const {
  const int64_t h = cfg_.hidden_size;
  std::vector<float> routed(n * h, 0.f);  // [n, hidden] f32
  if (plan_.data_sharded()) {
    routed_experts_dp(L, x, n, routed.data());
  } else {
    routed_experts(L, x, n, routed.data());
  }
  if (n == 0) return;  // a data-parallel rank without tokens this step
  if (L.has_shared_expert) {
    dense_mlp(L.shared_gate, L.shared_up, L.shared_down, x, n, out);
    for (int64_t i = 0; i < n * h; ++i) out[i] += routed[i];
  } else {
    std::copy(routed.begin(), routed.end(), out);
  }
}

void M3Model::forward(const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                      bool capture_msa) const {
  if (plan_.data_sharded()) {
    forward_dp(b, cache, out, capture_msa);
  } else {
    forward_local(b, cache, out, capture_msa);
  }
}

namespace {
// Rows of `width` values from every rank, each with a destination row id, written to
// dst[id * width ..]: the variable-count gather of data-parallel outputs (padded all-gathers).
template <class V>
void gather_rows(dist::Communicator& comm, const std::vector<V>& rows,
                 const std::vector<int32_t>& ids, int64_t width, V* dst) {
  const int64_t W = comm.world_size();
  const int32_t n = static_cast<int32_t>(ids.size());
  std::vector<int32_t> counts(W);
  comm.all_gather(&n, 1, counts.data());
  const int64_t nmax = *std::max_element(counts.begin(), counts.end());
  if (nmax == 0) return;
  std::vector<V> send(nmax * width), all(W * nmax * width);
  std::vector<int32_t> sid(nmax, -1), aid(W * nmax);
  std::copy_n(rows.begin(), static_cast<int64_t>(n) * width, send.begin());
  std::copy(ids.begin(), ids.end(), sid.begin());
  comm.all_gather(send.data(), nmax * width, all.data());
  comm.all_gather(sid.data(), nmax, aid.data());
  for (int64_t w = 0; w < W; ++w)
    for (int64_t i = 0; i < counts[w]; ++i)
      std::copy_n(all.begin() + (w * nmax + i) * width, width, dst + aid[w * nmax + i] * width);
}
}  // namespace

void M3Model::forward_dp(const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                         bool capture_msa) const {
  const int64_t T = static_cast<int64_t>(b.token_ids.size()), V = cfg_.vocab_size;
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  // This rank's tokens: those of the sequences it owns (by first KV page). The block tables are
  // kept whole, so seq_ids stay valid; with partitioned pages, this rank's sequences' pages
  // become its local ids and every other sequence's (never read here) page 0.
  ForwardBatch lb;
  lb.block_table_offsets = b.block_table_offsets;
  lb.block_table = b.block_table;
  if (plan_.dp_pages_per_rank > 0) {
    const int64_t S = static_cast<int64_t>(b.block_table_offsets.size()) - 1;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t p0 = b.block_table_offsets[s], p1 = b.block_table_offsets[s + 1];
      const bool mine = p1 > p0 && plan_.dp_owner(b.block_table[p0]) == plan_.rank;
      for (int32_t i = p0; i < p1; ++i) {
        if (!mine) {
          lb.block_table[i] = 0;
          continue;
        }
        const int32_t local = plan_.dp_local_page(b.block_table[i]);
        M3_CHECK(local >= 0 && local < plan_.dp_pages_per_rank,
                 "sequence %lld has pages in two data-parallel partitions (%d and %d)",
                 static_cast<long long>(s), b.block_table[p0], b.block_table[i]);
        lb.block_table[i] = local;
      }
    }
  }
  std::vector<int32_t> tok_global, local_of(T, -1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = b.seq_ids[t];
    M3_CHECK(b.block_table_offsets[s + 1] > b.block_table_offsets[s], "sequence %d has no pages", s);
    if (plan_.dp_owner(b.block_table[b.block_table_offsets[s]]) != plan_.rank) continue;
    local_of[t] = static_cast<int32_t>(lb.token_ids.size());
    tok_global.push_back(static_cast<int32_t>(t));
    lb.token_ids.push_back(b.token_ids[t]);
    lb.positions.push_back(b.positions[t]);
    lb.seq_ids.push_back(s);
  }
  std::vector<int32_t> row_global;
  for (size_t g = 0; g < b.logits_indices.size(); ++g) {
    const int32_t t = b.logits_indices[g];
    M3_CHECK(t >= 0 && t < T);
    if (local_of[t] < 0) continue;
    lb.logits_indices.push_back(local_of[t]);
    row_global.push_back(static_cast<int32_t>(g));
  }
  ForwardResult local;
  if (!lb.token_ids.empty()) {
    forward_local(lb, cache, &local, capture_msa);
  } else {
    // No sequence of ours this step: still join every MoE layer's collectives.
    for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li)
      if (cfg_.layer_is_moe[li]) moe(w_->layers[li], nullptr, 0, nullptr);
  }
  ForwardResult scratch;
  if (out == nullptr) out = &scratch;
  out->vocab_size = V;
  out->logits.assign(b.logits_indices.size() * V, 0.f);
  gather_rows(*comm_, local.logits, row_global, V, out->logits.data());
  out->msa_blocks.clear();
  if (!capture_msa) return;
  out->msa_blocks.resize(cfg_.num_hidden_layers);
  const int64_t width = cfg_.num_key_value_heads * cfg_.sparse_topk_blocks;
  for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li) {
    if (!cfg_.layer_is_sparse[li]) continue;
    out->msa_blocks[li].assign(T * width, -1);
    const std::vector<int32_t> none;
    const auto& sel = local.msa_blocks.empty() ? none : local.msa_blocks[li];
    gather_rows(*comm_, sel, tok_global, width, out->msa_blocks[li].data());
  }
}

void M3Model::forward_local(const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                            bool capture_msa) const {
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  M3_CHECK(has_weights(), "M3Model::forward on a config-only (synthetic) model");
  // Heads of this rank (all of them unless sharded).
  const int64_t H = cfg_.hidden_size, nq = plan_.num_q_heads, nkv = plan_.num_kv_heads,
                d = cfg_.head_dim;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  ops::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = b.positions.data();
  layout.seq_ids = b.seq_ids.data();
  layout.block_table_offsets = b.block_table_offsets.data();
  layout.block_table = b.block_table.data();

  // A shard always produces logits: the lm_head all-gather is a collective every rank joins.
  ForwardResult scratch;
  if (out == nullptr && plan_.tensor_sharded()) out = &scratch;

  std::vector<float> x(T * H);  // residual stream [T, hidden] f32, identical on every rank
  embed(b, x.data());

  std::vector<float> a(T * H), q(T * nq * d), k(T * nkv * d), v(T * nkv * d);
  std::vector<float> attn(T * nq * d), y(T * H);
  std::vector<float> iq, ik;
  std::vector<int32_t> sel;
  if (out) {
    out->msa_blocks.clear();
    if (capture_msa) out->msa_blocks.resize(cfg_.num_hidden_layers);
  }

  for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li) {
    const LayerWeights& L = w_->layers[li];
    const bool sparse = cfg_.layer_is_sparse[li];
    ops::rmsnorm_gemma(x.data(), T, H, L.input_norm, eps, a.data());
    ops::linear(a.data(), T, L.q_proj, q.data());  // q: [T, nq, d]
    ops::linear(a.data(), T, L.k_proj, k.data());  // k: [T, nkv, d]
    ops::linear(a.data(), T, L.v_proj, v.data());  // v: [T, nkv, d]
    ops::rmsnorm_gemma(q.data(), T * nq, d, L.q_norm, eps, q.data());
    ops::rmsnorm_gemma(k.data(), T * nkv, d, L.k_norm, eps, k.data());
    ops::rope_neox(q.data(), T, nq, d, cfg_.rotary_dim, b.positions.data(), cfg_.rope_theta);
    ops::rope_neox(k.data(), T, nkv, d, cfg_.rotary_dim, b.positions.data(), cfg_.rope_theta);
    ops::KvPages pages = cache.layer(li);
    M3_CHECK(pages.num_kv_heads == nkv, "the KV cache holds %lld KV heads, this model %lld",
             (long long)pages.num_kv_heads, (long long)nkv);
    if (sparse) {
      // Index-q heads follow the KV heads (index_n_heads == num_key_value_heads, config.cpp).
      const int64_t ni = nkv, di = cfg_.index_head_dim;
      const int64_t irot = std::min(cfg_.rotary_dim, di);
      iq.resize(T * ni * di);
      ik.resize(T * di);
      ops::linear(a.data(), T, L.index_q_proj, iq.data());  // iq: [T, ni, di]
      ops::linear(a.data(), T, L.index_k_proj, ik.data());  // ik: [T, di] (one shared head)
      ops::rmsnorm_gemma(iq.data(), T * ni, di, L.index_q_norm, eps, iq.data());
      ops::rmsnorm_gemma(ik.data(), T, di, L.index_k_norm, eps, ik.data());
      ops::rope_neox(iq.data(), T, ni, di, irot, b.positions.data(), cfg_.rope_theta);
      ops::rope_neox(ik.data(), T, 1, di, irot, b.positions.data(), cfg_.rope_theta);
      ops::kv_write(pages, layout, k.data(), v.data(), ik.data());
      const int64_t topk = cfg_.sparse_topk_blocks;
      sel.resize(T * ni * topk);
      ops::msa_select_blocks(iq.data(), ni, pages, layout, topk, cfg_.sparse_init_blocks,
                             cfg_.sparse_local_blocks, sel.data());
      ops::attention_paged(q.data(), nq, pages, layout, sel.data(), topk, scale, attn.data());
      if (out && capture_msa) out->msa_blocks[li] = gather_msa(sel, T);
    } else {
      ops::kv_write(pages, layout, k.data(), v.data(), nullptr);
      ops::attention_paged(q.data(), nq, pages, layout, nullptr, 0, scale, attn.data());
    }
    ops::linear(attn.data(), T, L.o_proj, y.data());  // y: [T, hidden]
    all_reduce(y, T * H);  // sharded: partial sums over this rank's heads
    for (int64_t i = 0; i < T * H; ++i) x[i] += y[i];

    ops::rmsnorm_gemma(x.data(), T, H, L.post_attention_norm, eps, a.data());
    if (cfg_.layer_is_moe[li]) {
      moe(L, a.data(), T, y.data());
    } else {
      dense_mlp(L.gate_proj, L.up_proj, L.down_proj, a.data(), T, y.data());
    }
    all_reduce(y, T * H);  // sharded: partial sums over intermediate slices / experts
    for (int64_t i = 0; i < T * H; ++i) x[i] += y[i];
  }

  if (!out) return;
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  out->vocab_size = cfg_.vocab_size;
  out->logits.assign(R * cfg_.vocab_size, 0.f);
  if (R == 0) return;
  std::vector<float> hs(R * H);  // final-normed hidden states of the wanted rows
  for (int64_t r = 0; r < R; ++r) {
    const int32_t t = b.logits_indices[r];
    M3_CHECK(t >= 0 && t < T);
    std::copy(x.begin() + t * H, x.begin() + (t + 1) * H, hs.begin() + r * H);
  }
  ops::rmsnorm_gemma(hs.data(), R, H, w_->final_norm, eps, hs.data());
  lm_head(hs.data(), R, out->logits.data());
}

}  // namespace m3::model
