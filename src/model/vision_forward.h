// VisionForward<Ops>: the vision tower's forward (m3-model.md §7), written once over an ops class
// like M3Forward: patch embedding (a matmul of the 1176-value rows), pre-LayerNorm, the pre-LN
// encoder layers (q/k/v with bias, 3-D RoPE from cos/sin tables, bidirectional attention inside
// segments, out_proj, GELU MLP), the projector (1280 -> P -> H, GELU) and the 2x2 patch merge
// (4 consecutive rows concatenated -> P -> H). `Ops` is model/vision_tower.cpp's VisionCpuOps
// today (the kernels/cpu/vision.h ops on host memory); a CUDA ops class with the same members
// is what the GPU path needs (model/cuda/vision_cuda.h's VisionCudaOps). Invariant: run()'s
// results depend only on its arguments and the weights; it keeps the RoPE tables of the last
// call's grids (the same image sizes recur), so it is not reentrant.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/vision_tower.h"

namespace m3::model {

enum class VBuf { kX, kA, kQ, kK, kV, kAttn, kO, kMlp, kProj, kProjH, kMerge, kCos, kSin, kCount };

template <class Ops>
class VisionForward {
 public:
  VisionForward(const M3Config& cfg, const VisionWeights& w) : cfg_(cfg), v_(cfg.vision), w_(w) {}

  // Rotary dims per head for the config's layout.
  int64_t rot_dim() const {
    const int64_t d = v_.head_dim();
    if (v_.rope_layout == VisionRopeLayout::kTransformers) return d;
    return 3 * (2 * ((2 * (d / 2) / 3) / 2));
  }

  // cos/sin [n, rot_dim] for the patches of `images` in order (merge-window row order), in fp32
  // as transformers computes them (fp32 inverse frequencies and angles).
  void rope_tables(std::span<const VisionImage> images, std::vector<float>& cos,
                   std::vector<float>& sin) const {
    const int64_t d = v_.head_dim(), m = v_.spatial_merge_size, rd = rot_dim();
    const bool hf = v_.rope_layout == VisionRopeLayout::kTransformers;
    const int64_t axis = hf ? d / 2 : rd / 3;  // the divisor of the exponent
    const int64_t nf = hf ? d / 4 : axis / 2;  // frequencies per axis
    std::vector<float> inv(nf);
    for (int64_t i = 0; i < nf; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(axis);
      inv[i] = 1.0f / std::pow(static_cast<float>(v_.rope_theta), e);
    }
    int64_t n = 0;
    for (const auto& im : images) n += im.num_patches();
    cos.resize(n * rd);
    sin.resize(n * rd);
    int64_t row = 0;
    for (const auto& im : images) {
      for (int64_t t = 0; t < im.grid_t; ++t)
        for (int64_t bh = 0; bh < im.grid_h / m; ++bh)
          for (int64_t bw = 0; bw < im.grid_w / m; ++bw)
            for (int64_t mh = 0; mh < m; ++mh)
              for (int64_t mw = 0; mw < m; ++mw, ++row) {
                const float pos[3] = {static_cast<float>(t), static_cast<float>(bh * m + mh),
                                      static_cast<float>(bw * m + mw)};
                // kTransformers: axes (t, h); kReference: (t, h, w). Then duplicated.
                const int64_t naxes = hf ? 2 : 3;
                float* c = cos.data() + row * rd;
                float* s = sin.data() + row * rd;
                for (int64_t a = 0; a < naxes; ++a)
                  for (int64_t i = 0; i < nf; ++i) {
                    const float ang = pos[a] * inv[i];
                    c[a * nf + i] = c[a * nf + i + rd / 2] = std::cos(ang);
                    s[a * nf + i] = s[a * nf + i + rd / 2] = std::sin(ang);
                  }
              }
    }
  }

