// Randomised robustness (fixed seeds, bounded sizes): encode/decode never crash or hang on
// arbitrary bytes, ids stay in range, and the lossless M3 pipeline round-trips the
// U+FFFD-sanitised input. Exactness against HF on random strings is in the goldens
// (random_cases in the generator); this covers inputs HF cannot even receive.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "text/detokenizer.h"
#include "text/tok_utf8.h"
#include "tokenizer_fixtures.h"

namespace m3::text {
namespace {

using testing::goldens;
using testing::load_suite_tokenizer;

std::shared_ptr<const Tokenizer> suite_tokenizer(const std::string& name) {
  for (const auto& s : goldens()["suites"]) {
    if (s["name"] == name) return load_suite_tokenizer(s);
  }
  return nullptr;
}

std::string random_input(std::mt19937& rng) {
  static const std::vector<std::string> atoms = {"]~b]",
                                                 "[e~[",
                                                 "<mm:think>",
                                                 "</mm:think>",
                                                 "]<]minimax[>[",
                                                 "<tool_call>",
                                                 "]~!b[",
                                                 " ",
                                                 "  ",
                                                 "\n",
                                                 "\t",
                                                 "\r\n",
                                                 "\xC2\xA0",
                                                 "\xE3\x80\x80",
                                                 "e\xCC\x81",
                                                 "\xF0\x9F\x98\x80",
                                                 "\xE4\xBD\xA0",
                                                 "'s",
                                                 "'LL",
                                                 "123456",
                                                 "abc",
                                                 "ABC",
                                                 "<s>",
                                                 "[MASK]",
                                                 "zzyzx",
                                                 "\xEF\xAC\x81x",
                                                 "\xE2\x80\x8D",
                                                 "\xF0\x9F\x87\xAF",
                                                 "]~b",
                                                 "[e~",
                                                 "<|im_start|>",
                                                 "\xE1\xA0\x8E"};
  std::string s;
  const int parts = rng() % 16;
  for (int i = 0; i < parts; ++i) {
    switch (rng() % 3) {
      case 0: {  // raw bytes, any value
        const int n = 1 + rng() % 6;
        for (int k = 0; k < n; ++k) s.push_back(static_cast<char>(rng() & 0xFF));
        break;
      }
      default:
        s += atoms[rng() % atoms.size()];
    }
  }
  return s;
}

TEST(TokenizerFuzz, RandomBytesNeverCrashAndRoundTrip) {
  for (const std::string name : {"m3", "flags", "qwen3"}) {
    auto tok = suite_tokenizer(name);
    if (!tok) continue;  // optional Qwen3 file absent
    std::mt19937 rng(42);
    for (int iter = 0; iter < 3000; ++iter) {
      const std::string in = random_input(rng);
      const std::vector<int32_t> ids = tok->encode(in);
      for (int32_t id : ids) {
        ASSERT_GE(id, 0);
        ASSERT_LT(id, tok->vocab_size());
      }
      const std::string out = tok->decode(ids, false);
      ASSERT_TRUE(utf8_valid(out));
      if (name == "m3") {
        std::string clean;
        utf8_append_lossy(in, clean, true);
        ASSERT_EQ(out, clean) << "iteration " << iter;
      }
      // Random id soup, including out-of-range and negative ids, through both decoders.
      std::vector<int32_t> soup;
      for (int k = 0; k < 8; ++k)
        soup.push_back(static_cast<int32_t>(rng() % (tok->vocab_size() + 10)) - 5);
      const bool skip = rng() & 1;
      IncrementalDetokenizer d(tok, skip);
      std::string streamed;
      for (int32_t id : soup) streamed += d.step(id);
      streamed += d.flush();
      ASSERT_EQ(streamed, tok->decode(soup, skip));
    }
  }
}

TEST(TokenizerFuzz, PathologicalLongInputsFinishQuickly) {
  auto tok = suite_tokenizer("m3");
  ASSERT_TRUE(tok);
  std::mt19937 rng(7);
  std::string cjk;
  for (int i = 0; i < 30000; ++i) utf8_append(0x4E00 + rng() % 2000, cjk);  // one 90 KB word
  const std::vector<std::string> inputs = {std::string(1 << 20, ' '),
                                           std::string(1 << 20, 'a'),
                                           std::string(200000, '\n'),
                                           std::string(300000, '='),
                                           cjk,
                                           std::string(100000, '\xFF')};
  for (const std::string& in : inputs) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok->encode(in);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string clean;
    utf8_append_lossy(in, clean, true);
    EXPECT_EQ(tok->decode(ids, false), clean);
    // Generous bound (~50x the time measured on a 2-core CI box) that still catches quadratic
    // behaviour, which takes minutes on these sizes.
    EXPECT_LT(secs, 10.0) << "input of " << in.size() << " bytes took " << secs << " s";
  }
}

TEST(TokenizerFuzz, ConcurrentEncodeMatchesSerial) {
  auto tok = suite_tokenizer("m3");
  ASSERT_TRUE(tok);
  std::mt19937 rng(99);
  std::vector<std::string> inputs;
  for (int i = 0; i < 400; ++i) inputs.push_back(random_input(rng));
  std::vector<std::vector<int32_t>> serial;
  for (const auto& in : inputs) serial.push_back(tok->encode(in));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) {
        for (size_t i = 0; i < inputs.size(); ++i) {
          if (tok->encode(inputs[(i + t * 37) % inputs.size()]) !=
              serial[(i + t * 37) % inputs.size()]) {
            ++mismatches[t];
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace m3::text
