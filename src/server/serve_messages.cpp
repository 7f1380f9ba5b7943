// /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.
// The request (system, messages of text / tool_use / tool_result / thinking blocks, tools,
// tool_choice, thinking, stop_sequences, sampling) becomes the equivalent chat request, so it is
// validated, rendered and run by start_chat like any chat completion; the output goes back as
// Anthropic content blocks (thinking from the reasoning parser, text, tool_use), as JSON or as
// Anthropic's SSE events (message_start, content_block_start / delta / stop, message_delta,
// message_stop), with errors in Anthropic's shape {"type": "error", "error": {type, message}}.
// Part of HttpServerImpl (server_impl.h).
#include <chrono>

#include "server/json_limits.h"
#include "server/output_blocks.h"
#include "server/server_impl.h"

namespace m3::server {

namespace {

// Anthropic's error types by HTTP status.
const char* anthropic_error_type(int status) {
  switch (status) {
    case 400:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
      return "overloaded_error";
    default:
      return "api_error";
  }
}

Json anthropic_error_body(const Error& e) {
  std::string msg = e.message;
  if (!e.param.empty() && msg.find(e.param) == std::string::npos) msg = e.param + ": " + msg;
  return {{"type", "error"},
          {"error", {{"type", anthropic_error_type(http_status(e))}, {"message", msg}}}};
}

}  // namespace

void send_anthropic_error(HttpResponse& res, const Error& e) {
  res.status = http_status(e);
  res.set_content(dump_json(anthropic_error_body(e)), "application/json");
  if (res.status == 429 || res.status == 503) res.set_header("Retry-After", "1");
}

namespace {

// Text of a content that is a string or an array of text blocks (system, tool_result content).
Result<std::string> block_text(const OrderedJson& v, const std::string& param) {
  if (v.is_null()) return std::string();
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array())
    return invalid_param(param, "'" + param + "' must be a string or an array of blocks");
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string bp = param + "[" + std::to_string(i) + "]";
    const auto& b = v[i];
    if (!b.is_object() || !b.contains("type") || !b["type"].is_string())
      return invalid_param(bp, "'" + bp + "' must be a block with a string 'type'");
    const std::string type = b["type"].get<std::string>();
    if (type != "text") {
      return make_error(ErrorCode::kUnsupported,
                        "'" + bp + "' is a '" + type +
                            "' block; only text blocks are supported here (this server serves "
                            "the text model)",
                        bp);
    }
    if (!b.contains("text") || !b["text"].is_string())
      return invalid_param(bp + ".text", "'" + bp + ".text' must be a string");
    out += (out.empty() ? "" : "\n") + b["text"].get<std::string>();
  }
  return out;
}

