// The vision tower on the CPU at MiniMax-M3's shapes (m3-model.md §1.4, §2.4: 32 layers, hidden
// 1280, 16 heads, MLP 5120, projector 6144, text hidden 6144) on synthetic bf16 weights: the
// processor (resize, normalise, patch rows) and the tower + projector + merge for one image, with
// the FLOPs they do and the rate reached. Usage:
//   bench_vision_tower [--size WxH] [--layers N] [--reps R]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "model/vision_tower.h"
#include "vision/image_processor.h"

using namespace m3;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Synthetic bf16 values of std ~1/sqrt(cols) (a fixed hash of the index: reproducible).
struct Store {
  std::vector<std::vector<uint16_t>> bufs;
  kernels::MatRef mat(int64_t rows, int64_t cols, uint64_t seed) {
    bufs.emplace_back(static_cast<size_t>(rows * cols));
    auto& b = bufs.back();
    const float scale = 1.7f / std::sqrt(static_cast<float>(cols));
    uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
    for (auto& v : b) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      v = f32_to_bf16((static_cast<float>(x >> 40) / 16777216.0f - 0.5f) * scale);
    }
    return kernels::MatRef{b.data(), DType::kBF16, rows, cols};
  }
  kernels::VecRef vec(int64_t n, float value) {
    bufs.emplace_back(static_cast<size_t>(n), f32_to_bf16(value));
    return kernels::VecRef{bufs.back().data(), DType::kBF16, n};
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t w = 672, h = 672, layers = 32, reps = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--size") {
      std::sscanf(argv[i + 1], "%ldx%ld", &w, &h);
    } else if (a == "--layers") {
      layers = std::atol(argv[i + 1]);
    } else if (a == "--reps") {
      reps = std::atol(argv[i + 1]);
    }
  }
  model::M3Config cfg;
  cfg.hidden_size = 6144;
  cfg.vision.present = true;
  cfg.vision.num_hidden_layers = layers;
  const auto& v = cfg.vision;
  const int64_t Hv = v.hidden_size, I = v.intermediate_size, P = v.projector_hidden_size,
                H = cfg.hidden_size;
  Store st;
  auto wts = std::make_unique<model::VisionWeights>();
  uint64_t seed = 1;
  wts->patch_embed = st.mat(Hv, v.patch_row_size(), seed++);
  wts->pre_ln_w = st.vec(Hv, 1.0f);
  wts->pre_ln_b = st.vec(Hv, 0.0f);
  wts->layers.resize(static_cast<size_t>(layers));
  for (auto& L : wts->layers) {
    L.ln1_w = L.ln2_w = st.vec(Hv, 1.0f);
    L.ln1_b = L.ln2_b = st.vec(Hv, 0.0f);
    L.q = st.mat(Hv, Hv, seed++);
    L.k = st.mat(Hv, Hv, seed++);
    L.v = st.mat(Hv, Hv, seed++);
    L.o = st.mat(Hv, Hv, seed++);
    L.fc1 = st.mat(I, Hv, seed++);
    L.fc2 = st.mat(Hv, I, seed++);
    L.q_b = L.k_b = L.v_b = L.o_b = L.fc2_b = st.vec(Hv, 0.01f);
    L.fc1_b = st.vec(I, 0.01f);
  }
  wts->proj1 = st.mat(P, Hv, seed++);
  wts->proj2 = st.mat(H, P, seed++);
  wts->merge1 = st.mat(P, 4 * H, seed++);
  wts->merge2 = st.mat(H, P, seed++);
  wts->proj1_b = wts->merge1_b = st.vec(P, 0.01f);
  wts->proj2_b = wts->merge2_b = st.vec(H, 0.01f);
  model::VisionTower tower(cfg, std::move(wts));

  vision::RgbImage img;
  img.width = w;
  img.height = h;
  img.rgb.resize(static_cast<size_t>(w * h * 3));
  for (size_t i = 0; i < img.rgb.size(); ++i)
    img.rgb[i] = static_cast<uint8_t>((i * 2654435761u) >> 24);
  double t0 = now_s();
  auto p = vision::preprocess_image(img, vision::ProcessorConfig{});
  const double t_proc = now_s() - t0;
  if (!p) {
    std::fprintf(stderr, "%s\n", p.error().message.c_str());
    return 1;
  }
  const int64_t n = p->num_patches(), nt = n / 4;
  const double flops = 2.0 * n * Hv * v.patch_row_size() +
                       layers * (2.0 * n * (4.0 * Hv * Hv + 2.0 * Hv * I) + 4.0 * n * n * Hv) +
                       2.0 * n * (Hv * P + P * H) + 2.0 * nt * (4 * H * P + P * H);
  model::VisionImage vi{p->grid_t, p->grid_h, p->grid_w, p->pixel_values.data()};
  std::vector<float> emb;
  double best = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    t0 = now_s();
    tower.encode({&vi, 1}, &emb);
    best = std::min(best, now_s() - t0);
  }
  std::printf(
      "image %ldx%ld -> %ldx%ld px, %ld patches, %ld tokens; processor %.1f ms; tower (%ld "
      "layers) + projector + merge %.3f s = %.3f images/s, %.1f GFLOP at %.1f GFLOP/s\n",
      w, h, p->resized_w, p->resized_h, n, nt, t_proc * 1e3, layers, best, 1.0 / best, flops / 1e9,
      flops / best / 1e9);
  return 0;
}
