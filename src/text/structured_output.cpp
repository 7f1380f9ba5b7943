#include "text/structured_output.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#ifdef M3_HAS_XGRAMMAR
#include <xgrammar/xgrammar.h>
#endif

namespace m3::text {

namespace {

bool is_name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_';
}

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

}  // namespace

bool grammar_is_lark(std::string_view g) {
  // EBNF defines rules with `::=`; Lark with `name:` (optionally `?name:`, `!name:`, a priority
  // `name.2:`) and has `%import` / `%ignore` directives. A grammar with any `::=` outside a
  // string literal is EBNF.
  bool in_str = false;
  char quote = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const char c = g[i];
    if (in_str) {
      if (c == '\\')
        ++i;
      else if (c == quote)
        in_str = false;
      continue;
    }
    if (c == '"' || c == '\'') {
      in_str = true;
      quote = c;
    } else if (g.compare(i, 3, "::=") == 0) {
      return false;
    }
  }
  size_t pos = 0;
  while (pos < g.size()) {
    size_t end = g.find('\n', pos);
    if (end == std::string_view::npos) end = g.size();
    std::string_view line = g.substr(pos, end - pos);
    pos = end + 1;
    size_t i = 0;
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    line.remove_prefix(i);
    if (line.empty() || line.starts_with("//") || line.starts_with("#")) continue;
    if (line.starts_with("%import") || line.starts_with("%ignore") || line.starts_with("%declare"))
      return true;
    size_t k = 0;
    if (line[k] == '?' || line[k] == '!') ++k;
    if (k >= line.size() || !is_name_start(line[k])) continue;
    while (k < line.size() && is_name_char(line[k])) ++k;
    if (k < line.size() && line[k] == '.') {  // priority: name.2
      ++k;
      while (k < line.size() && std::isdigit(static_cast<unsigned char>(line[k]))) ++k;
    }
    while (k < line.size() && (line[k] == ' ' || line[k] == '\t')) ++k;
    if (k < line.size() && line[k] == ':' && (k + 1 >= line.size() || line[k + 1] != ':'))
      return true;
  }
  return false;
}

Result<nlohmann::ordered_json> structural_tag_format(const nlohmann::ordered_json& tag,
                                                     const std::string& param) {
  using Json = nlohmann::ordered_json;
  const auto fail = [&](const std::string& why) {
    return make_error(ErrorCode::kInvalidArgument, "'" + param + "': " + why, param);
  };
  const std::string forms =
      "give {\"type\": \"structural_tag\", \"format\": {...}} (xgrammar's structural tag) or "
      "{\"type\": \"structural_tag\", \"structures\": [{\"begin\", \"schema\", \"end\"}], "
      "\"triggers\": [...]}";
  if (!tag.is_object()) return fail("a structural tag must be an object; " + forms);
  if (tag.contains("type") && tag["type"] != "structural_tag")
    return fail("a structural tag's 'type' must be \"structural_tag\"");
  if (tag.contains("format")) {
    if (tag.contains("structures"))
      return fail("give either 'format' or 'structures' + 'triggers', not both");
    if (!tag["format"].is_object() || !tag["format"].contains("type"))
      return fail("'format' must be an object with a 'type' (a structural tag format)");
    return tag["format"];
  }
  if (!tag.contains("structures")) return fail("no 'format' and no 'structures'; " + forms);
  const Json& st = tag["structures"];
  if (!st.is_array() || st.empty()) return fail("'structures' must be a non-empty array");
  const Json* tr = tag.contains("triggers") ? &tag["triggers"] : nullptr;
  if (!tr || !tr->is_array() || tr->empty())
    return fail("'triggers' must be a non-empty array of strings (the text that starts a tag)");
  Json triggers = Json::array();
  for (const auto& t : *tr) {
    if (!t.is_string() || t.get<std::string>().empty())
      return fail("'triggers' must hold non-empty strings");
    triggers.push_back(t);
  }
  Json tags = Json::array();
  for (size_t i = 0; i < st.size(); ++i) {
    const Json& e = st[i];
    const std::string at = "structures[" + std::to_string(i) + "]";
    if (!e.is_object() || !e.contains("begin") || !e["begin"].is_string() || !e.contains("end") ||
        !e["end"].is_string())
      return fail("'" + at + "' must be an object with string 'begin' and 'end'");
    const std::string begin = e["begin"].get<std::string>();
    bool triggered = false;
    for (const auto& t : triggers) triggered |= begin.starts_with(t.get<std::string>());
    if (!triggered)
      return fail("'" + at + ".begin' (\"" + begin + "\") starts with none of the triggers");
    Json schema = Json::object();  // no schema: any JSON value
    if (e.contains("schema") && !e["schema"].is_null()) {
      if (!e["schema"].is_object() && !e["schema"].is_boolean())
        return fail("'" + at + ".schema' must be a JSON schema object");
      schema = e["schema"];
    }
    tags.push_back(Json{{"type", "tag"},
                        {"begin", begin},
                        {"content", {{"type", "json_schema"}, {"json_schema", schema}}},
                        {"end", e["end"]}});
  }
  return Json{{"type", "triggered_tags"}, {"triggers", triggers}, {"tags", tags}};
}