  // embeds [sum tokens, H]; tower_hidden (may be null) [sum patches, vision hidden].
  void run(Ops& ops, std::span<const VisionImage> images, std::vector<float>* embeds,
           std::vector<float>* tower_hidden) const {
    const int64_t Hv = v_.hidden_size, nh = v_.num_attention_heads, d = v_.head_dim();
    const int64_t row = v_.patch_row_size(), m2 = v_.spatial_merge_size * v_.spatial_merge_size;
    const int64_t H = cfg_.hidden_size, P = v_.projector_hidden_size;
    const float eps = static_cast<float>(v_.layer_norm_eps);
    int64_t n = 0;
    std::vector<int64_t> seg{0};
    for (const auto& im : images) {
      M3_CHECK(im.grid_h % v_.spatial_merge_size == 0 && im.grid_w % v_.spatial_merge_size == 0,
               "vision grid %lldx%lld is not a multiple of the merge size",
               static_cast<long long>(im.grid_h), static_cast<long long>(im.grid_w));
      n += im.num_patches();
      if (v_.rope_layout == VisionRopeLayout::kReference) seg.push_back(n);
    }
    if (v_.rope_layout == VisionRopeLayout::kTransformers) seg.push_back(n);
    if (n == 0) {
      embeds->clear();
      return;
    }
    // x: [n, Hv] f32 the residual stream; the patch rows are gathered contiguously first.
    float* pix = ops.f32(VBuf::kMlp, n * std::max(row, v_.intermediate_size));
    {
      int64_t r = 0;
      for (const auto& im : images) {
        ops.copy(pix + r * row, im.patches, im.num_patches() * row);
        r += im.num_patches();
      }
    }
    float* x = ops.f32(VBuf::kX, n * Hv);
    ops.linear(pix, n, w_.patch_embed, x);
    ops.layer_norm(x, n, Hv, w_.pre_ln_w, w_.pre_ln_b, eps, x);
    // The tables depend only on the grids: recomputed when they change (host trigonometry of
    // ~2e5 values at 2304 patches, which the GPU would otherwise wait for).
    std::vector<int64_t> key;
    for (const auto& im : images) key.insert(key.end(), {im.grid_t, im.grid_h, im.grid_w});
    if (key != rope_key_) {
      rope_tables(images, rope_cos_, rope_sin_);
      rope_key_ = std::move(key);
    }
    const float* dcos = ops.upload(VBuf::kCos, rope_cos_);
    const float* dsin = ops.upload(VBuf::kSin, rope_sin_);
    float* a = ops.f32(VBuf::kA, n * Hv);
    float* q = ops.f32(VBuf::kQ, n * Hv);
    float* k = ops.f32(VBuf::kK, n * Hv);
    float* v = ops.f32(VBuf::kV, n * Hv);
    float* attn = ops.f32(VBuf::kAttn, n * Hv);
    float* o = ops.f32(VBuf::kO, n * Hv);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (const VisionLayerWeights& L : w_.layers) {
      ops.layer_norm(x, n, Hv, L.ln1_w, L.ln1_b, eps, a);
      ops.linear_bias(a, n, L.q, L.q_b, q);
      ops.linear_bias(a, n, L.k, L.k_b, k);
      ops.linear_bias(a, n, L.v, L.v_b, v);
      ops.rope_cos_sin(q, n, nh, d, rot_dim(), dcos, dsin);
      ops.rope_cos_sin(k, n, nh, d, rot_dim(), dcos, dsin);
      ops.attention_segments(q, k, v, n, nh, d, seg, scale, attn);
      ops.linear_bias(attn, n, L.o, L.o_b, o);
      ops.add_inplace(x, o, n * Hv);
      ops.layer_norm(x, n, Hv, L.ln2_w, L.ln2_b, eps, a);
      float* h = ops.f32(VBuf::kMlp, n * std::max(row, v_.intermediate_size));
      ops.linear_bias(a, n, L.fc1, L.fc1_b, h);
      ops.gelu(h, n * v_.intermediate_size);
      ops.linear_bias(h, n, L.fc2, L.fc2_b, o);
      ops.add_inplace(x, o, n * Hv);
    }
    if (tower_hidden != nullptr) ops.download(*tower_hidden, x, n * Hv);
    // Projector per patch, then the merge of each m2 consecutive rows ([n/m2, m2*H] is the same
    // memory as [n, H]).
    float* ph = ops.f32(VBuf::kProjH, n * P);
    float* y = ops.f32(VBuf::kProj, n * H);
    ops.linear_bias(x, n, w_.proj1, w_.proj1_b, ph);
    ops.gelu(ph, n * P);
    ops.linear_bias(ph, n, w_.proj2, w_.proj2_b, y);
    const int64_t nt = n / m2;
    float* mh = ops.f32(VBuf::kProjH, n * P);
    ops.linear_bias(y, nt, w_.merge1, w_.merge1_b, mh);
    ops.gelu(mh, nt * P);
    float* out = ops.f32(VBuf::kMerge, nt * H);
    ops.linear_bias(mh, nt, w_.merge2, w_.merge2_b, out);
    ops.download(*embeds, out, nt * H);
  }

 private:
  const M3Config& cfg_;
  const M3VisionConfig& v_;
  const VisionWeights& w_;
  mutable std::vector<int64_t> rope_key_;  // (t, h, w) of each image of the last call
  mutable std::vector<float> rope_cos_, rope_sin_;
};

}  // namespace m3::model
