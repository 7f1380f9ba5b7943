// Recursive-descent Jinja parser (grammar of jinja2/parser.py).
#include "text/jinja/parser.h"

#include <cstdlib>
#include <initializer_list>

namespace m3::text::jinja {
namespace {

struct ParseFail {
  int line;
  int col;
  std::string what;
};

std::string describe(const Token& t) {
  switch (t.kind) {
    case TokenKind::kData:
      return "template data";
    case TokenKind::kVarBegin:
      return "'{{'";
    case TokenKind::kVarEnd:
      return "end of print statement '}}'";
    case TokenKind::kBlockBegin:
      return "'{%'";
    case TokenKind::kBlockEnd:
      return "end of statement block '%}'";
    case TokenKind::kEof:
      return "end of template";
    case TokenKind::kString:
      return "string literal";
    default:
      return "'" + t.text + "'";
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  std::vector<NodePtr> parse_all() {
    auto body = subparse({});
    return body;
  }

 private:
  const Token& cur() const { return toks_[pos_]; }
  const Token& look(size_t k = 1) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < toks_.size()) ++pos_;
  }
  bool is_op(const char* op) const { return cur().kind == TokenKind::kOp && cur().text == op; }
  bool is_name(const char* n) const { return cur().kind == TokenKind::kName && cur().text == n; }

  [[noreturn]] void fail(const Token& t, const std::string& what) {
    throw ParseFail{t.line, t.col, what};
  }
  [[noreturn]] void fail_here(const std::string& what) { fail(cur(), what); }

  void expect_op(const char* op) {
    if (!is_op(op)) fail_here(std::string("expected '") + op + "', got " + describe(cur()));
    next();
  }
  void expect_block_end() {
    if (cur().kind != TokenKind::kBlockEnd)
      fail_here("expected end of statement block '%}', got " + describe(cur()));
    next();
  }
  std::string expect_name() {
    if (cur().kind != TokenKind::kName) fail_here("expected a name, got " + describe(cur()));
    std::string n = cur().text;
    next();
    return n;
  }

  NodePtr make(NodeKind kind, const Token& at) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = at.line;
    n->col = at.col;
    return n;
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p(p) {
      if (++p.depth_ > kMaxParseDepth)
        p.fail_here("template nesting is too deep (more than " + std::to_string(kMaxParseDepth) +
                    " levels)");
    }
    ~DepthGuard() { --p.depth_; }
    Parser& p;
  };

  // Statements --------------------------------------------------------------------------------

  // Parses until `{% <one of end_tags>` and returns with the stream at that tag's name.
  std::vector<NodePtr> subparse(std::initializer_list<const char*> end_tags) {
    DepthGuard guard(*this);
    std::vector<NodePtr> body;
    while (true) {
      const Token& t = cur();
      switch (t.kind) {
        case TokenKind::kData: {
          auto n = make(NodeKind::kData, t);
          n->value = Value::string(t.text);
          body.push_back(std::move(n));
          next();
          break;
        }
        case TokenKind::kVarBegin: {
          next();
          auto n = make(NodeKind::kOutput, t);
          n->args.push_back(parse_tuple(false, true, {}, false));
          if (cur().kind != TokenKind::kVarEnd)
            fail_here("expected end of print statement '}}', got " + describe(cur()));
          next();
          body.push_back(std::move(n));
          break;
        }
        case TokenKind::kBlockBegin: {
          next();
          if (cur().kind == TokenKind::kName) {
            for (const char* e : end_tags)
              if (cur().text == e) return body;
          }
          body.push_back(parse_statement(end_tags));
          break;
        }
        case TokenKind::kEof: {
          if (end_tags.size() != 0) {
            std::string want;
            for (const char* e : end_tags)
              want += std::string(want.empty() ? "" : " or ") + "'" + e + "'";
            fail(t, "unexpected end of template, expected " + want +
                        " to close the block opened at line " + std::to_string(open_line_) +
                        ", column " + std::to_string(open_col_));
          }
          return body;
        }
        default:
          fail(t, "unexpected " + describe(t));
      }
    }
  }

  // Parse a body ending in one of `end_tags`; returns the tag name found (consumed).
  std::string parse_body(std::vector<NodePtr>& out, std::initializer_list<const char*> end_tags,
                         const Token& opener) {
    int saved_line = open_line_, saved_col = open_col_;
    open_line_ = opener.line;
    open_col_ = opener.col;
    out = subparse(end_tags);
    open_line_ = saved_line;
    open_col_ = saved_col;
    std::string tag = cur().text;
    next();
    return tag;
  }

