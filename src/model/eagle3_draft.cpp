#include "model/eagle3_draft.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "model/cpu_ops.h"
#include "model/eagle3_forward.h"
#include "model/safetensors.h"

namespace m3::model {

namespace {

using json = nlohmann::json;

Error bad(const std::string& msg) {
  return Error{ErrorCode::kInvalidArgument, msg, "--speculative-config"};
}

Result<int64_t> get_int(const json& j, const char* key, const std::string& src, int64_t dflt = -1) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (dflt >= 0) return dflt;
    return tl::unexpected(bad(src + ": the EAGLE-3 draft config has no \"" + key + "\""));
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 0) {
    return tl::unexpected(
        bad(src + ": \"" + key + "\" must be a non-negative integer, got " + it->dump()));
  }
  return it->get<int64_t>();
}

}  // namespace

std::string Eagle3Config::summary() const {
  std::string aux;
  for (int32_t l : aux_layer_ids) aux += (aux.empty() ? "" : ",") + std::to_string(l);
  const bool mha = num_key_value_heads == num_attention_heads;
  return "EAGLE-3 draft: 1 layer, hidden " + std::to_string(hidden_size) + ", " +
         std::to_string(num_attention_heads) + " heads x " + std::to_string(head_dim) + " (" +
         (mha ? std::string("MHA") : "GQA, " + std::to_string(num_key_value_heads) + " KV heads") +
         "), mlp " + std::to_string(intermediate_size) + ", aux layers " + aux + ", vocab " +
         std::to_string(draft_vocab_size) +
         (draft_vocab_size != vocab_size ? " (d2t map to " + std::to_string(vocab_size) + ")" : "");
}

