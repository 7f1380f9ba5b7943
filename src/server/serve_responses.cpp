// /v1/responses: OpenAI's Responses API over the chat pipeline. `input` (a string, or items:
// messages, function_call, function_call_output, reasoning) and `instructions` become the
// equivalent chat request, run by start_chat; the output goes back as Responses items
// (reasoning from the reasoning parser, an assistant message, function_call items), as JSON or
// as the Responses SSE events (response.created, response.in_progress, output_item.added,
// content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta,
// their .done, output_item.done, response.completed or response.incomplete).
// previous_response_id: each stored response (store, the default) keeps its conversation, less
// its instructions, in a bounded in-memory store of this process (the oldest are dropped first);
// an id that is not there is a 404 that says so; GET /v1/responses/{id} returns a stored
// response, DELETE removes it, GET .../input_items lists its input items. background: true
// answers at once with status "queued" and generates on a thread of its own (the stored
// response goes queued -> in_progress -> completed / incomplete / failed / cancelled, as GET
// shows); POST .../cancel stops it. Part of HttpServerImpl (server_impl.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "server/json_limits.h"
#include "server/output_blocks.h"
#include "server/server_impl.h"

namespace m3::server {

// Stored responses by id: the response object (GET /v1/responses/{id}) and its conversation,
// less the instructions (what previous_response_id continues). Bounded by count and by bytes;
// the oldest go first.
struct ResponseStore {
  static constexpr size_t kMaxResponses = 4096;
  static constexpr size_t kMaxBytes = size_t{256} << 20;

  struct Entry {
    OrderedJson conversation;
    OrderedJson response;
    OrderedJson input_items;  // the request's input as Responses items, with ids
  };
  // A background response still generating: its thread watches `cancel` and sets `done`.
  struct Background {
    std::atomic<bool> cancel{false};
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    void wait_done(std::chrono::milliseconds limit) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, limit, [&] { return done; });
    }
  };

  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<const Entry>> by_id;
  std::deque<std::pair<std::string, size_t>> order;  // oldest first, with its size
  size_t bytes = 0;
  std::unordered_map<std::string, std::shared_ptr<Background>> running;
  int live_threads = 0;  // background threads not yet ended
  std::condition_variable threads_cv;

  // Adds (or replaces) a response. `only_if_present`: a background thread's update, which must
  // not bring back a response that was deleted meanwhile.
  void put(const std::string& id, OrderedJson conversation, OrderedJson response,
           OrderedJson input_items, bool only_if_present = false) {
    const size_t size =
        dump_json(conversation).size() + dump_json(response).size() + dump_json(input_items).size();
    auto e = std::make_shared<const Entry>(
        Entry{std::move(conversation), std::move(response), std::move(input_items)});
    std::lock_guard<std::mutex> lock(mu);
    const bool present = by_id.count(id) > 0;
    if (only_if_present && !present) return;
    if (present) drop_locked(id);
    if (size > kMaxBytes / 4) return;  // too large to keep; a later lookup says it is gone
    by_id[id] = std::move(e);
    order.emplace_back(id, size);
    bytes += size;
    while (order.size() > kMaxResponses || bytes > kMaxBytes) {
      bytes -= order.front().second;
      by_id.erase(order.front().first);
      order.pop_front();
    }
  }
  std::shared_ptr<const Entry> get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_id.find(id);
    return it == by_id.end() ? nullptr : it->second;
  }
  bool erase(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    if (!by_id.count(id)) return false;
    drop_locked(id);
    return true;
  }
  std::shared_ptr<Background> background(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = running.find(id);
    return it == running.end() ? nullptr : it->second;
  }
  // Server shutdown: cancels every background response and waits for the threads (bounded).
  void stop_background(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    for (auto& [id, bg] : running) bg->cancel = true;
    threads_cv.wait_for(lock, limit, [&] { return live_threads == 0; });
  }

 private:
  void drop_locked(const std::string& id) {
    by_id.erase(id);
    for (auto it = order.begin(); it != order.end(); ++it) {
      if (it->first == id) {
        bytes -= it->second;
        order.erase(it);
        break;
      }
    }
  }
};

void stop_background_responses(ResponseStore& store) {
  store.stop_background(std::chrono::seconds(10));
}

namespace {

// A message item's content: a string or input_text / output_text parts.
Result<std::string> item_text(const OrderedJson& v, const std::string& param) {
  if (v.is_null()) return std::string();
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array())
    return invalid_param(param, "'" + param + "' must be a string or an array of parts");
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string pp = param + "[" + std::to_string(i) + "]";
    const auto& p = v[i];
    const std::string type = string_member(p, "type");
    if (type == "input_text" || type == "output_text" || type == "text" ||
        type == "reasoning_text" || type == "summary_text") {
      if (!p.contains("text") || !p["text"].is_string())
        return invalid_param(pp + ".text", "'" + pp + ".text' must be a string");
      out += p["text"].get<std::string>();
    } else if (type == "refusal") {
      continue;
    } else {
      return unsupported_param(pp, "'" + pp + "' is a '" + type +
                                       "' part; send input_text parts (this server serves the text "
                                       "model)");
    }
  }
  return out;
}

