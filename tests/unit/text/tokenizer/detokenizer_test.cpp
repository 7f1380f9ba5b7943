// IncrementalDetokenizer: deltas concatenate to Tokenizer::decode for every split of the id
// stream, and no delta ends inside a UTF-8 character.
#include <gtest/gtest.h>

#include <random>

#include "text/detokenizer.h"
#include "text/tok_bpe.h"
#include "text/tok_utf8.h"
#include "tokenizer_fixtures.h"

namespace m3::text {
namespace {

using testing::case_input;
using testing::goldens;
using testing::ids_of;
using testing::load_suite_tokenizer;

// Streams `ids` in chunks drawn from `rng` (max chunk `max_chunk`) and checks the invariants.
void check_stream(const std::shared_ptr<const Tokenizer>& tok, const std::vector<int32_t>& ids,
                  bool skip, std::mt19937& rng, int max_chunk, const std::string& what) {
  IncrementalDetokenizer detok(tok, skip);
  std::string text;
  size_t i = 0;
  while (i < ids.size()) {
    const size_t n = std::min<size_t>(ids.size() - i, 1 + rng() % max_chunk);
    std::string delta =
        n == 1 ? detok.step(ids[i]) : detok.step(std::span<const int32_t>(ids.data() + i, n));
    ASSERT_TRUE(utf8_valid(delta)) << what << ": delta splits a character";
    ASSERT_LE(detok.pending_bytes(), 3u);
    text += delta;
    i += n;
  }
  text += detok.flush();
  EXPECT_EQ(detok.pending_bytes(), 0u);
  EXPECT_EQ(text, tok->decode(ids, skip)) << what << " skip_special=" << skip;
}

TEST(IncrementalDetokenizer, MatchesDecodeForGoldenIdStreams) {
  std::mt19937 rng(1234);
  int streams = 0;
  for (const auto& s : goldens()["suites"]) {
    if (!s.contains("decode")) continue;  // the split/ignore_merges variants add nothing here
    auto tok = load_suite_tokenizer(s);
    if (!tok) continue;  // optional Qwen3 file absent
    std::vector<std::vector<int32_t>> id_lists;
    for (const auto& c : s["decode"]) id_lists.push_back(ids_of(c["ids"]));
    for (const auto& c : s["encode"]) id_lists.push_back(ids_of(c["ids"]));
    for (const auto& ids : id_lists) {
      for (bool skip : {false, true}) {
        check_stream(tok, ids, skip, rng, 1, s["name"]);  // one id at a time
        check_stream(tok, ids, skip, rng, 5, s["name"]);  // random chunks
        ++streams;
      }
    }
  }
  EXPECT_GT(streams, 500);
}

TEST(IncrementalDetokenizer, HoldsBackSplitCharacterUntilComplete) {
  for (const auto& s : goldens()["suites"]) {
    if (s["name"] != "m3") continue;
    auto tok = load_suite_tokenizer(s);
    ASSERT_TRUE(tok);
    // One byte-level token per byte of U+1F600 (F0 9F 98 80): nothing until the 4th byte.
    std::vector<int32_t> ids;
    for (unsigned char b : std::string("\xF0\x9F\x98\x80")) {
      std::string ch;
      utf8_append(byte_to_unicode(b), ch);
      auto id = tok->token_to_id(ch);
      ASSERT_TRUE(id.has_value());
      ids.push_back(*id);
    }
    IncrementalDetokenizer d(tok, false);
    EXPECT_EQ(d.step(ids[0]), "");
    EXPECT_EQ(d.step(ids[1]), "");
    EXPECT_EQ(d.step(ids[2]), "");
    EXPECT_EQ(d.pending_bytes(), 3u);
    EXPECT_EQ(d.step(ids[3]), "\xF0\x9F\x98\x80");
    // A truncated character at the end of the stream becomes one U+FFFD, like decode().
    EXPECT_EQ(d.step(ids[0]), "");
    EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");
    EXPECT_EQ(tok->decode(std::vector<int32_t>{ids[0]}, false), "\xEF\xBF\xBD");
    // A special token after an incomplete prefix: the prefix is invalid at once.
    const int32_t eos = *tok->token_to_id("[e~[");
    EXPECT_EQ(d.step(ids[0]), "");
    EXPECT_EQ(d.step(eos), "\xEF\xBF\xBD[e~[");
    // Skipped specials do not break a character apart (decode joins the bytes across them).
    IncrementalDetokenizer skip(tok, true);
    std::string out;
    for (int32_t id : {ids[0], eos, ids[1], ids[2], ids[3]}) out += skip.step(id);
    out += skip.flush();
    EXPECT_EQ(out, "\xF0\x9F\x98\x80");
  }
}

}  // namespace
}  // namespace m3::text
