// IncrementalDetokenizer: turns a stream of generated token ids into text deltas for SSE.
// Called by the server's per-request streaming loop (one instance per request / choice).
// Invariant: the concatenation of every step() result and flush() equals
// Tokenizer::decode(all ids, skip_special_tokens); a delta never ends inside a UTF-8 character
// (incomplete trailing bytes are held back, at most 3), and invalid bytes become U+FFFD exactly
// where decode() puts them. Not thread-safe; cheap to create.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "text/tokenizer.h"

namespace m3::text {

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer, bool skip_special_tokens);

  // Feed one or several ids; returns the text that became complete (possibly empty).
  std::string step(int32_t id);
  std::string step(std::span<const int32_t> ids);
  // End of stream: held-back incomplete bytes become U+FFFD (as decode() does). The detokenizer
  // can keep being used after flush (it starts from a clean byte state).
  std::string flush();

  // Bytes currently held back because they may start a multi-byte character.
  size_t pending_bytes() const { return pending_.size(); }
  int64_t tokens_seen() const { return tokens_seen_; }

 private:
  void append_id(int32_t id);

  std::shared_ptr<const Tokenizer> tok_;
  bool skip_special_;
  bool any_emitted_ = false;  // for tokenizers without a decoder (HF joins tokens with " ")
  std::string pending_;       // undecoded bytes: an incomplete UTF-8 prefix between calls
  int64_t tokens_seen_ = 0;
};

}  // namespace m3::text
