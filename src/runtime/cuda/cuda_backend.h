// The GPU ForwardBackend: M3ModelCuda + KvCacheCuda on one device, its KV pool sized from the GPU
// memory left free after the weights (vLLM's --gpu-memory-utilization) or from an explicit byte
// count. Only src/app (and GPU tests) call make_cuda_backend, handing it to the engine as an
// EngineConfig::backend_factory, so the engine itself never links or includes CUDA.
// Invariant: the pool is allocated once, after the weights, and never grows.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/error.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"

namespace m3::model {
class M3ModelCuda;
}  // namespace m3::model

namespace m3::runtime {

struct CudaBackendOptions {
  int device = 0;
  // Fraction of the GPU memory free after the weights are uploaded that the KV pages may take;
  // the rest stays free for the forward's scratch (activations, logits) and the CUDA context.
  double gpu_memory_utilization = 0.9;
  // > 0: exactly this many bytes of KV pages (--kv-cache-memory-bytes), instead of the fraction.
  int64_t kv_cache_memory_bytes = 0;
  // > 0: refuse, before the pool is allocated, when one sequence of this many tokens does not
  // fit (--max-model-len; runtime/kv_budget.h).
  int64_t max_model_len = 0;
  // Seed of the weights when the host model is config-only (`--model synthetic:...,seed=S`).
  uint64_t synthetic_seed = 0;
  // --enforce-eager: never capture CUDA graphs for decode steps.
  bool enforce_eager = false;
  // > 0: one prefill step of this many tokens (capped by the pool and max_model_len) runs once
  // the pool is allocated, so the first request does not pay the scratch buffers' growth, the
  // GEMM and attention plans, or the pinned staging (serve / chat / generate: the step budget).
  int64_t warmup_tokens = 0;
  // --compilation-config cudagraph_capture_sizes: the step sizes (tokens) that replay CUDA
  // graphs (M3ModelCuda::set_graph_sizes); empty: every size up to 256.
  std::vector<int64_t> cudagraph_capture_sizes;
  // Tensor- and data-parallel ranks: replay CUDA graphs (with the NCCL collectives captured)
  // for decode steps, as one GPU does. On by default since tp_cuda_test ran TP2 and TP2 + EP
  // graphs of MoE layers at M3's shapes (synthetic:layers=4) on 2 H200s, and dp_cuda_test DP2
  // and DP2 + EP; off (or enforce_eager) runs every step of the ranks eagerly.
  bool parallel_graphs = true;
  // Attention data parallel: the page ids are one partition per rank (each rank caches only its
  // own pages, so the KV capacity is D pools; the engine's scheduler keeps a sequence inside
  // one partition, ForwardBackend::num_kv_partitions). Off: one page-id space every rank
  // allocates whole (drivers that hand out pages themselves, e.g. SequencePages in tests and
  // bench_tp).
  bool dp_kv_partitions = true;
  // Speculative decoding (single GPU): the EAGLE-3 draft (--speculative-config "model": a
  // directory, or synthetic:mha / synthetic:gqa) loaded onto the GPU right after the target, so
  // the KV pool's page count is sized for the target's page plus the draft's page (both caches
  // hold every page id) and the start-up line shows both; ForwardBackend::make_draft then hands
  // it out. Empty: a draft asked for later is loaded then, into what the pool left free.
  std::string draft_model;
  // Benchmarks only (bench/bench_tp.cpp): the TP ranks skip every collective, so a step's time
  // without communication can be set against the real one. The results are wrong; never set by
  // a serving path.
  bool skip_collectives_for_timing = false;
};

// Errors (each names the numbers and the flag to change): utilization outside (0, 1], no usable
// GPU, weights that do not fit, a KV budget smaller than one page or larger than the free memory,
// a --max-model-len whose pages do not fit in the pool. Prints one info line with the pool size in
// pages and tokens. A config-only host (M3Model::has_weights() false, i.e. a synthetic model) gets
// weights generated on the GPU from opts.synthetic_seed (M3ModelCuda::synthetic).
Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<M3Model> host,
                                                          const CudaBackendOptions& opts);

// A backend over a GPU model the caller keeps alive, on the current device, with a fresh KV cache
// for `max_total_tokens` tokens over `max_seqs` sequences (SequencePages::pages_needed): what a
// SequenceRunner drives in `generate` and the GPU tests.
std::unique_ptr<ForwardBackend> borrow_cuda_backend(model::M3ModelCuda& model,
                                                    int64_t max_total_tokens,
                                                    int64_t max_seqs = 64);

// The same for a model already on the device (tests build a synthetic one directly).
Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<model::M3ModelCuda> model,
                                                          const CudaBackendOptions& opts);

}  // namespace m3::runtime

