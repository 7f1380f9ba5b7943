// make_cuda_sharded_backend (model/cuda/cuda_backend.h): N tensor-parallel ranks, one GPU each,
// as persistent threads of this process over NCCL. Each thread binds its device once, so the
// engine thread never changes its own current device; a step costs two condition-variable
// handoffs. Every rank runs M3ModelCuda::forward on the same batch (the collectives pair up);
// rank 0's logits / samples are returned, the others compute them and drop them.
#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "model/cuda/cuda_backend.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/kv_budget.h"
#include "model/kv_cache.h"
#ifdef M3_HAS_NCCL
#include "dist/nccl_communicator.h"
#endif

namespace m3::model {

Status check_tensor_parallel_devices(int tp) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it so later probes start clean
    count = 0;
  }
  if (tp <= count) return {};
  return make_error(ErrorCode::kInvalidArgument,
                    "--tensor-parallel-size " + std::to_string(tp) + " needs " +
                        std::to_string(tp) + " GPUs (one per rank) but this machine has " +
                        std::to_string(count) + " visible; use --tensor-parallel-size " +
                        std::to_string(std::max(count, 1)) + " or fewer",
                    "--tensor-parallel-size");
}

#ifdef M3_HAS_NCCL
namespace {

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
  return buf;
}

struct CudaRank {
  std::unique_ptr<dist::NcclCommunicator> comm;
  std::unique_ptr<M3ModelCuda> model;
  std::unique_ptr<KvCacheCuda> cache;
};

class ShardedCudaBackend final : public ForwardBackend {
 public:
  ShardedCudaBackend(std::vector<CudaRank> ranks, std::string name, std::string flag)
      : ranks_(std::move(ranks)), name_(std::move(name)), flag_(std::move(flag)) {
    for (size_t r = 0; r < ranks_.size(); ++r) workers_.emplace_back([this, r] { worker(r); });
  }
  ~ShardedCudaBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : workers_) t.join();
    // Device memory, streams and communicators are released with their device current.
    for (size_t r = 0; r < ranks_.size(); ++r) {
      cudaSetDevice(static_cast<int>(r));
      ranks_[r].cache.reset();
      ranks_[r].model.reset();
      ranks_[r].comm.reset();
    }
  }

  const M3Config& config() const override { return ranks_[0].model->config(); }
  int64_t num_pages() const override { return ranks_[0].cache->num_pages(); }
  bool samples_on_device() const override { return true; }
  std::string device_name() const override { return name_; }
  std::string kv_cache_flag() const override { return flag_; }

  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    std::unique_lock<std::mutex> lock(mu_);
    batch_ = &batch;
    out_ = out;
    capture_ = capture_msa;
    pending_ = static_cast<int>(ranks_.size());
    ++generation_;
    cv_work_.notify_all();
    cv_done_.wait(lock, [&] { return pending_ == 0; });
    batch_ = nullptr;
    out_ = nullptr;
  }

 private:
  void worker(size_t r) {
    M3_CUDA_CHECK(cudaSetDevice(static_cast<int>(r)));  // rank r runs on GPU r
    uint64_t seen = 0;
    for (;;) {
      const ForwardBatch* batch = nullptr;
      ForwardResult* out = nullptr;
      bool capture = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        batch = batch_;
        out = r == 0 ? out_ : nullptr;
        capture = capture_;
      }
      ranks_[r].model->forward(*batch, *ranks_[r].cache, out, capture);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) cv_done_.notify_all();
    }
  }

  std::vector<CudaRank> ranks_;
  std::string name_, flag_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const ForwardBatch* batch_ = nullptr;
  ForwardResult* out_ = nullptr;
  bool capture_ = false;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace
#endif  // M3_HAS_NCCL

Result<std::unique_ptr<ForwardBackend>> make_cuda_sharded_backend(std::unique_ptr<M3Model> host,
                                                                  const CudaBackendOptions& opts,
                                                                  int tp, bool expert_parallel) {
  M3_CHECK(host != nullptr);
  if (tp < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--tensor-parallel-size must be >= 1, got " + std::to_string(tp),
                      "--tensor-parallel-size");
  }
  if (tp == 1) return make_cuda_backend(std::move(host), opts);  // EP over one rank: whole model
  const double util = opts.gpu_memory_utilization;
  if (!(util > 0.0 && util <= 1.0)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--gpu-memory-utilization " + std::to_string(util) +
                          " is outside (0, 1]; give a fraction such as 0.9",
                      "--gpu-memory-utilization");
  }
  M3_TRY_STATUS(check_tensor_parallel_devices(tp));
  if (!host->has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "--tensor-parallel-size " + std::to_string(tp) +
                          " with a synthetic model is not implemented (synthetic weights are "
                          "generated whole on one GPU); use --tensor-parallel-size 1",
                      "--tensor-parallel-size");
  }
  const M3Config cfg = host->config();
  // Check the split once, without a group, so a bad size fails before any thread starts.
  ShardSpec probe;
  probe.world = tp;
  probe.expert_parallel = expert_parallel;
  M3_TRY(ShardPlan plan0, make_shard_plan(cfg, probe));
#ifndef M3_HAS_NCCL
  (void)plan0;
  return make_error(ErrorCode::kUnavailable,
                    "--tensor-parallel-size " + std::to_string(tp) +
                        " with --device cuda needs NCCL, and this m3serve was built without it "
                        "(install libnccl-dev and rebuild), or use --device cpu",
                    "--tensor-parallel-size");
