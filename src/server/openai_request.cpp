#include "server/openai_request.h"

#include <algorithm>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "server/api_error.h"
#include "server/json_limits.h"

namespace m3::server {

std::string string_member(const OrderedJson& obj, const char* key, const std::string& dflt) {
  if (!obj.is_object()) return dflt;
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : dflt;
}

namespace {

std::string type_of(const OrderedJson& j) {
  if (j.is_number_integer() || j.is_number_unsigned()) return "integer";
  if (j.is_number_float()) return "number";
  return j.type_name();
}

const OrderedJson* field(const OrderedJson& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

Result<std::optional<double>> opt_number(const OrderedJson& obj, const char* key) {
  const OrderedJson* v = field(obj, key);
  if (!v) return std::optional<double>();
  if (!v->is_number()) {
    return invalid_param(key, std::string("'") + key + "' must be a number, got " + type_of(*v));
  }
  const double d = v->get<double>();
  if (!std::isfinite(d))
    return invalid_param(key, std::string("'") + key + "' must be a finite number");
  return std::optional<double>(d);
}

Result<std::optional<int64_t>> opt_integer(const OrderedJson& obj, const char* key) {
  const OrderedJson* v = field(obj, key);
  if (!v) return std::optional<int64_t>();
  if (v->is_number_integer()) return std::optional<int64_t>(v->get<int64_t>());
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return invalid_param(key, std::string("'") + key + "' is too large");
    }
    return std::optional<int64_t>(static_cast<int64_t>(u));
  }
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      return std::optional<int64_t>(static_cast<int64_t>(d));
    }
  }
  return invalid_param(key, std::string("'") + key + "' must be an integer, got " + type_of(*v));
}

Result<std::optional<bool>> opt_bool(const OrderedJson& obj, const char* key) {
  const OrderedJson* v = field(obj, key);
  if (!v) return std::optional<bool>();
  if (!v->is_boolean()) {
    return invalid_param(key, std::string("'") + key + "' must be a boolean, got " + type_of(*v));
  }
  return std::optional<bool>(v->get<bool>());
}

Result<std::optional<std::string>> opt_string(const OrderedJson& obj, const char* key) {
  const OrderedJson* v = field(obj, key);
  if (!v) return std::optional<std::string>();
  if (!v->is_string()) {
    return invalid_param(key, std::string("'") + key + "' must be a string, got " + type_of(*v));
  }
  return std::optional<std::string>(v->get<std::string>());
}

std::string fmt_num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Reads an optional float in [lo, hi] (open at lo when lo_open).
Status read_float(const OrderedJson& obj, const char* key, double lo, double hi, bool lo_open,
                  std::optional<float>& out) {
  M3_TRY(auto v, opt_number(obj, key));
  if (!v) return {};
  const bool low_ok = lo_open ? *v > lo : *v >= lo;
  if (!low_ok || *v > hi) {
    return invalid_param(key, std::string("'") + key + "' must be in " + (lo_open ? "(" : "[") +
                                  fmt_num(lo) + ", " + fmt_num(hi) + "], got " + fmt_num(*v));
  }
  out = static_cast<float>(*v);
  return {};
}

Result<OrderedJson> parse_body(std::string_view body) {
  M3_TRY(OrderedJson j, parse_json_bounded(body, "the request body"));
  if (!j.is_object()) {
    return invalid_param("", "request body must be a JSON object, got " + type_of(j));
  }
  return j;
}

Result<std::vector<int32_t>> token_array(const OrderedJson& arr, const std::string& param);

