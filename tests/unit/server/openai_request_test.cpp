// Request parsing and validation: every bad input is a 400-class Error naming the parameter.
#include <gtest/gtest.h>

#include "server/api_error.h"
#include "server/openai_request.h"

namespace m3::server {
namespace {

Error chat_error(const std::string& body) {
  auto r = parse_chat_request(body);
  EXPECT_FALSE(r.has_value()) << body;
  return r ? Error{} : r.error();
}

Error completion_error(const std::string& body) {
  auto r = parse_completion_request(body);
  EXPECT_FALSE(r.has_value()) << body;
  return r ? Error{} : r.error();
}

TEST(OpenAIRequest, ParsesAFullChatRequest) {
  auto r = parse_chat_request(R"({
    "model": "m3", "messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "n": 3, "seed": 7,
    "max_completion_tokens": 33, "stop": "END", "stream": true,
    "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 4,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
    "min_tokens": 2, "ignore_eos": true, "stop_token_ids": [5, 6], "skip_special_tokens": false,
    "priority": -3, "chat_template_kwargs": {"thinking_mode": "disabled"}})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->messages[1]["content"], "a\nb");
  EXPECT_EQ(r->common.n, 3);
  EXPECT_EQ(*r->common.max_tokens, 33);
  EXPECT_EQ(r->common.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r->common.stream);
  EXPECT_TRUE(r->common.include_usage);
  EXPECT_EQ(r->common.logprobs, 4);
  EXPECT_EQ(r->common.priority, -3);
  EXPECT_EQ(r->chat_template_kwargs["thinking_mode"], "disabled");
  EXPECT_EQ(r->tool_choice.kind, ToolChoiceKind::kNone);  // no tools

  GenerationDefaults d;
  d.temperature = 1.0f;
  d.top_k = 20;
  auto sp = make_sampling_params(r->common, d);
  EXPECT_FLOAT_EQ(sp.temperature, 0.5f);  // request wins over the model default
  EXPECT_EQ(sp.top_k, 40);
  EXPECT_FLOAT_EQ(sp.min_p, 0.1f);
  EXPECT_EQ(sp.max_tokens, 33);
  EXPECT_EQ(sp.min_tokens, 2);
  EXPECT_TRUE(sp.ignore_eos);
  EXPECT_EQ(sp.stop_token_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(*sp.seed, 7u);
  EXPECT_EQ(sp.logprobs, 4);
}

TEST(OpenAIRequest, ParallelToolCalls) {
  auto r = parse_chat_request(R"({"model": "m", "messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->parallel_tool_calls);
  r = parse_chat_request(
      R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": false})");
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->parallel_tool_calls);
  EXPECT_FALSE(
      parse_chat_request(
          R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "no"})")
          .has_value());
}

TEST(OpenAIRequest, ModelDefaultsFillOmittedKnobs) {
  auto r = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_TRUE(r.has_value());
  auto d = GenerationDefaults::from_json_text(R"({"temperature": 0.7, "top_p": 0.95, "top_k": 40})",
                                              "g");
  ASSERT_TRUE(d.has_value());
  auto sp = make_sampling_params(r->common, *d);
  EXPECT_FLOAT_EQ(sp.temperature, 0.7f);
  EXPECT_FLOAT_EQ(sp.top_p, 0.95f);
  EXPECT_EQ(sp.top_k, 40);
  auto none = make_sampling_params(r->common, GenerationDefaults{});
  EXPECT_FLOAT_EQ(none.temperature, 1.0f);
  EXPECT_EQ(none.logprobs, -1);
  auto greedy = GenerationDefaults::from_json_text(R"({"do_sample": false})", "g");
  EXPECT_FLOAT_EQ(*greedy->temperature, 0.0f);
}

TEST(OpenAIRequest, RejectsMalformedJson) {
  Error e = chat_error("{\"messages\": [");
  EXPECT_EQ(http_status(e), 400);
  EXPECT_NE(e.message.find("not valid JSON"), std::string::npos);
  e = chat_error("[1, 2]");
  EXPECT_EQ(http_status(e), 400);
}

