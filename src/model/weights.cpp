#include "model/weights.h"

#include <cstring>

namespace m3::model {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

class Loader {
 public:
  Loader(const Checkpoint& ckpt, M3Weights& w) : ckpt_(ckpt), w_(w) {}

  // The first of `names` present in the checkpoint (alternative spellings of one tensor).
  std::string pick(const std::vector<std::string>& names) const {
    for (const auto& n : names)
      if (ckpt_.has(n)) return n;
    return names.front();
  }

  Result<MatRef> matrix(const std::string& name, int64_t rows, int64_t cols) {
    const TensorInfo* t = ckpt_.find(name);
    if (t && t->dtype == DType::kF8E4M3) return fp8_matrix(*t, rows, cols);
    M3_TRY(const TensorInfo* ti,
           ckpt_.get(name, {rows, cols}, {DType::kBF16, DType::kF32, DType::kF16, DType::kF8E4M3}));
    MatRef m{ti->data, ti->dtype, rows, cols};
    if (ti->dtype == DType::kF16) {
      auto& buf = w_.owned_f32.emplace_back(rows * cols);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(ti->data);
      for (int64_t i = 0; i < rows * cols; ++i) buf[i] = f16_to_f32(src[i]);
      w_.bytes_owned += buf.size() * 4;
      m = MatRef{buf.data(), DType::kF32, rows, cols};
    } else {
      w_.bytes_in_place += ti->nbytes;
    }
    return m;
  }

  Result<VecRef> vector(const std::string& name, int64_t n) {
    M3_TRY(const TensorInfo* ti, ckpt_.get(name, {n}, {DType::kBF16, DType::kF32, DType::kF16}));
    if (ti->dtype == DType::kF16) {
      auto& buf = w_.owned_f32.emplace_back(n);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(ti->data);
      for (int64_t i = 0; i < n; ++i) buf[i] = f16_to_f32(src[i]);
      return VecRef{buf.data(), DType::kF32, n};
    }
    w_.bytes_in_place += ti->nbytes;
    return VecRef{ti->data, ti->dtype, n};
  }

 private:
  // MXFP8: W[o, i] = fp8(Wq[o, i]) * 2^(S[o, i/32] - 127), exact in bf16.
  Result<MatRef> fp8_matrix(const TensorInfo& t, int64_t rows, int64_t cols) {
    if (t.shape != std::vector<int64_t>{rows, cols}) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + t.name + "' has shape " + t.shape_str() + ", expected " +
                            shape_str({rows, cols}) + " (in " + t.file + ")",
                        t.name);
    }
    const std::string scale_name = t.name + "_scale_inv";
    const int64_t nblk = (cols + 31) / 32;
    M3_TRY(const TensorInfo* s, ckpt_.get(scale_name, {rows, nblk}, {DType::kU8}));
    auto& buf = w_.owned_u16.emplace_back(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = fp8_e4m3_to_f32(t.data[r * cols + c]) * e8m0_to_f32(s->data[r * nblk + c / 32]);
        buf[r * cols + c] = f32_to_bf16(v);
      }
    }
    w_.bytes_owned += buf.size() * 2;
    return MatRef{buf.data(), DType::kBF16, rows, cols};
  }

  const Checkpoint& ckpt_;
  M3Weights& w_;
};

}  // namespace

