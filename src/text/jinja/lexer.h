// Lexer: Jinja source -> tokens, with jinja2's whitespace rules as transformers configures them
// (trim_blocks, lstrip_blocks, keep_trailing_newline=False, `-`/`+` controls, {% raw %}).
// Called by the parser only. Invariant: newlines in the source are normalised to "\n" first (as
// jinja2 does), and every token carries the 1-based line and column where it starts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace m3::text::jinja {

enum class TokenKind {
  kData,        // literal template text (already whitespace-processed)
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,  // text holds the unescaped value
  kInt,     // text holds the digits without '_' (base prefix kept)
  kFloat,
  kOp,
  kEof,
};

struct Token {
  TokenKind kind;
  std::string text;
  int line = 1;
  int col = 1;
};

// Errors carry "line L, column C" of the offending character; `name` prefixes the message.
Result<std::vector<Token>> tokenize(std::string_view source, const std::string& name);

// "<name>: line L, column C: <what>" -- the one format every template error uses.
std::string located_message(const std::string& name, int line, int col, const std::string& what);

}  // namespace m3::text::jinja
