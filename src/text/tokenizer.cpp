// Encode pipeline (mirrors HF tokenizers 0.23 TokenizerImpl::encode_single_sequence):
//   1. invalid UTF-8 -> U+FFFD (documented in tokenizer.h)
//   2. split out added tokens whose `normalized` is false (leftmost-longest, then the
//      single_word / lstrip / rstrip rules of AddedVocabulary::find_matches)
//   3. normalize each remaining piece, then split out added tokens whose `normalized` is true
//   4. pre-tokenizer steps on each remaining piece, 5. BPE on each pre-token.
#include "text/tokenizer.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include <utf8proc.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/log.h"
#include "text/tok_bpe.h"
#include "text/tok_regex.h"
#include "text/tok_utf8.h"

namespace m3::text {
namespace {

using json = nlohmann::json;

enum class NormKind { kNFC, kNFD, kNFKC, kNFKD };
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  std::unique_ptr<TokRegex> re;  // Split pattern, or the GPT-2 regex for ByteLevel(use_regex)
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;
  bool use_regex = false;
};

// Byte trie over added-token patterns for leftmost-longest matching (what HF builds with
// daachorse MatchKind::LeftmostLongest).
class AddedTrie {
 public:
  void insert(std::string_view pattern, int32_t id) {
    if (pattern.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    int32_t cur = 0;
    for (unsigned char c : pattern) {
      int32_t nxt = child(cur, c);
      if (nxt < 0) {
        nxt = static_cast<int32_t>(nodes_.size());
        nodes_[cur].kids.emplace_back(c, nxt);
        nodes_.emplace_back();
      }
      cur = nxt;
    }
    nodes_[cur].id = id;
    first_[static_cast<unsigned char>(pattern[0])] = true;
  }
  bool empty() const { return nodes_.empty(); }
  // Longest pattern starting at s[pos]: returns its length (0 if none) and sets *id.
  size_t longest_at(std::string_view s, size_t pos, int32_t* id) const {
    if (!first_[static_cast<unsigned char>(s[pos])]) return 0;
    int32_t cur = 0;
    size_t best = 0;
    for (size_t i = pos; i < s.size(); ++i) {
      cur = child(cur, static_cast<unsigned char>(s[i]));
      if (cur < 0) break;
      if (nodes_[cur].id >= 0) {
        best = i + 1 - pos;
        *id = nodes_[cur].id;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> kids;
    int32_t id = -1;
  };
  int32_t child(int32_t n, unsigned char c) const {
    for (const auto& [k, v] : nodes_[n].kids) {
      if (k == c) return v;
    }
    return -1;
  }
  std::vector<Node> nodes_;
  std::array<bool, 256> first_{};
};

Error format_error(std::string msg, std::string param = {}) {
  return Error{ErrorCode::kFormat, "tokenizer.json: " + std::move(msg), std::move(param)};
}
Error unsupported(std::string what, std::string supported, std::string param) {
  return Error{ErrorCode::kUnsupported,
               "tokenizer.json: " + what + " is not supported (supported: " + supported +
                   "); use a tokenizer.json without it or extend src/text/tokenizer.cpp",
               std::move(param)};
}

}  // namespace

struct Tokenizer::Impl {
  std::vector<NormKind> normalizers;
  std::vector<PreStep> pre_steps;
  bool byte_level = false;  // the pre-tokenizer ends with ByteLevel: BPE sees raw bytes
  std::unique_ptr<BpeModel> model;

  std::vector<AddedTokenInfo> added;                // by id order
  std::unordered_map<int32_t, size_t> added_by_id;  // id -> index in `added`
  StringMap<int32_t> added_by_content;
  AddedTrie raw_trie, norm_trie;

  bool decoder_byte_level = false;
  std::vector<std::string> decoded;   // per id
  std::vector<uint8_t> present;       // per id: 1 if the id maps to a token
  std::vector<uint8_t> skip_special;  // per id
  int32_t vocab_size = 0;

  bool pp_supported = true;
  std::string pp_error;
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> pp_wraps;  // prefix/suffix

  // --- normalization -------------------------------------------------------------------
  std::string_view normalize(std::string_view s, std::string& buf) const {
    if (normalizers.empty() || s.empty()) return s;
    std::string_view cur = s;
    std::string tmp;
    for (NormKind k : normalizers) {
      uint8_t limit = 0x80;  // every byte below this is a code point the form leaves alone
      if (k == NormKind::kNFC)
        limit = 0xCC;  // < U+0300: no combining marks
      else if (k == NormKind::kNFD)
        limit = 0xC3;  // < U+00C0: no canonical decompositions
      bool trivial = true;
      for (unsigned char c : cur) {
        if (c >= limit) {
          trivial = false;
          break;
        }
      }
      if (trivial) continue;
      int opts = UTF8PROC_STABLE;
      if (k == NormKind::kNFC || k == NormKind::kNFKC)
        opts |= UTF8PROC_COMPOSE;
      else
        opts |= UTF8PROC_DECOMPOSE;
      if (k == NormKind::kNFKC || k == NormKind::kNFKD) opts |= UTF8PROC_COMPAT;
      utf8proc_uint8_t* dst = nullptr;
      const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                                              static_cast<utf8proc_ssize_t>(cur.size()), &dst,
                                              static_cast<utf8proc_option_t>(opts));
      if (n < 0) {  // cannot happen on valid UTF-8; keep the text unnormalized
        std::free(dst);
        continue;
      }
      tmp.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
      std::free(dst);
      buf.swap(tmp);
      cur = buf;
    }
    return cur;
  }

  // --- added tokens (AddedVocabulary::find_matches) ---------------------------------------
  template <class F>
  void split_added(std::string_view s, const AddedTrie& trie, F&& emit) const {
    if (s.empty()) return;
    if (trie.empty()) {
      emit(s, -1);
      return;
    }
    size_t start_offset = 0;
    size_t pos = 0;
    while (pos < s.size()) {
      int32_t id = -1;
      const size_t len = trie.longest_at(s, pos, &id);
      if (len == 0) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + len;
      pos = stop;  // the trie iterator resumes after the raw match
      const AddedTokenInfo& tok = added[added_by_id.at(id)];
      if (tok.single_word) {
        const bool start_space =
            start == 0 || !is_unicode_word(utf8_decode_last(s.substr(0, start)));
        size_t l = 0;
        const bool stop_space = stop == s.size() || !is_unicode_word(utf8_decode_at(s, stop, &l));
        if (!start_space || !stop_space) continue;
      }
      if (tok.lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t b = ns - 1;
          while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
          size_t l = 0;
          if (!is_unicode_whitespace(utf8_decode_at(s, b, &l))) break;
          ns = b;
        }
        start = std::max(ns, start_offset);
      }
      if (tok.rstrip) {
        while (stop < s.size()) {
          size_t l = 0;
          if (!is_unicode_whitespace(utf8_decode_at(s, stop, &l))) break;
          stop += l;
        }
      }
      if (start_offset < start) emit(s.substr(start_offset, start - start_offset), -1);
      emit(s.substr(start, stop - start), id);
      start_offset = stop;
    }
    if (start_offset < s.size()) emit(s.substr(start_offset), -1);
  }

