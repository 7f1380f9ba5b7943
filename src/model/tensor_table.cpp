#include "model/tensor_table.h"

#include "core/check.h"

namespace m3::model {

namespace {

// Builders of one spec each, so the table below reads as a list.
TensorSpec matrix(std::string name, int64_t layer, int64_t rows, int64_t cols, SplitDim split,
                  SplitBy by, MatRef LayerWeights::*view) {
  TensorSpec t;
  t.names = {std::move(name)};
  t.layer = layer;
  t.rows = rows;
  t.cols = cols;
  t.split = split;
  t.by = by;
  t.layer_mat = view;
  return t;
}

TensorSpec norm(std::string name, int64_t layer, int64_t n, VecRef LayerWeights::*view) {
  TensorSpec t;
  t.names = {std::move(name)};
  t.layer = layer;
  t.rows = n;
  t.vector = true;
  t.init = SyntheticInit::kNorm;
  t.layer_vec = view;
  return t;
}

TensorSpec expert(std::string name, int64_t layer, int64_t experts, int64_t rows, int64_t cols,
                  SplitDim split, MatRef ExpertWeights::*view) {
  TensorSpec t;
  t.names = {std::move(name)};
  t.layer = layer;
  t.experts = experts;
  t.rows = rows;
  t.cols = cols;
  t.split = split;
  t.by = SplitBy::kExpertInter;
  t.expert_mat = view;
  return t;
}

}  // namespace

std::string TensorSpec::name(std::string_view root, size_t spelling, int64_t expert) const {
  M3_CHECK(spelling < names.size());
  std::string n = std::string(root) + names[spelling];
  const size_t at = n.find("{e}");
  if (at != std::string::npos) n.replace(at, 3, std::to_string(expert));
  return n;
}

std::vector<int64_t> TensorSpec::shape() const {
  if (vector) return {rows};
  return {rows, cols};
}

MatRef& TensorSpec::mat(M3Weights& w, int64_t expert) const {
  if (model_mat != nullptr) return w.*model_mat;
  M3_CHECK(layer >= 0 && layer < static_cast<int64_t>(w.layers.size()), "%s: layer %lld",
           names[0].c_str(), static_cast<long long>(layer));
  LayerWeights& L = w.layers[static_cast<size_t>(layer)];
  if (layer_mat != nullptr) return L.*layer_mat;
  M3_CHECK(expert_mat != nullptr && expert >= 0 && expert < static_cast<int64_t>(L.experts.size()),
           "%s: not a matrix view, or expert %lld of %zu", names[0].c_str(),
           static_cast<long long>(expert), L.experts.size());
  return L.experts[static_cast<size_t>(expert)].*expert_mat;
}

const MatRef& TensorSpec::mat(const M3Weights& w, int64_t expert) const {
  return mat(const_cast<M3Weights&>(w), expert);
}

VecRef& TensorSpec::vec(M3Weights& w) const {
  if (model_vec != nullptr) return w.*model_vec;
  M3_CHECK(layer_vec != nullptr && layer >= 0 && layer < static_cast<int64_t>(w.layers.size()),
           "%s: not a vector view, or layer %lld", names[0].c_str(), static_cast<long long>(layer));
  return w.layers[static_cast<size_t>(layer)].*layer_vec;
}

const VecRef& TensorSpec::vec(const M3Weights& w) const {
  return vec(const_cast<M3Weights&>(w));
}

int64_t TensorSpec::count_in(const M3Weights& w) const {
  if (expert_mat == nullptr) return 1;
  return static_cast<int64_t>(w.layers.at(static_cast<size_t>(layer)).experts.size());
}

std::vector<TensorSpec> m3_tensors(const M3Config& cfg) {
  using L = LayerWeights;
  const int64_t h = cfg.hidden_size, d = cfg.head_dim, qs = cfg.q_size(), kvs = cfg.kv_size();
  std::vector<TensorSpec> t;

  TensorSpec embed;
  embed.names = {"model.embed_tokens.weight"};
  embed.rows = cfg.vocab_size;
  embed.cols = h;
  embed.split = SplitDim::kRows;
  embed.by = SplitBy::kVocab;
  embed.init = SyntheticInit::kEmbedding;
  embed.quantizable = false;
  embed.model_mat = &M3Weights::embed_tokens;
  t.push_back(embed);

  TensorSpec final_norm;
  final_norm.names = {"model.norm.weight"};
  final_norm.rows = h;
  final_norm.vector = true;
  final_norm.init = SyntheticInit::kNorm;
  final_norm.model_vec = &M3Weights::final_norm;
  t.push_back(final_norm);

  TensorSpec head = embed;
  head.names = {"lm_head.weight"};
  head.init = SyntheticInit::kLinear;
  head.may_tie = cfg.tie_word_embeddings;
  head.model_mat = &M3Weights::lm_head;
  t.push_back(head);

  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const std::string a = p + "self_attn.";
    t.push_back(norm(p + "input_layernorm.weight", i, h, &L::input_norm));
    t.push_back(norm(p + "post_attention_layernorm.weight", i, h, &L::post_attention_norm));
    t.push_back(
        matrix(a + "q_proj.weight", i, qs, h, SplitDim::kRows, SplitBy::kQHeads, &L::q_proj));
    t.push_back(
        matrix(a + "k_proj.weight", i, kvs, h, SplitDim::kRows, SplitBy::kKvHeads, &L::k_proj));
    t.push_back(
        matrix(a + "v_proj.weight", i, kvs, h, SplitDim::kRows, SplitBy::kKvHeads, &L::v_proj));
    t.push_back(
        matrix(a + "o_proj.weight", i, h, qs, SplitDim::kCols, SplitBy::kQHeads, &L::o_proj));
    t.push_back(norm(a + "q_norm.weight", i, d, &L::q_norm));
    t.push_back(norm(a + "k_norm.weight", i, d, &L::k_norm));
    if (cfg.layer_is_sparse[i]) {
      const int64_t di = cfg.index_head_dim;
      t.push_back(matrix(a + "index_q_proj.weight", i, cfg.index_n_heads * di, h, SplitDim::kRows,
                         SplitBy::kIndexHeads, &L::index_q_proj));
      // Index-K is one head: computed on every rank.
      t.push_back(matrix(a + "index_k_proj.weight", i, di, h, SplitDim::kReplicated, SplitBy::kNone,
                         &L::index_k_proj));
      t.push_back(norm(a + "index_q_norm.weight", i, di, &L::index_q_norm));
      t.push_back(norm(a + "index_k_norm.weight", i, di, &L::index_k_norm));
    }
    if (!cfg.layer_is_moe[i]) {
      // transformers writes the dense MLP under block_sparse_moe. or mlp. (m3-model.md §2.2):
      // the gate's spelling decides its up and down projections'.
      const int64_t di = cfg.dense_intermediate_size;
      const int gate_at = static_cast<int>(t.size());
      auto dense = [&](const std::string& proj, int64_t rows, int64_t cols, SplitDim split,
                       MatRef L::*view) {
        TensorSpec s = matrix(p + "mlp." + proj, i, rows, cols, split, SplitBy::kDense, view);
        s.names.push_back(p + "block_sparse_moe." + proj);
        if (static_cast<int>(t.size()) != gate_at) s.spelling_from = gate_at;
        t.push_back(std::move(s));
      };
      dense("gate_proj.weight", di, h, SplitDim::kRows, &L::gate_proj);
      dense("up_proj.weight", di, h, SplitDim::kRows, &L::up_proj);
      dense("down_proj.weight", h, di, SplitDim::kCols, &L::down_proj);
      continue;
    }
    const std::string m = p + "block_sparse_moe.";
    const int64_t ne = cfg.num_local_experts, ie = cfg.intermediate_size;
    // The router and its bias are f32 in M3 checkpoints and replicated on every rank.
    TensorSpec router =
        matrix(m + "gate.weight", i, ne, h, SplitDim::kReplicated, SplitBy::kNone, &L::router);
    router.synthetic_dtype = DType::kF32;
    router.init = SyntheticInit::kRouter;
    router.quantizable = false;
    t.push_back(router);
    if (cfg.use_routing_bias) {
      TensorSpec bias = norm(m + "e_score_correction_bias", i, ne, &L::router_bias);
      bias.synthetic_dtype = DType::kF32;
      bias.device_f32 = true;
      bias.init = SyntheticInit::kRouterBias;
      t.push_back(bias);
    }
    const std::string e = m + "experts.{e}.";
    t.push_back(expert(e + "w1.weight", i, ne, ie, h, SplitDim::kRows, &ExpertWeights::w1));
    t.push_back(expert(e + "w3.weight", i, ne, ie, h, SplitDim::kRows, &ExpertWeights::w3));
    t.push_back(expert(e + "w2.weight", i, ne, h, ie, SplitDim::kCols, &ExpertWeights::w2));
    if (cfg.n_shared_experts > 0 && cfg.shared_intermediate_size > 0) {
      const int64_t is = cfg.shared_intermediate_size * cfg.n_shared_experts;
      const std::string s = m + "shared_experts.";
      t.push_back(matrix(s + "gate_proj.weight", i, is, h, SplitDim::kRows, SplitBy::kShared,
                         &L::shared_gate));
      t.push_back(
          matrix(s + "up_proj.weight", i, is, h, SplitDim::kRows, SplitBy::kShared, &L::shared_up));
      t.push_back(matrix(s + "down_proj.weight", i, h, is, SplitDim::kCols, SplitBy::kShared,
                         &L::shared_down));
    }
  }
  return t;
}