// logit_bias, allowed_token_ids, bad_words.
// vLLM's kv_transfer_params: the router sends {"do_remote_decode": true, the rest null} to the
// prefill worker and the prefill worker's answer (do_remote_prefill, remote_*) to the decode one.
Status parse_kv_transfer(const OrderedJson& j, CommonParams& p) {
  auto it = j.find("kv_transfer_params");
  if (it == j.end() || it->is_null()) return {};
  const std::string f = "kv_transfer_params";
  if (!it->is_object()) return invalid_param(f, "'kv_transfer_params' must be an object");
  const OrderedJson& k = *it;
  engine::KvTransferParams t;
  M3_TRY(auto dec, opt_bool(k, "do_remote_decode"));
  M3_TRY(auto pre, opt_bool(k, "do_remote_prefill"));
  t.do_remote_decode = dec.value_or(false);
  t.do_remote_prefill = pre.value_or(false);
  if (!t.do_remote_decode && !t.do_remote_prefill) return {};
  M3_TRY(auto eng, opt_string(k, "remote_engine_id"));
  M3_TRY(auto host, opt_string(k, "remote_host"));
  t.remote_engine_id = eng.value_or("");
  t.remote_host = host.value_or("");
  if (auto r = k.find("remote_request_id"); r != k.end() && !r->is_null()) {
    if (r->is_string())
      t.remote_request_id = r->get<std::string>();
    else if (r->is_number_integer())
      t.remote_request_id = std::to_string(r->get<int64_t>());
    else
      return invalid_param(f, "'kv_transfer_params.remote_request_id' must be a string");
  }
  if (auto r = k.find("remote_port"); r != k.end() && !r->is_null()) {
    if (!r->is_number_integer() || r->get<int64_t>() < 1 || r->get<int64_t>() > 65535)
      return invalid_param(f, "'kv_transfer_params.remote_port' must be a port number (1-65535)");
    t.remote_port = static_cast<int>(r->get<int64_t>());
  }
  if (auto r = k.find("remote_block_ids"); r != k.end() && !r->is_null()) {
    if (!r->is_array())
      return invalid_param(f, "'kv_transfer_params.remote_block_ids' must be an array");
    // vLLM >= 0.11 nests them per KV cache group: [[ids...]]; m3serve has one group.
    const OrderedJson* ids = &*r;
    if (ids->size() == 1 && (*ids)[0].is_array()) ids = &(*ids)[0];
    for (const auto& b : *ids) {
      if (!b.is_number_integer() || b.get<int64_t>() < 0 ||
          b.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return invalid_param(
            f, "'kv_transfer_params.remote_block_ids' entries must be page ids (>= 0)");
      t.remote_block_ids.push_back(b.get<int64_t>());
    }
  }
  if (t.do_remote_decode && p.stream)
    return invalid_param(
        f,
        "kv_transfer_params.do_remote_decode with stream: the kv_transfer_params for the "
        "decode worker come in the non-streamed response; send stream: false (as "
        "vllm-router does)");
  if (p.n != 1)
    return invalid_param(
        f, "kv_transfer_params with n = " + std::to_string(p.n) +
               ": prefill/decode disaggregation serves one choice per request (n = 1)");
  p.kv_transfer = std::move(t);
  return {};
}

Status parse_logit_controls(const OrderedJson& j, CommonParams& p) {
  if (const OrderedJson* lb = field(j, "logit_bias")) {
    if (!lb->is_object()) {
      return invalid_param(
          "logit_bias",
          "'logit_bias' must be an object of token id (a string) -> bias, got " + type_of(*lb));
    }
    if (lb->size() > kMaxLogitBias) {
      return invalid_param("logit_bias", "'logit_bias' holds " + std::to_string(lb->size()) +
                                             " entries; at most " + std::to_string(kMaxLogitBias) +
                                             " are allowed");
    }
    for (auto it = lb->begin(); it != lb->end(); ++it) {
      const std::string& key = it.key();
      int64_t id = -1;
      if (!key.empty() && key.size() <= 10 && std::all_of(key.begin(), key.end(), ::isdigit))
        id = std::stoll(key);
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return invalid_param(
            "logit_bias", "'logit_bias' keys must be token ids written as decimal strings, got \"" +
                              key.substr(0, 40) + "\"");
      }
      if (!it->is_number() || !std::isfinite(it->get<double>())) {
        return invalid_param("logit_bias",
                             "'logit_bias[\"" + key + "\"]' must be a number, got " + type_of(*it));
      }
      // As OpenAI (and vLLM): biases are clamped to [-100, 100].
      const float b = static_cast<float>(std::clamp(it->get<double>(), -100.0, 100.0));
      p.logit_bias.push_back({static_cast<int32_t>(id), b});
    }
  }
  if (const OrderedJson* ids = field(j, "allowed_token_ids")) {
    if (!ids->is_array()) {
      return invalid_param(
          "allowed_token_ids",
          "'allowed_token_ids' must be an array of token ids, got " + type_of(*ids));
    }
    M3_TRY(p.allowed_token_ids, token_array(*ids, "allowed_token_ids"));
  }
  if (const OrderedJson* bw = field(j, "bad_words")) {
    if (!bw->is_array())
      return invalid_param("bad_words",
                           "'bad_words' must be an array of strings, got " + type_of(*bw));
    if (bw->size() > kMaxStopStrings) {
      return invalid_param("bad_words", "'bad_words' holds " + std::to_string(bw->size()) +
                                            " strings; at most " + std::to_string(kMaxStopStrings) +
                                            " are allowed");
    }
    for (size_t i = 0; i < bw->size(); ++i) {
      const auto& w = (*bw)[i];
      const std::string wp = "bad_words[" + std::to_string(i) + "]";
      if (!w.is_string() || w.get<std::string>().empty()) {
        return invalid_param(wp, "'" + wp + "' must be a non-empty string");
      }
      if (w.get<std::string>().size() > kMaxStopStringBytes) {
        return invalid_param(
            wp, "'" + wp + "' is longer than " + std::to_string(kMaxStopStringBytes) + " bytes");
      }
      p.bad_words.push_back(w.get<std::string>());
    }
  }
  return {};
}

// A JSON schema given as an object or as JSON text (vLLM accepts both for guided_json).
Result<std::string> schema_text(const OrderedJson& v, const std::string& param) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    OrderedJson parsed = OrderedJson::parse(v.get<std::string>(), nullptr, false);
    if (!parsed.is_discarded() && (parsed.is_object() || parsed.is_boolean())) return parsed.dump();
    return invalid_param(
        param, "'" + param + "' must be a JSON schema: an object, or a string holding one");
  }
  return invalid_param(param, "'" + param + "' must be a JSON schema object, got " + type_of(v));
}

Result<std::string> string_field(const OrderedJson& v, const std::string& param) {
  if (!v.is_string() || v.get<std::string>().empty()) {
    return invalid_param(param, "'" + param + "' must be a non-empty string, got " + type_of(v));
  }
  return v.get<std::string>();
}

Result<std::vector<std::string>> choice_list(const OrderedJson& v, const std::string& param) {
  if (!v.is_array() || v.empty())
    return invalid_param(param, "'" + param + "' must be a non-empty array of strings");
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      return invalid_param(param, "'" + param + "[" + std::to_string(i) +
                                      "]' must be a string, got " + type_of(v[i]));
    }
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// One constraint from structured_outputs.<key> / guided_<key>.
Result<std::optional<text::StructuredOutputSpec>> structured_entry(const OrderedJson& v,
                                                                   const std::string& key,
                                                                   const std::string& param) {
  using K = text::StructuredOutputSpec::Kind;
  text::StructuredOutputSpec s;
  s.param = param;
  if (key == "json") {
    s.kind = K::kJsonSchema;
    M3_TRY(s.value, schema_text(v, param));
  } else if (key == "regex") {
    s.kind = K::kRegex;
    M3_TRY(s.value, string_field(v, param));
  } else if (key == "choice") {
    s.kind = K::kChoice;
    M3_TRY(s.choices, choice_list(v, param));
  } else if (key == "grammar") {
    s.kind = K::kGrammar;
    M3_TRY(s.value, string_field(v, param));
  } else if (key == "json_object") {
    if (!v.is_boolean())
      return invalid_param(param, "'" + param + "' must be a boolean, got " + type_of(v));
    if (!v.get<bool>()) return std::optional<text::StructuredOutputSpec>();
    s.kind = K::kJsonObject;
  }
  return std::optional<text::StructuredOutputSpec>(std::move(s));
}

