// ChoiceOutput on canned model outputs, with the real M3 test tokenizer and the text parsers:
// reasoning / content / tool calls separated, stop strings and EOS hidden, streamed deltas adding
// up to the whole result for any split of the token stream into engine outputs.
#include <gtest/gtest.h>

#include <random>

#include "server/choice_output.h"
#include "server/response_json.h"

namespace m3::server {
namespace {

std::shared_ptr<const text::Tokenizer> tokenizer() {
  static auto tok = [] {
    auto t = text::Tokenizer::from_file(std::string(M3_SOURCE_DIR) +
                                        "/tests/golden/text/m3_tokenizer/tokenizer.json");
    EXPECT_TRUE(t.has_value()) << (t ? "" : t.error().message);
    return *t;
  }();
  return tok;
}

int32_t id_of(const std::string& s) {
  return *tokenizer()->token_to_id(s);
}

const char* kWeatherTools = R"([{"type": "function", "function": {"name": "get_weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])";

struct Collected {
  std::string content, reasoning;
  std::map<int, std::string> args, names, ids;
  int num_deltas = 0;
};

// Feeds `ids` in random-sized engine outputs; the last one finishes with `reason`.
Collected feed(ChoiceOutput& out, const std::vector<int32_t>& ids, const std::string& reason,
               std::mt19937& rng, std::optional<int32_t> stop_token = std::nullopt) {
  Collected c;
  size_t i = 0;
  while (i < ids.size() && !out.finished()) {
    const size_t len = std::min<size_t>(ids.size() - i, 1 + rng() % 3);
    engine::RequestOutput o;
    o.new_token_ids.assign(ids.begin() + i, ids.begin() + i + len);
    i += len;
    o.num_prompt_tokens = 10;
    o.num_output_tokens = static_cast<int>(i);
    o.num_cached_tokens = 0;
    if (i == ids.size()) {
      o.finished = true;
      o.finish_reason = reason;
      o.stop_token_id = stop_token;
    }
    ChoiceDelta d = out.add(o);
    c.content += d.text;
    c.reasoning += d.reasoning;
    for (const auto& t : d.tool_calls) {
      if (t.name) c.names[t.index] += *t.name;
      if (t.id) c.ids[t.index] += *t.id;
      c.args[t.index] += t.arguments_delta;
    }
    if (!d.empty()) ++c.num_deltas;
  }
  return c;
}

ChoiceOptions chat_options(const char* tools) {
  ChoiceOptions o;
  o.tokenizer = tokenizer();
  o.eos_token_ids = {id_of("[e~[")};
  text::ChatOutputOptions co;
  co.parse_reasoning = true;
  co.thinking_mode = text::ThinkingMode::kAdaptive;
  co.parse_tool_calls = tools != nullptr;
  if (tools) co.tools = nlohmann::json::parse(tools);
  co.tool_options.id_prefix = "call_test_";
  o.chat = co;
  return o;
}

TEST(ChoiceOutput, ReasoningContentAndToolCallsAreSeparated) {
  const std::string ns = "]<]minimax[>[";
  const std::string model_text =
      "<mm:think>The user wants weather.</mm:think>Let me check.\n" + ns + "<tool_call>\n" + ns +
      "<invoke name=\"get_weather\">" + ns + "<city>Paris</city>" + ns + "</city>" + ns +
      "<days>2" + ns + "</days>" + ns + "</invoke>\n" + ns + "<invoke name=\"get_weather\">" + ns +
      "<city>Rome" + ns + "</city>" + ns + "</invoke>\n" + ns + "</tool_call>[e~[";
  std::vector<int32_t> ids = tokenizer()->encode(model_text);
  ASSERT_EQ(ids.back(), id_of("[e~["));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 30; ++trial) {
    ChoiceOutput out(chat_options(kWeatherTools));
    Collected c = feed(out, ids, "stop", rng);
    ASSERT_TRUE(out.finished());
    EXPECT_EQ(out.finish_reason(), "tool_calls");
    EXPECT_EQ(out.reasoning(), "The user wants weather.");
    EXPECT_EQ(out.text(), "Let me check.\n");
    ASSERT_EQ(out.tool_calls().size(), 2u);
    EXPECT_EQ(out.tool_calls()[0].name, "get_weather");
    // A string parameter keeps its text verbatim, including the un-namespaced "</city>".
    EXPECT_EQ(nlohmann::json::parse(out.tool_calls()[0].arguments_json),
              nlohmann::json::parse(R"({"city": "Paris</city>", "days": 2})"));
    EXPECT_EQ(nlohmann::json::parse(out.tool_calls()[1].arguments_json),
              nlohmann::json::parse(R"({"city": "Rome"})"));
    EXPECT_EQ(out.tool_calls()[0].id.rfind("call_test_", 0), 0u);
    EXPECT_NE(out.tool_calls()[0].id, out.tool_calls()[1].id);
    // Streamed deltas add up to the whole result.
    EXPECT_EQ(c.content, out.text());
    EXPECT_EQ(c.reasoning, out.reasoning());
    EXPECT_EQ(c.args[0], out.tool_calls()[0].arguments_json);
    EXPECT_EQ(c.args[1], out.tool_calls()[1].arguments_json);
    EXPECT_EQ(c.names[1], "get_weather");
    EXPECT_EQ(c.ids[0], out.tool_calls()[0].id);
    EXPECT_EQ(out.num_output_tokens(), static_cast<int>(ids.size()));
    const int64_t thought =
        static_cast<int64_t>(tokenizer()->encode("The user wants weather.").size());
    // The reasoning tokens are the thought's tokens plus the closing marker, which is fed while
    // reasoning is open (the opener arrives in the content channel and is not counted).
    EXPECT_EQ(out.num_reasoning_tokens(), thought + 1);
  }
}

