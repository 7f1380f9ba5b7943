// make_cuda_data_parallel_backend (runtime/cuda/cuda_backend.h): D attention data-parallel ranks,
// one GPU each, as persistent threads of this process over NCCL (runtime/cuda/rank_group.h). The
// page ids are D partitions, one per rank (pages [r * P, (r + 1) * P) in rank r's cache; the
// scheduler keeps each sequence inside one), unless opts.dp_kv_partitions is off (one shared
// page-id space that every rank allocates whole). The batch is split on the host by sequence
// owner (runtime/dp_batch_split.h); each rank
// runs M3ModelCuda::forward on its own sequences, a rank without any joins the MoE collectives
// through forward_dp_idle, and the ranks' results are merged on the host into the batch's order
// (every rank's result is already in host memory, so no device all-gather of logits is needed).
#include <algorithm>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/kv_cache.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/cuda/rank_group.h"
#include "runtime/dp_batch_split.h"

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

Status check_data_parallel_devices(int dp) {
  return rank_group::check_gpus_for_ranks(dp, "--data-parallel-size", ", or --device cpu");
}

#ifdef M3_HAS_NCCL
namespace {

class DataParallelCudaBackend final : public ForwardBackend {
 public:
  // partitioned: rank r's cache holds pages [r * P, (r + 1) * P) of num_pages() = D * P.
  DataParallelCudaBackend(std::vector<rank_group::CudaRank> ranks, rank_group::RankPool pool,
                          bool partitioned)
      : ranks_(std::move(ranks)),
        pool_(std::move(pool)),
        partitioned_(partitioned),
        split_(static_cast<int>(ranks_.size())),
        threads_(rank_group::gpu_rank_threads(static_cast<int>(ranks_.size()))) {}
  ~DataParallelCudaBackend() override {
    threads_.stop();
    rank_group::release_ranks(ranks_);
  }

  const M3Config& config() const override { return ranks_[0].model->config(); }
  int64_t num_pages() const override {
    const int64_t per_rank = ranks_[0].cache->num_pages();
    return partitioned_ ? per_rank * static_cast<int64_t>(ranks_.size()) : per_rank;
  }
  int num_kv_partitions() const override {
    return partitioned_ ? static_cast<int>(ranks_.size()) : 1;
  }
  bool samples_on_device() const override { return true; }
  std::string device_name() const override { return pool_.where; }
  std::string image_refusal() const override {
    return "the data-parallel GPU backend (--data-parallel-size above 1) does not run the vision "
           "tower; serve images on one GPU (drop --data-parallel-size) or on the CPU backend "
           "(--device cpu)";
  }
  std::string kv_cache_flag() const override { return pool_.flag; }

  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    split_.split(batch, ranks_[0].model->shard_plan(),
                 partitioned_ ? ranks_[0].cache->num_pages() : 0);
    // Every rank's MoE all-gathers the step's largest per-rank row count (known here, on the
    // host, so the ranks need no count exchange and no device sync).
    const int64_t nmax = split_.max_rank_tokens();
    threads_.run([&](int r) {
      const ForwardBatch& rb = split_.batch(r);
      ForwardResult& res = split_.result(r);
      M3ModelCuda& model = *ranks_[r].model;
      model.set_dp_step_rows(nmax);
      if (rb.token_ids.empty()) {
        model.forward_dp_idle();
        res = ForwardResult{};
      } else {
        model.forward(rb, *ranks_[r].cache, &res, capture_msa);
      }
    });
    if (out != nullptr) split_.merge(batch, config(), out, capture_msa);
  }

 private:
  std::vector<rank_group::CudaRank> ranks_;
  rank_group::RankPool pool_;
  bool partitioned_;
  DpBatchSplit split_;   // the step's per-rank batches and results
  RankThreads threads_;  // last: started once everything above exists
};

}  // namespace
#endif  // M3_HAS_NCCL

