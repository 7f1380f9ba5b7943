// Python semantics of jinja Values: truthiness, equality, str/repr, json.dumps.
#include "text/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace m3::text::jinja {

Value Value::undefined(std::string hint) {
  Value v;
  v.s_ = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::number(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.f_ = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.s_ = std::move(s);
  return v;
}
Value Value::list(List items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::tuple(List items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}
Value Value::generator(List items, std::string type) {
  Value v = list(std::move(items));
  v.generator_ = true;
  v.s_ = std::move(type);
  return v;
}
Value Value::dict() {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::make_shared<Dict>();
  return v;
}
Value Value::ns() {
  Value v = dict();
  v.kind_ = Kind::kNamespace;
  return v;
}
Value Value::callable(std::string name, std::function<Value(Args&)> fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

const Value* Dict::find(const Value& key) const {
  for (const auto& [k, v] : entries)
    if (equals(k, key)) return &v;
  return nullptr;
}
const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k.is_string() && k.as_string() == key) return &v;
  return nullptr;
}
void Dict::set(Value key, Value value) {
  for (auto& [k, v] : entries) {
    if (equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

const Value* Args::get(size_t i, std::string_view name) const {
  if (i < pos.size()) return &pos[i];
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.as_bool();
    case Value::Kind::kInt:
      return v.as_int() != 0;
    case Value::Kind::kFloat:
      return v.as_double() != 0.0;
    case Value::Kind::kString:
      return !v.as_string().empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return v.is_generator() || !v.items().empty();
    case Value::Kind::kDict:
      return !v.entries().entries.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) {
    // Python: [1] == (1,) is False, so list and tuple stay distinct.
    return false;
  }
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      const List& x = a.items();
      const List& y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.entries();
      const Dict& y = b.entries();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kNamespace:
      return &a.entries() == &b.entries();
    case Value::Kind::kCallable:
      return &a.fn() == &b.fn();
    default:
      return false;
  }
}

std::string format_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.2345e+02", shortest round-trip digits
  bool neg = !sci.empty() && sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp10 = std::atoi(sci.c_str() + e + 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp10 < -4 || exp10 >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (exp10 < 0) {
    out += "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
    return out;
  }
  size_t int_len = static_cast<size_t>(exp10) + 1;
  if (digits.size() <= int_len) {
    out += digits + std::string(int_len - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, int_len) + "." + digits.substr(int_len);
  }
  return out;
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    size_t n;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c >> 5) == 0x6) {
      cp = c & 0x1f;
      n = 2;
    } else if ((c >> 4) == 0xe) {
      cp = c & 0x0f;
      n = 3;
    } else if ((c >> 3) == 0x1e) {
      cp = c & 0x07;
      n = 4;
    } else {
      out.push_back(0xfffd);  // invalid lead byte: Python would never hold it; keep going
      ++i;
      continue;
    }
    if (i + n > s.size()) {
      out.push_back(0xfffd);
      ++i;
      continue;
    }
    bool ok = true;
    for (size_t k = 1; k < n; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3f);
    }
    if (!ok) {
      out.push_back(0xfffd);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s)
    if ((static_cast<unsigned char>(c) & 0xc0) != 0x80) ++n;
  return n;
}

namespace {

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (uint32_t cp : utf8_decode(s)) {
    char buf[16];
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0)) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      out += buf;
    } else {
      utf8_append(out, cp);
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string to_repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString:
      return repr_string(v.as_string());
    case Value::Kind::kUndefined:
      return "Undefined";
    default:
      break;
  }
  return to_str(v);
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      return format_float(v.as_double());
    case Value::Kind::kString:
      return v.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.is_generator()) return "<" + v.as_string() + " object>";
      bool tuple = v.kind() == Value::Kind::kTuple;
      std::string out = tuple ? "(" : "[";
      const List& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += ", ";
        out += to_repr(items[i]);
      }
      if (tuple && items.size() == 1) out += ",";
      out += tuple ? ")" : "]";
      return out;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v.entries().entries) {
        if (!first) out += ", ";
        first = false;
        out += to_repr(k) + ": " + to_repr(val);
      }
      out += "}";
      if (v.kind() == Value::Kind::kNamespace) return "<Namespace " + out + ">";
      return out;
    }
    case Value::Kind::kCallable:
      return "<function " + v.fn().name + ">";
  }
  return "";
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return v.is_generator() ? v.as_string() : "list";
    case Value::Kind::kTuple:
      return "tuple";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kCallable:
      return "function";
  }
  return "object";
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  auto esc = [&](uint32_t cp) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "\\u%04x", cp & 0xffffu);
    out += buf;
  };
  for (uint32_t cp : utf8_decode(s)) {
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
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
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          esc(cp);
        } else if (ensure_ascii && cp > 0x7e) {
          if (cp >= 0x10000) {
            uint32_t c = cp - 0x10000;
            esc(0xd800 | (c >> 10));
            esc(0xdc00 | (c & 0x3ff));
          } else {
            esc(cp);
          }
        } else {
          utf8_append(out, cp);
        }
    }
  }
  out += '"';
}

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f < 0 ? "-Infinity" : "Infinity";
  return format_float(f);
}

