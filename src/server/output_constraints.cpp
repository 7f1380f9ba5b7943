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
  bool can_rollback() const override { return true; }
  void rollback(int n) override { m_->rollback(n); }

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

// thinking_token_budget: counts the tokens inside the reasoning block (after <mm:think>, or
// from the first token when the prompt opened it) and, once `budget` of them were drawn, allows
// only </mm:think>; otherwise it defers to the inner constraint (a grammar that starts after the
// reasoning block accepts that closer), or allows everything.
class ThinkingBudget final : public engine::TokenConstraint {
 public:
  ThinkingBudget(std::unique_ptr<engine::TokenConstraint> inner, int32_t start_id, int32_t end_id,
                 int32_t budget, bool inside)
      : inner_(std::move(inner)),
        start_id_(start_id),
        end_id_(end_id),
        budget_(budget),
        state_(inside ? State::kInside : State::kBefore) {}
  void fill_allowed(std::span<uint32_t> allowed) override {
    if (state_ == State::kInside && count_ >= budget_) {
      allowed[static_cast<size_t>(end_id_) / 32] |= 1u << (end_id_ % 32);
      return;
    }
    if (inner_) return inner_->fill_allowed(allowed);
    std::fill(allowed.begin(), allowed.end(), ~0u);
  }
  // The budget's state moves only with a token the inner constraint takes (a refused token
  // leaves both unchanged); each accepted token's state before it is kept for rollback().
  bool accept(int32_t token_id) override {
    if (inner_ && !inner_->accept(token_id)) return false;
    undo_.push_back({state_, count_});
    if (undo_.size() > kUndo) undo_.erase(undo_.begin());
    if (state_ == State::kBefore && token_id == start_id_) {
      state_ = State::kInside;
    } else if (state_ == State::kInside) {
      if (token_id == end_id_)
        state_ = State::kAfter;
      else
        ++count_;
    }
    return true;
  }
  bool is_terminated() const override { return inner_ && inner_->is_terminated(); }
  bool can_rollback() const override { return !inner_ || inner_->can_rollback(); }
  void rollback(int n) override {
    M3_CHECK(n >= 0 && static_cast<size_t>(n) <= undo_.size(),
             "thinking budget: rollback of %d tokens, %zu kept", n, undo_.size());
    if (n == 0) return;
    const Snapshot s = undo_[undo_.size() - static_cast<size_t>(n)];
    undo_.resize(undo_.size() - static_cast<size_t>(n));
    state_ = s.state;
    count_ = s.count;
    if (inner_) inner_->rollback(n);
  }

 private:
  enum class State { kBefore, kInside, kAfter };
  struct Snapshot {
    State state;
    int32_t count;
  };
  // Enough for a verify step's drafts and its bonus token (engine::kMaxSpeculativeTokens + 1).
  static constexpr size_t kUndo = 16;
  std::unique_ptr<engine::TokenConstraint> inner_;
  int32_t start_id_, end_id_, budget_;
  State state_;
  int32_t count_ = 0;
  std::vector<Snapshot> undo_;
};

class ThinkingBudgetFactory final : public engine::TokenConstraintFactory {
 public:
  ThinkingBudgetFactory(std::shared_ptr<const engine::TokenConstraintFactory> inner,
                        int32_t start_id, int32_t end_id, int32_t budget, bool inside)
      : inner_(std::move(inner)),
        start_id_(start_id),
        end_id_(end_id),
        budget_(budget),
        inside_(inside) {}
  std::unique_ptr<engine::TokenConstraint> make() const override {
    return std::make_unique<ThinkingBudget>(inner_ ? inner_->make() : nullptr, start_id_, end_id_,
                                            budget_, inside_);
  }

 private:
  std::shared_ptr<const engine::TokenConstraintFactory> inner_;
  int32_t start_id_, end_id_, budget_;
  bool inside_;
};

}  // namespace

Status HttpServerImpl::apply_thinking_budget(engine::SamplingParams& sp, int32_t budget,
                                             text::ThinkingMode mode) const {
  if (mode == text::ThinkingMode::kDisabled) return {};  // no reasoning block to bound
  const auto start = assets_.tokenizer->token_to_id(text::ReasoningParser::kThinkStart);
  const auto end = assets_.tokenizer->token_to_id(text::ReasoningParser::kThinkEnd);
  if (!start || !end) {
    return make_error(ErrorCode::kUnsupported,
                      "'thinking_token_budget' needs the tokenizer's <mm:think> and </mm:think> "
                      "tokens, which this model's tokenizer lacks; leave it out",
                      "thinking_token_budget");
  }
  sp.constraint = std::make_shared<ThinkingBudgetFactory>(sp.constraint, *start, *end, budget,
                                                          mode == text::ThinkingMode::kEnabled);
  return {};
}

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