Result<Eagle3Config> load_eagle3_config(const std::string& dir, const M3Config& target) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return tl::unexpected(Error{ErrorCode::kNotFound,
                                "cannot open " + path +
                                    "; the speculative-config \"model\" must be a directory "
                                    "with the EAGLE-3 draft's config.json and safetensors",
                                "--speculative-config"});
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return tl::unexpected(bad(path + " is not a JSON object"));
  bool eagle3 = false;
  std::string archs;
  if (auto a = j.find("architectures"); a != j.end() && a->is_array()) {
    for (const auto& x : *a) {
      if (!x.is_string()) continue;
      const std::string s = x.get<std::string>();
      archs += (archs.empty() ? "" : ", ") + s;
      eagle3 |= s == "LlamaForCausalLMEagle3" || s == "Eagle3LlamaForCausalLM";
    }
  }
  if (!eagle3) {
    return tl::unexpected(bad(path + ": architectures is [" + archs +
                              "]; m3serve's eagle3 method reads LlamaForCausalLMEagle3 drafts"));
  }
  Eagle3Config c;
  M3_TRY(c.hidden_size, get_int(j, "hidden_size", path));
  M3_TRY(c.num_attention_heads, get_int(j, "num_attention_heads", path));
  M3_TRY(c.num_key_value_heads, get_int(j, "num_key_value_heads", path, c.num_attention_heads));
  M3_TRY(c.intermediate_size, get_int(j, "intermediate_size", path));
  M3_TRY(c.vocab_size, get_int(j, "vocab_size", path));
  M3_TRY(c.draft_vocab_size, get_int(j, "draft_vocab_size", path, c.vocab_size));
  M3_TRY(c.target_hidden_size, get_int(j, "target_hidden_size", path, target.hidden_size));
  if (c.num_attention_heads < 1 || c.hidden_size < 1 || c.intermediate_size < 1) {
    return tl::unexpected(bad(path + ": hidden_size, num_attention_heads and intermediate_size "
                                     "must be positive"));
  }
  M3_TRY(c.head_dim, get_int(j, "head_dim", path, c.hidden_size / c.num_attention_heads));
  if (c.num_key_value_heads < 1 || c.num_attention_heads % c.num_key_value_heads != 0 ||
      c.head_dim < 2 || c.head_dim % 2 != 0) {
    return tl::unexpected(bad(path + ": " + std::to_string(c.num_attention_heads) + " heads over " +
                              std::to_string(c.num_key_value_heads) + " KV heads of head_dim " +
                              std::to_string(c.head_dim) + " is not a valid MHA/GQA layout"));
  }
  if (auto e = j.find("rms_norm_eps"); e != j.end() && e->is_number()) c.rms_norm_eps = *e;
  if (auto t = j.find("rope_theta"); t != j.end() && t->is_number()) c.rope_theta = *t;
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object()) {
    if (auto t = rp->find("rope_theta"); t != rp->end() && t->is_number()) c.rope_theta = *t;
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    const std::string type = rs->is_object() ? rs->value("rope_type", rs->value("type", "")) : "";
    if (type != "default") {
      return tl::unexpected(Error{ErrorCode::kUnsupported,
                                  path + ": rope_scaling " + rs->dump() +
                                      " is not implemented for the draft layer (plain RoPE only)",
                                  "--speculative-config"});
    }
  }
  if (auto act = j.find("hidden_act"); act != j.end() && act->is_string() && *act != "silu") {
    return tl::unexpected(Error{ErrorCode::kUnsupported,
                                path + ": hidden_act " + act->dump() +
                                    " is not implemented for the draft layer (silu only)",
                                "--speculative-config"});
  }
  const json* ids = nullptr;
  if (auto ec = j.find("eagle_config"); ec != j.end() && ec->is_object()) {
    if (auto a = ec->find("eagle_aux_hidden_state_layer_ids"); a != ec->end() && !a->is_null())
      ids = &*a;
  }
  if (ids == nullptr) {
    if (auto a = j.find("eagle_aux_hidden_state_layer_ids"); a != j.end() && !a->is_null())
      ids = &*a;
  }
  const int64_t L = target.num_hidden_layers;
  if (ids != nullptr) {
    if (!ids->is_array() || ids->empty()) {
      return tl::unexpected(
          bad(path + ": eagle_aux_hidden_state_layer_ids must be a non-empty list of layer ids"));
    }
    for (const auto& x : *ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > L) {
        return tl::unexpected(bad(path + ": aux hidden state layer id " + x.dump() +
                                  " is outside [0, " + std::to_string(L) + "] for a " +
                                  std::to_string(L) + "-layer target"));
      }
      c.aux_layer_ids.push_back(x.get<int32_t>());
    }
    c.aux_layers_from_config = true;
  } else {
    // vLLM's default for EAGLE-3 (and SGLang's capture list): (2, L/2, L-3) -> 2, 30, 57 for M3.
    for (int64_t l : {int64_t{2}, L / 2, L - 3})
      c.aux_layer_ids.push_back(static_cast<int32_t>(std::clamp<int64_t>(l, 0, L)));
  }
  return c;
}

bool is_synthetic_draft(const std::string& model) {
  return model.rfind("synthetic:", 0) == 0;
}

Result<Eagle3Config> synthetic_eagle3_config(const std::string& model, const M3Config& target) {
  const bool mha = model == "synthetic:mha", gqa = model == "synthetic:gqa";
  if (!mha && !gqa) {
    return tl::unexpected(bad("the synthetic draft '" + model +
                              "' is unknown; use synthetic:mha or synthetic:gqa (benchmarks "
                              "only: random weights of M3's draft shapes)"));
  }
  Eagle3Config c;
  c.hidden_size = target.hidden_size;
  c.target_hidden_size = target.hidden_size;
  c.head_dim = 128;
  c.num_attention_heads = std::max<int64_t>(1, target.hidden_size / c.head_dim);
  // GQA: 16x fewer KV heads where the head count allows, else one.
  c.num_key_value_heads = mha ? c.num_attention_heads
                              : (c.num_attention_heads % 16 == 0 ? c.num_attention_heads / 16 : 1);
  c.intermediate_size = 4 * target.hidden_size;
  c.vocab_size = target.vocab_size;
  c.draft_vocab_size = target.vocab_size;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  const int64_t L = target.num_hidden_layers;
  for (int64_t l : {int64_t{2}, L / 2, L - 3})
    c.aux_layer_ids.push_back(static_cast<int32_t>(std::clamp<int64_t>(l, 0, L)));
  return c;
}

int64_t Eagle3Draft::kv_bytes_per_token() const {
  return KvCache::page_bytes(cache_cfg_) / cache_cfg_.sparse_block_size;
}