// The last message when it is an assistant turn that more of the same turn may join (reasoning,
// text and calls of one reply arrive as separate items).
OrderedJson* open_assistant(OrderedJson& msgs) {
  if (msgs.empty() || string_member(msgs.back(), "role") != "assistant") return nullptr;
  return &msgs.back();
}

// Input items -> chat messages, appended to `msgs`.
Status translate_input(const OrderedJson& input, OrderedJson& msgs) {
  if (input.is_string()) {
    msgs.push_back({{"role", "user"}, {"content", input}});
    return {};
  }
  if (!input.is_array())
    return invalid_param("input", "'input' must be a string or an array of items");
  if (input.size() > kMaxMessages)
    return invalid_param("input",
                         "'input' holds more than " + std::to_string(kMaxMessages) + " items");
  for (size_t i = 0; i < input.size(); ++i) {
    const std::string ip = "input[" + std::to_string(i) + "]";
    const auto& it = input[i];
    if (!it.is_object()) return invalid_param(ip, "'" + ip + "' must be an object");
    const std::string type = string_member(it, "type", it.contains("role") ? "message" : "");
    if (type == "message") {
      if (!it.contains("role") || !it["role"].is_string())
        return invalid_param(ip + ".role", "'" + ip + ".role' must be a string");
      const std::string role = it["role"].get<std::string>();
      if (role != "user" && role != "assistant" && role != "system" && role != "developer")
        return invalid_param(ip + ".role",
                             "'" + ip + ".role' must be user, assistant, system or developer");
      M3_TRY(std::string text,
             item_text(it.contains("content") ? it["content"] : OrderedJson(), ip + ".content"));
      OrderedJson* open = role == "assistant" ? open_assistant(msgs) : nullptr;
      if (open && (*open)["content"].is_string() && (*open)["content"].get<std::string>().empty() &&
          !open->contains("tool_calls")) {
        (*open)["content"] = text;  // the text of a reply whose reasoning came first
      } else {
        msgs.push_back({{"role", role}, {"content", text}});
      }
    } else if (type == "reasoning") {
      std::string text;
      if (it.contains("content") && it["content"].is_array() && !it["content"].empty()) {
        M3_TRY(text, item_text(it["content"], ip + ".content"));
      } else if (it.contains("summary") && it["summary"].is_array()) {
        M3_TRY(text, item_text(it["summary"], ip + ".summary"));
      }
      msgs.push_back({{"role", "assistant"}, {"content", ""}, {"reasoning_content", text}});
    } else if (type == "function_call") {
      for (const char* k : {"call_id", "name"}) {
        if (!it.contains(k) || !it[k].is_string())
          return invalid_param(ip + "." + k, "'" + ip + "." + k + "' must be a string");
      }
      const std::string args = it.contains("arguments") && it["arguments"].is_string()
                                   ? it["arguments"].get<std::string>()
                                   : "{}";
      OrderedJson call = {{"id", it["call_id"]},
                          {"type", "function"},
                          {"function", {{"name", it["name"]}, {"arguments", args}}}};
      OrderedJson* open = open_assistant(msgs);
      if (!open) {
        msgs.push_back({{"role", "assistant"}, {"content", ""}});
        open = &msgs.back();
      }
      if (!open->contains("tool_calls")) (*open)["tool_calls"] = OrderedJson::array();
      (*open)["tool_calls"].push_back(std::move(call));
    } else if (type == "function_call_output") {
      if (!it.contains("call_id") || !it["call_id"].is_string())
        return invalid_param(ip + ".call_id", "'" + ip + ".call_id' must be a string");
      M3_TRY(std::string out,
             item_text(it.contains("output") ? it["output"] : OrderedJson(), ip + ".output"));
      msgs.push_back({{"role", "tool"}, {"tool_call_id", it["call_id"]}, {"content", out}});
    } else {
      return unsupported_param(ip + ".type", "'" + ip + ".type' '" + type +
                                                 "' is not supported; send message, function_call, "
                                                 "function_call_output or reasoning items");
    }
  }
  return {};
}

struct Translated {
  OrderedJson chat;          // the chat completions body
  OrderedJson conversation;  // its messages less the instructions (what a later turn continues)
};

