// The token masks and biases of a request, on the engine's sampling path: structured outputs
// (a text::StructuredOutputCompiler grammar wrapped as engine::TokenConstraint), bad_words
// (tokenized here), logit_bias and allowed_token_ids (copied by make_sampling_params). Part of
// HttpServerImpl (server_impl.h); called by the chat and completion handlers before submission.
#include <algorithm>
#include <set>

#include "server/server_impl.h"

namespace m3::server {

namespace {

// A grammar matcher as the engine sees it: token ids in, allowed token ids out.
class MatcherConstraint final : public engine::TokenConstraint {
 public:
  explicit MatcherConstraint(std::unique_ptr<text::TokenMatcher> m) : m_(std::move(m)) {}
  void fill_allowed(std::span<uint32_t> allowed) override { m_->fill_allowed(allowed); }
  bool accept(int32_t token_id) override { return m_->accept(token_id); }
  bool is_terminated() const override { return m_->is_terminated(); }

 private:
  std::unique_ptr<text::TokenMatcher> m_;
};

class StructureFactory final : public engine::TokenConstraintFactory {
 public:
  explicit StructureFactory(std::shared_ptr<const text::CompiledStructure> s) : s_(std::move(s)) {}
  std::unique_ptr<engine::TokenConstraint> make() const override {
    return std::make_unique<MatcherConstraint>(s_->make_matcher());
  }

 private:
  std::shared_ptr<const text::CompiledStructure> s_;
};

}  // namespace

Status HttpServerImpl::apply_output_controls(engine::SamplingParams& sp, const CommonParams& p,
                                             const std::optional<text::StructuredOutputSpec>& spec,
                                             text::ReasoningPrefix prefix) const {
  // vLLM's bad_words: each word (left-trimmed) as a token sequence, and also with a leading
  // space (how a word starts mid-text in byte-level BPE) when that spelling has as many tokens
  // and a different first one. A sequence's last token is banned right after the others.
  std::set<std::vector<int32_t>> seqs;
  for (const auto& w : p.bad_words) {
    const std::string trimmed = w.substr(std::min(w.size(), w.find_first_not_of(" \t\n")));
    std::vector<int32_t> plain = assets_.tokenizer->encode(trimmed);
    std::vector<int32_t> spaced = assets_.tokenizer->encode(" " + trimmed);
    if (!plain.empty() && spaced.size() == plain.size() && spaced[0] != plain[0]) {
      seqs.insert(std::move(spaced));
    }
    if (!plain.empty()) seqs.insert(std::move(plain));
  }
  sp.bad_words.assign(seqs.begin(), seqs.end());
  if (spec) {
    M3_TRY(auto compiled, structured_->compile(*spec, prefix));
    sp.constraint = std::make_shared<StructureFactory>(std::move(compiled));
  }
  return {};
}

}  // namespace m3::server