TEST(OpenAIRequest, RejectsWrongTypesNamingTheParameter) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  struct Case {
    std::string field;
    std::string param;
  };
  for (const Case& c : std::vector<Case>{{R"("temperature": "hot")", "temperature"},
                                         {R"("max_tokens": 1.5)", "max_tokens"},
                                         {R"("n": true)", "n"},
                                         {R"("stream": "yes")", "stream"},
                                         {R"("stop": 5)", "stop"},
                                         {R"("stop": ["a", 1])", "stop"},
                                         {R"("seed": "x")", "seed"},
                                         {R"("top_k": 1.5)", "top_k"},
                                         {R"("logprobs": 3)", "logprobs"},
                                         {R"("tools": {})", "tools"},
                                         {R"("tool_choice": 3)", "tool_choice"},
                                         {R"("chat_template_kwargs": [])", "chat_template_kwargs"},
                                         {R"("stream_options": 1)", "stream_options"}}) {
    Error e = chat_error("{" + msgs + ", " + c.field + "}");
    EXPECT_EQ(e.param, c.param) << c.field;
    EXPECT_EQ(http_status(e), 400) << c.field;
    EXPECT_EQ(error_body(e)["error"]["param"], c.param);
    EXPECT_EQ(error_body(e)["error"]["type"], "invalid_request_error");
  }
}

TEST(OpenAIRequest, RejectsOutOfRangeValues) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  struct Case {
    std::string field;
    std::string param;
  };
  for (const Case& c :
       std::vector<Case>{{R"("temperature": -0.1)", "temperature"},
                         {R"("top_p": 0)", "top_p"},
                         {R"("top_p": 1.5)", "top_p"},
                         {R"("min_p": 2)", "min_p"},
                         {R"("top_k": -2)", "top_k"},
                         {R"("n": 0)", "n"},
                         {R"("n": 100000)", "n"},
                         {R"("max_tokens": 0)", "max_tokens"},
                         {R"("max_completion_tokens": -5)", "max_completion_tokens"},
                         {R"("presence_penalty": 3)", "presence_penalty"},
                         {R"("frequency_penalty": -2.5)", "frequency_penalty"},
                         {R"("repetition_penalty": 0)", "repetition_penalty"},
                         {R"("logprobs": true, "top_logprobs": 21)", "top_logprobs"},
                         {R"("top_logprobs": 2)", "top_logprobs"},
                         {R"("max_tokens": 5, "min_tokens": 6)", "min_tokens"},
                         {R"("stop_token_ids": [-1])", "stop_token_ids"}}) {
    Error e = chat_error("{" + msgs + ", " + c.field + "}");
    EXPECT_EQ(e.param, c.param) << c.field;
    EXPECT_EQ(http_status(e), 400) << c.field;
  }
}

TEST(OpenAIRequest, ValidatesMessages) {
  EXPECT_EQ(chat_error(R"({"model": "m3"})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": []})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": "hi"})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": [{"content": "x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user"}]})").param, "messages[0].content");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": 5}]})").param,
            "messages[0].content");
  Error audio = chat_error(
      R"({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})");
  EXPECT_EQ(audio.param, "messages[0].content[0]");
  EXPECT_EQ(audio.code, ErrorCode::kUnsupported);
  EXPECT_EQ(http_status(audio), 400);
  EXPECT_EQ(
      chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})").param,
      "messages[0].content[0].image_url");
  EXPECT_EQ(
      chat_error(
          R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}]})")
          .param,
      "messages[0].content[0].image_url");
}

