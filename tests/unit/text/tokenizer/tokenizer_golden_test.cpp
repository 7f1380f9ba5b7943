// Encode/decode goldens from HF tokenizers (see tools/goldens/make_tokenizer_goldens.py):
// ids must match exactly, and decode must give HF's text.
#include <gtest/gtest.h>

#include "text/tok_utf8.h"
#include "tokenizer_fixtures.h"

namespace m3::text {
namespace {

using testing::case_input;
using testing::goldens;
using testing::ids_of;
using testing::load_suite_tokenizer;

class GoldenSuite : public ::testing::TestWithParam<std::string> {
 protected:
  const nlohmann::json& suite() const {
    for (const auto& s : goldens()["suites"]) {
      if (s["name"] == GetParam()) return s;
    }
    ADD_FAILURE() << "no suite " << GetParam();
    static nlohmann::json empty;
    return empty;
  }
};

// Suites that carry `key` (the Split/ignore_merges variants only have encode cases).
std::vector<std::string> suite_names(const char* key) {
  std::vector<std::string> names;
  for (const auto& s : goldens()["suites"]) {
    if (s.contains(key)) names.push_back(s["name"].get<std::string>());
  }
  return names;
}

class GoldenDecodeSuite : public GoldenSuite {};

TEST_P(GoldenSuite, EncodeMatchesHf) {
  const auto& s = suite();
  auto tok = load_suite_tokenizer(s);
  if (!tok) GTEST_SKIP() << "tokenizer file for suite " << GetParam() << " is not present";
  int failures = 0;
  for (const auto& c : s["encode"]) {
    const std::string in = case_input(c);
    const std::vector<int32_t> got = tok->encode(in);
    const std::vector<int32_t> want = ids_of(c["ids"]);
    if (got != want && ++failures <= 5) {
      ADD_FAILURE() << "suite " << GetParam() << " input '" << in.substr(0, 200)
                    << "': ids differ from HF (got " << got.size() << " ids, want " << want.size()
                    << ")";
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST_P(GoldenSuite, DecodeOfEncodeMatchesHf) {
  const auto& s = suite();
  auto tok = load_suite_tokenizer(s);
  if (!tok) GTEST_SKIP() << "tokenizer file for suite " << GetParam() << " is not present";
  for (const auto& c : s["encode"]) {
    const std::string in = case_input(c);
    // HF's decode(encode(x)): x itself unless the case records a normalised form; for invalid
    // input it is the U+FFFD-replaced text.
    std::string want;
    if (c.contains("decoded")) {
      want = c["decoded"].get<std::string>();
    } else {
      utf8_append_lossy(in, want, /*final=*/true);
    }
    EXPECT_EQ(tok->decode(tok->encode(in), false), want) << GetParam() << ": " << in.substr(0, 200);
  }
}

TEST_P(GoldenDecodeSuite, DecodeMatchesHf) {
  const auto& s = suite();
  auto tok = load_suite_tokenizer(s);
  if (!tok) GTEST_SKIP() << "tokenizer file for suite " << GetParam() << " is not present";
  for (const auto& c : s["decode"]) {
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    const bool skip = c["skip_special"].get<bool>();
    EXPECT_EQ(tok->decode(ids, skip), c["text"].get<std::string>())
        << GetParam() << " ids " << c["ids"].dump() << " skip_special=" << skip;
  }
}

TEST_P(GoldenDecodeSuite, VocabSizeMatchesHf) {
  const auto& s = suite();
  auto tok = load_suite_tokenizer(s);
  if (!tok) GTEST_SKIP() << "tokenizer file for suite " << GetParam() << " is not present";
  EXPECT_EQ(tok->vocab_size(), s["vocab_size"].get<int32_t>());
}

INSTANTIATE_TEST_SUITE_P(Hf, GoldenSuite, ::testing::ValuesIn(suite_names("encode")),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Hf, GoldenDecodeSuite, ::testing::ValuesIn(suite_names("decode")),
                         [](const auto& info) { return info.param; });

TEST(TokenizerGolden, M3RoundTripsEveryValidCase) {
  // The M3 fixture has no normalizer and a lossless byte-level pipeline, so HF gives back the
  // exact input; the goldens record no "decoded" override for it, which this pins down.
  for (const auto& s : goldens()["suites"]) {
    if (s["name"] != "m3") continue;
    auto tok = load_suite_tokenizer(s);
    ASSERT_TRUE(tok);
    for (const auto& c : s["encode"]) {
      if (!c.contains("text")) continue;
      EXPECT_FALSE(c.contains("decoded"));
      const std::string text = c["text"].get<std::string>();
      EXPECT_EQ(tok->decode(tok->encode(text), false), text);
    }
  }
}

TEST(TokenizerGolden, M3SpecialTokensAreSingleIds) {
  for (const auto& s : goldens()["suites"]) {
    if (s["name"] != "m3") continue;
    auto tok = load_suite_tokenizer(s);
    ASSERT_TRUE(tok);
    for (const auto& [content, id] : s["specials"].items()) {
      EXPECT_EQ(tok->token_to_id(content), id.get<int32_t>()) << content;
      EXPECT_EQ(tok->id_to_token(id.get<int32_t>()), content);
      EXPECT_TRUE(tok->is_special(id.get<int32_t>())) << content;
      EXPECT_EQ(tok->encode(content), std::vector<int32_t>{id.get<int32_t>()}) << content;
      EXPECT_EQ(tok->decode(std::vector<int32_t>{id.get<int32_t>()}, true), "");
    }
  }
}

TEST(TokenizerGolden, TemplatePostProcessorMatchesHf) {
  for (const auto& s : goldens()["suites"]) {
    if (s["name"] != "flags") continue;
    auto tok = load_suite_tokenizer(s);
    ASSERT_TRUE(tok);
    for (const auto& c : s["with_special"]) {
      auto ids = tok->encode(c["text"].get<std::string>(), true);
      ASSERT_TRUE(ids.has_value()) << ids.error().message;
      EXPECT_EQ(*ids, ids_of(c["ids"])) << c["text"];
    }
  }
}

}  // namespace
}  // namespace m3::text
