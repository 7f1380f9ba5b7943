// AST of a parsed Jinja template: one generic Node type for expressions and statements.
// Built by the parser, walked read-only by the interpreter (a parsed Template is shared by every
// concurrent render). Invariant: each node records the line/column where its source starts.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja/value.h"

namespace m3::text::jinja {

enum class NodeKind {
  // Expressions.
  kConst,    // value
  kName,     // name
  kAttr,     // args[0].name
  kItem,     // args[0][args[1]]
  kSlice,    // args[0][args[1]:args[2]:args[3]] (missing parts are null)
  kCall,     // args[0](args[1..], kwargs)
  kFilter,   // args[0] | name(args[1..], kwargs); args[0] null in filter blocks / set blocks
  kTest,     // args[0] is [not] name(args[1..], kwargs); `negated`
  kNeg,      // -args[0]
  kPos,      // +args[0]
  kNot,      // not args[0]
  kBinary,   // args[0] <name> args[1] for + - * / // % ** ~
  kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ... (Python chained comparison)
  kAnd,
  kOr,
  kCond,   // args[1] if args[0] else args[2] (args[2] may be null)
  kList,   // [args...]
  kTuple,  // (args...)
  kDict,   // {args[0]: args[1], args[2]: args[3], ...}
  // Statements.
  kData,         // value (literal text)
  kOutput,       // {{ args[0] }}
  kIf,           // if args[0]: body else orelse (elif = nested kIf in orelse)
  kFor,          // for args[0] in args[1] [if args[2]]: body else orelse
  kSet,          // set args[0] = args[1]
  kSetBlock,     // set args[0] [| args[1] filter chain] body endset
  kMacro,        // macro name(params) body
  kCallBlock,    // call(params) args[0] body endcall
  kFilterBlock,  // filter args[0] body endfilter
  kWith,         // with params(name = expr) body endwith
  kBreak,
  kContinue,
  kScope,  // {% generation %} body: rendered as is (transformers' AssistantTracker tag)
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

struct Node {
  NodeKind kind;
  int line = 0;
  int col = 0;
  std::string name;
  Value value;
  std::vector<NodePtr> args;
  std::vector<std::string> ops;                         // kCompare operators
  std::vector<std::pair<std::string, NodePtr>> kwargs;  // call kwargs, macro/with params
  std::vector<NodePtr> body;
  std::vector<NodePtr> orelse;
  bool negated = false;
};

}  // namespace m3::text::jinja