// Image and video parts: their URLs are collected in order and the content stays a list of
// parts, so the chat template writes a placeholder for each.
TEST(OpenAIRequest, CollectsMediaParts) {
  auto r = parse_chat_request(R"({"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "a"},
      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
      {"type": "image_url", "image_url": "file:///x.png"},
      {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  ASSERT_EQ(r->media.size(), 3u);
  EXPECT_EQ(r->media[0].kind, "image");
  EXPECT_EQ(r->media[0].url, "data:image/png;base64,AAAA");
  EXPECT_EQ(r->media[0].param, "messages[1].content[1]");
  EXPECT_EQ(r->media[1].url, "file:///x.png");
  EXPECT_EQ(r->media[2].kind, "video");
  const auto& c = r->messages[1]["content"];
  ASSERT_TRUE(c.is_array());
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0]["text"], "a");
  EXPECT_EQ(c[1]["type"], "image");
  EXPECT_EQ(c[3]["type"], "video");
  EXPECT_TRUE(r->messages[0]["content"].is_string());
}

TEST(OpenAIRequest, AssistantHistoryIsNormalisedForTemplates) {
  auto r = parse_chat_request(R"({"messages": [
    {"role": "user", "content": "w?"},
    {"role": "assistant", "reasoning": "think", "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  const auto& a = r->messages[1];
  EXPECT_TRUE(a["content"].is_null());
  EXPECT_EQ(a["reasoning_content"], "think");
  EXPECT_EQ(a["tool_calls"][0]["function"]["arguments"]["a"], 1);
}

TEST(OpenAIRequest, ToolChoiceForms) {
  const std::string base =
      R"("messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])";
  auto r = parse_chat_request("{" + base + "}");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->tool_choice.kind, ToolChoiceKind::kAuto);
  r = parse_chat_request("{" + base + R"(, "tool_choice": "required"})");
  EXPECT_EQ(r->tool_choice.kind, ToolChoiceKind::kRequired);
  r = parse_chat_request(
      "{" + base +
      R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})");
  EXPECT_EQ(r->tool_choice.kind, ToolChoiceKind::kNamed);
  EXPECT_EQ(r->tool_choice.name, "get_weather");
  EXPECT_EQ(chat_error("{" + base +
                       R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}}})")
                .param,
            "tool_choice");
  EXPECT_EQ(chat_error("{" + base + R"(, "tool_choice": "sometimes"})").param, "tool_choice");
  EXPECT_EQ(
      chat_error(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})")
          .param,
      "tool_choice");
  EXPECT_EQ(
      chat_error(
          R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]})")
          .param,
      "tools[0].function.name");
}

TEST(OpenAIRequest, UnsupportedFeaturesAreNamed) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_TRUE(
      parse_chat_request("{" + msgs + R"(, "response_format": {"type": "text"}})").has_value());
  EXPECT_EQ(chat_error("{" + msgs + R"(, "best_of": 3})").param, "best_of");
  EXPECT_EQ(
      chat_error("{" + msgs + R"(, "structured_outputs": {"whitespace_pattern": " "}})").param,
      "structured_outputs.whitespace_pattern");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "guided_whitespace_pattern": " "})").param,
            "guided_whitespace_pattern");
}

