// Robustness: random bytes and random mutations of real templates must never crash or hang the
// renderer; they either render or return an Error with a line and column. Bounded work: a fixed
// seed, a fixed number of cases, and small render limits.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>

#include "text/builtin_templates.h"
#include "text/jinja/template.h"
#include "unit/text/jinja/golden_util.h"

namespace m3::text::jinja {
namespace {

using nlohmann::ordered_json;

RenderOptions small_limits() {
  RenderOptions o;
  o.max_steps = 20000;
  o.max_output_bytes = 1 << 20;
  o.max_depth = 200;
  o.strftime_now = [](const std::string&) { return std::string("01 Jan 2026"); };
  return o;
}

const ordered_json& sample_vars() {
  static const ordered_json v = ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "sys"},
      {"role": "user", "content": "hello <tool_response>x</tool_response>"},
      {"role": "assistant", "content": "<think>r</think>ok", "reasoning_content": "why",
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": [1, {"b": null}], "c": true}}}]},
      {"role": "tool", "content": "res"},
      {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "thinking_mode": "enabled"
  })");
  return v;
}

// Either renders or fails with a located message; anything else (crash, hang) fails the test.
void check_one(const std::string& src, int& rendered, int& failed) {
  auto t = Template::parse(src, "fuzz");
  if (!t) {
    EXPECT_EQ(t.error().message.rfind("fuzz: line ", 0), 0u) << t.error().message;
    ++failed;
    return;
  }
  auto out = t->render(sample_vars(), small_limits());
  if (out) {
    ++rendered;
  } else {
    EXPECT_EQ(out.error().message.rfind("fuzz: line ", 0), 0u) << out.error().message;
    ++failed;
  }
}

TEST(JinjaFuzz, RandomTokenSoup) {
  static const char* kPieces[] = {
      "{{",       "}}",       "{%",       "%}",      "{#",         "#}",        "-",
      "+",        "(",        ")",        "[",       "]",          "{",         "}",
      "|",        ".",        ",",        ":",       "'",          "\"",        "~",
      "=",        "==",       "<",        ">",       "!",          "*",         "**",
      "/",        "//",       "%",        " ",       "\n",         "if ",       "else",
      "elif ",    "endif",    "for ",     " in ",    "endfor",     "set ",      "endset",
      "macro ",   "endmacro", "call",     "endcall", "filter ",    "endfilter", "not ",
      " and ",    " or ",     " is ",     "defined", "none",       "true",      "x",
      "ns",       "loop",     "messages", "tools",   "namespace(", "range(",    "0",
      "1",        "7",        "1.5",      "'a'",     "\"b\"",      "|tojson",   "|length",
      "|join",    "break",    "continue", "raw",     "endraw",     "\\",        "\xff",
      "\xc3\xa9", "\t"};
  std::mt19937 rng(1234);
  int rendered = 0, failed = 0;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3000; ++i) {
    std::string src;
    int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) src += kPieces[rng() % (sizeof(kPieces) / sizeof(kPieces[0]))];
    check_one(src, rendered, failed);
  }
  for (int i = 0; i < 1000; ++i) {  // raw random bytes
    std::string src(rng() % 64, '\0');
    for (char& c : src) c = static_cast<char>(rng() & 0xff);
    check_one(src, rendered, failed);
  }
  EXPECT_GT(rendered, 100);  // the soup must reach the interpreter, not only the parser
  EXPECT_GT(failed, 100);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

TEST(JinjaFuzz, MutatedRealTemplates) {
  std::vector<std::string> sources = {
      std::string(text::kMiniMaxM3ChatTemplate),
      test::read_text(test::golden_dir() + "/minimax_m2_style.jinja")};
  std::string qwen = test::qwen3_dir() + "/tokenizer_config.json";
  if (std::filesystem::exists(qwen))
    sources.push_back(
        ordered_json::parse(test::read_text(qwen)).at("chat_template").get<std::string>());
  for (const auto& c : test::goldens().at("features"))
    sources.push_back(c.at("template").get<std::string>());

  std::mt19937 rng(42);
  int rendered = 0, failed = 0;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 2500; ++i) {
    std::string src = sources[rng() % sources.size()];
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !src.empty(); ++e) {
      size_t pos = rng() % src.size();
      size_t len = 1 + rng() % 24;
      switch (rng() % 5) {
        case 0:
          src.erase(pos, len);
          break;  // delete a span
        case 1:
          src.insert(pos, src.substr(rng() % src.size(), len));
          break;  // duplicate a span
        case 2:
          src[pos] = "{}%#-()[]|'\"~ \n"[rng() % 15];
          break;  // flip a syntax char
        case 3:
          src.insert(pos, rng() % 2 ? "{% for x in messages %}" : "{% endfor %}");
          break;
        default:
          src.insert(pos, rng() % 2 ? "{{ x.y.z }}" : "{% set ns.q = 1 %}");
          break;
      }
    }
    check_one(src, rendered, failed);
  }
  EXPECT_GT(rendered, 100);
  EXPECT_GT(failed, 100);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

}  // namespace
}  // namespace m3::text::jinja
