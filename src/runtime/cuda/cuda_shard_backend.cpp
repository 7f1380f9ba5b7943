// make_cuda_sharded_backend (runtime/cuda/cuda_backend.h): N tensor-parallel ranks, one GPU each,
// as persistent threads of this process over NCCL (runtime/cuda/rank_group.h: the group's start-up,
// the rank threads, the pool). Each thread binds its device once, so the engine thread never
// changes its own current device; a step costs two condition-variable handoffs. Every rank runs
// M3ModelCuda::forward on the same batch (the collectives pair up); rank 0's logits / samples
// are returned, the others compute them and drop them.
#include <algorithm>
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
