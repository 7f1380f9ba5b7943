// make_cuda_sharded_backend (runtime/cuda/cuda_backend.h): N tensor-parallel ranks, one GPU each,
// as persistent threads of this process over NCCL (runtime/cuda/rank_group.h: the group's start-up,
// the rank threads, the pool). Each thread binds its device once, so the engine thread never
// changes its own current device; a step costs two condition-variable handoffs. Every rank runs
// M3ModelCuda::forward on the same batch (the collectives pair up); rank 0's logits / samples
// are returned, the others compute them and drop them.
#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/kv_cache.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/rank_group.h"
#include "runtime/multi_node.h"
#ifdef M3_HAS_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

Status check_tensor_parallel_devices(int tp) {
  return rank_group::check_gpus_for_ranks(tp, "--tensor-parallel-size");
}

#ifdef M3_HAS_NCCL
namespace {

using rank_group::CudaRank;

class ShardedCudaBackend final : public ForwardBackend {
 public:
  ShardedCudaBackend(std::vector<CudaRank> ranks, std::string name, std::string flag)
      : ranks_(std::move(ranks)),
        name_(std::move(name)),
        flag_(std::move(flag)),
        threads_(rank_group::gpu_rank_threads(static_cast<int>(ranks_.size()))) {}
  ~ShardedCudaBackend() override {
    threads_.stop();
    rank_group::release_ranks(ranks_);  // each rank's objects with its device current
  }

  const M3Config& config() const override { return ranks_[0].model->config(); }
  int64_t num_pages() const override { return ranks_[0].cache->num_pages(); }
  bool samples_on_device() const override { return true; }
  std::string device_name() const override { return name_; }
  std::string image_refusal() const override {
    return "the tensor-parallel GPU backend (--tensor-parallel-size above 1) does not run the "
           "vision tower; serve images on one GPU (drop --tensor-parallel-size) or on the CPU "
           "backend (--device cpu)";
  }
  std::string kv_cache_flag() const override { return flag_; }

  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    // Every rank runs the whole batch on its thread (model/rank_threads.h); rank 0 fills out.
    threads_.run([&](int r) {
      ranks_[r].model->forward(batch, *ranks_[r].cache, r == 0 ? out : nullptr, capture_msa);
    });
  }

 private:
  std::vector<CudaRank> ranks_;
  std::string name_, flag_;
  RankThreads threads_;  // last: its threads start once the ranks exist
};

}  // namespace
#endif  // M3_HAS_NCCL

