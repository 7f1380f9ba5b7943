#include "runtime/forward_backend.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/check.h"
#include "kernels/cpu/sample.h"
#include "model/eagle3_draft.h"
#include "model/kv_cache.h"

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

Status ForwardBackend::enable_host_kv_tier(int64_t /*num_slots*/) {
  return make_error(ErrorCode::kUnsupported,
                    "the host KV tier (--kv-transfer-config offloading, --kv-offloading-size) is "
                    "implemented for the single-rank CPU backend and one GPU "
                    "(--tensor-parallel-size 1, --data-parallel-size 1) so far; the " +
                        device_name() +
                        " backend keeps its KV cache on the device: drop the offloading flag",
                    "--kv-transfer-config");
}

void ForwardBackend::copy_host_kv_pages(std::span<const HostPageCopy> offloads,
                                        std::span<const HostPageCopy> restores) {
  M3_CHECK(offloads.empty() && restores.empty(), "%s backend: host KV copies without a tier",
           device_name().c_str());
}

Result<std::unique_ptr<DraftProposer>> ForwardBackend::make_draft(
    const std::string& model, std::shared_ptr<const M3Weights> target_weights) {
  if (is_synthetic_draft(model)) {
    return make_error(ErrorCode::kUnsupported,
                      "the synthetic draft '" + model +
                          "' (random weights, benchmarks only) is generated on the GPU; serve "
                          "on one GPU (--device cuda) or give an EAGLE-3 draft directory",
                      "--speculative-config");
  }
  M3_TRY(auto draft, Eagle3Draft::load(model, config(), std::move(target_weights), num_pages()));
  return host_draft_proposer(std::move(draft));
}

void ForwardBackend::launch(const ForwardBatch& batch) {
  M3_CHECK(samples_on_device(), "%s backend: launch() needs device sampling",
           device_name().c_str());
  M3_CHECK(launched_.size() < 2, "%s backend: a third step launched before collect()",
           device_name().c_str());
  M3_CHECK(batch.prev_sample_tokens.size() == batch.prev_sample_slots.size());
  launched_.emplace_back();
  if (batch.prev_sample_tokens.empty()) {
    forward(batch, &launched_.back(), /*capture_msa=*/false);
  } else {
    ForwardBatch b = batch;
    for (size_t i = 0; i < b.prev_sample_tokens.size(); ++i) {
      const int32_t t = b.prev_sample_tokens[i], slot = b.prev_sample_slots[i];
      M3_CHECK(t >= 0 && t < static_cast<int32_t>(b.token_ids.size()) && slot >= 0 &&
                   slot < static_cast<int32_t>(last_sampled_.size()),
               "launch: previous sample %d for token %d of %zu (%zu sampled)", slot, t,
               b.token_ids.size(), last_sampled_.size());
      b.token_ids[t] = last_sampled_[slot];
    }
    b.prev_sample_tokens.clear();
    b.prev_sample_slots.clear();
    forward(b, &launched_.back(), /*capture_msa=*/false);
  }
  last_sampled_ = launched_.back().sampled;
}

void ForwardBackend::collect(ForwardResult* out) {
  M3_CHECK(!launched_.empty(), "%s backend: collect() without a launched step",
           device_name().c_str());
  *out = std::move(launched_.front());
  launched_.pop_front();
}

namespace {

// Copies page `src_page` of `src` into page `dst_page` of `dst` for every layer (same config
// and heads: the byte strides per page match).
void copy_page(KvCache& src, int64_t src_page, KvCache& dst, int64_t dst_page, int64_t layers) {
  for (int64_t i = 0; i < layers; ++i) {
    const auto s = src.layer(i);
    const auto d = dst.layer(i);
    M3_CHECK(src_page >= 0 && src_page < s.num_pages && dst_page >= 0 && dst_page < d.num_pages,
             "KV page copy %lld -> %lld out of range", static_cast<long long>(src_page),
             static_cast<long long>(dst_page));
    auto chunk = [&](void* to, const void* from, int64_t page_bytes) {
      std::memcpy(static_cast<char*>(to) + dst_page * page_bytes,
                  static_cast<const char*>(from) + src_page * page_bytes, page_bytes);
    };
    const int64_t kv =
        s.page_size * s.num_kv_heads * s.head_dim * kernels::kv_dtype_size(s.kv_dtype);
    chunk(d.k, s.k, kv);
    chunk(d.v, s.v, kv);
    if (s.ik != nullptr)
      chunk(d.ik, s.ik, s.page_size * s.index_dim * kernels::kv_dtype_size(s.ik_dtype));
    if (s.ik_scale != nullptr)
      chunk(d.ik_scale, s.ik_scale, s.page_size * static_cast<int64_t>(sizeof(float)));
  }
}

class CpuBackend final : public ForwardBackend {
 public:
  // The cache keeps a pointer to the model's config, so the model is built first and outlives it
  // (members are destroyed in reverse order). `model` null: `borrowed` is used, not owned.
  CpuBackend(std::unique_ptr<M3Model> model, const M3Model* borrowed, int64_t num_pages)
      : owned_(std::move(model)),
        model_(owned_ ? owned_.get() : borrowed),
        cache_(model_->config(), num_pages, model_->cache_kv_heads()) {}

