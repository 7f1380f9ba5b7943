#include "text/json_schema_types.h"
#include "text/marker_scan.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace m3::text {
namespace {

// Schemas from requests can nest arbitrarily; past this depth sub-schemas are ignored (values
// then stay strings) so a hostile schema cannot exhaust the stack.
constexpr int kMaxSchemaDepth = 32;
// JSON text values nested deeper than this stay strings: nlohmann's dump recurses once per level,
// and a model coaxed into emitting 10^5 brackets must not overflow the server's stack.
constexpr int kMaxJsonTextDepth = 128;

std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  return trim_ascii_ws(s);
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

std::optional<ParamKind> kind_from_type_name(std::string_view raw) {
  const std::string k = ascii_lower(trim(raw));
  if (k == "string" || k == "str" || k == "text" || k == "varchar" || k == "char" || k == "enum")
    return ParamKind::kString;
  if (k == "integer" || k == "int") return ParamKind::kInteger;
  if (k == "number" || k == "float" || k == "double") return ParamKind::kNumber;
  if (k == "boolean" || k == "bool" || k == "binary") return ParamKind::kBoolean;
  if (k == "object" || k == "dict" || k == "map") return ParamKind::kObject;
  if (k == "array" || k == "arr" || k == "list" || k == "sequence") return ParamKind::kArray;
  if (k == "null") return ParamKind::kNull;
  if (starts_with(k, "int") || starts_with(k, "uint") || starts_with(k, "long") ||
      starts_with(k, "short") || starts_with(k, "unsigned"))
    return ParamKind::kInteger;
  if (starts_with(k, "num") || starts_with(k, "float")) return ParamKind::kNumber;
  if (starts_with(k, "dict")) return ParamKind::kObject;
  if (starts_with(k, "list")) return ParamKind::kArray;
  return std::nullopt;
}

std::optional<ParamType> from_schema(const nlohmann::json& schema, int depth);

// Object/array kinds pick up their child schemas from the same schema object.
ParamType make_type(ParamKind kind, const nlohmann::json& schema, int depth) {
  ParamType t;
  t.kind = kind;
  if (depth >= kMaxSchemaDepth) return t;
  if (kind == ParamKind::kObject) {
    auto props = schema.find("properties");
    if (props != schema.end() && props->is_object()) {
      for (auto it = props->begin(); it != props->end(); ++it) {
        if (auto sub = from_schema(it.value(), depth + 1))
          t.properties.emplace(it.key(), std::make_shared<const ParamType>(std::move(*sub)));
      }
    }
    auto add = schema.find("additionalProperties");
    if (add != schema.end()) {
      if (auto sub = from_schema(*add, depth + 1))
        t.additional = std::make_shared<const ParamType>(std::move(*sub));
    }
  } else if (kind == ParamKind::kArray) {
    auto items = schema.find("items");
    if (items != schema.end()) {
      if (auto sub = from_schema(*items, depth + 1))
        t.items = std::make_shared<const ParamType>(std::move(*sub));
    }
  }
  return t;
}

ParamType collapse(std::vector<ParamType> types) {
  if (types.size() == 1) return std::move(types.front());
  ParamType t;
  t.kind = ParamKind::kOneOf;
  t.one_of = std::move(types);
  return t;
}

// An enum without `type` takes the type of its values: [1, 2] is an integer, [0.5, 1] a number,
// [true, false] a boolean; values of several JSON types give a union tried in the order integer,
// number, boolean, null, string (so "5" stays the number 5 when 5 is allowed).
ParamType enum_type(const nlohmann::json& values, const nlohmann::json& schema, int depth) {
  bool has_int = false, has_float = false, has_bool = false, has_null = false, has_str = false;
  if (values.is_array()) {
    for (const auto& v : values) {
      if (v.is_number_integer())
        has_int = true;
      else if (v.is_number_float())
        has_float = true;
      else if (v.is_boolean())
        has_bool = true;
      else if (v.is_null())
        has_null = true;
      else
        has_str = true;  // strings, and objects/arrays (kept as their text)
    }
  }
  std::vector<ParamType> types;
  if (has_float)
    types.push_back(make_type(ParamKind::kNumber, schema, depth));
  else if (has_int)
    types.push_back(make_type(ParamKind::kInteger, schema, depth));
  if (has_bool) types.push_back(make_type(ParamKind::kBoolean, schema, depth));
  if (has_null) types.push_back(make_type(ParamKind::kNull, schema, depth));
  if (has_str || types.empty()) types.push_back(make_type(ParamKind::kString, schema, depth));
  return collapse(std::move(types));
}

std::optional<ParamType> from_schema(const nlohmann::json& schema, int depth) {
  if (!schema.is_object() || depth > kMaxSchemaDepth) return std::nullopt;
  auto type = schema.find("type");
  if (type != schema.end()) {
    if (type->is_string()) {
      auto kind = kind_from_type_name(type->get_ref<const std::string&>());
      if (!kind) return std::nullopt;
      return make_type(*kind, schema, depth);
    }
    if (type->is_array()) {
      std::vector<ParamType> types;
      for (const auto& name : *type) {
        if (!name.is_string()) continue;
        if (auto kind = kind_from_type_name(name.get_ref<const std::string&>()))
          types.push_back(make_type(*kind, schema, depth));
      }
      if (types.empty()) return std::nullopt;
      return collapse(std::move(types));
    }
    return std::nullopt;
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    auto composite = schema.find(key);
    if (composite == schema.end()) continue;
    std::vector<ParamType> types;
    if (composite->is_array()) {
      for (const auto& sub : *composite) {
        if (auto t = from_schema(sub, depth + 1)) types.push_back(std::move(*t));
      }
    }
    // A union we cannot read at all is most often a structured value: try JSON object text.
    if (types.empty()) return make_type(ParamKind::kObject, schema, depth);
    return collapse(std::move(types));
  }
  if (auto e = schema.find("enum"); e != schema.end()) return enum_type(*e, schema, depth);
  if (schema.contains("items")) return make_type(ParamKind::kArray, schema, depth);
  if (schema.contains("properties")) return make_type(ParamKind::kObject, schema, depth);
  return std::nullopt;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::optional<OrderedJson> parse_integer(std::string_view t) {
  std::string_view digits = t;
  bool negative = false;
  if (!digits.empty() && (digits.front() == '+' || digits.front() == '-')) {
    negative = digits.front() == '-';
    digits.remove_prefix(1);
  }
  if (!all_digits(digits)) return std::nullopt;
  // Parse the digits with the sign so INT64_MIN fits; from_chars rejects a leading '+'.
  std::string signed_digits = (negative ? "-" : "") + std::string(digits);
  int64_t v = 0;
  auto [ptr, ec] =
      std::from_chars(signed_digits.data(), signed_digits.data() + signed_digits.size(), v);
  if (ec != std::errc() || ptr != signed_digits.data() + signed_digits.size()) return std::nullopt;
  return OrderedJson(v);
}

// `[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?` — the decimal spellings we accept for numbers (no hex,
// no inf/nan, which strtod would also take).
bool is_decimal_number(std::string_view s) {
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t int_digits = 0, frac_digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++int_digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++frac_digits;
  }
  if (int_digits + frac_digits == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  return i == s.size();
}

std::optional<OrderedJson> parse_number(std::string_view t) {
  if (t.empty()) return std::nullopt;
  // JSON spelling first: keeps 5 an integer and 5.0 a float.
  OrderedJson j = OrderedJson::parse(t.begin(), t.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_number()) {
    if (j.is_number_float() && !std::isfinite(j.get<double>())) return std::nullopt;
    return j;
  }
  if (auto i = parse_integer(t)) return i;
  if (!is_decimal_number(t)) return std::nullopt;
  std::string copy(t);
  char* end = nullptr;
  double d = std::strtod(copy.c_str(), &end);
  if (end != copy.c_str() + copy.size() || !std::isfinite(d)) return std::nullopt;
  return OrderedJson(d);
}

// Bracket nesting of JSON text (outside strings) stays within `max_depth`.
bool json_depth_ok(std::string_view t, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : t) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

std::optional<OrderedJson> convert_text(const ParamType& type, std::string_view text) {
  const std::string_view t = trim(text);
  switch (type.kind) {
    case ParamKind::kString:
      return OrderedJson(utf8_sanitize(text));
    case ParamKind::kInteger:
      // `5.0` for an integer parameter is the number 5.0 (the model's value, still a number).
      if (auto i = parse_integer(t)) return i;
      if (t.find_first_of(".eE") == std::string_view::npos) return std::nullopt;  // 2^70: text
      return parse_number(t);
    case ParamKind::kNumber:
      return parse_number(t);
    case ParamKind::kBoolean: {
      const std::string k = ascii_lower(t);
      if (k == "true" || k == "1") return OrderedJson(true);
      if (k == "false" || k == "0") return OrderedJson(false);
      return std::nullopt;
    }
    case ParamKind::kObject:
    case ParamKind::kArray: {
      const bool object = type.kind == ParamKind::kObject;
      if (t.empty()) return object ? OrderedJson::object() : OrderedJson::array();
      if (!json_depth_ok(t, kMaxJsonTextDepth)) return std::nullopt;
      OrderedJson j = OrderedJson::parse(t.begin(), t.end(), nullptr, false);
      if (object ? j.is_object() : j.is_array()) return j;
      return std::nullopt;
    }
    case ParamKind::kNull:
      if (iequals(t, "null")) return OrderedJson(nullptr);
      return std::nullopt;
    case ParamKind::kOneOf:
      for (const auto& candidate : type.one_of) {
        if (auto v = convert_text(candidate, text)) return v;
      }
      return std::nullopt;
  }
  return std::nullopt;
}

// The schema that describes children: the type itself, or the first object/array candidate of a
// union.
const ParamType* container_type(const ParamType* type) {
  if (type == nullptr) return nullptr;
  if (type->kind == ParamKind::kObject || type->kind == ParamKind::kArray) return type;
  if (type->kind == ParamKind::kOneOf) {
    for (const auto& c : type->one_of) {
      if (c.kind == ParamKind::kObject || c.kind == ParamKind::kArray) return &c;
    }
  }
  return nullptr;
}

const ParamType* property_type(const ParamType* object, std::string_view name) {
  if (object == nullptr || object->kind != ParamKind::kObject) return nullptr;
  auto it = object->properties.find(name);
  if (it != object->properties.end()) return it->second.get();
  return object->additional.get();
}

}  // namespace

std::optional<ParamType> param_type_from_schema(const nlohmann::json& schema) {
  return from_schema(schema, 0);
}

OrderedJson convert_param(const ParamNode& node, const ParamType* type) {
  if (node.children.empty()) {
    if (iequals(trim(node.text), "null") && !(type && type->kind == ParamKind::kString))
      return OrderedJson(nullptr);
    if (type != nullptr) {
      if (auto v = convert_text(*type, node.text)) return std::move(*v);
    }
    return OrderedJson(utf8_sanitize(node.text));
  }
  const ParamType* container = container_type(type);
  if (container != nullptr && container->kind == ParamKind::kArray) {
    OrderedJson arr = OrderedJson::array();
    for (const auto& child : node.children)
      arr.push_back(convert_param(child.second, container->items.get()));
    return arr;
  }
  OrderedJson obj = OrderedJson::object();
  for (size_t i = 0; i < node.children.size(); ++i) {
    const std::string& name = node.children[i].first;
    const std::string key = utf8_sanitize(name);
    if (obj.contains(key)) continue;  // already gathered with its first occurrence
    size_t count = 0;
    for (const auto& c : node.children) count += c.first == name ? 1 : 0;
    const ParamType* sub = property_type(container, name);
    if (count == 1) {
      obj[key] = convert_param(node.children[i].second, sub);
      continue;
    }
    // Repeated tags form an array; an array-typed property types its elements with `items`.
    const ParamType* element = (sub && sub->kind == ParamKind::kArray) ? sub->items.get() : sub;
    OrderedJson arr = OrderedJson::array();
    for (const auto& c : node.children) {
      if (c.first == name) arr.push_back(convert_param(c.second, element));
    }
    obj[key] = std::move(arr);
  }
  if (!trim(node.text).empty()) {
    std::string key = "$text";
    while (obj.contains(key)) key.insert(0, "$");
    obj[key] = utf8_sanitize(node.text);
  }
  return obj;
}

ToolSchemas ToolSchemas::from_openai_tools(const nlohmann::json& tools) {
  ToolSchemas out;
  if (!tools.is_array()) return out;
  for (const auto& tool : tools) {
    if (!tool.is_object()) continue;
    const nlohmann::json* fn = &tool;
    auto f = tool.find("function");
    if (f != tool.end() && f->is_object()) fn = &*f;
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string()) continue;
    std::map<std::string, ParamType, std::less<>> params;
    auto parameters = fn->find("parameters");
    if (parameters != fn->end() && parameters->is_object()) {
      auto props = parameters->find("properties");
      if (props != parameters->end() && props->is_object()) {
        for (auto it = props->begin(); it != props->end(); ++it) {
          if (auto t = param_type_from_schema(it.value())) params.emplace(it.key(), std::move(*t));
        }
      }
    }
    out.tools_[name->get<std::string>()] = std::move(params);
  }
  return out;
}

