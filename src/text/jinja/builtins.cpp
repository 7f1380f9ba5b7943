// The built-ins of the Jinja interpreter: the globals transformers installs (range, namespace,
// dict, raise_exception, strftime_now), the str / dict / list methods the sandbox allows, and
// jinja2's filters and tests, each with Python's semantics (code-point aware strings, Python
// division and formatting). Members of Interp (interp.h), called from interpreter.cpp.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>

#include <utf8proc.h>

#include "text/jinja/interp.h"

namespace m3::text::jinja::detail {
namespace {

// ---- Python string helpers (code-point aware) ------------------------------------------------

bool py_isspace(uint32_t c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f) || c == 0x85 ||
         c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

// strip/lstrip/rstrip: chars == nullptr means whitespace.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  auto cps = utf8_decode(s);
  std::vector<uint32_t> set;
  if (chars) set = utf8_decode(*chars);
  auto strip_it = [&](uint32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  if (b == 0 && e == cps.size()) return s;
  return encode(cps, b, e);
}

std::vector<std::string> py_split(const std::string& s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t f = s.find(*sep, pos);
      if (f == std::string::npos) break;
      out.push_back(s.substr(pos, f - pos));
      pos = f + sep->size();
    }
    out.push_back(s.substr(pos));
    return out;
  }
  auto cps = utf8_decode(s);
  size_t i = 0, n = cps.size();
  while (true) {
    while (i < n && py_isspace(cps[i])) ++i;
    if (i >= n) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      size_t e = n;
      while (e > i && py_isspace(cps[e - 1])) --e;
      out.push_back(encode(cps, i, e));
      break;
    }
    size_t b = i;
    while (i < n && !py_isspace(cps[i])) ++i;
    out.push_back(encode(cps, b, i));
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& neu,
                       int64_t count, size_t max_bytes) {
  std::string out;
  if (old.empty()) {
    // Python inserts `neu` between every code point and at both ends.
    auto cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += neu;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
      if (out.size() > max_bytes) fail("string result too large");
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += neu;
    if (out.size() > max_bytes) fail("string result too large");
    pos = f + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string map_case(const std::string& s, int mode) {  // 0 lower, 1 upper
  if (is_ascii(s)) {
    std::string out = s;
    for (char& c : out)
      c = mode ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
               : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  std::string out;
  for (uint32_t cp : utf8_decode(s)) {
    // Python's str.upper uses full case mappings; the common multi-letter ones by hand.
    if (mode && cp == 0xdf) {
      out += "SS";
      continue;
    }
    if (mode && cp >= 0xfb00 && cp <= 0xfb06) {
      static const char* kLig[] = {"FF", "FI", "FL", "FFI", "FFL", "ST", "ST"};
      out += kLig[cp - 0xfb00];
      continue;
    }
    auto c = static_cast<utf8proc_int32_t>(cp);
    utf8_append(out, static_cast<uint32_t>(mode ? utf8proc_toupper(c) : utf8proc_tolower(c)));
  }
  return out;
}

bool is_cased_letter(uint32_t cp) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL ||
         cat == UTF8PROC_CATEGORY_LT || cat == UTF8PROC_CATEGORY_LM || cat == UTF8PROC_CATEGORY_LO;
}

uint32_t cp_upper(uint32_t c) {
  return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c)));
}
uint32_t cp_lower(uint32_t c) {
  return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
}

std::string py_title(const std::string& s) {  // str.title()
  std::string out;
  bool prev_cased = false;
  for (uint32_t cp : utf8_decode(s)) {
    bool letter = is_cased_letter(cp);
    utf8_append(out, letter ? (prev_cased ? cp_lower(cp) : cp_upper(cp)) : cp);
    prev_cased = letter;
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  auto cps = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i)
    utf8_append(out, i == 0 ? cp_upper(cps[i]) : cp_lower(cps[i]));
  return out;
}

// jinja's `title` filter: capitalise each item of re.split(r"([-\s({\[<]+)", s).
std::string jinja_title(const std::string& s) {
  std::string out;
  bool at_word_start = true;
  for (uint32_t cp : utf8_decode(s)) {
    bool sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || py_isspace(cp);
    if (sep) {
      utf8_append(out, cp);
      at_word_start = true;
    } else {
      utf8_append(out, at_word_start ? cp_upper(cp) : cp_lower(cp));
      at_word_start = false;
    }
  }
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  auto cps = utf8_decode(s);
  size_t b = 0, i = 0;
  while (i < cps.size()) {
    uint32_t c = cps[i];
    bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d ||
               c == 0x1e || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      ++i;
      continue;
    }
    size_t e = i + 1;
    if (c == '\r' && e < cps.size() && cps[e] == '\n') ++e;
    out.push_back(encode(cps, b, keepends ? e : i));
    b = i = e;
  }
  if (b < cps.size()) out.push_back(encode(cps, b, cps.size()));
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

