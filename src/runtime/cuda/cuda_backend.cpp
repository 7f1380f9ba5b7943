#include "runtime/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <string>

#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "model/cuda/eagle3_draft_cuda.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/kv_cache.h"
#include "runtime/cuda/host_kv_tier_cuda.h"
#include "runtime/kv_budget.h"
#include "runtime/sequence_runner.h"

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

namespace {

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
  return buf;
}

std::string fraction(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", f);
  return buf;
}

class CudaBackend final : public ForwardBackend {
 public:
  // `model` null: `borrowed` is used, not owned (a model the caller keeps alive).
  CudaBackend(std::unique_ptr<M3ModelCuda> model, M3ModelCuda* borrowed, int64_t num_pages,
              int device, std::string name)
      : owned_(std::move(model)),
        model_(owned_ ? owned_.get() : borrowed),
        cache_(model_->config(), num_pages),
        device_(device),
        name_(std::move(name)) {}

  const M3Config& config() const override { return model_->config(); }
  int64_t num_pages() const override { return cache_.num_pages(); }
  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    // The current device is per host thread, and the engine thread is not the one that loaded.
    M3_CUDA_CHECK(cudaSetDevice(device_));
    model_->forward(batch, cache_, out, capture_msa);
  }
  bool samples_on_device() const override { return true; }
  // Async scheduling: the step is enqueued on the model's stream and runs while the engine
  // prepares the next one.
  void launch(const ForwardBatch& batch) override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    model_->launch(batch, cache_);
  }
  void collect(ForwardResult* out) override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    model_->collect(out);
  }
  bool launch_overlaps() const override { return true; }
  std::string device_name() const override { return name_; }
  std::string kv_cache_flag() const override { return flag_; }
  void set_kv_cache_flag(std::string flag) { flag_ = std::move(flag); }
  // One GPU: the target's aux hidden states stay on the device (M3ModelCuda::aux_states) and
  // the draft head runs there too (model/cuda/eagle3_draft_cuda.h).
  std::string speculative_refusal() const override { return ""; }
  void set_draft(std::unique_ptr<Eagle3DraftCuda> d) { draft_ = std::move(d); }
  Result<std::unique_ptr<DraftProposer>> make_draft(
      const std::string& model, std::shared_ptr<const M3Weights> /*target_weights*/) override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    std::unique_ptr<Eagle3DraftCuda> d;
    if (draft_ != nullptr && draft_->name() == model) {
      d = std::move(draft_);
    } else {
      // Not loaded with the pool (CudaBackendOptions::draft_model): its KV pages come out of
      // the memory the pool left free.
      M3_TRY(d, Eagle3DraftCuda::load(model, *model_, device_));
      const double need = static_cast<double>(d->kv_page_bytes()) * num_pages();
      size_t free_b = 0, total_b = 0;
      M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      if (need > 0.9 * static_cast<double>(free_b)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "the EAGLE-3 draft's KV cache (" + mib(need) + " for the pool's " +
                              std::to_string(num_pages()) + " pages) does not fit in the " +
                              mib(static_cast<double>(free_b)) + " left on " + name_ + "; lower " +
                              flag_ + " so the pool leaves room for it",
                          "--speculative-config");
      }
      d->allocate_kv(num_pages());
      M3_LOG_INFO("EAGLE-3 draft on %s: weights %s, KV cache %s (%lld pages)", name_.c_str(),
                  mib(static_cast<double>(d->weight_bytes())).c_str(),
                  mib(static_cast<double>(d->kv_bytes())).c_str(),
                  static_cast<long long>(num_pages()));
    }
    return std::unique_ptr<DraftProposer>(std::move(d));
  }

  // Pinned host slots behind the pool (runtime/cuda/host_kv_tier_cuda.h).
  Status enable_host_kv_tier(int64_t num_slots) override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    M3_TRY(tier_, HostKvTierCuda::create(cache_, num_slots));
    return {};
  }
  // Enqueued on the tier's copy stream after every step launched so far; the next step waits
  // for layer l's copies before its layer l touches the pages (M3ModelCuda::wait_for_kv_copies).
  void copy_host_kv_pages(std::span<const HostPageCopy> offloads,
                          std::span<const HostPageCopy> restores) override {
    if (offloads.empty() && restores.empty()) return;
    M3_CHECK(tier_ != nullptr, "host KV copies without a tier");
    M3_CUDA_CHECK(cudaSetDevice(device_));
    tier_->enqueue(offloads, restores, model_->stream());
    model_->wait_for_kv_copies(tier_->layer_events());
  }

  // Image input: the tower on this GPU (M3ModelCuda::encode_images); forward() takes the
  // embeddings through ForwardBatch::embed_rows (such steps run eagerly).
  bool supports_image_input() const override { return model_->has_vision(); }
  std::string image_refusal() const override { return missing_tower_refusal(model_->config()); }
  void encode_images(std::span<const model::VisionImage> images,
                     std::vector<float>* embeds) override {
    M3_CUDA_CHECK(cudaSetDevice(device_));
    model_->encode_images(images, embeds);
  }

 private:
  std::unique_ptr<M3ModelCuda> owned_;
  M3ModelCuda* model_;
  KvCacheCuda cache_;
  std::unique_ptr<HostKvTierCuda> tier_;  // after cache_: destroyed (and synchronised) first
  int device_;
  std::string name_;
  std::string flag_ = "--gpu-memory-utilization";
  std::unique_ptr<Eagle3DraftCuda> draft_;  // loaded with the pool, until make_draft()
};

