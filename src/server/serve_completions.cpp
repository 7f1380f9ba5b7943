// /v1/completions: text or token-id prompts (several per request), n choices each, echo and
// logprobs, as JSON or as an SSE stream. Part of HttpServerImpl (server_impl.h).
#include <algorithm>
#include <chrono>

#include "server/server_impl.h"

namespace m3::server {

// ------------------------------------------------------------------------------- completions

void HttpServerImpl::handle_completions(const HttpRequest& req, HttpResponse& res) {
  // Shared with the stream provider, which runs after this handler returns.
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_)
    return send_error(
        res, Error{ErrorCode::kUnavailable,
                   "the server is draining (shutting down); retry on another replica", ""});
  auto parsed = parse_completion_request(req.body, cfg_.max_logprobs);
  if (!parsed) return send_error(res, parsed.error());
  CompletionRequest r = std::move(*parsed);
  if (auto st = check_model(r.common.model); !st) return send_error(res, st.error());

  auto gen = std::make_shared<Generation>(engine_, cfg_.stream_interval);
  const int32_t vocab = static_cast<int32_t>(engine_.model_info().vocab_size);
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    PromptData pd;
    const std::string param =
        r.prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
    if (r.prompts[i].is_text) {
      if (auto st = check_text_fits(r.prompts[i].text.size(), param); !st)
        return send_error(res, st.error());
      pd.ids = encode_prompt(r.prompts[i].text);
      pd.text = r.prompts[i].text;
    } else {
      pd.ids = r.prompts[i].token_ids;
      for (int32_t id : pd.ids) {
        if (id >= vocab) {
          return send_error(
              res, Error{ErrorCode::kInvalidArgument,
                         "token id " + std::to_string(id) + " in '" + param +
                             "' is outside the vocabulary [0, " + std::to_string(vocab) + ")",
                         param});
        }
      }
    }
    if (auto st = truncate_prompt(pd.ids, r.common); !st) return send_error(res, st.error());
    // Echo shows the prompt the model saw: the ids as given (or as truncated) decoded.
    if (r.echo && (!r.prompts[i].is_text || r.common.truncate_prompt_tokens))
      pd.text = assets_.tokenizer->decode(pd.ids, r.common.skip_special_tokens);
    gen->prompts.push_back(std::move(pd));
  }
  engine::SamplingParams sp = make_sampling_params(r.common, assets_.defaults);
  if (r.echo && r.common.logprobs >= 0)
    sp.prompt_logprobs = std::max(sp.prompt_logprobs, r.common.logprobs);
  // One max_tokens for all prompts: the longest prompt decides the default.
  size_t longest = 0;
  std::string longest_param = "prompt";
  for (size_t i = 0; i < gen->prompts.size(); ++i) {
    if (gen->prompts[i].ids.size() >= longest) {
      longest = gen->prompts[i].ids.size();
      longest_param = gen->prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
    }
  }
  for (size_t i = 0; i < gen->prompts.size(); ++i) {
    if (gen->prompts[i].ids.empty()) {
      return send_error(
          res, Error{ErrorCode::kInvalidArgument,
                     "the prompt is empty after tokenization; send some text",
                     gen->prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]"});
    }
  }
  if (auto st = fit_context(sp, r.common, longest, longest_param); !st)
    return send_error(res, st.error());
  if (auto st =
          apply_output_controls(sp, r.common, r.common.structured, text::ReasoningPrefix::kNone);
      !st) {
    return send_error(res, st.error());
  }

  ChoiceOptions base;
  base.tokenizer = assets_.tokenizer;
  base.skip_special_tokens = r.common.skip_special_tokens;
  base.stop = r.common.stop;
  base.include_stop_str = r.common.include_stop_str_in_output;
  base.eos_token_ids = engine_.model_info().eos_token_ids;
  base.tokens_as_ids = r.common.return_tokens_as_token_ids;
  const std::string id = "cmpl-" + random_id(32);
  if (auto st = submit_all(*gen, sp, r.common, base, id); !st) return send_error(res, st.error());

  const int64_t created = unix_now();
  const std::string model = model_name();

  // Echo logprobs for the prompt part (first token has none).
  auto prompt_lps = [](const ChoiceOutput& c, const PromptData& pd, CompletionLogprobs& lp) {
    const auto& pl = c.prompt_logprobs();
    for (size_t k = 0; k < pd.ids.size(); ++k) {
      std::optional<float> v;
      std::vector<std::pair<std::string, float>> top;
      if (pl && k < pl->size() && (*pl)[k]) {
        v = (*pl)[k]->logprob;
        for (const auto& [tid, l] : (*pl)[k]->top) top.emplace_back(c.logprob_token(tid), l);
      }
      lp.add(c.logprob_token(pd.ids[k]), v, top);
    }
  };
  auto usage_of = [](const Generation& g) {
    UsageCounts u;
    for (const auto& pd : g.prompts) u.prompt_tokens += static_cast<int64_t>(pd.ids.size());
    std::vector<int64_t> cached(g.prompts.size(), 0);
    for (const auto& s : g.slots) {
      u.completion_tokens += s.out->num_output_tokens();
      cached[s.prompt_index] =
          std::max<int64_t>(cached[s.prompt_index], s.out->num_cached_tokens());
    }
    for (int64_t c : cached) u.cached_tokens += c;
    return u;
  };

  if (!r.common.stream) {
    if (!wait_or_abort(*gen, req)) return;
    Json choices = Json::array();
    for (const auto& s : gen->slots) {
      if (s.out->finish_reason() == "error") {
        return send_error(res,
                          Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""});
      }
    }
    for (const auto& s : gen->slots) {
      const PromptData& pd = gen->prompts[s.prompt_index];
      Json c;
      c["index"] = s.index;
      c["text"] = (r.echo ? pd.text : std::string()) + s.out->text();
      if (r.common.logprobs >= 0) {
        CompletionLogprobs lp;
        if (r.echo) prompt_lps(*s.out, pd, lp);
        for (const auto& t : s.out->logprobs()) lp.add(t.text, t.logprob, t.top);
        c["logprobs"] = lp.to_json();
      } else {
        c["logprobs"] = nullptr;
      }
      c["finish_reason"] = s.out->finish_reason();
      c["stop_reason"] = stop_reason_json(*s.out);
      if (r.common.prompt_logprobs >= 0)
        c["prompt_logprobs"] = prompt_logprobs_json(*s.out, pd.ids);
      if (r.common.return_token_ids) {
        c["prompt_token_ids"] = pd.ids;
        c["token_ids"] = s.out->output_token_ids();
      }
      choices.push_back(std::move(c));
    }
    Json body = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model}};
    body["choices"] = choices;
    body["usage"] = usage_json(usage_of(*gen));
    if (const auto& kv = gen->slots[0].out->kv_transfer_params())
      body["kv_transfer_params"] = kv_transfer_params_json(*kv);
    return send_json(res, body);
  }

  // Streaming.
  const bool include_usage = r.common.include_usage;
  const bool continuous = r.common.continuous_usage_stats;
  const bool echo = r.echo;
  const int logprobs = r.common.logprobs;
  const bool token_ids = r.common.return_token_ids;
  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = [gen, guard,
                env = SseEnvelope{id, "text_completion", model, created, include_usage, continuous},
                echo, logprobs, token_ids, prompt_lps, usage_of](ResponseSink& sink) {
    auto write = [&](const std::string& s) { return sink.write(s); };
    // vLLM's streamed choice: stop_reason with the finish, and with return_token_ids the
    // prompt's ids on a choice's first chunk and each chunk's new token ids.
    std::vector<bool> sent_prompt_ids(gen->slots.size(), !token_ids);
    std::vector<size_t> sent_ids(gen->slots.size(), 0);
    auto chunk = [&](const ChoiceSlot& s, const std::string& text, const Json& lps,
                     const Json& finish) {
      Json c = {{"index", s.index}, {"text", text}, {"logprobs", lps}, {"finish_reason", finish}};
      if (!finish.is_null()) c["stop_reason"] = stop_reason_json(*s.out);
      const size_t i = static_cast<size_t>(&s - gen->slots.data());
      if (token_ids) {
        if (!sent_prompt_ids[i]) {
          c["prompt_token_ids"] = gen->prompts[s.prompt_index].ids;
          sent_prompt_ids[i] = true;
        }
        const auto& all = s.out->output_token_ids();
        c["token_ids"] =
            std::vector<int32_t>(all.begin() + static_cast<int64_t>(sent_ids[i]), all.end());
        sent_ids[i] = all.size();
      }
      return write(env.chunk(std::move(c), [&] { return usage_of(*gen); }));
    };
    std::vector<int64_t> offsets(gen->slots.size(), 0);
    if (echo) {
      for (size_t i = 0; i < gen->slots.size(); ++i) {
        const auto& s = gen->slots[i];
        const PromptData& pd = gen->prompts[s.prompt_index];
        Json lps = nullptr;
        if (logprobs >= 0) {
          // Prompt logprobs arrive with the first output; wait for it.
          while (!s.out->prompt_logprobs() && !s.out->finished()) {
            auto got = gen->poll(std::chrono::milliseconds(50));
            (void)got;
            if (sink.client_gone()) {
              gen->abort_all();
              return false;
            }
          }
          CompletionLogprobs lp;
          prompt_lps(*s.out, pd, lp);
          offsets[i] = lp.next_offset;
          lps = lp.to_json();
        }
        if (!chunk(s, pd.text, lps, nullptr)) {
          gen->abort_all();
          return false;
        }
      }
    }
    // Outputs already consumed while waiting for prompt logprobs are sent from the
    // accumulated state: track what was sent per slot.
    std::vector<size_t> sent_text(gen->slots.size(), 0), sent_lps(gen->slots.size(), 0);
    std::vector<bool> sent_finish(gen->slots.size(), false);
    auto flush_slot = [&](size_t i) {
      const auto& s = gen->slots[i];
      const std::string& text = s.out->text();
      const auto& all_lps = s.out->logprobs();
      const bool fin = s.out->finished() && !sent_finish[i];
      if (s.pending_tokens > 0 && !s.out->finished()) return true;  // held (--stream-interval)
      if (text.size() == sent_text[i] && all_lps.size() == sent_lps[i] && !fin &&
          (!token_ids || s.out->output_token_ids().size() == sent_ids[i]))
        return true;
      if (s.out->finished() && s.out->finish_reason() == "error") {
        write(sse_error(Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""}));
        return false;
      }
      Json lps = nullptr;
      if (logprobs >= 0) {
        CompletionLogprobs lp;
        lp.next_offset = offsets[i];
        for (size_t k = sent_lps[i]; k < all_lps.size(); ++k)
          lp.add(all_lps[k].text, all_lps[k].logprob, all_lps[k].top);
        offsets[i] = lp.next_offset;
        lps = lp.to_json();
      }
      std::string piece = text.substr(sent_text[i]);
      sent_text[i] = text.size();
      sent_lps[i] = all_lps.size();
      Json finish = nullptr;
      if (fin) {
        finish = s.out->finish_reason();
        sent_finish[i] = true;
      }
      return chunk(s, piece, lps, finish);
    };
    for (;;) {
      for (size_t i = 0; i < gen->slots.size(); ++i) {
        if (!flush_slot(i)) {
          gen->abort_all();
          return false;
        }
      }
      if (gen->all_finished()) break;
      gen->poll(std::chrono::milliseconds(100));
      if (sink.client_gone()) {
        gen->abort_all();
        return false;
      }
    }
    return env.finish(sink, usage_of(*gen));
  };
}

}  // namespace m3::server