// response_format, structured_outputs and the guided_* aliases become one StructuredOutputSpec
// naming its field; conflicting or malformed ones are refused by name.
TEST(OpenAIRequest, StructuredOutputFields) {
  using K = text::StructuredOutputSpec::Kind;
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  auto spec = [&](const std::string& extra) {
    auto r = parse_chat_request("{" + msgs + ", " + extra + "}");
    EXPECT_TRUE(r.has_value()) << extra << ": " << (r ? "" : r.error().message);
    return r && r->common.structured ? *r->common.structured : text::StructuredOutputSpec{};
  };
  auto s = spec(R"("response_format": {"type": "json_object"})");
  EXPECT_EQ(s.kind, K::kJsonObject);
  EXPECT_EQ(s.param, "response_format");
  s = spec(
      R"("response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true,
           "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}})");
  EXPECT_EQ(s.kind, K::kJsonSchema);
  EXPECT_EQ(s.param, "response_format.json_schema.schema");
  EXPECT_LT(s.value.find("\"b\""), s.value.find("\"a\""));  // property order kept
  s = spec(R"("structured_outputs": {"regex": "[0-9]+"})");
  EXPECT_EQ(s.kind, K::kRegex);
  EXPECT_EQ(s.value, "[0-9]+");
  EXPECT_EQ(s.param, "structured_outputs.regex");
  s = spec(R"("structured_outputs": {"choice": ["a", "b"], "disable_fallback": true})");
  EXPECT_EQ(s.kind, K::kChoice);
  EXPECT_EQ(s.choices, (std::vector<std::string>{"a", "b"}));
  s = spec(R"("structured_outputs": {"grammar": "root ::= \"x\""})");
  EXPECT_EQ(s.kind, K::kGrammar);
  s = spec(R"("structured_outputs": {"json_object": true})");
  EXPECT_EQ(s.kind, K::kJsonObject);
  s = spec(R"("guided_json": "{\"type\": \"object\"}")");
  EXPECT_EQ(s.kind, K::kJsonSchema);
  EXPECT_EQ(s.param, "guided_json");
  s = spec(R"("guided_choice": ["x"], "guided_decoding_backend": "xgrammar")");
  EXPECT_EQ(s.kind, K::kChoice);
  EXPECT_EQ(spec(R"("guided_regex": "a+")").param, "guided_regex");
  EXPECT_EQ(spec(R"("guided_grammar": "root ::= \"a\"")").param, "guided_grammar");
  auto r = parse_completion_request(R"({"prompt": "x", "structured_outputs": {"choice": ["a"]}})");
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->common.structured.has_value());

  EXPECT_EQ(chat_error("{" + msgs + R"(, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}})")
                .param,
            "structured_outputs.regex");
  EXPECT_EQ(
      chat_error("{" + msgs + R"(, "structured_outputs": {"regex": "a", "choice": ["b"]}})").param,
      "structured_outputs.choice");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "response_format": {"type": "json_schema"}})").param,
            "response_format.json_schema");
  EXPECT_EQ(
      chat_error("{" + msgs +
                 R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})")
          .param,
      "response_format.json_schema.schema");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "response_format": {"type": "yaml"}})").param,
            "response_format.type");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "structured_outputs": {"choice": []}})").param,
            "structured_outputs.choice");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "structured_outputs": {"regex": 5}})").param,
            "structured_outputs.regex");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "structured_outputs": {"jsn": {}}})").param,
            "structured_outputs.jsn");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "guided_json": "not json"})").param, "guided_json");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "structured_outputs": {"backend": "outlines"}})").param,
            "structured_outputs.backend");
}

