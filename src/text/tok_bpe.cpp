#include "text/tok_bpe.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <queue>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "text/tok_utf8.h"

namespace m3::text {
namespace {

struct ByteTables {
  std::array<char32_t, 256> to_cp{};
  std::unordered_map<char32_t, int> to_byte;
  ByteTables() {
    // Printable Latin-1 bytes map to themselves; the rest to 256, 257, ... in byte order.
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::array<bool, 256> direct{};
    for (int b : bs) direct[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) to_cp[b] = direct[b] ? static_cast<char32_t>(b) : 256 + n++;
    for (int b = 0; b < 256; ++b) to_byte[to_cp[b]] = b;
  }
};

const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

uint64_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return k;
}

constexpr uint64_t kEmptyKey = ~0ULL;   // ids are non-negative int32, so never a real key
constexpr size_t kLinearMergeMax = 48;  // above this many symbols use the heap (O(n log n))

Error format_error(std::string msg) {
  return Error{ErrorCode::kFormat, "tokenizer.json: " + std::move(msg), "model"};
}

}  // namespace

char32_t byte_to_unicode(uint8_t b) {
  return byte_tables().to_cp[b];
}

int unicode_to_byte(char32_t cp) {
  const auto& m = byte_tables().to_byte;
  auto it = m.find(cp);
  return it == m.end() ? -1 : it->second;
}

Result<std::unique_ptr<BpeModel>> BpeModel::from_json(const nlohmann::json& model,
                                                      bool byte_level) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->byte_level_ = byte_level;
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      model["dropout"].get<double>() != 0.0) {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: model.dropout is set (random BPE merges are a training "
                      "feature); set it to null for inference",
                      "model.dropout");
  }
  auto str_or_empty = [&](const char* key) -> std::string {
    if (!model.contains(key) || model[key].is_null()) return {};
    return model[key].get<std::string>();
  };
  m->prefix_ = str_or_empty("continuing_subword_prefix");
  m->suffix_ = str_or_empty("end_of_word_suffix");
  m->ignore_merges_ = model.value("ignore_merges", false);
  m->byte_fallback_ = model.value("byte_fallback", false);
  m->fuse_unk_ = model.value("fuse_unk", false);

  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return tl::unexpected(format_error("BPE model has no \"vocab\" object"));
  }
  int32_t max_id = -1;
  for (const auto& [tok, idj] : model["vocab"].items()) {
    const int64_t id = idj.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max() / 2) {
      return tl::unexpected(format_error("vocab id " + std::to_string(id) + " of token '" + tok +
                                         "' is out of range [0, 2^30)"));
    }
    m->vocab_[tok] = static_cast<int32_t>(id);
    max_id = std::max(max_id, static_cast<int32_t>(id));
  }
  m->id_to_token_.resize(max_id + 1);
  m->id_present_.assign(max_id + 1, 0);
  for (const auto& [tok, id] : m->vocab_) {
    m->id_to_token_[id] = tok;
    m->id_present_[id] = 1;
  }

  const std::string unk = str_or_empty("unk_token");
  if (!unk.empty()) {
    auto it = m->vocab_.find(unk);
    if (it == m->vocab_.end()) {
      return tl::unexpected(format_error("model.unk_token '" + unk +
                                         "' is not in the vocab; add it or set unk_token to null"));
    }
    m->unk_id_ = it->second;
  }

  // Merges: "a b" strings or ["a", "b"] pairs; rank = position; the result token must exist.
  std::vector<PairSlot> merges;
  if (model.contains("merges") && model["merges"].is_array()) {
    const auto& mj = model["merges"];
    merges.reserve(mj.size());
    uint32_t rank = 0;
    for (const auto& e : mj) {
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          return tl::unexpected(format_error("merge #" + std::to_string(rank) + " '" + s +
                                             "' is not two tokens separated by one space"));
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        return tl::unexpected(format_error("merge #" + std::to_string(rank) +
                                           " is neither \"a b\" nor [\"a\", \"b\"]"));
      }
      auto ia = m->vocab_.find(a), ib = m->vocab_.find(b);
      if (ia == m->vocab_.end() || ib == m->vocab_.end()) {
        return tl::unexpected(format_error("merge #" + std::to_string(rank) + " uses token '" +
                                           (ia == m->vocab_.end() ? a : b) +
                                           "' that is not in the vocab"));
      }
      const std::string merged = a + b.substr(std::min(m->prefix_.size(), b.size()));
      auto in = m->vocab_.find(merged);
      if (in == m->vocab_.end()) {
        return tl::unexpected(format_error("merge #" + std::to_string(rank) + " result '" + merged +
                                           "' is not in the vocab"));
      }
      merges.push_back(PairSlot{pair_key(ia->second, ib->second), rank, in->second});
      ++rank;
    }
  }
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  m->pairs_.assign(cap, PairSlot{kEmptyKey, 0, -1});
  m->pair_mask_ = cap - 1;
  for (const PairSlot& p : merges) {
    size_t i = mix(p.key) & m->pair_mask_;
    while (m->pairs_[i].key != kEmptyKey && m->pairs_[i].key != p.key) i = (i + 1) & m->pair_mask_;
    m->pairs_[i] = p;  // a repeated pair keeps its last rank, as HF's HashMap collect does
  }

  for (int b = 0; b < 256; ++b) {
    std::string c;
    utf8_append(byte_to_unicode(static_cast<uint8_t>(b)), c);
    m->byte_char_[b] = c;
    auto it = m->vocab_.find(c);
    m->byte_id_[b] =
        (it != m->vocab_.end() && m->prefix_.empty() && m->suffix_.empty()) ? it->second : -1;
  }
  if (byte_level && m->ignore_merges_) {
    for (const auto& [tok, id] : m->vocab_) {
      std::string raw;
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        size_t len = 0;
        const int b = unicode_to_byte(utf8_decode_at(tok, i, &len));
        if (b < 0) ok = false;
        raw.push_back(static_cast<char>(b));
        i += len;
      }
      if (ok) m->raw_vocab_.emplace(std::move(raw), id);
    }
  }
  return m;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size()) || !id_present_[id]) {
    return nullptr;
  }
  return &id_to_token_[id];
}

