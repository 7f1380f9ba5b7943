// Loading errors (each names the problem) and small API contracts.
#include <gtest/gtest.h>

#include "text/tok_utf8.h"
#include "text/tokenizer.h"
#include "tokenizer_fixtures.h"

namespace m3::text {
namespace {

std::string m3_json() {
  return testing::read_file(std::string(M3_SOURCE_DIR) +
                            "/tests/golden/text/m3_tokenizer/tokenizer.json");
}

Error load_error(const nlohmann::json& j) {
  auto r = Tokenizer::from_json_text(j.dump());
  EXPECT_FALSE(r.has_value());
  return r ? Error{} : r.error();
}

TEST(TokenizerApi, MissingFileIsNotFound) {
  auto r = Tokenizer::from_file("/nonexistent/dir/tokenizer.json");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kNotFound);
  EXPECT_NE(r.error().message.find("/nonexistent/dir/tokenizer.json"), std::string::npos);
}

TEST(TokenizerApi, MalformedJsonIsFormatError) {
  auto r = Tokenizer::from_json_text("{\"model\": ");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kFormat);
  auto j = nlohmann::json::parse(m3_json());
  j["model"]["vocab"] = "not an object";
  EXPECT_EQ(load_error(j).code, ErrorCode::kFormat);
}

TEST(TokenizerApi, UnsupportedPartsAreNamed) {
  auto j = nlohmann::json::parse(m3_json());
  j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", ""}};
  Error e = load_error(j);
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
  EXPECT_NE(e.message.find("Precompiled"), std::string::npos) << e.message;

  j = nlohmann::json::parse(m3_json());
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
  e = load_error(j);
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
  EXPECT_NE(e.message.find("Metaspace"), std::string::npos) << e.message;

  j = nlohmann::json::parse(m3_json());
  j["decoder"] = {{"type", "WordPiece"}};
  e = load_error(j);
  EXPECT_NE(e.message.find("WordPiece"), std::string::npos) << e.message;

  j = nlohmann::json::parse(m3_json());
  j["model"]["type"] = "Unigram";
  EXPECT_NE(load_error(j).message.find("Unigram"), std::string::npos);

  j = nlohmann::json::parse(m3_json());
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_EQ(load_error(j).code, ErrorCode::kUnsupported);
}

TEST(TokenizerApi, BadMergesAreFormatErrors) {
  auto j = nlohmann::json::parse(m3_json());
  j["model"]["merges"].push_back("nosuchtoken1 nosuchtoken2");
  Error e = load_error(j);
  EXPECT_EQ(e.code, ErrorCode::kFormat);
  EXPECT_NE(e.message.find("nosuchtoken1"), std::string::npos) << e.message;

  j = nlohmann::json::parse(m3_json());
  j["model"]["merges"].push_back("a b c");
  EXPECT_EQ(load_error(j).code, ErrorCode::kFormat);
}

TEST(TokenizerApi, UnsupportedPostProcessorOnlyFailsWithSpecialTokens) {
  auto j = nlohmann::json::parse(m3_json());
  j["post_processor"] = {{"type", "SomeFutureProcessor"}};
  auto tok = Tokenizer::from_json_text(j.dump());
  ASSERT_TRUE(tok.has_value()) << tok.error().message;
  EXPECT_FALSE((*tok)->encode("hi").empty());
  auto r = (*tok)->encode("hi", true);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(r.error().message.find("SomeFutureProcessor"), std::string::npos);
  auto plain = (*tok)->encode("hi", false);
  ASSERT_TRUE(plain.has_value());
  EXPECT_EQ(*plain, (*tok)->encode("hi"));
}

TEST(TokenizerApi, UnknownIdsAndTokens) {
  auto tok = Tokenizer::from_json_text(m3_json());
  ASSERT_TRUE(tok.has_value());
  const auto& t = **tok;
  EXPECT_EQ(t.id_to_token(-1), "");
  EXPECT_EQ(t.id_to_token(t.vocab_size()), "");
  EXPECT_FALSE(t.token_to_id("definitely not a token").has_value());
  EXPECT_FALSE(t.is_special(0));
  EXPECT_FALSE(t.contains_id(t.vocab_size()));
  EXPECT_EQ(t.decode(std::vector<int32_t>{-7, t.vocab_size(), 1 << 30}, false), "");
  EXPECT_TRUE(t.encode("").empty());
}

TEST(Utf8, LossyMatchesMaximalSubpartPolicy) {
  // Expected strings are what Python's bytes.decode("utf-8", "replace") gives.
  const std::string r = "\xEF\xBF\xBD";
  auto lossy = [](std::string_view s) {
    std::string o;
    utf8_append_lossy(s, o, true);
    return o;
  };
  EXPECT_EQ(lossy("a\xE4\xB8z"), "a" + r + "z");
  EXPECT_EQ(lossy("\xED\xA0\x80"), r + r + r);  // surrogate: ED then two stray continuations
  EXPECT_EQ(lossy("\xF0\x9F\x98"), r);
  EXPECT_EQ(lossy("\xC0\xAF"), r + r);
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), r + r + r + r);  // past U+10FFFF
  EXPECT_TRUE(utf8_valid("\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(utf8_valid("\xF4\x90\x80\x80"));
  std::string partial;
  EXPECT_EQ(utf8_append_lossy("ab\xE4\xB8", partial, false), 2u);
  EXPECT_EQ(partial, "ab");
}

}  // namespace
}  // namespace m3::text
