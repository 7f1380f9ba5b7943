// Tree-walking interpreter for Template::render: scopes, statements, expressions, attribute and
// item access, and operators, with jinja2 / Python semantics. The globals, methods, filters and
// tests templates call are in builtins.cpp; interp.h declares the class both files define.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "text/jinja/interp.h"
#include "text/jinja/lexer.h"
#include "text/jinja/template.h"

namespace m3::text::jinja::detail {
namespace {

int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// Python slice semantics -> list of indices.
std::vector<int64_t> slice_indices(int64_t len, const Value& start, const Value& stop,
                                   const Value& step) {
  auto as_index = [](const Value& v, const char* what) -> int64_t {
    if (v.is_int() || v.is_bool()) return v.as_int();
    fail(std::string("slice ") + what + " must be an integer or None, not " + type_name(v));
  };
  int64_t st = (step.is_none() || step.is_undefined()) ? 1 : as_index(step, "step");
  if (st == 0) fail("slice step cannot be zero");
  int64_t lo, hi;
  if (st > 0) {
    lo = 0;
    hi = len;
  } else {
    lo = -1;
    hi = len - 1;
  }
  auto norm = [&](const Value& v, int64_t dflt) -> int64_t {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t x = as_index(v, "index");
    if (x < 0) {
      x += len;
      if (x < lo) x = lo;
    } else if (x > hi) {
      x = hi;
    }
    return x;
  };
  int64_t b = norm(start, st > 0 ? lo : hi);
  int64_t e = norm(stop, st > 0 ? hi : lo);
  std::vector<int64_t> idx;
  if (st > 0)
    for (int64_t i = b; i < e; i += st) idx.push_back(i);
  else
    for (int64_t i = b; i > e; i += st) idx.push_back(i);
  return idx;
}

}  // namespace

std::string encode(const std::vector<uint32_t>& cps, size_t b, size_t e) {
  std::string out;
  for (size_t i = b; i < e; ++i) utf8_append(out, cps[i]);
  return out;
}

int64_t pymod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}
double pyfmod(double a, double b) {
  double m = std::fmod(a, b);
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

std::string obj_repr(const Value& v) {  // jinja's object_type_repr
  if (v.is_none()) return "None";
  return type_name(v) + " object";
}

std::string Interp::run(const std::vector<NodePtr>& body, const Value& vars) {
  Scope* globals = new_scope(nullptr);
  install_globals(*globals);
  Scope* root = new_scope(globals);
  if (vars.is_mapping()) {
    for (const auto& [k, v] : vars.entries().entries) {
      if (!k.is_string()) fail("template variable names must be strings");
      root->set(k.as_string(), v);
    }
  }
  std::string out;
  exec_body(body, *root, out);
  return out;
}

Scope* Interp::new_scope(Scope* parent) {
  scopes_.emplace_back();
  scopes_.back().parent = parent;
  return &scopes_.back();
}

void Interp::tick() {
  if (++steps_ > opts_.max_steps)
    fail("template exceeded its evaluation budget (" + std::to_string(opts_.max_steps) +
         " steps); it loops too long for a chat template");
}

void Interp::check_size(size_t n) const {
  if (n > opts_.max_output_bytes)
    fail("template output exceeds the limit of " + std::to_string(opts_.max_output_bytes) +
         " bytes");
}

// ---- Statements ---------------------------------------------------------------------------------
Flow Interp::exec_body(const std::vector<NodePtr>& body, Scope& scope, std::string& out) {
  for (const auto& n : body) {
    Flow f = exec(*n, scope, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

void Interp::emit(std::string& out, std::string_view s) {
  out.append(s);
  check_size(out.size());
}

Flow Interp::exec(const Node& n, Scope& scope, std::string& out) {
  Depth d(*this);
  tick();
  try {
    return exec_inner(n, scope, out);
  } catch (RenderError& e) {
    if (e.line == 0) {
      e.line = n.line;
      e.col = n.col;
    }
    throw;
  }
}

Flow Interp::exec_inner(const Node& n, Scope& scope, std::string& out) {
  switch (n.kind) {
    case NodeKind::kData:
      emit(out, n.value.as_string());
      return Flow::kNormal;
    case NodeKind::kOutput: {
      Value v = eval(*n.args[0], scope);
      emit(out, to_str(v));
      return Flow::kNormal;
    }
    case NodeKind::kIf:
      if (truthy(eval(*n.args[0], scope))) return exec_body(n.body, scope, out);
      return exec_body(n.orelse, scope, out);
    case NodeKind::kFor:
      return exec_for(n, scope, out);
    case NodeKind::kSet:
      assign(*n.args[0], eval(*n.args[1], scope), scope);
      return Flow::kNormal;
    case NodeKind::kSetBlock: {
      std::string captured;
      Scope* inner = new_scope(&scope);
      exec_body(n.body, *inner, captured);
      Value v = Value::string(std::move(captured));
      if (n.args[1]) v = apply_filter_chain(*n.args[1], std::move(v), scope);
      assign(*n.args[0], std::move(v), scope);
      return Flow::kNormal;
    }
    case NodeKind::kMacro:
      scope.set(n.name, make_macro(n, scope));
      return Flow::kNormal;
    case NodeKind::kCallBlock: {
      const Node& call = *n.args[0];
      Value caller = make_macro(n, scope);
      Value fn = eval(*call.args[0], scope);
      Args args = eval_args(call, scope);
      args.kw.emplace_back("caller", caller);
      emit(out, to_str(call_value(fn, args)));
      return Flow::kNormal;
    }
    case NodeKind::kFilterBlock: {
      std::string captured;
      Scope* inner = new_scope(&scope);
      exec_body(n.body, *inner, captured);
      emit(out, to_str(apply_filter_chain(*n.args[0], Value::string(std::move(captured)), scope)));
      return Flow::kNormal;
    }
    case NodeKind::kWith: {
      Scope* inner = new_scope(&scope);
      for (const auto& [name, expr] : n.kwargs) inner->set(name, eval(*expr, scope));
      return exec_body(n.body, *inner, out);
    }
    case NodeKind::kScope: {
      Scope* inner = new_scope(&scope);
      return exec_body(n.body, *inner, out);
    }
    case NodeKind::kBreak:
      return Flow::kBreak;
    case NodeKind::kContinue:
      return Flow::kContinue;
    default: {
      Value v = eval(n, scope);
      emit(out, to_str(v));
      return Flow::kNormal;
    }
  }
}

void Interp::assign(const Node& target, Value v, Scope& scope) {
  if (target.kind == NodeKind::kName) {
    scope.set(target.name, std::move(v));
  } else if (target.kind == NodeKind::kTuple) {
    List items = iterate(v);
    if (items.size() != target.args.size()) {
      if (items.size() > target.args.size())
        fail("too many values to unpack (expected " + std::to_string(target.args.size()) + ")");
      fail("not enough values to unpack (expected " + std::to_string(target.args.size()) +
           ", got " + std::to_string(items.size()) + ")");
    }
    for (size_t i = 0; i < items.size(); ++i) assign(*target.args[i], items[i], scope);
  } else if (target.kind == NodeKind::kAttr) {
    const Value* ns = scope.find(target.args[0]->name);
    if (!ns || ns->kind() != Value::Kind::kNamespace)
      fail("cannot assign attribute on non-namespace object '" + target.args[0]->name + "'");
    if (!target.name.empty() && target.name[0] == '_')
      fail("chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
           target.name + "'");
    ns->entries().set(Value::string(target.name), std::move(v));
  } else {
    fail("cannot assign to this expression");
  }
}

Flow Interp::exec_for(const Node& n, Scope& scope, std::string& out) {
  Value seq = eval(*n.args[1], scope);
  List items = iterate(seq);
  if (n.args[2]) {  // `for x in y if cond`: filter before loop.* is computed
    List kept;
    for (const auto& item : items) {
      tick();
      Scope* probe = new_scope(&scope);
      assign(*n.args[0], item, *probe);
      if (truthy(eval(*n.args[2], *probe))) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    Scope* inner = new_scope(&scope);
    return exec_body(n.orelse, *inner, out);
  }
  const int64_t len = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < len; ++i) {
    tick();
    Scope* iter = new_scope(&scope);
    Value loop = Value::dict();
    Dict& d = loop.entries();
    auto put = [&](const char* k, Value v) {
      d.entries.emplace_back(Value::string(k), std::move(v));
    };
    put("index", Value::integer(i + 1));
    put("index0", Value::integer(i));
    put("revindex", Value::integer(len - i));
    put("revindex0", Value::integer(len - i - 1));
    put("first", Value::boolean(i == 0));
    put("last", Value::boolean(i == len - 1));
    put("length", Value::integer(len));
    put("depth", Value::integer(1));
    put("depth0", Value::integer(0));
    if (i > 0) put("previtem", items[static_cast<size_t>(i - 1)]);
    if (i + 1 < len) put("nextitem", items[static_cast<size_t>(i + 1)]);
    put("cycle", Value::callable("cycle", [i](Args& a) -> Value {
          if (a.pos.empty()) fail("no items for cycling given");
          return a.pos[static_cast<size_t>(i) % a.pos.size()];
        }));
    iter->set("loop", std::move(loop));
    assign(*n.args[0], items[static_cast<size_t>(i)], *iter);
    Flow f = exec_body(n.body, *iter, out);
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

Value Interp::make_macro(const Node& n, Scope& scope) {
  const Node* node = &n;
  Scope* defining = &scope;
  std::string name = n.kind == NodeKind::kMacro ? n.name : "caller";
  return Value::callable(name, [this, node, defining, name](Args& a) -> Value {
    Depth d(*this);
    Scope* s = new_scope(defining);
    const auto& params = node->kwargs;
    if (a.pos.size() > params.size())
      fail("macro '" + name + "' takes not more than " + std::to_string(params.size()) +
           " argument(s)");
    for (size_t i = 0; i < a.pos.size(); ++i) s->set(params[i].first, a.pos[i]);
    for (const auto& [k, v] : a.kw) {
      bool known = k == "caller";
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].first == k) {
          if (i < a.pos.size())
            fail("macro '" + name + "' got multiple values for argument '" + k + "'");
          known = true;
        }
      }
      if (!known) fail("macro '" + name + "' takes no keyword argument '" + k + "'");
      s->set(k, v);
    }
    for (size_t i = a.pos.size(); i < params.size(); ++i) {
      bool given = false;
      for (const auto& kv : a.kw) given = given || kv.first == params[i].first;
      if (given) continue;
      if (params[i].second)
        s->set(params[i].first, eval(*params[i].second, *s));
      else
        s->set(params[i].first,
               Value::undefined("parameter '" + params[i].first + "' was not provided"));
    }
    std::string out;
    exec_body(node->body, *s, out);
    return Value::string(std::move(out));
  });
}

// ---- Expressions --------------------------------------------------------------------------------
Value Interp::eval(const Node& n, Scope& scope) {
  Depth d(*this);
  tick();
  try {
    return eval_inner(n, scope);
  } catch (RenderError& e) {
    if (e.line == 0) {
      e.line = n.line;
      e.col = n.col;
    }
    throw;
  }
}

Args Interp::eval_args(const Node& n, Scope& scope, size_t first) {
  Args a;
  for (size_t i = first; i < n.args.size(); ++i) a.pos.push_back(eval(*n.args[i], scope));
  for (const auto& [k, e] : n.kwargs) a.kw.emplace_back(k, eval(*e, scope));
  return a;
}

Value Interp::eval_inner(const Node& n, Scope& scope) {
  switch (n.kind) {
    case NodeKind::kConst:
      return n.value;
    case NodeKind::kName: {
      const Value* v = scope.find(n.name);
      if (!v) return Value::undefined("'" + n.name + "' is undefined");
      return *v;
    }
    case NodeKind::kAttr:
      return get_attr(eval(*n.args[0], scope), n.name);
    case NodeKind::kItem:
      return get_item(eval(*n.args[0], scope), eval(*n.args[1], scope));
    case NodeKind::kSlice: {
      Value obj = eval(*n.args[0], scope);
      Value parts[3];
      for (int i = 0; i < 3; ++i)
        parts[i] = n.args[i + 1] ? eval(*n.args[i + 1], scope) : Value::none();
      return slice(obj, parts[0], parts[1], parts[2]);
    }
    case NodeKind::kCall: {
      Value fn = eval(*n.args[0], scope);
      Args a = eval_args(n, scope);
      return call_value(fn, a);
    }
    case NodeKind::kFilter: {
      Value base = n.args[0] ? eval(*n.args[0], scope) : Value();
      Args a = eval_args(n, scope);
      return apply_filter(n.name, std::move(base), a);
    }
    case NodeKind::kTest: {
      Value base = eval(*n.args[0], scope);
      Args a = eval_args(n, scope);
      bool r = apply_test(n.name, base, a);
      return Value::boolean(n.negated ? !r : r);
    }
    case NodeKind::kNeg:
    case NodeKind::kPos: {
      Value v = eval(*n.args[0], scope);
      if (v.is_undefined()) fail(undefined_message(v));
      if (!v.is_number())
        fail("bad operand type for unary " + std::string(n.kind == NodeKind::kNeg ? "-" : "+") +
             ": '" + type_name(v) + "'");
      if (n.kind == NodeKind::kPos) return v.is_bool() ? Value::integer(v.as_int()) : v;
      if (v.is_float()) return Value::number(-v.as_double());
      if (v.as_int() == INT64_MIN) fail("integer overflow");
      return Value::integer(-v.as_int());
    }
    case NodeKind::kNot:
      return Value::boolean(!truthy(eval(*n.args[0], scope)));
    case NodeKind::kAnd: {
      Value l = eval(*n.args[0], scope);
      if (!truthy(l)) return l;
      return eval(*n.args[1], scope);
    }
    case NodeKind::kOr: {
      Value l = eval(*n.args[0], scope);
      if (truthy(l)) return l;
      return eval(*n.args[1], scope);
    }
    case NodeKind::kCond: {
      if (truthy(eval(*n.args[0], scope))) return eval(*n.args[1], scope);
      if (n.args[2]) return eval(*n.args[2], scope);
      return Value::undefined("the inline if-expression on line " + std::to_string(n.line) +
                              " evaluated to false and no else section was defined.");
    }
    case NodeKind::kBinary: {
      Value l = eval(*n.args[0], scope);
      Value r = eval(*n.args[1], scope);
      return binary(n.name, l, r);
    }
    case NodeKind::kCompare: {
      Value left = eval(*n.args[0], scope);
      for (size_t i = 0; i < n.ops.size(); ++i) {
        Value right = eval(*n.args[i + 1], scope);
        if (!compare(n.ops[i], left, right)) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case NodeKind::kList:
    case NodeKind::kTuple: {
      List items;
      for (const auto& a : n.args) items.push_back(eval(*a, scope));
      return n.kind == NodeKind::kList ? Value::list(std::move(items))
                                       : Value::tuple(std::move(items));
    }
    case NodeKind::kDict: {
      Value d = Value::dict();
      for (size_t i = 0; i + 1 < n.args.size(); i += 2) {
        Value k = eval(*n.args[i], scope);
        if (k.is_sequence() && k.kind() == Value::Kind::kList) fail("unhashable type: 'list'");
        if (k.is_mapping()) fail("unhashable type: 'dict'");
        d.entries().set(std::move(k), eval(*n.args[i + 1], scope));
      }
      return d;
    }
    default:
      fail("statement used where an expression was expected");
  }
}

std::string Interp::undefined_message(const Value& v) {
  return v.as_string().empty() ? std::string("value is undefined") : v.as_string();
}

Value Interp::call_value(const Value& fn, Args& a) {
  if (fn.is_undefined()) fail(undefined_message(fn));
  if (!fn.is_callable()) fail("'" + type_name(fn) + "' object is not callable");
  return fn.fn().fn(a);
}

// ---- Attribute / item access (sandbox getattr then getitem, or the reverse for []) --------------
bool Interp::is_dict_method(std::string_view n) {
  return n == "get" || n == "items" || n == "keys" || n == "values" || n == "pop" ||
         n == "update" || n == "setdefault" || n == "clear" || n == "popitem" || n == "copy";
}

bool Interp::is_str_method(std::string_view n) {
  static const char* kNames[] = {
      "strip",     "lstrip",       "rstrip",       "split",     "rsplit",     "startswith",
      "endswith",  "replace",      "upper",        "lower",     "title",      "capitalize",
      "find",      "rfind",        "index",        "count",     "join",       "splitlines",
      "isdigit",   "isalpha",      "isalnum",      "isspace",   "islower",    "isupper",
      "format",    "casefold",     "swapcase",     "zfill",     "center",     "ljust",
      "rjust",     "removeprefix", "removesuffix", "partition", "rpartition", "isnumeric",
      "isdecimal", "istitle",      "encode"};
  for (const char* k : kNames)
    if (n == k) return true;
  return false;
}

bool Interp::is_list_method(std::string_view n) {
  return n == "index" || n == "count" || n == "append" || n == "extend" || n == "insert" ||
         n == "pop" || n == "remove" || n == "sort" || n == "reverse" || n == "clear" ||
         n == "copy";
}

Value Interp::bound_method(const Value& obj, const std::string& name) {
  return Value::callable(name, [this, obj, name](Args& a) { return call_method(obj, name, a); });
}

Value Interp::get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail(undefined_message(obj));
    case Value::Kind::kDict: {
      if (is_dict_method(name)) return bound_method(obj, name);
      if (const Value* v = obj.entries().find(name)) return *v;
      break;
    }
    case Value::Kind::kNamespace: {
      if (const Value* v = obj.entries().find(name)) return *v;
      break;
    }
    case Value::Kind::kString:
      if (is_str_method(name)) return bound_method(obj, name);
      break;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (is_list_method(name)) return bound_method(obj, name);
      break;
    default:
      break;
  }
  return Value::undefined("'" + obj_repr(obj) + "' has no attribute '" + name + "'");
}

Value Interp::get_item(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail(undefined_message(obj));
    case Value::Kind::kDict:
      if (const Value* v = obj.entries().find(key)) return *v;
      break;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (obj.is_generator()) break;
      if (key.is_int() || key.is_bool()) {
        int64_t i = key.as_int();
        int64_t len = static_cast<int64_t>(obj.items().size());
        if (i < 0) i += len;
        if (i >= 0 && i < len) return obj.items()[static_cast<size_t>(i)];
        return Value::undefined("'" + obj_repr(obj) + "' has no element " + to_repr(key));
      }
      break;
    case Value::Kind::kString:
      if (key.is_int() || key.is_bool()) {
        auto cps = utf8_decode(obj.as_string());
        int64_t i = key.as_int();
        int64_t len = static_cast<int64_t>(cps.size());
        if (i < 0) i += len;
        if (i >= 0 && i < len)
          return Value::string(encode(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
        return Value::undefined("'" + obj_repr(obj) + "' has no element " + to_repr(key));
      }
      break;
    default:
      break;
  }
  if (key.is_string()) return get_attr(obj, key.as_string());
  return Value::undefined("'" + obj_repr(obj) + "' has no element " + to_repr(key));
}

Value Interp::slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail(undefined_message(obj));
  if (obj.is_string()) {
    auto cps = utf8_decode(obj.as_string());
    std::string out;
    for (int64_t i : slice_indices(static_cast<int64_t>(cps.size()), start, stop, step))
      utf8_append(out, cps[static_cast<size_t>(i)]);
    return Value::string(std::move(out));
  }
  if (obj.is_sequence() && !obj.is_generator()) {
    List out;
    const List& items = obj.items();
    for (int64_t i : slice_indices(static_cast<int64_t>(items.size()), start, stop, step))
      out.push_back(items[static_cast<size_t>(i)]);
    return obj.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out))
                                             : Value::list(std::move(out));
  }
  // jinja compiles slices to a plain Python subscript (no sandbox getitem fallback).
  if (obj.is_mapping()) fail("unhashable type: 'slice'");
  fail("'" + type_name(obj) + "' object is not subscriptable");
}

List Interp::iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return v.items();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, val] : v.entries().entries) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (uint32_t cp : utf8_decode(v.as_string())) {
        std::string s;
        utf8_append(s, cp);
        chars.push_back(Value::string(std::move(s)));
      }
      return chars;
    }
    default:
      fail("'" + type_name(v) + "' object is not iterable");
  }
}

