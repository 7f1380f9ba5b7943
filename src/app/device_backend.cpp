#include "app/device_backend.h"

#include <CLI/CLI.hpp>

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

void add_gemm_precision_option(CLI::App* sub, std::string& value) {
  sub->add_option("--gemm-precision", value,
                  "With --device cuda: exact (fp32 activations through a 3-term bf16 split: the "
                  "CPU reference's numbers) or bf16 (activations rounded to bf16 once: ~3x the "
                  "prefill GEMM rate, ~1e-2 logprob drift)")
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
                                                    int64_t max_model_len,
                                                    uint64_t synthetic_seed) {
  const double util = a.gpu_memory_utilization;
  M3_TRY_STATUS(runtime::check_gpu_memory_utilization(util));
  M3_TRY_STATUS(validate_parallel(a.parallel, a.device));
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
  opts.dp_kv_partitions = a.dp_kv_partitions;
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
    return engine::BackendFactory(
        [opts, dp, ep](
            std::unique_ptr<model::M3Model> host,
            int64_t /*cpu_num_pages*/) -> Result<std::unique_ptr<runtime::ForwardBackend>> {
          return runtime::make_cuda_data_parallel_backend(std::move(host), opts, dp, ep);
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
  return make_error(ErrorCode::kUnavailable,
                    "--device cuda: this m3serve was built without CUDA support; rebuild with "
                    "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu",
                    "--device");
#endif
}

}  // namespace m3::app
