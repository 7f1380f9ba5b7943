#include "server/response_json.h"

#include "server/api_error.h"

namespace m3::server {

std::string dump_json(const Json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string sse_event(const Json& j) {
  return "data: " + dump_json(j) + "\n\n";
}

std::string sse_named_event(const std::string& name, const Json& j) {
  return "event: " + name + "\ndata: " + dump_json(j) + "\n\n";
}

std::string sse_done() {
  return "data: [DONE]\n\n";
}

std::string sse_error(const Error& error) {
  return "data: " + error_json(error) + "\n\n";
}

Json usage_json(const UsageCounts& u) {
  Json j;
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  j["completion_tokens_details"] = {{"reasoning_tokens", u.reasoning_tokens}};
  return j;
}

Json bytes_json(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

Json chat_logprobs_json(const std::vector<TokenLogprob>& lps) {
  Json content = Json::array();
  for (const auto& lp : lps) {
    Json top = Json::array();
    for (const auto& [t, l] : lp.top) {
      top.push_back({{"token", t}, {"logprob", static_cast<double>(l)}, {"bytes", bytes_json(t)}});
    }
    content.push_back({{"token", lp.text},
                       {"logprob", static_cast<double>(lp.logprob)},
                       {"bytes", bytes_json(lp.text)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

void CompletionLogprobs::add(const std::string& token, std::optional<float> logprob,
                             const std::vector<std::pair<std::string, float>>& top) {
  tokens.push_back(token);
  token_logprobs.push_back(logprob ? Json(static_cast<double>(*logprob)) : Json(nullptr));
  if (!logprob) {
    top_logprobs.push_back(nullptr);
  } else {
    Json t = Json::object();
    for (const auto& [s, l] : top) {
      if (!t.contains(s)) t[s] = static_cast<double>(l);
    }
    top_logprobs.push_back(std::move(t));
  }
  text_offset.push_back(next_offset);
  next_offset += static_cast<int64_t>(token.size());
}

Json CompletionLogprobs::to_json() const {
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top_logprobs},
          {"text_offset", text_offset}};
}

Json tool_call_json(const text::ToolCall& call) {
  return {{"id", call.id},
          {"type", "function"},
          {"function", {{"name", call.name}, {"arguments", call.arguments_json}}}};
}

Json tool_call_delta_json(const text::ToolCallDelta& d) {
  Json j;
  j["index"] = d.index;
  if (d.id) {
    j["id"] = *d.id;
    j["type"] = "function";
  }
  Json fn = Json::object();
  if (d.name) fn["name"] = *d.name;
  fn["arguments"] = d.arguments_delta;
  j["function"] = fn;
  return j;
}

Json chat_delta_json(const ChoiceDelta& delta) {
  Json j = Json::object();
  if (!delta.reasoning.empty()) {
    j["reasoning"] = delta.reasoning;
    j["reasoning_content"] = delta.reasoning;
  }
  if (!delta.text.empty()) j["content"] = delta.text;
  if (!delta.tool_calls.empty()) {
    Json calls = Json::array();
    for (const auto& c : delta.tool_calls) calls.push_back(tool_call_delta_json(c));
    j["tool_calls"] = calls;
  }
  return j;
}

}  // namespace m3::server
