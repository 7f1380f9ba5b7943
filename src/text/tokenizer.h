// Tokenizer: a Hugging Face `tokenizer.json` byte-level BPE tokenizer (MiniMax-M3, Qwen3,
// GPT-2/o200k style) that gives exactly HF `tokenizers`' ids and decoded text.
// Called by the server (prompt encode, stop strings), the chat-template code and
// IncrementalDetokenizer. Invariant: immutable after load, so one shared instance is used from
// every thread; no member throws and every input (including invalid UTF-8) is accepted.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace m3::text {

struct AddedTokenInfo {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Supported tokenizer.json parts (anything else fails to load with an error naming it):
//   normalizer     null | NFC | NFD | NFKC | NFKD | Sequence of these
//   pre_tokenizer  null | Split (Regex or String pattern, every behavior, invert) |
//                  ByteLevel (add_prefix_space, use_regex; must be the last step) | Sequence
//   model          BPE (vocab, merges as "a b" or ["a","b"], unk_token, fuse_unk,
//                  byte_fallback, continuing_subword_prefix, end_of_word_suffix, ignore_merges)
//   decoder        null | ByteLevel
//   post_processor only used by encode(text, true): null | ByteLevel | TemplateProcessing |
//                  RobertaProcessing | BertProcessing | Sequence; others load but make
//                  encode(text, true) return kUnsupported.
// Added tokens follow HF AddedVocabulary exactly (ids re-derived like HF's add_tokens,
// leftmost-longest matching, single_word / lstrip / rstrip / normalized, special).
// Split regexes run on PCRE2 with the Oniguruma meanings of \s \w \h (see tok_regex.cpp).
// Invalid UTF-8 input is first replaced with U+FFFD per maximal invalid subpart (exactly
// Python's bytes.decode("utf-8", "replace")); the ids are then those HF gives for that string.
class Tokenizer {
 public:
  static Result<std::shared_ptr<const Tokenizer>> from_file(const std::string& path);
  static Result<std::shared_ptr<const Tokenizer>> from_json_text(std::string_view json_text);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // HF encode(text, add_special_tokens=False): what chat serving uses (the template already
  // contains the special tokens as text).
  std::vector<int32_t> encode(std::string_view text) const;
  // HF encode(text, add_special_tokens): with true, the post-processor's single-sequence
  // template is applied; kUnsupported if the post-processor type is not supported.
  Result<std::vector<int32_t>> encode(std::string_view text, bool add_special_tokens) const;

  // HF decode: unknown / negative ids are skipped; bytes that are not valid UTF-8 become U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string in the vocab (byte-level form for BPE tokens, content for added tokens);
  // empty when the id is unknown.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // Whether the id maps to a token (BPE vocab or added token); decode() skips the others.
  bool contains_id(int32_t id) const;
  // max id + 1 over the BPE vocab and the added tokens.
  int32_t vocab_size() const;
  const std::vector<AddedTokenInfo>& added_tokens() const;

  // What the decoder turns one id into: raw bytes, possibly a partial UTF-8 character. Empty for
  // unknown ids. decode() == lossy-UTF-8(concat of decoded_bytes of the kept ids) when
  // decoder_joins_with_space() is false (ByteLevel); with no decoder, HF joins tokens with " ".
  std::string_view decoded_bytes(int32_t id) const;
  // Whether decode(..., skip_special_tokens=true) drops this id (HF: the token string is in the
  // special-token set).
  bool skipped_when_skipping_special(int32_t id) const;
  bool decoder_joins_with_space() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::text
