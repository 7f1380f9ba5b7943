// Structured outputs: compiles a request's output format (JSON schema, any JSON object, regex,
// choice, EBNF grammar, or the MiniMax-M3 tool-call block for tool_choice required / named)
// with the tokenizer's vocabulary into a grammar, and makes per-request TokenMatchers that name
// the token ids allowed next. Backed by xgrammar (built from its sdist, cmake/deps.cmake); without
// it every compile is refused by name. Called by the server's chat/completion handlers (HTTP
// threads); the matchers then run on the engine thread, wrapped as engine::TokenConstraint.
// Invariant: a matcher allows only token ids whose text continues a valid output; once the
// output is complete it allows only the stop (EOS) ids, and accepting one terminates it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer.h"

namespace m3::text {

struct StructuredOutputSpec {
  enum class Kind {
    kJsonSchema,
    kJsonObject,
    kRegex,
    kChoice,
    kGrammar,
    kToolCall,
    kStructuralTag
  };
  Kind kind = Kind::kJsonObject;
  // kJsonSchema: the schema's JSON text; kRegex; kGrammar: EBNF (`root ::= ...`) or Lark
  // (`start: ...`, told apart by grammar_is_lark); kStructuralTag: the JSON text of xgrammar's
  // structural-tag `format` object (structural_tag_format turns the request's forms into it).
  std::string value;
  std::vector<std::string> choices;  // kChoice: the output is exactly one of them
  // kToolCall: the request's tools ([{"type": "function", "function": {name, parameters}}]) and,
  // for a named tool_choice, that function's name (empty: any of the tools, at least one call).
  nlohmann::ordered_json tools;  // ordered: a schema's property order is the output's
  std::string tool_name;
  std::string param;  // the request field that asked for it (errors name it)
};

// Whether a grammar is written in Lark syntax (rules `name: ...`, `%import`, `//` comments)
// rather than xgrammar's EBNF (rules `name ::= ...`). vLLM takes both for its xgrammar backend.
bool grammar_is_lark(std::string_view grammar);

// The structural-tag `format` (xgrammar's JSON) of a request's structural tag, in vLLM's two
// forms: {"type": "structural_tag", "format": {...}} (the format as is), or the legacy
// {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}
// (free text until a trigger, then one of the tags whose begin starts with it, its content
// following the JSON schema). Errors name `param`.
Result<nlohmann::ordered_json> structural_tag_format(const nlohmann::ordered_json& tag,
                                                     const std::string& param);

// Where the output starts relative to the model's reasoning block (<mm:think> ... </mm:think>):
// the format applies after the reasoning, which stays free text.
enum class ReasoningPrefix {
  kNone,    // no reasoning: the format starts at the first output token
  kInside,  // the prompt opened <mm:think> (thinking_mode enabled): reasoning, </mm:think>, format
  kOptional,  // adaptive: an optional <mm:think>...</mm:think> block or a bare </mm:think> first
};

// One request's position in the grammar. Used by one thread at a time.
class TokenMatcher {
 public:
  virtual ~TokenMatcher() = default;
  // Sets bit (t % 32) of word (t / 32) for every token id t allowed next; `allowed` is all zero on
  // entry and may be shorter or longer than the vocabulary (extra ids stay disallowed).
  virtual void fill_allowed(std::span<uint32_t> allowed) = 0;
  // False when `token_id` does not continue the output (the matcher is then unchanged).
  virtual bool accept(int32_t token_id) = 0;
  virtual bool is_terminated() const = 0;
  // Steps back over the last `n` accepted tokens (speculative decoding's drafts), undoing
  // termination; `n` at most the tokens accepted so far.
  virtual void rollback(int n) = 0;
};

class CompiledStructure {
 public:
  virtual ~CompiledStructure() = default;
  virtual std::unique_ptr<TokenMatcher> make_matcher() const = 0;
};

class StructuredOutputCompiler {
 public:
  // `vocab_size`: the model's logits width (>= the tokenizer's ids; the rest are never allowed);
  // `stop_token_ids`: the EOS ids that end a complete output.
  StructuredOutputCompiler(std::shared_ptr<const Tokenizer> tokenizer, int64_t vocab_size,
                           std::vector<int32_t> stop_token_ids);
  ~StructuredOutputCompiler();

  // Whether this build has the grammar engine.
  static bool available();

  // Builds the grammar engine's view of the vocabulary (a walk over every token; the first
  // compile does it otherwise). Thread-safe.
  void warm_up() const;

  // Compiles (or finds in the cache, keyed by the spec and the prefix) the structure. Errors: an
  // invalid schema / regex / grammar / tool schema is kInvalidArgument naming spec.param; a build
  // without xgrammar gives kUnsupported.
  Result<std::shared_ptr<const CompiledStructure>> compile(const StructuredOutputSpec& spec,
                                                           ReasoningPrefix prefix) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::text