const ParamType* ToolSchemas::find(std::string_view tool, std::string_view param) const {
  auto t = tools_.find(tool);
  if (t == tools_.end()) return nullptr;
  auto p = t->second.find(param);
  return p == t->second.end() ? nullptr : &p->second;
}

namespace {

// Length of the valid UTF-8 sequence at s[0]: > 0 complete and valid, 0 valid so far but cut by
// the end of `s`, -1 invalid.
int utf8_sequence_len(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = b(0);
  if (b0 < 0x80) return 1;
  int len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return -1;
  }
  for (int i = 1; i < len; ++i) {
    if (static_cast<size_t>(i) >= s.size()) return 0;
    const unsigned char c = b(static_cast<size_t>(i));
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (c < l || c > h) return -1;
  }
  return len;
}

}  // namespace

size_t utf8_sanitize_append(std::string_view in, bool final, std::string& out) {
  size_t i = 0;
  while (i < in.size()) {
    const int len = utf8_sequence_len(in.substr(i));
    if (len > 0) {
      out.append(in.data() + i, static_cast<size_t>(len));
      i += static_cast<size_t>(len);
    } else if (len == 0 && !final) {
      break;  // might complete with the next piece
    } else {
      out.append("\xEF\xBF\xBD");
      ++i;
    }
  }
  return i;
}

std::string utf8_sanitize(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  utf8_sanitize_append(in, true, out);
  return out;
}

void json_escape_append(std::string_view s, std::string& out) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c <= 0x1F) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
}

std::string dump_compact(const OrderedJson& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace m3::text
