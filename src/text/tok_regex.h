// TokRegex: a PCRE2 (UTF + UCP + JIT) pattern that enumerates matches the way HF `tokenizers`
// does with Oniguruma (onig crate FindMatches: an empty match right after the previous match is
// skipped by advancing one character). Used by the Split and ByteLevel pre-tokenizers.
// Invariant: subjects must be valid UTF-8 (the tokenizer sanitises its input first); matching is
// thread-safe (match data is per thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace m3::text {

class TokRegex {
 public:
  // `literal` compiles the pattern as a plain string (HF Split pattern {"String": ...}).
  static Result<std::unique_ptr<TokRegex>> compile(std::string_view pattern, bool literal);
  ~TokRegex();
  TokRegex(const TokRegex&) = delete;
  TokRegex& operator=(const TokRegex&) = delete;

  // Appends the [start, end) byte ranges of all matches in `s` to `out` (cleared first).
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  TokRegex() = default;
  void* code_ = nullptr;  // pcre2_code_8*, kept opaque so pcre2.h stays out of headers
  bool jit_ = false;
  std::string pattern_;
};

}  // namespace m3::text