TEST(ChoiceOutput, ParallelToolCallsFalseKeepsOnlyTheFirstCall) {
  // parallel_tool_calls: false (Messages: disable_parallel_tool_use) -> max_tool_calls 1: the
  // second invoke is dropped from the result and from the stream, in every split.
  const std::string ns = "]<]minimax[>[";
  const std::string model_text = ns + "<tool_call>\n" + ns + "<invoke name=\"get_weather\">" + ns +
                                 "<city>Paris" + ns + "</city>" + ns + "</invoke>\n" + ns +
                                 "<invoke name=\"get_weather\">" + ns + "<city>Rome" + ns +
                                 "</city>" + ns + "</invoke>\n" + ns + "</tool_call>[e~[";
  const std::vector<int32_t> ids = tokenizer()->encode(model_text);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    ChoiceOptions o = chat_options(kWeatherTools);
    o.max_tool_calls = 1;
    ChoiceOutput out(o);
    Collected c = feed(out, ids, "stop", rng);
    ASSERT_EQ(out.tool_calls().size(), 1u);
    EXPECT_EQ(nlohmann::json::parse(out.tool_calls()[0].arguments_json),
              nlohmann::json::parse(R"({"city": "Paris"})"));
    EXPECT_EQ(out.finish_reason(), "tool_calls");
    EXPECT_EQ(c.args.count(1), 0u) << "the second call reached the stream";
    EXPECT_EQ(c.args[0], out.tool_calls()[0].arguments_json);
    EXPECT_EQ(out.text(), "");
  }
  ChoiceOutput all(chat_options(kWeatherTools));
  feed(all, ids, "stop", rng);
  EXPECT_EQ(all.tool_calls().size(), 2u);
}

TEST(ChoiceOutput, TagLikeSpecialTokenInsideAToolBlockIsAParameterTag) {
  // `<filename>` is one of M3's special code-marker tokens. A tool parameter of that name is
  // written with it; skipping special tokens must not drop the tag inside a tool block (the value
  // `a.txt` would then lose its parameter), while outside a block it is skipped as usual.
  const std::string ns = "]<]minimax[>[";
  const char* tools = R"([{"type": "function", "function": {"name": "save_file", "parameters":
      {"type": "object", "properties": {"filename": {"type": "string"},
      "content": {"type": "string"}}}}}])";
  const std::string model_text = "Saving<filename>." + ns + "<tool_call>\n" + ns +
                                 "<invoke name=\"save_file\">" + ns + "<filename>a.txt" + ns +
                                 "<content>hi" + ns + "</content>" + ns + "</invoke>\n" + ns +
                                 "</tool_call>[e~[";
  const std::vector<int32_t> ids = tokenizer()->encode(model_text);
  const auto tag = tokenizer()->token_to_id("<filename>");
  ASSERT_TRUE(tag.has_value());
  ASSERT_EQ(std::count(ids.begin(), ids.end(), *tag), 2) << "the test needs the special token";
  std::mt19937 rng(9);
  for (int trial = 0; trial < 10; ++trial) {
    ChoiceOutput out(chat_options(tools));
    feed(out, ids, "stop", rng);
    EXPECT_EQ(out.text(), "Saving.");
    ASSERT_EQ(out.tool_calls().size(), 1u);
    EXPECT_EQ(out.tool_calls()[0].arguments_json, R"({"filename":"a.txt","content":"hi"})");
  }
}

TEST(ChoiceOutput, EnabledThinkingStartsInsideReasoning) {
  ChoiceOptions o = chat_options(nullptr);
  o.chat->thinking_mode = text::ThinkingMode::kEnabled;
  ChoiceOutput out(o);
  std::mt19937 rng(5);
  feed(out, tokenizer()->encode("step one</mm:think>Answer: 4[e~["), "stop", rng);
  EXPECT_EQ(out.reasoning(), "step one");
  EXPECT_EQ(out.text(), "Answer: 4");
  EXPECT_EQ(out.finish_reason(), "stop");
}