// response_format, structured_outputs and the guided_* aliases; at most one constraint.
Status parse_structured(const OrderedJson& j, CommonParams& p) {
  std::vector<text::StructuredOutputSpec> found;
  if (const OrderedJson* rf = field(j, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string()) {
      return invalid_param("response_format",
                           "'response_format' must be an object with a string 'type'");
    }
    const std::string t = (*rf)["type"].get<std::string>();
    text::StructuredOutputSpec s;
    if (t == "json_object") {
      s.kind = text::StructuredOutputSpec::Kind::kJsonObject;
      s.param = "response_format";
      found.push_back(std::move(s));
    } else if (t == "json_schema") {
      const OrderedJson* js = field(*rf, "json_schema");
      if (!js || !js->is_object()) {
        return invalid_param(
            "response_format.json_schema",
            "'response_format.json_schema' must be an object {name, schema, strict}");
      }
      // OpenAI's field is `schema`; vLLM also reads `json_schema` there.
      const OrderedJson* schema = field(*js, "schema");
      std::string sp = "response_format.json_schema.schema";
      if (!schema) {
        schema = field(*js, "json_schema");
        sp = "response_format.json_schema.json_schema";
      }
      if (!schema) {
        return invalid_param(
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema' is required: the JSON schema of the output");
      }
      if (const OrderedJson* strict = field(*js, "strict"); strict && !strict->is_boolean()) {
        return invalid_param("response_format.json_schema.strict",
                             "'response_format.json_schema.strict' must be a boolean");
      }
      s.kind = text::StructuredOutputSpec::Kind::kJsonSchema;
      s.param = sp;
      M3_TRY(s.value, schema_text(*schema, sp));
      found.push_back(std::move(s));
    } else if (t == "structural_tag") {
      M3_TRY(auto format, text::structural_tag_format(*rf, "response_format"));
      s.kind = text::StructuredOutputSpec::Kind::kStructuralTag;
      s.param = "response_format";
      s.value = format.dump();
      found.push_back(std::move(s));
    } else if (t != "text") {
      return invalid_param(
          "response_format.type",
          "'response_format.type' must be \"text\", \"json_object\", \"json_schema\" "
          "or \"structural_tag\", got \"" +
              t + "\"");
    }
  }
  static constexpr const char* kKinds[] = {"json", "regex", "choice", "grammar", "json_object"};
  if (const OrderedJson* so = field(j, "structured_outputs")) {
    if (!so->is_object()) {
      return invalid_param("structured_outputs",
                           "'structured_outputs' must be an object, got " + type_of(*so));
    }
    for (auto it = so->begin(); it != so->end(); ++it) {
      const std::string& key = it.key();
      const std::string param = "structured_outputs." + key;
      if (it->is_null()) continue;
      if (std::find(std::begin(kKinds), std::end(kKinds), key) != std::end(kKinds)) {
        M3_TRY(auto s, structured_entry(*it, key, param));
        if (s) found.push_back(std::move(*s));
      } else if (key == "disable_fallback" || key == "disable_any_whitespace" ||
                 key == "disable_additional_properties") {
        // One grammar engine (no fallback to choose); the others change the grammar and are
        // only accepted where they change nothing.
        if (!it->is_boolean()) return invalid_param(param, "'" + param + "' must be a boolean");
        if (key != "disable_fallback" && it->get<bool>()) {
          return unsupported_param(param, "'" + param + "': true is not supported; leave it out");
        }
      } else if (key == "backend") {
        if (!it->is_string() ||
            (it->get<std::string>() != "xgrammar" && it->get<std::string>() != "auto")) {
          return unsupported_param(
              param, "'" + param + "' must be \"xgrammar\" or \"auto\" (the only backend here)");
        }
      } else if (key == "structural_tag") {
        // vLLM's field holds the structural tag as JSON text (an object is taken too).
        OrderedJson tag = *it;
        if (it->is_string()) {
          tag = OrderedJson::parse(it->get<std::string>(), nullptr, false);
          if (tag.is_discarded())
            return invalid_param(
                param, "'" + param + "' must be a structural tag: JSON text or an object");
        }
        M3_TRY(auto format, text::structural_tag_format(tag, param));
        text::StructuredOutputSpec st;
        st.kind = text::StructuredOutputSpec::Kind::kStructuralTag;
        st.param = param;
        st.value = format.dump();
        found.push_back(std::move(st));
      } else if (key == "whitespace_pattern") {
        return unsupported_param(param, "'" + param +
                                            "' is not supported; use json, regex, choice, grammar, "
                                            "json_object or structural_tag");
      } else {
        return invalid_param(param,
                             "'structured_outputs' has no field '" + key +
                                 "'; it takes one of json, regex, choice, grammar, json_object, "
                                 "structural_tag");
      }
    }
  }
  for (const char* key : kKinds) {
    const std::string g = std::string("guided_") + key;
    if (const OrderedJson* v = field(j, g.c_str())) {
      M3_TRY(auto s, structured_entry(*v, key, g));
      if (s) found.push_back(std::move(*s));
    }
  }
  if (const OrderedJson* b = field(j, "guided_decoding_backend")) {
    if (!b->is_string() ||
        (b->get<std::string>() != "xgrammar" && b->get<std::string>() != "auto")) {
      return unsupported_param("guided_decoding_backend",
                               "'guided_decoding_backend' must be \"xgrammar\" or \"auto\"");
    }
  }
  if (field(j, "guided_whitespace_pattern")) {
    return unsupported_param("guided_whitespace_pattern",
                             "'guided_whitespace_pattern' is not supported; leave it out");
  }
  if (found.size() > 1) {
    return invalid_param(found[1].param,
                         "only one structured output constraint may be given, but '" +
                             found[0].param + "' and '" + found[1].param + "' both are; keep one");
  }
  if (!found.empty()) p.structured = std::move(found[0]);
  return {};
}

// vLLM's refusal of a logprobs count over --max-logprobs (`what`: "sample" or "prompt").
tl::unexpected<Error> over_max_logprobs(const std::string& param, const char* what, int64_t k,
                                        int32_t max_logprobs) {
  return invalid_param(param, std::string("Requested ") + what + " logprobs of " +
                                  std::to_string(k) + ", which is greater than max allowed: " +
                                  std::to_string(max_logprobs) + " (the server's --max-logprobs)");
}

// vLLM's fields beyond OpenAI's that both endpoints read.
Status parse_vllm_extras(const OrderedJson& j, CommonParams& p, int32_t max_logprobs) {
  M3_TRY(auto beam, opt_bool(j, "use_beam_search"));
  if (beam && *beam) {
    return unsupported_param("use_beam_search",
                             "'use_beam_search' is not supported: m3serve samples one sequence per "
                             "choice; leave it out (use 'n' for several samples)");
  }
  M3_TRY(auto trunc, opt_integer(j, "truncate_prompt_tokens"));
  if (trunc) {
    if (*trunc < -1 || *trunc == 0) {
      return invalid_param(
          "truncate_prompt_tokens",
          "'truncate_prompt_tokens' must be a positive number of tokens (or -1: the last "
          "max_model_len), got " +
              std::to_string(*trunc));
    }
    p.truncate_prompt_tokens = *trunc;
  }
  M3_TRY(auto plp, opt_integer(j, "prompt_logprobs"));
  if (plp) {
    if (*plp < 0) {
      return invalid_param("prompt_logprobs",
                           "'prompt_logprobs' must be >= 0, got " + std::to_string(*plp));
    }
    if (*plp > max_logprobs)
      return over_max_logprobs("prompt_logprobs", "prompt", *plp, max_logprobs);
    if (p.stream) {
      return invalid_param("prompt_logprobs",
                           "'prompt_logprobs' are not available when 'stream' is true");
    }
    p.prompt_logprobs = static_cast<int32_t>(*plp);
  }
  M3_TRY(auto rti, opt_bool(j, "return_token_ids"));
  p.return_token_ids = rti.value_or(false);
  M3_TRY(auto rtt, opt_bool(j, "return_tokens_as_token_ids"));
  p.return_tokens_as_token_ids = rtt.value_or(false);
  return {};
}

// Fields that both endpoints read.
Status parse_common(const OrderedJson& j, CommonParams& p, bool chat) {
  M3_TRY(auto model, opt_string(j, "model"));
  if (model) p.model = *model;

  M3_TRY(auto n, opt_integer(j, "n"));
  if (n) {
    if (*n < 1 || *n > kMaxN) {
      return invalid_param("n", "'n' must be between 1 and " + std::to_string(kMaxN) + ", got " +
                                    std::to_string(*n));
    }
    p.n = static_cast<int32_t>(*n);
  }
  M3_TRY(auto best_of, opt_integer(j, "best_of"));
  if (best_of && *best_of != p.n) {
    return unsupported_param("best_of",
                             "'best_of' different from 'n' is not supported; leave it out");
  }

  M3_TRY(auto stream, opt_bool(j, "stream"));
  p.stream = stream.value_or(false);
  if (const OrderedJson* so = field(j, "stream_options")) {
    if (!so->is_object()) {
      return invalid_param("stream_options",
                           "'stream_options' must be an object, got " + type_of(*so));
    }
    M3_TRY(auto iu, opt_bool(*so, "include_usage"));
    M3_TRY(auto cu, opt_bool(*so, "continuous_usage_stats"));
    p.include_usage = iu.value_or(false);
    p.continuous_usage_stats = cu.value_or(false);
  }

  // max_completion_tokens is the newer name; it wins when both are given.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    M3_TRY(auto mt, opt_integer(j, key));
    if (!mt) continue;
    if (*mt < 1) {
      return invalid_param(
          key, std::string("'") + key + "' must be at least 1, got " + std::to_string(*mt));
    }
    if (*mt > std::numeric_limits<int32_t>::max()) {
      return invalid_param(
          key, std::string("'") + key + "' is too large (" + std::to_string(*mt) +
                   "); prompt + completion must fit the model's context (--max-model-len)");
    }
    p.max_tokens = static_cast<int32_t>(*mt);
  }
  M3_TRY(auto min_tokens, opt_integer(j, "min_tokens"));
  if (min_tokens) {
    if (*min_tokens < 0 || *min_tokens > std::numeric_limits<int32_t>::max()) {
      return invalid_param("min_tokens",
                           "'min_tokens' must be >= 0, got " + std::to_string(*min_tokens));
    }
    if (p.max_tokens && *min_tokens > *p.max_tokens) {
      return invalid_param("min_tokens", "'min_tokens' (" + std::to_string(*min_tokens) +
                                             ") must not exceed max_tokens (" +
                                             std::to_string(*p.max_tokens) + ")");
    }
    p.min_tokens = static_cast<int32_t>(*min_tokens);
  }

  M3_TRY_STATUS(read_float(j, "temperature", 0.0, 100.0, false, p.temperature));
  M3_TRY_STATUS(read_float(j, "top_p", 0.0, 1.0, true, p.top_p));
  M3_TRY_STATUS(read_float(j, "min_p", 0.0, 1.0, false, p.min_p));
  M3_TRY_STATUS(read_float(j, "presence_penalty", -2.0, 2.0, false, p.presence_penalty));
  M3_TRY_STATUS(read_float(j, "frequency_penalty", -2.0, 2.0, false, p.frequency_penalty));
  M3_TRY_STATUS(read_float(j, "repetition_penalty", 0.0, 2.0, true, p.repetition_penalty));
  M3_TRY(auto top_k, opt_integer(j, "top_k"));
  if (top_k) {
    if (*top_k < -1 || *top_k > std::numeric_limits<int32_t>::max()) {
      return invalid_param(
          "top_k",
          "'top_k' must be -1 (off), 0 (off) or a positive integer, got " + std::to_string(*top_k));
    }
    p.top_k = static_cast<int32_t>(*top_k);
  }
  if (const OrderedJson* seed = field(j, "seed")) {
    if (seed->is_number_unsigned()) {
      p.seed = seed->get<uint64_t>();
    } else if (seed->is_number_integer()) {
      p.seed = static_cast<uint64_t>(seed->get<int64_t>());
    } else {
      return invalid_param("seed", "'seed' must be an integer, got " + type_of(*seed));
    }
  }

  if (const OrderedJson* stop = field(j, "stop")) {
    if (stop->is_string()) {
      if (!stop->get<std::string>().empty()) p.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > kMaxStopStrings) {
        return invalid_param("stop", "'stop' holds " + std::to_string(stop->size()) +
                                         " strings; at most " + std::to_string(kMaxStopStrings) +
                                         " are allowed");
      }
      for (size_t i = 0; i < stop->size(); ++i) {
        const auto& s = (*stop)[i];
        if (!s.is_string()) {
          return invalid_param(
              "stop", "'stop[" + std::to_string(i) + "]' must be a string, got " + type_of(s));
        }
        if (!s.get<std::string>().empty()) p.stop.push_back(s.get<std::string>());
      }
    } else {
      return invalid_param("stop",
                           "'stop' must be a string or an array of strings, got " + type_of(*stop));
    }
    for (const auto& s : p.stop) {
      if (s.size() > kMaxStopStringBytes) {
        return invalid_param("stop", "a stop string is " + std::to_string(s.size()) +
                                         " bytes; at most " + std::to_string(kMaxStopStringBytes) +
                                         " are allowed");
      }
    }
  }
  if (const OrderedJson* ids = field(j, "stop_token_ids")) {
    if (!ids->is_array()) {
      return invalid_param("stop_token_ids",
                           "'stop_token_ids' must be an array of integers, got " + type_of(*ids));
    }
    if (ids->size() > kMaxStopTokenIds) {
      return invalid_param("stop_token_ids", "'stop_token_ids' holds " +
                                                 std::to_string(ids->size()) + " ids; at most " +
                                                 std::to_string(kMaxStopTokenIds) + " are allowed");
    }
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return invalid_param("stop_token_ids",
                             "'stop_token_ids' entries must be non-negative token ids");
      }
      p.stop_token_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  M3_TRY(auto ignore_eos, opt_bool(j, "ignore_eos"));
  p.ignore_eos = ignore_eos.value_or(false);
  M3_TRY(auto skip, opt_bool(j, "skip_special_tokens"));
  p.skip_special_tokens = skip.value_or(true);
  M3_TRY(auto incl, opt_bool(j, "include_stop_str_in_output"));
  p.include_stop_str_in_output = incl.value_or(false);
  M3_TRY(auto priority, opt_integer(j, "priority"));
  if (priority) {
    if (*priority < std::numeric_limits<int32_t>::min() ||
        *priority > std::numeric_limits<int32_t>::max()) {
      return invalid_param("priority", "'priority' must fit in 32 bits");
    }
    p.priority = static_cast<int32_t>(*priority);
  }

  M3_TRY_STATUS(parse_logit_controls(j, p));
  M3_TRY_STATUS(parse_structured(j, p));
  M3_TRY_STATUS(parse_kv_transfer(j, p));
  (void)chat;
  return {};
}