// ---- Operators ----------------------------------------------------------------------------------
Value Interp::binary(const std::string& op, const Value& l, const Value& r) {
  if (op == "~") {
    std::string s = to_str(l);
    s += to_str(r);
    check_size(s.size());
    return Value::string(std::move(s));
  }
  if (op == "%" && l.is_string()) return Value::string(percent_format(l.as_string(), r));
  if (l.is_undefined()) fail(undefined_message(l));
  if (r.is_undefined()) fail(undefined_message(r));
  auto type_err = [&]() -> Value {
    fail("unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" + type_name(r) +
         "'");
  };
  const bool nums = l.is_number() && r.is_number();
  const bool ints = nums && !l.is_float() && !r.is_float();
  if (op == "+") {
    if (ints) {
      int64_t x;
      if (__builtin_add_overflow(l.as_int(), r.as_int(), &x)) fail("integer overflow");
      return Value::integer(x);
    }
    if (nums) return Value::number(l.as_double() + r.as_double());
    if (l.is_string() && r.is_string()) {
      check_size(l.as_string().size() + r.as_string().size());
      return Value::string(l.as_string() + r.as_string());
    }
    if (l.is_sequence() && l.kind() == r.kind()) {
      List items = l.items();
      check_size(items.size() + r.items().size());
      items.insert(items.end(), r.items().begin(), r.items().end());
      return l.kind() == Value::Kind::kTuple ? Value::tuple(std::move(items))
                                             : Value::list(std::move(items));
    }
    if (l.is_string()) fail("can only concatenate str (not \"" + type_name(r) + "\") to str");
    return type_err();
  }
  if (op == "-") {
    if (ints) {
      int64_t x;
      if (__builtin_sub_overflow(l.as_int(), r.as_int(), &x)) fail("integer overflow");
      return Value::integer(x);
    }
    if (nums) return Value::number(l.as_double() - r.as_double());
    return type_err();
  }
  if (op == "*") {
    if (ints) {
      int64_t x;
      if (__builtin_mul_overflow(l.as_int(), r.as_int(), &x)) fail("integer overflow");
      return Value::integer(x);
    }
    if (nums) return Value::number(l.as_double() * r.as_double());
    const Value* seq = nullptr;
    const Value* cnt = nullptr;
    if ((l.is_string() || l.is_sequence()) && (r.is_int() || r.is_bool())) {
      seq = &l;
      cnt = &r;
    } else if ((r.is_string() || r.is_sequence()) && (l.is_int() || l.is_bool())) {
      seq = &r;
      cnt = &l;
    }
    if (!seq) return type_err();
    int64_t k = std::max<int64_t>(cnt->as_int(), 0);
    if (seq->is_string()) {
      if (k > 0 && seq->as_string().size() > opts_.max_output_bytes / static_cast<uint64_t>(k))
        check_size(SIZE_MAX);
      std::string s;
      for (int64_t i = 0; i < k; ++i) s += seq->as_string();
      return Value::string(std::move(s));
    }
    if (k > 0 && seq->items().size() > opts_.max_output_bytes / static_cast<uint64_t>(k))
      check_size(SIZE_MAX);
    List items;
    for (int64_t i = 0; i < k; ++i)
      items.insert(items.end(), seq->items().begin(), seq->items().end());
    return seq->kind() == Value::Kind::kTuple ? Value::tuple(std::move(items))
                                              : Value::list(std::move(items));
  }
  if (op == "/") {
    if (!nums) return type_err();
    if (r.as_double() == 0) fail("division by zero");
    return Value::number(l.as_double() / r.as_double());
  }
  if (op == "//") {
    if (!nums) return type_err();
    if (r.as_double() == 0) fail("integer division or modulo by zero");
    if (ints) {
      if (l.as_int() == INT64_MIN && r.as_int() == -1) fail("integer overflow");
      return Value::integer(floordiv(l.as_int(), r.as_int()));
    }
    return Value::number(std::floor(l.as_double() / r.as_double()));
  }
  if (op == "%") {
    if (l.is_string()) return Value::string(percent_format(l.as_string(), r));
    if (!nums) return type_err();
    if (r.as_double() == 0) fail("integer division or modulo by zero");
    if (ints) {
      if (r.as_int() == -1) return Value::integer(0);
      return Value::integer(pymod(l.as_int(), r.as_int()));
    }
    return Value::number(pyfmod(l.as_double(), r.as_double()));
  }
  if (op == "**") {
    if (!nums) return type_err();
    if (ints && r.as_int() >= 0) {
      int64_t base = l.as_int(), e = r.as_int(), acc = 1;
      while (e > 0) {
        if (e & 1)
          if (__builtin_mul_overflow(acc, base, &acc)) fail("integer overflow");
        e >>= 1;
        if (e > 0 && __builtin_mul_overflow(base, base, &base)) fail("integer overflow");
      }
      return Value::integer(acc);
    }
    if (l.as_double() == 0 && r.as_double() < 0) fail("0.0 cannot be raised to a negative power");
    return Value::number(std::pow(l.as_double(), r.as_double()));
  }
  fail("unknown operator " + op);
}