namespace m3::runtime {

// Ok when this machine has at least `tensor_parallel_size` GPUs (one per rank); else an error
// naming both counts and --tensor-parallel-size. Cheap (no context beyond the runtime's).
Status check_tensor_parallel_devices(int tensor_parallel_size);

// Tensor parallel on GPUs 0 .. N-1 (N = tensor_parallel_size, runtime/cuda/cuda_shard_backend.cpp):
// one persistent thread per rank bound to its GPU, owning an NcclCommunicator, the rank's
// M3ModelCuda (from M3Model::make_shard of `host`; for a config-only synthetic host, the rank's
// slices of the synthetic weights generated on its GPU from opts.synthetic_seed) and a
// KvCacheCuda of the rank's KV heads; the
// pool has the same page count on every rank, the minimum of what each GPU's free memory allows
// (opts.gpu_memory_utilization or opts.kv_cache_memory_bytes, both per GPU). forward() runs every
// rank on the batch and returns rank 0's logits / device samples. N == 1 is make_cuda_backend.
// Errors (naming the flag): fewer GPUs than N, a split that does not divide the model, a
// build without NCCL, a rank's weights that do not fit its GPU, and make_cuda_backend's KV-pool
// errors.
Result<std::unique_ptr<ForwardBackend>> make_cuda_sharded_backend(std::unique_ptr<M3Model> host,
                                                                  const CudaBackendOptions& opts,
                                                                  int tensor_parallel_size,
                                                                  bool expert_parallel = false);

struct MultiNodeSpec;  // runtime/multi_node.h

// Tensor parallel over several processes (nodes.nnodes > 1, runtime/multi_node.h): node 0's
// backend for the engine. This node holds ranks [node_rank * L, (node_rank + 1) * L) of the
// tensor_parallel_size, L = size / nnodes, on its GPUs 0 .. L-1 as threads (as
// make_cuda_sharded_backend), one NCCL group over all nodes bootstrapped with rank 0's
// ncclUniqueId from the rendezvous store; the pool is the smallest page count any GPU of any node
// allows. Blocks until every node joined. Errors: make_cuda_sharded_backend's, an uneven split,
// the rendezvous' (naming the flags), a node whose model or flags differ.
Result<std::unique_ptr<ForwardBackend>> make_cuda_multi_node_backend(std::unique_ptr<M3Model> host,
                                                                     const CudaBackendOptions& opts,
                                                                     int tensor_parallel_size,
                                                                     bool expert_parallel,
                                                                     const MultiNodeSpec& nodes);
// A node R > 0 (--headless) of that group: joins, builds its ranks and runs node 0's steps until
// it shuts down (ok) or the group breaks (the error says why).
Status run_cuda_headless_node(std::unique_ptr<M3Model> host, const CudaBackendOptions& opts,
                              int tensor_parallel_size, bool expert_parallel,
                              const MultiNodeSpec& nodes);

// Ok when this machine has at least `data_parallel_size` GPUs; else an error naming both counts
// and --data-parallel-size.
Status check_data_parallel_devices(int data_parallel_size);

// Attention data parallel on GPUs 0 .. D-1 (D = data_parallel_size,
// runtime/cuda/cuda_dp_backend.cpp), the "DP + expert parallel" deployment: one persistent thread
// per rank bound to its GPU, owning an NcclCommunicator, the rank's M3ModelCuda (a data-parallel
// shard: everything whole except the routed experts, which are 1/D of each expert's intermediate,
// or with expert_parallel E/D whole experts; a config-only synthetic host generates those slices
// from opts.synthetic_seed) and a KvCacheCuda with all KV heads. forward() splits the batch on
// the host by sequence owner (runtime/dp_batch_split.h), runs every rank on its own sequences
// (a rank without any still joins every MoE layer's collectives) and merges the ranks' logits
// rows, device samples and MSA selections back into the batch's order. Every rank's cache has
// the same page count P, the smallest any GPU allows; with opts.dp_kv_partitions (default) the
// backend has D * P pages in D partitions (num_kv_partitions(); the owner of a sequence is its
// pages' partition), else P pages that every rank allocates (owner: ShardPlan::dp_owner of the
// first page). Decode steps replay CUDA graphs (opts.parallel_graphs).
// D == 1 is make_cuda_backend. Errors (naming the flag): fewer GPUs than D, a split that does not
// divide the experts, a build without NCCL, a rank's weights that do not fit its GPU, and the
// KV-pool errors of make_cuda_sharded_backend.
// moe_dispatch: model::MoeDispatch; kAuto is kAllGather here (decode steps replay CUDA graphs,
// which the all-to-all's host reads of the routing would prevent). kAllToAll is compiled and
// CPU-equivalent but has not run on GPUs yet (docs/MULTI_NODE.md).
Result<std::unique_ptr<ForwardBackend>> make_cuda_data_parallel_backend(
    std::unique_ptr<M3Model> host, const CudaBackendOptions& opts, int data_parallel_size,
    bool expert_parallel = false, model::MoeDispatch moe_dispatch = model::MoeDispatch::kAuto);

}  // namespace m3::runtime