  const M3Config& config() const override { return model_->config(); }
  int64_t num_pages() const override { return cache_.num_pages(); }
  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    M3_CHECK(batch.prev_sample_tokens.empty(), "cpu backend: previous samples outside launch()");
    model_->forward(batch, cache_, out, capture_msa);
    if (!batch.device_samples.empty()) sample_rows_here(batch, out);
  }
  // The rows the engine would send to a GPU's sampler are drawn here with the same CPU sampler
  // its host path calls (kernels::cpu::sample_rows, the GPU kernel's oracle), so the tokens do not
  // change; this is what lets the engine's async pipeline run on the CPU backend too.
  bool samples_on_device() const override { return true; }
  std::string device_name() const override { return "cpu"; }
  std::string speculative_refusal() const override { return ""; }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }
  bool supports_image_input() const override { return model_->vision() != nullptr; }
  std::string image_refusal() const override { return missing_tower_refusal(model_->config()); }
  void encode_images(std::span<const model::VisionImage> images,
                     std::vector<float>* embeds) override {
    model_->encode_images(images, embeds);
  }

  // A second KvCache of `num_slots` pages: the host tier is ordinary host memory like the pool.
  Status enable_host_kv_tier(int64_t num_slots) override {
    M3_CHECK(num_slots >= 1, "host KV tier of %lld pages", static_cast<long long>(num_slots));
    host_.emplace(model_->config(), num_slots, model_->cache_kv_heads());
    return {};
  }
  void copy_host_kv_pages(std::span<const HostPageCopy> offloads,
                          std::span<const HostPageCopy> restores) override {
    if (offloads.empty() && restores.empty()) return;
    M3_CHECK(host_.has_value(), "host KV copies without a tier");
    const int64_t layers = model_->config().num_hidden_layers;
    for (const HostPageCopy& c : offloads)
      copy_page(cache_, c.device_page, *host_, c.host_slot, layers);
    for (const HostPageCopy& c : restores)
      copy_page(*host_, c.host_slot, cache_, c.device_page, layers);
  }
  std::vector<KvRegion> kv_regions() override {
    std::vector<KvRegion> out;
    const int64_t layers = model_->config().num_hidden_layers;
    for (int64_t i = 0; i < layers; ++i) {
      const auto p = cache_.layer(i);
      const int64_t kv =
          p.page_size * p.num_kv_heads * p.head_dim * kernels::kv_dtype_size(p.kv_dtype);
      out.push_back({p.k, kv, p.num_pages});
      out.push_back({p.v, kv, p.num_pages});
      if (p.ik != nullptr)
        out.push_back(
            {p.ik, p.page_size * p.index_dim * kernels::kv_dtype_size(p.ik_dtype), p.num_pages});
      if (p.ik_scale != nullptr)
        out.push_back({p.ik_scale, p.page_size * static_cast<int64_t>(sizeof(float)), p.num_pages});
    }
    return out;
  }

 private:
  // ForwardBatch::device_samples over the full logits M3Model::forward returned; then only the
  // host_logits_rows stay in out->logits (the GPU backend's result layout).
  static void sample_rows_here(const ForwardBatch& b, ForwardResult* out) {
    const int64_t V = out->vocab_size;
    const int64_t R = static_cast<int64_t>(b.logits_indices.size());
    M3_CHECK(static_cast<int64_t>(out->logits.size()) == R * V, "cpu backend: %zu logits",
             out->logits.size());
    const int64_t valid = b.num_sampleable > 0 ? std::min<int64_t>(b.num_sampleable, V) : V;
    for (const auto& sr : b.device_samples)
      M3_CHECK(sr.row >= 0 && sr.row < R, "device sample row %d of %lld", sr.row,
               static_cast<long long>(R));
    out->sampled.assign(b.device_samples.size(), 0);
    kernels::cpu::sample_rows(out->logits.data(), V, valid, b.device_samples.data(),
                              static_cast<int64_t>(b.device_samples.size()), out->sampled.data());
    std::vector<float> kept(b.host_logits_rows.size() * V);
    for (size_t j = 0; j < b.host_logits_rows.size(); ++j) {
      const int32_t r = b.host_logits_rows[j];
      M3_CHECK(r >= 0 && r < R, "host logits row %d of %lld", r, static_cast<long long>(R));
      std::copy_n(out->logits.data() + static_cast<int64_t>(r) * V, V, kept.data() + j * V);
    }
    out->logits = std::move(kept);
    out->logits_rows = b.host_logits_rows;
  }

  std::unique_ptr<M3Model> owned_;
  const M3Model* model_;
  model::KvCache cache_;
  std::optional<model::KvCache> host_;
};

}  // namespace

Result<std::unique_ptr<ForwardBackend>> make_cpu_backend(std::unique_ptr<M3Model> model,
                                                         int64_t num_pages) {
  M3_CHECK(model != nullptr);
  if (!model->has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "the model " + model->config().model_type +
                          " has no weights on the host (a synthetic model is generated on the "
                          "GPU and is too big for the CPU path); use --device cuda",
                      "--device");
  }
  if (num_pages < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the CPU KV cache would have " + std::to_string(num_pages) +
                          " pages; raise --kv-cache-memory-bytes to at least " +
                          std::to_string(model::KvCache::page_bytes(model->config())) +
                          " (one page)",
                      "--kv-cache-memory-bytes");
  }
  return std::unique_ptr<ForwardBackend>(new CpuBackend(std::move(model), nullptr, num_pages));
}

std::unique_ptr<ForwardBackend> borrow_cpu_backend(const M3Model& model, int64_t num_pages) {
  M3_CHECK(model.has_weights() && num_pages >= 1);
  return std::unique_ptr<ForwardBackend>(new CpuBackend(nullptr, &model, num_pages));
}

}  // namespace m3::runtime