Result<std::unique_ptr<M3Weights>> load_weights(std::shared_ptr<Checkpoint> ckpt,
                                                const M3Config& cfg) {
  auto w = std::make_unique<M3Weights>();
  w->checkpoint = ckpt;
  Loader ld(*ckpt, *w);
  // Shipped VL checkpoints use "language_model.model."; text-only exports use "model.".
  std::string base = "language_model.model.";
  std::string head = "language_model.lm_head.weight";
  if (!ckpt->has(base + "embed_tokens.weight") && ckpt->has("model.embed_tokens.weight")) {
    base = "model.";
    head = "lm_head.weight";
  }
  const int64_t h = cfg.hidden_size;
  M3_TRY(w->embed_tokens, ld.matrix(base + "embed_tokens.weight", cfg.vocab_size, h));
  M3_TRY(w->final_norm, ld.vector(base + "norm.weight", h));
  if (cfg.tie_word_embeddings && !ckpt->has(head)) {
    w->lm_head = w->embed_tokens;
  } else {
    M3_TRY(w->lm_head, ld.matrix(head, cfg.vocab_size, h));
  }
  const int64_t qs = cfg.q_size(), kvs = cfg.kv_size();
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = base + "layers." + std::to_string(i) + ".";
    LayerWeights L;
    M3_TRY(L.input_norm, ld.vector(p + "input_layernorm.weight", h));
    M3_TRY(L.post_attention_norm, ld.vector(p + "post_attention_layernorm.weight", h));
    M3_TRY(L.q_proj, ld.matrix(p + "self_attn.q_proj.weight", qs, h));
    M3_TRY(L.k_proj, ld.matrix(p + "self_attn.k_proj.weight", kvs, h));
    M3_TRY(L.v_proj, ld.matrix(p + "self_attn.v_proj.weight", kvs, h));
    M3_TRY(L.o_proj, ld.matrix(p + "self_attn.o_proj.weight", h, qs));
    M3_TRY(L.q_norm, ld.vector(p + "self_attn.q_norm.weight", cfg.head_dim));
    M3_TRY(L.k_norm, ld.vector(p + "self_attn.k_norm.weight", cfg.head_dim));
    if (cfg.layer_is_sparse[i]) {
      const int64_t di = cfg.index_head_dim;
      M3_TRY(L.index_q_proj, ld.matrix(p + "self_attn.index_q_proj.weight", cfg.index_n_heads * di, h));
      M3_TRY(L.index_k_proj, ld.matrix(p + "self_attn.index_k_proj.weight", di, h));
      M3_TRY(L.index_q_norm, ld.vector(p + "self_attn.index_q_norm.weight", di));
      M3_TRY(L.index_k_norm, ld.vector(p + "self_attn.index_k_norm.weight", di));
    }
    if (!cfg.layer_is_moe[i]) {
      // transformers writes the dense MLP under block_sparse_moe. or mlp. (m3-model.md §2.2).
      const int64_t di = cfg.dense_intermediate_size;
      const std::string gate = ld.pick({p + "mlp.gate_proj.weight", p + "block_sparse_moe.gate_proj.weight"});
      const std::string pre = gate.substr(0, gate.size() - std::string("gate_proj.weight").size());
      M3_TRY(L.gate_proj, ld.matrix(pre + "gate_proj.weight", di, h));
      M3_TRY(L.up_proj, ld.matrix(pre + "up_proj.weight", di, h));
      M3_TRY(L.down_proj, ld.matrix(pre + "down_proj.weight", h, di));
    } else {
      const std::string mp = p + "block_sparse_moe.";
      const int64_t ne = cfg.num_local_experts, ie = cfg.intermediate_size;
      M3_TRY(L.router, ld.matrix(mp + "gate.weight", ne, h));
      if (cfg.use_routing_bias) {
        M3_TRY(L.router_bias, ld.vector(mp + "e_score_correction_bias", ne));
      }
      L.experts.resize(ne);
      for (int64_t e = 0; e < ne; ++e) {
        const std::string ep = mp + "experts." + std::to_string(e) + ".";
        M3_TRY(L.experts[e].w1, ld.matrix(ep + "w1.weight", ie, h));
        M3_TRY(L.experts[e].w3, ld.matrix(ep + "w3.weight", ie, h));
        M3_TRY(L.experts[e].w2, ld.matrix(ep + "w2.weight", h, ie));
      }
      if (cfg.n_shared_experts > 0 && cfg.shared_intermediate_size > 0) {
        const int64_t is = cfg.shared_intermediate_size * cfg.n_shared_experts;
        L.has_shared_expert = true;
        M3_TRY(L.shared_gate, ld.matrix(mp + "shared_experts.gate_proj.weight", is, h));
        M3_TRY(L.shared_up, ld.matrix(mp + "shared_experts.up_proj.weight", is, h));
        M3_TRY(L.shared_down, ld.matrix(mp + "shared_experts.down_proj.weight", h, is));
      }
    }
    w->layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace m3::model
