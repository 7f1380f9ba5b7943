// UTF-8 helpers for the tokenizer and detokenizer: validation, lossy decoding that matches
// Rust's String::from_utf8_lossy / Python's errors="replace" (one U+FFFD per maximal invalid
// subpart), streaming-safe prefixes, and the two Unicode classes HF's added-token rules use.
// Called by tokenizer.cpp, tok_bpe.cpp and detokenizer.cpp. Invariant: every function accepts
// arbitrary bytes and never reads past the view it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace m3::text {

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool utf8_valid(std::string_view s);

// Appends `in` to `out`, replacing each maximal invalid subpart with U+FFFD. When `final` is
// false, a trailing valid-but-incomplete sequence (at most 3 bytes) is not consumed; returns
// the number of bytes of `in` consumed (== in.size() when final).
size_t utf8_append_lossy(std::string_view in, std::string& out, bool final);

// Decodes the code point at `s[i]` (s must be valid UTF-8 there); sets `len` to its byte length.
char32_t utf8_decode_at(std::string_view s, size_t i, size_t* len);
// Decodes the last code point of valid UTF-8 `s` (s non-empty).
char32_t utf8_decode_last(std::string_view s);
// Appends the UTF-8 encoding of `cp` to `out`.
void utf8_append(char32_t cp, std::string& out);

// Unicode White_Space (what Rust regex `\s` matches).
bool is_unicode_whitespace(char32_t cp);
// Rust regex `\w`: Alphabetic, Mark, Decimal_Number, Connector_Punctuation, Join_Control.
bool is_unicode_word(char32_t cp);

}  // namespace m3::text
