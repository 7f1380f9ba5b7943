#include "server/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/log.h"
#include "server/api_error.h"
#include "server/choice_output.h"
#include "server/metrics.h"
#include "server/response_json.h"

namespace m3::server {

namespace {

using Clock = std::chrono::steady_clock;

std::string random_id(size_t len) {
  static constexpr char kAlphabet[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  thread_local std::mt19937_64 rng{std::random_device{}() ^
                                   static_cast<uint64_t>(Clock::now().time_since_epoch().count())};
  std::string s(len, '0');
  for (auto& c : s) c = kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return s;
}

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

void send_error(httplib::Response& res, const Error& e) {
  res.status = http_status(e);
  res.set_content(error_json(e), "application/json");
}

void send_json(httplib::Response& res, const Json& j, int status = 200) {
  res.status = status;
  res.set_content(dump_json(j), "application/json");
}

// One engine request per choice (prompt x n).
struct ChoiceSlot {
  int index = 0;         // OpenAI choice index
  int prompt_index = 0;  // which prompt
  std::shared_ptr<engine::RequestStream> stream;
  std::unique_ptr<ChoiceOutput> out;
  bool aborted = false;  // engine.abort() sent
};

// What every streamed chunk of one request shares (id, object, created, model, the usage mode)
// and the stream's tail, for /v1/completions and /v1/chat/completions alike.
struct SseEnvelope {
  std::string id, object, model;
  int64_t created = 0;
  bool include_usage = false, continuous = false;

  // One chunk around `choice`: running usage when continuous_usage_stats, null usage when only
  // include_usage (vLLM's shape), no usage key otherwise.
  template <class UsageFn>
  std::string chunk(Json choice, UsageFn usage) const {
    Json j = {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
    j["choices"] = Json::array({std::move(choice)});
    if (continuous) j["usage"] = usage_json(usage());
    else if (include_usage) j["usage"] = nullptr;
    return sse_event(j);
  }
  // The usage-only chunk when include_usage, then [DONE] and the end of the response. False
  // when the client is gone before the usage chunk.
  bool finish(httplib::DataSink& sink, const UsageCounts& usage) const {
    auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
    if (include_usage) {
      Json j = {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
      j["choices"] = Json::array();
      j["usage"] = usage_json(usage);
      if (!write(sse_event(j))) return false;
    }
    write(sse_done());
    sink.done();
    return true;
  }
};

struct PromptData {
  std::vector<int32_t> ids;
  std::string text;  // for echo
};

// The engine requests of one HTTP request. Aborts whatever is still running when destroyed, so
// no path (disconnect, error, exception) can leak pages.
class Generation {
 public:
  explicit Generation(engine::Engine& engine) : engine_(engine) {}
  ~Generation() { abort_all(); }

  std::vector<ChoiceSlot> slots;
  std::vector<PromptData> prompts;

  void abort_all() {
    for (auto& s : slots) {
      if (s.stream && !s.aborted && !(s.out && s.out->finished())) {
        engine_.abort(s.stream->id());
        s.aborted = true;
      }
    }
  }

  bool all_finished() const {
    for (const auto& s : slots) {
      if (!s.out->finished()) return false;
    }
    return true;
  }

  // Waits up to `wait` for output; applies it; returns (slot, delta) pairs with something new
  // or a newly finished choice.
  std::vector<std::pair<size_t, ChoiceDelta>> poll(std::chrono::milliseconds wait) {
    std::vector<std::pair<size_t, ChoiceDelta>> got;
    auto take = [&](size_t i, std::chrono::milliseconds t) {
      ChoiceSlot& s = slots[i];
      auto o = s.stream->next(t);
      if (!o) return false;
      const bool was_finished = s.out->finished();
      ChoiceDelta d = s.out->add(*o);
      if (s.out->stop_string_hit() && !s.aborted) {
        engine_.abort(s.stream->id());  // the engine keeps generating otherwise
        s.aborted = true;
      }
      if (!d.empty() || (s.out->finished() && !was_finished)) got.emplace_back(i, std::move(d));
      return true;
    };
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].out->finished()) continue;
      while (take(i, std::chrono::milliseconds(0)) && !slots[i].out->finished()) {
      }
    }
    if (!got.empty()) return got;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].out->finished()) continue;
      // With several choices, wait briefly on each in turn.
      take(i, slots.size() == 1 ? wait : std::chrono::milliseconds(2));
      if (!got.empty()) break;
    }
    return got;
  }

 private:
  engine::Engine& engine_;
};

}  // namespace