// One prefill step of t tokens of a dummy sequence over the first pages (no sequence owns any
// page yet; the rows are overwritten by the first real requests).
void warm_up(ForwardBackend& backend, int64_t t) {
  if (t < 1) return;
  const int64_t bs = backend.config().sparse_block_size;
  const int64_t pages = (t + bs - 1) / bs;
  ForwardBatch b;
  b.token_ids.assign(static_cast<size_t>(t), 0);
  b.positions.resize(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) b.positions[i] = static_cast<int32_t>(i);
  b.seq_ids.assign(static_cast<size_t>(t), 0);
  b.block_table_offsets = {0, static_cast<int32_t>(pages)};
  b.block_table.resize(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) b.block_table[i] = static_cast<int32_t>(i);
  b.logits_indices = {static_cast<int32_t>(t - 1)};
  ForwardResult out;
  const auto t0 = std::chrono::steady_clock::now();
  backend.forward(b, &out, false);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  M3_LOG_INFO(
      "warm-up: one %lld-token prefill step in %.0f ms (scratch buffers sized, kernels "
      "planned)",
      static_cast<long long>(t), ms);
}

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<M3Model> host,
                                                          const CudaBackendOptions& opts) {
  M3_CHECK(host != nullptr);
  M3_TRY_STATUS(check_gpu_memory_utilization(opts.gpu_memory_utilization));
  std::unique_ptr<M3ModelCuda> model;
  if (host->has_weights()) {
    M3_TRY(model, M3ModelCuda::from_host(std::move(host), opts.device));
  } else {
    const kernels::WeightQuant weights = host->synthetic_weights();
    M3_TRY(model, M3ModelCuda::synthetic(host->config(), opts.synthetic_seed, opts.device, nullptr,
                                         nullptr, nullptr, weights));
    M3_LOG_INFO(
        "synthetic weights on cuda:%d: %.2f GiB generated from seed %llu (linears %s)", opts.device,
        static_cast<double>(model->weight_bytes()) / (1 << 30),
        static_cast<unsigned long long>(opts.synthetic_seed),
        weights == kernels::WeightQuant::kNone ? "bf16" : kernels::weight_quant_name(weights));
  }
  return make_cuda_backend(std::move(model), opts);
}

