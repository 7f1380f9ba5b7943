// StopMatcher: no emitted byte is ever taken back, for every split of the input.
#include <gtest/gtest.h>

#include <random>

#include "server/stop_matcher.h"

namespace m3::server {
namespace {

std::string run_split(const std::vector<std::string>& stops, bool include, const std::string& text,
                      std::mt19937& rng, bool* stopped) {
  StopMatcher m(stops, include);
  std::string out;
  size_t i = 0;
  while (i < text.size() && !m.stopped()) {
    const size_t len = std::min<size_t>(text.size() - i, 1 + rng() % 4);
    out += m.feed(std::string_view(text).substr(i, len));
    i += len;
  }
  out += m.flush();
  *stopped = m.stopped();
  return out;
}

TEST(StopMatcher, TrimsAtTheEarliestMatchForAnySplit) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    bool stopped = false;
    EXPECT_EQ(run_split({"STOP", "ab"}, false, "xxaSTxSTOyySTOPzzab", rng, &stopped),
              "xxaSTxSTOyy");
    EXPECT_TRUE(stopped);
    EXPECT_EQ(run_split({"STOP"}, true, "xxSTOPyy", rng, &stopped), "xxSTOP");
    EXPECT_EQ(run_split({"STOP"}, false, "no match here ST", rng, &stopped), "no match here ST");
    EXPECT_FALSE(stopped);
    // Overlapping candidates: "aab" inside "aaab".
    EXPECT_EQ(run_split({"aab"}, false, "xaaaby", rng, &stopped), "xa");
  }
}

TEST(StopMatcher, HoldsBackOnlyPossibleStopPrefixes) {
  StopMatcher m({"END"}, false);
  EXPECT_EQ(m.feed("hello E"), "hello ");
  EXPECT_EQ(m.held_bytes(), 1u);
  EXPECT_EQ(m.feed("N"), "");
  EXPECT_EQ(m.feed("x"), "ENx");  // not a stop after all: released
  EXPECT_EQ(m.feed("yEND and more"), "y");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "END");
  EXPECT_EQ(m.feed("later"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, NoStopsPassesThrough) {
  StopMatcher m({}, false);
  EXPECT_EQ(m.feed("abc"), "abc");
  EXPECT_EQ(m.held_bytes(), 0u);
  StopMatcher empty_only({""}, false);
  EXPECT_EQ(empty_only.feed("abc"), "abc");
}

TEST(StopMatcher, MultiByteStopStrings) {
  StopMatcher m({"été"}, false);
  std::string out = m.feed("un \xc3");
  out += m.feed("\xa9t\xc3\xa9 chaud");
  EXPECT_EQ(out, "un ");
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace m3::server
