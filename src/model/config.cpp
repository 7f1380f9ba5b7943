// config.json -> M3Config. Both forms of the M3 config are read here (see config.h); every
// value is validated so the rest of the engine can trust the struct.
//
// Decisions (tested in tests/unit/model/config_test.cpp):
// - Where the shipped keys (text_config.sparse_attention_config.*, moe_layer_freq) and the flat
//   transformers keys (index_*, layer_types, mlp_layer_types) are both present they must agree;
//   a disagreement is refused, because the two programs that write them would build different
//   models from the same file (transformers lets sparse_attention_config win for index_*, but the
//   flat lists win for layer types).
// - RoPE follows transformers: when rope_parameters (or a non-null rope_scaling) is present it
//   decides theta and the rotated width, rotary_dim = partial_rotary_factor * head_dim with a
//   factor of 1.0 when rope_parameters has none (transformers ignores its own rotary_dim field
//   then). Without rope_parameters: rotary_dim, else partial_rotary_factor * head_dim, else 64.
// - Absent keys take the transformers MiniMaxM3VLTextConfig defaults (the real M3 values), except
//   head_dim (hidden_size / num_attention_heads), swiglu_beta (1.0) and the keys transformers
//   does not know (use_routing_bias true, n_shared_experts 1, scoring_func sigmoid,
//   sparse_init_block 0, sparse_disable_index_value 1 on every sparse layer).
// - use_sparse_attention false makes every layer full attention.
// - hidden_act is accepted as "swigluoai", "silu" (what transformers writes) or "swiglu", and
//   always means the clamped SwiGLU-OAI (m3-model.md §8.3).
#include "model/config.h"
#include "model/config_overrides.h"

#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

namespace m3::model {

namespace {

using json = nlohmann::json;

constexpr const char* kSupportedTypes =
    "minimax_m3_vl (with text_config), minimax_m3_vl_text, minimax_m3, minimax_m3_text";
constexpr const char* kSparseLayerType = "minimax_m3_sparse";
constexpr const char* kFullLayerType = "full_attention";

const char* json_type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number_float()) return "a float";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "a list";
  return "an object";
}

// Typed, optional access to the keys of one JSON object. `where_` prefixes key names in messages
// ("text_config.", "text_config.sparse_attention_config.") so the user can find the key.
class Fields {
 public:
  Fields(const json* obj, std::string where, std::string source)
      : obj_(obj), where_(std::move(where)), source_(std::move(source)) {}

  bool has(const char* key) const {
    return obj_ != nullptr && obj_->contains(key) && !obj_->at(key).is_null();
  }
  const json* raw(const char* key) const { return has(key) ? &obj_->at(key) : nullptr; }
  std::string name(const char* key) const { return where_ + key; }

  tl::unexpected<Error> type_error(const char* key, const char* want) const {
    return make_error(ErrorCode::kFormat,
                      source_ + ": " + name(key) + " must be " + want + ", got " +
                          json_type_name(obj_->at(key)) + " (" + obj_->at(key).dump() + ")",
                      name(key));
  }

  Result<std::optional<int64_t>> get_int(const char* key) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<int64_t>{};
    if (v->is_number_integer() || v->is_number_unsigned()) {
      return std::optional<int64_t>{v->get<int64_t>()};
    }
    // Some writers emit integral floats ("128.0"); accept them when exact.
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
        return std::optional<int64_t>{static_cast<int64_t>(d)};
      }
    }
    return type_error(key, "an integer");
  }

  Result<std::optional<double>> get_double(const char* key) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<double>{};
    if (!v->is_number()) return type_error(key, "a number");
    return std::optional<double>{v->get<double>()};
  }

  Result<std::optional<bool>> get_bool(const char* key) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<bool>{};
    if (v->is_boolean()) return std::optional<bool>{v->get<bool>()};
    if ((v->is_number_integer() || v->is_number_unsigned()) && (*v == 0 || *v == 1)) {
      return std::optional<bool>{v->get<int64_t>() == 1};
    }
    return type_error(key, "true or false");
  }

  Result<std::optional<std::string>> get_string(const char* key) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<std::string>{};
    if (!v->is_string()) return type_error(key, "a string");
    return std::optional<std::string>{v->get<std::string>()};
  }

  // A list of 0/1 flags (ints or booleans), as moe_layer_freq / sparse_attention_freq.
  Result<std::optional<std::vector<bool>>> get_flags(const char* key) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<std::vector<bool>>{};
    if (!v->is_array()) return type_error(key, "a list of 0/1, one per layer");
    std::vector<bool> out;
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (e.is_boolean()) {
        out.push_back(e.get<bool>());
      } else if ((e.is_number_integer() || e.is_number_unsigned()) && (e == 0 || e == 1)) {
        out.push_back(e.get<int64_t>() == 1);
      } else {
        return make_error(ErrorCode::kFormat,
                          source_ + ": " + name(key) + "[" + std::to_string(i) +
                              "] must be 0 or 1, got " + e.dump(),
                          name(key));
      }
    }
    return std::optional<std::vector<bool>>{std::move(out)};
  }

  // A list of names mapped to flags: `yes` -> true, `no` -> false (layer_types, mlp_layer_types).
  Result<std::optional<std::vector<bool>>> get_named_flags(const char* key, const char* yes,
                                                           const char* no) const {
    const json* v = raw(key);
    if (v == nullptr) return std::optional<std::vector<bool>>{};
    const std::string want = std::string("a list of \"") + yes + "\" / \"" + no + "\"";
    if (!v->is_array()) return type_error(key, want.c_str());
    std::vector<bool> out;
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (e.is_string() && e.get<std::string>() == yes) {
        out.push_back(true);
      } else if (e.is_string() && e.get<std::string>() == no) {
        out.push_back(false);
      } else {
        return make_error(ErrorCode::kUnsupported,
                          source_ + ": " + name(key) + "[" + std::to_string(i) + "] is " +
                              e.dump() + "; supported values are \"" + yes + "\" and \"" + no +
                              "\"",
                          name(key));
      }
    }
    return std::optional<std::vector<bool>>{std::move(out)};
  }

 private:
  const json* obj_;
  std::string where_;
  std::string source_;
};