class HttpServerImpl {
 public:
  HttpServerImpl(engine::Engine& engine, ServerAssets assets, ServerConfig config)
      : engine_(engine), assets_(std::move(assets)), cfg_(std::move(config)) {
    if (cfg_.served_model_names.empty()) cfg_.served_model_names.push_back("m3");
    setup();
  }

  engine::Engine& engine_;
  ServerAssets assets_;
  ServerConfig cfg_;
  httplib::Server svr_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  int port_ = 0;

  const std::string& model_name() const { return cfg_.served_model_names[0]; }

  struct InFlight {
    explicit InFlight(std::atomic<int64_t>& c) : c_(c) { ++c_; }
    ~InFlight() { --c_; }
    std::atomic<int64_t>& c_;
  };

  void setup();
  Status check_model(const std::string& model) const;
  void handle_completions(const httplib::Request& req, httplib::Response& res);
  void handle_chat(const httplib::Request& req, httplib::Response& res);
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);

  std::vector<int32_t> encode_prompt(const std::string& text) const {
    auto r = assets_.tokenizer->encode(text, true);
    if (r) return *r;
    return assets_.tokenizer->encode(text);
  }

  // Fills max_tokens and checks the context length; `param` names the prompt field.
  Status fit_context(engine::SamplingParams& sp, const CommonParams& p, size_t prompt_len,
                     const std::string& param) const;
  // Submits slots for every prompt x n; on error nothing stays submitted.
  Status submit_all(Generation& gen, const engine::SamplingParams& sp, const CommonParams& p,
                    const ChoiceOptions& base) const;
};

Status HttpServerImpl::check_model(const std::string& model) const {
  if (model.empty()) return {};
  for (const auto& n : cfg_.served_model_names) {
    if (n == model) return {};
  }
  return make_error(ErrorCode::kModelNotFound,
                    "The model `" + model + "` does not exist. This server serves `" + model_name() +
                        "` (see GET /v1/models).",
                    "model");
}

Status HttpServerImpl::fit_context(engine::SamplingParams& sp, const CommonParams& p, size_t prompt_len,
                                   const std::string& param) const {
  const int64_t max_len = engine_.model_info().max_model_len;
  const int64_t n = static_cast<int64_t>(prompt_len);
  if (n == 0) {
    return make_error(ErrorCode::kInvalidArgument, "the prompt is empty after tokenization; send some text", param);
  }
  if (n >= max_len) {
    return make_error(ErrorCode::kContextLength,
                      "This model's maximum context length is " + std::to_string(max_len) +
                          " tokens. However, your prompt has " + std::to_string(n) +
                          " tokens, which leaves no room for the completion. Please shorten the prompt.",
                      param);
  }
  if (p.max_tokens) {
    if (n + *p.max_tokens > max_len) {
      return make_error(ErrorCode::kContextLength,
                        "This model's maximum context length is " + std::to_string(max_len) +
                            " tokens. However, you requested " + std::to_string(n + *p.max_tokens) + " tokens (" +
                            std::to_string(n) + " in the prompt, " + std::to_string(*p.max_tokens) +
                            " for the completion). Please reduce the prompt or max_tokens.",
                        "max_tokens");
    }
    sp.max_tokens = *p.max_tokens;
  } else {
    int64_t room = max_len - n;
    if (assets_.defaults.max_new_tokens && *assets_.defaults.max_new_tokens > 0) {
      room = std::min<int64_t>(room, *assets_.defaults.max_new_tokens);
    }
    sp.max_tokens = static_cast<int32_t>(room);
  }
  if (sp.min_tokens > sp.max_tokens) sp.min_tokens = sp.max_tokens;
  return {};
}

