// Shared helpers for the text parser tests: golden-case loading, streaming under a given split,
// and the stream-protocol checks every streamed run must pass.
// Called by the *_test.cpp files of text_parsers_test only.
// Invariant: run_stream() feeds exactly the bytes of `text`, cut at `cuts`, then finish().
#pragma once

#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_output_parser.h"

namespace m3::text::testing {

struct GoldenCase {
  std::string id;  // file stem + case name, a valid gtest name
  std::string description;
  ChatOutputOptions options;
  std::string input;
  ChatOutputResult expected;
};

inline std::string golden_dir() {
  return std::string(M3_SOURCE_DIR) + "/tests/golden/text/parsers";
}

inline std::vector<std::string> golden_files() {
  return {"reasoning", "tool_calls", "truncated", "malformed", "chat", "quirks", "vllm_parity"};
}

inline std::string sanitize_test_name(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

// Throws (test setup) when a golden file is missing or malformed: a broken fixture must fail
// loudly.
inline std::vector<GoldenCase> load_golden_cases() {
  std::vector<GoldenCase> out;
  for (const std::string& stem : golden_files()) {
    std::ifstream f(golden_dir() + "/" + stem + ".json");
    if (!f) throw std::runtime_error("missing golden file " + stem + ".json");
    const nlohmann::json doc = nlohmann::json::parse(f);
    const nlohmann::json& sets = doc.at("tool_sets");
    for (const auto& c : doc.at("cases")) {
      GoldenCase g;
      g.id = sanitize_test_name(stem + "_" + c.at("name").get<std::string>());
      g.description = c.value("description", "");
      g.options.parse_reasoning = c.value("reasoning_parser", true);
      auto mode = thinking_mode_from_string(c.value("thinking_mode", "adaptive"));
      if (!mode) throw std::runtime_error(mode.error().message);
      g.options.thinking_mode = *mode;
      g.options.parse_tool_calls = c.value("tool_parser", true);
      if (c.contains("tools")) g.options.tools = sets.at(c.at("tools").get<std::string>());
      g.input = c.at("input").get<std::string>();
      const auto& e = c.at("expected");
      g.expected.reasoning = e.at("reasoning").get<std::string>();
      g.expected.content = e.at("content").get<std::string>();
      int index = 0;
      for (const auto& call : e.at("tool_calls")) {
        g.expected.tool_calls.push_back(ToolCall{"call_" + std::to_string(index++),
                                                 call.at("name").get<std::string>(),
                                                 call.at("arguments").get<std::string>()});
      }
      out.push_back(std::move(g));
    }
  }
  return out;
}

// gtest prints a failing parameter with this (instead of a byte dump).
inline void PrintTo(const GoldenCase& g, std::ostream* os) {
  *os << g.id;
}

// Checks the stream protocol: a call's first delta carries id and name, later ones neither, and
// new calls appear with consecutive indexes.
class StreamChecker {
 public:
  void check(const ChatOutputDelta& d) {
    for (const auto& c : d.tool_calls) {
      if (c.name.has_value()) {
        EXPECT_EQ(c.index, num_calls_) << "a new call must take the next index";
        EXPECT_TRUE(c.id.has_value()) << "the first delta of a call carries its id";
        ++num_calls_;
      } else {
        EXPECT_FALSE(c.id.has_value()) << "id only on the first delta";
        EXPECT_LT(c.index, num_calls_) << "arguments for a call that was never announced";
      }
    }
  }

 private:
  int num_calls_ = 0;
};

inline ChatOutputResult run_stream(const ChatOutputOptions& options, std::string_view text,
                                   const std::vector<size_t>& cuts) {
  ChatOutputParser p(options);
  ChatOutputResult r;
  StreamChecker checker;
  size_t begin = 0;
  for (size_t cut : cuts) {
    const auto d = p.feed(text.substr(begin, cut - begin));
    checker.check(d);
    r.append(d);
    begin = cut;
  }
  const auto d = p.feed(text.substr(begin));
  checker.check(d);
  r.append(d);
  const auto f = p.finish();
  checker.check(f);
  r.append(f);
  return r;
}

inline std::string describe_cuts(const std::vector<size_t>& cuts) {
  std::ostringstream os;
  os << "cuts:";
  for (size_t c : cuts) os << ' ' << c;
  return os.str();
}

inline void expect_same_result(const ChatOutputResult& want, const ChatOutputResult& got,
                               const std::string& context) {
  EXPECT_EQ(want.reasoning, got.reasoning) << context;
  EXPECT_EQ(want.content, got.content) << context;
  ASSERT_EQ(want.tool_calls.size(), got.tool_calls.size()) << context;
  for (size_t i = 0; i < want.tool_calls.size(); ++i) {
    EXPECT_EQ(want.tool_calls[i].id, got.tool_calls[i].id) << context << " call " << i;
    EXPECT_EQ(want.tool_calls[i].name, got.tool_calls[i].name) << context << " call " << i;
    EXPECT_EQ(want.tool_calls[i].arguments_json, got.tool_calls[i].arguments_json)
        << context << " call " << i;
  }
}

// Random cut points (sorted, distinct, inside (0, size)); portable: raw mt19937 output only.
inline std::vector<size_t> random_cuts(std::mt19937& rng, size_t size, size_t max_pieces) {
  std::vector<size_t> cuts;
  if (size < 2) return cuts;
  const size_t pieces = 1 + rng() % max_pieces;
  for (size_t i = 0; i + 1 < pieces; ++i) cuts.push_back(1 + rng() % (size - 1));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

inline std::vector<size_t> every_byte(size_t size) {
  std::vector<size_t> cuts;
  for (size_t i = 1; i < size; ++i) cuts.push_back(i);
  return cuts;
}

// All arguments must be one valid JSON object.
inline void expect_valid_arguments(const ChatOutputResult& r, const std::string& context) {
  for (const auto& c : r.tool_calls) {
    const auto j = nlohmann::json::parse(c.arguments_json, nullptr, false);
    EXPECT_TRUE(j.is_object()) << context
                               << ": arguments are not a JSON object: " << c.arguments_json;
  }
}

}  // namespace m3::text::testing