Result<std::unique_ptr<ForwardBackend>> make_cuda_sharded_backend(std::unique_ptr<M3Model> host,
                                                                  const CudaBackendOptions& opts,
                                                                  int tp, bool expert_parallel) {
  M3_CHECK(host != nullptr);
  M3_TRY_STATUS(rank_group::check_group_args(tp, "--tensor-parallel-size", opts));
  if (tp == 1) return make_cuda_backend(std::move(host), opts);  // EP over one rank: whole model
  M3_TRY_STATUS(check_tensor_parallel_devices(tp));
  // A config-only host (`--model synthetic:...`): each rank generates its own slices of the
  // synthetic weights on its GPU (M3ModelCuda::synthetic with the rank's plan).
  const bool synthetic = !host->has_weights();
  const M3Config cfg = host->config();
  // Check the split once, without a group, so a bad size fails before any thread starts.
  ShardSpec probe;
  probe.world = tp;
  probe.expert_parallel = expert_parallel;
  M3_TRY(ShardPlan plan0, make_shard_plan(cfg, probe));
#ifndef M3_HAS_NCCL
  (void)plan0;
  (void)synthetic;
  return make_error(ErrorCode::kUnavailable,
                    "--tensor-parallel-size " + std::to_string(tp) +
                        " with --device cuda needs NCCL, and this m3serve was built without it "
                        "(install libnccl-dev and rebuild), or use --device cpu",
                    "--tensor-parallel-size");
#else
  // Every rank joins the group and uploads (or, synthetic, generates) its shard on its own thread
  // (rank_group::start_nccl_ranks); the shards share the host weights (make_shard is const).
  std::shared_ptr<const M3Model> whole(std::move(host));
  auto build = [&](int r, CudaRank& rank) -> Status {
    ShardSpec spec;
    spec.rank = r;
    spec.world = tp;
    spec.expert_parallel = expert_parallel;  // whole experts per rank, picks remapped
    return rank_group::make_rank_model(*whole, spec, opts, rank);
  };
  M3_TRY(std::vector<CudaRank> ranks, rank_group::start_nccl_ranks(tp, build));
  whole.reset();
  // On an error return, each rank's objects are released with its device current.
  struct Release {
    std::vector<CudaRank>* ranks;
    ~Release() {
      if (ranks != nullptr) rank_group::release_ranks(*ranks);
    }
  } release{&ranks};
  // The pool: the same page count on every rank (the scheduler hands out one set of page ids),
  // the smallest any GPU allows (rank_group::size_rank_pool).
  const int64_t page_bytes = KvCache::page_bytes(cfg, plan0.num_kv_heads);
  M3_TRY(rank_group::RankPool pool,
         rank_group::size_rank_pool(cfg, page_bytes, opts, tp,
                                    "tensor parallel " + std::to_string(tp)));
  M3_LOG_INFO("%s", plan0.describe(cfg).c_str());
  if (synthetic) {
    M3_LOG_INFO("synthetic weights: %.2f GiB per GPU generated from seed %llu",
                static_cast<double>(ranks[0].model->weight_bytes()) / (1 << 30),
                static_cast<unsigned long long>(opts.synthetic_seed));
  }
  rank_group::log_rank_pool(cfg, pool);
  for (int r = 0; r < tp; ++r) {
    M3_CUDA_CHECK(cudaSetDevice(r));
    ranks[r].cache = std::make_unique<KvCacheCuda>(cfg, pool.num_pages,
                                                   ranks[r].model->shard_plan().num_kv_heads);
  }
  release.ranks = nullptr;
  return std::unique_ptr<ForwardBackend>(
      new ShardedCudaBackend(std::move(ranks), pool.where, pool.flag));
#endif
}

}  // namespace m3::runtime

