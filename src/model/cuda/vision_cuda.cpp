#include "model/cuda/vision_cuda.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vision.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/synthetic_weights.h"
#include "model/vision_forward.h"

namespace m3::model {

namespace ops = kernels::cuda;
using kernels::MatRef;
using kernels::VecRef;

static_assert(static_cast<size_t>(VBuf::kCount) == 13, "VisionCudaOps::bufs_ has one per VBuf");

namespace {
// The attention's score chunk is capped here (more query rows per GEMM only saves launches).
constexpr size_t kAttnScoreCap = size_t{256} << 20;
}  // namespace

template <class T>
T* VisionCudaOps::ensure(gpu::DeviceBuffer<T>& b, int64_t n) {
  if (b.size() < static_cast<size_t>(n)) {
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));  // kernels may still read the old buffer
    b = gpu::DeviceBuffer<T>(static_cast<size_t>(n));
  }
  return b.data();
}

float* VisionCudaOps::f32(VBuf b, int64_t n) {
  return ensure(bufs_[static_cast<size_t>(b)], n);
}

const float* VisionCudaOps::upload(VBuf b, const std::vector<float>& host) {
  float* p = f32(b, static_cast<int64_t>(host.size()));
  // Pageable source: the call returns once the bytes are staged, so `host` may go right after.
  if (!host.empty())
    M3_CUDA_CHECK(
        cudaMemcpyAsync(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, s_));
  return p;
}

void VisionCudaOps::download(std::vector<float>& host, const float* src, int64_t n) {
  host.resize(static_cast<size_t>(n));
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(host.data(), src, static_cast<size_t>(n) * sizeof(float),
                                  cudaMemcpyDeviceToHost, s_));
  M3_CUDA_CHECK(cudaStreamSynchronize(s_));
}

void VisionCudaOps::copy(float* dst, const float* src, int64_t n) {
  // The forward copies the processor's patch rows (host) into a device buffer with this too.
  if (n > 0)
    M3_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDefault, s_));
}

void VisionCudaOps::linear(const float* x, int64_t n, const MatRef& w, float* y) {
  ops::linear(x, n, w, y, s_);
}

void VisionCudaOps::linear_bias(const float* x, int64_t n, const MatRef& w, const VecRef& b,
                                float* y) {
  ops::linear(x, n, w, y, s_);
  if (b.n > 0) ops::add_bias_rows(y, n, b, s_);
}

void VisionCudaOps::layer_norm(const float* x, int64_t rows, int64_t dim, const VecRef& w,
                               const VecRef& b, float eps, float* out) {
  ops::layer_norm(x, rows, dim, w, b, eps, out, s_);
}

void VisionCudaOps::gelu(float* x, int64_t n) {
  ops::gelu_erf(x, n, s_);
}

void VisionCudaOps::rope_cos_sin(float* x, int64_t n, int64_t heads, int64_t d, int64_t rot,
                                 const float* c, const float* s) {
  ops::rope_cos_sin(x, n, heads, d, rot, c, s, s_);
}

void VisionCudaOps::attention_segments(const float* q, const float* k, const float* v, int64_t n,
                                       int64_t heads, int64_t d, const std::vector<int64_t>& seg,
                                       float scale, float* out) {
  const int64_t num_segments = static_cast<int64_t>(seg.size()) - 1;
  int64_t longest = 1;
  for (int64_t s = 0; s < num_segments; ++s) longest = std::max(longest, seg[s + 1] - seg[s]);
  // As many query rows per GEMM as fit the cap (at least one; all of the longest segment's
  // when they fit).
  const size_t one = ops::attention_segments_workspace_bytes(n, heads, d, 1, longest);
  const size_t conv = ops::attention_segments_workspace_bytes(n, heads, d, 0, longest);
  const int64_t rows = std::clamp<int64_t>(
      static_cast<int64_t>(kAttnScoreCap / std::max<size_t>(one - conv, 1)), 1, longest);
  const size_t bytes = ops::attention_segments_workspace_bytes(n, heads, d, rows, longest);
  uint8_t* ws = ensure(attn_ws_, static_cast<int64_t>(bytes));
  ops::attention_segments(q, k, v, n, heads, d, seg.data(), num_segments, scale,
                          kernels::Workspace{ws, attn_ws_.size()}, out, s_);
}