  // --- pre-tokenizer + model ----------------------------------------------------------------
  void pre_tokenize(size_t step_idx, std::string_view piece, std::vector<int32_t>& out) const {
    if (piece.empty()) return;
    if (step_idx == pre_steps.size()) {
      model->tokenize(piece, out);
      return;
    }
    const PreStep& step = pre_steps[step_idx];
    std::vector<std::pair<size_t, size_t>> matches;
    if (step.kind == PreStep::Kind::kByteLevel) {
      std::string buf;
      std::string_view p = piece;
      if (step.add_prefix_space && p[0] != ' ') {
        buf.reserve(p.size() + 1);
        buf.push_back(' ');
        buf.append(p);
        p = buf;
      }
      if (!step.use_regex) {
        pre_tokenize(step_idx + 1, p, out);
        return;
      }
      step.re->find_all(p, matches);
      emit_split(step_idx, p, matches, SplitBehavior::kIsolated, false, out);
      return;
    }
    step.re->find_all(piece, matches);
    emit_split(step_idx, piece, matches, step.behavior, step.invert, out);
  }

  // NormalizedString::split with Pattern::find_matches semantics, then recurse per piece.
  void emit_split(size_t step_idx, std::string_view p,
                  const std::vector<std::pair<size_t, size_t>>& matches, SplitBehavior behavior,
                  bool invert, std::vector<int32_t>& out) const {
    struct Seg {
      size_t a, b;
      bool is_match;
    };
    std::vector<Seg> segs;
    segs.reserve(matches.size() * 2 + 1);
    size_t prev = 0;
    for (const auto& [a, b] : matches) {
      if (prev != a) segs.push_back({prev, a, false});
      segs.push_back({a, b, true});
      prev = b;
    }
    if (prev != p.size()) segs.push_back({prev, p.size(), false});
    if (invert) {
      for (Seg& s : segs) s.is_match = !s.is_match;
    }
    struct Out {
      size_t a, b;
      bool remove;
    };
    std::vector<Out> res;
    res.reserve(segs.size());
    switch (behavior) {
      case SplitBehavior::kIsolated:
        for (const Seg& s : segs) res.push_back({s.a, s.b, false});
        break;
      case SplitBehavior::kRemoved:
        for (const Seg& s : segs) res.push_back({s.a, s.b, s.is_match});
        break;
      case SplitBehavior::kContiguous: {
        bool previous_match = false;
        for (const Seg& s : segs) {
          if (s.is_match == previous_match && !res.empty()) {
            res.back().b = s.b;
          } else {
            res.push_back({s.a, s.b, false});
          }
          previous_match = s.is_match;
        }
        break;
      }
      case SplitBehavior::kMergedWithPrevious: {
        bool previous_match = false;
        for (const Seg& s : segs) {
          if (s.is_match && !previous_match && !res.empty()) {
            res.back().b = s.b;
          } else {
            res.push_back({s.a, s.b, false});
          }
          previous_match = s.is_match;
        }
        break;
      }
      case SplitBehavior::kMergedWithNext: {
        bool previous_match = false;
        for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
          if (it->is_match && !previous_match && !res.empty()) {
            res.back().a = it->a;
          } else {
            res.push_back({it->a, it->b, false});
          }
          previous_match = it->is_match;
        }
        std::reverse(res.begin(), res.end());
        break;
      }
    }
    for (const Out& o : res) {
      if (!o.remove && o.b > o.a) pre_tokenize(step_idx + 1, p.substr(o.a, o.b - o.a), out);
    }
  }

