// ChatTemplate: model-directory loading and transformers-compatible request preprocessing.
#include "text/chat_template.h"

#include <fstream>
#include <sstream>

#include "core/check.h"
#include "text/builtin_templates.h"

namespace m3::text {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

Result<std::string> read_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    return make_error(ErrorCode::kNotFound,
                      "chat template file " + path.string() + " does not exist or is not a file",
                      path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return make_error(ErrorCode::kIo, "cannot open " + path.string() + " for reading",
                      path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return make_error(ErrorCode::kIo, "error while reading " + path.string(), path.string());
  return ss.str();
}

Result<ojson> read_json(const fs::path& path) {
  M3_TRY(std::string text, read_file(path));
  try {
    return ojson::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorCode::kFormat, path.string() + " is not valid JSON: " + e.what(),
                      path.string());
  }
}

// transformers' special_tokens_map: the named tokens that are set, as strings.
ojson special_tokens_of(const ojson& tokenizer_config) {
  static const char* kKeys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                "pad_token", "cls_token", "mask_token"};
  ojson out = ojson::object();
  for (const char* key : kKeys) {
    auto it = tokenizer_config.find(key);
    if (it == tokenizer_config.end()) continue;
    if (it->is_string()) {
      out[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"];
    }
  }
  return out;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::from_string(std::string_view source, std::string name,
                                               ojson special_tokens) {
  if (!special_tokens.is_object())
    return make_error(ErrorCode::kInvalidArgument,
                      "special tokens for chat template " + name + " must be a JSON object");
  M3_TRY(auto tpl, jinja::Template::parse(source, std::move(name)));
  ChatTemplate out;
  out.source_ = std::string(source);
  out.template_ = std::move(tpl);
  out.special_tokens_ = std::move(special_tokens);
  return out;
}

ChatTemplate ChatTemplate::builtin_m3() {
  ojson tokens = {{"bos_token", "]~b]"}, {"eos_token", "[e~["}};
  auto t = from_string(kMiniMaxM3ChatTemplate, "built-in MiniMax-M3 chat template", tokens);
  M3_CHECK(t.has_value(), "built-in template does not parse: %s", t.error().message.c_str());
  t->builtin_ = true;
  return std::move(*t);
}

Result<ChatTemplate> ChatTemplate::from_file(const fs::path& path) {
  M3_TRY(std::string source, read_file(path));
  return from_string(source, path.string());
}

Result<ChatTemplate> ChatTemplate::from_model_dir(const fs::path& dir,
                                                  const fs::path& template_file) {
  M3_TRY(ChatTemplate tpl, from_file(template_file));
  std::error_code ec;
  fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    M3_TRY(ojson config, read_json(config_path));
    if (config.is_object()) tpl.special_tokens_ = special_tokens_of(config);
  }
  return tpl;
}

Result<ChatTemplate> ChatTemplate::from_model_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return make_error(ErrorCode::kNotFound, "model directory " + dir.string() + " does not exist",
                      dir.string());
  ojson tokens = ojson::object();
  ojson config;
  fs::path config_path = dir / "tokenizer_config.json";
  bool has_config = fs::exists(config_path, ec);
  if (has_config) {
    M3_TRY(config, read_json(config_path));
    if (!config.is_object())
      return make_error(ErrorCode::kFormat, config_path.string() + " must hold a JSON object",
                        config_path.string());
    tokens = special_tokens_of(config);
  }

  if (fs::exists(dir / "chat_template.jinja", ec)) {
    M3_TRY(std::string source, read_file(dir / "chat_template.jinja"));
    return from_string(source, (dir / "chat_template.jinja").string(), tokens);
  }
  if (fs::exists(dir / "chat_template.json", ec)) {
    M3_TRY(ojson j, read_json(dir / "chat_template.json"));
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string())
      return from_string(j["chat_template"].get<std::string>(),
                         (dir / "chat_template.json").string(), tokens);
  }
  if (has_config && config.contains("chat_template") && !config["chat_template"].is_null()) {
    const ojson& ct = config["chat_template"];
    const std::string name = config_path.string() + " chat_template";
    if (ct.is_string()) return from_string(ct.get<std::string>(), name, tokens);
    if (ct.is_array()) {
      ChatTemplate out;
      bool has_default = false;
      for (const auto& entry : ct) {
        if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
            !entry["name"].is_string() || !entry["template"].is_string())
          return make_error(ErrorCode::kFormat,
                            name + ": each entry must be {\"name\": str, \"template\": str}",
                            config_path.string());
        std::string entry_name = entry["name"].get<std::string>();
        M3_TRY(auto parsed, jinja::Template::parse(entry["template"].get<std::string>(),
                                                   name + "[" + entry_name + "]"));
        if (entry_name == "default") {
          out.template_ = std::move(parsed);
          out.source_ = entry["template"].get<std::string>();
          has_default = true;
        } else {
          out.named_.emplace(entry_name, std::move(parsed));
        }
      }
      if (!has_default)
        return make_error(ErrorCode::kFormat,
                          name + " has no template named \"default\"; pass --chat-template FILE",
                          config_path.string());
      out.special_tokens_ = std::move(tokens);
      return out;
    }
    return make_error(ErrorCode::kFormat, name + " must be a string or a list of {name, template}",
                      config_path.string());
  }
  ChatTemplate out = builtin_m3();
  if (has_config) {
    // Keep the model's own token strings when it has them; the built-in ones otherwise.
    for (auto it = tokens.begin(); it != tokens.end(); ++it)
      out.special_tokens_[it.key()] = it.value();
  }
  return out;
}

