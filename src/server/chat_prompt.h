// ChatPrompt: the model's chat template (Jinja) plus what the server adds around it: default
// chat_template_kwargs (--default-chat-template-kwargs), tool_choice handling and the
// thinking mode the reasoning parser needs. Turns a validated ChatRequest into prompt text.
// Called by HttpServer handlers (chat completions, /tokenize with messages) on HTTP threads.
// Invariant: immutable after load, so one instance renders from many threads at once.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/openai_request.h"
#include "text/chat_template.h"
#include "text/reasoning_parser.h"

namespace m3::server {

struct RenderedChat {
  std::string prompt;
  text::ThinkingMode thinking_mode = text::ThinkingMode::kAdaptive;
  OrderedJson tools;  // the tools the template saw (null when none): the tool parser's schemas
};

class ChatPrompt {
 public:
  // `template_path` (--chat-template) when given, else the model directory's template
  // (text::ChatTemplate::from_model_dir: chat_template.jinja, tokenizer_config.json, or the
  // built-in MiniMax-M3 template).
  static Result<ChatPrompt> load(const std::string& model_dir, const std::string& template_path,
                                 const OrderedJson& default_kwargs);
  // For tests: a template given as text.
  static Result<ChatPrompt> from_source(const std::string& source,
                                        const OrderedJson& default_kwargs,
                                        const OrderedJson& special_tokens = OrderedJson::object());

  const std::string& source_name() const { return source_name_; }

  // Renders the request's messages. Errors: template runtime errors (400, the request made the
  // template fail), a bad thinking_mode.
  Result<RenderedChat> render(const ChatRequest& request) const;

 private:
  std::shared_ptr<const text::ChatTemplate> template_;
  std::string source_name_;
  OrderedJson default_kwargs_ = OrderedJson::object();
};

}  // namespace m3::server
