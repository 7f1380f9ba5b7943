// The pieces the multi-GPU backends share (tensor parallel: cuda_shard_backend.cpp, attention
// data parallel: cuda_dp_backend.cpp): counting the GPUs, starting one NCCL rank per GPU on its
// own thread, the persistent per-rank threads a step is handed to, and the KV pool's page count
// over all ranks' GPUs. Internal to model/cuda: only those two files include it.
// Invariant: rank r runs on GPU r, always on the same thread; every object of rank r is created
// and released with GPU r current.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/m3_model.h"
#include "model/shard.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/rank_threads.h"
#ifdef M3_HAS_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace m3::runtime::rank_group {

using model::KvCacheCuda;
using model::M3ModelCuda;
using model::ShardSpec;

// CUDA devices visible to this process (0 when the runtime finds none or fails).
int visible_gpu_count();

// Ok when `ranks` GPUs are visible (one per rank); else an error naming `flag`, both counts and
// the largest size that fits, then `also` (another way out, e.g. ", or --device cpu").
Status check_gpus_for_ranks(int ranks, const std::string& flag, const std::string& also = "");

// The group size and the memory fraction both backends take: ranks >= 1 (else an error naming
// `flag`) and opts.gpu_memory_utilization in (0, 1].
Status check_group_args(int ranks, const std::string& flag, const CudaBackendOptions& opts);

// "12.3 MiB", for the pool's log lines and errors.
std::string mib(double bytes);

// The per-rank threads (model/rank_threads.h), thread r bound to GPU r.
RankThreads gpu_rank_threads(int world);

// The KV pool of a group: the same page count on every rank (the scheduler hands out one set of
// page ids), the smallest any GPU allows.
struct RankPool {
  int64_t num_pages = 0;
  std::string where;     // "cuda:0-1 (2x NAME, <mode>, NCCL)": the backend's device_name()
  std::string sized_by;  // what bounded the page count, for the log line
  std::string flag;      // --kv-cache-memory-bytes or --gpu-memory-utilization
  int64_t page_bytes = 0;
};
// From each GPU's free memory now (after the weights) x opts.gpu_memory_utilization, or
// opts.kv_cache_memory_bytes per GPU; `page_bytes` is one page of one rank's cache and `mode`
// names the split in `where` (e.g. "tensor parallel 2"). Checks opts.max_model_len against the
// pool. Errors (naming the flag): an explicit budget above a GPU's free memory, no page fitting,
// a --max-model-len that does not fit.
Result<RankPool> size_rank_pool(const M3Config& cfg, int64_t page_bytes,
                                const CudaBackendOptions& opts, int world, const std::string& mode);
// The start-up line of the pool: pages per GPU, what sized it, tokens.
void log_rank_pool(const M3Config& cfg, const RankPool& pool);

#ifdef M3_HAS_NCCL
struct CudaRank {
  std::unique_ptr<dist::NcclCommunicator> comm;
  std::unique_ptr<M3ModelCuda> model;
  std::unique_ptr<KvCacheCuda> cache;
};

// Releases each rank's cache, model and communicator (in that order) with its GPU current.
void release_ranks(std::vector<CudaRank>& ranks);

// Rank rank.comm->rank()'s model (spec: the rank's ShardSpec without its communicator): its shard
// of `whole` uploaded to its GPU (rank.comm->device()), or for a config-only (synthetic) `whole`
// its slices generated there from opts.synthetic_seed; CUDA graphs off when opts.enforce_eager or
// !parallel_graphs, and skip_collectives_for_timing applied. Errors: the shard's or the upload's.
Status make_rank_model(const M3Model& whole, ShardSpec spec, const CudaBackendOptions& opts,
                       CudaRank& rank);

// Starts `world` ranks, each on a thread of its own bound to GPU r: joins the NCCL group
// (ncclCommInitRank blocks until every rank has) and then calls build(r, rank) to make the rank's
// model (rank.comm is set; build fills rank.model). Returns the first rank's error, with every
// rank made so far released; the caller sizes the pool and makes the caches afterwards.
Result<std::vector<CudaRank>> start_nccl_ranks(
    int world, const std::function<Status(int r, CudaRank& rank)>& build);
// The same for this process's `local` ranks [first, first + local) of a group of `world` over
// several processes that share `id` (rank 0's, handed out by the rendezvous store): local rank l
// runs on GPU l as global rank first + l; build(l, rank) as above.
Result<std::vector<CudaRank>> start_nccl_ranks(
    int local, int world, int first, const ncclUniqueId& id,
    const std::function<Status(int l, CudaRank& rank)>& build);
#endif

}  // namespace m3::runtime::rank_group
