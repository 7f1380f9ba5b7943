// /v1/chat/completions: the chat template, reasoning and tool-call parsing, tool_choice checks,
// as JSON or as an SSE stream. Part of HttpServerImpl (server_impl.h).
#include <algorithm>
#include <chrono>
#include <optional>

#include "server/server_impl.h"

namespace m3::server {

// ------------------------------------------------------------------------------------- chat

namespace {

// Required / named tool_choice are enforced by a grammar over the tool-call markup, so an output
// that ended by itself ("stop") always holds the call; this checks that invariant. An output cut
// by max_tokens ("length") or aborted is returned as it is, like any truncated answer.
std::optional<Error> check_tool_choice(const ToolChoice& tc, const ChoiceOutput& out) {
  if (out.finish_reason() != "stop" && out.finish_reason() != "tool_calls") return std::nullopt;
  if (tc.kind == ToolChoiceKind::kRequired && out.tool_calls().empty()) {
    return Error{ErrorCode::kInternal,
                 "tool_choice is \"required\" but the output holds no parsable tool call although "
                 "the tool-call grammar completed; please report this",
                 "tool_choice"};
  }
  if (tc.kind == ToolChoiceKind::kNamed) {
    if (out.tool_calls().empty()) {
      return Error{ErrorCode::kInternal,
                   "tool_choice names `" + tc.name +
                       "` but the output holds no parsable call of it although "
                       "the tool-call grammar completed; please report this",
                   "tool_choice"};
    }
    for (const auto& c : out.tool_calls()) {
      if (c.name != tc.name) {
        return Error{
            ErrorCode::kInternal,
            "tool_choice names `" + tc.name + "` but the output calls `" + c.name +
                "` although the tool-call grammar allows only the named one; please report this",
            "tool_choice"};
      }
    }
  }
  return std::nullopt;
}

}  // namespace

void HttpServerImpl::handle_chat(const HttpRequest& req, HttpResponse& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_)
    return send_error(
        res, Error{ErrorCode::kUnavailable,
                   "the server is draining (shutting down); retry on another replica", ""});
  auto parsed = parse_chat_request(req.body);
  if (!parsed) return send_error(res, parsed.error());
  ChatRequest r = std::move(*parsed);
  if (auto st = check_model(r.common.model); !st) return send_error(res, st.error());
  const bool wants_tools = r.tools.is_array() && r.tool_choice.kind != ToolChoiceKind::kNone;
  if (wants_tools && !cfg_.parse_tool_calls) {
    return send_error(
        res,
        Error{ErrorCode::kInvalidArgument,
              "tool calls need the server started with --tool-call-parser minimax_m3", "tools"});
  }
  if (wants_tools && r.tool_choice.kind == ToolChoiceKind::kAuto && !cfg_.enable_auto_tool_choice) {
    return send_error(
        res, Error{ErrorCode::kInvalidArgument,
                   "\"auto\" tool choice needs the server started with --enable-auto-tool-choice",
                   "tool_choice"});
  }
  if (!r.media.empty()) {
    if (auto st = check_media_parts(r.media, cfg_.media, engine_.model_info()); !st)
      return send_error(res, st.error());
  }
  auto rendered = assets_.chat->render(r);
  if (!rendered) return send_error(res, rendered.error());

  auto gen = std::make_shared<Generation>(engine_);
  PromptData pd;
  if (auto st = check_text_fits(rendered->prompt.size(), "messages"); !st)
    return send_error(res, st.error());
  pd.ids = assets_.tokenizer->encode(rendered->prompt);
  if (!r.media.empty()) {
    // Decode and process the images, then one placeholder token per merged patch.
    auto images = prepare_images(r.media, cfg_.media, engine_.model_info(), media_cache_.get());
    if (!images) return send_error(res, images.error());
    if (auto st = expand_image_placeholders(pd.ids, *images, engine_.model_info().image_token_id,
                                            image_start_ids_, image_end_ids_);
        !st)
      return send_error(res, st.error());
    pd.images = std::move(*images);
  }
  gen->prompts.push_back(std::move(pd));
  engine::SamplingParams sp = make_sampling_params(r.common, assets_.defaults);
  if (auto st = fit_context(sp, r.common, gen->prompts[0].ids.size(), "messages"); !st) {
    return send_error(res, st.error());
  }
  // tool_choice required / named: a grammar over the M3 tool-call block makes the call certain.
  std::optional<text::StructuredOutputSpec> spec = r.common.structured;
  const bool forced_tool = wants_tools && (r.tool_choice.kind == ToolChoiceKind::kRequired ||
                                           r.tool_choice.kind == ToolChoiceKind::kNamed);
  if (forced_tool) {
    if (spec) {
      return send_error(
          res, Error{ErrorCode::kInvalidArgument,
                     "tool_choice \"required\" or a named function already fixes the output's "
                     "format; drop '" +
                         spec->param + "' or use tool_choice \"auto\"",
                     spec->param});
    }
    text::StructuredOutputSpec ts;
    ts.kind = text::StructuredOutputSpec::Kind::kToolCall;
    ts.tools = r.tools;
    if (r.tool_choice.kind == ToolChoiceKind::kNamed) ts.tool_name = r.tool_choice.name;
    ts.param = "tool_choice";
    spec = std::move(ts);
  }
  // The format applies after the reasoning block when reasoning is parsed out of the output.
  text::ReasoningPrefix prefix = text::ReasoningPrefix::kNone;
  if (cfg_.parse_reasoning) {
    switch (rendered->thinking_mode) {
      case text::ThinkingMode::kEnabled:
        prefix = text::ReasoningPrefix::kInside;
        break;
      case text::ThinkingMode::kDisabled:
        prefix = text::ReasoningPrefix::kNone;
        break;
      case text::ThinkingMode::kAdaptive:
        prefix = text::ReasoningPrefix::kOptional;
        break;
    }
  }
  if (auto st = apply_output_controls(sp, r.common, spec, prefix); !st)
    return send_error(res, st.error());

