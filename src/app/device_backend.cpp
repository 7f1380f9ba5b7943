#include "app/device_backend.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

#include "model/forward_backend.h"
#include "model/m3_model.h"
#ifdef M3_HAS_CUDA
#include "gpu/device.h"
#include "model/cuda/cuda_backend.h"
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
}

Result<engine::BackendFactory> make_backend_factory(const DeviceArgs& a,
                                                    int64_t kv_cache_memory_bytes) {
  const double util = a.gpu_memory_utilization;
  if (!(util > 0.0 && util <= 1.0)) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "--gpu-memory-utilization %g is outside (0, 1]; give a fraction such as 0.9",
                  util);
    return make_error(ErrorCode::kInvalidArgument, buf, "--gpu-memory-utilization");
  }
  if (a.device == "cpu") return engine::BackendFactory{};
  if (a.device != "cuda") {
    return make_error(ErrorCode::kInvalidArgument,
                      "--device '" + a.device + "' is unknown; use cpu or cuda", "--device");
  }
#ifdef M3_HAS_CUDA
  // Probe before the checkpoint is read: a machine without a GPU fails in milliseconds.
  auto probe = gpu::probe_device(0);
  if (!probe) {
    return make_error(ErrorCode::kUnavailable,
                      "--device cuda: " + probe.error().message, "--device");
  }
  model::CudaBackendOptions opts;
  opts.device = 0;
  opts.gpu_memory_utilization = util;
  opts.kv_cache_memory_bytes = kv_cache_memory_bytes;
  return engine::BackendFactory(
      [opts](std::unique_ptr<model::M3Model> host,
             int64_t /*cpu_num_pages: the GPU pool is sized from GPU memory*/)
          -> Result<std::unique_ptr<model::ForwardBackend>> {
        return model::make_cuda_backend(std::move(host), opts);
      });
#else
  (void)kv_cache_memory_bytes;
  return make_error(ErrorCode::kUnavailable,
                    "--device cuda: this m3serve was built without CUDA support; rebuild with "
                    "-DM3_CUDA=ON on a machine with the CUDA toolkit, or use --device cpu",
                    "--device");
#endif
}

}  // namespace m3::app