// One Anthropic message -> the chat messages it stands for (a user message with tool_result
// blocks becomes tool messages, then the user's text).
Status translate_message(const OrderedJson& m, const std::string& mp, OrderedJson& out) {
  if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
    return invalid_param(mp,
                         "'" + mp + "' must be an object with 'role' \"user\" or \"assistant\"");
  const std::string role = m["role"].get<std::string>();
  if (role != "user" && role != "assistant")
    return invalid_param(mp + ".role",
                         "'" + mp + ".role' must be \"user\" or \"assistant\", got '" + role +
                             "' (the system prompt goes in the top-level 'system')");
  if (!m.contains("content"))
    return invalid_param(mp + ".content", "'" + mp + ".content' is required");
  const OrderedJson& content = m["content"];
  if (content.is_string()) {
    out.push_back({{"role", role}, {"content", content}});
    return {};
  }
  if (!content.is_array())
    return invalid_param(mp + ".content",
                         "'" + mp + ".content' must be a string or an array of blocks");
  std::string text, thinking;
  OrderedJson calls = OrderedJson::array();
  OrderedJson tool_msgs = OrderedJson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string bp = mp + ".content[" + std::to_string(i) + "]";
    const auto& b = content[i];
    if (!b.is_object() || !b.contains("type") || !b["type"].is_string())
      return invalid_param(bp, "'" + bp + "' must be a block with a string 'type'");
    const std::string type = b["type"].get<std::string>();
    if (type == "text") {
      if (!b.contains("text") || !b["text"].is_string())
        return invalid_param(bp + ".text", "'" + bp + ".text' must be a string");
      text += (text.empty() ? "" : "\n") + b["text"].get<std::string>();
    } else if (type == "thinking" && role == "assistant") {
      if (b.contains("thinking") && b["thinking"].is_string())
        thinking += b["thinking"].get<std::string>();
    } else if (type == "redacted_thinking" && role == "assistant") {
      continue;  // opaque to this server: nothing to put back in the prompt
    } else if (type == "tool_use" && role == "assistant") {
      if (!b.contains("id") || !b["id"].is_string() || !b.contains("name") ||
          !b["name"].is_string())
        return invalid_param(bp, "'" + bp + "' (tool_use) needs string 'id' and 'name'");
      const OrderedJson input =
          b.contains("input") && b["input"].is_object() ? b["input"] : OrderedJson::object();
      calls.push_back({{"id", b["id"]},
                       {"type", "function"},
                       {"function", {{"name", b["name"]}, {"arguments", dump_json(input)}}}});
    } else if (type == "tool_result" && role == "user") {
      if (!b.contains("tool_use_id") || !b["tool_use_id"].is_string())
        return invalid_param(bp + ".tool_use_id", "'" + bp + ".tool_use_id' must be a string");
      M3_TRY(std::string result,
             block_text(b.contains("content") ? b["content"] : OrderedJson(), bp + ".content"));
      if (b.contains("is_error") && b["is_error"].is_boolean() && b["is_error"].get<bool>())
        result = "Error: " + result;
      tool_msgs.push_back(
          {{"role", "tool"}, {"tool_call_id", b["tool_use_id"]}, {"content", result}});
    } else {
      return make_error(ErrorCode::kUnsupported,
                        "'" + bp + "' is a '" + type + "' block, which a " + role +
                            " message cannot carry here; send text" +
                            (role == "user" ? ", tool_result" : ", thinking, tool_use") +
                            " blocks (this server serves the text model)",
                        bp);
    }
  }
  for (auto& t : tool_msgs) out.push_back(std::move(t));
  if (role == "assistant") {
    OrderedJson msg = {{"role", "assistant"}, {"content", text}};
    if (!thinking.empty()) msg["reasoning_content"] = thinking;
    if (!calls.empty()) msg["tool_calls"] = std::move(calls);
    out.push_back(std::move(msg));
  } else if (!text.empty() || tool_msgs.empty()) {
    out.push_back({{"role", "user"}, {"content", text}});
  }
  return {};
}