std::string flags_str(const std::vector<bool>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ",";
    s += v[i] ? "1" : "0";
  }
  return s + "]";
}

tl::unexpected<Error> unsupported(const std::string& source, const std::string& key,
                                  const std::string& what) {
  return make_error(ErrorCode::kUnsupported, source + ": " + what, key);
}

tl::unexpected<Error> invalid(const std::string& source, const std::string& key,
                              const std::string& what) {
  return make_error(ErrorCode::kFormat, source + ": " + what, key);
}

// Reads an int that may come from a flat key and/or a legacy key; when both are present they must
// agree. Falls back to `def` when neither is.
Result<int64_t> int_from_either(const Fields& flat, const char* flat_key, const Fields& legacy,
                                const char* legacy_key, int64_t def, const std::string& source) {
  M3_TRY(std::optional<int64_t> a, flat.get_int(flat_key));
  M3_TRY(std::optional<int64_t> b, legacy.get_int(legacy_key));
  if (a && b && *a != *b) {
    return invalid(source, flat.name(flat_key),
                   flat.name(flat_key) + " = " + std::to_string(*a) + " disagrees with " +
                       legacy.name(legacy_key) + " = " + std::to_string(*b) +
                       "; they name the same setting, make them equal or remove one");
  }
  if (a) return *a;
  if (b) return *b;
  return def;
}

Status require_positive(const std::string& source, const std::string& key, int64_t v) {
  if (v <= 0) {
    return invalid(source, key, key + " must be positive, got " + std::to_string(v));
  }
  return {};
}

Status require_positive_real(const std::string& source, const std::string& key, double v) {
  if (!(v > 0.0) || !std::isfinite(v)) {
    std::ostringstream os;
    os << key << " must be a positive finite number, got " << v;
    return invalid(source, key, os.str());
  }
  return {};
}

Result<std::vector<int64_t>> parse_eos(const json& v, const std::string& key,
                                       const std::string& source) {
  std::vector<int64_t> out;
  auto one = [&](const json& e) -> Status {
    if (!(e.is_number_integer() || e.is_number_unsigned()) || e.get<int64_t>() < 0) {
      return invalid(source, key,
                     key + " must be a token id or a list of token ids, got " + v.dump());
    }
    out.push_back(e.get<int64_t>());
    return {};
  };
  if (v.is_array()) {
    if (v.empty()) return invalid(source, key, key + " is an empty list; give at least one id");
    for (const json& e : v) M3_TRY_STATUS(one(e));
  } else {
    M3_TRY_STATUS(one(v));
  }
  return out;
}

Result<int64_t> int_or(const Fields& f, const char* key, int64_t def) {
  M3_TRY(std::optional<int64_t> v, f.get_int(key));
  return v.value_or(def);
}

Result<double> real_or(const Fields& f, const char* key, double def) {
  M3_TRY(std::optional<double> v, f.get_double(key));
  return v.value_or(def);
}

Result<bool> bool_or(const Fields& f, const char* key, bool def) {
  M3_TRY(std::optional<bool> v, f.get_bool(key));
  return v.value_or(def);
}

// The objects a config's keys live in: the top level, the language model's object (text_config
// for the VL form, the top level itself otherwise) and its sparse_attention_config (may be
// absent: every lookup in it then misses).
struct Sections {
  const json* root;
  const json* text;
  Fields top;
  Fields t;
  Fields s;
  const std::string& source;

  bool text_is_top() const { return text == root; }
};

// One function per section of config.json, in the order parse_config_json runs them (so the
// first error reported is the same as when they were one function); each fills its fields of
// M3Config and validates them, and may read the fields an earlier section filled.

// model_type decides where the text model's keys are; also notes a vision_config.
Result<Sections> parse_model_type(const json& root, const std::string& source, M3Config& c) {
  Fields top(&root, "", source);
  M3_TRY(std::optional<std::string> model_type, top.get_string("model_type"));
  if (!model_type) {
    return invalid(source, "model_type",
                   "model_type is missing; an M3 config.json has \"model_type\": "
                   "\"minimax_m3_vl\" (supported: " +
                       std::string(kSupportedTypes) + ")");
  }
  c.model_type = *model_type;
  const json* text = nullptr;
  std::string where;
  if (*model_type == "minimax_m3_vl") {
    text = top.raw("text_config");
    if (text == nullptr || !text->is_object()) {
      return invalid(source, "text_config",
                     "model_type is \"minimax_m3_vl\" but text_config is missing or not an "
                     "object; the VL config keeps the language model's settings in text_config");
    }
    where = "text_config.";
  } else if (*model_type == "minimax_m3_vl_text" || *model_type == "minimax_m3" ||
             *model_type == "minimax_m3_text") {
    text = &root;
  } else {
    return unsupported(source, "model_type",
                       "model_type \"" + *model_type + "\" is not supported; m3serve serves " +
                           "MiniMax-M3 configs only (supported model_type: " + kSupportedTypes +
                           ")");
  }
  c.has_vision_config =
      top.raw("vision_config") != nullptr && top.raw("vision_config")->is_object();

  Fields t(text, where, source);
  const json* sparse_obj = t.raw("sparse_attention_config");
  if (sparse_obj != nullptr && !sparse_obj->is_object()) {
    return t.type_error("sparse_attention_config", "an object");
  }
  Fields s(sparse_obj, where + "sparse_attention_config.", source);
  return Sections{&root, text, std::move(top), std::move(t), std::move(s), source};
}