void dump(std::string& out, const Value& v, const JsonDumpOptions& o, int level) {
  const bool pretty = o.indent >= 0 || !o.indent_str.empty();
  const std::string unit =
      !o.indent_str.empty() ? o.indent_str : std::string(std::max(o.indent, 0), ' ');
  // json.dumps: with an indent the default item separator drops its trailing space.
  const std::string item_sep = o.has_separators ? o.item_sep : (pretty ? "," : ", ");
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += unit;
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat:
      out += json_float(v.as_double());
      return;
    case Value::Kind::kString:
      json_string(out, v.as_string(), o.ensure_ascii);
      return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.is_generator())
        throw RenderError("Object of type " + v.as_string() + " is not JSON serializable");
      const List& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        if (pretty) newline(level + 1);
        dump(out, items[i], o, level + 1);
      }
      if (pretty) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      std::vector<const std::pair<Value, Value>*> entries;
      for (const auto& e : v.entries().entries) entries.push_back(&e);
      if (entries.empty()) {
        out += "{}";
        return;
      }
      auto key_text = [](const Value& k) -> std::string {
        switch (k.kind()) {
          case Value::Kind::kString:
            return k.as_string();
          case Value::Kind::kInt:
            return std::to_string(k.as_int());
          case Value::Kind::kFloat:
            return json_float(k.as_double());
          case Value::Kind::kBool:
            return k.as_bool() ? "true" : "false";
          case Value::Kind::kNone:
            return "null";
          default:
            throw RenderError("keys must be str, int, float, bool or None, not " + type_name(k));
        }
      };
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [&](auto* a, auto* b) { return key_text(a->first) < key_text(b->first); });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        if (pretty) newline(level + 1);
        json_string(out, key_text(entries[i]->first), o.ensure_ascii);
        out += o.key_sep;
        dump(out, entries[i]->second, o, level + 1);
      }
      if (pretty) newline(level);
      out += '}';
      return;
    }
    default:
      throw RenderError("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string json_dumps(const Value& v, const JsonDumpOptions& opts) {
  std::string out;
  dump(out, v, opts, 0);
  return out;
}

namespace {

Value from_json_at(const nlohmann::ordered_json& j, int depth, int max_depth) {
  if (depth > max_depth) {
    throw RenderError("template variables nest objects/arrays more than " +
                      std::to_string(max_depth) + " levels deep");
  }
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::number(static_cast<double>(u));
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_at(e, depth + 1, max_depth));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::dict();
      auto& entries = d.entries().entries;
      entries.reserve(j.size());
      // JSON object keys are unique, so append without the duplicate scan.
      for (auto it = j.begin(); it != j.end(); ++it)
        entries.emplace_back(Value::string(it.key()),
                             from_json_at(it.value(), depth + 1, max_depth));
      return d;
    }
    case nlohmann::ordered_json::value_t::binary: {
      List items;
      for (uint8_t b : j.get_binary()) items.push_back(Value::integer(b));
      return Value::list(std::move(items));
    }
    default:
      return Value::none();
  }
}

}  // namespace

Value from_json(const nlohmann::ordered_json& j, int max_depth) {
  return from_json_at(j, 0, max_depth);
}

nlohmann::ordered_json to_json(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kNone:
      return nullptr;
    case Value::Kind::kBool:
      return v.as_bool();
    case Value::Kind::kInt:
      return v.as_int();
    case Value::Kind::kFloat:
      return v.as_double();
    case Value::Kind::kString:
      return v.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      auto arr = nlohmann::ordered_json::array();
      for (const auto& e : v.items()) arr.push_back(to_json(e));
      return arr;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      auto obj = nlohmann::ordered_json::object();
      for (const auto& [k, e] : v.entries().entries) obj[to_str(k)] = to_json(e);
      return obj;
    }
    default:
      throw RenderError("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace m3::text::jinja
