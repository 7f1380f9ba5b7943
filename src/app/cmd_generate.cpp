// `m3serve generate`: run the model on token ids and print the continuation, for debugging and
// for checks from outside. Stable interface (issue #2):
//   m3serve generate --model DIR --prompt-ids 5,17,42 --max-tokens 8 --temperature 0
//                    --logprobs 5 --echo --json [--device cpu|cuda]
//                    [--tensor-parallel-size N | --data-parallel-size N] [--enable-expert-parallel]
//                    (CPU: N rank threads)
// prints {"prompt_ids", "output_ids", "prompt_logprobs", "output_logprobs"}; prompt_logprobs[i]
// scores prompt token i given the tokens before it (entry 0 is null). --device cuda runs the
// same forward on the GPU (M3ModelCuda; only in builds with M3_HAS_CUDA) and prints the same JSON.
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
#include "engine/sampler.h"
#include "model/forward_backend.h"
#include "model/m3_model.h"
#include "model/sequence_runner.h"
#include "model/synthetic_model.h"
#ifdef M3_HAS_CUDA
#include "model/cuda/cuda_backend.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/cuda/sequence_runner_cuda.h"
#include "model/kv_cache.h"
#endif

namespace m3::app {

namespace {

struct GenerateArgs {
  std::string model_dir;
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
  std::string gemm_precision = "exact";
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
      return make_error(ErrorCode::kInvalidArgument,
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

  // The model on the chosen device; everything below sees only its config and a step function.
  std::unique_ptr<model::M3Model> cpu_model;
#ifdef M3_HAS_CUDA
  std::unique_ptr<model::M3ModelCuda> gpu_model;
#endif
  const model::M3Config* cfgp = nullptr;
  const bool synthetic = model::is_synthetic_model(a.model_dir);
  model::SyntheticSpec spec;
  if (synthetic) {
    auto parsed = model::parse_synthetic_spec(a.model_dir);
    if (!parsed) return fail(parsed.error().message);
    spec = *parsed;
    if (a.device != "cuda") return fail(model::synthetic_needs_cuda_message(a.model_dir));
  }
  (void)spec;  // read only by the CUDA branch below
  // --device cuda --tensor-parallel-size N: the host model is loaded here and sharded over N GPUs
  // below (model::make_cuda_sharded_backend), like the CPU ranks; --data-parallel-size N too
  // (model::make_cuda_data_parallel_backend; one sequence: one rank runs it, the others join the
  // MoE collectives).
  const bool gpu_tp = a.device == "cuda" && a.parallel.tensor_parallel_size > 1;
  const bool gpu_dp = a.device == "cuda" && a.parallel.data_parallel_size > 1;
  const bool gpu_sharded = gpu_tp || gpu_dp;
#ifdef M3_HAS_CUDA
  if (gpu_tp) {
    if (auto st = model::check_tensor_parallel_devices(a.parallel.tensor_parallel_size); !st)
      return fail(st.error().message);
    apply_gemm_precision(a.gemm_precision);
  }
  if (gpu_dp) {
    if (auto st = model::check_data_parallel_devices(a.parallel.data_parallel_size); !st)
      return fail(st.error().message);
    apply_gemm_precision(a.gemm_precision);
  }
#endif
  if (a.device == "cuda" && !gpu_sharded) {
#ifdef M3_HAS_CUDA
    apply_gemm_precision(a.gemm_precision);
    auto m = synthetic ? model::M3ModelCuda::synthetic(model::synthetic_m3_config(spec.layers),
                                                       spec.seed)
                       : model::M3ModelCuda::load(a.model_dir);
    if (!m) return fail(m.error().message);
    gpu_model = std::move(*m);
    cfgp = &gpu_model->config();
#else
    return fail("--device cuda: this m3serve was built without CUDA support; rebuild with "
                "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu");
#endif
  } else {
#ifndef M3_HAS_CUDA
    if (gpu_sharded)
      return fail("--device cuda: this m3serve was built without CUDA support; rebuild with "
                  "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu");
#endif
    auto m = model::M3Model::load(a.model_dir);
    if (!m) return fail(m.error().message);
    cpu_model = std::move(*m);
    cfgp = &cpu_model->config();
  }
  const model::M3Config& cfg = *cfgp;
  Status valid;  // the GPU model validates through its host model, the same way
  if (cpu_model) valid = cpu_model->validate_prompt(*ids);
#ifdef M3_HAS_CUDA
  if (gpu_model) valid = gpu_model->validate_prompt(*ids);
#endif
  if (!valid) return fail(valid.error().message);
  const int64_t total = static_cast<int64_t>(ids->size()) + a.max_tokens;
  if (total > cfg.max_position_embeddings) {
    return fail("prompt (" + std::to_string(ids->size()) + " tokens) + --max-tokens (" +
                std::to_string(a.max_tokens) + ") exceeds the model's max_position_embeddings (" +
                std::to_string(cfg.max_position_embeddings) + ")");
  }

  engine::SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_p = a.top_p;
  sp.top_k = a.top_k;
  sp.min_p = a.min_p;
  if (a.seed >= 0) sp.seed = static_cast<uint64_t>(a.seed);
  auto rng = engine::Sampler::make_rng(sp);

  using Chunks = std::vector<model::SequenceRunner::Chunk>;
  std::function<model::ForwardResult(const Chunks&)> run_step;
  std::unique_ptr<model::SequenceRunner> cpu_runner;
#ifdef M3_HAS_CUDA
  std::unique_ptr<model::SequenceRunnerCuda> gpu_runner;
  if (gpu_model) {
    gpu_runner = std::make_unique<model::SequenceRunnerCuda>(*gpu_model, total + 1, 1);
    run_step = [&](const Chunks& c) { return gpu_runner->step(c); };
  }
#endif
  // --tensor-parallel-size > 1 on the CPU: rank threads over the model's weights (shared), each
  // with its own KV pages; the bump page allocator is the runner's.
  std::unique_ptr<model::ForwardBackend> sharded;
  std::unique_ptr<model::SequencePages> sharded_pages;
  if (cpu_model && wants_sharding(a.parallel)) {
    // Shares the weights; a synthetic model is config-only (its ranks generate their weights).
    auto view = synthetic ? model::M3Model::load(a.model_dir)
                          : cpu_model->make_shard(model::ShardSpec{});
    if (!view) return fail(view.error().message);
    const int64_t bs = cfg.sparse_block_size;
    const int64_t pages = model::SequencePages::pages_needed(total + 1, 1, bs);
    Result<std::unique_ptr<model::ForwardBackend>> be = tl::unexpected(Error{});
#ifdef M3_HAS_CUDA
    if (gpu_tp) {
      model::CudaBackendOptions o;
      o.kv_cache_memory_bytes = pages * model::KvCache::page_bytes(cfg);  // >= pages per rank
      o.synthetic_seed = spec.seed;  // a synthetic model: each rank generates its slices
      be = model::make_cuda_sharded_backend(std::move(*view), o, a.parallel.tensor_parallel_size,
                                            a.parallel.enable_expert_parallel);
    }
    if (gpu_dp) {
      model::CudaBackendOptions o;
      o.kv_cache_memory_bytes = pages * model::KvCache::page_bytes(cfg);  // all heads per rank
      o.synthetic_seed = spec.seed;
      be = model::make_cuda_data_parallel_backend(std::move(*view), o,
                                                  a.parallel.data_parallel_size,
                                                  a.parallel.enable_expert_parallel);
    }
#endif
    if (!gpu_sharded) {
      be = model::make_cpu_sharded_backend(std::move(*view), pages,
                                           a.parallel.tensor_parallel_size,
                                           a.parallel.enable_expert_parallel,
                                           a.parallel.data_parallel_size);
    }
    if (!be) return fail(be.error().message);
    sharded = std::move(*be);
    sharded_pages = std::make_unique<model::SequencePages>(sharded->num_pages(), bs);
    run_step = [&](const Chunks& c) {
      model::ForwardBatch b = sharded_pages->build_step(c);
      model::ForwardResult r;
      sharded->forward(b, &r, false);
      return r;
    };
  } else if (cpu_model) {
    cpu_runner = std::make_unique<model::SequenceRunner>(*cpu_model, total + 1, 1);
    run_step = [&](const Chunks& c) { return cpu_runner->step(c); };
  }
  int seq = 0;  // the runner's only sequence
  if (cpu_runner) seq = cpu_runner->add_sequence();
  if (sharded_pages) seq = sharded_pages->add_sequence();
#ifdef M3_HAS_CUDA
  if (gpu_runner) seq = gpu_runner->add_sequence();
#endif
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
    if (a.logprobs >= 0) out_lps.push_back(logprob_json(engine::Sampler::logprobs(last_logits, tok, k)));
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
  return [a] { return run_generate(*a); };
}

}  // namespace m3::app