// Model sizes, the expert counts and head_dim.
Status parse_sizes(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  M3_TRY(c.vocab_size, int_or(t, "vocab_size", 200064));
  M3_TRY(c.hidden_size, int_or(t, "hidden_size", 6144));
  M3_TRY(c.num_hidden_layers, int_or(t, "num_hidden_layers", 60));
  M3_TRY(c.num_attention_heads, int_or(t, "num_attention_heads", 64));
  M3_TRY(c.num_key_value_heads, int_or(t, "num_key_value_heads", 4));
  M3_TRY(c.intermediate_size, int_or(t, "intermediate_size", 3072));
  M3_TRY(c.dense_intermediate_size, int_or(t, "dense_intermediate_size", 12288));
  M3_TRY(c.shared_intermediate_size, int_or(t, "shared_intermediate_size", 3072));
  M3_TRY(std::optional<int64_t> n_experts, t.get_int("num_local_experts"));
  if (!n_experts) {
    M3_TRY(n_experts, t.get_int("num_experts"));  // transformers attribute_map alias
  }
  c.num_local_experts = n_experts.value_or(128);
  M3_TRY(c.num_experts_per_tok, int_or(t, "num_experts_per_tok", 4));
  M3_TRY(c.n_shared_experts, int_or(t, "n_shared_experts", 1));
  M3_TRY(c.max_position_embeddings, int_or(t, "max_position_embeddings", 524288));
  M3_TRY(c.rms_norm_eps, real_or(t, "rms_norm_eps", 1e-6));

  for (auto [key, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                        {"hidden_size", c.hidden_size},
                        {"num_hidden_layers", c.num_hidden_layers},
                        {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads},
                        {"max_position_embeddings", c.max_position_embeddings}}) {
    M3_TRY_STATUS(require_positive(source, t.name(key), v));
  }
  M3_TRY_STATUS(require_positive_real(source, t.name("rms_norm_eps"), c.rms_norm_eps));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return invalid(source, t.name("num_attention_heads"),
                   t.name("num_attention_heads") + " = " + std::to_string(c.num_attention_heads) +
                       " is not a multiple of " + t.name("num_key_value_heads") + " = " +
                       std::to_string(c.num_key_value_heads) +
                       "; grouped-query attention needs whole groups");
  }
  M3_TRY(std::optional<int64_t> head_dim, t.get_int("head_dim"));
  if (head_dim) {
    c.head_dim = *head_dim;
    M3_TRY_STATUS(require_positive(source, t.name("head_dim"), c.head_dim));
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return invalid(source, t.name("head_dim"),
                     "head_dim is absent and hidden_size " + std::to_string(c.hidden_size) +
                         " is not divisible by num_attention_heads " +
                         std::to_string(c.num_attention_heads) + "; add \"head_dim\"");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  return {};
}

// hidden_act and the SwiGLU-OAI constants.
Status parse_activation(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  M3_TRY(std::optional<std::string> act, t.get_string("hidden_act"));
  if (act && *act != "swigluoai" && *act != "silu" && *act != "swiglu") {
    return unsupported(source, t.name("hidden_act"),
                       t.name("hidden_act") + " is \"" + *act +
                           "\"; M3 uses the clamped SwiGLU-OAI (\"swigluoai\"; transformers "
                           "writes \"silu\" for the same thing)");
  }
  M3_TRY(c.swiglu_alpha, real_or(t, "swiglu_alpha", 1.702));
  M3_TRY(c.swiglu_limit, real_or(t, "swiglu_limit", 7.0));
  M3_TRY(c.swiglu_beta, real_or(t, "swiglu_beta", 1.0));
  M3_TRY_STATUS(require_positive_real(source, t.name("swiglu_alpha"), c.swiglu_alpha));
  M3_TRY_STATUS(require_positive_real(source, t.name("swiglu_limit"), c.swiglu_limit));
  if (!std::isfinite(c.swiglu_beta)) {
    return invalid(source, t.name("swiglu_beta"), t.name("swiglu_beta") + " must be finite");
  }
  return {};
}

// Attention options the engine implements one way only: refused unless they say M3's way.
Status check_attention_options(const Sections& in) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  M3_TRY(bool qk_norm, bool_or(t, "use_qk_norm", true));
  if (!qk_norm) {
    return unsupported(source, t.name("use_qk_norm"),
                       t.name("use_qk_norm") +
                           " is false; M3 attention always normalises q and "
                           "k per head (use_qk_norm true)");
  }
  M3_TRY(std::optional<std::string> qk_norm_type, t.get_string("qk_norm_type"));
  if (qk_norm_type && *qk_norm_type != "per_head") {
    return unsupported(source, t.name("qk_norm_type"),
                       t.name("qk_norm_type") + " is \"" + *qk_norm_type +
                           "\"; only \"per_head\" (one [head_dim] weight) is supported");
  }
  M3_TRY(bool gemma_norm, bool_or(t, "use_gemma_norm", true));
  if (!gemma_norm) {
    return unsupported(source, t.name("use_gemma_norm"),
                       t.name("use_gemma_norm") +
                           " is false; only the Gemma-style (1+w) RMSNorm of M3 is supported");
  }
  M3_TRY(bool out_gate, bool_or(t, "attention_output_gate", false));
  if (out_gate) {
    return unsupported(source, t.name("attention_output_gate"),
                       t.name("attention_output_gate") +
                           " is true; gated attention output is not part of M3 and not supported");
  }
  return {};
}