// ---- Globals ------------------------------------------------------------------------------------
Value Interp::make_dict_from(Args& a, const char* what) {
  Value d = Value::dict();
  if (a.pos.size() > 1) fail(std::string(what) + " expected at most 1 positional argument");
  if (!a.pos.empty()) {
    const Value& src = a.pos[0];
    if (src.is_mapping() || src.kind() == Value::Kind::kNamespace) {
      for (const auto& [k, v] : src.entries().entries) d.entries().set(k, v);
    } else if (src.is_sequence()) {
      for (const auto& pair : src.items()) {
        if (!pair.is_sequence() || pair.items().size() != 2)
          fail(std::string(what) + ": sequence elements must be pairs");
        d.entries().set(pair.items()[0], pair.items()[1]);
      }
    } else {
      fail(std::string(what) + ": cannot convert '" + type_name(src) + "' to a dict");
    }
  }
  for (const auto& [k, v] : a.kw) d.entries().set(Value::string(k), v);
  return d;
}

void Interp::install_globals(Scope& g) {
  g.set("range", Value::callable("range", [this](Args& a) -> Value {
          auto arg = [&](size_t i) {
            const Value& v = a.pos[i];
            if (!v.is_int() && !v.is_bool())
              fail("range() arguments must be integers, not " + type_name(v));
            return v.as_int();
          };
          int64_t start = 0, stop, step = 1;
          if (a.pos.size() == 1) {
            stop = arg(0);
          } else if (a.pos.size() == 2 || a.pos.size() == 3) {
            start = arg(0);
            stop = arg(1);
            if (a.pos.size() == 3) step = arg(2);
          } else {
            fail("range expected 1 to 3 integer arguments");
          }
          if (step == 0) fail("range() arg 3 must not be zero");
          // Overflow-safe element count, then the sandbox's MAX_RANGE rule.
          double count = std::ceil((static_cast<double>(stop) - static_cast<double>(start)) /
                                   static_cast<double>(step));
          if (count > 100000)
            fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
          List items;
          if (step > 0)
            for (int64_t i = start; i < stop; i += step) items.push_back(Value::integer(i));
          else
            for (int64_t i = start; i > stop; i += step) items.push_back(Value::integer(i));
          return Value::list(std::move(items));
        }));
  g.set("namespace", Value::callable("namespace", [](Args& a) -> Value {
          Value d = make_dict_from(a, "namespace");
          Value ns = Value::ns();
          for (auto& [k, v] : d.entries().entries) {
            if (k.is_string() && !k.as_string().empty() && k.as_string()[0] == '_')
              fail(
                  "chat templates cannot store underscore-prefixed attributes on a namespace, but "
                  "got '" +
                  k.as_string() + "'");
            ns.entries().entries.emplace_back(k, v);
          }
          return ns;
        }));
  g.set("dict", Value::callable("dict", [](Args& a) { return make_dict_from(a, "dict"); }));
  g.set("raise_exception", Value::callable("raise_exception", [](Args& a) -> Value {
          fail(a.pos.empty() ? std::string("raise_exception() called") : to_str(a.pos[0]));
        }));
  g.set("strftime_now", Value::callable("strftime_now", [this](Args& a) -> Value {
          if (a.pos.empty() || !a.pos[0].is_string()) fail("strftime_now expects a format string");
          const std::string& f = a.pos[0].as_string();
          if (opts_.strftime_now) return Value::string(opts_.strftime_now(f));
          std::time_t now = std::time(nullptr);
          std::tm tm{};
          localtime_r(&now, &tm);
          char buf[512];
          size_t n = std::strftime(buf, sizeof(buf), f.c_str(), &tm);
          return Value::string(std::string(buf, n));
        }));
}

// ---- Methods ------------------------------------------------------------------------------------
const std::string& Interp::want_str(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " must be str, not " + type_name(v));
  return v.as_string();
}

bool Interp::match_affix(const std::string& s, const Value& arg, bool prefix) {
  auto one = [&](const std::string& a) {
    if (a.size() > s.size()) return false;
    return prefix ? s.compare(0, a.size(), a) == 0
                  : s.compare(s.size() - a.size(), a.size(), a) == 0;
  };
  if (arg.kind() == Value::Kind::kTuple) {
    for (const auto& e : arg.items())
      if (one(want_str(e, prefix ? "startswith first arg" : "endswith first arg"))) return true;
    return false;
  }
  return one(want_str(arg, prefix ? "startswith first arg" : "endswith first arg"));
}

Value Interp::str_format(const std::string& fmt, Args& a) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      size_t close = fmt.find('}', i);
      if (close == std::string::npos) fail("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, close - i - 1);
      size_t colon = field.find(':');
      if (colon != std::string::npos) field = field.substr(0, colon);  // format specs are ignored
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_idx >= a.pos.size())
          fail("Replacement index " + std::to_string(auto_idx) + " out of range");
        v = &a.pos[auto_idx++];
      } else if (std::isdigit(static_cast<unsigned char>(field[0]))) {
        size_t k = static_cast<size_t>(std::strtoull(field.c_str(), nullptr, 10));
        if (k >= a.pos.size()) fail("Replacement index " + field + " out of range");
        v = &a.pos[k];
      } else {
        for (const auto& kv : a.kw)
          if (kv.first == field) v = &kv.second;
        if (!v) fail("format key '" + field + "' not given");
      }
      out += to_str(*v);
      i = close;
    } else if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}')
        ++i;
      else
        fail("Single '}' encountered in format string");
      out += '}';
    } else {
      out += c;
    }
    check_size(out.size());
  }
  return Value::string(std::move(out));
}

