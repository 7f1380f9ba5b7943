#include "model/synthetic_model.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "model/tensor_table.h"

namespace m3::model {

namespace {

constexpr const char* kForm =
    "synthetic:layers=N[,seed=S][,weights=bf16|fp8|mxfp8|nvfp4|mxfp4][,vision=0|1] with 1 <= N <= "
    "60";

Result<uint64_t> parse_u64(std::string_view spec, std::string_view key, std::string_view text) {
  const std::string s(text);
  // strtoull would accept a sign or leading spaces; only plain digits are a count.
  const bool plain = !s.empty() && s[0] != '-' && s[0] != '+' && s[0] != ' ';
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = plain ? std::strtoull(s.c_str(), &end, 10) : 0;
  if (!plain || *end != '\0' || errno != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--model " + std::string(spec) + ": " + std::string(key) + "='" + s +
                          "' is not a non-negative integer; use " + kForm,
                      "--model");
  }
  return static_cast<uint64_t>(v);
}

}  // namespace

bool is_synthetic_model(std::string_view model) {
  return model.starts_with(kSyntheticPrefix);
}

Result<SyntheticSpec> parse_synthetic_spec(std::string_view model) {
  const std::string spec(model);
  if (!is_synthetic_model(model)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--model " + spec + " is not a synthetic model; use " + kForm, "--model");
  }
  std::string_view rest = model.substr(kSyntheticPrefix.size());
  SyntheticSpec out;
  bool have_layers = false, have_seed = false, have_weights = false, have_vision = false;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "--model " + spec + ": '" + std::string(item) + "' is not key=value; use " + kForm,
          "--model");
    }
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "layers" && !have_layers) {
      M3_TRY(uint64_t v, parse_u64(model, key, value));
      if (v < 1 || v > static_cast<uint64_t>(kSyntheticMaxLayers)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "--model " + spec + ": layers=" + std::string(value) +
                              " is outside 1..60 (MiniMax-M3 has 60 layers); use " + kForm,
                          "--model");
      }
      out.layers = static_cast<int64_t>(v);
      have_layers = true;
    } else if (key == "seed" && !have_seed) {
      M3_TRY(out.seed, parse_u64(model, key, value));
      have_seed = true;
    } else if (key == "weights" && !have_weights) {
      using kernels::WeightQuant;
      if (value == "bf16") {
        out.weights = WeightQuant::kNone;
      } else if (value == "fp8") {
        out.weights = WeightQuant::kFp8Channel;
      } else if (value == "mxfp8") {
        out.weights = WeightQuant::kMxfp8;
      } else if (value == "nvfp4") {
        out.weights = WeightQuant::kNvfp4;
      } else if (value == "mxfp4") {
        out.weights = WeightQuant::kMxfp4;
      } else {
        return make_error(ErrorCode::kInvalidArgument,
                          "--model " + spec + ": weights=" + std::string(value) +
                              " is unknown; use bf16, fp8, mxfp8, nvfp4 or mxfp4 (" + kForm + ")",
                          "--model");
      }
      have_weights = true;
    } else if (key == "vision" && !have_vision) {
      if (value != "0" && value != "1") {
        return make_error(ErrorCode::kInvalidArgument,
                          "--model " + spec + ": vision=" + std::string(value) +
                              " must be 0 or 1 (" + kForm + ")",
                          "--model");
      }
      out.vision = value == "1";
      have_vision = true;
    } else {
      const bool dup = (key == "layers" && have_layers) || (key == "seed" && have_seed) ||
                       (key == "weights" && have_weights) || (key == "vision" && have_vision);
      return make_error(ErrorCode::kInvalidArgument,
                        "--model " + spec + ": " +
                            (dup ? "'" + std::string(key) + "' is given twice"
                                 : "unknown key '" + std::string(key) + "'") +
                            "; use " + kForm,
                        "--model");
    }
  }
  if (!have_layers) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--model " + spec + " does not say how many layers; use " + kForm +
                          ", e.g. synthetic:layers=4",
                      "--model");
  }
  return out;
}

M3Config synthetic_m3_config(int64_t layers) {
  M3Config c;
  c.model_type = "minimax_m3_synthetic";
  c.vocab_size = 200064;
  c.hidden_size = 6144;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.intermediate_size = 3072;
  c.dense_intermediate_size = 12288;
  c.shared_intermediate_size = 3072;
  c.num_local_experts = 128;
  c.num_experts_per_tok = 4;
  c.n_shared_experts = 1;
  c.max_position_embeddings = 1048576;  // the shipped config (m3-model.md §1.2)
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 5000000.0;
  c.rotary_dim = 64;
  c.swiglu_alpha = 1.702;
  c.swiglu_limit = 7.0;
  c.swiglu_beta = 1.0;
  c.routed_scaling_factor = 2.0;
  c.use_routing_bias = true;
  c.tie_word_embeddings = false;
  c.index_n_heads = 4;
  c.index_head_dim = 128;
  c.sparse_block_size = 128;
  c.sparse_topk_blocks = 16;
  c.sparse_init_blocks = 0;
  c.sparse_local_blocks = 1;
  // moe_layer_freq and sparse_attention_freq are both [0,0,0, 1x57]: layers 0-2 dense + full.
  c.layer_is_sparse.assign(layers, false);
  c.layer_is_moe.assign(layers, false);
  for (int64_t i = 3; i < layers; ++i) {
    c.layer_is_sparse[i] = true;
    c.layer_is_moe[i] = true;
  }
  c.bos_token_id = 200034;
  c.eos_token_ids = {200020};
  c.has_vision_config = false;
  return c;
}