// RoPE theta and the rotated width (the rule is in the comment at the top of this file). Needs
// head_dim.
// YaRN's keys in a rope_scaling / rope_parameters object of rope_type "yarn" (transformers'
// and vLLM's names). factor > 1 is required; original_max_position_embeddings defaults to
// max_position_embeddings / factor, as transformers does without it.
Status parse_yarn(const Fields& r, const std::string& key, const std::string& source, M3Config& c) {
  M3_TRY(std::optional<double> factor, r.get_double("factor"));
  if (!factor || !(*factor > 1.0)) {
    return invalid(source, key,
                   key + " has rope_type \"yarn\" with factor " +
                       (factor ? std::to_string(*factor) : std::string("missing")) +
                       "; YaRN needs a factor above 1 (e.g. 2.0 for 1M tokens over a 512K window)");
  }
  kernels::RopeScaling& y = c.rope_scaling;
  y.factor = static_cast<float>(*factor);
  M3_TRY(std::optional<double> orig, r.get_double("original_max_position_embeddings"));
  y.original_max_position = orig ? *orig : static_cast<double>(c.max_position_embeddings) / *factor;
  if (!(y.original_max_position > 0)) {
    return invalid(source, key, key + " original_max_position_embeddings must be positive");
  }
  M3_TRY(std::optional<double> bf, r.get_double("beta_fast"));
  M3_TRY(std::optional<double> bs, r.get_double("beta_slow"));
  y.beta_fast = static_cast<float>(bf.value_or(32.0));
  y.beta_slow = static_cast<float>(bs.value_or(1.0));
  if (!(y.beta_fast > y.beta_slow && y.beta_slow > 0)) {
    return invalid(source, key, key + " needs beta_fast > beta_slow > 0");
  }
  auto mscale = [&](double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  M3_TRY(std::optional<double> af, r.get_double("attention_factor"));
  M3_TRY(std::optional<double> ms, r.get_double("mscale"));
  M3_TRY(std::optional<double> ms_all, r.get_double("mscale_all_dim"));
  if (af) {
    y.attention_factor = static_cast<float>(*af);
  } else if (ms && ms_all) {
    y.attention_factor = static_cast<float>(mscale(*factor, *ms) / mscale(*factor, *ms_all));
  } else {
    y.attention_factor = static_cast<float>(mscale(*factor, 1.0));
  }
  M3_TRY(std::optional<bool> truncate, r.get_bool("truncate"));
  y.truncate = truncate.value_or(true);
  // The extended window, as vLLM derives its max length: original x factor.
  c.max_position_embeddings = std::max<int64_t>(
      c.max_position_embeddings, static_cast<int64_t>(y.original_max_position * *factor));
  return {};
}

Status parse_rope(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  // rope_scaling non-null replaces rope_parameters, as in transformers; a YaRN rope_scaling
  // (the recipe's 1M override) extends the base RoPE: theta and the rotated width stay those of
  // rope_parameters / the flat keys unless the scaling object gives them.
  const bool has_scaling = t.has("rope_scaling");
  const json* scaling = has_scaling ? t.raw("rope_scaling") : nullptr;
  const json* params = t.raw("rope_parameters");
  M3_TRY(std::optional<double> theta_flat, t.get_double("rope_theta"));
  M3_TRY(std::optional<int64_t> rotary_dim_key, t.get_int("rotary_dim"));
  M3_TRY(std::optional<double> prf_flat, t.get_double("partial_rotary_factor"));
  double rotary_factor = 0.0;
  bool have_factor = false;
  std::optional<double> theta;
  std::optional<double> prf;
  bool saw_object = false;
  // Base parameters first (rope_parameters), then the scaling object on top.
  for (const json* obj : {params, scaling}) {
    if (obj == nullptr) continue;
    const char* field = obj == scaling ? "rope_scaling" : "rope_parameters";
    const std::string key = t.name(field);
    if (!obj->is_object()) return t.type_error(field, "an object");
    Fields r(obj, key + ".", source);
    if (r.has(kSparseLayerType) || r.has(kFullLayerType)) {
      return unsupported(source, key,
                         key +
                             " is given per layer type; M3 uses one RoPE for all layers, "
                             "write a single {rope_type, rope_theta, partial_rotary_factor}");
    }
    M3_TRY(std::optional<std::string> type, r.get_string("rope_type"));
    if (!type) {
      M3_TRY(type, r.get_string("type"));
    }
    if (type && *type == "yarn") {
      M3_TRY_STATUS(parse_yarn(r, key, source, c));
    } else if (type && *type != "default") {
      return unsupported(source, key,
                         key + " has rope_type \"" + *type +
                             "\"; supported: \"default\" (plain RoPE) and \"yarn\"");
    }
    M3_TRY(std::optional<double> th, r.get_double("rope_theta"));
    if (th) theta = th;
    M3_TRY(std::optional<double> p, r.get_double("partial_rotary_factor"));
    if (p) prf = p;
    // A plain rope_scaling replaces rope_parameters as transformers does; a YaRN one extends it.
    if (obj == scaling && !(type && *type == "yarn") && params != nullptr) {
      theta = th;
      prf = p;
    }
    saw_object = true;
  }
  if (saw_object) {
    c.rope_theta = theta ? *theta : theta_flat.value_or(5000000.0);
    // transformers' default RoPE rotates int(head_dim * factor) dims with factor 1.0 when absent.
    rotary_factor = prf ? *prf : (prf_flat ? *prf_flat : 1.0);
    have_factor = true;
  } else {
    c.rope_theta = theta_flat.value_or(5000000.0);
    if (!rotary_dim_key && prf_flat) {
      rotary_factor = *prf_flat;
      have_factor = true;
    }
  }
  const std::string rope_key = t.name(has_scaling ? "rope_scaling" : "rope_parameters");
  if (have_factor) {
    if (!(rotary_factor > 0.0 && rotary_factor <= 1.0)) {
      std::ostringstream os;
      os << "partial_rotary_factor " << rotary_factor << " must be in (0, 1]";
      return invalid(source, rope_key, os.str());
    }
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * rotary_factor);
  } else {
    c.rotary_dim = rotary_dim_key.value_or(64);
  }
  M3_TRY_STATUS(require_positive_real(source, t.name("rope_theta"), c.rope_theta));
  if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim) {
    return invalid(source, t.name("rotary_dim"),
                   "rotary_dim " + std::to_string(c.rotary_dim) +
                       " must be even, positive and <= head_dim " + std::to_string(c.head_dim) +
                       " (NeoX RoPE rotates two halves of the first rotary_dim channels)");
  }
  return {};
}

