// make_cpu_sharded_backend (declared in runtime/forward_backend.h): N ranks as threads of this
// process over a CpuCommunicator, on the per-rank threads every sharded backend uses
// (model/rank_threads.h). Tensor parallel: every rank runs the same batch. Attention data
// parallel: the batch is split on the host by sequence owner (runtime/dp_batch_split.h), exactly
// as on GPUs, and the ranks' results merged. The scheduler above stays one instance.
#include <climits>
#include <thread>
#include "core/check.h"
#include "core/log.h"

#include "dist/cpu_communicator.h"
#include "dist/tcp_communicator.h"
#include "model/kv_cache.h"
#include "runtime/dp_batch_split.h"
#include "runtime/forward_backend.h"
#include "runtime/multi_node.h"
#include "runtime/rank_threads.h"

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

namespace {

class ShardedCpuBackend final : public ForwardBackend {
 public:
  // `group` may be null (the ranks' communicators are TCP ones between processes); shards_ are
  // this process's ranks, local index 0 first (it fills the caller's result).
  ShardedCpuBackend(std::shared_ptr<dist::CpuGroup> group,
                    std::vector<std::unique_ptr<dist::Communicator>> comms,
                    std::vector<std::unique_ptr<M3Model>> shards, int64_t num_pages, int partitions,
                    int world)
      : group_(std::move(group)),
        comms_(std::move(comms)),
        shards_(std::move(shards)),
        partitions_(partitions),
        world_(world),
        split_(static_cast<int>(shards_.size())),
        threads_(static_cast<int>(shards_.size())) {
    for (const auto& s : shards_)
      caches_.push_back(std::make_unique<KvCache>(s->config(), num_pages, s->cache_kv_heads()));
    results_.resize(shards_.size());
  }
  ~ShardedCpuBackend() override { threads_.stop(); }

  const M3Config& config() const override { return shards_[0]->config(); }
  // Partitioned (data parallel): rank r's cache holds pages [r * P, (r + 1) * P).
  int64_t num_pages() const override { return caches_[0]->num_pages() * partitions_; }
  int num_kv_partitions() const override { return partitions_; }
  int64_t moe_dispatch_bytes() const override {
    int64_t b = 0;
    for (const auto& s : shards_) b += s->moe_dispatch_bytes();
    return b;
  }
  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    if (!shards_[0]->shard_plan().data_sharded()) {
      // Every rank computes the full logits (the lm_head all-gather); rank 0's are returned.
      threads_.run([&](int r) {
        shards_[r]->forward(batch, *caches_[r], r == 0 ? out : &results_[r], capture_msa);
      });
      return;
    }
    split_.split(batch, shards_[0]->shard_plan(), partitions_ > 1 ? caches_[0]->num_pages() : 0);
    const int64_t nmax = split_.max_rank_tokens();
    threads_.run([&](int r) {
      const M3Model& m = *shards_[r];
      m.set_dp_step_rows(nmax);
      if (split_.batch(r).token_ids.empty()) {
        m.forward_dp_idle();
        split_.result(r) = ForwardResult{};
      } else {
        m.forward(split_.batch(r), *caches_[r], &split_.result(r), capture_msa);
      }
    });
    if (out != nullptr) split_.merge(batch, config(), out, capture_msa);
  }
  // Speculative decoding: tensor parallel ranks each return the aux states (rank 0's are used);
  // data parallel ranks return their own tokens' and DpBatchSplit::merge puts them in order.
  std::string speculative_refusal() const override { return ""; }
  std::string device_name() const override {
    const ShardPlan& p = shards_[0]->shard_plan();
    const int local = static_cast<int>(shards_.size());
    return std::string("cpu (") + (p.data_parallel ? "data parallel " : "tensor parallel ") +
           std::to_string(world_) + " ranks" + (p.expert_parallel ? ", expert parallel" : "") +
           (local == world_
                ? ", threads)"
                : ", " + std::to_string(local) + " as threads here, TCP between nodes)");
  }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }
  std::string fault() const override {
    for (const auto& c : comms_)
      if (std::string why = c->fault(); !why.empty()) return why;
    return "";
  }
  // Tensor parallel: every rank gets the whole batch, embedding rows included, and writes them
  // after its embedding all-reduce; the tower (shared by the shards, not split) runs once. The
  // data-parallel split does not carry embedding rows yet.
  bool supports_image_input() const override {
    return shards_[0]->vision() != nullptr && !shards_[0]->shard_plan().data_sharded();
  }
  std::string image_refusal() const override {
    if (shards_[0]->vision() == nullptr) return missing_tower_refusal(shards_[0]->config());
    return "the data-parallel CPU split (--data-parallel-size) does not carry image embeddings; "
           "serve images with --tensor-parallel-size or one rank";
  }
  void encode_images(std::span<const VisionImage> images, std::vector<float>* embeds) override {
    shards_[0]->encode_images(images, embeds);
  }

 private:
  std::shared_ptr<dist::CpuGroup> group_;
  std::vector<std::unique_ptr<dist::Communicator>> comms_;
  std::vector<std::unique_ptr<M3Model>> shards_;
  int partitions_ = 1;
  int world_ = 1;
  std::vector<std::unique_ptr<KvCache>> caches_;  // each points into its shard's config
  std::vector<ForwardResult> results_;            // tensor parallel ranks >= 1: scratch
  DpBatchSplit split_;                            // data parallel: the step's rank batches
  RankThreads threads_;                           // last: started once everything above exists
};