  void encode_into(std::string_view text, std::vector<int32_t>& out) const {
    split_added(text, raw_trie, [&](std::string_view piece, int32_t id) {
      if (id >= 0) {
        out.push_back(id);
        return;
      }
      std::string norm_buf;
      const std::string_view norm = normalize(piece, norm_buf);
      split_added(norm, norm_trie, [&](std::string_view p2, int32_t id2) {
        if (id2 >= 0) {
          out.push_back(id2);
        } else {
          pre_tokenize(0, p2, out);
        }
      });
    });
  }

  // --- loading ------------------------------------------------------------------------------
  Status parse_normalizer(const json& j) {
    if (j.is_null()) return {};
    const std::string type = j.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const json& n : j.at("normalizers")) M3_TRY_STATUS(parse_normalizer(n));
      return {};
    }
    if (type == "NFC")
      normalizers.push_back(NormKind::kNFC);
    else if (type == "NFD")
      normalizers.push_back(NormKind::kNFD);
    else if (type == "NFKC")
      normalizers.push_back(NormKind::kNFKC);
    else if (type == "NFKD")
      normalizers.push_back(NormKind::kNFKD);
    else
      return tl::unexpected(unsupported("normalizer type '" + type + "'",
                                        "NFC, NFD, NFKC, NFKD, Sequence", "normalizer"));
    return {};
  }

  Status parse_pre_tokenizer(const json& j) {
    if (j.is_null()) return {};
    const std::string type = j.at("type").get<std::string>();
    if (!pre_steps.empty() && pre_steps.back().kind == PreStep::Kind::kByteLevel) {
      return tl::unexpected(unsupported("a pre-tokenizer after ByteLevel ('" + type + "')",
                                        "ByteLevel as the last step", "pre_tokenizer"));
    }
    if (type == "Sequence") {
      for (const json& p : j.at("pretokenizers")) M3_TRY_STATUS(parse_pre_tokenizer(p));
      return {};
    }
    PreStep step;
    if (type == "Split") {
      const json& pat = j.at("pattern");
      std::unique_ptr<TokRegex> re;
      if (pat.contains("Regex")) {
        M3_TRY(re, TokRegex::compile(pat["Regex"].get<std::string>(), false));
      } else if (pat.contains("String")) {
        M3_TRY(re, TokRegex::compile(pat["String"].get<std::string>(), true));
      } else {
        return tl::unexpected(
            format_error("Split pattern is neither {\"Regex\"} nor {\"String\"}", "pre_tokenizer"));
      }
      step.re = std::move(re);
      const std::string b = j.value("behavior", std::string("Isolated"));
      if (b == "Removed")
        step.behavior = SplitBehavior::kRemoved;
      else if (b == "Isolated")
        step.behavior = SplitBehavior::kIsolated;
      else if (b == "MergedWithPrevious")
        step.behavior = SplitBehavior::kMergedWithPrevious;
      else if (b == "MergedWithNext")
        step.behavior = SplitBehavior::kMergedWithNext;
      else if (b == "Contiguous")
        step.behavior = SplitBehavior::kContiguous;
      else
        return tl::unexpected(format_error("unknown Split behavior '" + b + "'", "pre_tokenizer"));
      step.invert = j.value("invert", false);
    } else if (type == "ByteLevel") {
      step.kind = PreStep::Kind::kByteLevel;
      step.add_prefix_space = j.value("add_prefix_space", true);
      step.use_regex = j.value("use_regex", true);
      if (step.use_regex) {
        std::unique_ptr<TokRegex> re;
        M3_TRY(re, TokRegex::compile(kGpt2Regex, false));
        step.re = std::move(re);
      }
      byte_level = true;
    } else {
      return tl::unexpected(unsupported("pre_tokenizer type '" + type + "'",
                                        "Split, ByteLevel, Sequence", "pre_tokenizer"));
    }
    pre_steps.push_back(std::move(step));
    return {};
  }

  Status parse_post_processor(const json& j) {
    if (j.is_null()) return {};
    const std::string type = j.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const json& p : j.at("processors")) M3_TRY_STATUS(parse_post_processor(p));
      return {};
    }
    if (type == "ByteLevel") return {};
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      pp_wraps.push_back({{j.at("cls").at(1).get<int32_t>()}, {j.at("sep").at(1).get<int32_t>()}});
      return {};
    }
    if (type == "TemplateProcessing") {
      std::vector<int32_t> pre, suf;
      bool seen_a = false;
      for (const json& item : j.at("single")) {
        if (item.contains("Sequence")) {
          if (seen_a) {
            pp_supported = false;
            pp_error = "TemplateProcessing with the sequence twice";
            return {};
          }
          seen_a = true;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        const json& st = j.at("special_tokens");
        if (!st.contains(name)) {
          return tl::unexpected(format_error("TemplateProcessing uses special token '" + name +
                                                 "' missing from its special_tokens",
                                             "post_processor"));
        }
        for (const json& id : st[name].at("ids")) (seen_a ? suf : pre).push_back(id.get<int32_t>());
      }
      pp_wraps.push_back({std::move(pre), std::move(suf)});
      return {};
    }
    pp_supported = false;
    pp_error = "post_processor type '" + type + "'";
    return {};
  }

  Status parse_added_tokens(const json& arr) {
    // HF AddedVocabulary::add_tokens: ids come from the vocab when the content is known,
    // otherwise the next id after max(vocab size, largest added id).
    const size_t model_size = model->vocab_entries();
    std::map<int32_t, AddedTokenInfo> by_id;
    std::set<std::string> special_set;
    int64_t next_id = static_cast<int64_t>(model_size);
    std::unordered_map<std::string, std::string> normalized_form;
    for (const json& t : arr) {
      AddedTokenInfo tok;
      tok.content = t.at("content").get<std::string>();
      tok.special = t.value("special", false);
      tok.lstrip = t.value("lstrip", false);
      tok.rstrip = t.value("rstrip", false);
      tok.single_word = t.value("single_word", false);
      tok.normalized = t.value("normalized", !tok.special);
      if (tok.content.empty()) continue;
      if (!utf8_valid(tok.content)) {
        return tl::unexpected(
            format_error("added token content is not valid UTF-8", "added_tokens"));
      }
      auto known = added_by_content.find(tok.content);
      if (known != added_by_content.end()) {
        const AddedTokenInfo& old = by_id[known->second];
        if (old.special == tok.special && old.lstrip == tok.lstrip && old.rstrip == tok.rstrip &&
            old.single_word == tok.single_word && old.normalized == tok.normalized) {
          continue;
        }
      }
      int32_t id;
      if (known != added_by_content.end()) {
        id = known->second;
      } else if (auto mid = model->token_to_id(tok.content)) {
        id = *mid;
      } else {
        id = static_cast<int32_t>(next_id++);
      }
      const int32_t json_id = t.at("id").get<int32_t>();
      if (json_id != id) {
        M3_LOG_WARN(
            "tokenizer.json: added token '%s' has id %d in the file but HF assigns %d; "
            "using %d",
            tok.content.c_str(), json_id, id, id);
      }
      tok.id = id;
      added_by_content[tok.content] = id;
      if (tok.special) special_set.insert(tok.content);
      by_id[id] = tok;
    }
    for (auto& [id, tok] : by_id) {
      std::string pattern = tok.content;
      if (tok.normalized && !normalizers.empty()) {
        std::string buf;
        pattern = std::string(normalize(tok.content, buf));
        if (pattern != tok.content) normalized_form[tok.content] = pattern;
      }
      (tok.normalized ? norm_trie : raw_trie).insert(pattern, id);
      added_by_id[id] = added.size();
      added.push_back(tok);
    }
    // Decode strings and skip flags for every id.
    vocab_size = model->max_id() + 1;
    for (const auto& tok : added) vocab_size = std::max(vocab_size, tok.id + 1);
    decoded.assign(vocab_size, std::string());
    present.assign(vocab_size, 0);
    skip_special.assign(vocab_size, 0);
    for (int32_t id = 0; id < vocab_size; ++id) {
      std::string s;
      auto a = added_by_id.find(id);
      if (a != added_by_id.end()) {
        const AddedTokenInfo& tok = added[a->second];
        auto nf = normalized_form.find(tok.content);
        s = nf != normalized_form.end() ? nf->second : tok.content;
      } else if (const std::string* m = model->id_to_token(id)) {
        s = *m;
      } else {
        continue;
      }
      present[id] = 1;
      skip_special[id] = special_set.count(s) ? 1 : 0;
      decoded[id] = decoder_byte_level ? byte_level_decode(s) : s;
    }
    return {};
  }

  // HF ByteLevel decoder on one token: map every char back to its byte, or, if any char is not
  // a byte-level char, keep the token's own UTF-8 bytes.
  static std::string byte_level_decode(const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
      size_t len = 0;
      const int b = unicode_to_byte(utf8_decode_at(s, i, &len));
      if (b < 0) return s;
      out.push_back(static_cast<char>(b));
      i += len;
    }
    return out;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