Result<std::unique_ptr<ForwardBackend>> make_cuda_data_parallel_backend(
    std::unique_ptr<M3Model> host, const CudaBackendOptions& opts, int dp, bool expert_parallel,
    MoeDispatch moe_dispatch) {
  M3_CHECK(host != nullptr);
  M3_TRY_STATUS(rank_group::check_group_args(dp, "--data-parallel-size", opts));
  if (dp == 1) return make_cuda_backend(std::move(host), opts);  // EP over one rank: whole model
  // A config-only host (`--model synthetic:...`): each rank generates its slices on its GPU.
  const bool synthetic = !host->has_weights();
  const M3Config cfg = host->config();
  // Check the split once, without a group or a GPU, so a bad size fails before anything starts.
  ShardSpec probe;
  probe.world = dp;
  probe.expert_parallel = expert_parallel;
  probe.data_parallel = true;
  // kAuto keeps the all-gather here: its steps need no host sync, so decode replays graphs.
  const MoeDispatch dispatch =
      moe_dispatch == MoeDispatch::kAuto ? MoeDispatch::kAllGather : moe_dispatch;
  probe.moe_dispatch = dispatch;
  M3_TRY(ShardPlan plan0, make_shard_plan(cfg, probe));
  M3_TRY_STATUS(check_data_parallel_devices(dp));
#ifndef M3_HAS_NCCL
  (void)plan0;
  (void)synthetic;
  return make_error(ErrorCode::kUnavailable,
                    "--data-parallel-size " + std::to_string(dp) +
                        " with --device cuda needs NCCL, and this m3serve was built without it "
                        "(install libnccl-dev and rebuild), or use --device cpu",
                    "--data-parallel-size");
#else
  // Every rank joins the group and makes its model on its own thread; the host shards share the
  // host weights (make_shard is const).
  std::shared_ptr<const M3Model> whole(std::move(host));
  // Decode steps replay CUDA graphs keyed by the rank's tokens and the step's MoE rows, as TP
  // ranks do; a rank without tokens runs its MoE collectives eagerly (forward_dp_idle).
  auto build = [&](int r, rank_group::CudaRank& rank) -> Status {
    ShardSpec spec;
    spec.rank = r;
    spec.world = dp;
    spec.expert_parallel = expert_parallel;
    spec.data_parallel = true;
    spec.moe_dispatch = dispatch;
    return rank_group::make_rank_model(*whole, spec, opts, rank);
  };
  M3_TRY(std::vector<rank_group::CudaRank> ranks, rank_group::start_nccl_ranks(dp, build));
  whole.reset();
  struct Release {  // on an error return, each rank's objects go with its device current
    std::vector<rank_group::CudaRank>* ranks;
    ~Release() {
      if (ranks != nullptr) rank_group::release_ranks(*ranks);
    }
  } release{&ranks};
  M3_LOG_INFO("%s", plan0.describe(cfg).c_str());
  if (synthetic) {
    M3_LOG_INFO("synthetic weights: %.2f GiB per GPU generated from seed %llu",
                static_cast<double>(ranks[0].model->weight_bytes()) / (1 << 30),
                static_cast<unsigned long long>(opts.synthetic_seed));
  }
  // Every rank's cache holds all KV heads and the same page ids.
  const int64_t page_bytes = KvCache::page_bytes(cfg, plan0.num_kv_heads);
  const std::string mode =
      "data parallel " + std::to_string(dp) + (expert_parallel ? " + expert parallel" : "");
  M3_TRY(rank_group::RankPool pool, rank_group::size_rank_pool(cfg, page_bytes, opts, dp, mode));
  rank_group::log_rank_pool(cfg, pool);
  const double per_gpu = static_cast<double>(pool.num_pages) * static_cast<double>(page_bytes);
  const long long tokens_per_rank = static_cast<long long>(pool.num_pages * cfg.sparse_block_size);
  if (opts.dp_kv_partitions) {
    M3_LOG_INFO(
        "data parallel KV cache: %d partitions of %lld pages, one per rank (%s per GPU, "
        "all KV heads); a sequence keeps its pages on its rank: %lld tokens per rank, "
        "%lld in all",
        dp, static_cast<long long>(pool.num_pages), rank_group::mib(per_gpu).c_str(),
        tokens_per_rank, tokens_per_rank * dp);
  } else {
    // One page-id space: a page is used only on its sequence's owner, but every rank allocates
    // every page.
    M3_LOG_INFO(
        "data parallel KV cache: each of the %d ranks allocates all %lld pages (%s per "
        "GPU, all KV heads) but uses only those of its own sequences, so the capacity is "
        "%lld tokens in all, not %d x that",
        dp, static_cast<long long>(pool.num_pages), rank_group::mib(per_gpu).c_str(),
        tokens_per_rank, dp);
  }
  int previous = 0;
  M3_CUDA_CHECK(cudaGetDevice(&previous));
  for (int r = 0; r < dp; ++r) {
    M3_CUDA_CHECK(cudaSetDevice(r));
    ranks[r].cache = std::make_unique<KvCacheCuda>(cfg, pool.num_pages, plan0.num_kv_heads);
  }
  M3_CUDA_CHECK(cudaSetDevice(previous));
  release.ranks = nullptr;
  return std::unique_ptr<ForwardBackend>(
      new DataParallelCudaBackend(std::move(ranks), std::move(pool), opts.dp_kv_partitions));
#endif
}

}  // namespace m3::runtime