// Python printf-style `str % args` for the common conversions.
std::string Interp::percent_format(const std::string& fmt, const Value& args) {
  List vals = args.kind() == Value::Kind::kTuple ? args.items() : List{args};
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) fail("incomplete format");
    if (fmt[i] == '%') {
      out += '%';
      continue;
    }
    std::string spec = "%";
    while (i < fmt.size() && std::strchr("-+ #0123456789.", fmt[i])) spec += fmt[i++];
    if (i >= fmt.size()) fail("incomplete format");
    char conv = fmt[i];
    if (next >= vals.size()) fail("not enough arguments for format string");
    const Value& v = vals[next++];
    char buf[512];
    if (spec.size() > 32) fail("format specification too long");
    switch (conv) {
      case 's':
      case 'r': {
        // Width/precision flags on %s are ignored (no chat template uses them).
        out += conv == 's' ? to_str(v) : to_repr(v);
        break;
      }
      case 'd':
      case 'i':
      case 'x':
      case 'X':
      case 'o': {
        if (!v.is_number())
          fail("%" + std::string(1, conv) + " format: a number is required, not " + type_name(v));
        int64_t x = v.is_float() ? static_cast<int64_t>(v.as_double()) : v.as_int();
        std::string f = spec + "ll" + (conv == 'i' ? 'd' : conv);
        std::snprintf(buf, sizeof(buf), f.c_str(), static_cast<long long>(x));
        out += buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        if (!v.is_number()) fail("must be real number, not " + type_name(v));
        std::snprintf(buf, sizeof(buf), (spec + conv).c_str(), v.as_double());
        out += buf;
        break;
      }
      default:
        fail(std::string("unsupported format character '") + conv + "'");
    }
    check_size(out.size());
  }
  // Python: leftover arguments are an error, except a lone mapping/sequence argument (it may
  // serve %(name)s lookups, so CPython does not count it).
  bool lone_container = args.kind() != Value::Kind::kTuple &&
                        (args.is_mapping() || args.kind() == Value::Kind::kList);
  if (next < vals.size() && !lone_container)
    fail("not all arguments converted during string formatting");
  return out;
}