namespace {

struct Counts {
  int64_t bf16 = 0;  // elements stored as bf16
  int64_t f32 = 0;   // elements stored as f32 (router weight and bias)
};

// Elements one rank of `p` stores: each tensor's block (M3ModelCuda::generate_weights draws
// exactly these), a tied lm_head not at all.
Counts count(const M3Config& c, const ShardPlan& p) {
  Counts n;
  for (const TensorSpec& t : m3_tensors(c)) {
    if (t.may_tie) continue;
    const int64_t k = static_cast<int64_t>(shard_block(t, c, p).size());
    M3_CHECK(t.synthetic_dtype == DType::kBF16 || t.synthetic_dtype == DType::kF32);
    (t.synthetic_dtype == DType::kF32 ? n.f32 : n.bf16) += k;
  }
  return n;
}

Counts count(const M3Config& c) {
  auto whole = make_shard_plan(c, ShardSpec{});
  M3_CHECK(whole.has_value(), "unsharded plan: %s", whole ? "" : whole.error().message.c_str());
  return count(c, *whole);
}

}  // namespace

int64_t synthetic_param_count(const M3Config& cfg) {
  const Counts n = count(cfg);
  return n.bf16 + n.f32;
}

int64_t synthetic_weight_bytes(const M3Config& cfg) {
  const Counts n = count(cfg);
  return 2 * n.bf16 + 4 * n.f32;
}

int64_t synthetic_weight_bytes(const M3Config& cfg, const ShardPlan& plan) {
  const Counts n = count(cfg, plan);
  return 2 * n.bf16 + 4 * n.f32;
}

kernels::WeightQuant synthetic_format_of(const TensorSpec& t, kernels::WeightQuant weights) {
  using kernels::WeightQuant;
  if (weights == WeightQuant::kNone || t.vector || !t.quantizable) return WeightQuant::kNone;
  if (weights == WeightQuant::kNvfp4 || weights == WeightQuant::kMxfp4)
    return t.experts > 0 ? weights : WeightQuant::kMxfp8;  // as the 4-bit checkpoints store them
  return weights;
}

int64_t synthetic_weight_bytes(const M3Config& cfg, const ShardPlan& plan,
                               kernels::WeightQuant weights) {
  int64_t bytes = 0;
  for (const TensorSpec& t : m3_tensors(cfg)) {
    if (t.may_tie) continue;
    const TensorBlock b = shard_block(t, cfg, plan);
    const kernels::WeightQuant q = synthetic_format_of(t, weights);
    if (q == kernels::WeightQuant::kNone) {
      bytes += static_cast<int64_t>(b.size() * dtype_size(t.synthetic_dtype));
      continue;
    }
    kernels::MatRef m;
    m.quant = q;
    m.dtype = kernels::weight_quant_is_4bit(q) ? DType::kU8 : DType::kF8E4M3;
    m.rows = b.row_count;
    m.cols = b.col_count;
    bytes += b.expert_count * m.bytes();
  }
  return bytes;
}

std::string synthetic_needs_cuda_message(std::string_view model) {
  // One MoE layer's bytes in the spec's format, to show the scale: 128 experts x 3 x 3072 x
  // 6144 bf16 = 14.5 GB.
  const auto spec = parse_synthetic_spec(model);
  const kernels::WeightQuant wq = spec ? spec->weights : kernels::WeightQuant::kNone;
  const M3Config c4 = synthetic_m3_config(4), c3 = synthetic_m3_config(3);
  const auto p4 = make_shard_plan(c4, ShardSpec{}), p3 = make_shard_plan(c3, ShardSpec{});
  M3_CHECK(p4.has_value() && p3.has_value(), "the unsharded plan of a synthetic model");
  const double moe_gb = static_cast<double>(synthetic_weight_bytes(c4, *p4, wq) -
                                            synthetic_weight_bytes(c3, *p3, wq)) /
                        1e9;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f GB", moe_gb);
  const std::string fmt =
      wq == kernels::WeightQuant::kNone ? "bf16" : kernels::weight_quant_name(wq);
  return "--model " + std::string(model) + " is a synthetic MiniMax-M3 at the real shapes (" + buf +
         " of " + fmt +
         " weights per MoE layer), generated on the GPU; it is too big for the CPU path: use "
         "--device cuda";
}

}  // namespace m3::model