Result<std::string> ChatTemplate::render(const ChatRequest& request) const {
  if (!request.messages.is_array())
    return make_error(ErrorCode::kInvalidArgument, "'messages' must be a list of message objects",
                      "messages");
  if (request.messages.empty())
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot apply the chat template to an empty conversation; "
                      "provide at least one message",
                      "messages");
  if (!request.tools.is_null() && !request.tools.is_array())
    return make_error(ErrorCode::kInvalidArgument, "'tools' must be a list of tool objects or null",
                      "tools");
  if (!request.chat_template_kwargs.is_object())
    return make_error(ErrorCode::kInvalidArgument, "'chat_template_kwargs' must be an object",
                      "chat_template_kwargs");

  // Messages as transformers sees them: top-level None-valued keys dropped
  // (_normalize_chat_messages), vLLM's parsing of assistant tool_call arguments, then reasoning
  // aliasing (_alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r}).
  ojson messages = ojson::array();
  for (size_t i = 0; i < request.messages.size(); ++i) {
    const ojson& in = request.messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!in.is_object())
      return make_error(ErrorCode::kInvalidArgument, where + " must be an object", "messages");
    ojson m = ojson::object();
    for (auto it = in.begin(); it != in.end(); ++it)
      if (!it.value().is_null()) m[it.key()] = it.value();
    if (m.value("role", "") == "assistant" && m.contains("tool_calls") &&
        m["tool_calls"].is_array()) {
      for (size_t j = 0; j < m["tool_calls"].size(); ++j) {
        ojson& call = m["tool_calls"][j];
        if (!call.is_object() || !call.contains("function") || !call["function"].is_object())
          continue;
        ojson& fn = call["function"];
        auto args = fn.find("arguments");
        bool empty = args == fn.end() || args->is_null() ||
                     (args->is_string() && args->get<std::string>().empty()) ||
                     (args->is_boolean() && !args->get<bool>()) ||
                     (args->is_number() && args->get<double>() == 0) ||
                     ((args->is_object() || args->is_array()) && args->empty());
        if (empty) {
          fn["arguments"] = ojson::object();
        } else if (!args->is_object() && !args->is_array()) {
          if (!args->is_string())
            return make_error(ErrorCode::kInvalidArgument,
                              where + ".tool_calls[" + std::to_string(j) +
                                  "].function.arguments must be a JSON string or object",
                              "messages");
          try {
            fn["arguments"] = ojson::parse(args->get<std::string>());
          } catch (const nlohmann::json::exception&) {
            return make_error(ErrorCode::kInvalidArgument,
                              where + ".tool_calls[" + std::to_string(j) +
                                  "].function.arguments is not valid JSON",
                              "messages");
          }
        }
      }
    }
    static const char* kReasoningKeys[] = {"reasoning_content", "thinking", "reasoning"};
    const ojson* reasoning = nullptr;
    for (const char* key : kReasoningKeys) {
      auto it = m.find(key);
      if (it != m.end()) {
        reasoning = &*it;
        break;
      }
    }
    if (reasoning) {
      ojson r = *reasoning;
      ojson aliased = ojson::object();
      aliased["thinking"] = r;
      for (auto it = m.begin(); it != m.end(); ++it) aliased[it.key()] = it.value();
      aliased["reasoning_content"] = r;
      m = std::move(aliased);
    }
    messages.push_back(std::move(m));
  }

  ojson vars = special_tokens_;
  for (auto it = request.chat_template_kwargs.begin(); it != request.chat_template_kwargs.end();
       ++it) {
    const std::string& k = it.key();
    if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
      return make_error(
          ErrorCode::kInvalidArgument,
          "chat_template_kwargs may not set '" + k + "'; use the request field instead",
          "chat_template_kwargs");
    vars[k] = it.value();
  }
  vars["messages"] = std::move(messages);
  vars["tools"] = request.tools;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = request.add_generation_prompt;

  const jinja::Template* tpl = &template_;
  if (!request.tools.is_null()) {
    auto it = named_.find("tool_use");
    if (it != named_.end()) tpl = &it->second;
  }
  return tpl->render(vars, options_);
}

}  // namespace m3::text
