#include "model/vision_tower.h"

#include <array>
#include <string>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/vision.h"
#include "model/vision_forward.h"

namespace m3::model {

// The tower's ops on the CPU: kernels/cpu/vision.h and kernels/cpu/ops.h on host vectors.
class VisionCpuOps {
 public:
  float* f32(VBuf b, int64_t n) {
    auto& v = bufs_[static_cast<size_t>(b)];
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    return v.data();
  }
  const float* upload(VBuf b, const std::vector<float>& host) {
    float* p = f32(b, static_cast<int64_t>(host.size()));
    std::copy(host.begin(), host.end(), p);
    return p;
  }
  void download(std::vector<float>& host, const float* src, int64_t n) {
    host.assign(src, src + n);
  }
  void copy(float* dst, const float* src, int64_t n) { kernels::cpu::copy(dst, src, n); }
  void linear(const float* x, int64_t n, const kernels::MatRef& w, float* y) {
    kernels::cpu::linear(x, n, w, y);
  }
  void linear_bias(const float* x, int64_t n, const kernels::MatRef& w, const kernels::VecRef& b,
                   float* y) {
    kernels::cpu::linear(x, n, w, y);
    if (b.n > 0) kernels::cpu::add_bias_rows(y, n, b);
  }
  void layer_norm(const float* x, int64_t rows, int64_t dim, const kernels::VecRef& w,
                  const kernels::VecRef& b, float eps, float* out) {
    kernels::cpu::layer_norm(x, rows, dim, w, b, eps, out);
  }
  void gelu(float* x, int64_t n) { kernels::cpu::gelu_erf(x, n); }
  void rope_cos_sin(float* x, int64_t n, int64_t heads, int64_t d, int64_t rot, const float* c,
                    const float* s) {
    kernels::cpu::rope_cos_sin(x, n, heads, d, rot, c, s);
  }
  void attention_segments(const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, const std::vector<int64_t>& seg, float scale, float* out) {
    kernels::cpu::attention_segments(q, k, v, n, heads, d, seg.data(),
                                     static_cast<int64_t>(seg.size()) - 1, scale, out);
  }
  void add_inplace(float* x, const float* y, int64_t n) { kernels::cpu::add_inplace(x, y, n); }

 private:
  std::array<std::vector<float>, static_cast<size_t>(VBuf::kCount)> bufs_;
};

namespace {

class Loader {
 public:
  explicit Loader(const Checkpoint& ck) : ck_(ck) {}
  Result<kernels::MatRef> mat(const std::string& name, std::vector<int64_t> shape) {
    M3_TRY(const TensorInfo* ti, ck_.get(name, shape, {DType::kBF16, DType::kF32}));
    int64_t cols = 1;
    for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
    return kernels::MatRef{ti->data, ti->dtype, shape[0], cols};
  }
  Result<kernels::VecRef> vec(const std::string& name, int64_t n) {
    M3_TRY(const TensorInfo* ti, ck_.get(name, {n}, {DType::kBF16, DType::kF32}));
    return kernels::VecRef{ti->data, ti->dtype, n};
  }
  // A bias that exists only when the config says the projector has biases.
  Result<kernels::VecRef> bias(const std::string& name, int64_t n, bool present) {
    if (!present) return kernels::VecRef{};
    return vec(name, n);
  }
  bool has(const std::string& name) const { return ck_.has(name); }

