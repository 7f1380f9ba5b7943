// Golden cases from tests/golden/text/parsers/*.json: whole-text result against the hand-written
// expectation, then every streaming split (byte by byte, every 2-way cut, random multi-way cuts)
// against the whole-text result.
#include <random>

#include "parser_test_util.h"

namespace m3::text::testing {
namespace {

class GoldenTest : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(GoldenTest, WholeTextMatchesExpected) {
  const GoldenCase& g = GetParam();
  SCOPED_TRACE(g.description);
  const ChatOutputResult got = ChatOutputParser::parse(g.input, g.options);
  expect_same_result(g.expected, got, "whole text");
  expect_valid_arguments(got, "whole text");
}

TEST_P(GoldenTest, EveryStreamingSplitMatchesWholeText) {
  const GoldenCase& g = GetParam();
  const ChatOutputResult whole = ChatOutputParser::parse(g.input, g.options);
  expect_same_result(whole, run_stream(g.options, g.input, every_byte(g.input.size())),
                     "byte by byte");
  for (size_t cut = 1; cut < g.input.size(); ++cut) {
    expect_same_result(whole, run_stream(g.options, g.input, {cut}),
                       "2-way cut at " + std::to_string(cut));
    if (::testing::Test::HasFailure()) return;  // one report per case is enough
  }
  std::mt19937 rng(20240601u + static_cast<unsigned>(g.input.size()));
  for (int i = 0; i < 200; ++i) {
    const auto cuts = random_cuts(rng, g.input.size(), 12);
    expect_same_result(whole, run_stream(g.options, g.input, cuts), describe_cuts(cuts));
    if (::testing::Test::HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Parsers, GoldenTest, ::testing::ValuesIn(load_golden_cases()),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           return info.param.id;
                         });

TEST(GoldenFiles, AllFilesHaveCases) {
  // Guards against a golden file silently losing its cases (the parameterized suite would just
  // shrink).
  const auto cases = load_golden_cases();
  EXPECT_GE(cases.size(), 80u);
  for (const std::string& stem : golden_files()) {
    const bool found = std::any_of(cases.begin(), cases.end(), [&](const GoldenCase& g) {
      return g.id.rfind(stem + "_", 0) == 0;
    });
    EXPECT_TRUE(found) << stem;
  }
}

}  // namespace
}  // namespace m3::text::testing