Result<std::vector<int32_t>> token_array(const OrderedJson& arr, const std::string& param) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const auto& v : arr) {
    if (!(v.is_number_integer() || v.is_number_unsigned())) {
      return invalid_param(param,
                           "'" + param + "' must hold only integer token ids, got " + type_of(v));
    }
    const int64_t id = v.is_number_unsigned()
                           ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), 1ull << 40))
                           : v.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return invalid_param(param, "'" + param + "' holds token id " + std::to_string(id) +
                                      ", which is not a valid id");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  if (ids.empty())
    return invalid_param(param, "'" + param + "' must not be an empty list of token ids");
  return ids;
}

// An image or video part's URL: {"image_url": {"url": U}} or {"image_url": U} (also "video_url",
// and the Responses-style {"type": "input_image", "image_url": U}).
Result<std::string> media_url(const OrderedJson& part, const char* key, const std::string& pp) {
  if (!part.contains(key))
    return invalid_param(pp + "." + key, "'" + pp + "." + key + "' is required");
  const auto& u = part[key];
  if (u.is_string()) return u.get<std::string>();
  if (u.is_object() && u.contains("url") && u["url"].is_string())
    return u["url"].get<std::string>();
  return invalid_param(pp + "." + key,
                       "'" + pp + "." + key + "' must be a URL string or {\"url\": ...}");
}

