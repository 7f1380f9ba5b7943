// `--device cpu|cuda` and `--gpu-memory-utilization` for the engine-backed commands (`serve`,
// `chat`): registers the flags and turns them into the engine's backend factory. The only place
// the engine's GPU backend is chosen, so src/engine stays free of CUDA (tools/check_layers.py).
// Invariant: a `cuda` choice is refused here, before any model file is read, when this build has
// no CUDA or the machine has no usable GPU.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.h"
#include "engine/engine.h"

namespace CLI {
class App;
}

namespace m3::app {

struct DeviceArgs {
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
};

void add_device_options(CLI::App* sub, DeviceArgs& a);

// The factory for EngineConfig::backend_factory: empty for cpu (the engine's default), the CUDA
// backend for cuda (its KV pool from --kv-cache-memory-bytes when > 0, else from the utilization).
// Errors, one line each: utilization outside (0, 1], cuda in a build without CUDA, no usable GPU.
Result<engine::BackendFactory> make_backend_factory(const DeviceArgs& a,
                                                    int64_t kv_cache_memory_bytes);

}  // namespace m3::app