void VisionCudaOps::add_inplace(float* x, const float* y, int64_t n) {
  ops::add_inplace(x, y, n, s_);
}

VisionTowerCuda::VisionTowerCuda(const M3Config& cfg, cudaStream_t stream)
    : cfg_(cfg), stream_(stream) {}

VisionTowerCuda::~VisionTowerCuda() = default;

void* VisionTowerCuda::alloc(size_t bytes) {
  return device_alloc(storage_, &bytes_, bytes);
}

MatRef VisionTowerCuda::put(const MatRef& m) {
  return device_copy(storage_, &bytes_, m, "vision tower");
}

VecRef VisionTowerCuda::put(const VecRef& v) {
  return device_copy(storage_, &bytes_, v);
}

void VisionTowerCuda::finish() {
  M3_CUDA_CHECK(cudaDeviceSynchronize());  // every weight has landed before a kernel reads it
  ops_ = std::make_unique<VisionCudaOps>(stream_);
  fw_ = std::make_unique<VisionForward<VisionCudaOps>>(cfg_, w_);
}

std::unique_ptr<VisionTowerCuda> VisionTowerCuda::upload(const M3Config& cfg,
                                                         const VisionWeights& h,
                                                         cudaStream_t stream) {
  std::unique_ptr<VisionTowerCuda> t(new VisionTowerCuda(cfg, stream));
  VisionWeights& d = t->w_;
  d.patch_embed = t->put(h.patch_embed);
  d.pre_ln_w = t->put(h.pre_ln_w);
  d.pre_ln_b = t->put(h.pre_ln_b);
  d.layers.resize(h.layers.size());
  for (size_t i = 0; i < h.layers.size(); ++i) {
    const VisionLayerWeights& s = h.layers[i];
    VisionLayerWeights& L = d.layers[i];
    for (auto [dst, src] : {std::pair{&L.ln1_w, &s.ln1_w},
                            {&L.ln1_b, &s.ln1_b},
                            {&L.ln2_w, &s.ln2_w},
                            {&L.ln2_b, &s.ln2_b},
                            {&L.q_b, &s.q_b},
                            {&L.k_b, &s.k_b},
                            {&L.v_b, &s.v_b},
                            {&L.o_b, &s.o_b},
                            {&L.fc1_b, &s.fc1_b},
                            {&L.fc2_b, &s.fc2_b}})
      *dst = t->put(*src);
    for (auto [dst, src] : {std::pair{&L.q, &s.q},
                            {&L.k, &s.k},
                            {&L.v, &s.v},
                            {&L.o, &s.o},
                            {&L.fc1, &s.fc1},
                            {&L.fc2, &s.fc2}})
      *dst = t->put(*src);
  }
  for (auto [dst, src] : {std::pair{&d.proj1, &h.proj1},
                          {&d.proj2, &h.proj2},
                          {&d.merge1, &h.merge1},
                          {&d.merge2, &h.merge2}})
    *dst = t->put(*src);
  for (auto [dst, src] : {std::pair{&d.proj1_b, &h.proj1_b},
                          {&d.proj2_b, &h.proj2_b},
                          {&d.merge1_b, &h.merge1_b},
                          {&d.merge2_b, &h.merge2_b}})
    *dst = t->put(*src);
  t->finish();
  return t;
}

int64_t VisionTowerCuda::weight_bytes(const M3Config& cfg) {
  const M3VisionConfig& v = cfg.vision;
  if (!v.present) return 0;
  const int64_t Hv = v.hidden_size, I = v.intermediate_size, P = v.projector_hidden_size,
                H = cfg.hidden_size, m2 = v.spatial_merge_size * v.spatial_merge_size;
  const int64_t mats = Hv * v.patch_row_size() + v.num_hidden_layers * (4 * Hv * Hv + 2 * Hv * I) +
                       P * Hv + H * P + P * m2 * H + H * P;
  const int64_t vecs = 2 * Hv + v.num_hidden_layers * (4 * Hv + 4 * Hv + I + Hv) +
                       (v.projector_bias ? 2 * (P + H) : 0);
  return 2 * mats + 4 * vecs;  // bf16 matrices; vectors at most f32
}

