// Parser: tokens -> AST, following jinja2 3.1's parser.py grammar (operator precedence, tests
// binding tighter than arithmetic, tuples, slices, filters, the statement tags chat templates use).
// Called by Template::parse. Invariant: nesting is bounded (kMaxParseDepth) so hostile templates
// cannot overflow the stack; every error names the line and column.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "text/jinja/ast.h"
#include "text/jinja/lexer.h"

namespace m3::text::jinja {

inline constexpr int kMaxParseDepth = 256;

Result<std::vector<NodePtr>> parse_template(std::vector<Token> tokens, const std::string& name);

}  // namespace m3::text::jinja