const BpeModel::PairSlot* BpeModel::find_pair(int32_t a, int32_t b) const {
  const uint64_t key = pair_key(a, b);
  size_t i = mix(key) & pair_mask_;
  while (true) {
    const PairSlot& s = pairs_[i];
    if (s.key == key) return &s;
    if (s.key == kEmptyKey) return nullptr;
    i = (i + 1) & pair_mask_;
  }
}

// One character of the word (with prefix/suffix already applied to `key`): vocab id, else
// byte fallback, else unk (HF BPE::merge_word, including where a pending unk is flushed).
void BpeModel::add_char(const std::string& key, std::vector<int32_t>& syms,
                        bool* unk_pending) const {
  auto it = vocab_.find(key);
  if (it != vocab_.end()) {
    if (*unk_pending) {
      syms.push_back(unk_id_);
      *unk_pending = false;
    }
    syms.push_back(it->second);
    return;
  }
  if (byte_fallback_) {
    std::vector<int32_t> fb;
    bool ok = true;
    for (unsigned char c : key) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", c);
      auto f = vocab_.find(std::string_view(name));
      if (f == vocab_.end()) {
        ok = false;
        break;
      }
      fb.push_back(f->second);
    }
    if (ok) {
      syms.insert(syms.end(), fb.begin(), fb.end());
      return;
    }
  }
  if (unk_id_ >= 0) {
    if (*unk_pending && !fuse_unk_) syms.push_back(unk_id_);
    *unk_pending = true;
  }
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& syms) const {
  syms.clear();
  bool unk_pending = false;
  std::string key;
  if (byte_level_) {
    const size_t n = word.size();
    for (size_t i = 0; i < n; ++i) {
      const uint8_t b = static_cast<uint8_t>(word[i]);
      if (byte_id_[b] >= 0) {  // fast path: no prefix/suffix and the byte char is in the vocab
        if (unk_pending) {
          syms.push_back(unk_id_);
          unk_pending = false;
        }
        syms.push_back(byte_id_[b]);
        continue;
      }
      key.clear();
      if (i > 0) key += prefix_;
      key += byte_char_[b];
      if (i + 1 == n) key += suffix_;
      add_char(key, syms, &unk_pending);
    }
  } else {
    for (size_t i = 0; i < word.size();) {
      size_t len = 0;
      utf8_decode_at(word, i, &len);
      key.clear();
      if (i > 0) key += prefix_;
      key.append(word.substr(i, len));
      if (i + len == word.size()) key += suffix_;
      add_char(key, syms, &unk_pending);
      i += len;
    }
  }
  if (unk_pending) syms.push_back(unk_id_);
}

