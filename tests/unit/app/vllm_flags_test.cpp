// The vLLM flag table against the MiniMax-M3 recipe: every launch command of the recipe (with
// vLLM's spellings) parses, then either starts or is refused with a reason that names the flag
// and what to do; no-ops print a notice; argv normalisation, VLLM_* variables, hub ids,
// --max-model-len forms and the --hf-overrides merge. The same commands run against the real
// binary in tests/e2e/test_recipe_flags.py.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "app/vllm_flags.h"
#include "model/config_overrides.h"

namespace m3::app {
namespace {

// m3serve's own serve options (cmd_serve.cpp, device_backend.cpp, parallel_args.cpp): stand-ins
// with the same names and arity, so the table can be checked without the engine. The e2e test
// runs the real binary, which would abort at registration if a table name collided with these.
const std::vector<std::pair<std::string, bool>> kNative = {
    {"--model", true},
    {"--tokenizer", true},
    {"--host", true},
    {"--port", true},
    {"--served-model-name", true},
    {"--max-model-len", true},
    {"--max-num-seqs", true},
    {"--max-num-batched-tokens", true},
    {"--block-size", true},
    {"--enable-prefix-caching", false},
    {"--no-enable-prefix-caching", false},
    {"--api-key", true},
    {"--tool-call-parser", true},
    {"--reasoning-parser", true},
    {"--enable-auto-tool-choice", false},
    {"--chat-template", true},
    {"--default-chat-template-kwargs", true},
    {"--generation-config", true},
    {"--max-queue-len,--max-num-queued-reqs", true},
    {"--language-model-only", false},
    {"--kv-cache-memory-bytes", true},
    {"--scheduling-policy", true},
    {"--log-level,--uvicorn-log-level", true},
    {"--http-threads", true},
    {"--device", true},
    {"--gpu-memory-utilization", true},
    {"--tensor-parallel-size,--tp", true},
    {"--enable-expert-parallel", false},
    {"--data-parallel-size,--dp", true},
    {"--nnodes", true},
    {"--node-rank", true},
    {"--master-addr", true},
    {"--master-port", true},
    {"--headless", false},
    {"--gemm-precision", true},
    {"--enforce-eager", false},
};

struct Parsed {
  std::string parse_error;  // CLI11's, when parsing failed
  Result<CompatPlan> plan = make_error(ErrorCode::kInternal, "not reviewed");
};

Parsed run(std::vector<std::string> argv, const EnvList& env = {},
           const std::string& device = "cpu") {
  CLI::App app{"t"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  CLI::App* sub = app.add_subcommand("serve");
  std::string model;
  sub->add_option("model_dir", model);
  std::vector<std::string> sink(kNative.size());
  for (size_t i = 0; i < kNative.size(); ++i) {
    if (kNative[i].second) {
      sub->add_option(kNative[i].first, sink[i]);
    } else {
      sub->add_flag(kNative[i].first);
    }
  }
  VllmFlagValues v;
  add_vllm_flags(sub, v, VllmCommand::kServe);
  argv.insert(argv.begin(), "serve");
  auto args = normalize_vllm_argv(argv);
  std::reverse(args.begin(), args.end());
  Parsed p;
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    p.parse_error = e.what();
    return p;
  }
  p.plan = review_vllm_flags(v, VllmCommand::kServe, device,
                             sub->get_option("--gemm-precision")->count() > 0, env);
  return p;
}

std::vector<std::string> split(const std::string& cmd) {
  // Shell-like split with single quotes (the recipe quotes its JSON arguments that way).
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false, have = false;
  for (char c : cmd) {
    if (c == '\'') {
      quoted = !quoted;
      have = true;
    } else if (c == ' ' && !quoted) {
      if (have) out.push_back(cur);
      cur.clear();
      have = false;
    } else {
      cur += c;
      have = true;
    }
  }
  if (have) out.push_back(cur);
  return out;
}

std::string all_notices(const CompatPlan& p) {
  std::string s;
  for (const auto& n : p.notices) s += n + "\n";
  return s;
}

struct RecipeCase {
  std::string name;
  std::string args;  // after `vllm serve MODEL`
  EnvList env;
  std::string refuse;  // "" = starts; else a substring of the refusal
  std::string notice;  // when it starts: a substring one notice must carry
};

// The recipe's commands (shared/seeds: the vLLM MiniMax-M3 recipe), model argument left out.
const std::vector<RecipeCase> kRecipe = {
    {"tp8",
     "--tensor-parallel-size 8 --block-size 128 --tool-call-parser minimax_m3 "
     "--reasoning-parser minimax_m3 --enable-auto-tool-choice",
     {},
     "",
     ""},
    {"tp8_ep",
     "--tensor-parallel-size 8 --enable-expert-parallel --block-size 128 "
     "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 "
     "--enable-auto-tool-choice",
     {},
     "",
     ""},
    {"dp8_ep",
     "--data-parallel-size 8 --enable-expert-parallel --block-size 128 "
     "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 "
     "--enable-auto-tool-choice",
     {},
     "",
     ""},
    {"amd_tp8_text",
     "--tensor-parallel-size 8 --block-size 128 --attention-backend TRITON_ATTN "
     "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 "
     "--enable-auto-tool-choice",
     {"VLLM_USE_BREAKABLE_CUDAGRAPH=0"},
     "",
     "--attention-backend TRITON_ATTN is ignored"},
    {"amd_tp8_vision",
     "--tensor-parallel-size 8 --block-size 128 --attention-backend "
     "TRITON_ATTN --mm-encoder-tp-mode data --mm-encoder-attn-backend "
     "ROCM_AITER_FA --tool-call-parser minimax_m3",
     {},
     "",
     "--mm-encoder-tp-mode data: the vision tower runs whole"},
    {"vision_limits",
     "--limit-mm-per-prompt '{\"image\": 2, \"video\": 1}' --mm-processor-cache-gb 1 "
     "--mm-processor-cache-type shm",
     {},
     "",
     "--mm-processor-cache-type shm"},
    {"vision_limit_bad_key", "--limit-mm-per-prompt '{\"audio\": 1}'", {}, "not a modality", ""},
    {"vision_cache_bad", "--mm-processor-cache-gb lots", {}, "--mm-processor-cache-gb", ""},
    {"vision_processor_kwargs",
     "--mm-processor-kwargs '{\"max_pixels\": 200704, \"fps\": 2, \"max_frames\": 64}'",
     {},
     "",
     "videos sampled at 2 fps, 4..64 frames"},
    {"vision_processor_kwargs_size",
     "--mm-processor-kwargs '{\"size\": {\"shortest_edge\": 784, \"longest_edge\": 3136}}'",
     {},
     "",
     "images resized within 784..3136 pixels"},
    {"vision_processor_kwargs_unknown",
     "--mm-processor-kwargs '{\"num_frames\": 8}'",
     {},
     "\"num_frames\" is not a MiniMax-M3 processor option m3serve knows; accepted: min_pixels",
     ""},
    {"vision_processor_kwargs_order",
     "--mm-processor-kwargs '{\"min_pixels\": 500000}'",
     {},
     "min_pixels 500000 is above max_pixels 451584",
     ""},
    {"vision_processor_kwargs_fps",
     "--mm-processor-kwargs '{\"fps\": 0}'",
     {},
     "\"fps\" must be",
     ""},
    {"offload_lazy_default",
     "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": "
     "\"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 1073741824}}'",
     {},
     "",
     "lazy_offload false (vLLM's default when not given)"},
    {"uds", "--uds /tmp/m3.sock", {}, "", ""},
    {"uds_too_long",
     "--uds "
     "/tmp/"
     "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
     "xxxxxxxxxxxxxxxxxxxxxxxxxxx",
     {},
     "is not a Unix socket path",
     ""},
    {"vision_media_io_kwargs",
     "--media-io-kwargs '{\"video\": {\"num_frames\": 8}}'",
     {},
     "video frame sampling is set with --mm-processor-kwargs",
     ""},
    {"amd_fp8_per_channel",
     "--tensor-parallel-size 8 --block-size 128 --attention-backend "
     "TRITON_ATTN --quantization fp8_per_channel",
     {"VLLM_ROCM_USE_AITER=1", "VLLM_ROCM_USE_AITER_MOE=0"},
     "",
     ""},
    {"quantization_unknown",
     "--tensor-parallel-size 8 --quantization int3",
     {},
     "--quantization 'int3' is unknown; accepted: none, fp8_per_channel, mxfp8",
     ""},
    {"fp8_kv", "--tensor-parallel-size 8 --block-size 128 --kv-cache-dtype fp8", {}, "", ""},
    {"max_len_128k",
     "--tensor-parallel-size 8 --block-size 128 --max-model-len 131072",
     {},
     "",
     ""},
    {"yarn_1m",
     "--block-size 128 --tensor-parallel-size 8 --max-model-len 1048576 "
     "--tool-call-parser minimax_m3 --enable-auto-tool-choice --reasoning-parser "
     "minimax_m3 --hf-overrides '{\"text_config\":{\"rope_scaling\":{\"rope_type\":"
     "\"yarn\",\"factor\":2.0,\"original_max_position_embeddings\":524288}}}'",
     {"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"},
     "",
     ""},
    {"mxfp8_mi300x",
     "--tensor-parallel-size 8 --block-size 128 --language-model-only "
     "--max-model-len 65536 --attention-backend TRITON_ATTN --async-scheduling "
     "--max-num-batched-tokens 16384 --tool-call-parser minimax_m3",
     {"VLLM_ENGINE_READY_TIMEOUT_S=3600", "VLLM_ROCM_USE_AITER_MHA=0"},
     "",
     "VLLM_ENGINE_READY_TIMEOUT_S, VLLM_ROCM_USE_AITER_MHA are ignored"},
    {"mxfp8_h200",
     "--tensor-parallel-size 8 --block-size 128 --attention-backend FLASH_ATTN "
     "--linear-backend humming --kv-cache-dtype fp8 --gpu-memory-utilization 0.95 "
     "--enable-prefix-caching",
     {"VLLM_MARLIN_USE_ATOMIC_ADD=1"},
     "",
     "--linear-backend humming is ignored"},
    {"mxfp8_indexer_dotted",
     "--tensor-parallel-size 8 --block-size 128 "
     "--attention_config.indexer_kv_dtype fp8",
     {},
     "",
     ""},
    {"mi355x_hc",
     "--tensor-parallel-size 4 --block-size 128 --language-model-only "
     "--moe-backend aiter --max-num-batched-tokens 32768 --attention-backend "
     "TRITON_ATTN --linear-backend emulation --tool-call-parser minimax_m3",
     {"VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1"},
     "",
     "--moe-backend aiter is ignored"},
    {"nvfp4",
     "--tensor-parallel-size 8 --trust-remote-code --block-size 128 "
     "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 "
     "--enable-auto-tool-choice",
     {"VLLM_FLOAT32_MATMUL_PRECISION=high"},
     "",
     "--trust-remote-code is ignored"},
    {"nvfp4_eagle3",
     "--tensor-parallel-size 8 --trust-remote-code --block-size 128 "
     "--language-model-only --speculative-config '{\"method\": \"eagle3\", "
     "\"model\": \"Inferact/MiniMax-M3-EAGLE3\", \"num_speculative_tokens\": 3}'",
     {},
     "does not download",
     ""},
    {"nvfp4_trtllm_dotted",
     "--tensor-parallel-size 8 --kv-cache-dtype auto "
     "--attention_config.backend FLASHINFER "
     "--attention_config.use_trtllm_attention true "
     "--attention_config.minimax_m3_msa_decode_backend cutlass",
     {},
     "",
     "backend, use_trtllm_attention, minimax_m3_msa_decode_backend"},
    {"mxfp4_tp8",
     "--tensor-parallel-size 8 --trust-remote-code --compilation-config "
     "'{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' --block-size 128",
     {},
     "",
     "--compilation-config is ignored"},
    {"agentx_lane",
     "--port 8000 --tensor-parallel-size 4 --trust-remote-code --block-size 128 "
     "--gpu-memory-utilization 0.90 --enable-chunked-prefill "
     "--max-num-batched-tokens 32768 --language-model-only "
     "--enable-prefix-caching --attention-backend ROCM_AITER_UNIFIED_ATTN "
     "--moe-backend aiter --default-chat-template-kwargs "
     "'{\"thinking_mode\":\"enabled\"}' --max-num-seqs 64 --stream-interval 20",
     {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1800"},
     "",
     "--moe-backend aiter is ignored"},
    {"gb200_worker",
     "--tensor-parallel-size 4 --pipeline-parallel-size 1 --trust-remote-code "
     "--block-size 128 --max-model-len 1048576 --no-enable-flashinfer-autotune "
     "--kv-events-config '{\"publisher\":\"zmq\"}'",
     {},
     "",
     "enable_kv_cache_events is false, so no KV events are published"},
    {"multinode_headless",
     "--tensor-parallel-size 8 --nnodes 2 --node-rank 1 --headless",
     {},
     "",
     ""},
    {"kv_offload",
     "--kv-transfer-config '{\"kv_connector\":\"SimpleCPUOffloadConnector\"}'",
     {"VLLM_USE_SIMPLE_KV_OFFLOAD=1"},
     "needs kv_role",
     ""},
    {"common_set",
     "--dtype auto --seed 0 --max-logprobs 20 --disable-log-requests "
     "--disable-log-stats --override-generation-config '{\"temperature\":1.0}' "
     "--allowed-origins '[\"*\"]' --root-path /m3 --enable-prompt-tokens-details "
     "--exclude-tools-when-tool-choice-none --api-key k1 --disable-flashinfer-autotune",
     {},
     "",
     "--root-path /m3"},
};

class Recipe : public ::testing::TestWithParam<RecipeCase> {};

TEST_P(Recipe, StartsOrRefusesWithReason) {
  const RecipeCase& c = GetParam();
  const Parsed p = run(split(c.args), c.env);
  ASSERT_EQ(p.parse_error, "") << "CLI11 rejected a recipe flag";
  if (c.refuse.empty()) {
    ASSERT_TRUE(p.plan.has_value()) << p.plan.error().message;
    if (!c.notice.empty()) {
      EXPECT_NE(all_notices(*p.plan).find(c.notice), std::string::npos) << all_notices(*p.plan);
    }
  } else {
    ASSERT_FALSE(p.plan.has_value()) << "expected a refusal mentioning " << c.refuse;
    const std::string& m = p.plan.error().message;
    EXPECT_NE(m.find(c.refuse), std::string::npos) << m;
    EXPECT_NE(m.find("--"), std::string::npos) << "a refusal names the flag: " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(VllmRecipe, Recipe, ::testing::ValuesIn(kRecipe),
                         [](const auto& info) { return info.param.name; });

TEST(VllmFlagTable, EveryEntryHasAReasonAndAUniqueName) {
  std::set<std::string> names;
  for (const auto& [n, _] : kNative) names.insert(n.substr(0, n.find(',')));
  for (const VllmFlag& f : vllm_flag_table()) {
    const std::string n(f.names.substr(0, f.names.find(',')));
    EXPECT_TRUE(names.insert(n).second) << n << " is registered twice";
    if (f.kind != FlagKind::kHandled) {
      EXPECT_FALSE(f.why.empty()) << n;
    }
    if (f.kind == FlagKind::kComing) {
      EXPECT_NE(f.why.find("issue #"), std::string_view::npos) << n;
    }
  }
}

TEST(VllmFlagTable, EveryNoopPrintsANoticeAndEveryRefusalNamesItsFlag) {
  for (const VllmFlag& f : vllm_flag_table()) {
    if (f.kind == FlagKind::kHandled) continue;
    const std::string n(f.names.substr(0, f.names.find(',')));
    std::vector<std::string> argv = {n};
    if (f.takes_value) argv.push_back("some-value");
    const Parsed p = run(argv);
    ASSERT_EQ(p.parse_error, "") << n;
    if (f.kind == FlagKind::kNoop) {
      ASSERT_TRUE(p.plan.has_value()) << n;
      EXPECT_NE(all_notices(*p.plan).find(n), std::string::npos) << n;
    } else {
      ASSERT_FALSE(p.plan.has_value()) << n;
      EXPECT_EQ(p.plan.error().message.rfind(n, 0), 0u) << p.plan.error().message;
    }
  }
}

TEST(VllmFlags, RepeatedFlagLastWins) {
  EXPECT_TRUE(run({"--kv-cache-dtype", "int8", "--kv-cache-dtype", "auto"}).plan.has_value());
  EXPECT_FALSE(run({"--kv-cache-dtype", "auto", "--kv-cache-dtype", "int8"}).plan.has_value());
}

TEST(VllmFlags, KvCacheDtypes) {
  // vLLM's spellings map to one name each; the engine's own float32 is accepted too.
  const std::pair<const char*, const char*> ok[] = {
      {"auto", "auto"},     {"fp8", "fp8_e4m3"},      {"FP8_E4M3", "fp8_e4m3"},
      {"bf16", "bfloat16"}, {"bfloat16", "bfloat16"}, {"float32", "float32"}};
  for (const auto& [given, want] : ok) {
    auto p = run({"--kv-cache-dtype", given});
    ASSERT_TRUE(p.plan.has_value()) << given << ": " << p.plan.error().message;
    EXPECT_EQ(p.plan->kv_cache_dtype.value_or(""), want) << given;
  }
  for (const char* bad : {"fp16", "int8", "fp8_e5m2", "bfloat", ""}) {
    auto p = run({"--kv-cache-dtype", bad});
    ASSERT_FALSE(p.plan.has_value()) << bad;
    EXPECT_NE(p.plan.error().message.find("accepted: auto, bfloat16, fp8"), std::string::npos)
        << p.plan.error().message;
  }
  // The index-K format through --attention-config, JSON or the recipe's dotted form.
  auto j = run({"--attention-config", "{\"indexer_kv_dtype\": \"fp8\"}"});
  ASSERT_TRUE(j.plan.has_value()) << j.plan.error().message;
  EXPECT_EQ(j.plan->index_kv_dtype.value_or(""), "fp8_e4m3");
  EXPECT_EQ(all_notices(*j.plan).find("--attention-config"), std::string::npos);
  auto dotted = run(normalize_vllm_argv({"--attention_config.indexer_kv_dtype", "bf16"}));
  ASSERT_TRUE(dotted.plan.has_value()) << dotted.plan.error().message;
  EXPECT_EQ(dotted.plan->index_kv_dtype.value_or(""), "bfloat16");
  auto unknown = run({"--attention-config", "{\"indexer_kv_dtyp\": \"fp8\"}"});
  ASSERT_FALSE(unknown.plan.has_value());
  EXPECT_NE(unknown.plan.error().message.find("indexer_kv_dtyp' is unknown"), std::string::npos);
  EXPECT_NE(unknown.plan.error().message.find("indexer_kv_dtype, backend"), std::string::npos);
  EXPECT_FALSE(run({"--attention-config", "{\"indexer_kv_dtype\": \"int8\"}"}).plan.has_value());
}

TEST(VllmFlags, DtypeMapsToGemmPrecisionOnTheGpu) {
  auto f32 = run({"--dtype", "float32"}, {}, "cuda");
  ASSERT_TRUE(f32.plan.has_value());
  EXPECT_EQ(f32.plan->gemm_precision.value_or(""), "exact");
  auto bf16 = run({"--dtype", "bfloat16"}, {}, "cuda");
  EXPECT_EQ(bf16.plan->gemm_precision.value_or(""), "bf16");
  auto automatic = run({"--dtype", "auto"}, {}, "cuda");
  EXPECT_FALSE(automatic.plan->gemm_precision.has_value());
  auto cpu = run({"--dtype", "bfloat16"}, {}, "cpu");
  ASSERT_TRUE(cpu.plan.has_value());
  EXPECT_FALSE(cpu.plan->gemm_precision.has_value());
  EXPECT_NE(all_notices(*cpu.plan).find("fp32"), std::string::npos);
  EXPECT_FALSE(run({"--dtype", "half"}).plan.has_value());
  auto both = run({"--dtype", "bfloat16", "--gemm-precision", "exact"}, {}, "cuda");
  ASSERT_FALSE(both.plan.has_value());
  EXPECT_NE(both.plan.error().message.find("give one"), std::string::npos);
}

TEST(VllmFlags, SpeculativeConfig) {
  const std::string dir = ::testing::TempDir() + "/spec_cfg_draft";
  std::filesystem::create_directories(dir);
  auto spec = [&](const std::string& body) {
    return run({"--speculative-config", "{" + body + "}"});
  };
  const std::string base = "\"method\": \"eagle3\", \"model\": \"" + dir + "\"";
  auto ok = spec(base +
                 ", \"num_speculative_tokens\": 3, \"draft_tensor_parallel_size\": 8, "
                 "\"use_local_argmax_reduction\": true, \"attention_backend\": "
                 "\"FLASH_ATTN\"");
  ASSERT_TRUE(ok.plan.has_value()) << ok.plan.error().message;
  ASSERT_TRUE(ok.plan->speculative.has_value());
  EXPECT_EQ(ok.plan->speculative->method, "eagle3");
  EXPECT_EQ(ok.plan->speculative->model, dir);
  EXPECT_EQ(ok.plan->speculative->num_speculative_tokens, 3);
  EXPECT_FALSE(ok.plan->speculative->synthetic);
  const std::string notes = all_notices(*ok.plan);
  EXPECT_NE(notes.find("attention_backend \"FLASH_ATTN\": not applicable"), std::string::npos)
      << notes;
  EXPECT_NE(notes.find("draft_tensor_parallel_size 8"), std::string::npos) << notes;
  EXPECT_NE(notes.find("use_local_argmax_reduction: not applicable"), std::string::npos) << notes;

  auto syn = spec(base +
                  ", \"num_speculative_tokens\": 3, \"rejection_sample_method\": "
                  "\"synthetic\", \"synthetic_acceptance_length\": 2.78");
  ASSERT_TRUE(syn.plan.has_value()) << syn.plan.error().message;
  EXPECT_TRUE(syn.plan->speculative->synthetic);
  EXPECT_DOUBLE_EQ(syn.plan->speculative->synthetic_acceptance_length, 2.78);
  EXPECT_NE(all_notices(*syn.plan).find("BENCHMARK ONLY"), std::string::npos);
  // A synthetic draft (random weights on the GPU) is no directory; it is named as benchmark-only.
  auto sd =
      spec("\"method\": \"eagle3\", \"model\": \"synthetic:gqa\", \"num_speculative_tokens\": 3");
  ASSERT_TRUE(sd.plan.has_value()) << sd.plan.error().message;
  EXPECT_EQ(sd.plan->speculative->model, "synthetic:gqa");
  EXPECT_NE(all_notices(*sd.plan).find("SYNTHETIC draft"), std::string::npos);

  auto refused = [&](const std::string& body, const std::vector<std::string>& needles) {
    auto p = spec(body);
    ASSERT_FALSE(p.plan.has_value()) << body;
    for (const auto& n : needles)
      EXPECT_NE(p.plan.error().message.find(n), std::string::npos) << p.plan.error().message;
  };
  refused(base + ", \"num_speculative_tokens\": 3, \"bogus\": 1",
          {"key 'bogus' is unknown", "num_speculative_tokens", "rejection_sample_method"});
  refused("\"method\": \"ngram\", \"num_speculative_tokens\": 3",
          {"method 'ngram' is not supported", "\"eagle3\""});
  refused(base + ", \"num_speculative_tokens\": 0", {"is 0", "1 to 8"});
  refused(base + ", \"num_speculative_tokens\": 9", {"is 9", "1 to 8"});
  refused(base, {"needs \"num_speculative_tokens\""});
  refused(base + ", \"num_speculative_tokens\": 3, \"rejection_sample_method\": \"synthetic\"",
          {"needs synthetic_acceptance_length", "never assumed"});
  refused(base + ", \"num_speculative_tokens\": 3, \"synthetic_acceptance_length\": 2.5",
          {"only read with"});
  refused(base +
              ", \"num_speculative_tokens\": 3, \"rejection_sample_method\": "
              "\"synthetic\", \"synthetic_acceptance_length\": 4.5",
          {"must be in [1, 4]"});
  refused(base + ", \"num_speculative_tokens\": 3, \"rejection_sample_method\": \"typical\"",
          {"'typical' is unknown", "\"exact\""});
  refused("\"method\": \"eagle3\", \"model\": \"" + dir +
              "/missing\", "
              "\"num_speculative_tokens\": 3",
          {"is not a directory"});
  refused("\"method\": \"eagle3\", \"num_speculative_tokens\": 3", {"needs \"model\""});
  EXPECT_FALSE(run({"--num-speculative-tokens", "3"}).plan.has_value());
}

TEST(VllmFlags, AsyncSchedulingAndCaptureSizes) {
  EXPECT_FALSE(run({}).plan->async_scheduling.has_value());
  EXPECT_EQ(run({"--async-scheduling"}).plan->async_scheduling, std::optional<bool>(true));
  EXPECT_EQ(run({"--no-async-scheduling"}).plan->async_scheduling, std::optional<bool>(false));
  auto both = run({"--async-scheduling", "--no-async-scheduling"});
  ASSERT_FALSE(both.plan.has_value());
  EXPECT_NE(both.plan.error().message.find("both given"), std::string::npos);

  auto sizes = run({"--compilation-config",
                    "{\"cudagraph_mode\": \"FULL_DECODE_ONLY\", \"cudagraph_capture_sizes\": "
                    "[8, 1, 2, 4]}"});
  ASSERT_TRUE(sizes.plan.has_value()) << sizes.plan.error().message;
  EXPECT_EQ(sizes.plan->cudagraph_capture_sizes, (std::vector<int64_t>{8, 1, 2, 4}));
  EXPECT_FALSE(sizes.plan->enforce_eager);
  ASSERT_EQ(sizes.plan->notices.size(), 1u);
  EXPECT_NE(sizes.plan->notices[0].find("exactly 4 sizes (up to 8 tokens)"), std::string::npos)
      << sizes.plan->notices[0];
  auto capped = run({"--compilation-config", "{\"max_cudagraph_capture_size\": 16}"});
  ASSERT_TRUE(capped.plan.has_value());
  EXPECT_EQ(capped.plan->cudagraph_capture_sizes.size(), 16u);
  EXPECT_EQ(capped.plan->cudagraph_capture_sizes.back(), 16);
  auto listed = run({"--cuda-graph-sizes", "1,2,4,8,16"});
  ASSERT_TRUE(listed.plan.has_value()) << listed.plan.error().message;
  EXPECT_EQ(listed.plan->cudagraph_capture_sizes, (std::vector<int64_t>{1, 2, 4, 8, 16}));
  for (const char* bad :
       {"{\"cudagraph_capture_sizes\": [0]}", "{\"cudagraph_capture_sizes\": [512]}",
        "{\"cudagraph_capture_sizes\": []}", "{\"cudagraph_capture_sizes\": \"1,2\"}",
        "{\"max_cudagraph_capture_size\": 0}"}) {
    auto r = run({"--compilation-config", bad});
    ASSERT_FALSE(r.plan.has_value()) << bad;
    EXPECT_EQ(r.plan.error().param, "--compilation-config") << bad;
  }
  EXPECT_FALSE(run({"--cuda-graph-sizes", "1,x"}).plan.has_value());
  // Keys m3serve has no use for are named in a notice.
  auto other = run({"--compilation-config", "{\"cudagraph_capture_sizes\": [1], \"level\": 3}"});
  ASSERT_TRUE(other.plan.has_value());
  ASSERT_EQ(other.plan->notices.size(), 2u);
  EXPECT_NE(other.plan->notices[1].find("--compilation-config level is ignored"), std::string::npos)
      << other.plan->notices[1];
}

TEST(VllmFlags, HandledValues) {
  auto p = run({"--compilation-config", "{\"cudagraph_mode\": \"NONE\"}", "--seed", "7",
                "--hf-overrides", "{\"a\": {\"b\": 1}}", "--override-generation-config",
                "{\"top_k\": 40}", "--enable-log-requests"});
  ASSERT_TRUE(p.plan.has_value()) << p.plan.error().message;
  EXPECT_TRUE(p.plan->enforce_eager);
  EXPECT_EQ(p.plan->seed.value_or(0), 7u);
  EXPECT_EQ(p.plan->hf_overrides, "{\"a\":{\"b\":1}}");
  EXPECT_EQ(p.plan->generation_overrides, "{\"top_k\":40}");
  EXPECT_TRUE(p.plan->log_requests);
  EXPECT_EQ(p.plan->quantization, "");
  // --quantization is kept for the model load (checked there against the checkpoint).
  EXPECT_EQ(run({"--quantization", "fp8_per_channel"}).plan->quantization, "fp8_per_channel");
  EXPECT_EQ(run({"-q", "MXFP8"}).plan->quantization, "MXFP8");
  EXPECT_FALSE(run({"--quantization", "gptq"}).plan.has_value());
  EXPECT_FALSE(run({"--hf-overrides", "[1]"}).plan.has_value());
  EXPECT_FALSE(run({"--seed", "x"}).plan.has_value());
  EXPECT_EQ(run({"--max-logprobs", "50"}).plan->max_logprobs.value_or(0), 50);
  EXPECT_EQ(run({"--max-logprobs", "-1"}).plan->max_logprobs.value_or(0), 1 << 30);
  EXPECT_FALSE(run({"--max-logprobs", "-2"}).plan.has_value());
  EXPECT_FALSE(run({"--max-logprobs", "x"}).plan.has_value());
  EXPECT_FALSE(run({"--enable-log-requests", "--disable-log-requests"}).plan.has_value());
  const auto si = run({"--stream-interval", "20"});
  ASSERT_TRUE(si.plan.has_value());
  EXPECT_EQ(si.plan->stream_interval, 20);
  EXPECT_TRUE(si.plan->notices.empty());  // it works: no "ignored" notice
  EXPECT_EQ(run({}).plan->stream_interval, 1);
  for (const char* bad : {"0", "-3", "x", "5000"})
    EXPECT_FALSE(run({"--stream-interval", bad}).plan.has_value()) << bad;
  const auto lp = run({"--long-prefill-token-threshold", "2048"});
  ASSERT_TRUE(lp.plan.has_value());
  EXPECT_EQ(lp.plan->long_prefill_token_threshold, 2048);
  EXPECT_TRUE(lp.plan->notices.empty());  // applied (sched/scheduler.h), not a no-op
  EXPECT_EQ(run({}).plan->long_prefill_token_threshold, 0);
  for (const char* bad : {"-1", "x", ""})
    EXPECT_FALSE(run({"--long-prefill-token-threshold", bad}).plan.has_value()) << bad;
}

TEST(VllmFlags, EnvironmentHonouredOrReportedOnce) {
  auto p = run({}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1", "VLLM_API_KEY=x", "VLLM_B=1", "VLLM_A=2",
                    "PATH=/bin", "VLLM_LOGGING_LEVEL=DEBUG"});
  ASSERT_TRUE(p.plan.has_value());
  EXPECT_TRUE(p.plan->allow_long_max_model_len);
  EXPECT_EQ(p.plan->log_level.value_or(""), "debug");
  ASSERT_EQ(p.plan->notices.size(), 1u) << all_notices(*p.plan);
  EXPECT_NE(p.plan->notices[0].find("VLLM_A, VLLM_B are ignored"), std::string::npos);
  EXPECT_TRUE(run({}, {}).plan->notices.empty());
  // VLLM_VIDEO_FETCH_TIMEOUT bounds the decoding of a video part (m3serve fetches nothing).
  auto v = run({}, {"VLLM_VIDEO_FETCH_TIMEOUT=5"});
  ASSERT_TRUE(v.plan.has_value());
  EXPECT_EQ(v.plan->video_timeout_s.value_or(0), 5.0);
  EXPECT_TRUE(v.plan->notices.empty());
  auto bad = run({}, {"VLLM_VIDEO_FETCH_TIMEOUT=soon"});
  ASSERT_FALSE(bad.plan.has_value());
  EXPECT_NE(bad.plan.error().message.find("VLLM_VIDEO_FETCH_TIMEOUT='soon' is not a positive"),
            std::string::npos);
}

TEST(VllmArgv, Normalisation) {
  using V = std::vector<std::string>;
  EXPECT_EQ(normalize_vllm_argv({"serve", "m_dir", "--max_model_len", "4", "--block_size=128"}),
            (V{"serve", "m_dir", "--max-model-len", "4", "--block-size=128"}));
  EXPECT_EQ(normalize_vllm_argv({"-tp", "8", "-pp=1", "-dp", "2"}),
            (V{"--tensor-parallel-size", "8", "--pipeline-parallel-size=1", "--data-parallel-size",
               "2"}));
  const V dotted = normalize_vllm_argv({"--attention_config.backend", "FLASHINFER", "--port", "1",
                                        "--attention-config.use_trtllm_attention=true",
                                        "--compilation-config.pass_config.x", "{\"y\": 2}"});
  ASSERT_EQ(dotted.size(), 6u);
  EXPECT_EQ(dotted[0], "--attention-config");
  EXPECT_EQ(nlohmann::json::parse(dotted[1]),
            nlohmann::json::parse(R"({"backend":"FLASHINFER","use_trtllm_attention":true})"));
  EXPECT_EQ(dotted[2], "--port");
  EXPECT_EQ(dotted[4], "--compilation-config");
  EXPECT_EQ(nlohmann::json::parse(dotted[5]),
            nlohmann::json::parse(R"({"pass_config":{"x":{"y":2}}})"));
  // Values are never rewritten.
  EXPECT_EQ(normalize_vllm_argv({"--chat-template", "a_b.jinja"}),
            (V{"--chat-template", "a_b.jinja"}));
}

TEST(VllmArgv, MaxModelLenForms) {
  EXPECT_EQ(*parse_max_model_len("65536"), 65536);
  EXPECT_EQ(*parse_max_model_len("128k"), 128000);
  EXPECT_EQ(*parse_max_model_len("128K"), 131072);
  EXPECT_EQ(*parse_max_model_len("1M"), 1048576);
  EXPECT_EQ(*parse_max_model_len("25.6k"), 25600);
  EXPECT_EQ(*parse_max_model_len("auto"), 0);
  EXPECT_EQ(*parse_max_model_len("-1"), 0);
  EXPECT_FALSE(parse_max_model_len("1.5").has_value());
  EXPECT_FALSE(parse_max_model_len("12q").has_value());
  EXPECT_FALSE(parse_max_model_len("").has_value());
}

TEST(VllmModelArgument, HubIdFromLocalCacheOrClearError) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("m3_hub_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path repo = root / "hub" / "models--MiniMaxAI--MiniMax-M3";
  fs::create_directories(repo / "refs");
  fs::create_directories(repo / "snapshots" / "abc123");
  std::ofstream(repo / "refs" / "main") << "abc123\n";
  std::ofstream(repo / "snapshots" / "abc123" / "config.json") << "{}";
  std::string notice;
  auto got = resolve_model_argument("MiniMaxAI/MiniMax-M3", {"HF_HOME=" + root.string()}, &notice);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, (repo / "snapshots" / "abc123").string());
  EXPECT_NE(notice.find("cache"), std::string::npos);
  auto missing =
      resolve_model_argument("MiniMaxAI/MiniMax-M3-MXFP8", {"HF_HOME=" + root.string()}, nullptr);
  ASSERT_FALSE(missing.has_value());
  EXPECT_NE(missing.error().message.find("does not download"), std::string::npos);
  EXPECT_NE(missing.error().message.find("huggingface-cli download MiniMaxAI/MiniMax-M3-MXFP8"),
            std::string::npos);
  // Not hub-like: passed through for the caller's "no such directory" message.
  EXPECT_EQ(*resolve_model_argument("/no/such/dir", {}, nullptr), "/no/such/dir");
  EXPECT_EQ(*resolve_model_argument("synthetic:layers=2", {}, nullptr), "synthetic:layers=2");
  fs::remove_all(root);
}

TEST(ConfigOverrides, MergesObjectsAndReplacesValues) {
  const std::string cfg =
      R"({"model_type":"m","text_config":{"max_position_embeddings":524288,"rope_parameters":{"rope_theta":5000000}},"x":[1,2]})";
  auto merged = model::merge_config_json(
      cfg,
      R"({"text_config":{"max_position_embeddings":1048576,"rope_parameters":{"factor":2}},"x":[3]})",
      "config.json");
  ASSERT_TRUE(merged.has_value());
  EXPECT_EQ(
      nlohmann::json::parse(*merged),
      nlohmann::json::parse(
          R"({"model_type":"m","text_config":{"max_position_embeddings":1048576,"rope_parameters":{"rope_theta":5000000,"factor":2}},"x":[3]})"));
  // Key order of the file is kept (the parser reads keys by name, but diffs stay readable).
  EXPECT_EQ(merged->rfind("{\"model_type\"", 0), 0u);
  EXPECT_EQ(*model::merge_config_json(cfg, "", "config.json"), cfg);
  EXPECT_FALSE(model::merge_config_json("[1]", "{\"a\":1}", "config.json").has_value());
  EXPECT_FALSE(model::set_config_overrides("not json").has_value());
  ASSERT_TRUE(model::set_config_overrides(R"({"a": 1})").has_value());
  EXPECT_EQ(model::config_overrides(), "{\"a\":1}");
  EXPECT_EQ(nlohmann::json::parse(*model::apply_config_overrides("{\"a\":0,\"b\":2}", "c")),
            nlohmann::json::parse("{\"a\":1,\"b\":2}"));
  ASSERT_TRUE(model::set_config_overrides("").has_value());
  EXPECT_EQ(*model::apply_config_overrides("{\"a\":0}", "c"), "{\"a\":0}");
}

}  // namespace
}  // namespace m3::app

namespace m3::app {
namespace {

TEST(VllmFlags, NixlConnectorRolesAndSideChannel) {
  const std::string pre = "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"";
  const std::pair<const char*, engine::KvRole> roles[] = {
      {"kv_producer", engine::KvRole::kProducer},
      {"kv_consumer", engine::KvRole::kConsumer},
      {"kv_both", engine::KvRole::kBoth}};
  for (const auto& [name, role] : roles) {
    auto p = run({"--kv-transfer-config", pre + name + "\"}"});
    ASSERT_TRUE(p.plan.has_value()) << name << ": " << p.plan.error().message;
    ASSERT_TRUE(p.plan->pd.has_value()) << name;
    EXPECT_EQ(p.plan->pd->role, role);
    EXPECT_EQ(p.plan->pd->port, 5600);  // vLLM's defaults
    EXPECT_EQ(p.plan->pd->host, "localhost");
    EXPECT_EQ(p.plan->host_kv_cache_bytes, 0);  // not the offloading tier
  }
  // vLLM's side-channel variables configure it.
  auto env = run({"--kv-transfer-config", pre + "kv_producer\"}"},
                 {"VLLM_NIXL_SIDE_CHANNEL_PORT=6123", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.7",
                  "VLLM_NIXL_ABORT_REQUEST_TIMEOUT=12.5"});
  ASSERT_TRUE(env.plan.has_value()) << env.plan.error().message;
  EXPECT_EQ(env.plan->pd->port, 6123);
  EXPECT_EQ(env.plan->pd->host, "10.0.0.7");
  EXPECT_DOUBLE_EQ(env.plan->pd->abort_timeout_s, 12.5);
  EXPECT_EQ(all_notices(*env.plan).find("VLLM_NIXL"), std::string::npos);
  // Without the connector the variables do nothing, and say so.
  auto alone = run({}, {"VLLM_NIXL_SIDE_CHANNEL_PORT=6123"});
  ASSERT_TRUE(alone.plan.has_value());
  EXPECT_NE(all_notices(*alone.plan).find("VLLM_NIXL_* is ignored"), std::string::npos);
  // UCX is the one backend; vLLM's placement keys are ignored with a notice.
  auto ucx = run(
      {"--kv-transfer-config", pre + "kv_both\", \"kv_buffer_device\": \"cuda\", "
                                     "\"kv_connector_extra_config\": {\"backends\": [\"UCX\"]}}"});
  ASSERT_TRUE(ucx.plan.has_value()) << ucx.plan.error().message;
  EXPECT_NE(all_notices(*ucx.plan).find("keys kv_buffer_device are ignored"), std::string::npos);

  struct Bad {
    std::string config;
    EnvList env;
    std::string says;
  };
  const Bad bad[] = {
      {pre + "decode\"}",
       {},
       "kv_role 'decode' is unknown; NixlConnector takes kv_producer, "
       "kv_consumer, kv_both"},
      {"{\"kv_connector\": \"NixlConnector\"}",
       {},
       "needs kv_role with kv_connector 'NixlConnector'"},
      {pre + "kv_both\", \"kv_connector_extra_config\": {\"backends\": [\"LIBFABRIC\"]}}",
       {},
       "backends must be [\"UCX\"]"},
      {pre + "kv_both\"}", {"VLLM_NIXL_SIDE_CHANNEL_PORT=0"}, "is not a port number"},
      {pre + "kv_both\"}", {"VLLM_NIXL_SIDE_CHANNEL_PORT=5600x"}, "is not a port number"},
      {pre + "kv_both\"}", {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT=-1"}, "positive number of seconds"},
      {"{\"kv_connector\": \"MooncakeConnector\", \"kv_role\": \"kv_both\"}",
       {},
       "'MooncakeConnector' is not available: m3serve runs OffloadingConnector, "
       "SimpleCPUOffloadConnector (the host-memory KV tier) and NixlConnector"},
  };
  for (const Bad& b : bad) {
    auto p = run({"--kv-transfer-config", b.config}, b.env);
    ASSERT_FALSE(p.plan.has_value()) << b.config;
    EXPECT_NE(p.plan.error().message.find(b.says), std::string::npos) << p.plan.error().message;
  }
}

}  // namespace
}  // namespace m3::app
