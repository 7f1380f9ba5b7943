// `--device cpu|cuda` and `--gpu-memory-utilization` for the commands that run the model
// (`serve`, `chat`, `generate`): registers the flags and turns them into a backend factory of the
// runtime (src/runtime). The only place a backend is chosen, so src/engine stays free of CUDA
// (tools/check_layers.py).
// Invariant: a `cuda` choice is refused here, before any model file is read, when this build has
// no CUDA or the machine has no usable GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "app/parallel_args.h"
#include "core/error.h"
#include "engine/engine.h"
#include "kernels/views.h"

namespace CLI {
class App;
}

namespace m3::app {

struct DeviceArgs {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  ParallelArgs parallel;                // --tensor-parallel-size and friends (app/parallel_args.h)
  std::string gemm_precision = "bf16";  // --gemm-precision exact|bf16 (GPU GEMMs; --dtype)
  // --kv-cache-dtype and the index-K format (--attention-config indexer_kv_dtype): auto,
  // bfloat16, fp8_e4m3 or float32 (resolve_kv_format picks auto's meaning per device).
  std::string kv_cache_dtype = "auto";
  std::string index_kv_dtype = "auto";
  bool enforce_eager = false;  // --enforce-eager: no CUDA graphs
  // CUDA-graph step sizes (--compilation-config cudagraph_capture_sizes; empty: all up to 256).
  std::vector<int64_t> cudagraph_capture_sizes;
  // Attention DP: one page-id partition per rank (the engine's scheduler keeps a sequence in
  // one); off for drivers that hand out one page-id space themselves (`generate`).
  bool dp_kv_partitions = true;
  // `serve` (the only command that takes --nnodes > 1 and --headless).
  bool serve_command = false;
};

// Registers --gemm-precision on `sub` (serve, chat and generate share it).
void add_gemm_precision_option(CLI::App* sub, std::string& value);
// Applies --gemm-precision to the GPU GEMMs (a no-op in builds without CUDA). "exact" keeps fp32
// activations exact to ~2^-24 through a 3-term bf16 split (the CPU ops' numbers, ~1/3 of the
// tensor-core rate at prefill); "bf16" rounds activations to bf16 once, as other engines do.
void apply_gemm_precision(const std::string& value);

// The KV cache's formats for these args (docs/KV_CACHE.md). auto: float32 on the CPU (the
// reference) and under --gemm-precision exact (--dtype float32), else bfloat16; the index-K's
// auto follows the KV format, except bfloat16 under an fp8 KV (vLLM keeps its indexer bf16 unless
// asked). Errors: an unknown value; fp8 on a GPU without FP8 support (compute capability < 8.9).
struct KvFormatChoice {
  kernels::KvDtype kv = kernels::KvDtype::kF32;
  kernels::KvDtype index = kernels::KvDtype::kF32;
};
Result<KvFormatChoice> resolve_kv_format(const DeviceArgs& a);
// `generate`'s own --kv-cache-dtype and --indexer-kv-dtype (serve and chat take vLLM's
// --kv-cache-dtype and --attention-config through app/vllm_flags.h).
void add_kv_dtype_options(CLI::App* sub, std::string& kv, std::string& index);

// Also registers the parallelism flags (add_parallel_options).
void add_device_options(CLI::App* sub, DeviceArgs& a);

// The factory for EngineConfig::backend_factory: empty for cpu (the engine's default), the CUDA
// backend for cuda (its KV pool from --kv-cache-memory-bytes when > 0, else from the utilization;
// max_model_len > 0 is checked against the pool before it is allocated; a synthetic model's
// weights come from synthetic_seed). Errors, one line each: utilization outside (0, 1], cuda in a
// build without CUDA, no usable GPU.
// warmup_tokens: the single-GPU backend runs one prefill step of that many tokens at start
// (runtime/cuda/cuda_backend.h; the step budget, --max-num-batched-tokens).
// draft_model: the --speculative-config draft, which the single-GPU backend loads with its KV
// pool (CudaBackendOptions::draft_model).
Result<engine::BackendFactory> make_backend_factory(
    const DeviceArgs& a, int64_t kv_cache_memory_bytes, int64_t max_model_len = 0,
    uint64_t synthetic_seed = 0, int64_t warmup_tokens = 8192, const std::string& draft_model = "");

// `serve --headless` on a node R > 0 of a group over --nnodes (runtime/multi_node.h): loads the
// model as the engine would (ec.model_dir, ec.quantization, ec.language_model_only, the KV
// formats), joins node 0 at --master-addr:--master-port, builds this node's ranks (threads over
// TCP communicators on the CPU, NCCL on GPUs) and runs node 0's steps until node 0 shuts down
// (ok) or the group breaks (the error says why). Errors also: validate_parallel's, the model's.
Status run_headless_node(const DeviceArgs& a, const engine::EngineConfig& ec,
                         int64_t kv_cache_memory_bytes, int64_t max_model_len,
                         uint64_t synthetic_seed);

}  // namespace m3::app