// response_format structural_tag in vLLM's two forms, and structured_outputs.structural_tag as
// JSON text, become xgrammar's structural-tag format; a malformed one is a 400 naming its field.
TEST(OpenAIRequest, StructuralTagForms) {
  using K = text::StructuredOutputSpec::Kind;
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  auto spec = [&](const std::string& extra) {
    auto r = parse_chat_request("{" + msgs + ", " + extra + "}");
    EXPECT_TRUE(r.has_value()) << extra << ": " << (r ? "" : r.error().message);
    return r && r->common.structured ? *r->common.structured : text::StructuredOutputSpec{};
  };
  auto s = spec(R"("response_format": {"type": "structural_tag", "triggers": ["<f="],
      "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]})");
  EXPECT_EQ(s.kind, K::kStructuralTag);
  EXPECT_EQ(s.param, "response_format");
  const auto legacy = nlohmann::json::parse(s.value);
  EXPECT_EQ(legacy["type"], "triggered_tags");
  EXPECT_EQ(legacy["triggers"], nlohmann::json::parse(R"(["<f="])"));
  EXPECT_EQ(legacy["tags"][0]["begin"], "<f=a>");
  EXPECT_EQ(legacy["tags"][0]["content"]["json_schema"], nlohmann::json::parse(R"({"type":
      "object"})"));
  s = spec(R"("response_format": {"type": "structural_tag", "format": {"type": "const_string",
      "value": "ok"}})");
  EXPECT_EQ(nlohmann::json::parse(s.value), nlohmann::json::parse(R"({"type": "const_string",
      "value": "ok"})"));
  s = spec(R"("structured_outputs": {"structural_tag":
      "{\"type\": \"structural_tag\", \"format\": {\"type\": \"regex\", \"pattern\": \"a+\"}}"})");
  EXPECT_EQ(s.kind, K::kStructuralTag);
  EXPECT_EQ(s.param, "structured_outputs.structural_tag");

  const auto param_of = [&](const std::string& extra) {
    return chat_error("{" + msgs + ", " + extra + "}").param;
  };
  EXPECT_EQ(param_of(R"("response_format": {"type": "structural_tag"})"), "response_format");
  EXPECT_EQ(param_of(R"("response_format": {"type": "structural_tag", "structures": [
      {"begin": "<a>", "end": "</a>"}]})"),
            "response_format");  // no triggers
  EXPECT_EQ(param_of(R"("response_format": {"type": "structural_tag", "triggers": ["<b"],
      "structures": [{"begin": "<a>", "end": "</a>"}]})"),
            "response_format");  // begin matches no trigger
  EXPECT_EQ(param_of(R"("response_format": {"type": "structural_tag", "format": 3})"),
            "response_format");
  EXPECT_EQ(param_of(R"("structured_outputs": {"structural_tag": "{nope"})"),
            "structured_outputs.structural_tag");
  const Error e = chat_error("{" + msgs + R"(, "response_format": {"type": "structural_tag"}})");
  EXPECT_NE(e.message.find("\"format\""), std::string::npos) << e.message;
  EXPECT_EQ(e.code, ErrorCode::kInvalidArgument);
}

TEST(OpenAIRequest, LogitBiasAllowedTokenIdsAndBadWords) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  auto r = parse_chat_request("{" + msgs + R"(, "logit_bias": {"5": 1.5, "7": -300, "9": 250},
                              "allowed_token_ids": [1, 2, 3], "bad_words": ["foo", " bar baz"]})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  using P = std::pair<int32_t, float>;
  EXPECT_EQ(r->common.logit_bias, (std::vector<P>{{5, 1.5f}, {7, -100.f}, {9, 100.f}}));  // clamped
  EXPECT_EQ(r->common.allowed_token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r->common.bad_words, (std::vector<std::string>{"foo", " bar baz"}));
  const auto sp = make_sampling_params(r->common, GenerationDefaults{});
  EXPECT_EQ(sp.logit_bias.size(), 3u);
  EXPECT_EQ(sp.allowed_token_ids.size(), 3u);
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"x": 1}})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"-1": 1}})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"1": "a"}})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": [1]})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "allowed_token_ids": []})").param, "allowed_token_ids");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "allowed_token_ids": ["a"]})").param, "allowed_token_ids");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "bad_words": [""]})").param, "bad_words[0]");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "bad_words": "x"})").param, "bad_words");
}

TEST(OpenAIRequest, CompletionPromptForms) {
  auto r = parse_completion_request(R"({"prompt": "hello"})");
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_TRUE(r->prompts[0].is_text);
  r = parse_completion_request(R"({"prompt": ["a", "b"]})");
  ASSERT_EQ(r->prompts.size(), 2u);
  r = parse_completion_request(R"({"prompt": [1, 2, 3]})");
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0].token_ids, (std::vector<int32_t>{1, 2, 3}));
  r = parse_completion_request(R"({"prompt": [[1, 2], [3]], "echo": true, "logprobs": 2})");
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_TRUE(r->echo);
  EXPECT_EQ(r->common.logprobs, 2);
  EXPECT_EQ(completion_error(R"({})").param, "prompt");
  EXPECT_EQ(completion_error(R"({"prompt": ""})").param, "prompt");
  EXPECT_EQ(completion_error(R"({"prompt": []})").param, "prompt");
  EXPECT_EQ(completion_error(R"({"prompt": [1, "a"]})").param, "prompt");
  EXPECT_EQ(completion_error(R"({"prompt": [1, -4]})").param, "prompt");
  EXPECT_EQ(completion_error(R"({"prompt": ["a", 5]})").param, "prompt[1]");
  EXPECT_EQ(completion_error(R"({"prompt": [[1], []]})").param, "prompt[1]");
  EXPECT_EQ(completion_error(R"({"prompt": "x", "logprobs": 21})").param, "logprobs");
  EXPECT_EQ(completion_error(R"({"prompt": "x", "logprobs": true})").param, "logprobs");
  EXPECT_EQ(completion_error(R"({"prompt": "x", "suffix": "y"})").param, "suffix");
}