  NodePtr parse_statement(std::initializer_list<const char*> enclosing) {
    const Token t = cur();
    if (t.kind != TokenKind::kName) fail(t, "tag name expected, got " + describe(t));
    const std::string& k = t.text;
    if (k == "if") return parse_if();
    if (k == "for") return parse_for();
    if (k == "set") return parse_set();
    if (k == "macro") return parse_macro();
    if (k == "call") return parse_call_block();
    if (k == "filter") return parse_filter_block();
    if (k == "with") return parse_with();
    if (k == "generation") {
      next();
      expect_block_end();
      auto n = make(NodeKind::kScope, t);
      parse_body(n->body, {"endgeneration"}, t);
      expect_block_end();
      return n;
    }
    if (k == "break" || k == "continue") {
      if (loop_depth_ == 0) fail(t, "'" + k + "' outside of a for loop");
      next();
      expect_block_end();
      return make(k == "break" ? NodeKind::kBreak : NodeKind::kContinue, t);
    }
    std::string msg = "unknown or unsupported tag '" + k + "'";
    if (enclosing.size() != 0) {
      std::string want;
      for (const char* e : enclosing)
        want += std::string(want.empty() ? "" : " or ") + "'" + e + "'";
      msg += " (the innermost open block expects " + want + ")";
    }
    fail(t, msg);
  }

