// `m3serve generate`: run the model on token ids and print the continuation, for debugging and
// for checks from outside. Stable interface (issue #2):
//   m3serve generate --model DIR --prompt-ids 5,17,42 --max-tokens 8 --temperature 0
//                    --logprobs 5 --echo --json [--device cpu|cuda]
//                    [--tensor-parallel-size N | --data-parallel-size N] [--enable-expert-parallel]
//                    (CPU: N rank threads)
// prints {"prompt_ids", "output_ids", "prompt_logprobs", "output_logprobs"}; prompt_logprobs[i]
// scores prompt token i given the tokens before it (entry 0 is null). The backend (CPU, GPU,
// sharded) comes from the same switch `serve` uses (app/device_backend.h) and one
// runtime::SequenceRunner drives it, so every device prints the same JSON.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "app/device_backend.h"
#include "app/parallel_args.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "model/quantization.h"
#include "model/synthetic_model.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::app {

namespace {

struct GenerateArgs {
  std::string model_dir;
  std::string quantization;
  std::string prompt_ids;
  int max_tokens = 16;
  float temperature = 0.f;
  float top_p = 1.f;
  int top_k = 0;
  float min_p = 0.f;
  int64_t seed = -1;
  int logprobs = -1;
  bool echo = false;
  bool json = false;
  bool ignore_eos = false;
  int prefill_chunk = 0;
  std::string device = "cpu";
  ParallelArgs parallel;
  std::string gemm_precision = "bf16";
  std::string kv_cache_dtype = "auto";
  std::string index_kv_dtype = "auto";
};

Result<std::vector<int32_t>> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    tok.erase(0, tok.find_first_not_of(" \t"));
    tok.erase(tok.find_last_not_of(" \t") + 1);
    if (tok.empty()) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "--prompt-ids has an empty entry; give comma-separated integers like 5,17,42",
          "--prompt-ids");
    }
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || v < INT32_MIN || v > INT32_MAX) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--prompt-ids entry '" + tok + "' is not an integer token id",
                        "--prompt-ids");
    }
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return ids;
}

nlohmann::json logprob_json(const engine::TokenLogprob& lp) {
  nlohmann::json top = nlohmann::json::array();
  for (const auto& [id, l] : lp.top) top.push_back({id, static_cast<double>(l)});
  return {{"token", lp.token}, {"logprob", static_cast<double>(lp.logprob)}, {"top", top}};
}