Value Interp::call_method(const Value& obj, const std::string& name, Args& a) {
  auto arg = [&](size_t i, const char* n) -> const Value* { return a.get(i, n); };
  if (obj.is_mapping()) {
    const Dict& d = obj.entries();
    if (name == "get") {
      const Value* k = arg(0, "key");
      if (!k) fail("get expected at least 1 argument");
      if (const Value* v = d.find(*k)) return *v;
      const Value* dflt = arg(1, "default");
      return dflt ? *dflt : Value::none();
    }
    if (name == "items") {
      List out;
      for (const auto& [k, v] : d.entries) out.push_back(Value::tuple({k, v}));
      return Value::list(std::move(out));
    }
    if (name == "keys") return Value::list(iterate(obj));
    if (name == "values") {
      List out;
      for (const auto& kv : d.entries) out.push_back(kv.second);
      return Value::list(std::move(out));
    }
    if (name == "copy") {
      Args ca{{obj}, {}};
      return make_dict_from(ca, "dict");
    }
    fail("access to attribute '" + name + "' of 'dict' object is unsafe.");
  }
  if (obj.is_sequence()) {
    const List& items = obj.items();
    if (name == "index" || name == "count") {
      const Value* x = arg(0, "value");
      if (!x) fail(name + "() takes exactly one argument");
      int64_t n = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        if (equals(items[i], *x)) {
          if (name == "index") return Value::integer(static_cast<int64_t>(i));
          ++n;
        }
      }
      if (name == "index") fail(to_repr(*x) + " is not in list");
      return Value::integer(n);
    }
    if (name == "copy") return Value::list(items);
    fail("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
  }
  const std::string& s = obj.as_string();
  auto opt_str = [&](size_t i, const char* n) -> const std::string* {
    const Value* v = arg(i, n);
    if (!v || v->is_none()) return nullptr;
    return &want_str(*v, n);
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const std::string* chars = opt_str(0, "chars");
    return Value::string(py_strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    const std::string* sep = opt_str(0, "sep");
    const Value* m = arg(1, "maxsplit");
    int64_t maxsplit = m ? m->as_int() : -1;
    std::vector<std::string> parts;
    if (name == "rsplit" && maxsplit >= 0) {
      // rsplit with a limit: split the reversed problem by scanning from the right.
      if (!sep) {
        auto all = py_split(s, nullptr, -1);
        if (static_cast<int64_t>(all.size()) > maxsplit + 1) {
          // Re-join the leftmost pieces with their original spacing.
          auto cps = utf8_decode(s);
          size_t e = cps.size();
          int64_t splits = 0;
          std::vector<std::string> rev;
          while (splits < maxsplit) {
            while (e > 0 && py_isspace(cps[e - 1])) --e;
            size_t b = e;
            while (b > 0 && !py_isspace(cps[b - 1])) --b;
            rev.push_back(encode(cps, b, e));
            e = b;
            ++splits;
          }
          while (e > 0 && py_isspace(cps[e - 1])) --e;
          size_t b0 = 0;
          while (b0 < e && py_isspace(cps[b0])) ++b0;
          if (e > b0) rev.push_back(encode(cps, b0, e));
          parts.assign(rev.rbegin(), rev.rend());
        } else {
          parts = std::move(all);
        }
      } else {
        if (sep->empty()) fail("empty separator");
        std::vector<std::string> rev;
        size_t end = s.size();
        while (static_cast<int64_t>(rev.size()) < maxsplit) {
          if (end < sep->size()) break;
          size_t f = s.rfind(*sep, end - sep->size());
          if (f == std::string::npos) break;
          rev.push_back(s.substr(f + sep->size(), end - f - sep->size()));
          end = f;
        }
        rev.push_back(s.substr(0, end));
        parts.assign(rev.rbegin(), rev.rend());
      }
    } else {
      parts = py_split(s, sep, maxsplit);
    }
    List out;
    for (auto& p : parts) out.push_back(Value::string(std::move(p)));
    return Value::list(std::move(out));
  }
  if (name == "startswith" || name == "endswith") {
    const Value* p = arg(0, "prefix");
    if (!p) fail(name + "() takes at least 1 argument");
    return Value::boolean(match_affix(s, *p, name == "startswith"));
  }
  if (name == "replace") {
    const Value* o = arg(0, "old");
    const Value* n = arg(1, "new");
    if (!o || !n) fail("replace() takes at least 2 arguments");
    const Value* c = arg(2, "count");
    return Value::string(py_replace(s, want_str(*o, "replace() argument 1"),
                                    want_str(*n, "replace() argument 2"), c ? c->as_int() : -1,
                                    opts_.max_output_bytes));
  }
  if (name == "upper") return Value::string(map_case(s, 1));
  if (name == "lower" || name == "casefold") return Value::string(map_case(s, 0));
  if (name == "title") return Value::string(py_title(s));
  if (name == "capitalize") return Value::string(py_capitalize(s));
  if (name == "swapcase") {
    std::string out;
    for (uint32_t cp : utf8_decode(s)) {
      uint32_t u = cp_upper(cp);
      utf8_append(out, u != cp ? u : cp_lower(cp));
    }
    return Value::string(std::move(out));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "count") {
    const Value* sub = arg(0, "sub");
    if (!sub) fail(name + "() takes at least 1 argument");
    const std::string& needle = want_str(*sub, "substring");
    if (name == "count") {
      if (needle.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s)) + 1);
      int64_t n = 0;
      for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + needle.size()))
        ++n;
      return Value::integer(n);
    }
    size_t p = name == "rfind" ? s.rfind(needle) : s.find(needle);
    if (p == std::string::npos) {
      if (name == "index") fail("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(static_cast<int64_t>(utf8_length(std::string_view(s).substr(0, p))));
  }
  if (name == "join") {
    const Value* it = arg(0, "iterable");
    if (!it) fail("join() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const auto& e : iterate(*it)) {
      if (!first) out += s;
      first = false;
      out += want_str(e, "sequence item");
      check_size(out.size());
    }
    return Value::string(std::move(out));
  }
  if (name == "splitlines") {
    const Value* k = arg(0, "keepends");
    List out;
    for (auto& line : py_splitlines(s, k && truthy(*k)))
      out.push_back(Value::string(std::move(line)));
    return Value::list(std::move(out));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    const Value* p = arg(0, "prefix");
    if (!p) fail(name + "() takes exactly one argument");
    const std::string& a0 = want_str(*p, name.c_str());
    if (name == "removeprefix" && s.compare(0, a0.size(), a0) == 0)
      return Value::string(s.substr(a0.size()));
    if (name == "removesuffix" && a0.size() <= s.size() && !a0.empty() &&
        s.compare(s.size() - a0.size(), a0.size(), a0) == 0)
      return Value::string(s.substr(0, s.size() - a0.size()));
    return obj;
  }
  if (name == "partition" || name == "rpartition") {
    const Value* p = arg(0, "sep");
    if (!p) fail(name + "() takes exactly one argument");
    const std::string& sep = want_str(*p, "sep");
    if (sep.empty()) fail("empty separator");
    size_t f = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (f == std::string::npos) {
      if (name == "partition") return Value::tuple({obj, Value::string(""), Value::string("")});
      return Value::tuple({Value::string(""), Value::string(""), obj});
    }
    return Value::tuple({Value::string(s.substr(0, f)), Value::string(sep),
                         Value::string(s.substr(f + sep.size()))});
  }
  if (name == "format") return str_format(s, a);
  if (name == "zfill" || name == "center" || name == "ljust" || name == "rjust") {
    const Value* w = arg(0, "width");
    if (!w || !(w->is_int() || w->is_bool())) fail(name + "() requires an integer width");
    int64_t width = w->as_int();
    int64_t len = static_cast<int64_t>(utf8_length(s));
    if (width > static_cast<int64_t>(opts_.max_output_bytes)) check_size(SIZE_MAX);
    if (width <= len) return obj;
    size_t pad = static_cast<size_t>(width - len);
    if (name == "zfill") {
      bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
      return Value::string((sign ? s.substr(0, 1) : "") + std::string(pad, '0') +
                           (sign ? s.substr(1) : s));
    }
    const std::string* fill = opt_str(1, "fillchar");
    std::string f = fill ? *fill : " ";
    auto rep = [&](size_t k) {
      std::string o;
      for (size_t i = 0; i < k; ++i) o += f;
      return o;
    };
    if (name == "ljust") return Value::string(s + rep(pad));
    if (name == "rjust") return Value::string(rep(pad) + s);
    // Python's center puts the extra space on the right when len is even... exactly:
    size_t left = pad / 2 + (pad & static_cast<size_t>(width) & 1);
    return Value::string(rep(left) + s + rep(pad - left));
  }
  if (name == "encode") fail("access to attribute 'encode' is not supported in chat templates");
  // is* predicates.
  auto cps = utf8_decode(s);
  auto all = [&](auto pred) {
    if (cps.empty()) return false;
    for (uint32_t c : cps)
      if (!pred(c)) return false;
    return true;
  };
  auto cat = [](uint32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)); };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric")
    return Value::boolean(all([&](uint32_t c) {
      return cat(c) == UTF8PROC_CATEGORY_ND ||
             (name != "isdecimal" && cat(c) == UTF8PROC_CATEGORY_NO);
    }));
  if (name == "isalpha") return Value::boolean(all([&](uint32_t c) { return is_cased_letter(c); }));
  if (name == "isalnum")
    return Value::boolean(
        all([&](uint32_t c) { return is_cased_letter(c) || cat(c) == UTF8PROC_CATEGORY_ND; }));
  if (name == "isspace") return Value::boolean(all([](uint32_t c) { return py_isspace(c); }));
  if (name == "islower" || name == "isupper" || name == "istitle") {
    bool cased = false;
    for (uint32_t c : cps) {
      if (cp_upper(c) != c || cp_lower(c) != c) {
        cased = true;
        if (name == "islower" && cp_lower(c) != c) return Value::boolean(false);
        if (name == "isupper" && cp_upper(c) != c) return Value::boolean(false);
      }
    }
    if (name == "istitle") return Value::boolean(cased && py_title(s) == s);
    return Value::boolean(cased);
  }
  fail("'str' object has no method '" + name + "'");
}

