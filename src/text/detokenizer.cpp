#include "text/detokenizer.h"

#include <utility>

#include "core/check.h"
#include "text/tok_utf8.h"

namespace m3::text {

IncrementalDetokenizer::IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer,
                                               bool skip_special_tokens)
    : tok_(std::move(tokenizer)), skip_special_(skip_special_tokens) {
  M3_CHECK(tok_ != nullptr, "IncrementalDetokenizer needs a tokenizer");
}

void IncrementalDetokenizer::append_id(int32_t id) {
  ++tokens_seen_;
  if (!tok_->contains_id(id)) return;  // decode() skips unknown ids too
  if (skip_special_ && tok_->skipped_when_skipping_special(id)) return;
  const std::string_view bytes = tok_->decoded_bytes(id);
  if (tok_->decoder_joins_with_space() && any_emitted_) pending_.push_back(' ');
  pending_.append(bytes);
  any_emitted_ = true;
}

std::string IncrementalDetokenizer::step(int32_t id) {
  append_id(id);
  std::string out;
  const size_t used = utf8_append_lossy(pending_, out, /*final=*/false);
  pending_.erase(0, used);
  return out;
}

std::string IncrementalDetokenizer::step(std::span<const int32_t> ids) {
  for (int32_t id : ids) append_id(id);
  std::string out;
  const size_t used = utf8_append_lossy(pending_, out, /*final=*/false);
  pending_.erase(0, used);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out;
  utf8_append_lossy(pending_, out, /*final=*/true);
  pending_.clear();
  return out;
}

}  // namespace m3::text