Result<Translated> responses_to_chat(const OrderedJson& j, const OrderedJson* history) {
  Translated t;
  OrderedJson& c = t.chat;
  c = OrderedJson::object();
  if (j.contains("model")) c["model"] = j["model"];
  for (const char* k : {"temperature", "top_p", "top_k", "stream", "chat_template_kwargs"}) {
    if (j.contains(k) && !j[k].is_null()) c[k] = j[k];
  }
  if (j.contains("max_output_tokens") && !j["max_output_tokens"].is_null())
    c["max_tokens"] = j["max_output_tokens"];
  if (j.contains("top_logprobs") && j["top_logprobs"].is_number() &&
      j["top_logprobs"].get<double>() != 0) {
    return unsupported_param("top_logprobs",
                             "'top_logprobs' is not supported on /v1/responses yet; use "
                             "/v1/chat/completions with logprobs / top_logprobs");
  }
  for (const char* k : {"conversation", "prompt"}) {
    if (j.contains(k) && !j[k].is_null() && !(j[k].is_boolean() && !j[k].get<bool>())) {
      return unsupported_param(k, std::string("'") + k +
                                      "' is not supported by this server; send the whole input (or "
                                      "previous_response_id) and wait for the reply");
    }
  }
  OrderedJson msgs = history ? *history : OrderedJson::array();
  if (!j.contains("input") || j["input"].is_null())
    return invalid_param("input", "'input' is required: a string or an array of items");
  M3_TRY_STATUS(translate_input(j["input"], msgs));
  t.conversation = msgs;
  if (j.contains("instructions") && !j["instructions"].is_null()) {
    if (!j["instructions"].is_string())
      return invalid_param("instructions", "'instructions' must be a string");
    msgs.insert(msgs.begin(), OrderedJson{{"role", "system"}, {"content", j["instructions"]}});
  }
  c["messages"] = std::move(msgs);
  if (j.contains("tools") && j["tools"].is_array() && !j["tools"].empty()) {
    OrderedJson tools = OrderedJson::array();
    for (size_t i = 0; i < j["tools"].size(); ++i) {
      const std::string tp = "tools[" + std::to_string(i) + "]";
      const auto& tool = j["tools"][i];
      const std::string type = string_member(tool, "type");
      if (type != "function") {
        return unsupported_param(tp + ".type", "'" + tp + ".type' is '" + type +
                                                   "': only function tools are supported (built-in "
                                                   "tools are not run by this server)");
      }
      if (!tool.contains("name") || !tool["name"].is_string())
        return invalid_param(tp + ".name", "'" + tp + ".name' must be a string");
      OrderedJson fn = {{"name", tool["name"]}};
      if (tool.contains("description") && tool["description"].is_string())
        fn["description"] = tool["description"];
      fn["parameters"] = tool.contains("parameters") && tool["parameters"].is_object()
                             ? tool["parameters"]
                             : OrderedJson{{"type", "object"}};
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    c["tools"] = std::move(tools);
  }
  if (j.contains("tool_choice") && !j["tool_choice"].is_null()) {
    const auto& tc = j["tool_choice"];
    if (tc.is_string()) {
      c["tool_choice"] = tc;
    } else if (string_member(tc, "type") == "function" && tc.contains("name")) {
      c["tool_choice"] = {{"type", "function"}, {"function", {{"name", tc["name"]}}}};
    } else {
      return invalid_param("tool_choice",
                           "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                           "\"function\", \"name\": ...}");
    }
  }
  if (j.contains("parallel_tool_calls") && !j["parallel_tool_calls"].is_null())
    c["parallel_tool_calls"] = j["parallel_tool_calls"];  // validated by the chat parser
  // reasoning.effort: none / minimal turn thinking off, low / medium / high on; absent: the
  // template's default (adaptive).
  if (j.contains("reasoning") && j["reasoning"].is_object() && j["reasoning"].contains("effort") &&
      j["reasoning"]["effort"].is_string()) {
    const std::string e = j["reasoning"]["effort"].get<std::string>();
    if (!c.contains("chat_template_kwargs")) c["chat_template_kwargs"] = OrderedJson::object();
    // (kwargs that are not an object are refused by parse_chat_request, naming the field)
    if (c["chat_template_kwargs"].is_object() &&
        !c["chat_template_kwargs"].contains("thinking_mode")) {
      c["chat_template_kwargs"]["thinking_mode"] =
          (e == "none" || e == "minimal") ? "disabled" : "enabled";
    }
  }
  // text.format: text / json_object / json_schema {name, schema, strict}.
  if (j.contains("text") && j["text"].is_object() && j["text"].contains("format") &&
      j["text"]["format"].is_object()) {
    const auto& f = j["text"]["format"];
    const std::string type = string_member(f, "type", "text");
    if (type == "json_object") {
      c["response_format"] = {{"type", "json_object"}};
    } else if (type == "json_schema") {
      OrderedJson js = {{"name", string_member(f, "name", "schema")}};
      if (f.contains("schema")) js["schema"] = f["schema"];
      if (f.contains("strict")) js["strict"] = f["strict"];
      c["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(js)}};
    } else if (type != "text") {
      return invalid_param("text.format.type",
                           "'text.format.type' must be text, json_object or json_schema");
    }
  }
  return t;
}

Json usage_of(const UsageCounts& u) {
  return {{"input_tokens", u.prompt_tokens},
          {"input_tokens_details", {{"cached_tokens", u.cached_tokens}}},
          {"output_tokens", u.completion_tokens},
          {"output_tokens_details", {{"reasoning_tokens", u.reasoning_tokens}}},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

// One output item: reasoning, an assistant message, or a function call.
Json output_item(BlockKind kind, const std::string& id, const std::string& text,
                 const std::string& call_id, const std::string& name, bool done) {
  const char* status = done ? "completed" : "in_progress";
  switch (kind) {
    case BlockKind::kReasoning: {
      Json content = Json::array();
      if (done) content.push_back({{"type", "reasoning_text"}, {"text", text}});
      return {{"id", id},
              {"type", "reasoning"},
              {"summary", Json::array()},
              {"content", content},
              {"status", status}};
    }
    case BlockKind::kText: {
      Json content = Json::array();
      if (done) {
        content.push_back({{"type", "output_text"},
                           {"text", text},
                           {"annotations", Json::array()},
                           {"logprobs", Json::array()}});
      }
      return {{"id", id},
              {"type", "message"},
              {"role", "assistant"},
              {"status", status},
              {"content", content}};
    }
    case BlockKind::kToolCall:
      return {{"id", id},     {"type", "function_call"}, {"call_id", call_id},
              {"name", name}, {"arguments", text},       {"status", status}};
  }
  return nullptr;
}

std::string item_id(BlockKind kind) {
  switch (kind) {
    case BlockKind::kReasoning:
      return "rs_" + random_id(24);
    case BlockKind::kText:
      return "msg_" + random_id(24);
    case BlockKind::kToolCall:
      return "fc_" + random_id(24);
  }
  return random_id(24);
}

// What the response object echoes of its request.
struct ResponseEcho {
  std::string id, model, previous_response_id;
  int64_t created = 0;
  bool background = false;
  Json instructions, max_output_tokens, temperature, top_p, tools, tool_choice, metadata, text,
      reasoning, parallel_tool_calls, store;
};

Json response_json(const ResponseEcho& e, const std::string& status, Json output, const Json& usage,
                   const Json& incomplete, const Json& error = nullptr) {
  return {{"id", e.id},
          {"object", "response"},
          {"created_at", e.created},
          {"status", status},
          {"background", e.background},
          {"error", error},
          {"incomplete_details", incomplete},
          {"instructions", e.instructions},
          {"max_output_tokens", e.max_output_tokens},
          {"model", e.model},
          {"output", std::move(output)},
          {"parallel_tool_calls", e.parallel_tool_calls},
          {"previous_response_id",
           e.previous_response_id.empty() ? Json(nullptr) : Json(e.previous_response_id)},
          {"reasoning", e.reasoning},
          {"store", e.store},
          {"temperature", e.temperature},
          {"text", e.text},
          {"tool_choice", e.tool_choice},
          {"tools", e.tools},
          {"top_p", e.top_p},
          {"truncation", "disabled"},
          {"usage", usage},
          {"user", nullptr},
          {"metadata", e.metadata}};
}

// The assistant chat message of an output (what a later previous_response_id turn continues).
OrderedJson assistant_message(const ChoiceOutput& out) {
  OrderedJson m = {{"role", "assistant"}, {"content", out.text()}};
  if (!out.reasoning().empty()) m["reasoning_content"] = out.reasoning();
  if (!out.tool_calls().empty()) {
    OrderedJson calls = OrderedJson::array();
    for (const auto& c : out.tool_calls()) {
      calls.push_back({{"id", c.id},
                       {"type", "function"},
                       {"function", {{"name", c.name}, {"arguments", c.arguments_json}}}});
    }
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

// The output items of a finished (or stopped) choice: reasoning, the message (also when empty
// and there are no calls), the function calls.
Json output_of(const ChoiceOutput& out) {
  Json output = Json::array();
  if (!out.reasoning().empty()) {
    output.push_back(output_item(BlockKind::kReasoning, item_id(BlockKind::kReasoning),
                                 out.reasoning(), "", "", true));
  }
  const std::string& text = out.text();
  if (!text.empty() || out.tool_calls().empty()) {
    output.push_back(output_item(BlockKind::kText, item_id(BlockKind::kText), text, "", "", true));
  }
  for (const auto& c : out.tool_calls()) {
    output.push_back(output_item(BlockKind::kToolCall, item_id(BlockKind::kToolCall),
                                 c.arguments_json, c.id, c.name, true));
  }
  return output;
}

std::pair<std::string, Json> finish_state_of(const ChoiceOutput& out) {
  if (out.finish_reason() == "length") return {"incomplete", Json{{"reason", "max_output_tokens"}}};
  return {"completed", nullptr};
}

// The request's input as stored Responses items (GET .../input_items): a string is one user
// message; each item keeps its fields, gains an id when it has none, and a message's string
// content becomes one input_text (output_text for the assistant) part.
OrderedJson input_items_of(const OrderedJson& input) {
  OrderedJson items = OrderedJson::array();
  auto text_part = [](const std::string& role, const OrderedJson& text) {
    return OrderedJson{{"type", role == "assistant" ? "output_text" : "input_text"},
                       {"text", text}};
  };
  if (input.is_string()) {
    items.push_back({{"id", "msg_" + random_id(24)},
                     {"type", "message"},
                     {"role", "user"},
                     {"content", OrderedJson::array({text_part("user", input)})},
                     {"status", "completed"}});
    return items;
  }
  if (!input.is_array()) return items;
  for (const auto& it : input) {
    if (!it.is_object()) continue;
    OrderedJson item = it;
    const std::string type = string_member(item, "type", "message");
    item["type"] = type;
    if (!item.contains("id") || !item["id"].is_string()) {
      const char* prefix = type == "function_call"          ? "fc_"
                           : type == "function_call_output" ? "fco_"
                           : type == "reasoning"            ? "rs_"
                                                            : "msg_";
      item["id"] = prefix + random_id(24);
    }
    if (type == "message" && item.contains("content") && item["content"].is_string()) {
      item["content"] =
          OrderedJson::array({text_part(string_member(item, "role", "user"), item["content"])});
    }
    if (!item.contains("status")) item["status"] = "completed";
    items.push_back(std::move(item));
  }
  return items;
}

// What a background response's thread does: polls its generation until it ends or is
// cancelled, moving the stored response from queued to in_progress (first output) to its final
// status. Holds only shared state, so it may outlive the request that started it.
void run_background(std::shared_ptr<ResponseStore> store,
                    std::shared_ptr<ResponseStore::Background> bg, std::shared_ptr<ChatJob> job,
                    ResponseEcho echo, OrderedJson conversation, OrderedJson input_items) {
  Generation& gen = *job->gen;
  const ChoiceOutput& out = *gen.slots[0].out;
  bool started = false;
  while (!gen.all_finished() && !bg->cancel) {
    const auto ready = gen.poll(std::chrono::milliseconds(100));
    if (!started && (!ready.empty() || out.num_output_tokens() > 0)) {
      started = true;
      store->put(echo.id, conversation,
                 response_json(echo, "in_progress", Json::array(), nullptr, nullptr), input_items,
                 /*only_if_present=*/true);
    }
  }
  Json body;
  if (!gen.all_finished()) {  // cancelled
    gen.abort_all();
    body = response_json(echo, "cancelled", output_of(out), usage_of(job->usage()), nullptr);
  } else if (out.finish_reason() == "error" || out.finish_reason() == "abort") {
    const std::string why = out.finish_reason() == "abort"
                                ? std::string("the request was aborted (server shutting down)")
                                : "generation failed: " + out.error();
    body = response_json(echo, "failed", Json::array(), usage_of(job->usage()), nullptr,
                         Json{{"code", "server_error"}, {"message", why}});
  } else if (auto e = check_tool_choice(job->tool_choice, out)) {
    body = response_json(echo, "failed", Json::array(), usage_of(job->usage()), nullptr,
                         Json{{"code", "server_error"}, {"message", e->message}});
  } else {
    const auto [status, incomplete] = finish_state_of(out);
    body = response_json(echo, status, output_of(out), usage_of(job->usage()), incomplete);
  }
  OrderedJson conv = std::move(conversation);
  conv.push_back(assistant_message(out));
  store->put(echo.id, std::move(conv), body, std::move(input_items), /*only_if_present=*/true);
  {
    std::lock_guard<std::mutex> lock(bg->mu);
    bg->done = true;
  }
  bg->cv.notify_all();
  std::lock_guard<std::mutex> lock(store->mu);
  store->running.erase(echo.id);
  --store->live_threads;
  store->threads_cv.notify_all();
}

}  // namespace

std::shared_ptr<ResponseStore> HttpServerImpl::response_store() {
  std::lock_guard<std::mutex> lock(responses_mu_);
  if (!responses_) responses_ = std::make_shared<ResponseStore>();
  return responses_;
}

void HttpServerImpl::handle_responses(const HttpRequest& req, HttpResponse& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_)
    return send_error(
        res, Error{ErrorCode::kUnavailable,
                   "the server is draining (shutting down); retry on another replica", ""});
  auto parsed_body = parse_json_bounded(req.body, "the request body");
  if (!parsed_body) return send_error(res, parsed_body.error());
  const OrderedJson& j = *parsed_body;
  if (!j.is_object())
    return send_error(res,
                      Error{ErrorCode::kInvalidArgument, "request body must be a JSON object", ""});
  const std::shared_ptr<ResponseStore> store_ptr = response_store();
  ResponseEcho echo;
  std::shared_ptr<const ResponseStore::Entry> history;
  if (j.contains("previous_response_id") && !j["previous_response_id"].is_null()) {
    if (!j["previous_response_id"].is_string()) {
      return send_error(
          res, Error{ErrorCode::kInvalidArgument, "'previous_response_id' must be a string",
                     "previous_response_id"});
    }
    echo.previous_response_id = j["previous_response_id"].get<std::string>();
    history = store_ptr->get(echo.previous_response_id);
    if (!history) {
      return send_error(
          res, Error{ErrorCode::kNotFound,
                     "Previous response with id '" + echo.previous_response_id +
                         "' not found: this server keeps stored responses in memory (the last " +
                         std::to_string(ResponseStore::kMaxResponses) +
                         ", until it restarts) and never those sent with store: false; send the "
                         "whole conversation as 'input' instead",
                     "previous_response_id"});
    }
  }
  auto translated = responses_to_chat(j, history ? &history->conversation : nullptr);
  if (!translated) return send_error(res, translated.error());
  auto parsed = parse_chat_request(dump_json(translated->chat), cfg_.max_logprobs);
  if (!parsed) return send_error(res, parsed.error());
  const ChatRequest r = std::move(*parsed);
  const bool store = !j.contains("store") || j["store"].is_null() || !j["store"].is_boolean() ||
                     j["store"].get<bool>();
  if (j.contains("background") && !j["background"].is_null()) {
    if (!j["background"].is_boolean())
      return send_error(
          res, Error{ErrorCode::kInvalidArgument, "'background' must be a boolean", "background"});
    echo.background = j["background"].get<bool>();
  }
  if (echo.background && !store) {
    return send_error(
        res, Error{ErrorCode::kInvalidArgument,
                   "'background': true needs store: true (a background response is read back "
                   "with GET /v1/responses/{id})",
                   "background"});
  }
  if (echo.background && r.common.stream) {
    return send_error(res, Error{ErrorCode::kUnsupported,
                                 "'background' with 'stream': true is not supported; send "
                                 "background: true without stream and poll GET "
                                 "/v1/responses/{id}, or stream without background",
                                 "stream"});
  }
  OrderedJson input_items = input_items_of(j["input"]);
  echo.id = "resp_" + random_id(32);
  auto started = start_chat(r, echo.id);
  if (!started) return send_error(res, started.error());
  auto job = std::make_shared<ChatJob>(std::move(*started));
  auto gen = job->gen;

  echo.model = r.common.model.empty() ? model_name() : r.common.model;
  echo.created = unix_now();
  auto get = [&](const char* k, Json dflt) {
    return j.contains(k) && !j[k].is_null() ? j[k] : dflt;
  };
  echo.instructions = get("instructions", nullptr);
  echo.max_output_tokens = get("max_output_tokens", nullptr);
  echo.temperature = get("temperature", nullptr);
  echo.top_p = get("top_p", nullptr);
  echo.tools = get("tools", Json::array());
  echo.tool_choice = get("tool_choice", "auto");
  echo.metadata = get("metadata", Json::object());
  echo.text = get("text", Json{{"format", {{"type", "text"}}}});
  echo.reasoning = get("reasoning", Json{{"effort", nullptr}, {"summary", nullptr}});
  echo.parallel_tool_calls = get("parallel_tool_calls", true);
  echo.store = get("store", true);
  auto remember = [store, store_ptr, conversation = translated->conversation, job, input_items](
                      const std::string& id, const Json& response) {
    if (!store) return;
    OrderedJson conv = conversation;
    conv.push_back(assistant_message(*job->gen->slots[0].out));
    store_ptr->put(id, std::move(conv), response, input_items);
  };
  auto finish_state = [](const ChoiceOutput& out) { return finish_state_of(out); };

  if (echo.background) {
    auto bg = std::make_shared<ResponseStore::Background>();
    const Json queued = response_json(echo, "queued", Json::array(), nullptr, nullptr);
    store_ptr->put(echo.id, translated->conversation, queued, input_items);
    {
      std::lock_guard<std::mutex> lock(store_ptr->mu);
      store_ptr->running[echo.id] = bg;
      ++store_ptr->live_threads;
    }
    std::thread(run_background, store_ptr, bg, job, echo, translated->conversation, input_items)
        .detach();
    return send_json(res, queued);
  }

  if (!r.common.stream) {
    if (!wait_or_abort(*gen, req)) return;
    const ChoiceOutput& out = *gen->slots[0].out;
    if (out.finish_reason() == "error")
      return send_error(res, Error{ErrorCode::kInternal, "generation failed: " + out.error(), ""});
    if (auto e = check_tool_choice(job->tool_choice, out)) return send_error(res, *e);
    const auto [status, incomplete] = finish_state(out);
    Json body = response_json(echo, status, output_of(out), usage_of(job->usage()), incomplete);
    remember(echo.id, body);
    return send_json(res, body);
  }

  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = [job, gen, guard, echo, remember, finish_state](ResponseSink& sink) {
    int64_t seq = 0;
    auto ev = [&](const std::string& name, const Json& fields) {
      Json j = {{"type", name}, {"sequence_number", seq++}};
      for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = it.value();
      return sink.write(sse_named_event(name, j));
    };
    auto fail = [&](const Error& e) {
      ev("error", {{"code", error_body(e)["error"]["code"]},
                   {"message", e.message},
                   {"param", e.param.empty() ? Json(nullptr) : Json(e.param)}});
      gen->abort_all();
      return false;
    };
    const Json pending = response_json(echo, "in_progress", Json::array(), nullptr, nullptr);
    if (!ev("response.created", {{"response", pending}}) ||
        !ev("response.in_progress", {{"response", pending}})) {
      gen->abort_all();
      return false;
    }
    OutputBlocks blocks;
    std::vector<std::string> ids;  // item id per block
    Json done_items = Json::array();
    auto emit = [&](const std::vector<BlockEvent>& events) {
      for (const BlockEvent& e : events) {
        bool ok = true;
        if (e.type == BlockEvent::Type::kOpen) {
          ids.push_back(item_id(e.kind));
          const std::string& id = ids.back();
          ok = ev("response.output_item.added",
                  {{"output_index", e.block},
                   {"item", output_item(e.kind, id, "", e.tool_id, e.tool_name, false)}});
          if (ok && e.kind == BlockKind::kText) {
            ok = ev("response.content_part.added",
                    {{"item_id", id},
                     {"output_index", e.block},
                     {"content_index", 0},
                     {"part",
                      {{"type", "output_text"}, {"text", ""}, {"annotations", Json::array()}}}});
          }
          continue;
        }
        const std::string& id = ids[static_cast<size_t>(e.block)];
        if (e.type == BlockEvent::Type::kDelta) {
          switch (e.kind) {
            case BlockKind::kReasoning:
              ok = ev("response.reasoning_text.delta", {{"item_id", id},
                                                        {"output_index", e.block},
                                                        {"content_index", 0},
                                                        {"delta", e.text}});
              break;
            case BlockKind::kText:
              ok = ev("response.output_text.delta", {{"item_id", id},
                                                     {"output_index", e.block},
                                                     {"content_index", 0},
                                                     {"delta", e.text},
                                                     {"logprobs", Json::array()}});
              break;
            case BlockKind::kToolCall:
              ok = ev("response.function_call_arguments.delta",
                      {{"item_id", id}, {"output_index", e.block}, {"delta", e.text}});
              break;
          }
        } else {
          switch (e.kind) {
            case BlockKind::kReasoning:
              ok = ev("response.reasoning_text.done", {{"item_id", id},
                                                       {"output_index", e.block},
                                                       {"content_index", 0},
                                                       {"text", e.text}});
              break;
            case BlockKind::kText:
              ok = ev("response.output_text.done", {{"item_id", id},
                                                    {"output_index", e.block},
                                                    {"content_index", 0},
                                                    {"text", e.text},
                                                    {"logprobs", Json::array()}}) &&
                   ev("response.content_part.done", {{"item_id", id},
                                                     {"output_index", e.block},
                                                     {"content_index", 0},
                                                     {"part",
                                                      {{"type", "output_text"},
                                                       {"text", e.text},
                                                       {"annotations", Json::array()}}}});
              break;
            case BlockKind::kToolCall:
              ok = ev("response.function_call_arguments.done", {{"item_id", id},
                                                                {"output_index", e.block},
                                                                {"name", e.tool_name},
                                                                {"arguments", e.text}});
              break;
          }
          Json item = output_item(e.kind, id, e.text, e.tool_id, e.tool_name, true);
          ok = ok && ev("response.output_item.done", {{"output_index", e.block}, {"item", item}});
          done_items.push_back(std::move(item));
        }
        if (!ok) return false;
      }
      return true;
    };
    const ChoiceOutput& out = *gen->slots[0].out;
    if (!stream_blocks(*gen, blocks, emit, [&] { return sink.client_gone(); })) return false;
    if (out.finish_reason() == "error")
      return fail(Error{ErrorCode::kInternal, "generation failed: " + out.error(), ""});
    if (auto e = check_tool_choice(job->tool_choice, out)) return fail(*e);
    if (!emit(blocks.finish())) return false;
    if (blocks.num_blocks() == 0) {  // an empty reply is still one (empty) message
      const std::string id = item_id(BlockKind::kText);
      Json item = output_item(BlockKind::kText, id, "", "", "", true);
      if (!ev("response.output_item.added",
              {{"output_index", 0},
               {"item", output_item(BlockKind::kText, id, "", "", "", false)}}) ||
          !ev("response.output_item.done", {{"output_index", 0}, {"item", item}}))
        return false;
      done_items.push_back(std::move(item));
    }
    const auto [status, incomplete] = finish_state(out);
    Json body = response_json(echo, status, done_items, usage_of(job->usage()), incomplete);
    remember(echo.id, body);
    return ev(status == "completed" ? "response.completed" : "response.incomplete",
              {{"response", body}});
  };
}

namespace {

std::string response_id_of(const HttpRequest& req) {
  std::string id = req.path.substr(std::string_view("/v1/responses/").size());
  return id.substr(0, id.find('/'));
}

Error response_not_found(const std::string& id) {
  return Error{ErrorCode::kNotFound,
               "Response with id '" + id +
                   "' not found: this server keeps stored responses in memory (the last " +
                   std::to_string(ResponseStore::kMaxResponses) +
                   ", until it restarts), never those sent with store: false or deleted",
               "response_id"};
}

}  // namespace

void HttpServerImpl::handle_get_response(const HttpRequest& req, HttpResponse& res) {
  const std::string id = response_id_of(req);
  auto e = response_store()->get(id);
  if (!e) return send_error(res, response_not_found(id));
  send_json(res, e->response);
}

void HttpServerImpl::handle_delete_response(const HttpRequest& req, HttpResponse& res) {
  const std::string id = response_id_of(req);
  auto store = response_store();
  if (auto bg = store->background(id)) {  // still generating: stop it first
    bg->cancel = true;
    bg->wait_done(std::chrono::seconds(5));
  }
  if (!store->erase(id)) return send_error(res, response_not_found(id));
  send_json(res, Json{{"id", id}, {"object", "response"}, {"deleted", true}});
}

void HttpServerImpl::handle_cancel_response(const HttpRequest& req, HttpResponse& res) {
  const std::string id = response_id_of(req);
  auto store = response_store();
  if (auto bg = store->background(id)) {
    bg->cancel = true;
    bg->wait_done(std::chrono::seconds(5));
  }
  auto e = store->get(id);
  if (!e) return send_error(res, response_not_found(id));
  const Json& r = e->response;
  if (!r.contains("background") || r["background"] != true) {
    return send_error(res, Error{ErrorCode::kInvalidArgument,
                                 "Cannot cancel a synchronous response: only responses created "
                                 "with background: true can be cancelled",
                                 "response_id"});
  }
  send_json(res, r);  // cancelled now, or the final state it had already reached
}

void HttpServerImpl::handle_response_input_items(const HttpRequest& req, HttpResponse& res) {
  const std::string id = response_id_of(req);
  auto e = response_store()->get(id);
  if (!e) return send_error(res, response_not_found(id));
  // Query: limit (1-100, default 20), order (asc | desc, default desc), after / before (an id).
  int64_t limit = 20;
  std::string order = "desc", after, before;
  size_t pos = 0;
  while (pos <= req.query.size() && !req.query.empty()) {
    size_t amp = req.query.find('&', pos);
    if (amp == std::string::npos) amp = req.query.size();
    const std::string kv = req.query.substr(pos, amp - pos);
    pos = amp + 1;
    const size_t eq = kv.find('=');
    const std::string k = kv.substr(0, eq);
    const std::string v = eq == std::string::npos ? "" : kv.substr(eq + 1);
    if (k == "limit") {
      char* end = nullptr;
      limit = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || limit < 1 || limit > 100)
        return send_error(res, Error{ErrorCode::kInvalidArgument,
                                     "'limit' must be an integer from 1 to 100", "limit"});
    } else if (k == "order") {
      if (v != "asc" && v != "desc")
        return send_error(res, Error{ErrorCode::kInvalidArgument,
                                     "'order' must be \"asc\" or \"desc\"", "order"});
      order = v;
    } else if (k == "after") {
      after = v;
    } else if (k == "before") {
      before = v;
    }
  }
  std::vector<const OrderedJson*> items;
  for (const auto& it : e->input_items) items.push_back(&it);
  if (order == "desc") std::reverse(items.begin(), items.end());
  auto index_of = [&](const std::string& item_id) -> std::optional<size_t> {
    for (size_t i = 0; i < items.size(); ++i)
      if ((*items[i])["id"] == item_id) return i;
    return std::nullopt;
  };
  size_t from = 0, to = items.size();
  if (!after.empty()) {
    auto i = index_of(after);
    if (!i)
      return send_error(res,
                        Error{ErrorCode::kInvalidArgument,
                              "'after': no input item '" + after + "' in this response", "after"});
    from = *i + 1;
  }
  if (!before.empty()) {
    auto i = index_of(before);
    if (!i)
      return send_error(
          res, Error{ErrorCode::kInvalidArgument,
                     "'before': no input item '" + before + "' in this response", "before"});
    to = *i;
  }
  Json data = Json::array();
  for (size_t i = from; i < to && static_cast<int64_t>(data.size()) < limit; ++i)
    data.push_back(*items[i]);
  const bool has_more = from + data.size() < to;
  send_json(res, Json{{"object", "list"},
                      {"data", data},
                      {"first_id", data.empty() ? Json(nullptr) : data.front()["id"]},
                      {"last_id", data.empty() ? Json(nullptr) : data.back()["id"]},
                      {"has_more", has_more}});
}

}  // namespace m3::server
