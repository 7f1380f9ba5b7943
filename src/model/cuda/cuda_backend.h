// The GPU ForwardBackend: M3ModelCuda + KvCacheCuda on one device, its KV pool sized from the GPU
// memory left free after the weights (vLLM's --gpu-memory-utilization) or from an explicit byte
// count. Only src/app (and GPU tests) call make_cuda_backend, handing it to the engine as an
// EngineConfig::backend_factory, so the engine itself never links or includes CUDA.
// Invariant: the pool is allocated once, after the weights, and never grows.
#pragma once

#include <cstdint>
#include <memory>

#include "core/error.h"
#include "model/forward_backend.h"
#include "model/m3_model.h"

namespace m3::model {

struct CudaBackendOptions {
  int device = 0;
  // Fraction of the GPU memory free after the weights are uploaded that the KV pages may take;
  // the rest stays free for the forward's scratch (activations, logits) and the CUDA context.
  double gpu_memory_utilization = 0.9;
  // > 0: exactly this many bytes of KV pages (--kv-cache-memory-bytes), instead of the fraction.
  int64_t kv_cache_memory_bytes = 0;
  // > 0: refuse, before the pool is allocated, when one sequence of this many tokens does not
  // fit (--max-model-len; model/kv_budget.h).
  int64_t max_model_len = 0;
  // Seed of the weights when the host model is config-only (`--model synthetic:...,seed=S`).
  uint64_t synthetic_seed = 0;
  // --enforce-eager: never capture CUDA graphs for decode steps.
  bool enforce_eager = false;
};

// Errors (each names the numbers and the flag to change): utilization outside (0, 1], no usable
// GPU, weights that do not fit, a KV budget smaller than one page or larger than the free memory,
// a --max-model-len whose pages do not fit in the pool. Prints one info line with the pool size in
// pages and tokens. A config-only host (M3Model::has_weights() false, i.e. a synthetic model) gets
// weights generated on the GPU from opts.synthetic_seed (M3ModelCuda::synthetic).
Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<M3Model> host,
                                                          const CudaBackendOptions& opts);

class M3ModelCuda;
// The same for a model already on the device (tests build a synthetic one directly).
Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<M3ModelCuda> model,
                                                          const CudaBackendOptions& opts);

}  // namespace m3::model
