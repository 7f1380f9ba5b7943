// The chat pipeline every chat-shaped API shares (start_chat: template, tokenization, context,
// tool_choice grammars, thinking budget, masks, submission) and /v1/chat/completions' own output
// as JSON or as an SSE stream. /v1/messages and /v1/responses format the same ChatJob their own
// way (serve_messages.cpp, serve_responses.cpp). Part of HttpServerImpl (server_impl.h).
#include <algorithm>
#include <chrono>
#include <optional>

#include "server/server_impl.h"

namespace m3::server {

// ------------------------------------------------------------------------------------- chat

// An output cut by max_tokens ("length") or aborted is returned as it is, like any truncated
// answer; only an output that ended by itself must hold the forced call.
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

UsageCounts ChatJob::usage() const {
  UsageCounts u;
  u.prompt_tokens = static_cast<int64_t>(gen->prompts[0].ids.size());
  for (const auto& s : gen->slots) {
    u.completion_tokens += s.out->num_output_tokens();
    u.cached_tokens = std::max<int64_t>(u.cached_tokens, s.out->num_cached_tokens());
    u.reasoning_tokens += s.out->num_reasoning_tokens();
  }
  return u;
}

Result<ChatJob> HttpServerImpl::start_chat(const ChatRequest& r,
                                           const std::string& request_id) const {
  M3_TRY_STATUS(check_model(r.common.model));
  ChatJob job;
  job.wants_tools = r.tools.is_array() && r.tool_choice.kind != ToolChoiceKind::kNone;
  if (job.wants_tools && !cfg_.parse_tool_calls) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tool calls need the server started with --tool-call-parser minimax_m3",
                      "tools");
  }
  if (job.wants_tools && r.tool_choice.kind == ToolChoiceKind::kAuto &&
      !cfg_.enable_auto_tool_choice) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "\"auto\" tool choice needs the server started with --enable-auto-tool-choice",
        "tool_choice");
  }
  if (!r.media.empty()) {
    M3_TRY_STATUS(check_media_parts(r.media, cfg_.media, engine_.model_info()));
  }
  M3_TRY(auto rendered, assets_.chat->render(r));
  job.thinking_mode = rendered.thinking_mode;

  job.gen = std::make_shared<Generation>(engine_, cfg_.stream_interval);
  PromptData pd;
  M3_TRY_STATUS(check_text_fits(rendered.prompt.size(), "messages"));
  // Videos first: their expansion is text (timestamps between the frame pairs), put into the
  // rendered prompt before tokenizing, as the HF processor does.
  std::vector<PreparedVideo> videos;
  const bool has_video = std::any_of(r.media.begin(), r.media.end(),
                                     [](const MediaPart& m) { return m.kind == "video"; });
  if (has_video) {
    M3_TRY(videos, prepare_videos(r.media, cfg_.media, engine_.model_info(), media_cache_.get()));
    M3_TRY_STATUS(expand_video_text(rendered.prompt, videos));
    M3_TRY_STATUS(check_text_fits(rendered.prompt.size(), "messages"));
  }
  pd.ids = assets_.tokenizer->encode(rendered.prompt);
  M3_TRY_STATUS(truncate_prompt(pd.ids, r.common));
  if (!r.media.empty()) {
    // Decode and process the images, then one placeholder token per merged patch.
    M3_TRY(auto images,
           prepare_images(r.media, cfg_.media, engine_.model_info(), media_cache_.get()));
    M3_TRY_STATUS(expand_image_placeholders(pd.ids, images, engine_.model_info().image_token_id,
                                            image_start_ids_, image_end_ids_));
    if (has_video) {
      M3_TRY_STATUS(locate_video_tokens(pd.ids, videos, engine_.model_info().video_token_id));
      for (auto& v : videos) images.push_back(std::move(v.input));
      std::stable_sort(images.begin(), images.end(),
                       [](const engine::ImageInput& a, const engine::ImageInput& b) {
                         return a.token_offset < b.token_offset;
                       });
    }
    pd.images = std::move(images);
  }
  job.gen->prompts.push_back(std::move(pd));
  engine::SamplingParams sp = make_sampling_params(r.common, assets_.defaults);
  M3_TRY_STATUS(fit_context(sp, r.common, job.gen->prompts[0].ids.size(), "messages"));
  // tool_choice required / named: a grammar over the M3 tool-call block makes the call certain.
  std::optional<text::StructuredOutputSpec> spec = r.common.structured;
  const bool forced_tool = job.wants_tools && (r.tool_choice.kind == ToolChoiceKind::kRequired ||
                                               r.tool_choice.kind == ToolChoiceKind::kNamed);
  if (forced_tool) {
    if (spec) {
      return make_error(ErrorCode::kInvalidArgument,
                        "tool_choice \"required\" or a named function already fixes the output's "
                        "format; drop '" +
                            spec->param + "' or use tool_choice \"auto\"",
                        spec->param);
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
    switch (rendered.thinking_mode) {
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
  M3_TRY_STATUS(apply_output_controls(sp, r.common, spec, prefix));
  if (r.thinking_token_budget) {
    M3_TRY_STATUS(apply_thinking_budget(sp, *r.thinking_token_budget, rendered.thinking_mode));
  }
  if (r.tools.is_array() && r.tool_choice.kind == ToolChoiceKind::kNone) {
    // tool_choice "none": the tools stay out of the prompt, and the tokens that open M3's tool
    // markup cannot be drawn, so the content never carries a call the client did not ask for.
    for (std::string_view m : {"]<]minimax[>[", "<tool_call>"}) {
      if (auto id = assets_.tokenizer->token_to_id(m)) sp.bad_words.push_back({*id});
    }
  }

  ChoiceOptions base;
  base.tokenizer = assets_.tokenizer;
  base.skip_special_tokens = r.common.skip_special_tokens;
  base.stop = r.common.stop;
  base.include_stop_str = r.common.include_stop_str_in_output;
  base.eos_token_ids = engine_.model_info().eos_token_ids;
  base.tokens_as_ids = r.common.return_tokens_as_token_ids;
  base.max_tool_calls = r.parallel_tool_calls ? 0 : 1;
  if (cfg_.parse_reasoning || job.wants_tools) {
    text::ChatOutputOptions co;
    co.parse_reasoning = cfg_.parse_reasoning;
    co.thinking_mode = rendered.thinking_mode;
    co.parse_tool_calls = job.wants_tools;
    if (job.wants_tools) co.tools = nlohmann::json::parse(rendered.tools.dump());
    co.tool_options.id_prefix = "call_" + random_id(20) + "_";
    base.chat = co;
  }
  // The reply's role: --response-role after a generation prompt, else the final message's own
  // role. vLLM's chat `echo`: the reply continues the final message when it has that role.
  {
    const auto& last = r.messages.back();
    job.role = r.add_generation_prompt ? cfg_.response_role : last["role"].get<std::string>();
    if (r.echo && last["role"] == job.role && last["content"].is_string())
      job.echo = last["content"].get<std::string>();
  }
  M3_TRY_STATUS(submit_all(*job.gen, sp, r.common, base, request_id));
  job.tool_choice = job.wants_tools ? r.tool_choice : ToolChoice{ToolChoiceKind::kAuto, {}};
  return job;
}

Json prompt_logprobs_json(const ChoiceOutput& out, const std::vector<int32_t>& ids) {
  Json arr = Json::array();
  const auto& pl = out.prompt_logprobs();
  for (size_t k = 0; k < ids.size(); ++k) {
    if (!pl || k >= pl->size() || !(*pl)[k]) {
      arr.push_back(nullptr);
      continue;
    }
    const engine::TokenLogprobOut& e = *(*pl)[k];
    Json m = Json::object();
    m[std::to_string(e.token)] = {
        {"logprob", e.logprob}, {"rank", e.rank}, {"decoded_token", out.logprob_token(e.token)}};
    for (size_t r = 0; r < e.top.size(); ++r) {
      const std::string key = std::to_string(e.top[r].first);
      if (m.contains(key)) continue;
      m[key] = {{"logprob", e.top[r].second},
                {"rank", static_cast<int64_t>(r + 1)},
                {"decoded_token", out.logprob_token(e.top[r].first)}};
    }
    arr.push_back(std::move(m));
  }
  return arr;
}

Json stop_reason_json(const ChoiceOutput& out) {
  if (out.stop_string()) return *out.stop_string();
  if (out.stop_token()) return *out.stop_token();
  return nullptr;
}

void HttpServerImpl::handle_chat(const HttpRequest& req, HttpResponse& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_)
    return send_error(
        res, Error{ErrorCode::kUnavailable,
                   "the server is draining (shutting down); retry on another replica", ""});
  auto parsed = parse_chat_request(req.body, cfg_.max_logprobs);
  if (!parsed) return send_error(res, parsed.error());
  ChatRequest r = std::move(*parsed);
  const std::string id = "chatcmpl-" + random_id(32);
  auto started = start_chat(r, id);
  if (!started) return send_error(res, started.error());
  auto job = std::make_shared<ChatJob>(std::move(*started));
  auto gen = job->gen;

  const int64_t created = unix_now();
  const std::string model = model_name();
  const bool logprobs = r.common.logprobs >= 0;
  const bool include_reasoning = r.include_reasoning;
  const bool token_ids = r.common.return_token_ids;
  const bool want_prompt_lps = r.common.prompt_logprobs >= 0;

  if (!r.common.stream) {
    if (!wait_or_abort(*gen, req)) return;
    for (const auto& s : gen->slots) {
      if (s.out->finish_reason() == "error") {
        return send_error(res,
                          Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""});
      }
      if (auto e = check_tool_choice(job->tool_choice, *s.out)) return send_error(res, *e);
    }
    Json choices = Json::array();
    for (const auto& s : gen->slots) {
      Json msg;
      msg["role"] = job->role;
      const bool has_calls = !s.out->tool_calls().empty();
      const std::string text = job->echo + s.out->text();
      msg["content"] = (text.empty() && has_calls) ? Json(nullptr) : Json(text);
      msg["reasoning"] = (!include_reasoning || s.out->reasoning().empty())
                             ? Json(nullptr)
                             : Json(s.out->reasoning());
      msg["reasoning_content"] = msg["reasoning"];
      Json calls = Json::array();
      for (const auto& c : s.out->tool_calls()) calls.push_back(tool_call_json(c));
      msg["tool_calls"] = calls;
      Json c;
      c["index"] = s.index;
      c["message"] = msg;
      c["logprobs"] = logprobs ? chat_logprobs_json(s.out->logprobs()) : Json(nullptr);
      c["finish_reason"] = s.out->finish_reason();
      c["stop_reason"] = stop_reason_json(*s.out);
      if (token_ids) c["token_ids"] = s.out->output_token_ids();
      choices.push_back(std::move(c));
    }
    Json body = {{"id", id}, {"object", "chat.completion"}, {"created", created}, {"model", model}};
    body["choices"] = choices;
    body["usage"] = usage_json(job->usage());
    if (want_prompt_lps)
      body["prompt_logprobs"] = prompt_logprobs_json(*gen->slots[0].out, gen->prompts[0].ids);
    if (token_ids) body["prompt_token_ids"] = gen->prompts[0].ids;
    if (const auto& kv = gen->slots[0].out->kv_transfer_params())
      body["kv_transfer_params"] = kv_transfer_params_json(*kv);
    return send_json(res, body);
  }

  const bool include_usage = r.common.include_usage;
  const bool continuous = r.common.continuous_usage_stats;
  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = [job, gen, guard,
                env = SseEnvelope{id, "chat.completion.chunk", model, created, include_usage,
                                  continuous},
                logprobs, include_reasoning, token_ids](ResponseSink& sink) {
    auto write = [&](const std::string& s) { return sink.write(s); };
    auto chunk = [&](const ChoiceSlot& s, const Json& delta, const Json& lps, const Json& finish,
                     const Json& stop_reason, const Json& ids, const Json& extra = nullptr) {
      Json c = {{"index", s.index}, {"delta", delta}, {"logprobs", lps}, {"finish_reason", finish}};
      if (!finish.is_null()) c["stop_reason"] = stop_reason;
      if (!ids.is_null()) c["token_ids"] = ids;
      return write(env.chunk(
          std::move(c), [&] { return job->usage(); }, extra));
    };
    // The role comes first, before any token, in every choice (with the echoed text, and the
    // prompt's token ids when return_token_ids).
    for (const auto& s : gen->slots) {
      const Json first = {{"role", job->role}, {"content", job->echo}};
      if (!chunk(s, first, nullptr, nullptr, nullptr, token_ids ? Json::array() : Json(nullptr),
                 token_ids ? Json{{"prompt_token_ids", gen->prompts[0].ids}} : Json(nullptr))) {
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
          if (auto e = check_tool_choice(job->tool_choice, *s.out)) {
            write(sse_error(*e));
            gen->abort_all();
            return false;
          }
          finish = s.out->finish_reason();
        }
        const Json lps =
            logprobs && !d.logprobs.empty() ? chat_logprobs_json(d.logprobs) : Json(nullptr);
        if (!include_reasoning) d.reasoning.clear();
        Json delta = chat_delta_json(d);
        if (delta.empty() && finish.is_null() && lps.is_null() &&
            (!token_ids || d.token_ids.empty()))
          continue;
        if (!chunk(s, delta, lps, finish, stop_reason_json(*s.out),
                   token_ids ? Json(d.token_ids) : Json(nullptr))) {
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
    return env.finish(sink, job->usage());
  };
}

}  // namespace m3::server