// The chat completions body an Anthropic Messages body stands for. `count_only`: for
// count_tokens (max_tokens not required).
Result<OrderedJson> messages_to_chat(std::string_view body, bool count_only) {
  M3_TRY(OrderedJson j, parse_json_bounded(body, "the request body"));
  if (!j.is_object()) return invalid_param("", "request body must be a JSON object");
  OrderedJson c = OrderedJson::object();
  if (j.contains("model")) c["model"] = j["model"];
  if (!count_only) {
    if (!j.contains("max_tokens"))
      return invalid_param("max_tokens",
                           "'max_tokens' is required: the most tokens the reply may have");
    c["max_tokens"] = j["max_tokens"];
  }
  for (const char* k : {"temperature", "top_p", "top_k", "stream"}) {
    if (j.contains(k)) c[k] = j[k];
  }
  if (j.contains("stop_sequences")) c["stop"] = j["stop_sequences"];
  OrderedJson msgs = OrderedJson::array();
  if (j.contains("system") && !j["system"].is_null()) {
    M3_TRY(std::string sys, block_text(j["system"], "system"));
    msgs.push_back({{"role", "system"}, {"content", sys}});
  }
  if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
    return invalid_param("messages", "'messages' must be a non-empty array of {role, content}");
  if (j["messages"].size() > kMaxMessages) {
    return invalid_param(
        "messages", "'messages' holds more than " + std::to_string(kMaxMessages) + " messages");
  }
  for (size_t i = 0; i < j["messages"].size(); ++i)
    M3_TRY_STATUS(translate_message(j["messages"][i], "messages[" + std::to_string(i) + "]", msgs));
  // A final assistant message is a prefill: the reply continues it.
  if (string_member(j["messages"].back(), "role") == "assistant") {
    c["add_generation_prompt"] = false;
    c["continue_final_message"] = true;
  }
  c["messages"] = std::move(msgs);
  if (j.contains("tools") && j["tools"].is_array() && !j["tools"].empty()) {
    OrderedJson tools = OrderedJson::array();
    for (size_t i = 0; i < j["tools"].size(); ++i) {
      const std::string tp = "tools[" + std::to_string(i) + "]";
      const auto& t = j["tools"][i];
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
        return invalid_param(tp, "'" + tp + "' must be an object with a string 'name'");
      if (t.contains("type") && t["type"].is_string() && t["type"] != "custom") {
        return make_error(ErrorCode::kUnsupported,
                          "'" + tp + "' is the server tool '" + t["type"].get<std::string>() +
                              "', which this server does not run; give client tools {name, "
                              "description, input_schema}",
                          tp + ".type");
      }
      OrderedJson fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      fn["parameters"] = t.contains("input_schema") && t["input_schema"].is_object()
                             ? t["input_schema"]
                             : OrderedJson{{"type", "object"}};
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    c["tools"] = std::move(tools);
  }
  if (j.contains("tool_choice") && !j["tool_choice"].is_null()) {
    const auto& tc = j["tool_choice"];
    const std::string type = string_member(tc, "type");
    if (type == "auto") {
      c["tool_choice"] = "auto";
    } else if (type == "any") {
      c["tool_choice"] = "required";
    } else if (type == "none") {
      c["tool_choice"] = "none";
    } else if (type == "tool" && tc.contains("name") && tc["name"].is_string()) {
      c["tool_choice"] = {{"type", "function"}, {"function", {{"name", tc["name"]}}}};
    } else {
      return invalid_param(
          "tool_choice",
          "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": "
          "\"tool\", \"name\": ...}");
    }
    if (tc.contains("disable_parallel_tool_use")) {
      if (!tc["disable_parallel_tool_use"].is_boolean()) {
        return invalid_param("tool_choice",
                             "'tool_choice.disable_parallel_tool_use' must be a boolean");
      }
      c["parallel_tool_calls"] = !tc["disable_parallel_tool_use"].get<bool>();
    }
  }
  if (j.contains("thinking") && !j["thinking"].is_null()) {
    const auto& th = j["thinking"];
    const std::string type = string_member(th, "type");
    if (type == "enabled") {
      c["chat_template_kwargs"] = {{"thinking_mode", "enabled"}};
      if (th.contains("budget_tokens") && th["budget_tokens"].is_number_integer())
        c["thinking_token_budget"] = th["budget_tokens"];
    } else if (type == "disabled") {
      c["chat_template_kwargs"] = {{"thinking_mode", "disabled"}};
    } else if (type == "adaptive") {
      c["chat_template_kwargs"] = {{"thinking_mode", "adaptive"}};
    } else {
      return invalid_param(
          "thinking",
          "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": "
          "\"disabled\"} or {\"type\": \"adaptive\"}");
    }
  }
  return c;
}

// Anthropic's stop_reason (and stop_sequence) of a finished choice.
std::pair<Json, Json> stop_of(const ChoiceOutput& out) {
  const std::string f = out.finish_reason();
  if (f == "tool_calls") return {"tool_use", nullptr};
  if (f == "length") return {"max_tokens", nullptr};
  if (out.stop_string()) return {"stop_sequence", *out.stop_string()};
  return {"end_turn", nullptr};
}

Json tool_input(const std::string& arguments_json) {
  Json input = Json::parse(arguments_json, nullptr, false);
  return input.is_object() ? input : Json::object();
}

Json usage_of(const UsageCounts& u) {
  return {{"input_tokens", u.prompt_tokens},
          {"output_tokens", u.completion_tokens},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", u.cached_tokens}};
}

}  // namespace

void HttpServerImpl::handle_count_tokens(const HttpRequest& req, HttpResponse& res) {
  auto body = messages_to_chat(req.body, /*count_only=*/true);
  if (!body) return send_anthropic_error(res, body.error());
  auto r = parse_chat_request(dump_json(*body), cfg_.max_logprobs);
  if (!r) return send_anthropic_error(res, r.error());
  if (auto st = check_model(r->common.model); !st) return send_anthropic_error(res, st.error());
  auto rendered = assets_.chat->render(*r);
  if (!rendered) return send_anthropic_error(res, rendered.error());
  if (auto st = check_text_fits(rendered->prompt.size(), "messages"); !st)
    return send_anthropic_error(res, st.error());
  const size_t n = assets_.tokenizer->encode(rendered->prompt).size();
  send_json(res, Json{{"input_tokens", n}});
}

void HttpServerImpl::handle_messages(const HttpRequest& req, HttpResponse& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_) {
    return send_anthropic_error(
        res, Error{ErrorCode::kUnavailable,
                   "the server is draining (shutting down); retry on another replica", ""});
  }
  auto body = messages_to_chat(req.body, /*count_only=*/false);
  if (!body) return send_anthropic_error(res, body.error());
  auto parsed = parse_chat_request(dump_json(*body), cfg_.max_logprobs);
  if (!parsed) return send_anthropic_error(res, parsed.error());
  const ChatRequest r = std::move(*parsed);
  const std::string id = "msg_" + random_id(24);
  auto started = start_chat(r, id);
  if (!started) return send_anthropic_error(res, started.error());
  auto job = std::make_shared<ChatJob>(std::move(*started));
  auto gen = job->gen;
  const std::string model = r.common.model.empty() ? model_name() : r.common.model;

  if (!r.common.stream) {
    if (!wait_or_abort(*gen, req)) return;
    const ChoiceOutput& out = *gen->slots[0].out;
    if (out.finish_reason() == "error") {
      return send_anthropic_error(
          res, Error{ErrorCode::kInternal, "generation failed: " + out.error(), ""});
    }
    if (auto e = check_tool_choice(job->tool_choice, out)) return send_anthropic_error(res, *e);
    Json content = Json::array();
    if (!out.reasoning().empty()) {
      content.push_back({{"type", "thinking"}, {"thinking", out.reasoning()}, {"signature", ""}});
    }
    const std::string& text = out.text();
    if (!text.empty() || out.tool_calls().empty())
      content.push_back({{"type", "text"}, {"text", text}});
    for (const auto& c : out.tool_calls()) {
      content.push_back({{"type", "tool_use"},
                         {"id", c.id},
                         {"name", c.name},
                         {"input", tool_input(c.arguments_json)}});
    }
    const auto [stop_reason, stop_sequence] = stop_of(out);
    Json msg = {{"id", id},
                {"type", "message"},
                {"role", "assistant"},
                {"model", model},
                {"content", content},
                {"stop_reason", stop_reason},
                {"stop_sequence", stop_sequence}};
    msg["usage"] = usage_of(job->usage());
    return send_json(res, msg);
  }

  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = [job, gen, guard, id, model](ResponseSink& sink) {
    auto ev = [&](const char* name, const Json& fields) {
      Json j = {{"type", name}};
      for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = it.value();
      return sink.write(sse_named_event(name, j));
    };
    auto fail = [&](const Error& e) {
      sink.write(sse_named_event("error", anthropic_error_body(e)));
      gen->abort_all();
      return false;
    };
    Json start_usage = usage_of(job->usage());
    start_usage["output_tokens"] = 0;
    Json message = {{"id", id},
                    {"type", "message"},
                    {"role", "assistant"},
                    {"model", model},
                    {"content", Json::array()},
                    {"stop_reason", nullptr},
                    {"stop_sequence", nullptr},
                    {"usage", start_usage}};
    if (!ev("message_start", {{"message", message}})) {
      gen->abort_all();
      return false;
    }
    OutputBlocks blocks;
    auto emit = [&](const std::vector<BlockEvent>& events) {
      for (const BlockEvent& e : events) {
        bool ok = true;
        if (e.type == BlockEvent::Type::kOpen) {
          Json cb;
          switch (e.kind) {
            case BlockKind::kReasoning:
              cb = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
              break;
            case BlockKind::kText:
              cb = {{"type", "text"}, {"text", ""}};
              break;
            case BlockKind::kToolCall:
              cb = {{"type", "tool_use"},
                    {"id", e.tool_id},
                    {"name", e.tool_name},
                    {"input", Json::object()}};
              break;
          }
          ok = ev("content_block_start", {{"index", e.block}, {"content_block", cb}});
        } else if (e.type == BlockEvent::Type::kDelta) {
          Json d;
          switch (e.kind) {
            case BlockKind::kReasoning:
              d = {{"type", "thinking_delta"}, {"thinking", e.text}};
              break;
            case BlockKind::kText:
              d = {{"type", "text_delta"}, {"text", e.text}};
              break;
            case BlockKind::kToolCall:
              d = {{"type", "input_json_delta"}, {"partial_json", e.text}};
              break;
          }
          ok = ev("content_block_delta", {{"index", e.block}, {"delta", d}});
        } else {
          ok = ev("content_block_stop", {{"index", e.block}});
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
    if (blocks.num_blocks() == 0) {  // an empty reply still has its (empty) text block
      if (!ev("content_block_start",
              {{"index", 0}, {"content_block", {{"type", "text"}, {"text", ""}}}}) ||
          !ev("content_block_stop", {{"index", 0}}))
        return false;
    }
    if (!emit(blocks.finish())) return false;
    const auto [stop_reason, stop_sequence] = stop_of(out);
    const UsageCounts u = job->usage();
    return ev("message_delta",
              {{"delta", {{"stop_reason", stop_reason}, {"stop_sequence", stop_sequence}}},
               {"usage", {{"output_tokens", u.completion_tokens}}}}) &&
           ev("message_stop", Json::object());
  };
}

}  // namespace m3::server
