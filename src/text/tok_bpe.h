// BpeModel: the `model` section of a Hugging Face tokenizer.json of type BPE (vocab, merges,
// unk_token, fuse_unk, byte_fallback, continuing_subword_prefix, end_of_word_suffix,
// ignore_merges), plus the GPT-2 byte<->unicode table used by ByteLevel.
// Called by Tokenizer for every pre-token. Invariant: after from_json succeeds every merge
// result and every referenced token has an id; tokenize() is const and thread-safe (the word
// cache is sharded behind mutexes) and its result equals HF `tokenizers` BPE::tokenize.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/error.h"

namespace m3::text {

// GPT-2 byte-level alphabet: every byte maps to one printable code point.
char32_t byte_to_unicode(uint8_t b);
// Inverse of byte_to_unicode; -1 when `cp` is not one of the 256 byte-level code points.
int unicode_to_byte(char32_t cp);

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringViewHash, std::equal_to<>>;

class BpeModel {
 public:
  // `byte_level`: pre-tokens arrive as raw bytes and each byte stands for its byte-level char
  // (the pipeline ends with a ByteLevel pre-tokenizer); otherwise pre-tokens are plain text.
  static Result<std::unique_ptr<BpeModel>> from_json(const nlohmann::json& model, bool byte_level);

  // Appends the ids of one pre-token.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Nullptr when `id` is not in the vocab.
  const std::string* id_to_token(int32_t id) const;
  // Number of vocab entries (HF Model::get_vocab_size) and the largest id.
  size_t vocab_entries() const { return vocab_.size(); }
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct PairSlot {
    uint64_t key;
    uint32_t rank;
    int32_t new_id;
  };
  struct CacheShard {
    std::mutex mu;
    StringMap<std::vector<int32_t>> map;
  };
  static constexpr int kShards = 16;
  static constexpr size_t kCacheWordMaxBytes = 256;  // longer words are not cached
  static constexpr size_t kCacheShardCapacity = 8192;

  BpeModel() = default;
  const PairSlot* find_pair(int32_t a, int32_t b) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& syms) const;
  void add_char(const std::string& key, std::vector<int32_t>& syms, bool* unk_pending) const;
  void merge(std::vector<int32_t>& syms) const;
  void merge_heap(std::vector<int32_t>& syms) const;

  StringMap<int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> id_present_;
  std::vector<PairSlot> pairs_;  // open addressing, power-of-two size
  uint64_t pair_mask_ = 0;
  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::string prefix_;  // continuing_subword_prefix
  std::string suffix_;  // end_of_word_suffix
  // byte_level_ fast path: id of each byte's char when prefix/suffix are empty, else -1.
  std::array<int32_t, 256> byte_id_{};
  std::array<std::string, 256> byte_char_;  // UTF-8 of byte_to_unicode(b)
  // ignore_merges_ in byte-level mode: vocab keyed by raw bytes.
  StringMap<int32_t> raw_vocab_;
  mutable std::array<CacheShard, kShards> cache_;
};

}  // namespace m3::text