// Repeatedly merge the adjacent pair with the lowest rank, leftmost first. This is the order
// HF's heap (ordered by rank, then position) produces; merge_heap is the same for long words.
void BpeModel::merge(std::vector<int32_t>& syms) const {
  if (syms.size() < 2) return;
  if (syms.size() > kLinearMergeMax) {
    merge_heap(syms);
    return;
  }
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  uint32_t rank[kLinearMergeMax];
  int32_t merged[kLinearMergeMax];
  size_t n = syms.size();
  auto fill = [&](size_t i) {
    const PairSlot* p = find_pair(syms[i], syms[i + 1]);
    rank[i] = p ? p->rank : kNone;
    merged[i] = p ? p->new_id : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) fill(i);
  while (n > 1) {
    size_t best = 0;
    uint32_t best_rank = kNone;
    for (size_t i = 0; i + 1 < n; ++i) {
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = i;
      }
    }
    if (best_rank == kNone) break;
    syms[best] = merged[best];
    for (size_t i = best + 1; i + 1 < n; ++i) syms[i] = syms[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) {
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) fill(best - 1);
    if (best + 1 < n) fill(best);
  }
  syms.resize(n);
}

void BpeModel::merge_heap(std::vector<int32_t>& syms) const {
  const size_t n = syms.size();
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Entry {
    uint32_t rank;
    uint32_t pos;
    int32_t new_id;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (const PairSlot* p = find_pair(syms[i], syms[i + 1])) {
      queue.push(Entry{p->rank, static_cast<uint32_t>(i), p->new_id});
    }
  }
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    const size_t pos = top.pos;
    if (!alive[pos] || next[pos] < 0) continue;
    const size_t right = static_cast<size_t>(next[pos]);
    const PairSlot* cur = find_pair(syms[pos], syms[right]);
    if (cur == nullptr || cur->new_id != top.new_id) continue;  // stale entry
    syms[pos] = top.new_id;
    alive[right] = 0;
    next[pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = static_cast<int32_t>(pos);
    if (prev[pos] >= 0) {
      const size_t p = static_cast<size_t>(prev[pos]);
      if (const PairSlot* ps = find_pair(syms[p], syms[pos])) {
        queue.push(Entry{ps->rank, static_cast<uint32_t>(p), ps->new_id});
      }
    }
    if (next[pos] >= 0) {
      if (const PairSlot* ps = find_pair(syms[pos], syms[next[pos]])) {
        queue.push(Entry{ps->rank, static_cast<uint32_t>(pos), ps->new_id});
      }
    }
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i) {
    if (alive[i]) syms[w++] = syms[i];
  }
  syms.resize(w);
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const StringMap<int32_t>& v = byte_level_ ? raw_vocab_ : vocab_;
    auto it = v.find(word);
    if (it != v.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() == 1 && byte_level_ && byte_id_[static_cast<uint8_t>(word[0])] >= 0) {
    out.push_back(byte_id_[static_cast<uint8_t>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= kCacheWordMaxBytes;
  CacheShard* shard = nullptr;
  if (cacheable) {
    shard = &cache_[StringViewHash{}(word) % kShards];
    std::lock_guard<std::mutex> lock(shard->mu);
    auto it = shard->map.find(word);
    if (it != shard->map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<int32_t> syms;
  initial_symbols(word, syms);
  merge(syms);
  out.insert(out.end(), syms.begin(), syms.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard->mu);
    if (shard->map.size() >= kCacheShardCapacity) shard->map.clear();  // crude bound on memory
    shard->map.emplace(std::string(word), syms);
  }
}

}  // namespace m3::text