// The MoE router (scoring, bias, routed scale) and the shared expert. The expert sizes are
// checked later (check_moe_sizes), once the layer types say whether any layer is MoE.
Status parse_moe_routing(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  M3_TRY(std::optional<std::string> scoring, t.get_string("scoring_func"));
  if (scoring && *scoring != "sigmoid") {
    return unsupported(source, t.name("scoring_func"),
                       t.name("scoring_func") + " is \"" + *scoring +
                           "\"; M3 routes with \"sigmoid\" scores, the only supported value");
  }
  M3_TRY(c.use_routing_bias, bool_or(t, "use_routing_bias", true));
  M3_TRY(c.routed_scaling_factor, real_or(t, "routed_scaling_factor", 2.0));
  M3_TRY_STATUS(
      require_positive_real(source, t.name("routed_scaling_factor"), c.routed_scaling_factor));
  if (c.n_shared_experts < 0 || c.n_shared_experts > 1) {
    return unsupported(source, t.name("n_shared_experts"),
                       t.name("n_shared_experts") + " = " + std::to_string(c.n_shared_experts) +
                           "; only 0 or 1 shared expert is supported");
  }
  if (c.shared_intermediate_size < 0) {
    return invalid(source, t.name("shared_intermediate_size"),
                   t.name("shared_intermediate_size") + " must be >= 0 (0: no shared expert)");
  }
  if (c.n_shared_experts == 0 || c.shared_intermediate_size == 0) {
    // Either spelling of "no shared expert" means none; keep the two fields consistent.
    c.n_shared_experts = 0;
    c.shared_intermediate_size = 0;
  }
  return {};
}

// Tied embeddings and the bos / eos token ids: the text object first, then the VL top level.
Status parse_tokens(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const Fields& top = in.top;
  M3_TRY(bool tie_text, bool_or(t, "tie_word_embeddings", false));
  M3_TRY(bool tie_top, bool_or(top, "tie_word_embeddings", false));
  c.tie_word_embeddings = tie_text || (!in.text_is_top() && tie_top);

  M3_TRY(std::optional<int64_t> bos, t.get_int("bos_token_id"));
  if (!bos && !in.text_is_top()) {
    M3_TRY(bos, top.get_int("bos_token_id"));
  }
  if (bos) c.bos_token_id = *bos;
  const json* eos = t.raw("eos_token_id");
  std::string eos_key = t.name("eos_token_id");
  if (eos == nullptr && !in.text_is_top()) {
    eos = top.raw("eos_token_id");
    eos_key = "eos_token_id";
  }
  if (eos != nullptr) {
    M3_TRY(c.eos_token_ids, parse_eos(*eos, eos_key, in.source));
  }
  return {};
}

// MSA geometry: flat index_* keys and/or sparse_attention_config. Validated in check_msa, once
// the layer types say whether any layer is sparse.
Status parse_msa_geometry(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const Fields& s = in.s;
  const std::string& source = in.source;
  M3_TRY(c.index_n_heads,
         int_from_either(t, "index_n_heads", s, "sparse_num_index_heads", 4, source));
  M3_TRY(c.index_head_dim,
         int_from_either(t, "index_head_dim", s, "sparse_index_dim", 128, source));
  M3_TRY(c.sparse_block_size,
         int_from_either(t, "index_block_size", s, "sparse_block_size", 128, source));
  M3_TRY(c.sparse_topk_blocks,
         int_from_either(t, "index_topk_blocks", s, "sparse_topk_blocks", 16, source));
  M3_TRY(c.sparse_local_blocks,
         int_from_either(t, "index_local_blocks", s, "sparse_local_block", 1, source));
  M3_TRY(c.sparse_init_blocks, int_or(s, "sparse_init_block", 0));
  M3_TRY(std::optional<std::string> score_type, s.get_string("sparse_score_type"));
  if (score_type && *score_type != "max") {
    return unsupported(source, s.name("sparse_score_type"),
                       s.name("sparse_score_type") + " is \"" + *score_type +
                           "\"; M3 pools token scores into blocks with \"max\", the only "
                           "supported value");
  }
  return {};
}