// Message content: a string, null, or an array of {"type": "text", "text": ...} parts
// (joined with "\n", as vLLM does for string-content templates). With image or video parts the
// content stays a list of text and {"type": "image"} / {"type": "video"} parts, in order, so the
// chat template writes a placeholder per part; `media` gets the parts' URLs in that order.
Result<OrderedJson> normalise_content(const OrderedJson& content, const std::string& param,
                                      std::vector<MediaPart>* media = nullptr) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) {
    return invalid_param(param, "'" + param +
                                    "' must be a string, null or an array of content parts, got " +
                                    type_of(content));
  }
  if (content.size() > kMaxContentParts) {
    return invalid_param(param, "'" + param + "' has " + std::to_string(content.size()) +
                                    " parts; at most " + std::to_string(kMaxContentParts) +
                                    " are allowed");
  }
  std::string text;
  bool first = true;
  OrderedJson parts = OrderedJson::array();  // the list form, used when there is media
  bool has_media = false;
  for (size_t i = 0; i < content.size(); ++i) {
    const auto& part = content[i];
    const std::string pp = param + "[" + std::to_string(i) + "]";
    if (part.is_string()) {
      text += (first ? "" : "\n") + part.get<std::string>();
      first = false;
      parts.push_back({{"type", "text"}, {"text", part.get<std::string>()}});
      continue;
    }
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      return invalid_param(pp, "'" + pp + "' must be an object with a string 'type'");
    }
    const std::string type = part["type"].get<std::string>();
    if (type == "text" || type == "input_text" || type == "output_text") {
      if (!part.contains("text") || !part["text"].is_string()) {
        return invalid_param(pp + ".text", "'" + pp + ".text' must be a string");
      }
      text += (first ? "" : "\n") + part["text"].get<std::string>();
      first = false;
      parts.push_back({{"type", "text"}, {"text", part["text"].get<std::string>()}});
    } else if (type == "refusal") {
      continue;
    } else if (media != nullptr &&
               (type == "image_url" || type == "input_image" || type == "video_url")) {
      const bool video = type == "video_url";
      M3_TRY(std::string url, media_url(part, video ? "video_url" : "image_url", pp));
      media->push_back(MediaPart{video ? "video" : "image", std::move(url), pp});
      parts.push_back({{"type", video ? "video" : "image"}});
      has_media = true;
    } else {
      return unsupported_param(pp,
                               "content part type '" + type +
                                   "' is not supported; send text, image_url or video_url parts");
    }
  }
  if (has_media) return parts;
  return OrderedJson(text);
}

