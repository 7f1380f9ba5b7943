// Randomised robustness: arbitrary bytes, marker-rich random text and mutated golden samples.
// For every input: no crash or hang (bounded input sizes and iteration counts), a random
// streaming split gives exactly the whole-text result, and every call's arguments are one valid
// JSON object.
#include <random>

#include "parser_test_util.h"

namespace m3::text::testing {
namespace {

const char* const kFragments[] = {"]<]minimax[>[",
                                  "<tool_call>",
                                  "</tool_call>",
                                  "<invoke name=\"get_weather\">",
                                  "<invoke name=",
                                  "<invoke",
                                  "</invoke>",
                                  "<city>",
                                  "</city>",
                                  "<days>",
                                  "</days>",
                                  "<item>",
                                  "</item>",
                                  "<mm:think>",
                                  "</mm:think>",
                                  "<",
                                  ">",
                                  "/",
                                  "\n",
                                  " ",
                                  "Paris",
                                  "7",
                                  "null",
                                  "\"",
                                  "'",
                                  "\\",
                                  "\xC3\xA9",
                                  "\xE6\x9D\xB1",
                                  "\xF0\x9F",
                                  "\x9A\x80",
                                  "\xFF",
                                  "{\"a\":1}",
                                  "[1,",
                                  "]<]mini",
                                  "[e~[",
                                  "<invoke ",
                                  "]<]minimax[>[offerta.docx",
                                  "\n\n"};

ChatOutputOptions random_options(std::mt19937& rng, const nlohmann::json& tools) {
  ChatOutputOptions o;
  o.parse_reasoning = rng() % 4 != 0;
  o.thinking_mode = static_cast<ThinkingMode>(rng() % 3);
  o.parse_tool_calls = rng() % 8 != 0;
  if (rng() % 3 != 0) o.tools = tools;
  return o;
}

void check_input(const ChatOutputOptions& options, const std::string& input, std::mt19937& rng) {
  const ChatOutputResult whole = ChatOutputParser::parse(input, options);
  expect_valid_arguments(whole, "fuzz");
  const auto cuts = random_cuts(rng, input.size(), 1 + rng() % 40);
  expect_same_result(whole, run_stream(options, input, cuts), describe_cuts(cuts));
}

nlohmann::json fuzz_tools() {
  return nlohmann::json::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":
    {"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},
     "item":{"type":"array","items":{"type":"number"}},"cfg":{"type":"object"}}}}}])");
}

TEST(ParserFuzz, ArbitraryBytes) {
  std::mt19937 rng(1234);
  const auto tools = fuzz_tools();
  for (int iter = 0; iter < 2000; ++iter) {
    std::string input(rng() % 200, '\0');
    for (char& c : input) c = static_cast<char>(rng() & 0xFF);
    check_input(random_options(rng, tools), input, rng);
    if (HasFailure()) return;
  }
}

TEST(ParserFuzz, MarkerRichRandomText) {
  std::mt19937 rng(99);
  const auto tools = fuzz_tools();
  for (int iter = 0; iter < 6000; ++iter) {
    std::string input;
    const size_t n = rng() % 60;
    for (size_t i = 0; i < n; ++i) input += kFragments[rng() % std::size(kFragments)];
    check_input(random_options(rng, tools), input, rng);
    if (HasFailure()) return;
  }
}

TEST(ParserFuzz, MutatedGoldenSamples) {
  std::mt19937 rng(4242);
  const auto cases = load_golden_cases();
  ASSERT_FALSE(cases.empty());
  for (int iter = 0; iter < 6000; ++iter) {
    const GoldenCase& g = cases[rng() % cases.size()];
    std::string s = g.input;
    const int mutations = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      const size_t len = 1 + rng() % 16;
      switch (rng() % 5) {
        case 0:
          s.erase(pos, len);
          break;  // delete a range
        case 1:
          s.insert(pos, s.substr(pos, len));
          break;  // duplicate a range
        case 2:
          s.insert(pos, kFragments[rng() % std::size(kFragments)]);
          break;
        case 3:
          if (pos < s.size()) s[pos] = static_cast<char>(rng() & 0xFF);
          break;
        case 4:
          s.resize(pos);
          break;  // truncate
      }
    }
    check_input(g.options, s, rng);
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace m3::text::testing