Eagle3Draft::Eagle3Draft(Eagle3Config cfg, std::unique_ptr<Eagle3Weights> w, int64_t page_size,
                         int64_t num_pages)
    : cfg_(std::move(cfg)), w_(std::move(w)) {
  cache_cfg_.num_hidden_layers = 1;
  cache_cfg_.num_attention_heads = cfg_.num_attention_heads;
  cache_cfg_.num_key_value_heads = cfg_.num_key_value_heads;
  cache_cfg_.head_dim = cfg_.head_dim;
  cache_cfg_.hidden_size = cfg_.hidden_size;
  cache_cfg_.sparse_block_size = page_size;
  cache_cfg_.layer_is_sparse = {false};
  cache_cfg_.layer_is_moe = {false};
  cache_cfg_.kv_cache_dtype = kernels::KvDtype::kF32;
  cache_ = std::make_unique<KvCache>(cache_cfg_, num_pages);
  ops_ = std::make_unique<CpuOps>();
  fw_ = std::make_unique<Eagle3Forward<CpuOps>>(cfg_, *w_);
}

Eagle3Draft::~Eagle3Draft() = default;

void Eagle3Draft::forward(const DraftBatch& b, DraftResult* out) {
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  const int64_t H = cfg_.hidden_size;
  const int64_t in_w =
      b.hidden_is_aux ? static_cast<int64_t>(cfg_.aux_layer_ids.size()) * cfg_.target_hidden_size
                      : H;
  M3_CHECK(T > 0 && b.positions.size() == static_cast<size_t>(T) &&
               b.seq_ids.size() == static_cast<size_t>(T) &&
               b.hidden.size() == static_cast<size_t>(T * in_w),
           "draft step: %lld tokens, %zu hidden floats (rows of %lld)", static_cast<long long>(T),
           b.hidden.size(), static_cast<long long>(in_w));
  kernels::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = b.positions.data();
  layout.seq_ids = b.seq_ids.data();
  layout.block_table_offsets = b.block_table_offsets.data();
  layout.block_table = b.block_table.data();
  const int64_t max_pos = *std::max_element(b.positions.begin(), b.positions.end());
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  const int64_t Vd = cfg_.draft_vocab_size;
  std::vector<float> logits(static_cast<size_t>(R * Vd));
  fw_->run(*ops_, b.token_ids.data(), layout, cache_->layer(0), b.hidden.data(), b.hidden_is_aux,
           max_pos + 1, b.logits_indices.data(), R, logits.data());
  const float* x = ops_->f32(Buf::kX, 0);
  out->prenorm.assign(x, x + T * H);
  out->argmax_tokens.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* l = logits.data() + r * Vd;
    int64_t best = 0;
    for (int64_t i = 1; i < Vd; ++i)
      if (l[i] > l[best]) best = i;
    out->argmax_tokens[r] =
        w_->draft_to_target.empty() ? static_cast<int32_t>(best) : w_->draft_to_target[best];
  }
}

Result<std::unique_ptr<Eagle3Draft>> Eagle3Draft::load(
    const std::string& dir, const M3Config& target, std::shared_ptr<const M3Weights> target_weights,
    int64_t num_pages) {
  if (target_weights == nullptr || target_weights->embed_tokens.data == nullptr) {
    return tl::unexpected(Error{ErrorCode::kUnsupported,
                                "the EAGLE-3 draft on the host shares the target's embedding and "
                                "LM head, but this target has no host weights (a synthetic "
                                "model); run the draft on the GPU backend (--device cuda)",
                                "--speculative-config"});
  }
  M3_TRY(Eagle3Checkpoint ck, load_eagle3_checkpoint(dir, target, std::move(target_weights)));
  return std::make_unique<Eagle3Draft>(std::move(ck.config), std::move(ck.weights),
                                       target.sparse_block_size, num_pages);
}

