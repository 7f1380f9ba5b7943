#include "model/m3_model.h"

#include <cmath>

#include "core/check.h"
#include "kernels/cpu/ops.h"

namespace m3::model {

namespace ops = kernels::cpu;

Result<std::unique_ptr<M3Model>> M3Model::load(const std::string& model_dir,
                                               const LoadOptions& opts) {
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

M3Model::M3Model(M3Config cfg, std::unique_ptr<M3Weights> w)
    : cfg_(std::move(cfg)), w_(std::move(w)) {}

Status M3Model::validate_prompt(std::span<const int32_t> ids) const {
  if (ids.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the prompt is empty; give at least one token", "prompt");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= cfg_.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "prompt token " + std::to_string(i) + " has id " + std::to_string(ids[i]) +
                            ", outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) + ")",
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

void M3Model::moe(const LayerWeights& L, const float* x, int64_t n, float* out) const {
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
  std::vector<float> routed(n * h, 0.f);  // [n, hidden] f32
  std::vector<float> xe, ye;
  for (int64_t e = 0; e < ne; ++e) {
    const auto& toks = by_expert[e];
    if (toks.empty()) continue;
    const int64_t m = static_cast<int64_t>(toks.size());
    xe.resize(m * h);
    ye.resize(m * h);
    for (int64_t i = 0; i < m; ++i)
      std::copy(x + toks[i].first * h, x + (toks[i].first + 1) * h, xe.begin() + i * h);
    dense_mlp(L.experts[e].w1, L.experts[e].w3, L.experts[e].w2, xe.data(), m, ye.data());
    for (int64_t i = 0; i < m; ++i) {
      float* r = routed.data() + toks[i].first * h;
      const float wgt = toks[i].second;
      for (int64_t c = 0; c < h; ++c) r[c] += wgt * ye[i * h + c];
    }
  }
  if (L.has_shared_expert) {
    dense_mlp(L.shared_gate, L.shared_up, L.shared_down, x, n, out);
    for (int64_t i = 0; i < n * h; ++i) out[i] += routed[i];
  } else {
    std::copy(routed.begin(), routed.end(), out);
  }
}

void M3Model::forward(const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                      bool capture_msa) const {
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  const int64_t H = cfg_.hidden_size, nq = cfg_.num_attention_heads,
                nkv = cfg_.num_key_value_heads, d = cfg_.head_dim;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  ops::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = b.positions.data();
  layout.seq_ids = b.seq_ids.data();
  layout.block_table_offsets = b.block_table_offsets.data();
  layout.block_table = b.block_table.data();

  std::vector<float> x(T * H);  // residual stream [T, hidden] f32
  ops::embedding(w_->embed_tokens, b.token_ids.data(), T, x.data());

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
    if (sparse) {
      const int64_t ni = cfg_.index_n_heads, di = cfg_.index_head_dim;
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
      if (out && capture_msa) out->msa_blocks[li] = sel;
    } else {
      ops::kv_write(pages, layout, k.data(), v.data(), nullptr);
      ops::attention_paged(q.data(), nq, pages, layout, nullptr, 0, scale, attn.data());
    }
    ops::linear(attn.data(), T, L.o_proj, y.data());  // y: [T, hidden]
    for (int64_t i = 0; i < T * H; ++i) x[i] += y[i];

    ops::rmsnorm_gemma(x.data(), T, H, L.post_attention_norm, eps, a.data());
    if (cfg_.layer_is_moe[li]) {
      moe(L, a.data(), T, y.data());
    } else {
      dense_mlp(L.gate_proj, L.up_proj, L.down_proj, a.data(), T, y.data());
    }
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
  ops::linear(hs.data(), R, w_->lm_head, out->logits.data());  // logits: [R, vocab] f32
}

}  // namespace m3::model
