// Value: the dynamic value a Jinja template computes with, with the Python semantics jinja2 gives
// it (truthiness, ==, str(), repr(), json.dumps). Used by the jinja parser/interpreter and by
// chat_template.cpp to turn request JSON into template variables.
// Invariant: lists, dicts and namespaces are shared by pointer (Python reference semantics); the
// only in-place mutation during a render is `{% set ns.attr = ... %}` on a namespace, because the
// environment is an immutable sandbox like transformers' (list.append etc. are refused).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace m3::text::jinja {

class Value;
using List = std::vector<Value>;
struct Dict;
struct Callable;

// Thrown inside the interpreter for runtime failures; Template::render catches it and returns an
// Error carrying the line and column of the node being evaluated. Never escapes the jinja module.
struct RenderError : std::runtime_error {
  explicit RenderError(const std::string& what) : std::runtime_error(what) {}
  int line = 0;
  int col = 0;
};

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,
    kCallable,
  };

  Value() = default;  // undefined
  static Value undefined(std::string hint = {});
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value list(List items = {});
  static Value tuple(List items);
  // A lazy iterator as jinja's select/map/unique/items/batch/reverse filters return: iterable
  // like a list, but always truthy, no len(), not subscriptable, printed as a generator.
  static Value generator(List items, std::string type = "generator");
  static Value dict();
  static Value ns();
  static Value callable(std::string name, std::function<Value(struct Args&)> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // Python numbers: bool is an int subclass, so it counts (as in jinja's `is number`).
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  bool is_mapping() const { return kind_ == Kind::kDict; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  bool is_generator() const { return kind_ == Kind::kList && generator_; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double as_double() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return s_; }  // string value, or undefined's hint
  List& items() const { return *list_; }               // list / tuple
  Dict& entries() const { return *dict_; }             // dict / namespace
  Callable& fn() const { return *fn_; }

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool generator_ = false;  // kList only: see generator()
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
};

// Insertion-ordered dict (Python 3.7+ order, which json.dumps(sort_keys=False) relies on).
// Linear lookup: chat-template dicts are small (a message, a tool schema level).
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
};

// Call arguments: positional, then keyword (in source order).
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Python-style binding: the i-th positional, else the keyword `name`, else nullptr.
  const Value* get(size_t i, std::string_view name) const;
};

struct Callable {
  std::string name;
  std::function<Value(Args&)> fn;
};

// Python semantics.
bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
std::string to_str(const Value& v);     // str(v); undefined -> ""
std::string to_repr(const Value& v);    // repr(v)
std::string type_name(const Value& v);  // "str", "int", "dict", ... as Python's type(v).__name__
std::string format_float(double f);     // repr(float): shortest round-trip, "1.0", "1e+20"

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson filter calls
// it. indent < 0 means None; indent_str overrides the indent unit when non-empty (json.dumps
// also takes a string indent). Throws RenderError for undefined/callable values.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  int indent = -1;
  std::string indent_str;
  bool has_separators = false;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};
std::string json_dumps(const Value& v, const JsonDumpOptions& opts);

// nlohmann JSON -> Value (objects keep their order: pass ordered_json to keep the caller's order).
// The conversion recurses once per nesting level, so it refuses (throws RenderError) JSON nested
// deeper than `max_depth`: request JSON reaches it, and the stack must not be the limit.
inline constexpr int kMaxFromJsonDepth = 256;
Value from_json(const nlohmann::ordered_json& j, int max_depth = kMaxFromJsonDepth);
// Value -> JSON (for tests and callers that want data back). Throws RenderError on undefined.
nlohmann::ordered_json to_json(const Value& v);

// UTF-8 helpers: Python strings index by code point, our strings are UTF-8 bytes.
std::vector<uint32_t> utf8_decode(std::string_view s);
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_length(std::string_view s);

}  // namespace m3::text::jinja
