// `m3serve parse-outputs`: the chat output parsers (reasoning + minimax_m3 tool calls) from the
// command line, on many outputs at once, through the same code the server runs. Used by the
// side-by-side check against vLLM's parsers (tools/parity/) and by its CI replay test.
//   m3serve parse-outputs --model DIR < records.jsonl > results.jsonl
// One JSON object per input line:
//   {"id": any, "text": "...", "token_ids": [...], "tools": [...] | null,
//    "thinking_mode": "adaptive"|"enabled"|"disabled", "parse_reasoning": true,
//    "finish_reason": "stop"|"length", "text_splits": [[byte offsets], ...]}
// "text" and "token_ids" are both optional (one is needed). Tool calls are parsed when "tools" is
// a non-empty array (the server parses them when the request has tools and tool_choice is not
// "none"). Output, one line per input line, in order:
//   {"id": ..., "whole": R, "server": R, "splits": [R, ...]}
//   R = {"reasoning": str, "content": str|null, "tool_calls": [{"name", "arguments"}],
//        "finish_reason": str}
// "whole" parses "text" (or the decoded token_ids) in one piece; "server" feeds token_ids one
// engine output per token through ChoiceOutput, the server's per-choice output pipeline
// (detokenizer, EOS handling, parsers) and appears only with token_ids; each "splits" entry feeds
// "text" cut at the given byte offsets. content is null as in the server's chat response: empty
// with tool calls. A bad line answers {"id": ..., "error": "..."} and the run goes on.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "engine/engine.h"
#include "server/choice_output.h"
#include "text/chat_output_parser.h"
#include "text/tokenizer.h"