TensorBlock shard_block(const TensorSpec& t, const M3Config& cfg, const ShardPlan& p) {
  TensorBlock b;
  b.rows = b.row_count = t.rows;
  b.cols = b.col_count = t.cols;
  if (t.experts > 0) {
    b.experts = t.experts;
    b.expert_begin = p.expert_begin;
    b.expert_count = p.num_experts;
  }
  if (t.split == SplitDim::kReplicated) return b;
  const int64_t d = cfg.head_dim, di = cfg.index_head_dim;
  int64_t begin = 0, count = 0;
  switch (t.by) {
    case SplitBy::kQHeads:
      begin = p.q_head_begin * d;
      count = p.num_q_heads * d;
      break;
    case SplitBy::kKvHeads:
      begin = p.kv_head_begin * d;
      count = p.num_kv_heads * d;
      break;
    case SplitBy::kIndexHeads:
      // Index-q heads follow the KV heads under tensor parallelism (m3-model.md §2.9).
      begin = p.tensor_sharded() ? p.kv_head_begin * di : 0;
      count = (p.tensor_sharded() ? p.num_kv_heads : cfg.index_n_heads) * di;
      break;
    case SplitBy::kVocab:
      begin = p.vocab_begin;
      count = p.vocab_count;
      break;
    case SplitBy::kDense:
      begin = p.dense_inter_begin;
      count = p.dense_inter;
      break;
    case SplitBy::kShared:
      begin = p.shared_inter_begin;
      count = p.shared_inter;
      break;
    case SplitBy::kExpertInter:
      begin = p.expert_inter_begin;
      count = p.expert_inter;
      break;
    case SplitBy::kNone:
      M3_CHECK(false, "%s: split without a range", t.names[0].c_str());
  }
  const bool rows = t.split == SplitDim::kRows;
  const int64_t whole = rows ? t.rows : t.cols;
  M3_CHECK(begin >= 0 && count >= 0 && begin + count <= whole,
           "%s: rank %d's range [%lld, +%lld) outside its %lld %s", t.names[0].c_str(), p.rank,
           static_cast<long long>(begin), static_cast<long long>(count),
           static_cast<long long>(whole), rows ? "rows" : "columns");
  (rows ? b.row_begin : b.col_begin) = begin;
  (rows ? b.row_count : b.col_count) = count;
  return b;
}