namespace m3::runtime {

namespace {

#ifdef M3_HAS_NCCL
// This node's ranks of a tensor-parallel group over nodes (cuda_backend.h
// make_cuda_multi_node_backend): the rendezvous, rank 0's NCCL id through the store, the local
// ranks on GPUs 0 .. L-1, the pool agreed over all nodes.
struct CudaNodeRanks {
  std::unique_ptr<NodeGroup> group;
  std::unique_ptr<ForwardBackend> backend;
};
Result<CudaNodeRanks> make_cuda_node_ranks(std::unique_ptr<M3Model> host,
                                           const CudaBackendOptions& opts, int tp, bool ep,
                                           const MultiNodeSpec& nodes) {
  const std::string flag = "--tensor-parallel-size";
  M3_TRY_STATUS(rank_group::check_group_args(tp, flag, opts));
  M3_TRY_STATUS(check_node_split(tp, nodes, flag));
  const int local = tp / nodes.nnodes;
  const int first = nodes.node_rank * local;
  M3_TRY_STATUS(rank_group::check_gpus_for_ranks(
      local, flag, " per node (this node holds --tensor-parallel-size / --nnodes ranks)"));
  const M3Config cfg = host->config();
  ShardSpec probe;
  probe.world = tp;
  probe.expert_parallel = ep;
  M3_TRY(ShardPlan plan0, make_shard_plan(cfg, probe));
  const std::string layout =
      std::string("cuda | ") + cfg.summary() + " | KV " +
      kernels::kv_dtype_name(cfg.kv_cache_dtype) + ", index-K " +
      kernels::kv_dtype_name(cfg.index_cache_dtype) + " | tensor parallel " + std::to_string(tp) +
      (ep ? " + expert parallel" : "") + " over " + std::to_string(nodes.nnodes) + " nodes" +
      (host->has_weights() ? "" : " | synthetic seed " + std::to_string(opts.synthetic_seed));
  CudaNodeRanks out;
  M3_TRY(out.group, NodeGroup::join(nodes, layout));
  // Rank 0 makes the NCCL id; the store hands its 128 bytes to every other node.
  ncclUniqueId id;
  if (nodes.node_rank == 0) {
    M3_TRY(id, dist::make_nccl_unique_id());
    M3_TRY_STATUS(out.group->store().set(
        "m3/nccl_id", std::string(reinterpret_cast<const char*>(&id), sizeof id)));
  } else {
    M3_TRY(std::string bytes, out.group->store().get("m3/nccl_id"));
    if (bytes.size() != sizeof id)
      return make_error(ErrorCode::kFormat, "node 0's NCCL id has " + std::to_string(bytes.size()) +
                                                " bytes, not " + std::to_string(sizeof id));
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  std::shared_ptr<const M3Model> whole(std::move(host));
  auto build = [&](int l, rank_group::CudaRank& rank) -> Status {
    ShardSpec spec;
    spec.rank = first + l;
    spec.world = tp;
    spec.expert_parallel = ep;
    return rank_group::make_rank_model(*whole, spec, opts, rank);
  };
  M3_TRY(std::vector<rank_group::CudaRank> ranks,
         rank_group::start_nccl_ranks(local, tp, first, id, build));
  whole.reset();
  struct Release {
    std::vector<rank_group::CudaRank>* ranks;
    ~Release() {
      if (ranks != nullptr) rank_group::release_ranks(*ranks);
    }
  } release{&ranks};
  const int64_t page_bytes = KvCache::page_bytes(cfg, plan0.num_kv_heads);
  M3_TRY(
      rank_group::RankPool pool,
      rank_group::size_rank_pool(
          cfg, page_bytes, opts, local,
          "tensor parallel " + std::to_string(tp) + ", ranks " + std::to_string(first) + "-" +
              std::to_string(first + local - 1) + " of node " + std::to_string(nodes.node_rank)));
  // Every node must hold the same page ids: the smallest pool of any GPU of any node.
  M3_TRY(pool.num_pages, out.group->agree_pages(pool.num_pages));
  M3_LOG_INFO("%s", plan0.describe(cfg).c_str());
  rank_group::log_rank_pool(cfg, pool);
  for (int l = 0; l < local; ++l) {
    M3_CUDA_CHECK(cudaSetDevice(l));
    ranks[l].cache = std::make_unique<KvCacheCuda>(cfg, pool.num_pages,
                                                   ranks[l].model->shard_plan().num_kv_heads);
  }
  release.ranks = nullptr;
  out.backend = std::unique_ptr<ForwardBackend>(
      new ShardedCudaBackend(std::move(ranks), pool.where, pool.flag));
  M3_TRY_STATUS(out.group->ready());
  return out;
}
#endif

#ifndef M3_HAS_NCCL
Error no_nccl(int tp) {
  return Error{ErrorCode::kUnavailable,
               "--tensor-parallel-size " + std::to_string(tp) +
                   " with --nnodes and --device cuda needs NCCL, and this m3serve was built "
                   "without it (install libnccl-dev and rebuild), or use --device cpu",
               "--tensor-parallel-size"};
}
#endif

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cuda_multi_node_backend(std::unique_ptr<M3Model> host,
                                                                     const CudaBackendOptions& opts,
                                                                     int tp, bool ep,
                                                                     const MultiNodeSpec& nodes) {
  M3_CHECK(host != nullptr && nodes.node_rank == 0);
#ifdef M3_HAS_NCCL
  M3_TRY(CudaNodeRanks r, make_cuda_node_ranks(std::move(host), opts, tp, ep, nodes));
  return make_leader_backend(std::move(r.backend), std::move(r.group));
#else
  (void)opts;
  (void)ep;
  return tl::unexpected(no_nccl(tp));
#endif
}

Status run_cuda_headless_node(std::unique_ptr<M3Model> host, const CudaBackendOptions& opts, int tp,
                              bool ep, const MultiNodeSpec& nodes) {
  M3_CHECK(host != nullptr && nodes.node_rank > 0);
#ifdef M3_HAS_NCCL
  M3_TRY(CudaNodeRanks r, make_cuda_node_ranks(std::move(host), opts, tp, ep, nodes));
  M3_LOG_INFO("node %d: serving node 0's steps (headless)", nodes.node_rank);
  return run_headless(*r.backend, *r.group);
#else
  (void)opts;
  (void)ep;
  return tl::unexpected(no_nccl(tp));
#endif
}

}  // namespace m3::runtime
