// rank_group.h: GPU counting, the NCCL ranks' start-up, per-rank threads and the group's KV pool
// (moved out of cuda_shard_backend.cpp so the data-parallel backend reuses them).
#include "runtime/cuda/rank_group.h"

#include <algorithm>
#include <climits>
#include <cstdio>

#include "core/check.h"
#include "core/env.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "runtime/kv_budget.h"

namespace m3::runtime::rank_group {

using namespace m3::model;  // the model this runtime runs

int visible_gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it so later probes start clean
    count = 0;
  }
  return count;
}

Status check_gpus_for_ranks(int ranks, const std::string& flag, const std::string& also) {
  const int count = visible_gpu_count();
  if (ranks <= count) return {};
  return make_error(ErrorCode::kInvalidArgument,
                    flag + " " + std::to_string(ranks) + " needs " + std::to_string(ranks) +
                        " GPUs (one per rank) but this machine has " + std::to_string(count) +
                        " visible; use " + flag + " " + std::to_string(std::max(count, 1)) +
                        " or fewer" + also,
                    flag);
}

Status check_group_args(int ranks, const std::string& flag, const CudaBackendOptions& opts) {
  if (ranks < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      flag + " must be >= 1, got " + std::to_string(ranks), flag);
  }
  return check_gpu_memory_utilization(opts.gpu_memory_utilization);
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
  return buf;
}

RankThreads gpu_rank_threads(int world) {
  return RankThreads(world, [](int r) { M3_CUDA_CHECK(cudaSetDevice(r)); });  // rank r: GPU r
}

Result<RankPool> size_rank_pool(const M3Config& cfg, int64_t page_bytes,
                                const CudaBackendOptions& opts, int world,
                                const std::string& mode) {
  const double util = opts.gpu_memory_utilization;
  const bool explicit_bytes = opts.kv_cache_memory_bytes > 0;
  RankPool pool;
  pool.flag = explicit_bytes ? "--kv-cache-memory-bytes" : "--gpu-memory-utilization";
  int64_t num_pages = INT32_MAX;
  std::string gpu_name;
  for (int r = 0; r < world; ++r) {
    M3_TRY(gpu::DeviceInfo info, gpu::probe_device(r));
    const double free_bytes = static_cast<double>(info.free_bytes);
    const double budget =
        explicit_bytes ? static_cast<double>(opts.kv_cache_memory_bytes) : free_bytes * util;
    if (explicit_bytes && budget > free_bytes) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--kv-cache-memory-bytes asks for " + mib(budget) +
                            " of KV cache per GPU but cuda:" + std::to_string(r) + " has " +
                            mib(free_bytes) +
                            " free after its shard of the weights; lower "
                            "--kv-cache-memory-bytes",
                        pool.flag);
    }
    const int64_t pages = static_cast<int64_t>(budget / static_cast<double>(page_bytes));
    if (pages < num_pages) {
      num_pages = pages;
      pool.sized_by = explicit_bytes ? "--kv-cache-memory-bytes " + mib(budget) + " per GPU"
                                     : mib(free_bytes) + " free on cuda:" + std::to_string(r) +
                                           " after its shard x " + std::to_string(util);
    }
    gpu_name = info.name;
  }
  pool.where = "cuda:0-" + std::to_string(world - 1) + " (" + std::to_string(world) + "x " +
               gpu_name + ", " + mode + ", NCCL)";
  if (num_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "no KV page fits on every GPU of " + pool.where + ": " + pool.sized_by +
                          ", but one page (" + std::to_string(cfg.sparse_block_size) +
                          " tokens, this rank's KV heads) needs " +
                          mib(static_cast<double>(page_bytes)) + "; raise " + pool.flag +
                          " or free GPU memory",
                      pool.flag);
  }
  pool.num_pages = num_pages;
  KvPoolFacts facts;
  facts.num_pages = num_pages;
  facts.page_size = cfg.sparse_block_size;
  facts.page_bytes = page_bytes;
  facts.where = pool.where;
  facts.sized_by = pool.sized_by;
  facts.flag = pool.flag;
  M3_TRY_STATUS(check_max_model_len_fits(opts.max_model_len, facts));
  pool.page_bytes = page_bytes;
  return pool;
}