TEST(ChoiceOutput, AdaptiveBareCloserIsDropped) {
  ChoiceOutput out(chat_options(nullptr));
  std::mt19937 rng(6);
  feed(out, tokenizer()->encode("</mm:think>Just the answer."), "length", rng);
  EXPECT_EQ(out.reasoning(), "");
  EXPECT_EQ(out.text(), "Just the answer.");
  EXPECT_EQ(out.finish_reason(), "length");
  EXPECT_EQ(out.num_reasoning_tokens(), 0);
}

TEST(ChoiceOutput, NoToolsMeansToolMarkupIsNotParsed) {
  ChoiceOutput out(chat_options(nullptr));
  std::mt19937 rng(7);
  feed(out, tokenizer()->encode("</mm:think>plain text[e~["), "stop", rng);
  EXPECT_TRUE(out.tool_calls().empty());
  EXPECT_EQ(out.finish_reason(), "stop");
}

TEST(ChoiceOutput, StopStringIsTrimmedAndEndsTheChoice) {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 20; ++trial) {
    ChoiceOptions o;
    o.tokenizer = tokenizer();
    o.stop = {"world"};
    ChoiceOutput out(o);
    Collected c = feed(out, tokenizer()->encode("hello world and more text"), "length", rng);
    EXPECT_TRUE(out.finished());
    EXPECT_TRUE(out.stop_string_hit());
    EXPECT_EQ(out.finish_reason(), "stop");
    EXPECT_EQ(out.text(), "hello ");
    EXPECT_EQ(c.content, "hello ");
    EXPECT_LT(out.num_output_tokens(),
              static_cast<int>(tokenizer()->encode("hello world and more text").size()));
  }
}

TEST(ChoiceOutput, StopTokenAndEosAreHiddenButCounted) {
  std::mt19937 rng(9);
  ChoiceOptions o;
  o.tokenizer = tokenizer();
  o.eos_token_ids = {id_of("[e~[")};
  ChoiceOutput out(o);
  auto ids = tokenizer()->encode("abc");
  const int32_t stop_id = ids.back();
  feed(out, ids, "stop", rng, stop_id);
  EXPECT_EQ(out.text(),
            tokenizer()->decode(std::vector<int32_t>(ids.begin(), ids.end() - 1), true));
  EXPECT_EQ(out.num_output_tokens(), static_cast<int>(ids.size()));

  ChoiceOutput out2(o);
  auto ids2 = tokenizer()->encode("abc[e~[");
  feed(out2, ids2, "stop", rng);
  EXPECT_EQ(out2.text(), "abc");
}

TEST(ChoiceOutput, SkipSpecialTokensControlsCompletionText) {
  std::mt19937 rng(10);
  const std::string text = "a]~b]b";
  ChoiceOptions o;
  o.tokenizer = tokenizer();
  o.skip_special_tokens = true;
  ChoiceOutput skip(o);
  feed(skip, tokenizer()->encode(text), "length", rng);
  EXPECT_EQ(skip.text(), "ab");
  o.skip_special_tokens = false;
  ChoiceOutput keep(o);
  feed(keep, tokenizer()->encode(text), "length", rng);
  EXPECT_EQ(keep.text(), text);
}

TEST(ChoiceOutput, LogprobsCarryTokenTexts) {
  ChoiceOptions o;
  o.tokenizer = tokenizer();
  ChoiceOutput out(o);
  auto ids = tokenizer()->encode("hi there");
  engine::RequestOutput r;
  r.new_token_ids = ids;
  for (int32_t id : ids) r.logprobs.push_back({id, -0.5f, {{id, -0.5f}, {ids[0], -1.5f}}});
  r.finished = true;
  r.finish_reason = "length";
  out.add(r);
  ASSERT_EQ(out.logprobs().size(), ids.size());
  std::string joined;
  for (const auto& lp : out.logprobs()) joined += lp.text;
  EXPECT_EQ(joined, "hi there");
  EXPECT_EQ(out.logprobs()[0].top.size(), 2u);
  Json j = chat_logprobs_json(out.logprobs());
  EXPECT_EQ(j["content"].size(), ids.size());
  EXPECT_EQ(j["content"][0]["top_logprobs"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["content"][0]["logprob"].get<double>(), -0.5);
}

TEST(ChoiceOutput, EngineErrorAndAbortAreReported) {
  ChoiceOptions o;
  o.tokenizer = tokenizer();
  ChoiceOutput out(o);
  engine::RequestOutput r;
  r.finished = true;
  r.finish_reason = "error";
  r.error = "boom";
  out.add(r);
  EXPECT_TRUE(out.finished());
  EXPECT_EQ(out.finish_reason(), "error");
  EXPECT_EQ(out.error(), "boom");
  // Nothing is added after the end.
  engine::RequestOutput more;
  more.new_token_ids = {1, 2};
  EXPECT_TRUE(out.add(more).empty());
  EXPECT_EQ(out.num_output_tokens(), 0);
}

}  // namespace
}  // namespace m3::server
