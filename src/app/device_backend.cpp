#include "app/device_backend.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <memory>

#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "runtime/kv_budget.h"
#ifdef M3_HAS_CUDA
#include "gpu/device.h"
#include "kernels/cuda/ops.h"
#include "runtime/cuda/cuda_backend.h"
#endif

namespace m3::app {

void add_device_options(CLI::App* sub, DeviceArgs& a) {
  sub->add_option("--device", a.device, "Where the model runs: cpu, or cuda (GPU builds)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--gpu-memory-utilization", a.gpu_memory_utilization,
                  "With --device cuda: fraction (0, 1] of the GPU memory free after the weights "
                  "that the KV cache takes (--kv-cache-memory-bytes overrides it)")
      ->capture_default_str();
  add_parallel_options(sub, a.parallel);
  add_gemm_precision_option(sub, a.gemm_precision);
  sub->add_flag(
      "--enforce-eager", a.enforce_eager,
      "With --device cuda: run every step eagerly (no CUDA graph replay of decode steps)");
}

namespace {
Result<kernels::KvDtype> kv_dtype_named(const std::string& flag, const std::string& v) {
  if (v == "float32") return kernels::KvDtype::kF32;
  if (v == "bfloat16") return kernels::KvDtype::kBf16;
  if (v == "fp8_e4m3") return kernels::KvDtype::kFp8;
  return make_error(ErrorCode::kInvalidArgument,
                    flag + " '" + v + "' is unknown; accepted: auto, bfloat16, fp8, float32", flag);
}
}  // namespace

Result<KvFormatChoice> resolve_kv_format(const DeviceArgs& a) {
  const bool gpu = a.device == "cuda";
  const kernels::KvDtype automatic =
      gpu && a.gemm_precision != "exact" ? kernels::KvDtype::kBf16 : kernels::KvDtype::kF32;
  KvFormatChoice c;
  if (a.kv_cache_dtype == "auto") {
    c.kv = automatic;
  } else {
    M3_TRY(c.kv, kv_dtype_named("--kv-cache-dtype", a.kv_cache_dtype));
  }
  if (a.index_kv_dtype == "auto") {
    c.index = c.kv == kernels::KvDtype::kFp8 ? kernels::KvDtype::kBf16 : c.kv;
  } else {
    M3_TRY(c.index, kv_dtype_named("--attention-config indexer_kv_dtype", a.index_kv_dtype));
  }
#ifdef M3_HAS_CUDA
  if (gpu && (c.kv == kernels::KvDtype::kFp8 || c.index == kernels::KvDtype::kFp8)) {
    auto info = gpu::probe_device(0);
    if (info && (info->cc_major * 10 + info->cc_minor) < 89) {
      return make_error(ErrorCode::kUnsupported,
                        "an fp8 KV cache needs FP8 support (compute capability 8.9 or newer: "
                        "Ada, Hopper, Blackwell); " +
                            info->name + " is " + std::to_string(info->cc_major) + "." +
                            std::to_string(info->cc_minor) + ": use --kv-cache-dtype bfloat16",
                        "--kv-cache-dtype");
    }
  }
#endif
  return c;
}

void add_kv_dtype_options(CLI::App* sub, std::string& kv, std::string& index) {
  const auto canonical = [](std::string v) -> std::string {
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (v == "bf16") return "bfloat16";
    if (v == "fp8") return "fp8_e4m3";
    if (v == "fp32") return "float32";
    return v;
  };
  const auto check = CLI::IsMember({"auto", "bfloat16", "fp8_e4m3", "float32"});
  sub->add_option("--kv-cache-dtype", kv,
                  "KV cache format: auto (bfloat16 on the GPU, float32 under --gemm-precision "
                  "exact and on the CPU), bfloat16, fp8 (fp8_e4m3), float32 (docs/KV_CACHE.md)")
      ->transform(canonical)
      ->check(check)
      ->capture_default_str();
  sub->add_option("--indexer-kv-dtype", index,
                  "MSA index-K cache format: auto (the KV format; bfloat16 under an fp8 KV), "
                  "bfloat16, fp8, float32")
      ->transform(canonical)
      ->check(check)
      ->capture_default_str();
}

void add_gemm_precision_option(CLI::App* sub, std::string& value) {
  sub->add_option("--gemm-precision", value,
                  "With --device cuda: bf16 (the default, as --dtype auto / bfloat16: "
                  "activations rounded to bf16 once at each GEMM, as other engines do) or exact "
                  "(--dtype float32, the oracle mode: fp32 activations through a 3-term bf16 "
                  "split, the CPU reference's numbers, ~1/3 of the prefill GEMM rate)")
      ->check(CLI::IsMember({"exact", "bf16"}))
      ->capture_default_str();
}

void apply_gemm_precision(const std::string& value) {
#ifdef M3_HAS_CUDA
  kernels::cuda::set_gemm_precision(value == "bf16" ? kernels::cuda::GemmPrecision::kBf16
                                                    : kernels::cuda::GemmPrecision::kExact);
#else
  (void)value;
#endif
}

Result<engine::BackendFactory> make_backend_factory(const DeviceArgs& a,
                                                    int64_t kv_cache_memory_bytes,
                                                    int64_t max_model_len, uint64_t synthetic_seed,
                                                    int64_t warmup_tokens,
                                                    const std::string& draft_model) {
  const double util = a.gpu_memory_utilization;
  M3_TRY_STATUS(runtime::check_gpu_memory_utilization(util));
  M3_TRY_STATUS(validate_parallel(a.parallel, a.device, a.serve_command));
  // cpu: the engine's default backend, or the tensor-parallel one.
  if (a.device == "cpu")
    return wrap_backend_factory(a.parallel, engine::BackendFactory{}, a.dp_kv_partitions);
  if (a.device != "cuda") {
    return make_error(ErrorCode::kInvalidArgument,
                      "--device '" + a.device + "' is unknown; use cpu or cuda", "--device");
  }
#ifdef M3_HAS_CUDA
  apply_gemm_precision(a.gemm_precision);
  // Probe before the checkpoint is read: a machine without a GPU fails in milliseconds.
  auto probe = gpu::probe_device(0);
  if (!probe) {
    return make_error(ErrorCode::kUnavailable, "--device cuda: " + probe.error().message,
                      "--device");
  }
  runtime::CudaBackendOptions opts;
  opts.device = 0;
  opts.gpu_memory_utilization = util;
  opts.kv_cache_memory_bytes = kv_cache_memory_bytes;
  opts.max_model_len = max_model_len;
  opts.synthetic_seed = synthetic_seed;
  opts.enforce_eager = a.enforce_eager;
  opts.cudagraph_capture_sizes = a.cudagraph_capture_sizes;
  opts.dp_kv_partitions = a.dp_kv_partitions;
  opts.warmup_tokens = warmup_tokens;
  opts.draft_model = draft_model;
  if (a.parallel.nnodes > 1) {
    // Node 0 of tensor parallel over processes (validate_parallel: TP only, even split): this
    // node's tp / nnodes ranks on its GPUs, one NCCL group over all nodes.
    const int tp = a.parallel.tensor_parallel_size;
    const bool ep = a.parallel.enable_expert_parallel;
    const runtime::MultiNodeSpec nodes = multi_node_spec(a.parallel);
    M3_TRY_STATUS(runtime::check_tensor_parallel_devices(tp / nodes.nnodes));
    return engine::BackendFactory(
        [opts, tp, ep, nodes](
            std::unique_ptr<model::M3Model> host,
            int64_t /*cpu_num_pages*/) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
          return runtime::make_cuda_multi_node_backend(std::move(host), opts, tp, ep, nodes);
        });
  }
  if (a.parallel.tensor_parallel_size > 1) {
    // One GPU per rank: refuse a size above the GPU count before the checkpoint is read.
    const int tp = a.parallel.tensor_parallel_size;
    M3_TRY_STATUS(runtime::check_tensor_parallel_devices(tp));
    const bool ep = a.parallel.enable_expert_parallel;
    return engine::BackendFactory(
        [opts, tp, ep](
            std::unique_ptr<model::M3Model> host,
            int64_t /*cpu_num_pages*/) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
          return runtime::make_cuda_sharded_backend(std::move(host), opts, tp, ep);
        });
  }
  if (a.parallel.data_parallel_size > 1) {
    // Attention data parallel, one GPU per rank (validate_parallel refused DP with TP > 1).
    const int dp = a.parallel.data_parallel_size;
    M3_TRY_STATUS(runtime::check_data_parallel_devices(dp));
    const bool ep = a.parallel.enable_expert_parallel;
    const model::MoeDispatch dispatch =  // validate_parallel checked it
        model::parse_moe_dispatch(a.parallel.moe_dispatch).value_or(model::MoeDispatch::kAuto);
    return engine::BackendFactory(
        [opts, dp, ep, dispatch](
            std::unique_ptr<model::M3Model> host,
            int64_t /*cpu_num_pages*/) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
          return runtime::make_cuda_data_parallel_backend(std::move(host), opts, dp, ep, dispatch);
        });
  }
  return engine::BackendFactory(
      [opts](std::unique_ptr<model::M3Model> host,
             int64_t /*cpu_num_pages: the GPU pool is sized from GPU memory*/)
          -> Result<std::unique_ptr<runtime::ForwardBackend>> {
        return runtime::make_cuda_backend(std::move(host), opts);
      });