Status HttpServerImpl::submit_all(Generation& gen, const engine::SamplingParams& sp0, const CommonParams& p,
                                  const ChoiceOptions& base) const {
  int index = 0;
  for (size_t pi = 0; pi < gen.prompts.size(); ++pi) {
    for (int i = 0; i < p.n; ++i) {
      engine::GenerateRequest gr;
      gr.prompt_token_ids = gen.prompts[pi].ids;
      gr.params = sp0;
      // Distinct but reproducible streams for the n choices of a seeded request.
      if (sp0.seed && i > 0) gr.params.seed = *sp0.seed + static_cast<uint64_t>(i);
      gr.priority = p.priority;
      auto st = engine_.submit(std::move(gr));
      if (!st) {
        gen.abort_all();
        gen.slots.clear();
        return tl::unexpected(st.error());
      }
      ChoiceSlot slot;
      slot.index = index++;
      slot.prompt_index = static_cast<int>(pi);
      slot.stream = *st;
      slot.out = std::make_unique<ChoiceOutput>(base);
      gen.slots.push_back(std::move(slot));
    }
  }
  return {};
}

// ------------------------------------------------------------------------------- completions

void HttpServerImpl::handle_completions(const httplib::Request& req, httplib::Response& res) {
  // Shared with the stream provider, which runs after this handler returns.
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_) return send_error(res, Error{ErrorCode::kUnavailable, "the server is draining (shutting down); retry on another replica", ""});
  auto parsed = parse_completion_request(req.body);
  if (!parsed) return send_error(res, parsed.error());
  CompletionRequest r = std::move(*parsed);
  if (auto st = check_model(r.common.model); !st) return send_error(res, st.error());

  auto gen = std::make_shared<Generation>(engine_);
  const int32_t vocab = static_cast<int32_t>(engine_.model_info().vocab_size);
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    PromptData pd;
    const std::string param = r.prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
    if (r.prompts[i].is_text) {
      pd.ids = encode_prompt(r.prompts[i].text);
      pd.text = r.prompts[i].text;
    } else {
      pd.ids = r.prompts[i].token_ids;
      for (int32_t id : pd.ids) {
        if (id >= vocab) {
          return send_error(res, Error{ErrorCode::kInvalidArgument,
                                       "token id " + std::to_string(id) + " in '" + param +
                                           "' is outside the vocabulary [0, " + std::to_string(vocab) + ")",
                                       param});
        }
      }
      if (r.echo) pd.text = assets_.tokenizer->decode(pd.ids, r.common.skip_special_tokens);
    }
    gen->prompts.push_back(std::move(pd));
  }
  engine::SamplingParams sp = make_sampling_params(r.common, assets_.defaults);
  if (r.echo && r.common.logprobs >= 0) sp.prompt_logprobs = r.common.logprobs;
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
      return send_error(res, Error{ErrorCode::kInvalidArgument, "the prompt is empty after tokenization; send some text",
                                   gen->prompts.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]"});
    }
  }
  if (auto st = fit_context(sp, r.common, longest, longest_param); !st) return send_error(res, st.error());

  ChoiceOptions base;
  base.tokenizer = assets_.tokenizer;
  base.skip_special_tokens = r.common.skip_special_tokens;
  base.stop = r.common.stop;
  base.include_stop_str = r.common.include_stop_str_in_output;
  base.eos_token_ids = engine_.model_info().eos_token_ids;
  if (auto st = submit_all(*gen, sp, r.common, base); !st) return send_error(res, st.error());

  const std::string id = "cmpl-" + random_id(32);
  const int64_t created = unix_now();
  const std::string model = model_name();
  const auto tok = assets_.tokenizer;

  // Echo logprobs for the prompt part (first token has none).
  auto prompt_lps = [tok](const ChoiceOutput& c, const PromptData& pd, CompletionLogprobs& lp) {
    const auto& pl = c.prompt_logprobs();
    for (size_t k = 0; k < pd.ids.size(); ++k) {
      std::optional<float> v;
      std::vector<std::pair<std::string, float>> top;
      if (pl && k < pl->size() && (*pl)[k]) {
        v = (*pl)[k]->logprob;
        for (const auto& [tid, l] : (*pl)[k]->top) top.emplace_back(ChoiceOutput::token_text(*tok, tid), l);
      }
      lp.add(ChoiceOutput::token_text(*tok, pd.ids[k]), v, top);
    }
  };
  auto usage_of = [](const Generation& g) {
    UsageCounts u;
    for (const auto& pd : g.prompts) u.prompt_tokens += static_cast<int64_t>(pd.ids.size());
    std::vector<int64_t> cached(g.prompts.size(), 0);
    for (const auto& s : g.slots) {
      u.completion_tokens += s.out->num_output_tokens();
      cached[s.prompt_index] = std::max<int64_t>(cached[s.prompt_index], s.out->num_cached_tokens());
    }
    for (int64_t c : cached) u.cached_tokens += c;
    return u;
  };

  if (!r.common.stream) {
    while (!gen->all_finished()) gen->poll(std::chrono::milliseconds(200));
    Json choices = Json::array();
    for (const auto& s : gen->slots) {
      if (s.out->finish_reason() == "error") {
        return send_error(res, Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""});
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
      c["stop_reason"] = nullptr;
      choices.push_back(std::move(c));
    }
    Json body = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model}};
    body["choices"] = choices;
    body["usage"] = usage_json(usage_of(*gen));
    return send_json(res, body);
  }

  // Streaming.
  const bool include_usage = r.common.include_usage;
  const bool continuous = r.common.continuous_usage_stats;
  const bool echo = r.echo;
  const int logprobs = r.common.logprobs;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [gen, guard, env = SseEnvelope{id, "text_completion", model, created, include_usage, continuous},
       echo, logprobs, prompt_lps, usage_of](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
        auto chunk = [&](const ChoiceSlot& s, const std::string& text, const Json& lps, const Json& finish) {
          Json c = {{"index", s.index}, {"text", text}, {"logprobs", lps}, {"finish_reason", finish}};
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
                if (!sink.is_writable()) {
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
          if (text.size() == sent_text[i] && all_lps.size() == sent_lps[i] && !fin) return true;
          if (s.out->finished() && s.out->finish_reason() == "error") {
            write(sse_error(Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""}));
            return false;
          }
          Json lps = nullptr;
          if (logprobs >= 0) {
            CompletionLogprobs lp;
            lp.next_offset = offsets[i];
            for (size_t k = sent_lps[i]; k < all_lps.size(); ++k) lp.add(all_lps[k].text, all_lps[k].logprob, all_lps[k].top);
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
          if (!sink.is_writable()) {
            gen->abort_all();
            return false;
          }
        }
        return env.finish(sink, usage_of(*gen));
      },
      [gen, guard](bool) { gen->abort_all(); });
}