TEST(OpenAIRequest, VllmExtraFields) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  auto r = parse_chat_request("{" + msgs + R"(, "include_reasoning": false,
      "thinking_token_budget": 12, "echo": true, "truncate_prompt_tokens": 9,
      "prompt_logprobs": 3, "return_token_ids": true, "return_tokens_as_token_ids": true,
      "use_beam_search": false})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_FALSE(r->include_reasoning);
  EXPECT_EQ(r->thinking_token_budget.value_or(-1), 12);
  EXPECT_TRUE(r->echo);
  EXPECT_EQ(r->common.truncate_prompt_tokens.value_or(0), 9);
  EXPECT_EQ(r->common.prompt_logprobs, 3);
  EXPECT_TRUE(r->common.return_token_ids && r->common.return_tokens_as_token_ids);
  EXPECT_EQ(make_sampling_params(r->common, {}).prompt_logprobs, 3);
  // -1 is "no budget" and "the last max_model_len tokens".
  r = parse_chat_request("{" + msgs + R"(, "thinking_token_budget": -1,
      "truncate_prompt_tokens": -1})");
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->thinking_token_budget.has_value());
  EXPECT_EQ(r->common.truncate_prompt_tokens.value_or(0), -1);
  for (const auto& [extra, param] : std::vector<std::pair<std::string, std::string>>{
           {R"("use_beam_search": true)", "use_beam_search"},
           {R"("truncate_prompt_tokens": 0)", "truncate_prompt_tokens"},
           {R"("truncate_prompt_tokens": -3)", "truncate_prompt_tokens"},
           {R"("prompt_logprobs": -1)", "prompt_logprobs"},
           {R"("prompt_logprobs": 21)", "prompt_logprobs"},
           {R"("prompt_logprobs": 1, "stream": true)", "prompt_logprobs"},
           {R"("thinking_token_budget": -2)", "thinking_token_budget"},
           {R"("include_reasoning": "no")", "include_reasoning"},
           {R"("echo": 1)", "echo"},
           {R"("return_token_ids": "yes")", "return_token_ids"}}) {
    EXPECT_EQ(chat_error("{" + msgs + ", " + extra + "}").param, param) << extra;
  }
  EXPECT_EQ(chat_error("{" + msgs + R"(, "use_beam_search": true})").code, ErrorCode::kUnsupported);
}

TEST(OpenAIRequest, MaxLogprobsIsTheServersLimit) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  const std::string body = "{" + msgs + R"(, "logprobs": true, "top_logprobs": 30})";
  EXPECT_FALSE(parse_chat_request(body).has_value());  // the default --max-logprobs is 20
  EXPECT_TRUE(parse_chat_request(body, 30).has_value());
  auto e = parse_chat_request(body, 5);
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.error().param, "top_logprobs");
  EXPECT_NE(e.error().message.find("Requested sample logprobs of 30, which is greater than max "
                                   "allowed: 5"),
            std::string::npos);
  EXPECT_TRUE(parse_completion_request(R"({"prompt": "x", "logprobs": 40})", 40).has_value());
  auto c = parse_completion_request(R"({"prompt": "x", "prompt_logprobs": 6})", 5);
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.error().message.find("Requested prompt logprobs of 6"), std::string::npos);
}