#else
  (void)kv_cache_memory_bytes;
  (void)max_model_len;
  (void)synthetic_seed;
  (void)warmup_tokens;
  (void)draft_model;
  return make_error(ErrorCode::kUnavailable,
                    "--device cuda: this m3serve was built without CUDA support; rebuild with "
                    "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu",
                    "--device");
#endif
}

Status run_headless_node(const DeviceArgs& a, const engine::EngineConfig& ec,
                         int64_t kv_cache_memory_bytes, int64_t max_model_len,
                         uint64_t synthetic_seed) {
  M3_TRY_STATUS(validate_parallel(a.parallel, a.device, /*serve_command=*/true));
  M3_CHECK(a.parallel.headless && a.parallel.nnodes > 1 && a.parallel.node_rank > 0);
  if (a.device != "cpu" && a.device != "cuda") {
    return make_error(ErrorCode::kInvalidArgument,
                      "--device '" + a.device + "' is unknown; use cpu or cuda", "--device");
  }
#ifdef M3_HAS_CUDA
  runtime::CudaBackendOptions opts;
  if (a.device == "cuda") {
    M3_TRY_STATUS(runtime::check_gpu_memory_utilization(a.gpu_memory_utilization));
    apply_gemm_precision(a.gemm_precision);
    auto probe = gpu::probe_device(0);
    if (!probe) {
      return make_error(ErrorCode::kUnavailable, "--device cuda: " + probe.error().message,
                        "--device");
    }
    M3_TRY_STATUS(runtime::check_tensor_parallel_devices(a.parallel.tensor_parallel_size /
                                                         a.parallel.nnodes));
    opts.gpu_memory_utilization = a.gpu_memory_utilization;
    opts.kv_cache_memory_bytes = kv_cache_memory_bytes;
    opts.max_model_len = max_model_len;
    opts.synthetic_seed = synthetic_seed;
    opts.enforce_eager = a.enforce_eager;
    opts.cudagraph_capture_sizes = a.cudagraph_capture_sizes;
  }
#else
  (void)kv_cache_memory_bytes;
  (void)max_model_len;
  (void)synthetic_seed;
  if (a.device == "cuda") {
    return make_error(ErrorCode::kUnavailable,
                      "--device cuda: this m3serve was built without CUDA support; rebuild with "
                      "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu",
                      "--device");
  }
#endif
  model::LoadOptions lo;
  lo.language_model_only = ec.language_model_only;
  lo.quantization = ec.quantization;
  M3_TRY(auto model, model::M3Model::load(ec.model_dir, lo));
  model->set_kv_cache_format(ec.kv_cache_dtype, ec.index_cache_dtype);
  const runtime::MultiNodeSpec nodes = multi_node_spec(a.parallel);
  const int tp = a.parallel.tensor_parallel_size;
  const bool ep = a.parallel.enable_expert_parallel;
#ifdef M3_HAS_CUDA
  if (a.device == "cuda")
    return runtime::run_cuda_headless_node(std::move(model), opts, tp, ep, nodes);
#endif
  return runtime::run_cpu_headless_node(std::move(model), tp, ep, nodes);
}

}  // namespace m3::app