int run_generate(const GenerateArgs& a) {
  auto ids = parse_ids(a.prompt_ids);
  if (!ids) return fail(ids.error().message);
  if (a.max_tokens < 0) return fail("--max-tokens must be >= 0");
  if (a.logprobs > 20) return fail("--logprobs must be at most 20");
  if (auto st = validate_parallel(a.parallel, a.device); !st) return fail(st.error().message);

  // The host model (config-only for a synthetic spec), then the backend the runtime picks for
  // --device and the parallelism flags, exactly as `serve` builds it (app/device_backend.h), and
  // one SequenceRunner over it (runtime/sequence_runner.h).
  if (model::is_synthetic_model(a.model_dir) && a.device != "cuda")
    return fail(model::synthetic_needs_cuda_message(a.model_dir));
  DeviceArgs dev;
  dev.device = a.device;
  dev.parallel = a.parallel;
  dev.gemm_precision = a.gemm_precision;
  dev.kv_cache_dtype = a.kv_cache_dtype;
  dev.index_kv_dtype = a.index_kv_dtype;
  dev.dp_kv_partitions = false;  // the runner hands out one page-id space
  auto kv_format = resolve_kv_format(dev);
  if (!kv_format) return fail(kv_format.error().message);
  model::LoadOptions lo;
  lo.quantization = a.quantization;
  auto host = model::M3Model::load(a.model_dir, lo);
  if (!host) return fail(host.error().message);
  (*host)->set_kv_cache_format(kv_format->kv, kv_format->index);
  const model::M3Config cfg = (*host)->config();
  if (auto st = (*host)->validate_prompt(*ids); !st) return fail(st.error().message);
  if (auto st = engine::check_context_length(static_cast<int64_t>(ids->size()), a.max_tokens,
                                             cfg.max_position_embeddings, "--prompt-ids");
      !st) {
    return fail(st.error().message);
  }
  const int64_t total = static_cast<int64_t>(ids->size()) + a.max_tokens;
  // One sequence: pages for the prompt, the output and the token scored after the last.
  const int64_t pages = runtime::SequencePages::pages_needed(total + 1, 1, cfg.sparse_block_size);
  auto factory = make_backend_factory(
      dev, pages * model::KvCache::page_bytes(cfg), 0,
      model::is_synthetic_model(a.model_dir) ? model::parse_synthetic_spec(a.model_dir)->seed : 0);
  if (!factory) return fail(factory.error().message);
  auto backend = *factory ? (*factory)(std::move(*host), pages)
                          : runtime::make_cpu_backend(std::move(*host), pages);
  if (!backend) return fail(backend.error().message);
  runtime::SequenceRunner runner(std::move(*backend));
  const int seq = runner.add_sequence();
  auto run_step = [&](const std::vector<runtime::SequenceChunk>& c) { return runner.step(c); };

  engine::SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_p = a.top_p;
  sp.top_k = a.top_k;
  sp.min_p = a.min_p;
  if (a.seed >= 0) sp.seed = static_cast<uint64_t>(a.seed);
  auto rng = engine::Sampler::make_rng(sp);
  const int k = std::max(0, a.logprobs);
  const int64_t V = cfg.vocab_size;

  // Prefill, in chunks of --prefill-chunk tokens (0: whole prompt in one step).
  nlohmann::json prompt_lps = nlohmann::json::array();
  prompt_lps.push_back(nullptr);
  std::vector<float> last_logits;
  const int64_t n = static_cast<int64_t>(ids->size());
  const int64_t chunk = a.prefill_chunk > 0 ? a.prefill_chunk : n;
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t len = std::min(chunk, n - s);
    auto r = run_step({{seq, std::span<const int32_t>(ids->data() + s, len), a.echo}});
    if (a.echo) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t pos = s + i;
        if (pos + 1 < n) {
          std::span<const float> row(r.logits.data() + i * V, V);
          prompt_lps.push_back(logprob_json(engine::Sampler::logprobs(row, (*ids)[pos + 1], k)));
        }
      }
    }
    last_logits.assign(r.logits.end() - V, r.logits.end());
  }

  std::vector<int32_t> history(*ids), out_ids;
  nlohmann::json out_lps = nlohmann::json::array();
  for (int step = 0; step < a.max_tokens; ++step) {
    std::vector<float> work(last_logits);
    const int32_t tok = engine::Sampler::sample(work, sp, history, out_ids, rng, V);
    if (a.logprobs >= 0)
      out_lps.push_back(logprob_json(engine::Sampler::logprobs(last_logits, tok, k)));
    out_ids.push_back(tok);
    history.push_back(tok);
    const bool eos = std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), tok) !=
                     cfg.eos_token_ids.end();
    if ((eos && !a.ignore_eos) || step + 1 == a.max_tokens) break;
    auto r = run_step({{seq, std::span<const int32_t>(&tok, 1), false}});
    last_logits = std::move(r.logits);
  }

  if (a.json) {
    nlohmann::json j;
    j["prompt_ids"] = *ids;
    j["output_ids"] = out_ids;
    j["prompt_logprobs"] = a.echo ? prompt_lps : nlohmann::json(nullptr);
    j["output_logprobs"] = a.logprobs >= 0 ? out_lps : nlohmann::json(nullptr);
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("prompt ids (%zu):", ids->size());
    for (int32_t t : *ids) std::printf(" %d", t);
    std::printf("\noutput ids (%zu):", out_ids.size());
    for (int32_t t : out_ids) std::printf(" %d", t);
    std::printf("\n");
    if (a.logprobs >= 0) {
      for (size_t i = 0; i < out_lps.size(); ++i)
        std::printf("  %d  logprob %.6f\n", out_ids[i], out_lps[i]["logprob"].get<double>());
    }
  }
  return 0;
}

}  // namespace

RunFn register_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Run the model on token ids (debugging, checks)");
  sub->add_option("--model", a->model_dir,
                  "Model directory (config.json + safetensors), or synthetic:layers=N[,seed=S] "
                  "(M3's shapes, weights generated on the GPU; needs --device cuda)")
      ->required();
  sub->add_option("--prompt-ids", a->prompt_ids, "Comma-separated prompt token ids")->required();
  sub->add_option("--quantization,-q", a->quantization,
                  std::string("Weight format: none (the checkpoint as stored; its "
                              "quantization_config decides), fp8_per_channel (quantize a bf16 "
                              "checkpoint's linears at load), or the checkpoint's own method; "
                              "accepted: ") +
                      model::kQuantizationValues + " (docs/QUANTIZATION.md)");
  sub->add_option("--max-tokens", a->max_tokens, "Tokens to generate");
  sub->add_option("--temperature", a->temperature, "0 = greedy");
  sub->add_option("--top-p", a->top_p);
  sub->add_option("--top-k", a->top_k);
  sub->add_option("--min-p", a->min_p);
  sub->add_option("--seed", a->seed, "RNG seed for sampling");
  sub->add_option("--logprobs", a->logprobs, "Report logprobs with this many top entries");
  sub->add_flag("--echo", a->echo, "Also score the prompt (prompt_logprobs)");
  sub->add_flag("--json", a->json, "Print one JSON object");
  sub->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at the end-of-sequence token");
  sub->add_option("--prefill-chunk", a->prefill_chunk,
                  "Prefill the prompt in chunks of this many tokens (0 = one step)");
  sub->add_option("--device", a->device, "Where to run the model: cpu, or cuda (GPU builds)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_parallel_options(sub, a->parallel);
  add_gemm_precision_option(sub, a->gemm_precision);
  add_kv_dtype_options(sub, a->kv_cache_dtype, a->index_kv_dtype);
  return [a] { return run_generate(*a); };
}

}  // namespace m3::app