TEST(ApiError, StatusAndBodyPerCode) {
  EXPECT_EQ(http_status(Error{ErrorCode::kUnauthorized, "x", ""}), 401);
  EXPECT_EQ(http_status(Error{ErrorCode::kModelNotFound, "x", "model"}), 404);
  EXPECT_EQ(http_status(Error{ErrorCode::kQueueFull, "x", ""}), 429);
  EXPECT_EQ(http_status(Error{ErrorCode::kUnavailable, "x", ""}), 503);
  EXPECT_EQ(http_status(Error{ErrorCode::kInternal, "x", ""}), 500);
  auto b = error_body(Error{ErrorCode::kContextLength, "too long", "messages"});
  EXPECT_EQ(b["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(b["error"]["param"], "messages");
  EXPECT_EQ(b["error"]["message"], "too long");
  EXPECT_TRUE(error_body(Error{ErrorCode::kInternal, "x", ""})["error"]["param"].is_null());
  // Invalid UTF-8 in a message must not throw when dumped.
  EXPECT_NO_THROW(error_json(Error{ErrorCode::kInvalidArgument, std::string("bad \xff byte"), ""}));
}

}  // namespace
}  // namespace m3::server

namespace m3::server {
namespace {

TEST(OpenAIRequest, KvTransferParamsAsTheRouterSendsThem) {
  // vllm-router's prefill request: do_remote_decode, the rest null.
  auto pre = parse_completion_request(
      R"({"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true,
          "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
          "remote_host": null, "remote_port": null}})");
  ASSERT_TRUE(pre.has_value()) << pre.error().message;
  ASSERT_TRUE(pre->common.kv_transfer.has_value());
  EXPECT_TRUE(pre->common.kv_transfer->do_remote_decode);
  EXPECT_FALSE(pre->common.kv_transfer->do_remote_prefill);
  // The decode request: the prefill worker's answer, passed through (block ids flat or nested
  // per KV cache group as newer vLLM writes them).
  for (const char* ids : {"[4, 5, 6]", "[[4, 5, 6]]"}) {
    const std::string body =
        std::string(R"({"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params":
            {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "m3-ab",
             "remote_request_id": "17", "remote_host": "10.0.0.2", "remote_port": 5601,
             "tp_size": 1, "remote_block_ids": )") +
        ids + "}}";
    auto dec = parse_chat_request(body);
    ASSERT_TRUE(dec.has_value()) << dec.error().message;
    const auto& k = *dec->common.kv_transfer;
    EXPECT_TRUE(k.do_remote_prefill);
    EXPECT_EQ(k.remote_engine_id, "m3-ab");
    EXPECT_EQ(k.remote_request_id, "17");
    EXPECT_EQ(k.remote_host, "10.0.0.2");
    EXPECT_EQ(k.remote_port, 5601);
    EXPECT_EQ(k.remote_block_ids, (std::vector<int64_t>{4, 5, 6}));
    // What a prefill worker answers round-trips through the same field names.
    const OrderedJson back = kv_transfer_params_json(k);
    EXPECT_EQ(back["remote_block_ids"], OrderedJson::parse("[4, 5, 6]"));
    EXPECT_EQ(back["remote_engine_id"], "m3-ab");
    EXPECT_EQ(back["remote_port"], 5601);
    EXPECT_EQ(back["do_remote_prefill"], true);
  }
  // Neither flag set (or null params): no transfer.
  auto none = parse_completion_request(R"({"prompt": "hi", "kv_transfer_params": {}})");
  ASSERT_TRUE(none.has_value());
  EXPECT_FALSE(none->common.kv_transfer.has_value());
  // Bad shapes name the field.
  for (
      const char* bad : {
          R"({"prompt": "hi", "kv_transfer_params": 3})",
          R"({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true, "remote_port": 99999}})",
          R"({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [-1]}})",
          R"({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": 5}})",
          R"({"prompt": "hi", "n": 2, "kv_transfer_params": {"do_remote_decode": true}})",
      }) {
    auto r = parse_completion_request(bad);
    ASSERT_FALSE(r.has_value()) << bad;
    EXPECT_EQ(r.error().param, "kv_transfer_params") << bad;
  }
}

}  // namespace
}  // namespace m3::server