  NodePtr parse_if() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kIf, t);
    n->args.push_back(parse_tuple(false, false, {}, false));
    expect_block_end();
    std::string tag = parse_body(n->body, {"elif", "else", "endif"}, t);
    if (tag == "elif") {
      --pos_;  // re-read `elif` as a nested if
      n->orelse.push_back(parse_if());
      return n;
    }
    if (tag == "else") {
      expect_block_end();
      parse_body(n->orelse, {"endif"}, t);
    }
    expect_block_end();
    return n;
  }

  NodePtr parse_for() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kFor, t);
    n->args.push_back(parse_assign_target(true, {"in"}));
    if (!is_name("in")) fail_here("expected 'in' in for loop, got " + describe(cur()));
    next();
    n->args.push_back(parse_tuple(false, false, {"recursive"}, false));
    if (is_name("if")) {
      next();
      n->args.push_back(parse_expression(true));
    } else {
      n->args.push_back(nullptr);
    }
    if (is_name("recursive")) fail_here("recursive for loops are not supported");
    expect_block_end();
    ++loop_depth_;
    std::string tag = parse_body(n->body, {"endfor", "else"}, t);
    --loop_depth_;
    if (tag == "else") {
      expect_block_end();
      parse_body(n->orelse, {"endfor"}, t);
    }
    expect_block_end();
    return n;
  }

  NodePtr parse_set() {
    const Token t = cur();
    next();
    NodePtr target;
    if (cur().kind == TokenKind::kName && look().kind == TokenKind::kOp && look().text == ".") {
      const Token nt = cur();
      auto base = make(NodeKind::kName, nt);
      base->name = cur().text;
      next();
      next();
      target = make(NodeKind::kAttr, nt);
      target->name = expect_name();
      target->args.push_back(std::move(base));
    } else {
      target = parse_assign_target(true, {});
    }
    if (is_op("=")) {
      next();
      auto n = make(NodeKind::kSet, t);
      n->args.push_back(std::move(target));
      n->args.push_back(parse_tuple(false, true, {}, false));
      expect_block_end();
      return n;
    }
    auto n = make(NodeKind::kSetBlock, t);
    n->args.push_back(std::move(target));
    n->args.push_back(parse_filter(nullptr, false));
    expect_block_end();
    parse_body(n->body, {"endset"}, t);
    expect_block_end();
    return n;
  }

  NodePtr parse_macro() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kMacro, t);
    n->name = expect_name();
    parse_signature(*n);
    expect_block_end();
    int saved = loop_depth_;
    loop_depth_ = 0;  // break/continue cannot cross a macro boundary
    parse_body(n->body, {"endmacro"}, t);
    loop_depth_ = saved;
    expect_block_end();
    return n;
  }

  void parse_signature(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (!n.kwargs.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string arg = expect_name();
      NodePtr def;
      if (is_op("=")) {
        next();
        def = parse_expression(true);
      }
      n.kwargs.emplace_back(std::move(arg), std::move(def));
    }
    next();
  }

  NodePtr parse_call_block() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kCallBlock, t);
    if (is_op("(")) parse_signature(*n);
    NodePtr call = parse_expression(true);
    if (call->kind != NodeKind::kCall) fail(t, "expected a call expression after {% call %}");
    n->args.push_back(std::move(call));
    expect_block_end();
    parse_body(n->body, {"endcall"}, t);
    expect_block_end();
    return n;
  }

  NodePtr parse_filter_block() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kFilterBlock, t);
    n->args.push_back(parse_filter(nullptr, true));
    expect_block_end();
    parse_body(n->body, {"endfilter"}, t);
    expect_block_end();
    return n;
  }

  NodePtr parse_with() {
    const Token t = cur();
    next();
    auto n = make(NodeKind::kWith, t);
    while (cur().kind != TokenKind::kBlockEnd) {
      if (!n->kwargs.empty()) expect_op(",");
      std::string name = expect_name();
      expect_op("=");
      n->kwargs.emplace_back(std::move(name), parse_expression(true));
    }
    expect_block_end();
    parse_body(n->body, {"endwith"}, t);
    expect_block_end();
    return n;
  }

  NodePtr parse_assign_target(bool with_tuple, std::initializer_list<const char*> extra_end) {
    const Token t = cur();
    NodePtr target = with_tuple ? parse_tuple(true, true, extra_end, false) : parse_primary();
    auto assignable = [](const Node& n) { return n.kind == NodeKind::kName; };
    bool ok = assignable(*target);
    if (target->kind == NodeKind::kTuple) {
      ok = true;
      for (const auto& a : target->args) ok = ok && assignable(*a);
    }
    if (!ok) fail(t, "cannot assign to this expression (expected a name or a tuple of names)");
    if (target->kind == NodeKind::kName &&
        (target->name == "true" || target->name == "false" || target->name == "none"))
      fail(t, "cannot assign to '" + target->name + "'");
    return target;
  }

  // Expressions -------------------------------------------------------------------------------

  bool tuple_end(std::initializer_list<const char*> extra_end) const {
    const Token& t = cur();
    if (t.kind == TokenKind::kVarEnd || t.kind == TokenKind::kBlockEnd || t.kind == TokenKind::kEof)
      return true;
    if (t.kind == TokenKind::kOp && t.text == ")") return true;
    if (t.kind == TokenKind::kName)
      for (const char* e : extra_end)
        if (t.text == e) return true;
    return false;
  }

  NodePtr parse_tuple(bool simplified, bool with_condexpr,
                      std::initializer_list<const char*> extra_end, bool explicit_parens) {
    const Token t = cur();
    std::vector<NodePtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is_op(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail_here("expected an expression, got " + describe(cur()));
    }
    auto n = make(NodeKind::kTuple, t);
    n->args = std::move(items);
    return n;
  }

  NodePtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  NodePtr parse_condexpr() {
    NodePtr expr1 = parse_or();
    while (is_name("if")) {
      const Token t = cur();
      next();
      NodePtr expr2 = parse_or();
      NodePtr expr3;
      if (is_name("else")) {
        next();
        expr3 = parse_condexpr();
      }
      auto n = make(NodeKind::kCond, t);
      n->args.push_back(std::move(expr2));
      n->args.push_back(std::move(expr1));
      n->args.push_back(std::move(expr3));
      expr1 = std::move(n);
    }
    return expr1;
  }

  NodePtr parse_or() {
    NodePtr left = parse_and();
    while (is_name("or")) {
      const Token t = cur();
      next();
      auto n = make(NodeKind::kOr, t);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_and());
      left = std::move(n);
    }
    return left;
  }

  NodePtr parse_and() {
    NodePtr left = parse_not();
    while (is_name("and")) {
      const Token t = cur();
      next();
      auto n = make(NodeKind::kAnd, t);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_not());
      left = std::move(n);
    }
    return left;
  }

  NodePtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      const Token t = cur();
      next();
      auto n = make(NodeKind::kNot, t);
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  NodePtr parse_compare() {
    const Token t = cur();
    NodePtr first = parse_math1();
    auto n = make(NodeKind::kCompare, t);
    n->args.push_back(std::move(first));
    while (true) {
      if (cur().kind == TokenKind::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        n->ops.push_back(cur().text);
        next();
      } else if (is_name("in")) {
        n->ops.push_back("in");
        next();
      } else if (is_name("not") && look().kind == TokenKind::kName && look().text == "in") {
        n->ops.push_back("notin");
        next();
        next();
      } else {
        break;
      }
      n->args.push_back(parse_math1());
    }
    if (n->ops.empty()) return std::move(n->args[0]);
    return n;
  }

  NodePtr binary(NodePtr left, const Token& t, NodePtr right) {
    auto n = make(NodeKind::kBinary, t);
    n->name = t.text;
    n->args.push_back(std::move(left));
    n->args.push_back(std::move(right));
    return n;
  }

  NodePtr parse_math1() {
    NodePtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token t = cur();
      next();
      left = binary(std::move(left), t, parse_concat());
    }
    return left;
  }

  NodePtr parse_concat() {
    NodePtr left = parse_math2();
    while (is_op("~")) {
      const Token t = cur();
      next();
      left = binary(std::move(left), t, parse_math2());
    }
    return left;
  }

  NodePtr parse_math2() {
    NodePtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token t = cur();
      next();
      left = binary(std::move(left), t, parse_pow());
    }
    return left;
  }

  NodePtr parse_pow() {
    NodePtr left = parse_unary(true);
    while (is_op("**")) {
      const Token t = cur();
      next();
      left = binary(std::move(left), t, parse_unary(true));
    }
    return left;
  }

  NodePtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    const Token t = cur();
    NodePtr node;
    if (is_op("-") || is_op("+")) {
      next();
      node = make(t.text == "-" ? NodeKind::kNeg : NodeKind::kPos, t);
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  NodePtr parse_primary() {
    DepthGuard guard(*this);
    const Token t = cur();
    switch (t.kind) {
      case TokenKind::kName: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto n = make(NodeKind::kConst, t);
          n->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
          return n;
        }
        if (t.text == "none" || t.text == "None") {
          auto n = make(NodeKind::kConst, t);
          n->value = Value::none();
          return n;
        }
        auto n = make(NodeKind::kName, t);
        n->name = t.text;
        return n;
      }
      case TokenKind::kString: {
        std::string s;
        while (cur().kind == TokenKind::kString) {
          s += cur().text;
          next();
        }
        auto n = make(NodeKind::kConst, t);
        n->value = Value::string(std::move(s));
        return n;
      }
      case TokenKind::kInt: {
        next();
        auto n = make(NodeKind::kConst, t);
        errno = 0;
        int base = 10;
        std::string digits = t.text;
        if (digits.size() > 1 && digits[0] == '0') {
          char b = static_cast<char>(digits[1] | 0x20);
          base = b == 'x' ? 16 : b == 'o' ? 8 : b == 'b' ? 2 : 10;
          if (base != 10) digits = digits.substr(2);
        }
        char* end = nullptr;
        long long v = std::strtoll(digits.c_str(), &end, base);
        if (errno == ERANGE) fail(t, "integer literal too large");
        n->value = Value::integer(v);
        return n;
      }
      case TokenKind::kFloat: {
        next();
        auto n = make(NodeKind::kConst, t);
        n->value = Value::number(std::strtod(t.text.c_str(), nullptr));
        return n;
      }
      case TokenKind::kOp: {
        if (t.text == "(") {
          next();
          NodePtr n = parse_tuple(false, true, {}, true);
          expect_op(")");
          return n;
        }
        if (t.text == "[") {
          next();
          auto n = make(NodeKind::kList, t);
          while (!is_op("]")) {
            if (!n->args.empty()) expect_op(",");
            if (is_op("]")) break;
            n->args.push_back(parse_expression(true));
          }
          next();
          return n;
        }
        if (t.text == "{") {
          next();
          auto n = make(NodeKind::kDict, t);
          while (!is_op("}")) {
            if (!n->args.empty()) expect_op(",");
            if (is_op("}")) break;
            n->args.push_back(parse_expression(true));
            expect_op(":");
            n->args.push_back(parse_expression(true));
          }
          next();
          return n;
        }
        break;
      }
      default:
        break;
    }
    fail(t, "unexpected " + describe(t) + ", expected an expression");
  }

  NodePtr parse_postfix(NodePtr node) {
    while (true) {
      const Token t = cur();
      if (is_op(".")) {
        next();
        if (cur().kind == TokenKind::kName) {
          auto n = make(NodeKind::kAttr, t);
          n->name = cur().text;
          next();
          n->args.push_back(std::move(node));
          node = std::move(n);
        } else if (cur().kind == TokenKind::kInt) {
          auto n = make(NodeKind::kItem, t);
          n->args.push_back(std::move(node));
          n->args.push_back(parse_primary());
          node = std::move(n);
        } else {
          fail_here("expected an attribute name after '.', got " + describe(cur()));
        }
      } else if (is_op("[")) {
        next();
        std::vector<NodePtr> subs;
        while (!is_op("]")) {
          if (!subs.empty()) expect_op(",");
          subs.push_back(parse_subscribed());
        }
        next();
        if (subs.empty()) fail(t, "expected a subscript inside '[]'");
        NodePtr key;
        if (subs.size() == 1) {
          key = std::move(subs[0]);
        } else {
          key = make(NodeKind::kTuple, t);
          key->args = std::move(subs);
        }
        if (key->kind == NodeKind::kSlice) {
          key->args.insert(key->args.begin(), std::move(node));
          node = std::move(key);
        } else {
          auto n = make(NodeKind::kItem, t);
          n->args.push_back(std::move(node));
          n->args.push_back(std::move(key));
          node = std::move(n);
        }
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  NodePtr parse_subscribed() {
    const Token t = cur();
    std::vector<NodePtr> parts;
    if (is_op(":")) {
      next();
      parts.push_back(nullptr);
    } else {
      NodePtr n = parse_expression(true);
      if (!is_op(":")) return n;
      next();
      parts.push_back(std::move(n));
    }
    if (is_op(":")) {
      parts.push_back(nullptr);
    } else if (!is_op("]") && !is_op(",")) {
      parts.push_back(parse_expression(true));
    } else {
      parts.push_back(nullptr);
    }
    if (is_op(":")) {
      next();
      if (!is_op("]") && !is_op(","))
        parts.push_back(parse_expression(true));
      else
        parts.push_back(nullptr);
    } else {
      parts.push_back(nullptr);
    }
    auto s = make(NodeKind::kSlice, t);
    s->args = std::move(parts);  // [start, stop, step]; the object is inserted first by the caller
    return s;
  }

  void parse_call_args(Node& n) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail_here("*args / **kwargs in calls are not supported");
      if (cur().kind == TokenKind::kName && look().kind == TokenKind::kOp && look().text == "=") {
        std::string key = cur().text;
        next();
        next();
        n.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!n.kwargs.empty()) fail_here("positional argument after keyword argument");
        n.args.push_back(parse_expression(true));
      }
    }
    next();
  }

  NodePtr parse_call(NodePtr callee) {
    auto n = make(NodeKind::kCall, cur());
    n->line = callee->line;  // report errors at the callee, e.g. raise_exception(...)
    n->col = callee->col;
    n->args.push_back(std::move(callee));
    parse_call_args(*n);
    return n;
  }

  NodePtr parse_filter(NodePtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      const Token t = cur();
      auto n = make(NodeKind::kFilter, t);
      n->name = expect_name();
      while (is_op(".")) {
        next();
        n->name += "." + expect_name();
      }
      n->args.push_back(std::move(node));
      if (is_op("(")) parse_call_args(*n);
      node = std::move(n);
    }
    return node;
  }

  NodePtr parse_test(NodePtr node) {
    const Token t = cur();
    next();  // 'is'
    auto n = make(NodeKind::kTest, t);
    if (is_name("not")) {
      next();
      n->negated = true;
    }
    n->name = expect_name();
    while (is_op(".")) {
      next();
      n->name += "." + expect_name();
    }
    n->args.push_back(std::move(node));
    const Token& c = cur();
    bool arg_start = c.kind == TokenKind::kName || c.kind == TokenKind::kString ||
                     c.kind == TokenKind::kInt || c.kind == TokenKind::kFloat ||
                     (c.kind == TokenKind::kOp && (c.text == "[" || c.text == "{"));
    if (is_op("(")) {
      parse_call_args(*n);
    } else if (arg_start && !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail_here("you cannot chain multiple tests with 'is'");
      NodePtr arg = parse_postfix(parse_primary());
      n->args.push_back(std::move(arg));
    }
    return n;
  }

  NodePtr parse_filter_expr(NodePtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node), false);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  int open_line_ = 0;
  int open_col_ = 0;
};

}  // namespace

Result<std::vector<NodePtr>> parse_template(std::vector<Token> tokens, const std::string& name) {
  Parser parser(std::move(tokens));
  try {
    return parser.parse_all();
  } catch (const ParseFail& f) {
    return make_error(ErrorCode::kFormat, located_message(name, f.line, f.col, f.what));
  }
}

}  // namespace m3::text::jinja