Result<Eagle3Checkpoint> load_eagle3_checkpoint(const std::string& dir, const M3Config& target,
                                                std::shared_ptr<const M3Weights> target_weights) {
  M3_TRY(Eagle3Config c, load_eagle3_config(dir, target));
  const std::string src = dir + "/config.json";
  if (c.vocab_size != target.vocab_size) {
    return tl::unexpected(bad("the draft's vocabulary (" + std::to_string(c.vocab_size) + " in " +
                              src + ") does not match the target's (" +
                              std::to_string(target.vocab_size) +
                              "): use a draft trained for this model"));
  }
  if (c.target_hidden_size != target.hidden_size) {
    return tl::unexpected(
        bad("the draft reads target hidden states of " + std::to_string(c.target_hidden_size) +
            " (" + src + " target_hidden_size) but the target's hidden size is " +
            std::to_string(target.hidden_size) + ": use a draft trained for this model"));
  }
  M3_TRY(Checkpoint ck, Checkpoint::open(dir));
  auto w = std::make_unique<Eagle3Weights>();
  w->checkpoint = std::make_shared<Checkpoint>(std::move(ck));
  w->target = target_weights;
  const Checkpoint& cp = *w->checkpoint;
  // Names as vLLM / SpecForge write them: `midlayer.` (or `layers.0.`), optionally under `model.`.
  auto find = [&](const std::string& name) -> std::string {
    for (const std::string& pre : {std::string(), std::string("model.")}) {
      if (cp.has(pre + name)) return pre + name;
      if (name.rfind("midlayer.", 0) == 0 && cp.has(pre + "layers.0." + name.substr(9)))
        return pre + "layers.0." + name.substr(9);
    }
    return name;
  };
  const std::vector<DType> fdt = {DType::kBF16, DType::kF32, DType::kF16};
  auto mat = [&](const std::string& name, int64_t rows, int64_t cols) -> Result<kernels::MatRef> {
    M3_TRY(const TensorInfo* t, cp.get(find(name), {rows, cols}, fdt));
    kernels::MatRef m{t->data, t->dtype, rows, cols};
    if (t->dtype == DType::kF16) {
      auto& v = w->owned_f32.emplace_back(static_cast<size_t>(rows * cols));
      const uint16_t* p = reinterpret_cast<const uint16_t*>(t->data);
      for (int64_t i = 0; i < rows * cols; ++i) v[i] = f16_to_f32(p[i]);
      m = kernels::MatRef{v.data(), DType::kF32, rows, cols};
    }
    return m;
  };
  const int64_t H = c.hidden_size;
  // Llama RMSNorm (x * w) read by the Gemma-form op (x * (1 + w')): w' = w - 1.
  auto norm = [&](const std::string& name) -> Result<kernels::VecRef> {
    M3_TRY(const TensorInfo* t, cp.get(find(name), {H}, fdt));
    auto& v = w->owned_f32.emplace_back(static_cast<size_t>(H));
    for (int64_t i = 0; i < H; ++i) {
      float x = 0.f;
      if (t->dtype == DType::kF32) x = reinterpret_cast<const float*>(t->data)[i];
      if (t->dtype == DType::kBF16) x = bf16_to_f32(reinterpret_cast<const uint16_t*>(t->data)[i]);
      if (t->dtype == DType::kF16) x = f16_to_f32(reinterpret_cast<const uint16_t*>(t->data)[i]);
      v[i] = x - 1.0f;
    }
    return kernels::VecRef{v.data(), DType::kF32, H};
  };
  const int64_t naux = static_cast<int64_t>(c.aux_layer_ids.size());
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  if (const TensorInfo* fc = cp.find(find("fc.weight"));
      fc != nullptr && fc->shape.size() == 2 && fc->shape[1] != naux * target.hidden_size) {
    return tl::unexpected(bad("the draft's fc.weight is " + fc->shape_str() + ": it reads " +
                              std::to_string(fc->shape[1]) + " columns, but " +
                              std::to_string(naux) + " aux layers of the target's hidden size " +
                              std::to_string(target.hidden_size) + " are " +
                              std::to_string(naux * target.hidden_size)));
  }
  M3_TRY(w->fc, mat("fc.weight", H, naux * target.hidden_size));
  M3_TRY(w->q_proj, mat("midlayer.self_attn.q_proj.weight", q, 2 * H));
  M3_TRY(w->k_proj, mat("midlayer.self_attn.k_proj.weight", kv, 2 * H));
  M3_TRY(w->v_proj, mat("midlayer.self_attn.v_proj.weight", kv, 2 * H));
  M3_TRY(w->o_proj, mat("midlayer.self_attn.o_proj.weight", H, q));
  M3_TRY(w->gate_proj, mat("midlayer.mlp.gate_proj.weight", c.intermediate_size, H));
  M3_TRY(w->up_proj, mat("midlayer.mlp.up_proj.weight", c.intermediate_size, H));
  M3_TRY(w->down_proj, mat("midlayer.mlp.down_proj.weight", H, c.intermediate_size));
  M3_TRY(w->input_norm, norm("midlayer.input_layernorm.weight"));
  M3_TRY(w->hidden_norm, norm("midlayer.hidden_norm.weight"));
  M3_TRY(w->post_attention_norm, norm("midlayer.post_attention_layernorm.weight"));
  M3_TRY(w->final_norm, norm("norm.weight"));
  // The embedding and LM head: the draft's own when it ships them, else the target's (which
  // requires the same hidden size).
  if (cp.has(find("embed_tokens.weight"))) {
    M3_TRY(w->embed_tokens, mat("embed_tokens.weight", c.vocab_size, H));
    w->own_embed = true;
  }
  if (cp.has("lm_head.weight")) {
    M3_TRY(w->lm_head, mat("lm_head.weight", c.draft_vocab_size, H));
    w->own_lm_head = true;
  }
  if ((!w->own_embed || !w->own_lm_head) && H != target.hidden_size) {
    return tl::unexpected(bad("the draft's hidden size (" + std::to_string(H) + " in " + src +
                              ") does not match the target's (" +
                              std::to_string(target.hidden_size) +
                              "), whose embedding and LM head it shares: use a draft trained "
                              "for this model"));
  }
  const bool host_target =
      target_weights != nullptr && target_weights->embed_tokens.data != nullptr;
  if (!w->own_embed && host_target) w->embed_tokens = target_weights->embed_tokens;
  if (!w->own_lm_head) {
    if (c.draft_vocab_size != c.vocab_size) {
      return tl::unexpected(bad("the draft has a vocabulary of " +
                                std::to_string(c.draft_vocab_size) +
                                " (draft_vocab_size) but no lm_head.weight of its own; the "
                                "target's LM head has " +
                                std::to_string(target.vocab_size) + " rows"));
    }
    if (host_target) w->lm_head = target_weights->lm_head;
  }
  if (c.draft_vocab_size != c.vocab_size) {
    M3_TRY(const TensorInfo* d2t, cp.get(find("d2t"), {c.draft_vocab_size}, {DType::kI64}));
    const int64_t* p = reinterpret_cast<const int64_t*>(d2t->data);
    w->draft_to_target.resize(c.draft_vocab_size);
    for (int64_t i = 0; i < c.draft_vocab_size; ++i) {
      const int64_t t = i + p[i];  // d2t holds offsets: target id = draft id + d2t[draft id]
      if (t < 0 || t >= c.vocab_size) {
        return tl::unexpected(bad("the draft's d2t maps draft id " + std::to_string(i) +
                                  " to target id " + std::to_string(t) + ", outside [0, " +
                                  std::to_string(c.vocab_size) + ")"));
      }
      w->draft_to_target[i] = static_cast<int32_t>(t);
    }
  }
  Eagle3Checkpoint out;
  out.config = std::move(c);
  out.weights = std::move(w);
  return out;
}