// The per-layer lists: which layers are sparse (layer_types / sparse_attention_freq), which are
// MoE (mlp_layer_types / moe_layer_freq), and sparse_disable_index_value. Needs
// num_hidden_layers.
Status parse_layer_types(const Sections& in, M3Config& c) {
  const Fields& t = in.t;
  const Fields& s = in.s;
  const std::string& source = in.source;
  const size_t n_layers = static_cast<size_t>(c.num_hidden_layers);
  auto check_len = [&](const std::vector<bool>& v, const std::string& key) -> Status {
    if (v.size() != n_layers) {
      return invalid(source, key,
                     key + " has " + std::to_string(v.size()) +
                         " entries but num_hidden_layers is " + std::to_string(n_layers) +
                         "; give one entry per layer");
    }
    return {};
  };
  M3_TRY(std::optional<std::vector<bool>> layer_types,
         t.get_named_flags("layer_types", kSparseLayerType, kFullLayerType));
  M3_TRY(std::optional<std::vector<bool>> sparse_freq, s.get_flags("sparse_attention_freq"));
  M3_TRY(bool use_sparse, bool_or(s, "use_sparse_attention", true));
  if (layer_types) M3_TRY_STATUS(check_len(*layer_types, t.name("layer_types")));
  if (sparse_freq) {
    M3_TRY_STATUS(check_len(*sparse_freq, s.name("sparse_attention_freq")));
    if (!use_sparse) sparse_freq = std::vector<bool>(n_layers, false);
  }
  if (layer_types && sparse_freq && *layer_types != *sparse_freq) {
    return invalid(source, t.name("layer_types"),
                   t.name("layer_types") + " (sparse = 1: " + flags_str(*layer_types) +
                       ") disagrees with " + s.name("sparse_attention_freq") +
                       (use_sparse ? "" : " with use_sparse_attention false") + " (" +
                       flags_str(*sparse_freq) + "); make them equal or remove one");
  }
  if (layer_types) {
    c.layer_is_sparse = *layer_types;
  } else if (sparse_freq) {
    c.layer_is_sparse = *sparse_freq;
  } else {
    c.layer_is_sparse.assign(n_layers, false);  // transformers: all full attention
  }

  M3_TRY(std::optional<std::vector<bool>> mlp_types,
         t.get_named_flags("mlp_layer_types", "sparse", "dense"));
  M3_TRY(std::optional<std::vector<bool>> moe_freq, t.get_flags("moe_layer_freq"));
  if (mlp_types) M3_TRY_STATUS(check_len(*mlp_types, t.name("mlp_layer_types")));
  if (moe_freq) M3_TRY_STATUS(check_len(*moe_freq, t.name("moe_layer_freq")));
  if (mlp_types && moe_freq && *mlp_types != *moe_freq) {
    return invalid(source, t.name("mlp_layer_types"),
                   t.name("mlp_layer_types") + " (moe = 1: " + flags_str(*mlp_types) +
                       ") disagrees with " + t.name("moe_layer_freq") + " (" +
                       flags_str(*moe_freq) + "); make them equal or remove one");
  }
  if (mlp_types) {
    c.layer_is_moe = *mlp_types;
  } else if (moe_freq) {
    c.layer_is_moe = *moe_freq;
  } else {
    c.layer_is_moe.assign(n_layers, true);  // transformers: every layer MoE
  }

  M3_TRY(std::optional<std::vector<bool>> disable_iv, s.get_flags("sparse_disable_index_value"));
  if (disable_iv) {
    M3_TRY_STATUS(check_len(*disable_iv, s.name("sparse_disable_index_value")));
    for (size_t i = 0; i < n_layers; ++i) {
      if (c.layer_is_sparse[i] && !(*disable_iv)[i]) {
        return unsupported(source, s.name("sparse_disable_index_value"),
                           s.name("sparse_disable_index_value") + "[" + std::to_string(i) +
                               "] is 0 on sparse layer " + std::to_string(i) +
                               ": the indexer value branch is not supported (no M3 checkpoint "
                               "uses it); it must be 1 on every sparse layer");
      }
    }
  }
  return {};
}

// The expert and dense MLP sizes, checked only when some layer uses them.
Status check_moe_sizes(const Sections& in, const M3Config& c) {
  const Fields& t = in.t;
  const std::string& source = in.source;
  bool any_moe = false, any_dense = false;
  for (bool m : c.layer_is_moe) (m ? any_moe : any_dense) = true;
  if (any_moe) {
    M3_TRY_STATUS(require_positive(source, t.name("intermediate_size"), c.intermediate_size));
    M3_TRY_STATUS(require_positive(source, t.name("num_local_experts"), c.num_local_experts));
    M3_TRY_STATUS(require_positive(source, t.name("num_experts_per_tok"), c.num_experts_per_tok));
    if (c.num_experts_per_tok > c.num_local_experts) {
      return invalid(source, t.name("num_experts_per_tok"),
                     t.name("num_experts_per_tok") + " = " + std::to_string(c.num_experts_per_tok) +
                         " is more than num_local_experts = " +
                         std::to_string(c.num_local_experts) + "; top-k must be <= the experts");
    }
  }
  if (any_dense) {
    M3_TRY_STATUS(
        require_positive(source, t.name("dense_intermediate_size"), c.dense_intermediate_size));
  }
  return {};
}

