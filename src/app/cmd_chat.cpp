// `m3serve chat [MODEL_DIR]`: an interactive terminal chat with a model (the embedded demo model
// when none is given). Reasoning is shown dimmed, tool calls as `name(arguments)`. Commands:
// /think enabled|disabled|adaptive, /reset, /quit. Reads stdin line by line, so it also works
// piped (`echo "hi" | m3serve chat`). Takes the vLLM flags that make sense without a server
// (app/vllm_flags.h): --seed seeds every answer, --dtype, --hf-overrides, ...
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "app/commands.h"
#include "app/device_backend.h"
#include "app/model_choice.h"
#include "app/vllm_flags.h"
#include "engine/engine.h"
#include "model/config_overrides.h"
#include "model/quantization.h"
#include "text/chat_output_parser.h"
#include "text/chat_template.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace m3::app {

namespace {

struct ChatArgs {
  std::string model_dir;
  std::string tokenizer;
  std::string thinking_mode = "adaptive";
  int max_tokens = 512;
  float temperature = 0.f;
  std::string system;
  DeviceArgs device;
  VllmFlagValues vllm;
  bool gemm_precision_given = false;
};

int run_chat(const ChatArgs& args) {
  ChatArgs a = args;
  const EnvList env = process_environment();
  auto plan =
      review_vllm_flags(a.vllm, VllmCommand::kChat, a.device.device, a.gemm_precision_given, env);
  if (!plan) return fail(plan.error().message);
  for (const auto& n : plan->notices) std::fprintf(stderr, "m3serve: note: %s\n", n.c_str());
  if (plan->gemm_precision) a.device.gemm_precision = *plan->gemm_precision;
  if (plan->kv_cache_dtype) a.device.kv_cache_dtype = *plan->kv_cache_dtype;
  if (plan->index_kv_dtype) a.device.index_kv_dtype = *plan->index_kv_dtype;
  if (plan->enforce_eager) a.device.enforce_eager = true;
  a.device.cudagraph_capture_sizes = plan->cudagraph_capture_sizes;
  const std::string quantization = plan->quantization;
  if (auto st = model::set_config_overrides(plan->hf_overrides); !st)
    return fail(st.error().message);
  if (!a.model_dir.empty()) {
    std::string notice;
    auto resolved = resolve_model_argument(a.model_dir, env, &notice);
    if (!resolved) return fail(resolved.error().message);
    if (*resolved != a.model_dir) std::fprintf(stderr, "m3serve: note: %s\n", notice.c_str());
    a.model_dir = *resolved;
  }
  if (a.model_dir.empty()) a.model_dir = find_demo_model();
  if (a.model_dir.empty())
    return fail("no MODEL_DIR given and no demo model found; run `m3serve chat /path/to/model`");
  auto mode = text::thinking_mode_from_string(a.thinking_mode);
  if (!mode) return fail(mode.error().message);
  auto choice = resolve_model(a.model_dir, a.tokenizer, a.device.device, find_demo_model());
  if (!choice) return fail(choice.error().message);
  if (!model::is_synthetic_model(a.model_dir)) {
    // --quantization against the checkpoint's declaration, before anything is loaded.
    auto q = model::resolve_quantization(quantization, model::read_checkpoint_quant(a.model_dir));
    if (!q) return fail(q.error().message);
  }
  auto backend_factory =  // probes the GPU for cuda
      make_backend_factory(a.device, 0, 0, choice->spec.seed);
  if (!backend_factory) return fail(backend_factory.error().message);
  auto kv_format = resolve_kv_format(a.device);
  if (!kv_format) return fail(kv_format.error().message);
  auto tok = text::Tokenizer::from_file(
      (std::filesystem::path(choice->tokenizer_dir) / "tokenizer.json").string());
  if (!tok) return fail(tok.error().message);
  auto tpl = text::ChatTemplate::from_model_dir(choice->tokenizer_dir);
  if (!tpl) return fail(tpl.error().message);
  engine::EngineConfig ec;
  ec.async_scheduling = plan->async_scheduling;
  ec.long_prefill_token_threshold = plan->long_prefill_token_threshold;
  ec.model_dir = a.model_dir;
  ec.max_num_seqs = 1;
  ec.quantization = quantization;
  ec.num_sampleable_tokens = (*tok)->vocab_size();
  ec.backend_factory = std::move(*backend_factory);
  ec.kv_cache_dtype = kv_format->kv;
  ec.index_cache_dtype = kv_format->index;
  if (plan->speculative) ec.speculative = *plan->speculative;
  auto eng = engine::Engine::create(ec);
  if (!eng) return fail(eng.error().message);
  const auto& info = (*eng)->model_info();
  const bool tty = isatty(1) != 0;
  const char* dim = tty ? "\033[2m" : "";
  const char* reset = tty ? "\033[0m" : "";
  std::printf(
      "m3serve chat: %s on %s (%d tokens of context). /think enabled|disabled|adaptive, /reset, "
      "/quit\n",
      a.model_dir.c_str(), info.device.c_str(), info.max_model_len);
  if (!info.speculative.empty())
    std::fprintf(stderr, "m3serve: speculative decoding: %s\n", info.speculative.c_str());

  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
  text::ThinkingMode current = *mode;
  std::string line;
  for (;;) {
    std::printf("%s> ", tty ? "\n" : "");
    std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line == "/quit" || line == "/exit") break;
    if (line == "/reset") {
      messages = nlohmann::ordered_json::array();
      if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
      std::printf("(conversation cleared)\n");
      continue;
    }
    if (line.rfind("/think", 0) == 0) {
      auto m = text::thinking_mode_from_string(line.size() > 7 ? line.substr(7) : "");
      if (!m) {
        std::printf("usage: /think enabled|disabled|adaptive\n");
      } else {
        current = *m;
        std::printf("(thinking mode: %s)\n", text::thinking_mode_name(current));
      }
      continue;
    }
    messages.push_back({{"role", "user"}, {"content", line}});
    text::ChatRequest cr;
    cr.messages = messages;
    cr.chat_template_kwargs = {{"thinking_mode", text::thinking_mode_name(current)}};
    auto prompt = tpl->render(cr);
    if (!prompt) {
      std::printf("error: %s\n", prompt.error().message.c_str());
      messages.erase(messages.end() - 1);
      continue;
    }
    engine::GenerateRequest req;
    req.prompt_token_ids = (*tok)->encode(*prompt);
    req.params.temperature = a.temperature;
    // --seed: each answer reproducible; turns differ (the seed advances per answer).
    if (plan->seed) req.params.seed = *plan->seed + static_cast<uint64_t>(messages.size());
    req.params.max_tokens = std::max(
        1,
        std::min(a.max_tokens, info.max_model_len - static_cast<int>(req.prompt_token_ids.size())));
    auto stream = (*eng)->submit(req);
    if (!stream) {
      std::printf("error: %s\n", stream.error().message.c_str());
      messages.erase(messages.end() - 1);
      continue;
    }
    text::IncrementalDetokenizer detok(*tok, /*skip_special_tokens=*/false);
    text::ChatOutputOptions opts;
    opts.thinking_mode = current;
    text::ChatOutputParser parser(opts);
    text::ChatOutputResult result;
    bool in_reasoning_shown = false;
    auto show = [&](const text::ChatOutputDelta& d) {
      result.append(d);
      if (!d.reasoning.empty()) {
        if (!in_reasoning_shown) std::printf("%s[thinking] ", dim);
        in_reasoning_shown = true;
        std::printf("%s%s%s", dim, d.reasoning.c_str(), reset);
      }
      if (!d.content.empty()) {
        if (in_reasoning_shown) {
          std::printf("%s\n", reset);
          in_reasoning_shown = false;
        }
        std::printf("%s", d.content.c_str());
      }
      std::fflush(stdout);
    };
    for (;;) {
      auto o = (*stream)->next(std::chrono::milliseconds(600000));
      if (!o) break;
      for (int32_t id : o->new_token_ids) {
        if (std::find(info.eos_token_ids.begin(), info.eos_token_ids.end(), id) !=
            info.eos_token_ids.end())
          continue;
        show(parser.feed(detok.step(id)));
      }
      if (o->finished) {
        if (o->finish_reason == "error") std::printf("\nerror: %s", o->error.c_str());
        if (o->finish_reason == "length") std::printf("%s [max tokens reached]%s", dim, reset);
        break;
      }
    }
    show(parser.feed(detok.flush()));
    show(parser.finish());
    std::printf("%s\n", reset);
    nlohmann::ordered_json msg = {{"role", "assistant"}, {"content", result.content}};
    if (!result.reasoning.empty()) msg["reasoning_content"] = result.reasoning;
    messages.push_back(msg);
  }
  (*eng)->shutdown(false);
  return 0;
}

}  // namespace

RunFn register_chat(CLI::App& app) {
  auto a = std::make_shared<ChatArgs>();
  CLI::App* sub =
      app.add_subcommand("chat", "Interactive terminal chat (the demo model when no MODEL_DIR)");
  sub->add_option(
      "model_dir", a->model_dir,
      "Model directory (default: the embedded demo model), or synthetic:layers=N[,seed=S] "
      "with --device cuda");
  sub->add_option("--tokenizer", a->tokenizer,
                  "Directory with tokenizer.json and the chat template (default: the model's; for "
                  "a synthetic model, the demo model's)");
  sub->add_option("--thinking-mode", a->thinking_mode, "enabled | disabled | adaptive");
  sub->add_option("--max-tokens", a->max_tokens, "Tokens per answer");
  sub->add_option("--temperature", a->temperature, "0 = greedy");
  sub->add_option("--system", a->system, "System prompt");
  add_device_options(sub, a->device);
  add_vllm_flags(sub, a->vllm, VllmCommand::kChat);
  return [a, sub] {
    a->gemm_precision_given = sub->get_option("--gemm-precision")->count() > 0;
    return run_chat(*a);
  };
}

}  // namespace m3::app