#ifdef M3_HAS_XGRAMMAR

namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kNs = "]<]minimax[>[";  // the M3 tool-call namespace marker
constexpr const char* kThinkBegin = "<mm:think>";
constexpr const char* kThinkEnd = "</mm:think>";
// Special tokens whose text the formats above spell; every other special token is never allowed
// (its text would vanish from the output when special tokens are skipped).
constexpr const char* kGrammarSpecials[] = {"]<]minimax[>[", "<tool_call>", "</tool_call>",
                                            "<mm:think>", "</mm:think>"};

// Whitespace between JSON tokens is free (as vLLM's default), up to this many characters per gap:
// enough for JSON pretty-printed 4 spaces deep 15 levels, and it keeps a weak model from spending
// its whole max_tokens on a run of blanks inside an object.
constexpr int kMaxJsonWhitespace = 64;

tl::unexpected<Error> bad(const std::string& param, const std::string& message) {
  return make_error(ErrorCode::kInvalidArgument, message, param);
}

Json const_string(const std::string& s) {
  return {{"type", "const_string"}, {"value", s}};
}

// A tool's parameters schema relaxed to what xgrammar's minimax_m3_xml style can express, so any
// valid tool schema gives a grammar (the call stays well-formed; the tool parser then converts the
// values with the request's own schema). String pattern / format / length limits are dropped
// (a value's text must only exclude the namespace marker); an untyped value and a free-form
// object (no properties: a dict) become a string, which the parser reads as JSON text; extra
// properties of an object with declared ones are not offered.
void relax_for_m3_xml(Json& s, bool top) {
  if (!s.is_object()) return;
  static constexpr const char* kShape[] = {"type",  "properties", "items", "prefixItems", "anyOf",
                                           "oneOf", "allOf",      "enum",  "const",       "$ref"};
  bool shaped = false;
  for (const char* k : kShape) shaped = shaped || s.contains(k);
  if (!shaped) {
    s = Json{{"type", "string"}};
    return;
  }
  for (const char* k : {"pattern", "format", "minLength", "maxLength"}) s.erase(k);
  const bool has_props =
      s.contains("properties") && s["properties"].is_object() && !s["properties"].empty();
  if (!top && !has_props && s.value("type", Json()) == Json("object")) {
    s = Json{{"type", "string"}};
    return;
  }
  for (const char* k : {"additionalProperties", "patternProperties", "propertyNames",
                        "unevaluatedProperties", "unevaluatedItems"}) {
    s.erase(k);
  }
  if (has_props) {
    for (auto& [name, sub] : s["properties"].items()) relax_for_m3_xml(sub, false);
  }
  if (s.contains("items")) {
    if (s["items"].is_array()) {
      for (auto& sub : s["items"]) relax_for_m3_xml(sub, false);
    } else if (s["items"].is_object()) {
      relax_for_m3_xml(s["items"], false);
    }
  }
  for (const char* k : {"prefixItems", "anyOf", "oneOf", "allOf"}) {
    if (s.contains(k) && s[k].is_array()) {
      for (auto& sub : s[k]) relax_for_m3_xml(sub, false);
    }
  }
  for (const char* k : {"$defs", "definitions"}) {
    if (s.contains(k) && s[k].is_object()) {
      for (auto& [name, sub] : s[k].items()) relax_for_m3_xml(sub, false);
    }
  }
}

