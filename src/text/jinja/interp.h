// Interp: the tree-walking interpreter behind Template::render, in two files: interpreter.cpp
// (scopes, statements, expressions, attribute access, operators) and builtins.cpp (the globals,
// str/dict/list methods, filters and tests chat templates call). Internal to src/text/jinja:
// only those two files include it. Invariant: one Interp renders one template once on one thread;
// a runtime error is a RenderError thrown by fail(), located and returned by Template::render.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja/ast.h"
#include "text/jinja/template.h"
#include "text/jinja/value.h"

namespace m3::text::jinja::detail {

[[noreturn]] inline void fail(const std::string& what) {
  throw RenderError(what);
}

// Python semantics both files use (defined in interpreter.cpp).
std::string encode(const std::vector<uint32_t>& cps, size_t b, size_t e);  // code points [b, e)
int64_t pymod(int64_t a, int64_t b);   // Python's int %: the sign of the divisor
double pyfmod(double a, double b);     // Python's float %
std::string obj_repr(const Value& v);  // jinja's object_type_repr

// ---- Scopes -------------------------------------------------------------------------------------

struct Scope {
  Scope* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent)
      for (const auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};
enum class Flow { kNormal, kBreak, kContinue };

class Interp {
 public:
  Interp(const RenderOptions& opts, const std::string& name) : opts_(opts), name_(name) {}

  std::string run(const std::vector<NodePtr>& body, const Value& vars);

 private:
  Scope* new_scope(Scope* parent);
  void tick();
  void check_size(size_t n) const;

  struct Depth {
    explicit Depth(Interp& in) : in(in) {
      if (++in.depth_ > in.opts_.max_depth)
        fail("template recursion is too deep (more than " + std::to_string(in.opts_.max_depth) +
             " nested frames)");
    }
    ~Depth() { --in.depth_; }
    Interp& in;
  };

  // ---- Statements -------------------------------------------------------------------------------

  Flow exec_body(const std::vector<NodePtr>& body, Scope& scope, std::string& out);
  void emit(std::string& out, std::string_view s);
  Flow exec(const Node& n, Scope& scope, std::string& out);
  Flow exec_inner(const Node& n, Scope& scope, std::string& out);
  void assign(const Node& target, Value v, Scope& scope);
  Flow exec_for(const Node& n, Scope& scope, std::string& out);
  Value make_macro(const Node& n, Scope& scope);

  // ---- Expressions ------------------------------------------------------------------------------

  Value eval(const Node& n, Scope& scope);
  Args eval_args(const Node& n, Scope& scope, size_t first = 1);
  Value eval_inner(const Node& n, Scope& scope);
  static std::string undefined_message(const Value& v);
  Value call_value(const Value& fn, Args& a);

  // ---- Attribute / item access (sandbox getattr then getitem, or the reverse for []) ------------

  static bool is_dict_method(std::string_view n);
  static bool is_str_method(std::string_view n);
  static bool is_list_method(std::string_view n);
  Value bound_method(const Value& obj, const std::string& name);
  Value get_attr(const Value& obj, const std::string& name);
  Value get_item(const Value& obj, const Value& key);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
  List iterate(const Value& v);

  // ---- Operators --------------------------------------------------------------------------------

  Value binary(const std::string& op, const Value& l, const Value& r);

  // Python printf-style `str % args` for the common conversions.
  std::string percent_format(const std::string& fmt, const Value& args);
  int cmp(const Value& l, const Value& r, const std::string& op);
  bool contains(const Value& container, const Value& item);
  bool compare(const std::string& op, const Value& l, const Value& r);

  // The functions from here on are defined in builtins.cpp, those above in interpreter.cpp.

  // ---- Globals ----------------------------------------------------------------------------------

  static Value make_dict_from(Args& a, const char* what);
  void install_globals(Scope& g);

  // ---- Methods ----------------------------------------------------------------------------------

  static const std::string& want_str(const Value& v, const char* what);
  static bool match_affix(const std::string& s, const Value& arg, bool prefix);
  Value str_format(const std::string& fmt, Args& a);
  Value call_method(const Value& obj, const std::string& name, Args& a);

  // ---- Filters ----------------------------------------------------------------------------------

  Value apply_filter_chain(const Node& chain, Value base, Scope& scope);
  Value attr_path(const Value& item, const Value& attribute);
  std::string sort_key_str(const Value& v, bool case_sensitive);
  List sorted(List items, bool reverse, bool case_sensitive, const Value* attribute);
  Value apply_filter(const std::string& name, Value v, Args& a);

  // ---- Tests ------------------------------------------------------------------------------------

  bool apply_test(const std::string& name, const Value& v, Args& a);

  const RenderOptions& opts_;
  const std::string& name_;
  std::deque<Scope> scopes_;  // arena: macros keep raw pointers to their defining scope
  uint64_t steps_ = 0;
  int depth_ = 0;
};

}  // namespace m3::text::jinja::detail