// ------------------------------------------------------------------------------------- chat

namespace {

// Required / named tool_choice are asked for in the prompt (no guided decoding yet); this
// checks that the model complied.
std::optional<Error> check_tool_choice(const ToolChoice& tc, const ChoiceOutput& out) {
  if (tc.kind == ToolChoiceKind::kRequired && out.tool_calls().empty()) {
    return Error{ErrorCode::kInternal,
                 "tool_choice is \"required\" but the model answered without a tool call (this server "
                 "asks for the call in the prompt and validates the answer; it has no guided decoding "
                 "yet); retry, or use tool_choice \"auto\"",
                 "tool_choice"};
  }
  if (tc.kind == ToolChoiceKind::kNamed) {
    if (out.tool_calls().empty()) {
      return Error{ErrorCode::kInternal,
                   "tool_choice names `" + tc.name + "` but the model answered without calling it; retry, or use tool_choice \"auto\"",
                   "tool_choice"};
    }
    for (const auto& c : out.tool_calls()) {
      if (c.name != tc.name) {
        return Error{ErrorCode::kInternal,
                     "tool_choice names `" + tc.name + "` but the model called `" + c.name + "`; retry, or use tool_choice \"auto\"",
                     "tool_choice"};
      }
    }
  }
  return std::nullopt;
}

}  // namespace