 private:
  const Checkpoint& ck_;
};

}  // namespace

Result<std::unique_ptr<VisionWeights>> load_vision_weights(std::shared_ptr<Checkpoint> ckpt,
                                                           const M3Config& cfg) {
  const M3VisionConfig& v = cfg.vision;
  if (!v.present) {
    return make_error(ErrorCode::kNotFound,
                      "config.json has no vision_config: this checkpoint has no vision tower");
  }
  auto w = std::make_unique<VisionWeights>();
  Loader ld(*ckpt);
  const std::string root = "vision_tower.vision_model.";
  const int64_t Hv = v.hidden_size, I = v.intermediate_size, P = v.projector_hidden_size,
                H = cfg.hidden_size, m2 = v.spatial_merge_size * v.spatial_merge_size;
  M3_TRY(w->patch_embed,
         ld.mat(root + "embeddings.patch_embedding.weight",
                {Hv, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size}));
  M3_TRY(w->pre_ln_w, ld.vec(root + "pre_layrnorm.weight", Hv));
  M3_TRY(w->pre_ln_b, ld.vec(root + "pre_layrnorm.bias", Hv));
  w->layers.resize(static_cast<size_t>(v.num_hidden_layers));
  for (int64_t i = 0; i < v.num_hidden_layers; ++i) {
    VisionLayerWeights& L = w->layers[i];
    const std::string p = root + "encoder.layers." + std::to_string(i) + ".";
    const std::string mlp =
        ld.has(p + "mlp.fc1.weight") || !ld.has(p + "block_sparse_moe.fc1.weight")
            ? p + "mlp."
            : p + "block_sparse_moe.";
    M3_TRY(L.ln1_w, ld.vec(p + "layer_norm1.weight", Hv));
    M3_TRY(L.ln1_b, ld.vec(p + "layer_norm1.bias", Hv));
    M3_TRY(L.ln2_w, ld.vec(p + "layer_norm2.weight", Hv));
    M3_TRY(L.ln2_b, ld.vec(p + "layer_norm2.bias", Hv));
    M3_TRY(L.q, ld.mat(p + "self_attn.q_proj.weight", {Hv, Hv}));
    M3_TRY(L.k, ld.mat(p + "self_attn.k_proj.weight", {Hv, Hv}));
    M3_TRY(L.v, ld.mat(p + "self_attn.v_proj.weight", {Hv, Hv}));
    M3_TRY(L.o, ld.mat(p + "self_attn.out_proj.weight", {Hv, Hv}));
    M3_TRY(L.q_b, ld.vec(p + "self_attn.q_proj.bias", Hv));
    M3_TRY(L.k_b, ld.vec(p + "self_attn.k_proj.bias", Hv));
    M3_TRY(L.v_b, ld.vec(p + "self_attn.v_proj.bias", Hv));
    M3_TRY(L.o_b, ld.vec(p + "self_attn.out_proj.bias", Hv));
    M3_TRY(L.fc1, ld.mat(mlp + "fc1.weight", {I, Hv}));
    M3_TRY(L.fc1_b, ld.vec(mlp + "fc1.bias", I));
    M3_TRY(L.fc2, ld.mat(mlp + "fc2.weight", {Hv, I}));
    M3_TRY(L.fc2_b, ld.vec(mlp + "fc2.bias", Hv));
  }
  const bool pb = v.projector_bias;
  M3_TRY(w->proj1, ld.mat("multi_modal_projector.linear_1.weight", {P, Hv}));
  M3_TRY(w->proj1_b, ld.bias("multi_modal_projector.linear_1.bias", P, pb));
  M3_TRY(w->proj2, ld.mat("multi_modal_projector.linear_2.weight", {H, P}));
  M3_TRY(w->proj2_b, ld.bias("multi_modal_projector.linear_2.bias", H, pb));
  M3_TRY(w->merge1, ld.mat("patch_merge_mlp.linear_1.weight", {P, m2 * H}));
  M3_TRY(w->merge1_b, ld.bias("patch_merge_mlp.linear_1.bias", P, pb));
  M3_TRY(w->merge2, ld.mat("patch_merge_mlp.linear_2.weight", {H, P}));
  M3_TRY(w->merge2_b, ld.bias("patch_merge_mlp.linear_2.bias", H, pb));
  w->checkpoint = std::move(ckpt);
  return w;
}

VisionTower::VisionTower(const M3Config& cfg, std::unique_ptr<VisionWeights> w)
    : cfg_(cfg),
      w_(std::move(w)),
      ops_(std::make_unique<VisionCpuOps>()),
      fw_(std::make_unique<VisionForward<VisionCpuOps>>(cfg_, *w_)) {}

VisionTower::~VisionTower() = default;

Result<std::unique_ptr<VisionTower>> VisionTower::load(std::shared_ptr<Checkpoint> ckpt,
                                                       const M3Config& cfg) {
  M3_TRY(auto w, load_vision_weights(std::move(ckpt), cfg));
  return std::make_unique<VisionTower>(cfg, std::move(w));
}

int64_t VisionTower::num_tokens(const VisionImage& img) const {
  const int64_t m = cfg_.vision.spatial_merge_size;
  return img.num_patches() / (m * m);
}

void VisionTower::encode(std::span<const VisionImage> images, std::vector<float>* embeds,
                         std::vector<float>* tower_hidden) const {
  fw_->run(*ops_, images, embeds, tower_hidden);
}

}  // namespace m3::model
