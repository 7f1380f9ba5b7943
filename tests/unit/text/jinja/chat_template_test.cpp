// ChatTemplate against transformers.apply_chat_template goldens (built-in MiniMax-M3 template,
// a MiniMax-M2-style template, Qwen3's real template), plus loading and request validation.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "text/builtin_templates.h"
#include "text/chat_template.h"
#include "unit/text/jinja/golden_util.h"

namespace m3::text {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using test::golden_dir;
using test::goldens;
using test::read_text;

ChatRequest request_of(const ordered_json& c) {
  ChatRequest r;
  r.messages = c.at("messages");
  r.tools = c.at("tools");
  r.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
  r.chat_template_kwargs = c.at("kwargs");
  return r;
}

void expect_matches_golden(const ChatTemplate& tpl, const ordered_json& c) {
  auto out = tpl.render(request_of(c));
  if (c.contains("expected")) {
    ASSERT_TRUE(out) << out.error().message;
    EXPECT_EQ(*out, c.at("expected").get<std::string>());
  } else {
    ASSERT_FALSE(out) << "rendered: " << *out;
    EXPECT_NE(out.error().message.find(c.at("error").get<std::string>()), std::string::npos)
        << out.error().message;
    EXPECT_NE(
        out.error().message.find("line " + std::to_string(c.at("error_line").get<int>()) + ","),
        std::string::npos)
        << out.error().message;
  }
}

TEST(ChatTemplate, BuiltinIsTheGoldenFile) {
  EXPECT_EQ(std::string(kMiniMaxM3ChatTemplate), read_text(golden_dir() + "/minimax_m3.jinja"));
  ChatTemplate t = ChatTemplate::builtin_m3();
  EXPECT_TRUE(t.is_builtin());
}

TEST(ChatTemplate, MiniMaxGoldens) {
  int checked = 0;
  const std::string m2 = read_text(golden_dir() + "/minimax_m2_style.jinja");
  for (const auto& c : goldens().at("chats")) {
    const std::string id = c.at("template").get<std::string>();
    if (id == "qwen3") continue;
    SCOPED_TRACE(c.at("name").get<std::string>());
    if (id == "minimax_m3") {
      expect_matches_golden(ChatTemplate::builtin_m3(), c);
    } else {
      ASSERT_EQ(id, "minimax_m2_style");
      auto t = ChatTemplate::from_string(m2, "minimax_m2_style.jinja", c.at("special_tokens"));
      ASSERT_TRUE(t) << t.error().message;
      expect_matches_golden(*t, c);
    }
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

TEST(ChatTemplate, Qwen3Goldens) {
  if (!fs::exists(test::qwen3_dir() + "/tokenizer_config.json"))
    GTEST_SKIP() << "Qwen3 fixture absent";
  auto t = ChatTemplate::from_model_dir(test::qwen3_dir());
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_FALSE(t->is_builtin());
  EXPECT_EQ(t->special_tokens().dump(),
            R"({"eos_token":"<|im_end|>","pad_token":"<|endoftext|>"})");
  int checked = 0;
  for (const auto& c : goldens().at("chats")) {
    if (c.at("template") != "qwen3") continue;
    SCOPED_TRACE(c.at("name").get<std::string>());
    expect_matches_golden(*t, c);
    ++checked;
  }
  EXPECT_GE(checked, 7);
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("m3_chat_template_test_" + std::to_string(::getpid()) +
                                         "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  fs::path path_;
  static inline int counter_ = 0;
};

ChatRequest hello() {
  ChatRequest r;
  r.messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  return r;
}

TEST(ChatTemplate, LoadsTemplateSourcesInOrder) {
  TempDir dir;
  // tokenizer_config.json with AddedToken-style tokens and a string template.
  dir.write("tokenizer_config.json",
            R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
    "unk_token": null, "chat_template": "{{ bos_token }}cfg:{{ messages[0].content }}{{ eos_token }}"})");
  auto a = ChatTemplate::from_model_dir(dir.path());
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(*a->render(hello()), "<s>cfg:hi</s>");
  // chat_template.jinja wins over tokenizer_config.json.
  dir.write("chat_template.jinja", "{{ bos_token }}file:{{ messages | length }}\n");
  auto b = ChatTemplate::from_model_dir(dir.path());
  ASSERT_TRUE(b) << b.error().message;
  EXPECT_EQ(*b->render(hello()), "<s>file:1");
  // --chat-template FILE keeps the directory's tokens.
  dir.write("override.jinja", "{{ eos_token }}override");
  auto c = ChatTemplate::from_model_dir(dir.path(), dir.path() / "override.jinja");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(*c->render(hello()), "</s>override");
  auto d = ChatTemplate::from_file(dir.path() / "override.jinja");
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ(*d->render(hello()), "override");
}

TEST(ChatTemplate, NamedTemplatesPickToolUseWhenToolsGiven) {
  TempDir dir;
  dir.write("tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "plain"},
    {"name": "tool_use", "template": "tools={{ tools | length }}"}]})");
  auto t = ChatTemplate::from_model_dir(dir.path());
  ASSERT_TRUE(t) << t.error().message;
  ChatRequest r = hello();
  EXPECT_EQ(*t->render(r), "plain");
  r.tools = ordered_json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  EXPECT_EQ(*t->render(r), "tools=1");
}

TEST(ChatTemplate, FallsBackToBuiltinWhenModelHasNone) {
  TempDir dir;
  dir.write("tokenizer_config.json", R"({"eos_token": "[e~["})");
  auto t = ChatTemplate::from_model_dir(dir.path());
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_TRUE(t->is_builtin());
  auto out = t->render(hello());
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(out->rfind("]~!b[]~b]system\n", 0), 0u);
  EXPECT_NE(out->find("]~b]user\nhi[e~[\n]~b]ai\n"), std::string::npos);
}

TEST(ChatTemplate, LoadErrorsNameTheFile) {
  auto missing = ChatTemplate::from_model_dir("/nonexistent/m3/model");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
  EXPECT_NE(missing.error().message.find("/nonexistent/m3/model"), std::string::npos);
  TempDir dir;
  dir.write("tokenizer_config.json", "{not json");
  auto bad = ChatTemplate::from_model_dir(dir.path());
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code, ErrorCode::kFormat);
  EXPECT_NE(bad.error().message.find("tokenizer_config.json"), std::string::npos);
  TempDir dir2;
  dir2.write("chat_template.jinja", "line one\n{% for x in y %}\nno end");
  auto syntax = ChatTemplate::from_model_dir(dir2.path());
  ASSERT_FALSE(syntax);
  EXPECT_NE(syntax.error().message.find("chat_template.jinja: line 3, column 7"), std::string::npos)
      << syntax.error().message;
}

TEST(ChatTemplate, RequestValidation) {
  ChatTemplate t = ChatTemplate::builtin_m3();
  ChatRequest empty;
  auto e = t.render(empty);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().param, "messages");
  ChatRequest bad_tools = hello();
  bad_tools.tools = "nope";
  EXPECT_EQ(t.render(bad_tools).error().param, "tools");
  ChatRequest clash = hello();
  clash.chat_template_kwargs = {{"messages", 1}};
  EXPECT_EQ(t.render(clash).error().param, "chat_template_kwargs");
  ChatRequest bad_args;
  bad_args.messages =
      ordered_json::parse(R"([{"role": "user", "content": "q"}, {"role": "assistant",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])");
  auto a = t.render(bad_args);
  ASSERT_FALSE(a);
  EXPECT_NE(
      a.error().message.find("messages[1].tool_calls[0].function.arguments is not valid JSON"),
      std::string::npos);
}

TEST(ChatTemplate, ReasoningAliasesAndNullKeys) {
  auto t = ChatTemplate::from_string(
      "{% for m in messages %}{{ m.keys() | list }}{{ m.reasoning_content }}|{% endfor %}", "t");
  ASSERT_TRUE(t) << t.error().message;
  ChatRequest r;
  r.messages = ordered_json::parse(R"([{"role": "assistant", "content": null, "reasoning": "R"},
    {"role": "user", "content": "x", "reasoning_content": null}])");
  auto out = t->render(r);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(*out, "['thinking', 'role', 'reasoning', 'reasoning_content']R|['role', 'content']|");
}

}  // namespace
}  // namespace m3::text