void HttpServerImpl::handle_chat(const httplib::Request& req, httplib::Response& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_) return send_error(res, Error{ErrorCode::kUnavailable, "the server is draining (shutting down); retry on another replica", ""});
  auto parsed = parse_chat_request(req.body);
  if (!parsed) return send_error(res, parsed.error());
  ChatRequest r = std::move(*parsed);
  if (auto st = check_model(r.common.model); !st) return send_error(res, st.error());
  const bool wants_tools = r.tools.is_array() && r.tool_choice.kind != ToolChoiceKind::kNone;
  if (wants_tools && !cfg_.parse_tool_calls) {
    return send_error(res, Error{ErrorCode::kInvalidArgument,
                                 "tool calls need the server started with --tool-call-parser minimax_m3", "tools"});
  }
  if (wants_tools && r.tool_choice.kind == ToolChoiceKind::kAuto && !cfg_.enable_auto_tool_choice) {
    return send_error(res, Error{ErrorCode::kInvalidArgument,
                                 "\"auto\" tool choice needs the server started with --enable-auto-tool-choice",
                                 "tool_choice"});
  }
  auto rendered = assets_.chat->render(r);
  if (!rendered) return send_error(res, rendered.error());

  auto gen = std::make_shared<Generation>(engine_);
  PromptData pd;
  pd.ids = assets_.tokenizer->encode(rendered->prompt);
  gen->prompts.push_back(std::move(pd));
  engine::SamplingParams sp = make_sampling_params(r.common, assets_.defaults);
  if (auto st = fit_context(sp, r.common, gen->prompts[0].ids.size(), "messages"); !st) {
    return send_error(res, st.error());
  }

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
  const ToolChoice tool_choice = wants_tools ? r.tool_choice : ToolChoice{ToolChoiceKind::kAuto, {}};
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
    while (!gen->all_finished()) gen->poll(std::chrono::milliseconds(200));
    for (const auto& s : gen->slots) {
      if (s.out->finish_reason() == "error") {
        return send_error(res, Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""});
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
  res.set_chunked_content_provider(
      "text/event-stream",
      [gen, guard, env = SseEnvelope{id, "chat.completion.chunk", model, created, include_usage, continuous},
       logprobs, tool_choice, usage_of](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
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
                write(sse_error(Error{ErrorCode::kInternal, "generation failed: " + s.out->error(), ""}));
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
            const Json lps = logprobs && !d.logprobs.empty() ? chat_logprobs_json(d.logprobs) : Json(nullptr);
            Json delta = chat_delta_json(d);
            if (delta.empty() && finish.is_null() && lps.is_null()) continue;
            if (!chunk(s, delta, lps, finish)) {
              gen->abort_all();
              return false;
            }
          }
          if (gen->all_finished()) break;
          if (got.empty() && !sink.is_writable()) {
            gen->abort_all();
            return false;
          }
        }
        return env.finish(sink, usage_of(*gen));
      },
      [gen, guard](bool) { gen->abort_all(); });
}

// ---------------------------------------------------------------------- tokenize / detokenize

void HttpServerImpl::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  OrderedJson j = OrderedJson::parse(req.body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return send_error(res, Error{ErrorCode::kInvalidArgument, "request body must be a JSON object", ""});
  }
  if (j.contains("model") && j["model"].is_string()) {
    if (auto st = check_model(j["model"].get<std::string>()); !st) return send_error(res, st.error());
  }
  std::vector<int32_t> ids;
  if (j.contains("messages")) {
    auto parsed = parse_chat_request(req.body);
    if (!parsed) return send_error(res, parsed.error());
    auto rendered = assets_.chat->render(*parsed);
    if (!rendered) return send_error(res, rendered.error());
    ids = assets_.tokenizer->encode(rendered->prompt);
  } else if (j.contains("prompt") && j["prompt"].is_string()) {
    bool add_special = true;
    if (j.contains("add_special_tokens")) {
      if (!j["add_special_tokens"].is_boolean()) {
        return send_error(res, Error{ErrorCode::kInvalidArgument, "'add_special_tokens' must be a boolean", "add_special_tokens"});
      }
      add_special = j["add_special_tokens"].get<bool>();
    }
    const std::string text = j["prompt"].get<std::string>();
    ids = add_special ? encode_prompt(text) : assets_.tokenizer->encode(text);
  } else {
    return send_error(res, Error{ErrorCode::kInvalidArgument,
                                 "give 'prompt' (a string) or 'messages' (a chat) to tokenize", "prompt"});
  }
  Json out;
  out["count"] = ids.size();
  out["max_model_len"] = engine_.model_info().max_model_len;
  out["tokens"] = ids;
  if (j.value("return_token_strs", false)) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(assets_.tokenizer->id_to_token(id));
    out["token_strs"] = strs;
  } else {
    out["token_strs"] = nullptr;
  }
  send_json(res, out);
}

