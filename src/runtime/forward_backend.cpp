#include "runtime/forward_backend.h"

#include "core/check.h"
#include "model/kv_cache.h"

namespace m3::runtime {

using namespace m3::model;  // the model this runtime runs

namespace {

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
    model_->forward(batch, cache_, out, capture_msa);
  }
  std::string device_name() const override { return "cpu"; }
  std::string kv_cache_flag() const override { return "--kv-cache-memory-bytes"; }
  bool supports_image_input() const override { return model_->vision() != nullptr; }
  std::string image_refusal() const override {
    if (!model_->config().vision.present)
      return "this model has no vision tower (config.json has no vision_config)";
    return "the vision tower is not loaded (the server runs with --language-model-only)";
  }
  void encode_images(std::span<const model::VisionImage> images,
                     std::vector<float>* embeds) override {
    model_->encode_images(images, embeds);
  }

 private:
  std::unique_ptr<M3Model> owned_;
  const M3Model* model_;
  model::KvCache cache_;
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