// The tool-call block in the M3 markup (docs: m3-model.md 6.3): NS<tool_call>\n, one or more
// NS<invoke name="F"> parameters-as-XML NS</invoke>\n, NS</tool_call>. Parameters follow the
// function's JSON schema in xgrammar's minimax_m3_xml style (NS<p>value NS</p>, nested objects and
// arrays as child elements).
Result<Json> tool_call_format(const StructuredOutputSpec& spec) {
  Json invokes = Json::array();
  if (!spec.tools.is_array() || spec.tools.empty()) {
    return bad(spec.param, "'" + spec.param + "' needs a non-empty 'tools' list");
  }
  for (size_t i = 0; i < spec.tools.size(); ++i) {
    const Json& fn = spec.tools[i].contains("function") ? spec.tools[i]["function"] : spec.tools[i];
    const std::string name = fn.value("name", "");
    if (!spec.tool_name.empty() && name != spec.tool_name) continue;
    Json params = fn.contains("parameters") && fn["parameters"].is_object()
                      ? fn["parameters"]
                      : Json{{"type", "object"}, {"properties", Json::object()}};
    relax_for_m3_xml(params, /*top=*/true);
    invokes.push_back(
        {{"type", "tag"},
         {"begin", std::string(kNs) + "<invoke name=\"" + name + "\">"},
         {"content",
          {{"type", "json_schema"}, {"json_schema", params}, {"style", "minimax_m3_xml"}}},
         {"end", std::string(kNs) + "</invoke>\n"}});
  }
  if (invokes.empty()) {
    return bad(spec.param,
               "tool_choice names function '" + spec.tool_name + "', which is not in 'tools'");
  }
  Json content = spec.tool_name.empty() ? Json{{"type", "tags_with_separator"},
                                               {"tags", invokes},
                                               {"separator", ""},
                                               {"at_least_one", true}}
                                        : invokes[0];
  return Json{{"type", "tag"},
              {"begin", std::string(kNs) + "<tool_call>\n"},
              {"content", content},
              {"end", std::string(kNs) + "</tool_call>"}};
}

// xgrammar's messages start with "[hh:mm:ss] path/file.cc:line: ": keep what follows.
std::string clean_message(std::string msg) {
  if (!msg.empty() && msg[0] == '[') {
    const size_t src = msg.find(".cc:");
    const size_t colon = src == std::string::npos ? src : msg.find(": ", src);
    if (colon != std::string::npos) msg = msg.substr(colon + 2);
  }
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  if (msg.size() > 600) msg = msg.substr(0, 600) + "...";
  return msg;
}

// The structural-tag format (xgrammar's JSON description) of the output after any reasoning.
Result<Json> body_format(const StructuredOutputSpec& spec) {
  using K = StructuredOutputSpec::Kind;
  switch (spec.kind) {
    case K::kJsonSchema: {
      Json schema = Json::parse(spec.value, nullptr, false);
      if (schema.is_discarded() || !(schema.is_object() || schema.is_boolean())) {
        return bad(spec.param, "'" + spec.param + "' must be a JSON schema (an object)");
      }
      return Json{{"type", "json_schema"},
                  {"json_schema", schema},
                  {"max_whitespace_cnt", kMaxJsonWhitespace}};
    }
    case K::kJsonObject:
      return Json{{"type", "json_schema"},
                  {"json_schema", {{"type", "object"}, {"additionalProperties", true}}},
                  {"max_whitespace_cnt", kMaxJsonWhitespace}};
    case K::kRegex:
      return Json{{"type", "regex"}, {"pattern", spec.value}};
    case K::kChoice: {
      if (spec.choices.empty())
        return bad(spec.param, "'" + spec.param + "' must list at least one choice");
      Json elems = Json::array();
      for (const auto& c : spec.choices) elems.push_back(const_string(c));
      return Json{{"type", "or"}, {"elements", elems}};
    }
    case K::kGrammar: {
      if (!grammar_is_lark(spec.value)) return Json{{"type", "grammar"}, {"grammar", spec.value}};
      // Lark (vLLM takes it for xgrammar too): xgrammar's own converter, printed back as EBNF
      // (root rule `root`) for the structural tag.
      try {
        return Json{{"type", "grammar"},
                    {"grammar", xgrammar::Grammar::FromLark(spec.value).ToString()}};
      } catch (const std::exception& e) {
        return bad(spec.param,
                   "'" + spec.param + "' is not a valid Lark grammar: " + clean_message(e.what()));
      }
    }
    case K::kStructuralTag: {
      Json format = Json::parse(spec.value, nullptr, false);
      if (format.is_discarded() || !format.is_object())
        return bad(spec.param, "'" + spec.param + "' must hold a structural tag format object");
      return format;
    }
    case K::kToolCall:
      return tool_call_format(spec);
  }
  return bad(spec.param, "unknown structured output kind");
}

