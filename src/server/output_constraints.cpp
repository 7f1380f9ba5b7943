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
  // vLLM's bad_words: each word as written and with a leading space (the two ways a word starts
  // in byte-level BPE), each a token sequence whose last token is banned after the others.
  std::set<std::vector<int32_t>> seqs;
  for (const auto& w : p.bad_words) {
    std::string trimmed = w;
    trimmed.erase(0, trimmed.find_first_not_of(' '));
    for (const std::string& text : {w, " " + trimmed}) {
      std::vector<int32_t> ids = assets_.tokenizer->encode(text);
      if (!ids.empty()) seqs.insert(std::move(ids));
    }
  }
  sp.bad_words.assign(seqs.begin(), seqs.end());
  if (spec) {
    M3_TRY(auto compiled, structured_->compile(*spec, prefix));
    sp.constraint = std::make_shared<StructureFactory>(std::move(compiled));
  }
  return {};
}

}  // namespace m3::server