namespace {

class HostProposer final : public DraftProposer {
 public:
  explicit HostProposer(std::unique_ptr<Eagle3Draft> d) : draft_(std::move(d)) {}
  const Eagle3Config& config() const override { return draft_->config(); }
  int64_t kv_bytes_per_token() const override { return draft_->kv_bytes_per_token(); }
  std::string where() const override { return "host"; }

  std::vector<std::vector<int32_t>> propose(const std::vector<DraftSeq>& seqs,
                                            std::span<const float> aux_hidden, int k) override {
    const Eagle3Config& dc = draft_->config();
    const int64_t aux_w = static_cast<int64_t>(dc.aux_layer_ids.size()) * dc.target_hidden_size;
    const int64_t H = dc.hidden_size;
    std::vector<std::vector<int32_t>> out(seqs.size());
    // Context pass: every verified position of the step, with the target's aux states.
    DraftBatch b;
    b.hidden_is_aux = true;
    b.block_table_offsets.push_back(0);
    std::vector<int> last_row(seqs.size(), -1);  // row of each seq's last position in b
    std::vector<int> logits_of(seqs.size(), -1);
    int32_t s_idx = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const DraftSeq& s = seqs[i];
      if (s.num_valid <= 0) continue;
      M3_CHECK(static_cast<int>(s.next_tokens.size()) == s.num_valid);
      b.block_table.insert(b.block_table.end(), s.block_table.begin(), s.block_table.end());
      b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
      for (int j = 0; j < s.num_valid; ++j) {
        b.token_ids.push_back(s.next_tokens[j]);
        b.positions.push_back(s.start_pos + j);
        b.seq_ids.push_back(s_idx);
        const float* h = aux_hidden.data() + static_cast<int64_t>(s.first_row + j) * aux_w;
        M3_CHECK(static_cast<size_t>((s.first_row + j + 1) * aux_w) <= aux_hidden.size(),
                 "draft: aux hidden row %d outside the step", s.first_row + j);
        b.hidden.insert(b.hidden.end(), h, h + aux_w);
      }
      last_row[i] = static_cast<int>(b.token_ids.size()) - 1;
      if (s.num_propose > 0) {
        logits_of[i] = static_cast<int>(b.logits_indices.size());
        b.logits_indices.push_back(last_row[i]);
      }
      ++s_idx;
    }
    if (b.token_ids.empty()) return out;
    DraftResult r;
    draft_->forward(b, &r);
    // Autoregressive draft steps: each proposing seq feeds its last proposal and the draft's
    // own pre-norm output back in, one position further.
    std::vector<std::vector<float>> h(seqs.size());
    std::vector<int> pos(seqs.size(), 0);
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (logits_of[i] < 0) continue;
      out[i].push_back(r.argmax_tokens[logits_of[i]]);
      h[i].assign(r.prenorm.begin() + static_cast<int64_t>(last_row[i]) * H,
                  r.prenorm.begin() + static_cast<int64_t>(last_row[i] + 1) * H);
      pos[i] = seqs[i].start_pos + seqs[i].num_valid;  // where the first proposal's KV goes
    }
    for (int step = 1; step < k; ++step) {
      DraftBatch d;
      d.hidden_is_aux = false;
      d.block_table_offsets.push_back(0);
      std::vector<size_t> who;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const DraftSeq& s = seqs[i];
        if (static_cast<int>(out[i].size()) != step || step >= s.num_propose ||
            pos[i] >= s.capacity)
          continue;
        d.block_table.insert(d.block_table.end(), s.block_table.begin(), s.block_table.end());
        d.block_table_offsets.push_back(static_cast<int32_t>(d.block_table.size()));
        d.token_ids.push_back(out[i].back());
        d.positions.push_back(pos[i]);
        d.seq_ids.push_back(static_cast<int32_t>(who.size()));
        d.hidden.insert(d.hidden.end(), h[i].begin(), h[i].end());
        d.logits_indices.push_back(static_cast<int32_t>(who.size()));
        who.push_back(i);
      }
      if (who.empty()) break;
      DraftResult dr;
      draft_->forward(d, &dr);
      for (size_t w = 0; w < who.size(); ++w) {
        const size_t i = who[w];
        out[i].push_back(dr.argmax_tokens[w]);
        h[i].assign(dr.prenorm.begin() + static_cast<int64_t>(w) * H,
                    dr.prenorm.begin() + static_cast<int64_t>(w + 1) * H);
        ++pos[i];
      }
    }
    return out;
  }

 private:
  std::unique_ptr<Eagle3Draft> draft_;
};

}  // namespace

std::unique_ptr<DraftProposer> host_draft_proposer(std::unique_ptr<Eagle3Draft> draft) {
  M3_CHECK(draft != nullptr);
  return std::make_unique<HostProposer>(std::move(draft));
}

}  // namespace m3::model