namespace m3::app {

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

struct ParseArgs {
  std::string model;
};

Json result_json(const std::string& reasoning, const std::string& content,
                 const std::vector<text::ToolCall>& calls, const std::string& finish_reason) {
  Json r;
  r["reasoning"] = reasoning;
  r["content"] = (content.empty() && !calls.empty()) ? Json(nullptr) : Json(content);
  r["tool_calls"] = Json::array();
  for (const auto& c : calls)
    r["tool_calls"].push_back({{"name", c.name}, {"arguments", c.arguments_json}});
  r["finish_reason"] = finish_reason;
  return r;
}

std::string finish_of(const std::string& engine_reason, const std::vector<text::ToolCall>& calls) {
  return engine_reason == "stop" && !calls.empty() ? "tool_calls" : engine_reason;
}

Result<text::ChatOutputOptions> options_of(const nlohmann::json& rec) {
  text::ChatOutputOptions o;
  o.parse_reasoning = rec.value("parse_reasoning", true);
  if (rec.contains("thinking_mode") && !rec["thinking_mode"].is_null()) {
    if (!rec["thinking_mode"].is_string())
      return make_error(ErrorCode::kInvalidArgument, "thinking_mode must be a string");
    M3_TRY(auto mode, text::thinking_mode_from_string(rec["thinking_mode"].get<std::string>()));
    o.thinking_mode = mode;
  }
  if (rec.contains("tools") && rec["tools"].is_array() && !rec["tools"].empty()) {
    o.parse_tool_calls = true;
    o.tools = rec["tools"];
  } else if (rec.contains("tools") && !rec["tools"].is_null() && !rec["tools"].is_array()) {
    return make_error(ErrorCode::kInvalidArgument, "tools must be an array or null");
  }
  return o;
}

Result<Json> parse_record(const nlohmann::json& rec,
                          const std::shared_ptr<const text::Tokenizer>& tok) {
  if (!rec.is_object()) return make_error(ErrorCode::kInvalidArgument, "a line must be an object");
  M3_TRY(text::ChatOutputOptions opts, options_of(rec));
  const std::string reason = rec.value("finish_reason", std::string("stop"));
  if (reason != "stop" && reason != "length")
    return make_error(ErrorCode::kInvalidArgument, "finish_reason must be \"stop\" or \"length\"");

  std::vector<int32_t> ids;
  if (rec.contains("token_ids")) {
    if (!rec["token_ids"].is_array())
      return make_error(ErrorCode::kInvalidArgument, "token_ids must be an array of ids");
    for (const auto& v : rec["token_ids"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
          v.get<int64_t>() >= static_cast<int64_t>(tok->vocab_size()))
        return make_error(ErrorCode::kInvalidArgument,
                          "token_ids holds an id outside the tokenizer's vocabulary");
      ids.push_back(v.get<int32_t>());
    }
  }
  std::string text;
  if (rec.contains("text")) {
    if (!rec["text"].is_string())
      return make_error(ErrorCode::kInvalidArgument, "text must be a string");
    text = rec["text"].get<std::string>();
  } else if (!ids.empty()) {
    text = tok->decode(ids, false);
  } else {
    return make_error(ErrorCode::kInvalidArgument, "give \"text\" or \"token_ids\"");
  }

  Json out;
  out["id"] = rec.contains("id") ? Json(rec["id"]) : Json(nullptr);
  {
    text::ChatOutputResult r = text::ChatOutputParser::parse(text, opts);
    out["whole"] =
        result_json(r.reasoning, r.content, r.tool_calls, finish_of(reason, r.tool_calls));
  }
  if (!ids.empty()) {
    server::ChoiceOptions co;
    co.tokenizer = tok;
    co.skip_special_tokens = true;  // the request default
    if (auto eos = tok->token_to_id(text::ChatOutputParser::kEosText)) co.eos_token_ids = {*eos};
    co.chat = opts;
    co.chat->tool_options.id_prefix = "call_";
    server::ChoiceOutput choice(co);
    for (size_t i = 0; i < ids.size(); ++i) {
      engine::RequestOutput o;
      o.new_token_ids = {ids[i]};
      o.finished = i + 1 == ids.size();
      if (o.finished) o.finish_reason = reason;
      choice.add(o);
    }
    out["server"] =
        result_json(choice.reasoning(), choice.text(), choice.tool_calls(), choice.finish_reason());
  }
  out["splits"] = Json::array();
  if (rec.contains("text_splits")) {
    if (!rec["text_splits"].is_array())
      return make_error(ErrorCode::kInvalidArgument, "text_splits must be an array of arrays");
    for (const auto& cuts : rec["text_splits"]) {
      if (!cuts.is_array())
        return make_error(ErrorCode::kInvalidArgument, "text_splits must be an array of arrays");
      text::ChatOutputParser p(opts);
      text::ChatOutputResult r;
      size_t at = 0;
      for (const auto& c : cuts) {
        if (!c.is_number_unsigned() || c.get<size_t>() < at || c.get<size_t>() > text.size())
          return make_error(ErrorCode::kInvalidArgument,
                            "text_splits offsets must rise and stay within the text");
        const size_t to = c.get<size_t>();
        r.append(p.feed(std::string_view(text).substr(at, to - at)));
        at = to;
      }
      r.append(p.feed(std::string_view(text).substr(at)));
      r.append(p.finish());
      out["splits"].push_back(
          result_json(r.reasoning, r.content, r.tool_calls, finish_of(reason, r.tool_calls)));
    }
  }
  return out;
}

int run_parse(const ParseArgs& a) {
  fs::path p(a.model);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::exists(p))
    return fail("no tokenizer.json at " + p.string() +
                "; give --model a model directory that holds tokenizer.json");
  auto tok = text::Tokenizer::from_file(p.string());
  if (!tok) return fail(tok.error().message);
  std::string line;
  size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    if (line.empty()) continue;
    Json out;
    nlohmann::json rec;
    try {
      rec = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      out = {{"id", nullptr},
             {"error", "line " + std::to_string(line_no) + " is not JSON: " + e.what()}};
    }
    if (out.is_null()) {
      auto r = parse_record(rec, *tok);
      if (r) {
        out = std::move(*r);
      } else {
        out = {{"id", rec.is_object() && rec.contains("id") ? Json(rec["id"]) : Json(nullptr)},
               {"error", "line " + std::to_string(line_no) + ": " + r.error().message}};
      }
    }
    const std::string s = out.dump(-1, ' ', false, Json::error_handler_t::replace);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

RunFn register_parse(CLI::App& app) {
  auto args = std::make_shared<ParseArgs>();
  auto* cmd = app.add_subcommand("parse-outputs",
                                 "Run the chat output parsers (reasoning + minimax_m3 tool calls) "
                                 "on JSONL records from stdin");
  cmd->add_option("--model", args->model, "model directory holding tokenizer.json (or the file)")
      ->required();
  return [args] { return run_parse(*args); };
}

}  // namespace m3::app
