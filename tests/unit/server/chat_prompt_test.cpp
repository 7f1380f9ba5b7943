// ChatPrompt: template variables, default kwargs, tool_choice handling, thinking mode.
#include <gtest/gtest.h>

#include "server/chat_prompt.h"

namespace m3::server {
namespace {

// A small template that shows what it was given.
const char* kTemplate =
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "mode={{ thinking_mode | default('none') }}{% if add_generation_prompt %}<ai>{% endif %}";

ChatRequest request(const std::string& body) {
  auto r = parse_chat_request(body);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  return *r;
}

TEST(ChatPrompt, RendersWithDefaultsAndRequestKwargs) {
  auto p = ChatPrompt::from_source(kTemplate, OrderedJson{{"thinking_mode", "disabled"}},
                                   OrderedJson{{"bos_token", "<s>"}});
  ASSERT_TRUE(p.has_value()) << p.error().message;
  auto r = p->render(request(R"({"messages": [{"role": "user", "content": "hi"}]})"));
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->prompt, "<s><user>hi</user>mode=disabled<ai>");
  EXPECT_EQ(r->thinking_mode, text::ThinkingMode::kDisabled);
  r = p->render(request(
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking_mode": "enabled"}, "add_generation_prompt": false})"));
  EXPECT_EQ(r->prompt, "<s><user>hi</user>mode=enabled");
  EXPECT_EQ(r->thinking_mode, text::ThinkingMode::kEnabled);
  auto bad = p->render(request(
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking_mode": "sometimes"}})"));
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().param, "chat_template_kwargs.thinking_mode");
}

TEST(ChatPrompt, ToolChoiceShapesThePrompt) {
  auto p = ChatPrompt::from_source(kTemplate, OrderedJson::object());
  ASSERT_TRUE(p.has_value());
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}])";
  auto r = p->render(request(R"({"messages": [{"role": "user", "content": "x"}], )" + tools + "}"));
  EXPECT_EQ(r->prompt, "<user>x</user>[tools:a;b;]mode=none<ai>");
  // none: the model is not shown the tools.
  r = p->render(request(
      R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none", )" + tools + "}"));
  EXPECT_EQ(r->prompt, "<user>x</user>mode=none<ai>");
  EXPECT_TRUE(r->tools.is_null());
  // required and a named function: the same prompt as auto (all tools, no added text, as vLLM);
  // the tool-call grammar enforces the choice.
  r = p->render(
      request(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", )" +
              tools + "}"));
  EXPECT_EQ(r->prompt, "<user>x</user>[tools:a;b;]mode=none<ai>");
  r = p->render(request(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "b"}}, )" +
      tools + "}"));
  EXPECT_EQ(r->prompt, "<system>S</system><user>x</user>[tools:a;b;]mode=none<ai>");
  ASSERT_EQ(r->tools.size(), 2u);
}

TEST(ChatPrompt, ContinueFinalMessageCutsAfterIt) {
  auto p = ChatPrompt::from_source(kTemplate, OrderedJson::object());
  auto r = p->render(request(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}], "continue_final_message": true})"));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->prompt, "<user>x</user><assistant>The answer is");
}

TEST(ChatPrompt, BadTemplateFileNamesTheFlag) {
  auto bad = ChatPrompt::load("/nonexistent-dir", "/nonexistent-file.jinja", OrderedJson::object());
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().param, "--chat-template");
}

TEST(ChatPrompt, TemplateRuntimeErrorsAre400) {
  auto p =
      ChatPrompt::from_source("{{ raise_exception('no system allowed') }}", OrderedJson::object());
  ASSERT_TRUE(p.has_value());
  auto r = p->render(request(R"({"messages": [{"role": "user", "content": "x"}]})"));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message.find("no system allowed"), std::string::npos);
}

}  // namespace
}  // namespace m3::server