Result<OrderedJson> parse_messages(const OrderedJson& j, std::vector<MediaPart>* media) {
  const OrderedJson* msgs = field(j, "messages");
  if (!msgs)
    return invalid_param("messages",
                         "'messages' is required: a non-empty array of {role, content}");
  if (!msgs->is_array())
    return invalid_param("messages", "'messages' must be an array, got " + type_of(*msgs));
  if (msgs->empty()) return invalid_param("messages", "'messages' must not be empty");
  if (msgs->size() > kMaxMessages) {
    return invalid_param("messages", "'messages' holds " + std::to_string(msgs->size()) +
                                         " messages; at most " + std::to_string(kMaxMessages) +
                                         " are allowed");
  }
  OrderedJson out = OrderedJson::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const std::string mp = "messages[" + std::to_string(i) + "]";
    const auto& m = (*msgs)[i];
    if (!m.is_object())
      return invalid_param(mp, "'" + mp + "' must be an object, got " + type_of(m));
    if (!m.contains("role") || !m["role"].is_string() || m["role"].get<std::string>().empty()) {
      return invalid_param(mp + ".role", "'" + mp + ".role' must be a non-empty string");
    }
    OrderedJson msg = m;
    const std::string role = m["role"].get<std::string>();
    // The roles chat templates know ("root" carries M3's identity override).
    static const char* const kRoles[] = {"system", "developer", "user", "assistant",
                                         "tool",   "function",  "root"};
    if (std::find(std::begin(kRoles), std::end(kRoles), role) == std::end(kRoles)) {
      return invalid_param(mp + ".role",
                           "'" + mp + ".role' is '" + role +
                               "'; use one of system, developer, user, assistant, tool, root");
    }
    if (m.contains("content")) {
      M3_TRY(auto c, normalise_content(m["content"], mp + ".content", media));
      msg["content"] = std::move(c);
    } else if (role != "assistant") {
      return invalid_param(mp + ".content",
                           "'" + mp + ".content' is required for role '" + role + "'");
    } else {
      msg["content"] = nullptr;
    }
    // Reasoning round-trips under either name (interleaved thinking must stay in history).
    for (const char* key : {"reasoning_content", "reasoning"}) {
      if (msg.contains(key) && !msg[key].is_null() && !msg[key].is_string()) {
        return invalid_param(mp + "." + key, "'" + mp + "." + key + "' must be a string");
      }
    }
    if (msg.contains("reasoning") && msg["reasoning"].is_string() &&
        (!msg.contains("reasoning_content") || msg["reasoning_content"].is_null())) {
      msg["reasoning_content"] = msg["reasoning"];
    }
    if (msg.contains("tool_calls") && !msg["tool_calls"].is_null()) {
      const auto& tcs = msg["tool_calls"];
      if (!tcs.is_array())
        return invalid_param(mp + ".tool_calls", "'" + mp + ".tool_calls' must be an array");
      if (tcs.size() > kMaxToolCalls) {
        return invalid_param(mp + ".tool_calls",
                             "'" + mp + ".tool_calls' holds " + std::to_string(tcs.size()) +
                                 " calls; at most " + std::to_string(kMaxToolCalls) +
                                 " are allowed");
      }
      OrderedJson calls = OrderedJson::array();
      for (size_t k = 0; k < tcs.size(); ++k) {
        const std::string tp = mp + ".tool_calls[" + std::to_string(k) + "]";
        const auto& tc = tcs[k];
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object()) {
          return invalid_param(tp, "'" + tp + "' must be an object with a 'function' object");
        }
        OrderedJson call = tc;
        OrderedJson& fn = call["function"];
        if (!fn.contains("name") || !fn["name"].is_string()) {
          return invalid_param(tp + ".function.name",
                               "'" + tp + ".function.name' must be a string");
        }
        // Templates iterate the arguments as a mapping; clients send them as a JSON string.
        if (fn.contains("arguments") && !fn["arguments"].is_string() &&
            !fn["arguments"].is_object() && !fn["arguments"].is_null()) {
          return invalid_param(
              tp + ".function.arguments",
              "'" + tp + ".function.arguments' must be a JSON string (or an object), got " +
                  type_of(fn["arguments"]));
        }
        if (fn.contains("arguments") && fn["arguments"].is_string()) {
          // Arguments that are not JSON stay a string (the template prints them as given); a
          // string nested too deep is refused rather than parsed.
          const std::string ap = tp + ".function.arguments";
          const std::string& text = fn["arguments"].get_ref<const std::string&>();
          const JsonShape shape = json_shape(text, kMaxJsonDepth, kMaxObjectMembers);
          if (shape.depth > kMaxJsonDepth) {
            return invalid_param(ap, "'" + ap + "' nests objects/arrays more than " +
                                         std::to_string(kMaxJsonDepth) +
                                         " levels deep; flatten it");
          }
          if (shape.max_members > kMaxObjectMembers) {
            return invalid_param(ap, "'" + ap + "' has an object with more than " +
                                         std::to_string(kMaxObjectMembers) + " members");
          }
          OrderedJson args = OrderedJson::parse(text, nullptr, false);
          if (!args.is_discarded() && args.is_object()) fn["arguments"] = std::move(args);
        }
        calls.push_back(std::move(call));
      }
      msg["tool_calls"] = std::move(calls);
    }
    out.push_back(std::move(msg));
  }
  return out;
}