#else
  M3_TRY(ncclUniqueId id, dist::make_nccl_unique_id());
  // Every rank joins the group (ncclCommInitRank blocks until all have) and uploads its shard on
  // its own thread; the shards share the host weights (make_shard is const).
  std::shared_ptr<const M3Model> whole(std::move(host));
  std::vector<CudaRank> ranks(tp);
  std::vector<Status> status(tp);
  // On an error return, each rank's objects are released with its device current.
  struct Release {
    std::vector<CudaRank>* ranks;
    ~Release() {
      if (ranks == nullptr) return;
      for (size_t q = 0; q < ranks->size(); ++q) {
        cudaSetDevice(static_cast<int>(q));
        (*ranks)[q].cache.reset();
        (*ranks)[q].model.reset();
        (*ranks)[q].comm.reset();
      }
    }
  } release{&ranks};
  {
    std::vector<std::thread> init;
    for (int r = 0; r < tp; ++r) {
      init.emplace_back([&, r] {
        auto comm = dist::NcclCommunicator::create(r, tp, r, id);
        if (!comm) {
          status[r] = tl::unexpected(comm.error());
          return;
        }
        ranks[r].comm = std::move(*comm);
        ShardSpec spec;
        spec.rank = r;
        spec.world = tp;
        spec.expert_parallel = expert_parallel;  // whole experts per rank, picks remapped
        spec.comm = ranks[r].comm.get();
        auto shard = whole->make_shard(spec);
        if (!shard) {
          status[r] = tl::unexpected(shard.error());
          return;
        }
        auto model = M3ModelCuda::from_host(std::move(*shard), r, ranks[r].comm.get(),
                                            ranks[r].comm->stream());
        if (!model) {
          status[r] = tl::unexpected(model.error());
          return;
        }
        ranks[r].model = std::move(*model);
        if (opts.enforce_eager || !opts.tensor_parallel_graphs)
          ranks[r].model->set_use_graphs(false);
      });
    }
    for (auto& t : init) t.join();
  }
  whole.reset();
  for (int r = 0; r < tp; ++r) {
    if (!status[r]) return tl::unexpected(status[r].error());
  }
  // The pool: the same page count on every rank (the scheduler hands out one set of page ids),
  // the smallest any GPU allows.
  const int64_t page_bytes = KvCache::page_bytes(cfg, plan0.num_kv_heads);
  const bool explicit_bytes = opts.kv_cache_memory_bytes > 0;
  const std::string flag = explicit_bytes ? "--kv-cache-memory-bytes" : "--gpu-memory-utilization";
  int64_t num_pages = INT32_MAX;
  std::string where, gpu_name, sized_by;
  for (int r = 0; r < tp; ++r) {
    M3_TRY(gpu::DeviceInfo info, gpu::probe_device(r));
    const double free_bytes = static_cast<double>(info.free_bytes);
    const double budget =
        explicit_bytes ? static_cast<double>(opts.kv_cache_memory_bytes) : free_bytes * util;
    if (explicit_bytes && budget > free_bytes) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--kv-cache-memory-bytes asks for " + mib(budget) +
                            " of KV cache per GPU but cuda:" + std::to_string(r) + " has " +
                            mib(free_bytes) + " free after its shard of the weights; lower "
                            "--kv-cache-memory-bytes",
                        flag);
    }
    const int64_t pages = static_cast<int64_t>(budget / static_cast<double>(page_bytes));
    if (pages < num_pages) {
      num_pages = pages;
      sized_by = explicit_bytes ? "--kv-cache-memory-bytes " + mib(budget) + " per GPU"
                                : mib(free_bytes) + " free on cuda:" + std::to_string(r) +
                                      " after its shard x " + std::to_string(util);
    }
    gpu_name = info.name;
  }
  where = "cuda:0-" + std::to_string(tp - 1) + " (" + std::to_string(tp) + "x " + gpu_name +
          ", tensor parallel " + std::to_string(tp) + ", NCCL)";
  if (num_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "no KV page fits on every GPU of " + where + ": " + sized_by +
                          ", but one page (" + std::to_string(cfg.sparse_block_size) +
                          " tokens, this rank's KV heads) needs " +
                          mib(static_cast<double>(page_bytes)) + "; raise " + flag +
                          " or free GPU memory",
                      flag);
  }
  KvPoolFacts facts;
  facts.num_pages = num_pages;
  facts.page_size = cfg.sparse_block_size;
  facts.page_bytes = page_bytes;
  facts.where = where;
  facts.sized_by = sized_by;
  facts.flag = flag;
  M3_TRY_STATUS(check_max_model_len_fits(opts.max_model_len, facts));
  M3_LOG_INFO("%s", plan0.describe(cfg).c_str());
  M3_LOG_INFO("KV cache on %s: %lld pages of %s per GPU (%s) = %lld tokens", where.c_str(),
              static_cast<long long>(num_pages), mib(static_cast<double>(page_bytes)).c_str(),
              sized_by.c_str(), static_cast<long long>(num_pages * cfg.sparse_block_size));
  for (int r = 0; r < tp; ++r) {
    M3_CUDA_CHECK(cudaSetDevice(r));
    ranks[r].cache = std::make_unique<KvCacheCuda>(cfg, num_pages,
                                                   ranks[r].model->shard_plan().num_kv_heads);
  }
  release.ranks = nullptr;
  return std::unique_ptr<ForwardBackend>(
      new ShardedCudaBackend(std::move(ranks), where, flag));
#endif
}

}  // namespace m3::model