// ---- Filters ------------------------------------------------------------------------------------
Value Interp::apply_filter_chain(const Node& chain, Value base, Scope& scope) {
  // The chain is nested Filter nodes whose innermost args[0] is null: apply inside-out.
  std::vector<const Node*> stack;
  for (const Node* n = &chain; n; n = n->args.empty() || !n->args[0] ? nullptr : n->args[0].get())
    stack.push_back(n);
  Value v = std::move(base);
  for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
    Args a = eval_args(**it, scope);
    v = apply_filter((*it)->name, std::move(v), a);
  }
  return v;
}

Value Interp::attr_path(const Value& item, const Value& attribute) {
  // jinja's make_attrgetter: "a.b" walks attributes; integer parts index.
  if (attribute.is_int()) return get_item(item, attribute);
  std::string path = to_str(attribute);
  Value cur = item;
  size_t b = 0;
  while (true) {
    size_t dot = path.find('.', b);
    std::string part = path.substr(b, dot == std::string::npos ? std::string::npos : dot - b);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    cur = numeric ? get_item(cur, Value::integer(std::strtoll(part.c_str(), nullptr, 10)))
                  : get_item(cur, Value::string(part));
    if (dot == std::string::npos) return cur;
    b = dot + 1;
  }
}

std::string Interp::sort_key_str(const Value& v, bool case_sensitive) {
  return case_sensitive ? v.as_string() : map_case(v.as_string(), 0);
}