void HttpServerImpl::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  OrderedJson j = OrderedJson::parse(req.body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return send_error(res, Error{ErrorCode::kInvalidArgument, "request body must be a JSON object", ""});
  }
  if (j.contains("model") && j["model"].is_string()) {
    if (auto st = check_model(j["model"].get<std::string>()); !st) return send_error(res, st.error());
  }
  if (!j.contains("tokens") || !j["tokens"].is_array()) {
    return send_error(res, Error{ErrorCode::kInvalidArgument, "'tokens' must be an array of token ids", "tokens"});
  }
  std::vector<int32_t> ids;
  const int64_t vocab = std::max<int64_t>(assets_.tokenizer->vocab_size(), engine_.model_info().vocab_size);
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return send_error(res, Error{ErrorCode::kInvalidArgument,
                                   "'tokens' must hold token ids in [0, " + std::to_string(vocab) + ")", "tokens"});
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  send_json(res, Json{{"prompt", assets_.tokenizer->decode(ids, false)}});
}

// --------------------------------------------------------------------------------- routing

void HttpServerImpl::setup() {
  int threads = cfg_.num_http_threads;
  if (threads <= 0) threads = std::clamp(cfg_.max_num_seqs * 4, 256, 1024);
  svr_.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  svr_.set_keep_alive_max_count(100000);
  svr_.set_keep_alive_timeout(5);  // idle keep-alive connections also delay a drain by this much
  svr_.set_read_timeout(60);
  svr_.set_write_timeout(60);
  svr_.set_payload_max_length(size_t{256} << 20);

  svr_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (cfg_.api_key.empty() || req.path.rfind("/v1", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    std::string auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    std::string key = auth.rfind(prefix, 0) == 0 ? auth.substr(prefix.size()) : std::string();
    if (key.empty()) key = req.get_header_value("x-api-key");
    if (key != cfg_.api_key) {
      send_error(res, Error{ErrorCode::kUnauthorized,
                            key.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                                        : "invalid API key",
                            ""});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      send_error(res, Error{ErrorCode::kNotFound, "no route for " + req.method + " " + req.path, ""});
    } else if (res.status == 413) {
      res.status = 413;
      Error e{ErrorCode::kInvalidArgument, "request body too large", ""};
      res.set_content(error_json(e), "application/json");
    } else {
      const int status = res.status;
      Error e{ErrorCode::kInvalidArgument, "HTTP error " + std::to_string(status), ""};
      res.set_content(error_json(e), "application/json");
      res.status = status;
    }
  });
  svr_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    M3_LOG_ERROR("server: handler exception: %s", what.c_str());
    send_error(res, Error{ErrorCode::kInternal, "internal error: " + what, ""});
  });

  svr_.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& s) { handle_completions(q, s); });
  svr_.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& s) { handle_chat(q, s); });
  svr_.Post("/tokenize", [this](const httplib::Request& q, httplib::Response& s) { handle_tokenize(q, s); });
  svr_.Post("/detokenize", [this](const httplib::Request& q, httplib::Response& s) { handle_detokenize(q, s); });
  svr_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const auto& info = engine_.model_info();
    Json data = Json::array();
    for (const auto& name : cfg_.served_model_names) {
      data.push_back({{"id", name},
                      {"object", "model"},
                      {"created", unix_now()},
                      {"owned_by", "m3serve"},
                      {"root", info.model_dir},
                      {"parent", nullptr},
                      {"max_model_len", info.max_model_len}});
    }
    send_json(res, Json{{"object", "list"}, {"data", data}});
  });
  auto health = [this](const httplib::Request&, httplib::Response& res) {
    if (draining_ || !engine_.healthy()) {
      res.status = 503;
      res.set_content(draining_ ? "draining" : "unhealthy", "text/plain");
      return;
    }
    res.status = 200;
  };
  svr_.Get("/health", health);
  svr_.Get("/ping", health);
  svr_.Get("/version", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, Json{{"version", cfg_.version}});
  });
  svr_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    ServerGauges g;
    g.http_requests_in_flight = in_flight_.load();
    g.draining = draining_.load();
    res.set_content(format_metrics(engine_.stats(), model_name(), g), "text/plain; version=0.0.4; charset=utf-8");
  });
}