Json with_reasoning(Json body, ReasoningPrefix prefix) {
  if (prefix == ReasoningPrefix::kNone) return body;
  Json free_text = {{"type", "any_text"}};
  if (prefix == ReasoningPrefix::kInside) {
    Json reasoning = {{"type", "tag"}, {"begin", ""}, {"content", free_text}, {"end", kThinkEnd}};
    return Json{{"type", "sequence"}, {"elements", {reasoning, body}}};
  }
  Json block = {
      {"type", "tag"}, {"begin", kThinkBegin}, {"content", free_text}, {"end", kThinkEnd}};
  Json lead = {{"type", "optional"},
               {"content", {{"type", "or"}, {"elements", {block, const_string(kThinkEnd)}}}}};
  return Json{{"type", "sequence"}, {"elements", {lead, body}}};
}

std::string what_of(const StructuredOutputSpec& spec) {
  using K = StructuredOutputSpec::Kind;
  switch (spec.kind) {
    case K::kJsonSchema:
      return "JSON schema";
    case K::kJsonObject:
      return "JSON object format";
    case K::kRegex:
      return "regular expression";
    case K::kChoice:
      return "choice list";
    case K::kGrammar:
      return grammar_is_lark(spec.value)
                 ? "Lark grammar (with a `start: ...` rule)"
                 : "EBNF grammar (xgrammar/GBNF syntax with a `root ::= ...` rule; Lark with a "
                   "`start: ...` rule is taken too)";
    case K::kStructuralTag:
      return "structural tag";
    case K::kToolCall:
      return "tool-call format (a tool's parameters schema)";
  }
  return "format";
}

class XgMatcher final : public TokenMatcher {
 public:
  XgMatcher(const xgrammar::CompiledGrammar& g, int32_t bitmask_words)
      : m_(g), bits_(bitmask_words, 0) {}

  void fill_allowed(std::span<uint32_t> allowed) override {
    std::fill(bits_.begin(), bits_.end(), 0);
    int64_t shape[1] = {static_cast<int64_t>(bits_.size())};
    DLTensor t{};
    t.data = bits_.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = xgrammar::GetBitmaskDLType();
    t.shape = shape;
    // No exception leaves the module: a matcher that fails allows nothing, so the request ends
    // (the engine stops a request whose masks leave no token).
    try {
      m_.FillNextTokenBitmask(&t);
    } catch (const std::exception&) {
      std::fill(bits_.begin(), bits_.end(), 0);
    }
    const size_t n = std::min(allowed.size(), bits_.size());
    std::memcpy(allowed.data(), bits_.data(), n * sizeof(uint32_t));
  }
  bool accept(int32_t token_id) override {
    try {
      return m_.AcceptToken(token_id);
    } catch (const std::exception&) {
      return false;
    }
  }
  bool is_terminated() const override { return m_.IsTerminated(); }
  void rollback(int n) override {
    if (n > 0) m_.Rollback(n);
  }

 private:
  xgrammar::GrammarMatcher m_;
  std::vector<int32_t> bits_;
};

class XgStructure final : public CompiledStructure {
 public:
  XgStructure(xgrammar::CompiledGrammar g, int32_t words) : g_(std::move(g)), words_(words) {}
  std::unique_ptr<TokenMatcher> make_matcher() const override {
    return std::make_unique<XgMatcher>(g_, words_);
  }

 private:
  xgrammar::CompiledGrammar g_;
  int32_t words_;
};

}  // namespace