int Interp::cmp(const Value& l, const Value& r, const std::string& op) {
  if (l.is_number() && r.is_number()) {
    if (l.is_float() || r.is_float()) {
      double a = l.as_double(), b = r.as_double();
      return a < b ? -1 : a > b ? 1 : 0;
    }
    return l.as_int() < r.as_int() ? -1 : l.as_int() > r.as_int() ? 1 : 0;
  }
  if (l.is_string() && r.is_string()) {
    int c = l.as_string().compare(r.as_string());  // UTF-8 byte order == code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (l.is_sequence() && l.kind() == r.kind()) {
    const List& a = l.items();
    const List& b = r.items();
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      if (equals(a[i], b[i])) continue;
      return cmp(a[i], b[i], op);
    }
    return a.size() < b.size() ? -1 : a.size() > b.size() ? 1 : 0;
  }
  if (l.is_undefined()) fail(undefined_message(l));
  if (r.is_undefined()) fail(undefined_message(r));
  fail("'" + op + "' not supported between instances of '" + type_name(l) + "' and '" +
       type_name(r) + "'");
}

bool Interp::contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      for (const auto& e : container.items())
        if (equals(e, item)) return true;
      return false;
    case Value::Kind::kDict:
      if (item.kind() == Value::Kind::kList || item.is_mapping())
        fail("unhashable type: '" + type_name(item) + "'");
      return container.entries().find(item) != nullptr;
    default:
      fail("argument of type '" + type_name(container) + "' is not iterable");
  }
}

bool Interp::compare(const std::string& op, const Value& l, const Value& r) {
  if (op == "==") return equals(l, r);
  if (op == "!=") return !equals(l, r);
  if (op == "in") return contains(r, l);
  if (op == "notin") return !contains(r, l);
  int c = cmp(l, r, op);
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

}  // namespace m3::text::jinja::detail

namespace m3::text::jinja {

Result<std::string> Template::render(const Value& vars, const RenderOptions& options) const {
  if (!vars.is_mapping())
    return make_error(ErrorCode::kInvalidArgument,
                      name_ + ": template variables must be a mapping");
  if (!body_) return make_error(ErrorCode::kInternal, name_ + ": template was never parsed");
  detail::Interp interp(options, name_);
  try {
    return interp.run(*body_, vars);
  } catch (const RenderError& e) {
    return make_error(ErrorCode::kInvalidArgument, located_message(name_, e.line, e.col, e.what()));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kInvalidArgument, name_ + ": rendering ran out of memory");
  }
}

}  // namespace m3::text::jinja