// ---------------------------------------------------------------------------------- public

HttpServer::HttpServer(engine::Engine& engine, ServerAssets assets, ServerConfig config)
    : impl_(std::make_unique<HttpServerImpl>(engine, std::move(assets), std::move(config))) {}

HttpServer::~HttpServer() = default;

namespace {
// cpp-httplib 0.11 (Debian's build) listens with a backlog of 5, so a burst of clients (64
// streams connecting at once) overflows the accept queue and some see resets. The library keeps
// its socket private: find our listening socket by its port and listen again with the system's
// maximum (Linux updates the backlog of a listening socket in place).
void widen_listen_backlog(int port) {
  for (int fd = 3; fd < 4096; ++fd) {
    int accepting = 0;
    socklen_t len = sizeof accepting;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting) continue;
    sockaddr_storage ss{};
    socklen_t sl = sizeof ss;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) continue;
    int p = -1;
    if (ss.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    if (ss.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    if (p == port) ::listen(fd, SOMAXCONN);
  }
}
}  // namespace

Status HttpServer::bind() {
  auto& c = impl_->cfg_;
  if (c.port < 0 || c.port > 65535) {
    return make_error(ErrorCode::kInvalidArgument, "--port " + std::to_string(c.port) + " is not a TCP port (0..65535)", "--port");
  }
  if (c.port == 0) {
    const int p = impl_->svr_.bind_to_any_port(c.host);
    if (p <= 0) return make_error(ErrorCode::kInvalidArgument, "cannot bind to " + c.host + "; check --host", "--host");
    impl_->port_ = p;
    widen_listen_backlog(p);
    return {};
  }
  if (!impl_->svr_.bind_to_port(c.host, c.port)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot listen on " + c.host + ":" + std::to_string(c.port) +
                          " (in use or not an address of this machine); choose another --port or --host",
                      "--port");
  }
  impl_->port_ = c.port;
  widen_listen_backlog(c.port);
  return {};
}

int HttpServer::bound_port() const { return impl_->port_; }

Status HttpServer::run() {
  if (!impl_->svr_.listen_after_bind()) {
    return make_error(ErrorCode::kIo, "the HTTP server stopped with an error");
  }
  return {};
}

void HttpServer::drain_and_stop() {
  impl_->draining_ = true;
  // Generation handlers that are running finish (their streams complete); new ones get 503.
  while (impl_->in_flight_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  impl_->svr_.stop();
}

bool HttpServer::draining() const { return impl_->draining_; }

// ------------------------------------------------------------------------------------ assets

Result<ServerAssets> load_server_assets(const std::string& model_dir, const std::string& chat_template_path,
                                        const OrderedJson& default_kwargs, const std::string& generation_config) {
  ServerAssets a;
  const std::string tok_path = model_dir + "/tokenizer.json";
  auto tok = text::Tokenizer::from_file(tok_path);
  if (!tok) {
    return make_error(tok.error().code, "cannot load the tokenizer " + tok_path + ": " + tok.error().message);
  }
  a.tokenizer = *tok;
  M3_TRY(auto chat, ChatPrompt::load(model_dir, chat_template_path, default_kwargs));
  a.chat = std::make_shared<const ChatPrompt>(std::move(chat));
  if (generation_config == "vllm") {
    a.defaults = GenerationDefaults{};
  } else {
    const std::string dir = (generation_config.empty() || generation_config == "auto") ? model_dir : generation_config;
    M3_TRY(a.defaults, GenerationDefaults::from_dir(dir));
  }
  return a;
}

}  // namespace m3::server