Result<std::shared_ptr<const Tokenizer>> Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return make_error(ErrorCode::kNotFound,
                      "tokenizer file '" + path +
                          "' cannot be opened; check the model directory "
                          "contains tokenizer.json",
                      "tokenizer");
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  auto r = from_json_text(ss.str());
  if (!r) r.error().message += " (file: " + path + ")";
  return r;
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::from_json_text(std::string_view json_text) {
  auto impl = std::make_unique<Impl>();
  try {
    const json j = json::parse(json_text);
    if (!j.is_object()) return tl::unexpected(format_error("top level is not a JSON object"));
    M3_TRY_STATUS(impl->parse_normalizer(j.value("normalizer", json())));
    M3_TRY_STATUS(impl->parse_pre_tokenizer(j.value("pre_tokenizer", json())));
    const json& model = j.at("model");
    const std::string mtype = model.value("type", std::string("BPE"));
    if (mtype != "BPE") {
      return tl::unexpected(unsupported("model type '" + mtype + "'", "BPE", "model"));
    }
    std::unique_ptr<BpeModel> bpe;
    M3_TRY(bpe, BpeModel::from_json(model, impl->byte_level));
    impl->model = std::move(bpe);
    const json decoder = j.value("decoder", json());
    if (!decoder.is_null()) {
      const std::string dtype = decoder.at("type").get<std::string>();
      if (dtype != "ByteLevel") {
        return tl::unexpected(unsupported("decoder type '" + dtype + "'", "ByteLevel", "decoder"));
      }
      impl->decoder_byte_level = true;
    }
    M3_TRY_STATUS(impl->parse_post_processor(j.value("post_processor", json())));
    M3_TRY_STATUS(impl->parse_added_tokens(j.value("added_tokens", json::array())));
  } catch (const json::exception& e) {
    return tl::unexpected(format_error(std::string("malformed JSON: ") + e.what()));
  }
  return std::shared_ptr<const Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  if (text.empty()) return out;
  out.reserve(text.size() / 3 + 4);
  if (utf8_valid(text)) {
    impl_->encode_into(text, out);
  } else {
    std::string clean;
    utf8_append_lossy(text, clean, /*final=*/true);
    impl_->encode_into(clean, out);
  }
  return out;
}

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text,
                                               bool add_special_tokens) const {
  std::vector<int32_t> ids = encode(text);
  if (!add_special_tokens) return ids;
  if (!impl_->pp_supported) {
    return tl::unexpected(unsupported(impl_->pp_error,
                                      "null, ByteLevel, TemplateProcessing, RobertaProcessing, "
                                      "BertProcessing, Sequence",
                                      "post_processor"));
  }
  for (const auto& [pre, suf] : impl_->pp_wraps) {
    std::vector<int32_t> w;
    w.reserve(pre.size() + ids.size() + suf.size());
    w.insert(w.end(), pre.begin(), pre.end());
    w.insert(w.end(), ids.begin(), ids.end());
    w.insert(w.end(), suf.begin(), suf.end());
    ids.swap(w);
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::string bytes;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= m.vocab_size || !m.present[id]) continue;
    if (skip_special_tokens && m.skip_special[id]) continue;
    if (!m.decoder_byte_level && !first) bytes.push_back(' ');
    bytes += m.decoded[id];
    first = false;
  }
  if (utf8_valid(bytes)) return bytes;
  std::string out;
  utf8_append_lossy(bytes, out, /*final=*/true);
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  auto a = impl_->added_by_id.find(id);
  if (a != impl_->added_by_id.end()) return impl_->added[a->second].content;
  const std::string* s = impl_->model->id_to_token(id);
  return s ? *s : std::string();
}

bool Tokenizer::is_special(int32_t id) const {
  auto a = impl_->added_by_id.find(id);
  return a != impl_->added_by_id.end() && impl_->added[a->second].special;
}

bool Tokenizer::contains_id(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && impl_->present[id];
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}

const std::vector<AddedTokenInfo>& Tokenizer::added_tokens() const {
  return impl_->added;
}

std::string_view Tokenizer::decoded_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size) return {};
  return impl_->decoded[id];
}

bool Tokenizer::skipped_when_skipping_special(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && impl_->skip_special[id];
}

bool Tokenizer::decoder_joins_with_space() const {
  return !impl_->decoder_byte_level;
}

}  // namespace m3::text