std::unique_ptr<VisionTowerCuda> VisionTowerCuda::synthetic(const M3Config& cfg, uint64_t seed,
                                                            cudaStream_t stream) {
  M3_CHECK(cfg.vision.present, "a synthetic vision tower needs cfg.vision");
  const M3VisionConfig& v = cfg.vision;
  std::unique_ptr<VisionTowerCuda> t(new VisionTowerCuda(cfg, stream));
  // Tensor ids far from the text model's (model/tensor_table.h numbers those from 0).
  uint64_t id = uint64_t{1} << 40;
  auto mat = [&](int64_t rows, int64_t cols) {
    auto* p = static_cast<uint16_t*>(t->alloc(static_cast<size_t>(rows * cols) * 2));
    const float bound = std::sqrt(3.0f / static_cast<float>(cols));  // std 1/sqrt(fan_in)
    fill_uniform_bf16(p, static_cast<size_t>(rows * cols), bound, seed, id++, stream);
    return MatRef{p, DType::kBF16, rows, cols};
  };
  std::mt19937 rng(static_cast<uint32_t>(seed ^ 0x5eedu));
  auto vec = [&](int64_t n, float center, float spread) {
    std::uniform_real_distribution<float> u(center - spread, center + spread);
    std::vector<float> h(static_cast<size_t>(n));
    for (auto& x : h) x = u(rng);
    void* p = t->alloc(h.size() * sizeof(float));
    t->storage_.back().copy_from(reinterpret_cast<const uint8_t*>(h.data()),
                                 h.size() * sizeof(float));
    return VecRef{p, DType::kF32, n};
  };
  const int64_t Hv = v.hidden_size, I = v.intermediate_size, P = v.projector_hidden_size,
                H = cfg.hidden_size, m2 = v.spatial_merge_size * v.spatial_merge_size;
  VisionWeights& d = t->w_;
  d.patch_embed = mat(Hv, v.patch_row_size());
  d.pre_ln_w = vec(Hv, 1.f, 0.05f);
  d.pre_ln_b = vec(Hv, 0.f, 0.02f);
  d.layers.resize(static_cast<size_t>(v.num_hidden_layers));
  for (VisionLayerWeights& L : d.layers) {
    L.ln1_w = vec(Hv, 1.f, 0.05f);
    L.ln1_b = vec(Hv, 0.f, 0.02f);
    L.ln2_w = vec(Hv, 1.f, 0.05f);
    L.ln2_b = vec(Hv, 0.f, 0.02f);
    L.q = mat(Hv, Hv);
    L.k = mat(Hv, Hv);
    L.v = mat(Hv, Hv);
    L.o = mat(Hv, Hv);
    L.fc1 = mat(I, Hv);
    L.fc2 = mat(Hv, I);
    L.q_b = vec(Hv, 0.f, 0.02f);
    L.k_b = vec(Hv, 0.f, 0.02f);
    L.v_b = vec(Hv, 0.f, 0.02f);
    L.o_b = vec(Hv, 0.f, 0.02f);
    L.fc1_b = vec(I, 0.f, 0.02f);
    L.fc2_b = vec(Hv, 0.f, 0.02f);
  }
  d.proj1 = mat(P, Hv);
  d.proj2 = mat(H, P);
  d.merge1 = mat(P, m2 * H);
  d.merge2 = mat(H, P);
  if (v.projector_bias) {
    d.proj1_b = vec(P, 0.f, 0.02f);
    d.proj2_b = vec(H, 0.f, 0.02f);
    d.merge1_b = vec(P, 0.f, 0.02f);
    d.merge2_b = vec(H, 0.f, 0.02f);
  }
  t->finish();
  return t;
}

void VisionTowerCuda::encode(std::span<const VisionImage> images, std::vector<float>* embeds,
                             std::vector<float>* tower_hidden) {
  fw_->run(*ops_, images, embeds, tower_hidden);
}

}  // namespace m3::model