List Interp::sorted(List items, bool reverse, bool case_sensitive, const Value* attribute) {
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& it : items) {
    Value k = attribute ? attr_path(it, *attribute) : it;
    if (k.is_string() && !case_sensitive) k = Value::string(map_case(k.as_string(), 0));
    keyed.emplace_back(std::move(k), std::move(it));
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? cmp(y.first, x.first, "<") < 0 : cmp(x.first, y.first, "<") < 0;
  });
  List out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return out;
}

Value Interp::apply_filter(const std::string& name, Value v, Args& a) {
  auto arg = [&](size_t i, const char* n) -> const Value* { return a.get(i, n); };
  auto flag = [&](size_t i, const char* n, bool dflt) {
    const Value* x = arg(i, n);
    return x ? truthy(*x) : dflt;
  };
  if (name == "default" || name == "d") {
    const Value* dflt = arg(0, "default_value");
    bool boolean = flag(1, "boolean", false);
    if (v.is_undefined() || (boolean && !truthy(v))) return dflt ? *dflt : Value::string("");
    return v;
  }
  if (name == "tojson") {
    JsonDumpOptions o;
    if (const Value* x = arg(0, "ensure_ascii")) o.ensure_ascii = truthy(*x);
    if (const Value* x = arg(1, "indent")) {
      if (x->is_string())
        o.indent_str = x->as_string();
      else if (x->is_int() || x->is_bool())
        o.indent = static_cast<int>(std::clamp<int64_t>(x->as_int(), 0, 64));
      else if (!x->is_none())
        fail("tojson indent must be an integer or a string");
    }
    if (const Value* x = arg(2, "separators"); x && !x->is_none()) {
      if (!x->is_sequence() || x->items().size() != 2 || !x->items()[0].is_string() ||
          !x->items()[1].is_string())
        fail("tojson separators must be a (item_separator, key_separator) pair of strings");
      o.has_separators = true;
      o.item_sep = x->items()[0].as_string();
      o.key_sep = x->items()[1].as_string();
    }
    if (const Value* x = arg(3, "sort_keys")) o.sort_keys = truthy(*x);
    std::string s = json_dumps(v, o);
    check_size(s.size());
    return Value::string(std::move(s));
  }
  if (name == "safe") return Value::string(to_str(v));  // Markup(value) is a str
  if (name == "escape" || name == "e" || name == "forceescape")
    return Value::string(html_escape(to_str(v)));
  if (name == "string") return Value::string(to_str(v));
  if (name == "length" || name == "count") {
    switch (v.kind()) {
      case Value::Kind::kUndefined:
        return Value::integer(0);
      case Value::Kind::kString:
        return Value::integer(static_cast<int64_t>(utf8_length(v.as_string())));
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        if (v.is_generator()) fail("object of type '" + v.as_string() + "' has no len()");
        return Value::integer(static_cast<int64_t>(v.items().size()));
      case Value::Kind::kDict:
        return Value::integer(static_cast<int64_t>(v.entries().entries.size()));
      default:
        fail("object of type '" + type_name(v) + "' has no len()");
    }
  }
  if (name == "list") return Value::list(iterate(v));
  if (name == "first") {
    List items = iterate(v);
    if (items.empty()) return Value::undefined("No first item, sequence was empty.");
    return items.front();
  }
  if (name == "last") {
    if ((!v.is_sequence() && !v.is_string() && !v.is_undefined() && !v.is_mapping()) ||
        v.is_generator())
      fail("'" + type_name(v) + "' object is not reversible");
    List items = iterate(v);
    if (items.empty()) return Value::undefined("No last item, sequence was empty.");
    return items.back();
  }
  if (name == "join") {
    const Value* sep = arg(0, "d");
    const Value* attribute = arg(1, "attribute");
    std::string d = sep ? to_str(*sep) : "";
    std::string out;
    bool first = true;
    for (const auto& it : iterate(v)) {
      if (!first) out += d;
      first = false;
      out += to_str(attribute && !attribute->is_none() ? attr_path(it, *attribute) : it);
      check_size(out.size());
    }
    return Value::string(std::move(out));
  }
  if (name == "upper") return Value::string(map_case(to_str(v), 1));
  if (name == "lower") return Value::string(map_case(to_str(v), 0));
  if (name == "capitalize") return Value::string(py_capitalize(to_str(v)));
  if (name == "title") return Value::string(jinja_title(to_str(v)));
  if (name == "trim") {
    const Value* chars = arg(0, "chars");
    std::string c = chars && !chars->is_none() ? to_str(*chars) : std::string();
    return Value::string(
        py_strip(to_str(v), chars && !chars->is_none() ? &c : nullptr, true, true));
  }
  if (name == "replace") {
    const Value* o = arg(0, "old");
    const Value* n = arg(1, "new");
    if (!o || !n) fail("replace filter needs 'old' and 'new' arguments");
    const Value* c = arg(2, "count");
    return Value::string(py_replace(to_str(v), to_str(*o), to_str(*n),
                                    c && !c->is_none() ? c->as_int() : -1, opts_.max_output_bytes));
  }
  if (name == "indent") {
    const Value* w = arg(0, "width");
    std::string ind = !w ? "    "
                      : w->is_string()
                          ? w->as_string()
                          : std::string(static_cast<size_t>(std::clamp<int64_t>(
                                            w->is_number() ? w->as_int() : 4, 0, 1024)),
                                        ' ');
    bool first = flag(1, "first", false);
    bool blank = flag(2, "blank", false);
    // do_indent appends "\n" with +=, so anything but a string fails as in Python.
    if (v.is_undefined()) fail(undefined_message(v));
    if (!v.is_string())
      fail("unsupported operand type(s) for +=: '" + type_name(v) + "' and 'str'");
    std::string s = v.as_string() + "\n";
    auto lines = py_splitlines(s, false);
    std::string rv;
    if (blank) {
      for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
    } else {
      rv = lines.empty() ? "" : lines[0];
      for (size_t i = 1; i < lines.size(); ++i)
        rv += "\n" + (lines[i].empty() ? "" : ind) + lines[i];
    }
    if (first) rv = ind + rv;
    check_size(rv.size());
    return Value::string(std::move(rv));
  }
  if ((name == "int" || name == "float" || name == "abs" || name == "round") && v.is_undefined())
    fail(undefined_message(v));  // jinja's Undefined raises from __int__/__float__/__abs__
  if (name == "int") {
    const Value* dflt = arg(0, "default");
    const Value* base = arg(1, "base");
    Value fallback = dflt ? *dflt : Value::integer(0);
    if (v.is_int() || v.is_bool()) return Value::integer(v.as_int());
    if (v.is_float()) {
      double f = v.as_double();
      if (!std::isfinite(f) || std::fabs(f) >= 9.2e18) return fallback;
      return Value::integer(static_cast<int64_t>(f));
    }
    if (v.is_string()) {
      std::string s = py_strip(v.as_string(), nullptr, true, true);
      int b = base ? static_cast<int>(base->as_int()) : 10;
      std::string digits;
      for (char c : s)
        if (c != '_') digits += c;
      if (!digits.empty()) {
        char* end = nullptr;
        errno = 0;
        long long x = std::strtoll(digits.c_str(), &end, b == 0 ? 0 : b);
        if (errno == 0 && end && *end == 0) return Value::integer(x);
        end = nullptr;
        double f = std::strtod(digits.c_str(), &end);
        if (end && *end == 0 && std::isfinite(f) && std::fabs(f) < 9.2e18)
          return Value::integer(static_cast<int64_t>(f));
      }
    }
    return fallback;
  }
  if (name == "float") {
    const Value* dflt = arg(0, "default");
    if (v.is_number()) return Value::number(v.as_double());
    if (v.is_string()) {
      std::string s = py_strip(v.as_string(), nullptr, true, true);
      char* end = nullptr;
      double f = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == 0) return Value::number(f);
    }
    return dflt ? *dflt : Value::number(0.0);
  }
  if (name == "abs") {
    if (!v.is_number()) fail("bad operand type for abs(): '" + type_name(v) + "'");
    if (v.is_float()) return Value::number(std::fabs(v.as_double()));
    if (v.as_int() == INT64_MIN) fail("integer overflow");
    return Value::integer(std::llabs(v.as_int()));
  }
  if (name == "round") {
    const Value* p = arg(0, "precision");
    const Value* m = arg(1, "method");
    int64_t prec = p ? p->as_int() : 0;
    std::string method = m ? to_str(*m) : "common";
    if (!v.is_number()) fail("round filter needs a number, got " + type_name(v));
    double x = v.as_double();
    double scale = std::pow(10.0, static_cast<double>(prec));
    if (method == "floor") return Value::number(std::floor(x * scale) / scale);
    if (method == "ceil") return Value::number(std::ceil(x * scale) / scale);
    if (method != "common") fail("method must be common, ceil or floor");
    if (v.is_int() || v.is_bool()) return Value::integer(v.as_int());  // round(int, n) stays int
    if (prec == 0) return Value::number(std::nearbyint(x));
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(std::clamp<int64_t>(prec, 0, 300)), x);
    return Value::number(std::strtod(buf, nullptr));
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::list();
    if (!v.is_mapping()) fail("can only get item pairs from a mapping, not " + type_name(v));
    List out;
    for (const auto& [k, val] : v.entries().entries) out.push_back(Value::tuple({k, val}));
    return Value::generator(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_mapping()) fail("dictsort needs a mapping, got " + type_name(v));
    bool cs = flag(0, "case_sensitive", false);
    const Value* by = arg(1, "by");
    bool by_value = by && to_str(*by) == "value";
    bool rev = flag(2, "reverse", false);
    List pairs;
    for (const auto& [k, val] : v.entries().entries) pairs.push_back(Value::tuple({k, val}));
    Value pos = Value::integer(by_value ? 1 : 0);
    return Value::list(sorted(std::move(pairs), rev, cs, &pos));
  }
  if (name == "sort") {
    bool rev = flag(0, "reverse", false);
    bool cs = flag(1, "case_sensitive", false);
    const Value* attribute = arg(2, "attribute");
    return Value::list(
        sorted(iterate(v), rev, cs, attribute && !attribute->is_none() ? attribute : nullptr));
  }
  if (name == "reverse") {
    if (v.is_string()) {
      auto cps = utf8_decode(v.as_string());
      std::reverse(cps.begin(), cps.end());
      return Value::string(encode(cps, 0, cps.size()));
    }
    List items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::generator(std::move(items), v.kind() == Value::Kind::kList && !v.is_generator()
                                                  ? "list_reverseiterator"
                                                  : "reversed");
  }
  if (name == "unique") {
    bool cs = flag(0, "case_sensitive", false);
    const Value* attribute = arg(1, "attribute");
    List out, seen;
    for (const auto& it : iterate(v)) {
      Value k = attribute && !attribute->is_none() ? attr_path(it, *attribute) : it;
      if (k.is_string() && !cs) k = Value::string(map_case(k.as_string(), 0));
      bool dup = false;
      for (const auto& s : seen) dup = dup || equals(s, k);
      if (!dup) {
        seen.push_back(k);
        out.push_back(it);
      }
    }
    return Value::generator(std::move(out));
  }
  if (name == "min" || name == "max") {
    bool cs = flag(0, "case_sensitive", false);
    const Value* attribute = arg(1, "attribute");
    List items =
        sorted(iterate(v), false, cs, attribute && !attribute->is_none() ? attribute : nullptr);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    return name == "min" ? items.front() : items.back();
  }
  if (name == "sum") {
    const Value* attribute = arg(0, "attribute");
    const Value* start = arg(1, "start");
    Value acc = start ? *start : Value::integer(0);
    for (const auto& it : iterate(v))
      acc = binary("+", acc, attribute && !attribute->is_none() ? attr_path(it, *attribute) : it);
    return acc;
  }
  if (name == "map") {
    List out;
    if (!truthy(v)) return Value::generator({});  // sync_do_map: `if value:` guards the loop
    List items = iterate(v);
    bool has_attr = false;
    for (const auto& kv : a.kw) has_attr = has_attr || kv.first == "attribute";
    if (a.pos.empty() && has_attr) {
      const Value* attribute = arg(99, "attribute");
      const Value* dflt = arg(99, "default");
      for (const auto& it : items) {
        Value x = attr_path(it, *attribute);
        if (x.is_undefined() && dflt) x = *dflt;
        out.push_back(std::move(x));
      }
      return Value::generator(std::move(out));
    }
    if (a.pos.empty()) fail("map requires a filter name or attribute=");
    std::string filter = to_str(a.pos[0]);
    Args rest{List(a.pos.begin() + 1, a.pos.end()), a.kw};
    for (const auto& it : items) {
      Args copy = rest;
      out.push_back(apply_filter(filter, it, copy));
    }
    return Value::generator(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    if (!truthy(v)) return Value::generator({});  // select_or_reject: `if seq:` guards the loop
    bool by_attr = name == "selectattr" || name == "rejectattr";
    bool want = name == "select" || name == "selectattr";
    size_t k = 0;
    Value attribute;
    if (by_attr) {
      if (a.pos.empty()) fail(name + " requires an attribute name");
      attribute = a.pos[k++];
    }
    std::string test = k < a.pos.size() ? to_str(a.pos[k++]) : "";
    Args targs{
        List(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(k, a.pos.size())), a.pos.end()),
        a.kw};
    List out;
    for (const auto& it : iterate(v)) {
      Value x = by_attr ? attr_path(it, attribute) : it;
      Args copy = targs;
      bool r = test.empty() ? truthy(x) : apply_test(test, x, copy);
      if (r == want) out.push_back(it);
    }
    return Value::generator(std::move(out));
  }
  if (name == "attr") {
    const Value* n = arg(0, "name");
    if (!n) fail("attr filter needs a name");
    // jinja's attr filter is getattr only: dict keys are not attributes.
    std::string an = to_str(*n);
    if ((v.is_mapping() && is_dict_method(an)) || (v.is_string() && is_str_method(an)) ||
        (v.is_sequence() && is_list_method(an)) || v.kind() == Value::Kind::kNamespace)
      return get_attr(v, an);
    return Value::undefined("'" + obj_repr(v) + "' has no attribute '" + an + "'");
  }
  if (name == "batch") {
    const Value* n = arg(0, "linecount");
    if (!n || !n->is_int() || n->as_int() <= 0) fail("batch needs a positive line count");
    const Value* fill = arg(1, "fill_with");
    size_t per = static_cast<size_t>(n->as_int());
    List out, cur;
    for (const auto& it : iterate(v)) {
      cur.push_back(it);
      if (cur.size() == per) {
        out.push_back(Value::list(std::move(cur)));
        cur.clear();
      }
    }
    if (!cur.empty()) {
      if (fill && !fill->is_none())
        while (cur.size() < per) cur.push_back(*fill);
      out.push_back(Value::list(std::move(cur)));
    }
    return Value::generator(std::move(out));
  }
  if (name == "center") {
    const Value* w = arg(0, "width");
    Args ca{{w ? *w : Value::integer(80)}, {}};
    return call_method(Value::string(to_str(v)), "center", ca);
  }
  if (name == "wordcount") {  // len(re.findall(r"\w+", str(value)))
    int64_t words = 0;
    bool in_word = false;
    for (uint32_t cp : utf8_decode(to_str(v))) {
      auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
      bool w = cp == '_' || is_cased_letter(cp) || c == UTF8PROC_CATEGORY_ND ||
               c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
      if (w && !in_word) ++words;
      in_word = w;
    }
    return Value::integer(words);
  }
  if (name == "format") {
    if (!a.kw.empty()) fail("format filter with keyword arguments is not supported");
    return Value::string(percent_format(to_str(v), Value::tuple(a.pos)));
  }
  if (name == "pprint") return Value::string(to_repr(v));
  fail("no filter named '" + name + "'");
}