Result<std::unique_ptr<ForwardBackend>> make_cuda_backend(std::unique_ptr<M3ModelCuda> model,
                                                          const CudaBackendOptions& opts) {
  M3_CHECK(model != nullptr);
  if (opts.enforce_eager) model->set_use_graphs(false);
  if (!opts.cudagraph_capture_sizes.empty()) model->set_graph_sizes(opts.cudagraph_capture_sizes);
  const double util = opts.gpu_memory_utilization;
  M3_TRY_STATUS(check_gpu_memory_utilization(util));
  // The EAGLE-3 draft's weights first, so the free memory below is what both caches share.
  std::unique_ptr<Eagle3DraftCuda> draft;
  if (!opts.draft_model.empty()) {
    M3_TRY(draft,
           Eagle3DraftCuda::load(opts.draft_model, *model, opts.device, opts.synthetic_seed + 1));
  }
  const int64_t target_page_bytes = KvCache::page_bytes(model->config());  // KvCacheCuda: same
  // One page id is a page of the target's cache and one of the draft's.
  const int64_t draft_page_bytes = draft ? draft->kv_page_bytes() : 0;
  const int64_t page_bytes = target_page_bytes + draft_page_bytes;
  // Free memory now that the weights are resident (probe also reads cudaMemGetInfo).
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(opts.device));
  const double free_bytes = static_cast<double>(info.free_bytes);
  const std::string where = "cuda:" + std::to_string(opts.device) + " (" + info.name + ")";
  const bool explicit_bytes = opts.kv_cache_memory_bytes > 0;
  const std::string flag = explicit_bytes ? "--kv-cache-memory-bytes" : "--gpu-memory-utilization";
  double budget =
      explicit_bytes ? static_cast<double>(opts.kv_cache_memory_bytes) : free_bytes * util;
  if (explicit_bytes && budget > free_bytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--kv-cache-memory-bytes asks for " + mib(budget) + " of KV cache but " +
                          where + " has " + mib(free_bytes) +
                          " free after the weights; lower --kv-cache-memory-bytes",
                      flag);
  }
  const int64_t num_pages =
      std::min<int64_t>(static_cast<int64_t>(budget / static_cast<double>(page_bytes)), INT32_MAX);
  if (num_pages < 1) {
    const std::string how =
        explicit_bytes ? "--kv-cache-memory-bytes gives " + mib(budget)
                       : mib(free_bytes) + " free after the weights x --gpu-memory-utilization " +
                             fraction(util) + " = " + mib(budget);
    return make_error(ErrorCode::kInvalidArgument,
                      "no KV page fits on " + where + ": " + how + ", but one page (" +
                          std::to_string(model->config().sparse_block_size) + " tokens) needs " +
                          mib(static_cast<double>(page_bytes)) + "; raise " + flag +
                          ", free GPU memory, or use --device cpu",
                      flag);
  }
  const int64_t tokens = num_pages * model->config().sparse_block_size;
  const std::string source = explicit_bytes
                                 ? std::string("--kv-cache-memory-bytes")
                                 : mib(free_bytes) + " free after the weights x " + fraction(util);
  KvPoolFacts facts;
  facts.num_pages = num_pages;
  facts.page_size = model->config().sparse_block_size;
  facts.page_bytes = page_bytes;
  facts.where = where;
  facts.sized_by = explicit_bytes ? "--kv-cache-memory-bytes " + mib(budget) : source;
  facts.flag = explicit_bytes ? "--kv-cache-memory-bytes" : "--gpu-memory-utilization";
  M3_TRY_STATUS(check_max_model_len_fits(opts.max_model_len, facts));
  const std::string page_str = draft ? mib(static_cast<double>(page_bytes)) + " (target " +
                                           mib(static_cast<double>(target_page_bytes)) +
                                           " + EAGLE-3 draft " +
                                           mib(static_cast<double>(draft_page_bytes)) + ")"
                                     : mib(static_cast<double>(page_bytes));
  M3_LOG_INFO("KV cache on %s: %s (%s) = %lld pages of %s = %lld tokens", where.c_str(),
              mib(static_cast<double>(num_pages) * static_cast<double>(page_bytes)).c_str(),
              source.c_str(), static_cast<long long>(num_pages), page_str.c_str(),
              static_cast<long long>(tokens));
  if (draft) {
    draft->allocate_kv(num_pages);
    M3_LOG_INFO("EAGLE-3 draft %s on %s: weights %s, KV cache %s", opts.draft_model.c_str(),
                where.c_str(), mib(static_cast<double>(draft->weight_bytes())).c_str(),
                mib(static_cast<double>(draft->kv_bytes())).c_str());
  }
  auto backend =
      std::make_unique<CudaBackend>(std::move(model), nullptr, num_pages, opts.device, where);
  backend->set_kv_cache_flag(flag);
  if (draft) backend->set_draft(std::move(draft));
  if (opts.warmup_tokens > 0) {
    int64_t t = std::min(opts.warmup_tokens, tokens);
    if (opts.max_model_len > 0) t = std::min(t, opts.max_model_len);
    warm_up(*backend, t);
  }
  return std::unique_ptr<ForwardBackend>(std::move(backend));
}

std::unique_ptr<ForwardBackend> borrow_cuda_backend(M3ModelCuda& model, int64_t max_total_tokens,
                                                    int64_t max_seqs) {
  int device = 0;
  M3_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t pages =
      SequencePages::pages_needed(max_total_tokens, max_seqs, model.config().sparse_block_size);
  return std::make_unique<CudaBackend>(nullptr, &model, pages, device,
                                       "cuda:" + std::to_string(device));
}

}  // namespace m3::runtime
