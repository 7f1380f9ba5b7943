#include "server/chat_prompt.h"

#include "core/check.h"

namespace m3::server {

Result<ChatPrompt> ChatPrompt::from_source(const std::string& source,
                                           const OrderedJson& default_kwargs,
                                           const OrderedJson& special_tokens) {
  M3_TRY(auto tpl, text::ChatTemplate::from_string(
                       source, "chat template",
                       special_tokens.is_object() ? special_tokens : OrderedJson::object()));
  ChatPrompt p;
  p.template_ = std::make_shared<const text::ChatTemplate>(std::move(tpl));
  p.source_name_ = "chat template";
  p.default_kwargs_ = default_kwargs.is_object() ? default_kwargs : OrderedJson::object();
  return p;
}

Result<ChatPrompt> ChatPrompt::load(const std::string& model_dir, const std::string& template_path,
                                    const OrderedJson& default_kwargs) {
  auto tpl = template_path.empty() ? text::ChatTemplate::from_model_dir(model_dir)
                                   : text::ChatTemplate::from_model_dir(model_dir, template_path);
  if (!tpl) {
    Error e = tpl.error();
    if (!template_path.empty()) {
      e.message = "--chat-template " + template_path + ": " + e.message;
      e.param = "--chat-template";
    }
    return tl::unexpected(std::move(e));
  }
  ChatPrompt p;
  p.source_name_ = !template_path.empty() ? template_path
                   : tpl->is_builtin()    ? std::string("built-in MiniMax-M3 template")
                                          : model_dir;
  p.template_ = std::make_shared<const text::ChatTemplate>(std::move(*tpl));
  p.default_kwargs_ = default_kwargs.is_object() ? default_kwargs : OrderedJson::object();
  return p;
}

Result<RenderedChat> ChatPrompt::render(const ChatRequest& r) const {
  M3_CHECK(template_ != nullptr);
  RenderedChat out;
  OrderedJson kwargs = default_kwargs_;
  for (auto it = r.chat_template_kwargs.begin(); it != r.chat_template_kwargs.end(); ++it)
    kwargs[it.key()] = it.value();

  // Thinking mode: what the template is told is what the reasoning parser must assume.
  out.thinking_mode = text::ThinkingMode::kAdaptive;
  if (kwargs.contains("thinking_mode") && !kwargs["thinking_mode"].is_null()) {
    if (!kwargs["thinking_mode"].is_string()) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "chat_template_kwargs.thinking_mode must be \"enabled\", \"disabled\" or \"adaptive\"",
          "chat_template_kwargs.thinking_mode");
    }
    M3_TRY(out.thinking_mode,
           text::thinking_mode_from_string(kwargs["thinking_mode"].get<std::string>()));
  } else if (kwargs.contains("enable_thinking") && kwargs["enable_thinking"].is_boolean() &&
             kwargs["enable_thinking"].get<bool>()) {
    // Deprecated switch: true means "enabled" (the M3 template maps it the same way).
    out.thinking_mode = text::ThinkingMode::kEnabled;
  }

  text::ChatRequest tr;
  tr.messages = r.messages;
  tr.add_generation_prompt = r.add_generation_prompt;
  tr.chat_template_kwargs = kwargs;
  // Every tool is shown for auto, required and a named function, as vLLM renders them; required
  // and named are enforced by the tool-call grammar (serve_chat.cpp), not by extra prompt text.
  if (r.tools.is_array() && r.tool_choice.kind != ToolChoiceKind::kNone) tr.tools = r.tools;
  auto text = template_->render(tr);
  if (!text) {
    Error e = text.error();
    e.code = ErrorCode::kInvalidArgument;
    e.message = "the chat template failed on these messages: " + e.message;
    if (e.param.empty()) e.param = "messages";
    return tl::unexpected(std::move(e));
  }
  out.prompt = std::move(*text);
  if (r.continue_final_message) {
    // Cut after the final message's content so the model continues it.
    const auto& last = tr.messages.back();
    if (last.contains("content") && last["content"].is_string() &&
        !last["content"].get<std::string>().empty()) {
      const std::string c = last["content"].get<std::string>();
      const size_t pos = out.prompt.rfind(c);
      if (pos != std::string::npos) out.prompt.resize(pos + c.size());
    }
  }
  out.tools = tr.tools;
  return out;
}

}  // namespace m3::server