Status parse_tools(const OrderedJson& j, ChatRequest& r) {
  const OrderedJson* tools = field(j, "tools");
  if (tools) {
    if (!tools->is_array())
      return invalid_param("tools", "'tools' must be an array, got " + type_of(*tools));
    if (tools->size() > kMaxTools) {
      return invalid_param("tools", "'tools' holds " + std::to_string(tools->size()) +
                                        " tools; at most " + std::to_string(kMaxTools) +
                                        " are allowed");
    }
    // Schemas are walked by the template and the tool parser; bound that work before it starts.
    if (json_node_count(*tools, kMaxToolSchemaNodes) > kMaxToolSchemaNodes) {
      return invalid_param("tools", "'tools' holds more than " +
                                        std::to_string(kMaxToolSchemaNodes) +
                                        " JSON values in all; send fewer or smaller tool schemas");
    }
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string tp = "tools[" + std::to_string(i) + "]";
      const auto& t = (*tools)[i];
      if (!t.is_object()) return invalid_param(tp, "'" + tp + "' must be an object");
      if (t.contains("type") &&
          (!t["type"].is_string() || t["type"].get<std::string>() != "function")) {
        return unsupported_param(tp + ".type", "'" + tp + ".type' must be \"function\"");
      }
      if (!t.contains("function") || !t["function"].is_object()) {
        return invalid_param(tp + ".function",
                             "'" + tp + ".function' must be an object with 'name'");
      }
      const auto& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() ||
          fn["name"].get<std::string>().empty()) {
        return invalid_param(tp + ".function.name",
                             "'" + tp + ".function.name' must be a non-empty string");
      }
      if (fn.contains("parameters") && !fn["parameters"].is_null() &&
          !fn["parameters"].is_object()) {
        return invalid_param(tp + ".function.parameters",
                             "'" + tp + ".function.parameters' must be a JSON schema object");
      }
    }
    if (!tools->empty()) r.tools = *tools;
  }
  const OrderedJson* tc = field(j, "tool_choice");
  if (!tc) {
    r.tool_choice.kind = r.tools.is_array() ? ToolChoiceKind::kAuto : ToolChoiceKind::kNone;
    return {};
  }
  r.tool_choice_given = true;
  if (tc->is_string()) {
    const std::string s = tc->get<std::string>();
    if (s == "auto")
      r.tool_choice.kind = ToolChoiceKind::kAuto;
    else if (s == "none")
      r.tool_choice.kind = ToolChoiceKind::kNone;
    else if (s == "required")
      r.tool_choice.kind = ToolChoiceKind::kRequired;
    else
      return invalid_param("tool_choice",
                           "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                           "\"function\", \"function\": {\"name\": ...}}, got \"" +
                               s + "\"");
  } else if (tc->is_object()) {
    const auto fn = tc->find("function");
    if (fn == tc->end() || !fn->is_object() || !fn->contains("name") ||
        !(*fn)["name"].is_string()) {
      return invalid_param(
          "tool_choice",
          "'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    r.tool_choice.kind = ToolChoiceKind::kNamed;
    r.tool_choice.name = (*fn)["name"].get<std::string>();
  } else {
    return invalid_param("tool_choice",
                         "'tool_choice' must be a string or an object, got " + type_of(*tc));
  }
  if (r.tool_choice.kind == ToolChoiceKind::kRequired ||
      r.tool_choice.kind == ToolChoiceKind::kNamed) {
    if (!r.tools.is_array()) {
      return invalid_param(
          "tool_choice",
          "tool_choice '" +
              std::string(r.tool_choice.kind == ToolChoiceKind::kNamed ? "function" : "required") +
              "' needs a non-empty 'tools' list");
    }
  }
  if (r.tool_choice.kind == ToolChoiceKind::kNamed) {
    bool found = false;
    for (const auto& t : r.tools)
      found = found || t["function"]["name"].get<std::string>() == r.tool_choice.name;
    if (!found) {
      return invalid_param("tool_choice", "tool_choice names function '" + r.tool_choice.name +
                                              "', which is not in 'tools'");
    }
  }
  return {};
}

}  // namespace

Result<GenerationDefaults> GenerationDefaults::from_json_text(std::string_view text,
                                                              std::string_view source) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return make_error(ErrorCode::kFormat, std::string(source) + " is not a JSON object");
  }
  GenerationDefaults d;
  auto num = [&](const char* key, std::optional<float>& out) {
    auto it = j.find(key);
    if (it != j.end() && it->is_number()) out = it->get<float>();
  };
  num("temperature", d.temperature);
  num("top_p", d.top_p);
  num("min_p", d.min_p);
  num("repetition_penalty", d.repetition_penalty);
  num("presence_penalty", d.presence_penalty);
  num("frequency_penalty", d.frequency_penalty);
  if (auto it = j.find("top_k"); it != j.end() && it->is_number_integer())
    d.top_k = it->get<int32_t>();
  if (auto it = j.find("max_new_tokens"); it != j.end() && it->is_number_integer()) {
    d.max_new_tokens = it->get<int32_t>();
  }
  // transformers writes do_sample=false for greedy checkpoints.
  if (auto it = j.find("do_sample"); it != j.end() && it->is_boolean() && !it->get<bool>()) {
    d.temperature = 0.0f;
  }
  return d;
}

Result<GenerationDefaults> GenerationDefaults::from_dir(const std::string& dir) {
  const std::string path = dir + "/generation_config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return GenerationDefaults{};
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json_text(ss.str(), path);
}

Result<CompletionRequest> parse_completion_request(std::string_view body, int32_t max_logprobs) {
  M3_TRY(OrderedJson j, parse_body(body));
  CompletionRequest r;
  M3_TRY_STATUS(parse_common(j, r.common, false));
  M3_TRY_STATUS(parse_vllm_extras(j, r.common, max_logprobs));
  const OrderedJson* prompt = field(j, "prompt");
  if (!prompt)
    return invalid_param("prompt",
                         "'prompt' is required: a string, a list of strings or token ids");
  if (prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_number() &&
      prompt->size() > kMaxPrompts) {
    return invalid_param("prompt", "'prompt' holds " + std::to_string(prompt->size()) +
                                       " prompts; at most " + std::to_string(kMaxPrompts) +
                                       " are allowed in one request");
  }
  if (prompt->is_string()) {
    r.prompts.push_back({true, prompt->get<std::string>(), {}});
  } else if (prompt->is_array()) {
    if (prompt->empty()) return invalid_param("prompt", "'prompt' must not be an empty list");
    const auto& first = (*prompt)[0];
    if (first.is_number()) {
      M3_TRY(auto ids, token_array(*prompt, "prompt"));
      r.prompts.push_back({false, {}, std::move(ids)});
    } else {
      for (size_t i = 0; i < prompt->size(); ++i) {
        const auto& p = (*prompt)[i];
        const std::string pp = "prompt[" + std::to_string(i) + "]";
        if (p.is_string()) {
          r.prompts.push_back({true, p.get<std::string>(), {}});
        } else if (p.is_array()) {
          M3_TRY(auto ids, token_array(p, pp));
          r.prompts.push_back({false, {}, std::move(ids)});
        } else {
          return invalid_param(
              pp, "'" + pp + "' must be a string or a list of token ids, got " + type_of(p));
        }
      }
    }
  } else {
    return invalid_param(
        "prompt",
        "'prompt' must be a string, a list of strings or token ids, got " + type_of(*prompt));
  }
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    if (r.prompts[i].is_text && r.prompts[i].text.empty()) {
      return invalid_param(r.prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]",
                           "the prompt is empty; send at least one character or token id");
    }
  }
  if (r.prompts.size() * static_cast<size_t>(r.common.n) > static_cast<size_t>(kMaxChoices)) {
    return invalid_param("n", std::to_string(r.prompts.size()) +
                                  " prompts x n=" + std::to_string(r.common.n) +
                                  " asks for more than " + std::to_string(kMaxChoices) +
                                  " completions in one request; split it into several requests");
  }
  M3_TRY(auto echo, opt_bool(j, "echo"));
  r.echo = echo.value_or(false);
  if (const OrderedJson* lp = field(j, "logprobs")) {
    if (!(lp->is_number_integer() || lp->is_number_unsigned())) {
      return invalid_param("logprobs", "'logprobs' must be an integer (0.." +
                                           std::to_string(max_logprobs) +
                                           ") for completions, got " + type_of(*lp));
    }
    const int64_t k = lp->is_number_unsigned()
                          ? static_cast<int64_t>(std::min<uint64_t>(lp->get<uint64_t>(), 1u << 30))
                          : lp->get<int64_t>();
    if (k < 0)
      return invalid_param("logprobs", "'logprobs' must be >= 0, got " + std::to_string(k));
    if (k > max_logprobs) return over_max_logprobs("logprobs", "sample", k, max_logprobs);
    r.common.logprobs = static_cast<int32_t>(k);
  }
  M3_TRY(auto suffix, opt_string(j, "suffix"));
  if (suffix && !suffix->empty())
    return unsupported_param("suffix",
                             "'suffix' (fill-in-the-middle) is not supported; leave it out");
  return r;
}