struct StructuredOutputCompiler::Impl {
  std::shared_ptr<const Tokenizer> tokenizer;
  int64_t vocab_size = 0;
  std::vector<int32_t> stop_ids;
  std::mutex mu;
  std::optional<xgrammar::GrammarCompiler> compiler;  // made on first use (walks the vocab)
  int32_t words = 0;
  // Compiled structures by key; cleared when it grows past kMaxEntries.
  static constexpr size_t kMaxEntries = 512;
  std::map<std::string, std::shared_ptr<const CompiledStructure>> cache;

  xgrammar::GrammarCompiler& get_compiler() {
    if (!compiler) {
      const int32_t n =
          std::max<int32_t>(tokenizer->vocab_size(), static_cast<int32_t>(vocab_size));
      std::vector<std::string> vocab(tokenizer->vocab_size());
      for (int32_t id = 0; id < tokenizer->vocab_size(); ++id) {
        if (!tokenizer->contains_id(id)) continue;  // "" = never allowed
        std::string text(tokenizer->decoded_bytes(id));
        if (tokenizer->is_special(id) &&
            std::find(std::begin(kGrammarSpecials), std::end(kGrammarSpecials), text) ==
                std::end(kGrammarSpecials)) {
          text.clear();
        }
        vocab[id] = std::move(text);
      }
      xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, n, stop_ids, false);
      compiler.emplace(info, /*max_threads=*/2, /*cache_enabled=*/false);
      words = xgrammar::GetBitmaskSize(n);
    }
    return *compiler;
  }
};

StructuredOutputCompiler::StructuredOutputCompiler(std::shared_ptr<const Tokenizer> tokenizer,
                                                   int64_t vocab_size,
                                                   std::vector<int32_t> stop_token_ids)
    : impl_(std::make_unique<Impl>()) {
  impl_->tokenizer = std::move(tokenizer);
  impl_->vocab_size = vocab_size;
  impl_->stop_ids = std::move(stop_token_ids);
}

bool StructuredOutputCompiler::available() {
  return true;
}

Result<std::shared_ptr<const CompiledStructure>> StructuredOutputCompiler::compile(
    const StructuredOutputSpec& spec, ReasoningPrefix prefix) const {
  M3_TRY(Json body, body_format(spec));
  const Json tag = {{"type", "structural_tag"},
                    {"format", with_reasoning(std::move(body), prefix)}};
  const std::string key = tag.dump();
  xgrammar::GrammarCompiler* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (auto it = impl_->cache.find(key); it != impl_->cache.end()) return it->second;
    c = &impl_->get_compiler();
  }
  // Compiled without the lock (xgrammar's compiler is thread-safe): a large schema does not hold
  // up other requests. Two requests with a new key at once may both compile it; one is kept.
  try {
    auto compiled = std::make_shared<XgStructure>(c->CompileStructuralTag(key), impl_->words);
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->cache.size() >= Impl::kMaxEntries) impl_->cache.clear();
    return impl_->cache.emplace(key, compiled).first->second;
  } catch (const std::exception& e) {
    return bad(spec.param, "'" + spec.param + "' is not a valid " + what_of(spec) + ": " +
                               clean_message(e.what()));
  }
}

void StructuredOutputCompiler::warm_up() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->get_compiler();
}

#else  // !M3_HAS_XGRAMMAR

struct StructuredOutputCompiler::Impl {};

StructuredOutputCompiler::StructuredOutputCompiler(std::shared_ptr<const Tokenizer>, int64_t,
                                                   std::vector<int32_t>) {}

bool StructuredOutputCompiler::available() {
  return false;
}

Result<std::shared_ptr<const CompiledStructure>> StructuredOutputCompiler::compile(
    const StructuredOutputSpec& spec, ReasoningPrefix prefix) const {
  (void)prefix;
  return make_error(
      ErrorCode::kUnsupported,
      "'" + spec.param +
          "' needs structured outputs, and this m3serve was built "
          "without xgrammar; rebuild after tools/setup.sh (or tools/gpu_deps.sh on the "
          "GPU machine) fetches it",
      spec.param);
}

void StructuredOutputCompiler::warm_up() const {}  // nothing to warm without xgrammar

#endif

StructuredOutputCompiler::~StructuredOutputCompiler() = default;

}  // namespace m3::text