  ChoiceOptions base;
  base.tokenizer = assets_.tokenizer;
  base.skip_special_tokens = r.common.skip_special_tokens;
  base.stop = r.common.stop;
  base.include_stop_str = r.common.include_stop_str_in_output;
  base.eos_token_ids = engine_.model_info().eos_token_ids;
  if (cfg_.parse_reasoning || wants_tools) {
    text::ChatOutputOptions co;
    co.parse_reasoning = cfg_.parse_reasoning;
    co.thinking_mode = rendered->thinking_mode;
    co.parse_tool_calls = wants_tools;
    if (wants_tools) co.tools = nlohmann::json::parse(rendered->tools.dump());
    co.tool_options.id_prefix = "call_" + random_id(20) + "_";
    base.chat = co;
  }
  if (auto st = submit_all(*gen, sp, r.common, base); !st) return send_error(res, st.error());

  const std::string id = "chatcmpl-" + random_id(32);
  const int64_t created = unix_now();
  const std::string model = model_name();
  const ToolChoice tool_choice =
      wants_tools ? r.tool_choice : ToolChoice{ToolChoiceKind::kAuto, {}};
  const bool logprobs = r.common.logprobs >= 0;
  auto usage_of = [](const Generation& g) {
    UsageCounts u;
    u.prompt_tokens = static_cast<int64_t>(g.prompts[0].ids.size());
    for (const auto& s : g.slots) {
      u.completion_tokens += s.out->num_output_tokens();
      u.cached_tokens = std::max<int64_t>(u.cached_tokens, s.out->num_cached_tokens());
      u.reasoning_tokens += s.out->num_reasoning_tokens();
    }
    return u;
  };

  if (!r.common.stream) {
    if (!wait_or_abort(*gen, req)) return;
    for (const auto& s : gen->slots) {
      if (s.out->finish_reason() == "error") {
        return send_error(res,
                          Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""});
      }
      if (auto e = check_tool_choice(tool_choice, *s.out)) return send_error(res, *e);
    }
    Json choices = Json::array();
    for (const auto& s : gen->slots) {
      Json msg;
      msg["role"] = "assistant";
      const bool has_calls = !s.out->tool_calls().empty();
      msg["content"] = (s.out->text().empty() && has_calls) ? Json(nullptr) : Json(s.out->text());
      msg["reasoning"] = s.out->reasoning().empty() ? Json(nullptr) : Json(s.out->reasoning());
      msg["reasoning_content"] = msg["reasoning"];
      Json calls = Json::array();
      for (const auto& c : s.out->tool_calls()) calls.push_back(tool_call_json(c));
      msg["tool_calls"] = calls;
      Json c;
      c["index"] = s.index;
      c["message"] = msg;
      c["logprobs"] = logprobs ? chat_logprobs_json(s.out->logprobs()) : Json(nullptr);
      c["finish_reason"] = s.out->finish_reason();
      c["stop_reason"] = nullptr;
      choices.push_back(std::move(c));
    }
    Json body = {{"id", id}, {"object", "chat.completion"}, {"created", created}, {"model", model}};
    body["choices"] = choices;
    body["usage"] = usage_json(usage_of(*gen));
    return send_json(res, body);
  }

  const bool include_usage = r.common.include_usage;
  const bool continuous = r.common.continuous_usage_stats;
  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = [gen, guard,
                env = SseEnvelope{id, "chat.completion.chunk", model, created, include_usage,
                                  continuous},
                logprobs, tool_choice, usage_of](ResponseSink& sink) {
    auto write = [&](const std::string& s) { return sink.write(s); };
    auto chunk = [&](const ChoiceSlot& s, const Json& delta, const Json& lps, const Json& finish) {
      Json c = {{"index", s.index}, {"delta", delta}, {"logprobs", lps}, {"finish_reason", finish}};
      return write(env.chunk(std::move(c), [&] { return usage_of(*gen); }));
    };
    // The role comes first, before any token, in every choice.
    for (const auto& s : gen->slots) {
      if (!chunk(s, Json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr)) {
        gen->abort_all();
        return false;
      }
    }
    for (;;) {
      auto got = gen->poll(std::chrono::milliseconds(100));
      for (auto& [i, d] : got) {
        const ChoiceSlot& s = gen->slots[i];
        Json finish = nullptr;
        if (s.out->finished()) {
          if (s.out->finish_reason() == "error") {
            write(
                sse_error(Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""}));
            gen->abort_all();
            return false;
          }
          if (auto e = check_tool_choice(tool_choice, *s.out)) {
            write(sse_error(*e));
            gen->abort_all();
            return false;
          }
          finish = s.out->finish_reason();
        }
        const Json lps =
            logprobs && !d.logprobs.empty() ? chat_logprobs_json(d.logprobs) : Json(nullptr);
        Json delta = chat_delta_json(d);
        if (delta.empty() && finish.is_null() && lps.is_null()) continue;
        if (!chunk(s, delta, lps, finish)) {
          gen->abort_all();
          return false;
        }
      }
      if (gen->all_finished()) break;
      if (got.empty() && sink.client_gone()) {
        gen->abort_all();
        return false;
      }
    }
    return env.finish(sink, usage_of(*gen));
  };
}

}  // namespace m3::server