void size_views(M3Weights& w, const M3Config& cfg, const std::vector<TensorSpec>& table,
                int64_t experts_per_layer) {
  w.layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  for (const TensorSpec& t : table) {
    if (t.layer < 0) continue;
    LayerWeights& L = w.layers[static_cast<size_t>(t.layer)];
    if (t.expert_mat != nullptr) L.experts.resize(static_cast<size_t>(experts_per_layer));
    if (t.by == SplitBy::kShared) L.has_shared_expert = true;
  }
}

bool uploads_quantized(const MatRef& m) {
  return m.quantized() && m.rows > 0 && m.cols % 16 == 0;
}

bool experts_upload_quantized(const LayerWeights& L) {
  if (L.experts.empty()) return false;
  const kernels::WeightQuant q = L.experts[0].w1.quant;
  if (q == kernels::WeightQuant::kNone) return false;
  for (const ExpertWeights& e : L.experts) {
    for (const MatRef* m : {&e.w1, &e.w3, &e.w2})
      if (m->quant != q || !uploads_quantized(*m)) return false;
  }
  return true;
}

size_t view_bytes(const M3Weights& w, const std::vector<TensorSpec>& table, bool as_uploaded) {
  size_t n = 0;
  for (const TensorSpec& t : table) {
    if (t.vector) {
      const VecRef& v = t.vec(w);
      if (v.data == nullptr) continue;
      const size_t es = as_uploaded && t.device_f32 ? sizeof(float) : dtype_size(v.dtype);
      n += static_cast<size_t>(v.n) * es;
      continue;
    }
    if (t.may_tie && t.mat(w).data == w.embed_tokens.data) continue;  // the embedding's view
    for (int64_t e = 0; e < t.count_in(w); ++e) {
      const MatRef& m = t.mat(w, e);
      if (m.data == nullptr) continue;
      // As uploaded: quantized matrices the GPU kernels cannot read, and every routed-expert
      // projection of a MoE layer whose experts cannot all stay quantized, in f32.
      bool widened = m.quantized() && !uploads_quantized(m);
      if (t.experts > 0) {
        const LayerWeights& L = w.layers[static_cast<size_t>(t.layer)];
        bool any = false;
        for (const ExpertWeights& x : L.experts)
          any = any || x.w1.quantized() || x.w3.quantized() || x.w2.quantized();
        widened = any && !experts_upload_quantized(L);
      }
      n += as_uploaded && widened ? static_cast<size_t>(m.rows * m.cols) * 4
                                  : static_cast<size_t>(m.bytes());
    }
  }
  return n;
}

}  // namespace m3::model