// The MSA geometry against the rest of the model. The block is also the KV page size
// (check_kv_block_size), so it must be valid even for a model without sparse layers; the rest is
// checked only when some layer is sparse.
Status check_msa(const Sections& in, const M3Config& c) {
  const Fields& s = in.s;
  const std::string& source = in.source;
  M3_TRY_STATUS(require_positive(source, "sparse_block_size", c.sparse_block_size));
  if (!c.any_sparse()) return {};
  M3_TRY_STATUS(require_positive(source, "index_n_heads", c.index_n_heads));
  M3_TRY_STATUS(require_positive(source, "index_head_dim", c.index_head_dim));
  M3_TRY_STATUS(require_positive(source, "sparse_topk_blocks", c.sparse_topk_blocks));
  if (c.index_n_heads != c.num_key_value_heads) {
    return unsupported(
        source, "index_n_heads",
        "index_n_heads (sparse_num_index_heads) = " + std::to_string(c.index_n_heads) +
            " differs from num_key_value_heads = " + std::to_string(c.num_key_value_heads) +
            "; MSA selects blocks per KV head, so they must be equal");
  }
  if (c.rotary_dim > c.index_head_dim) {
    return unsupported(source, "index_head_dim",
                       "rotary_dim " + std::to_string(c.rotary_dim) + " exceeds index_head_dim " +
                           std::to_string(c.index_head_dim) +
                           "; the indexer applies the same RoPE and needs index_head_dim >= "
                           "rotary_dim");
  }
  if (c.sparse_init_blocks < 0) {
    return invalid(source, s.name("sparse_init_block"),
                   "sparse_init_block must be >= 0, got " + std::to_string(c.sparse_init_blocks));
  }
  if (c.sparse_local_blocks < 1) {
    return unsupported(
        source, "sparse_local_block",
        "sparse_local_block (index_local_blocks) = " + std::to_string(c.sparse_local_blocks) +
            "; it must be >= 1 so a query always sees its own block (M3 uses 1)");
  }
  if (c.sparse_init_blocks + c.sparse_local_blocks > c.sparse_topk_blocks) {
    return invalid(source, "sparse_topk_blocks",
                   "sparse_init_block + sparse_local_block = " +
                       std::to_string(c.sparse_init_blocks + c.sparse_local_blocks) +
                       " exceeds sparse_topk_blocks = " + std::to_string(c.sparse_topk_blocks) +
                       "; the always-selected blocks must fit in the top-k");
  }
  return {};
}

// vision_config and the top-level projector keys (m3-model.md §1.1, §1.4); only when present.
Status parse_vision(const Sections& in, M3Config& c) {
  M3VisionConfig& v = c.vision;
  M3_TRY(std::optional<int64_t> img, in.top.get_int("image_token_index"));
  if (!img) {
    M3_TRY(img, in.top.get_int("image_token_id"));
  }
  if (img) v.image_token_index = *img;
  M3_TRY(std::optional<int64_t> vid, in.top.get_int("video_token_index"));
  if (!vid) {
    M3_TRY(vid, in.top.get_int("video_token_id"));
  }
  if (vid) v.video_token_index = *vid;
  v.present = c.has_vision_config;
  if (!v.present) return {};
  const json* vobj = in.top.raw("vision_config");
  Fields f(vobj, "vision_config.", in.source);
  auto int_key = [&](const char* key, int64_t& out) -> Status {
    M3_TRY(std::optional<int64_t> x, f.get_int(key));
    if (x) {
      if (*x < 1) return invalid(in.source, f.name(key), f.name(key) + " must be >= 1");
      out = *x;
    }
    return {};
  };
  M3_TRY_STATUS(int_key("hidden_size", v.hidden_size));
  M3_TRY_STATUS(int_key("intermediate_size", v.intermediate_size));
  M3_TRY_STATUS(int_key("num_hidden_layers", v.num_hidden_layers));
  M3_TRY_STATUS(int_key("num_attention_heads", v.num_attention_heads));
  M3_TRY_STATUS(int_key("num_channels", v.num_channels));
  M3_TRY_STATUS(int_key("patch_size", v.patch_size));
  M3_TRY_STATUS(int_key("temporal_patch_size", v.temporal_patch_size));
  M3_TRY_STATUS(int_key("spatial_merge_size", v.spatial_merge_size));
  // The shipped config spells the merge geometry in img_token_compression_config.
  if (const json* comp = in.top.raw("img_token_compression_config"); comp && comp->is_object()) {
    Fields cf(comp, "img_token_compression_config.", in.source);
    M3_TRY(std::optional<int64_t> sm, cf.get_int("spatial_merge_size"));
    if (sm && !f.has("spatial_merge_size")) v.spatial_merge_size = *sm;
    M3_TRY(std::optional<int64_t> tp, cf.get_int("temporal_patch_size"));
    if (tp && !f.has("temporal_patch_size")) v.temporal_patch_size = *tp;
  }
  M3_TRY(std::optional<double> eps, f.get_double("layer_norm_eps"));
  if (eps) v.layer_norm_eps = *eps;
  M3_TRY(std::optional<double> theta, f.get_double("rope_theta"));
  if (const json* rp = f.raw("rope_parameters"); rp && rp->is_object()) {
    Fields r(rp, "vision_config.rope_parameters.", in.source);
    M3_TRY(std::optional<double> t2, r.get_double("rope_theta"));
    if (t2) theta = t2;
  }
  if (theta) v.rope_theta = *theta;
  M3_TRY(std::optional<std::string> act, f.get_string("hidden_act"));
  if (act && *act != "gelu") {
    return unsupported(in.source, f.name("hidden_act"),
                       "vision_config.hidden_act \"" + *act +
                           "\" is not supported; the M3 vision tower uses \"gelu\" (erf)");
  }
  M3_TRY(std::optional<std::string> vtype, f.get_string("model_type"));
  v.rope_layout = vtype && *vtype == "minimax_m3_vl_vision" ? VisionRopeLayout::kTransformers
                                                            : VisionRopeLayout::kReference;
  M3_TRY(std::optional<int64_t> proj, in.top.get_int("projector_hidden_size"));
  if (proj) v.projector_hidden_size = *proj;
  M3_TRY(std::optional<bool> pbias, in.top.get_bool("multimodal_projector_bias"));
  if (pbias) v.projector_bias = *pbias;
  M3_TRY(std::optional<std::string> pact, in.top.get_string("projector_hidden_act"));
  if (pact && *pact != "gelu") {
    return unsupported(in.source, "projector_hidden_act",
                       "projector_hidden_act \"" + *pact + "\" is not supported (gelu only)");
  }
  if (v.hidden_size % v.num_attention_heads != 0 || v.head_dim() % 2 != 0) {
    return invalid(in.source, "vision_config.num_attention_heads",
                   "vision_config.hidden_size must split into an even head_dim per head");
  }
  if (v.rope_layout == VisionRopeLayout::kTransformers && v.head_dim() % 4 != 0) {
    return invalid(in.source, "vision_config.hidden_size",
                   "the transformers vision RoPE needs head_dim divisible by 4");
  }
  return {};
}