Result<ChatRequest> parse_chat_request(std::string_view body, int32_t max_logprobs) {
  M3_TRY(OrderedJson j, parse_body(body));
  ChatRequest r;
  M3_TRY_STATUS(parse_common(j, r.common, true));
  M3_TRY_STATUS(parse_vllm_extras(j, r.common, max_logprobs));
  M3_TRY(auto inc, opt_bool(j, "include_reasoning"));
  r.include_reasoning = inc.value_or(true);
  M3_TRY(auto budget, opt_integer(j, "thinking_token_budget"));
  if (budget && *budget != -1) {
    if (*budget < 0 || *budget > std::numeric_limits<int32_t>::max()) {
      return invalid_param(
          "thinking_token_budget",
          "'thinking_token_budget' must be a number of tokens >= 0 (or -1: no budget), "
          "got " +
              std::to_string(*budget));
    }
    r.thinking_token_budget = static_cast<int32_t>(*budget);
  }
  M3_TRY(auto echo, opt_bool(j, "echo"));
  r.echo = echo.value_or(false);
  M3_TRY(auto parallel, opt_bool(j, "parallel_tool_calls"));
  r.parallel_tool_calls = parallel.value_or(true);
  M3_TRY(r.messages, parse_messages(j, &r.media));
  M3_TRY_STATUS(parse_tools(j, r));
  if (const OrderedJson* kw = field(j, "chat_template_kwargs")) {
    if (!kw->is_object())
      return invalid_param("chat_template_kwargs",
                           "'chat_template_kwargs' must be an object, got " + type_of(*kw));
    if (json_node_count(*kw, kMaxKwargsNodes) > kMaxKwargsNodes) {
      return invalid_param("chat_template_kwargs", "'chat_template_kwargs' holds more than " +
                                                       std::to_string(kMaxKwargsNodes) +
                                                       " JSON values");
    }
    r.chat_template_kwargs = *kw;
  }
  M3_TRY(auto agp, opt_bool(j, "add_generation_prompt"));
  r.add_generation_prompt = agp.value_or(true);
  M3_TRY(auto cfm, opt_bool(j, "continue_final_message"));
  r.continue_final_message = cfm.value_or(false);
  if (r.continue_final_message && r.add_generation_prompt && agp) {
    return invalid_param(
        "continue_final_message",
        "'continue_final_message' and 'add_generation_prompt' cannot both be true");
  }
  if (r.continue_final_message) r.add_generation_prompt = false;
  M3_TRY(auto lp, opt_bool(j, "logprobs"));
  r.logprobs = lp.value_or(false);
  M3_TRY(auto tlp, opt_integer(j, "top_logprobs"));
  if (tlp) {
    if (*tlp < 0) {
      return invalid_param("top_logprobs",
                           "'top_logprobs' must be >= 0, got " + std::to_string(*tlp));
    }
    if (*tlp > max_logprobs) return over_max_logprobs("top_logprobs", "sample", *tlp, max_logprobs);
    if (!r.logprobs && *tlp > 0)
      return invalid_param("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r.top_logprobs = static_cast<int32_t>(*tlp);
  }
  r.common.logprobs = r.logprobs ? r.top_logprobs : -1;
  return r;
}

engine::SamplingParams make_sampling_params(const CommonParams& p, const GenerationDefaults& d) {
  engine::SamplingParams sp;
  sp.temperature = p.temperature.value_or(d.temperature.value_or(1.0f));
  sp.top_p = p.top_p.value_or(d.top_p.value_or(1.0f));
  sp.top_k = p.top_k.value_or(d.top_k.value_or(0));
  if (sp.top_k < 0) sp.top_k = 0;
  sp.min_p = p.min_p.value_or(d.min_p.value_or(0.0f));
  sp.presence_penalty = p.presence_penalty.value_or(d.presence_penalty.value_or(0.0f));
  sp.frequency_penalty = p.frequency_penalty.value_or(d.frequency_penalty.value_or(0.0f));
  sp.repetition_penalty = p.repetition_penalty.value_or(d.repetition_penalty.value_or(1.0f));
  sp.seed = p.seed;
  sp.logprobs = p.logprobs;
  sp.prompt_logprobs = p.prompt_logprobs;
  sp.n = 1;  // the server submits one engine request per choice
  sp.min_tokens = p.min_tokens;
  sp.ignore_eos = p.ignore_eos;
  sp.stop_token_ids = p.stop_token_ids;
  sp.logit_bias = p.logit_bias;
  sp.allowed_token_ids = p.allowed_token_ids;
  if (p.max_tokens) sp.max_tokens = *p.max_tokens;
  return sp;
}

OrderedJson kv_transfer_params_json(const engine::KvTransferParams& k) {
  OrderedJson o = OrderedJson::object();
  o["do_remote_prefill"] = k.do_remote_prefill;
  o["do_remote_decode"] = k.do_remote_decode;
  o["remote_block_ids"] = k.remote_block_ids;
  o["remote_engine_id"] = k.remote_engine_id;
  o["remote_request_id"] = k.remote_request_id;
  o["remote_host"] = k.remote_host;
  o["remote_port"] = k.remote_port;
  o["tp_size"] = k.tp_size;
  return o;
}

}  // namespace m3::server
