// `m3serve tokenize` and `m3serve detokenize`: the text layer from the command line, for
// debugging and for checks from outside. Stable interface (issue #3):
//   m3serve tokenize --model DIR --text "..."   -> {"ids": [...]}
//   m3serve tokenize --model DIR --chat FILE    -> {"prompt": "<rendered text>", "ids": [...]}
//     FILE: a JSON object with "messages" and optionally "tools", "chat_template_kwargs",
//     "add_generation_prompt" (default true)
//   m3serve detokenize --model DIR --ids 1,2,3  -> {"text": "..."}
// DIR holds tokenizer.json (and the chat template); a path to tokenizer.json itself also works.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "app/commands.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace m3::app {

namespace {

namespace fs = std::filesystem;

struct TokenizeArgs {
  std::string model;
  std::string text;
  bool text_given = false;
  std::string chat_file;
  std::string chat_template;
  bool add_special_tokens = false;
  std::string ids;
  bool skip_special_tokens = false;
};

fs::path model_dir_of(const std::string& model) {
  fs::path p(model);
  return fs::is_regular_file(p) ? p.parent_path() : p;
}

Result<std::shared_ptr<const text::Tokenizer>> load_tokenizer(const std::string& model) {
  fs::path p(model);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::exists(p)) {
    return make_error(ErrorCode::kNotFound,
                      "no tokenizer.json at " + p.string() +
                          "; give --model a model directory that holds tokenizer.json",
                      "--model");
  }
  return text::Tokenizer::from_file(p.string());
}

std::string dump(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

int run_tokenize(const TokenizeArgs& a) {
  if (a.text_given == !a.chat_file.empty())
    return fail("give exactly one of --text or --chat FILE");
  auto tok = load_tokenizer(a.model);
  if (!tok) return fail(tok.error().message);
  nlohmann::ordered_json out;
  std::string prompt;
  if (a.text_given) {
    prompt = a.text;
  } else {
    std::ifstream f(a.chat_file);
    if (!f) return fail("cannot read --chat file " + a.chat_file);
    std::stringstream ss;
    ss << f.rdbuf();
    nlohmann::ordered_json req;
    try {
      req = nlohmann::ordered_json::parse(ss.str());
    } catch (const std::exception& e) {
      return fail("--chat file " + a.chat_file + " is not valid JSON: " + e.what());
    }
    if (!req.is_object() || !req.contains("messages") || !req["messages"].is_array()) {
      return fail("--chat file must hold a JSON object with a \"messages\" array");
    }
    text::ChatRequest cr;
    cr.messages = req["messages"];
    if (req.contains("tools")) cr.tools = req["tools"];
    if (req.contains("chat_template_kwargs")) {
      if (!req["chat_template_kwargs"].is_object())
        return fail("chat_template_kwargs must be an object");
      cr.chat_template_kwargs = req["chat_template_kwargs"];
    }
    if (req.contains("add_generation_prompt")) {
      if (!req["add_generation_prompt"].is_boolean())
        return fail("add_generation_prompt must be true or false");
      cr.add_generation_prompt = req["add_generation_prompt"].get<bool>();
    }
    const fs::path dir = model_dir_of(a.model);
    auto tpl = a.chat_template.empty() ? text::ChatTemplate::from_model_dir(dir)
                                       : text::ChatTemplate::from_model_dir(dir, a.chat_template);
    if (!tpl) return fail(tpl.error().message);
    auto rendered = tpl->render(cr);
    if (!rendered) return fail(rendered.error().message);
    prompt = *rendered;
    out["prompt"] = prompt;
  }
  std::vector<int32_t> ids;
  if (a.add_special_tokens) {
    auto r = (*tok)->encode(prompt, true);
    if (!r) return fail(r.error().message);
    ids = *r;
  } else {
    ids = (*tok)->encode(prompt);
  }
  out["ids"] = ids;
  std::printf("%s\n", dump(out).c_str());
  return 0;
}

int run_detokenize(const TokenizeArgs& a) {
  auto tok = load_tokenizer(a.model);
  if (!tok) return fail(tok.error().message);
  std::vector<int32_t> ids;
  std::stringstream ss(a.ids);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || v < 0 || v > INT32_MAX) {
      return fail("--ids entry '" + item + "' is not a token id (a non-negative integer)");
    }
    if (!(*tok)->contains_id(static_cast<int32_t>(v))) {
      return fail("--ids entry " + item + " is not in the tokenizer's vocabulary (size " +
                  std::to_string((*tok)->vocab_size()) + ")");
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  nlohmann::ordered_json out;
  out["text"] = (*tok)->decode(ids, a.skip_special_tokens);
  std::printf("%s\n", dump(out).c_str());
  return 0;
}

}  // namespace

RunFn register_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* sub =
      app.add_subcommand("tokenize", "Token ids of a text or of a rendered chat prompt");
  sub->add_option("--model", a->model, "Model directory with tokenizer.json (or the file)")
      ->required();
  sub->add_option_function<std::string>(
      "--text", [a](const std::string& s) { a->text = s, a->text_given = true; }, "Text to encode");
  sub->add_option("--chat", a->chat_file,
                  "JSON file: {messages, tools?, chat_template_kwargs?, add_generation_prompt?}");
  sub->add_option("--chat-template", a->chat_template,
                  "Jinja chat template file (else the model's)");
  sub->add_flag("--add-special-tokens", a->add_special_tokens,
                "Apply the tokenizer's post-processor");
  return [a] { return run_tokenize(*a); };
}

RunFn register_detokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* sub = app.add_subcommand("detokenize", "Text of token ids");
  sub->add_option("--model", a->model, "Model directory with tokenizer.json (or the file)")
      ->required();
  sub->add_option("--ids", a->ids, "Comma-separated token ids")->required();
  sub->add_flag("--skip-special-tokens", a->skip_special_tokens,
                "Drop special tokens from the text");
  return [a] { return run_detokenize(*a); };
}

}  // namespace m3::app