// A CPU KV pool of num_pages pages: at least one, else the error names the flag and the size.
Status check_cpu_pages(int64_t num_pages, const M3Config& config) {
  if (num_pages >= 1) return {};
  return make_error(ErrorCode::kInvalidArgument,
                    "the CPU KV cache would have " + std::to_string(num_pages) +
                        " pages; raise --kv-cache-memory-bytes to at least " +
                        std::to_string(KvCache::page_bytes(config)) + " (one page)",
                    "--kv-cache-memory-bytes");
}

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cpu_sharded_backend(
    std::unique_ptr<M3Model> model, int64_t num_pages, int tensor_parallel_size,
    bool expert_parallel, int data_parallel_size, bool dp_kv_partitions, MoeDispatch moe_dispatch) {
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
  M3_TRY_STATUS(check_cpu_pages(num_pages, model->config()));
  const int W = dp ? data_parallel_size : tensor_parallel_size;
  // Partitioned data parallel: the budget's pages split over the ranks, each caching its own.
  const bool partitioned = dp && dp_kv_partitions;
  const int64_t rank_pages = partitioned ? num_pages / W : num_pages;
  if (rank_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the CPU KV cache of " + std::to_string(num_pages) + " pages gives each of " +
                          "the " + std::to_string(W) +
                          " data-parallel ranks none; raise "
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
    probe.moe_dispatch = moe_dispatch;
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
    spec.moe_dispatch = moe_dispatch;
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
  return std::unique_ptr<ForwardBackend>(new ShardedCpuBackend(
      std::move(group), std::move(comms), std::move(shards), rank_pages, partitioned ? W : 1, W));
}

namespace {

// The line every node must share: the model, the KV formats and the split.
std::string node_layout(const M3Config& cfg, int world, bool ep, const MultiNodeSpec& nodes) {
  return std::string("cpu | ") + cfg.summary() + " | KV " +
         kernels::kv_dtype_name(cfg.kv_cache_dtype) + ", index-K " +
         kernels::kv_dtype_name(cfg.index_cache_dtype) + " | tensor parallel " +
         std::to_string(world) + (ep ? " + expert parallel" : "") + " over " +
         std::to_string(nodes.nnodes) + " nodes";
}

// This node's ranks of a tensor-parallel group over nodes: checks, joins the group, agrees on
// the pages (node 0 offers `num_pages`, the others follow it), connects the TCP communicators
// (one thread per local rank, as every rank's mesh connects at once) and cuts the shards.
struct NodeRanks {
  std::unique_ptr<NodeGroup> group;
  std::unique_ptr<ForwardBackend> backend;
};
Result<NodeRanks> make_node_ranks(std::unique_ptr<M3Model> model, int64_t num_pages, int tp,
                                  bool ep, const MultiNodeSpec& nodes) {
  M3_CHECK(model != nullptr && nodes.active());
  const std::string flag = "--tensor-parallel-size";
  if (tp < 2)
    return make_error(ErrorCode::kInvalidArgument,
                      "--nnodes " + std::to_string(nodes.nnodes) +
                          " needs --tensor-parallel-size of at least --nnodes (the ranks are "
                          "split over the nodes)",
                      flag);
  M3_TRY_STATUS(check_node_split(tp, nodes, flag));
  if (!model->has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "--tensor-parallel-size on the CPU needs a model with weights on the host "
                      "(a synthetic model is generated on the GPU only)",
                      flag);
  }
  {
    ShardSpec probe;
    probe.world = tp;
    probe.expert_parallel = ep;
    M3_TRY(ShardPlan unused, make_shard_plan(model->config(), probe));
    (void)unused;
  }
  NodeRanks out;
  M3_TRY(out.group, NodeGroup::join(nodes, node_layout(model->config(), tp, ep, nodes)));
  M3_TRY(const int64_t pages, out.group->agree_pages(num_pages));
  if (pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the CPU KV cache would have " + std::to_string(pages) +
                          " pages; raise --kv-cache-memory-bytes on node 0",
                      "--kv-cache-memory-bytes");
  }
  const int local = tp / nodes.nnodes;
  const int first = nodes.node_rank * local;
  std::vector<std::unique_ptr<dist::Communicator>> comms(local);
  {
    std::vector<Status> st(local);
    std::vector<std::thread> ts;
    for (int l = 0; l < local; ++l) {
      ts.emplace_back([&, l] {
        auto c = dist::TcpCommunicator::create(out.group->store(), "m3/tp", first + l, tp);
        if (!c) {
          st[l] = tl::unexpected(c.error());
          return;
        }
        (*c)->set_timeout_s(nodes.timeout_s);
        comms[l] = std::move(*c);
      });
    }
    for (auto& t : ts) t.join();
    for (auto& s : st) M3_TRY_STATUS(s);
  }
  std::vector<std::unique_ptr<M3Model>> shards;
  for (int l = 0; l < local; ++l) {
    ShardSpec spec;
    spec.rank = first + l;
    spec.world = tp;
    spec.expert_parallel = ep;
    spec.comm = comms[l].get();
    M3_TRY(auto shard, model->make_shard(spec));
    shards.push_back(std::move(shard));
  }
  const ShardPlan& p0 = shards[0]->shard_plan();
  const M3Config& cfg = shards[0]->config();
  M3_LOG_INFO("node %d of %d: ranks %d-%d of %d; %s", nodes.node_rank, nodes.nnodes, first,
              first + local - 1, tp, p0.describe(cfg).c_str());
  M3_LOG_INFO("CPU KV cache: %lld pages per rank, %.1f MiB per rank", static_cast<long long>(pages),
              static_cast<double>(KvCache::page_bytes(cfg, p0.num_kv_heads)) *
                  static_cast<double>(pages) / (1 << 20));
  model.reset();
  out.backend = std::unique_ptr<ForwardBackend>(
      new ShardedCpuBackend(nullptr, std::move(comms), std::move(shards), pages, 1, tp));
  M3_TRY_STATUS(out.group->ready());
  return out;
}

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cpu_multi_node_backend(std::unique_ptr<M3Model> model,
                                                                    int64_t num_pages, int tp,
                                                                    bool ep,
                                                                    const MultiNodeSpec& nodes) {
  M3_CHECK(nodes.node_rank == 0, "the engine runs on node 0 only");
  M3_TRY_STATUS(check_cpu_pages(num_pages, model->config()));
  M3_TRY(NodeRanks r, make_node_ranks(std::move(model), num_pages, tp, ep, nodes));
  return make_leader_backend(std::move(r.backend), std::move(r.group));
}

Status run_cpu_headless_node(std::unique_ptr<M3Model> model, int tp, bool ep,
                             const MultiNodeSpec& nodes) {
  M3_CHECK(nodes.node_rank > 0, "node 0 runs the engine, not the headless loop");
  // Node 0's page count rules (it sized the pool from its flags); this node offers no limit.
  M3_TRY(NodeRanks r, make_node_ranks(std::move(model), INT64_MAX, tp, ep, nodes));
  M3_LOG_INFO("node %d: serving node 0's steps (headless)", nodes.node_rank);
  return run_headless(*r.backend, *r.group);
}

}  // namespace m3::runtime
