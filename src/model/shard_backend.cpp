// make_cpu_sharded_backend (declared in model/forward_backend.h): N tensor-parallel ranks as
// threads of this process. Rank 0 runs on the engine thread; ranks 1..N-1 are persistent
// threads that wake for each step, so a step costs two condition-variable handoffs, not thread
// creation. The scheduler above stays one instance: every rank sees the same batch.
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "core/log.h"
#include "dist/cpu_communicator.h"
#include "model/forward_backend.h"
#include "model/kv_cache.h"

namespace m3::model {

namespace {

class ShardedCpuBackend final : public ForwardBackend {
 public:
  ShardedCpuBackend(std::shared_ptr<dist::CpuGroup> group,
                    std::vector<std::unique_ptr<dist::Communicator>> comms,
                    std::vector<std::unique_ptr<M3Model>> shards, int64_t num_pages,
                    int partitions)
      : group_(std::move(group)),
        comms_(std::move(comms)),
        shards_(std::move(shards)),
        partitions_(partitions) {
    for (const auto& s : shards_)
      caches_.push_back(std::make_unique<KvCache>(s->config(), num_pages, s->cache_kv_heads()));
    results_.resize(shards_.size());
    for (size_t r = 1; r < shards_.size(); ++r) workers_.emplace_back([this, r] { worker(r); });
  }
  ~ShardedCpuBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : workers_) t.join();
  }

  const M3Config& config() const override { return shards_[0]->config(); }
  // Partitioned (data parallel): rank r's cache holds pages [r * P, (r + 1) * P).
  int64_t num_pages() const override { return caches_[0]->num_pages() * partitions_; }
  int num_kv_partitions() const override { return partitions_; }
  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch_ = &batch;
      capture_ = capture_msa;
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_work_.notify_all();
    shards_[0]->forward(batch, *caches_[0], out, capture_msa);
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return pending_ == 0; });
    batch_ = nullptr;
  }
  std::string device_name() const override {
    const ShardPlan& p = shards_[0]->shard_plan();
    return std::string("cpu (") + (p.data_parallel ? "data parallel " : "tensor parallel ") +
           std::to_string(shards_.size()) + " ranks" +
           (p.expert_parallel ? ", expert parallel" : "") + ", threads)";
  }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }

 private:
  void worker(size_t r) {
    uint64_t seen = 0;
    for (;;) {
      const ForwardBatch* batch = nullptr;
      bool capture = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        batch = batch_;
        capture = capture_;
      }
      // Every rank computes the full logits (the lm_head all-gather); only rank 0's are used.
      shards_[r]->forward(*batch, *caches_[r], &results_[r], capture);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) cv_done_.notify_all();
    }
  }

  std::shared_ptr<dist::CpuGroup> group_;
  std::vector<std::unique_ptr<dist::Communicator>> comms_;
  std::vector<std::unique_ptr<M3Model>> shards_;
  int partitions_ = 1;
  std::vector<std::unique_ptr<KvCache>> caches_;  // each points into its shard's config
  std::vector<ForwardResult> results_;            // ranks >= 1: scratch
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const ForwardBatch* batch_ = nullptr;
  bool capture_ = false;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cpu_sharded_backend(std::unique_ptr<M3Model> model,
                                                                 int64_t num_pages,
                                                                 int tensor_parallel_size,
                                                                 bool expert_parallel,
                                                                 int data_parallel_size,
                                                                 bool dp_kv_partitions) {
  M3_CHECK(model != nullptr);
  if (tensor_parallel_size < 1) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "--tensor-parallel-size must be >= 1, got " + std::to_string(tensor_parallel_size),
        "--tensor-parallel-size");
  }
  if (data_parallel_size < 1) {
    return make_error(
        ErrorCode::kInvalidArgument,
        "--data-parallel-size must be >= 1, got " + std::to_string(data_parallel_size),
        "--data-parallel-size");
  }
  if (data_parallel_size > 1 && tensor_parallel_size > 1) {
    return make_error(ErrorCode::kUnsupported,
                      "--data-parallel-size with --tensor-parallel-size > 1 is not implemented "
                      "yet; use one of them",
                      "--data-parallel-size");
  }
  const bool dp = data_parallel_size > 1;
  // Expert parallelism over one rank is the whole model.
  if (tensor_parallel_size == 1 && !dp) {
    return make_cpu_backend(std::move(model), num_pages);
  }
  if (!model->has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "--tensor-parallel-size on the CPU needs a model with weights on the host "
                      "(a synthetic model is generated on the GPU only)",
                      "--tensor-parallel-size");
  }
  if (num_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the CPU KV cache would have " + std::to_string(num_pages) +
                          " pages; raise --kv-cache-memory-bytes to at least " +
                          std::to_string(KvCache::page_bytes(model->config())) + " (one page)",
                      "--kv-cache-memory-bytes");
  }
  const int W = dp ? data_parallel_size : tensor_parallel_size;
  // Partitioned data parallel: the budget's pages split over the ranks, each caching its own.
  const bool partitioned = dp && dp_kv_partitions;
  const int64_t rank_pages = partitioned ? num_pages / W : num_pages;
  if (rank_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the CPU KV cache of " + std::to_string(num_pages) + " pages gives each of " +
                          "the " + std::to_string(W) + " data-parallel ranks none; raise "
                          "--kv-cache-memory-bytes to at least " +
                          std::to_string(W * KvCache::page_bytes(model->config())),
                      "--kv-cache-memory-bytes");
  }
  // Check the split once, without a group, so a bad size fails before any thread starts.
  {
    ShardSpec probe;
    probe.world = W;
    probe.expert_parallel = expert_parallel;
    probe.data_parallel = dp;
    M3_TRY(ShardPlan unused, make_shard_plan(model->config(), probe));
    (void)unused;
  }
  auto group = std::make_shared<dist::CpuGroup>(W);
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  std::vector<std::unique_ptr<M3Model>> shards;
  for (int r = 0; r < W; ++r) {
    comms.push_back(group->communicator(r));
    ShardSpec spec;
    spec.rank = r;
    spec.world = W;
    spec.expert_parallel = expert_parallel;
    spec.data_parallel = dp;
    spec.dp_pages_per_rank = partitioned ? rank_pages : 0;
    spec.comm = comms.back().get();
    M3_TRY(auto shard, model->make_shard(spec));
    shards.push_back(std::move(shard));
  }
  const ShardPlan& p0 = shards[0]->shard_plan();
  const M3Config& cfg = shards[0]->config();
  M3_LOG_INFO("%s", p0.describe(cfg).c_str());
  const double per_rank = static_cast<double>(KvCache::page_bytes(cfg, p0.num_kv_heads)) *
                          static_cast<double>(rank_pages);
  M3_LOG_INFO("CPU KV cache: %lld pages per rank%s, %.1f MiB per rank, %.1f MiB over %d ranks",
              static_cast<long long>(rank_pages),
              partitioned ? " (one page-id partition each)" : "", per_rank / (1 << 20),
              per_rank * W / (1 << 20), W);
  // The shards share the weights; the unsharded model object is no longer needed.
  model.reset();
  return std::unique_ptr<ForwardBackend>(
      new ShardedCpuBackend(std::move(group), std::move(comms), std::move(shards), rank_pages,
                            partitioned ? W : 1));
}

}  // namespace m3::model