Result<M3Config> parse_config_json(const json& root, const std::string& source) {
  if (!root.is_object()) {
    return invalid(source, "",
                   "the top level must be a JSON object, got " + std::string(json_type_name(root)));
  }
  M3Config c;
  M3_TRY(const Sections in, parse_model_type(root, source, c));
  M3_TRY_STATUS(parse_sizes(in, c));
  M3_TRY_STATUS(parse_activation(in, c));
  M3_TRY_STATUS(check_attention_options(in));
  M3_TRY_STATUS(parse_rope(in, c));
  M3_TRY_STATUS(parse_moe_routing(in, c));
  M3_TRY_STATUS(parse_tokens(in, c));
  M3_TRY_STATUS(parse_msa_geometry(in, c));
  M3_TRY_STATUS(parse_layer_types(in, c));
  M3_TRY_STATUS(check_moe_sizes(in, c));
  M3_TRY_STATUS(check_msa(in, c));
  M3_TRY_STATUS(parse_vision(in, c));
  return c;
}

}  // namespace

int64_t M3Config::num_sparse_layers() const {
  int64_t n = 0;
  for (bool b : layer_is_sparse) n += b ? 1 : 0;
  return n;
}

std::string M3Config::summary() const {
  int64_t n_moe = 0;
  for (bool b : layer_is_moe) n_moe += b ? 1 : 0;
  const int64_t n_sparse = num_sparse_layers();
  std::ostringstream os;
  os << model_type << ": " << num_hidden_layers << " layers (" << n_sparse << " MSA + "
     << (num_hidden_layers - n_sparse) << " full attention; " << n_moe << " MoE + "
     << (num_hidden_layers - n_moe) << " dense), hidden " << hidden_size << ", heads "
     << num_attention_heads << "q/" << num_key_value_heads << "kv x " << head_dim << " (rotary "
     << rotary_dim << ", theta " << rope_theta << "), experts " << num_local_experts << " top-"
     << num_experts_per_tok << " + " << n_shared_experts << " shared (inter " << intermediate_size
     << ", dense " << dense_intermediate_size << ")";
  if (n_sparse > 0) {
    os << ", MSA index " << index_n_heads << "x" << index_head_dim << " block " << sparse_block_size
       << " top-" << sparse_topk_blocks << " init " << sparse_init_blocks << " local "
       << sparse_local_blocks;
  }
  os << ", vocab " << vocab_size << ", max_pos " << max_position_embeddings;
  return os.str();
}

Result<M3Config> parse_config(std::string_view json_text, std::string_view source) {
  const std::string src(source);
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::parse_error& e) {
    // e.what() carries "parse error at line L, column C: ..." which locates the mistake.
    return make_error(ErrorCode::kFormat, src + " is not valid JSON: " + e.what());
  }
  try {
    return parse_config_json(root, src);
  } catch (const json::exception& e) {
    // Every access above is type-checked first; this is a last line so no exception escapes.
    return make_error(ErrorCode::kFormat, src + ": unexpected JSON content: " + e.what());
  }
}

Result<M3Config> load_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return make_error(
        ErrorCode::kNotFound,
        "cannot open " + path + "; the model directory must contain the checkpoint's config.json");
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return make_error(ErrorCode::kIo, "error reading " + path);
  M3_TRY(const std::string text, apply_config_overrides(ss.str(), path));  // --hf-overrides
  return parse_config(text, path);
}

Status check_kv_block_size(const M3Config& cfg, int64_t block_size) {
  if (block_size == cfg.sparse_block_size) return {};
  std::string why = cfg.any_sparse() ? "the KV page must be one MSA block of " +
                                           std::to_string(cfg.sparse_block_size) + " tokens"
                                     : "m3serve always pages the KV cache in MSA blocks of " +
                                           std::to_string(cfg.sparse_block_size) + " tokens";
  return make_error(ErrorCode::kUnsupported,
                    "--block-size " + std::to_string(block_size) + " is not supported: " + why +
                        "; use --block-size " + std::to_string(cfg.sparse_block_size),
                    "--block-size");
}

}  // namespace m3::model
