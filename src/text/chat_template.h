// ChatTemplate: loads a model's Jinja chat template and renders OpenAI-style chat requests into
// the prompt text, byte-identical to transformers' apply_chat_template(tokenize=False) after
// vLLM's request preprocessing (tool_call arguments given as JSON strings are parsed to objects).
// Called by the server for /v1/chat/completions and by `m3serve tokenize --chat FILE`.
// Invariant: immutable after loading (render is const and thread-safe); every failure (missing
// file, bad JSON, template syntax/runtime error, malformed request) is an Error, never a crash.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/jinja/template.h"

namespace m3::text {

// What a chat request contributes to the template. Use nlohmann::ordered_json when parsing the
// HTTP body: tool schemas are printed with `tojson`, which must keep the client's key order.
struct ChatRequest {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // [{role, content, ...}]
  nlohmann::ordered_json tools = nullptr;                             // null or [{type, function}]
  bool add_generation_prompt = true;
  // Extra top-level template variables (e.g. {"thinking_mode": "enabled"}); they override the
  // special-token variables, as in transformers.
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // Template of a HF model directory: chat_template.jinja, else chat_template.json
  // ({"chat_template": ...}), else tokenizer_config.json's "chat_template" (a string, or a list
  // of {name, template} where "default" is used, and "tool_use" when the request has tools),
  // else the built-in MiniMax-M3 template. Special tokens (bos_token, eos_token, unk_token,
  // sep_token, pad_token, cls_token, mask_token; strings or {"content": ...}) come from
  // tokenizer_config.json when present.
  static Result<ChatTemplate> from_model_dir(const std::filesystem::path& dir);
  // `--chat-template FILE` with a model directory: the file's template, the directory's tokens.
  static Result<ChatTemplate> from_model_dir(const std::filesystem::path& dir,
                                             const std::filesystem::path& template_file);
  // A template file alone (no special-token variables).
  static Result<ChatTemplate> from_file(const std::filesystem::path& path);
  // A template from memory. `special_tokens` is a JSON object of extra template variables.
  static Result<ChatTemplate> from_string(
      std::string_view source, std::string name,
      nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());
  // The built-in MiniMax-M3 template with the M3 special tokens.
  static ChatTemplate builtin_m3();

  // Render the prompt. Errors: kInvalidArgument for a malformed request or a template error
  // (the message carries the template line and column, e.g. a raise_exception() message).
  Result<std::string> render(const ChatRequest& request) const;

  const std::string& source() const { return source_; }
  bool is_builtin() const { return builtin_; }
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }
  // Limits and clock used when rendering (tests shrink the limits / inject strftime_now).
  jinja::RenderOptions& render_options() { return options_; }

 private:
  std::string source_;
  jinja::Template template_;
  std::map<std::string, jinja::Template> named_;  // extra named templates (e.g. "tool_use")
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  jinja::RenderOptions options_;
  bool builtin_ = false;
};

}  // namespace m3::text