// ---- Tests --------------------------------------------------------------------------------------
bool Interp::apply_test(const std::string& name, const Value& v, Args& a) {
  auto arg0 = [&]() -> const Value& {
    if (a.pos.empty()) {
      if (!a.kw.empty()) return a.kw[0].second;
      fail("test '" + name + "' needs an argument");
    }
    return a.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_mapping();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "callable") return v.is_callable();
  if (name == "iterable")
    return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_mapping();
  if (name == "sequence")
    return v.is_undefined() || v.is_string() || (v.is_sequence() && !v.is_generator()) ||
           v.is_mapping();
  if (name == "escaped") return false;
  if (name == "even" || name == "odd") {
    if (!v.is_number()) fail("test '" + name + "' needs a number");
    int64_t x = v.is_float() ? static_cast<int64_t>(v.as_double()) : v.as_int();
    return (x % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const Value& d = arg0();
    if (!v.is_number() || !d.is_number()) fail("divisibleby needs numbers");
    if (d.as_double() == 0) fail("integer division or modulo by zero");
    if (v.is_float() || d.is_float()) return pyfmod(v.as_double(), d.as_double()) == 0;
    return pymod(v.as_int(), d.as_int()) == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg0());
  if (name == "ne" || name == "!=") return !equals(v, arg0());
  if (name == "lt" || name == "lessthan" || name == "<") return compare("<", v, arg0());
  if (name == "le" || name == "<=") return compare("<=", v, arg0());
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(">", v, arg0());
  if (name == "ge" || name == ">=") return compare(">=", v, arg0());
  if (name == "in") return contains(arg0(), v);
  if (name == "sameas") {
    const Value& o = arg0();
    if (v.kind() != o.kind()) return false;
    switch (v.kind()) {
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        return &v.items() == &o.items();
      case Value::Kind::kDict:
      case Value::Kind::kNamespace:
        return &v.entries() == &o.entries();
      default:
        return equals(v, o);
    }
  }
  if (name == "lower" || name == "upper") {  // str(value).islower()
    Args none;
    return truthy(
        call_method(Value::string(to_str(v)), name == "lower" ? "islower" : "isupper", none));
  }
  if (name == "filter" || name == "test") {
    static const char* kFilters[] = {
        "default",    "d",          "tojson", "safe",  "escape",   "e",         "string",
        "length",     "count",      "list",   "first", "last",     "join",      "upper",
        "lower",      "capitalize", "title",  "trim",  "replace",  "indent",    "int",
        "float",      "abs",        "round",  "items", "dictsort", "sort",      "reverse",
        "unique",     "min",        "max",    "sum",   "map",      "select",    "reject",
        "selectattr", "rejectattr", "attr",   "batch", "center",   "wordcount", "format",
        "pprint",     "forceescape"};
    static const char* kTests[] = {
        "defined", "undefined", "none",  "string",      "mapping",     "number",   "integer",
        "float",   "boolean",   "true",  "false",       "callable",    "iterable", "sequence",
        "escaped", "even",      "odd",   "divisibleby", "eq",          "equalto",  "ne",
        "lt",      "lessthan",  "le",    "gt",          "greaterthan", "ge",       "in",
        "sameas",  "lower",     "upper", "filter",      "test"};
    std::string q = v.is_string() ? v.as_string() : "";
    if (name == "filter") {
      for (const char* f : kFilters)
        if (q == f) return true;
      return false;
    }
    for (const char* t : kTests)
      if (q == t) return true;
    return false;
  }
  fail("no test named '" + name + "'");
}

}  // namespace m3::text::jinja::detail