void log_rank_pool(const M3Config& cfg, const RankPool& pool) {
  M3_LOG_INFO("KV cache on %s: %lld pages of %s per GPU (%s) = %lld tokens", pool.where.c_str(),
              static_cast<long long>(pool.num_pages),
              mib(static_cast<double>(pool.page_bytes)).c_str(), pool.sized_by.c_str(),
              static_cast<long long>(pool.num_pages * cfg.sparse_block_size));
}

#ifdef M3_HAS_NCCL
void release_ranks(std::vector<CudaRank>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    cudaSetDevice(static_cast<int>(r));
    ranks[r].cache.reset();
    ranks[r].model.reset();
    ranks[r].comm.reset();
  }
}

Status make_rank_model(const M3Model& whole, ShardSpec spec, const CudaBackendOptions& opts,
                       CudaRank& rank) {
  spec.comm = rank.comm.get();
  const int r = rank.comm->device();  // the global rank is spec.rank; over nodes they differ
  Result<std::unique_ptr<M3ModelCuda>> model = tl::unexpected(Error{});
  if (!whole.has_weights()) {
    M3_TRY(ShardPlan plan, make_shard_plan(whole.config(), spec));
    // A stored format (whole.synthetic_weights()) is generated unsharded only: synthetic()
    // refuses it for a sharded plan with the reason.
    model = M3ModelCuda::synthetic(whole.config(), opts.synthetic_seed, r, &plan, rank.comm.get(),
                                   rank.comm->stream(), whole.synthetic_weights());
  } else {
    M3_TRY(auto shard, whole.make_shard(spec));
    model = M3ModelCuda::from_host(std::move(shard), r, rank.comm.get(), rank.comm->stream());
  }
  if (!model) return tl::unexpected(model.error());
  rank.model = std::move(*model);
  if (opts.enforce_eager || !opts.parallel_graphs) rank.model->set_use_graphs(false);
  if (!opts.cudagraph_capture_sizes.empty())
    rank.model->set_graph_sizes(opts.cudagraph_capture_sizes);
  rank.model->set_skip_collectives_for_timing(opts.skip_collectives_for_timing);
  return {};
}

Result<std::vector<CudaRank>> start_nccl_ranks(
    int world, const std::function<Status(int r, CudaRank& rank)>& build) {
  M3_TRY(ncclUniqueId id, dist::make_nccl_unique_id());
  return start_nccl_ranks(world, world, 0, id, build);
}

// Decode's all-reduces are [batch, hidden]: up to 64 rows of M3's 6144 go one-shot.
constexpr int64_t kOneShotMaxFloats = 64 * 6144;

Result<std::vector<CudaRank>> start_nccl_ranks(
    int local, int world, int first, const ncclUniqueId& id,
    const std::function<Status(int l, CudaRank& rank)>& build) {
  std::vector<CudaRank> ranks(local);
  std::vector<Status> status(local);
  // The one-shot all-reduce for decode-sized vectors among this process's GPUs (opt-in until it
  // is measured against NCCL on several GPUs: docs/MULTI_NODE.md 1b).
  std::shared_ptr<const dist::OneShotGroup> one_shot;
  if (local == world && world > 1 && env_switch("M3_ONE_SHOT_ALL_REDUCE", false)) {
    std::vector<int> devices(local);
    for (int r = 0; r < local; ++r) devices[r] = r;
    auto g = dist::OneShotGroup::create(devices, kOneShotMaxFloats);
    if (g) {
      one_shot = std::move(*g);
      M3_LOG_INFO(
          "one-shot all-reduce on for vectors of up to %lld floats (M3_ONE_SHOT_ALL_REDUCE)",
          static_cast<long long>(kOneShotMaxFloats));
    } else {
      M3_LOG_WARN("M3_ONE_SHOT_ALL_REDUCE=1 is ignored: %s", g.error().message.c_str());
    }
  }
  {
    std::vector<std::thread> init;
    for (int r = 0; r < local; ++r) {
      init.emplace_back([&, r] {
        auto comm = dist::NcclCommunicator::create(first + r, world, r, id);
        if (!comm) {
          status[r] = tl::unexpected(comm.error());
          return;
        }
        ranks[r].comm = std::move(*comm);
        ranks[r].comm->attach_one_shot(one_shot);
        status[r] = build(r, ranks[r]);
      });
    }
    for (auto& t : init) t.join();
  }
  for (int r = 0; r < local; ++r) {
    if (!status[r]) {
      release_ranks(ranks);
      return tl::unexpected(status[r].error());
    }
  }
  return ranks;
}
#endif

}  // namespace m3::runtime::rank_group
