#include "kernels/cpu/vision.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"

namespace m3::kernels::cpu {

void layer_norm(const float* x, int64_t rows, int64_t dim, const VecRef& w, const VecRef& b,
                float eps, float* out) {
  M3_CHECK(w.n == dim && b.n == dim, "layer_norm: weight %lld / bias %lld for dim %lld",
           static_cast<long long>(w.n), static_cast<long long>(b.n), static_cast<long long>(dim));
  std::vector<float> wf(dim), bf(dim);
  w.to_f32(wf.data());
  b.to_f32(bf.data());
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      double mean = 0.0;
      for (int64_t i = 0; i < dim; ++i) mean += xr[i];
      mean /= static_cast<double>(dim);
      double var = 0.0;
      for (int64_t i = 0; i < dim; ++i) {
        const double d = xr[i] - mean;
        var += d * d;
      }
      var /= static_cast<double>(dim);
      const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
      const float m = static_cast<float>(mean);
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] - m) * inv * wf[i] + bf[i];
    }
  });
}

void add_bias_rows(float* y, int64_t rows, const VecRef& bias) {
  const int64_t n = bias.n;
  std::vector<float> bf(n);
  bias.to_f32(bf.data());
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] += bf[i];
  }
}

void gelu_erf(float* x, int64_t n) {
  parallel_for(
      n,
      [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const float v = x[i];
          x[i] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
        }
      },
      4096);
}

void rope_cos_sin(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
                  const float* cos, const float* sin) {
  M3_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim, "rope_cos_sin: rot_dim %lld of head_dim %lld",
           static_cast<long long>(rot_dim), static_cast<long long>(head_dim));
  const int64_t half = rot_dim / 2;
  parallel_for(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + t * rot_dim;
      const float* s = sin + t * rot_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* xh = x + (t * num_heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xh[i], x2 = xh[i + half];
          xh[i] = x1 * c[i] - x2 * s[i];
          xh[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

void attention_segments(const float* q, const float* k, const float* v, int64_t n,
                        int64_t num_heads, int64_t head_dim, const int64_t* seg_starts,
                        int64_t num_segments, float scale, float* out) {
  M3_CHECK(num_segments >= 1 && seg_starts[0] == 0 && seg_starts[num_segments] == n,
           "attention_segments: segments do not cover the %lld tokens", static_cast<long long>(n));
  const int64_t stride = num_heads * head_dim;
  // One work item per (token, head); each finds its segment by binary search.
  parallel_for(n * num_heads, [&](int64_t w0, int64_t w1) {
    std::vector<float> p;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / num_heads, h = w % num_heads;
      const int64_t s =
          std::upper_bound(seg_starts, seg_starts + num_segments + 1, t) - seg_starts - 1;
      const int64_t j0 = seg_starts[s], j1 = seg_starts[s + 1];
      p.resize(static_cast<size_t>(j1 - j0));
      const float* qt = q + t * stride + h * head_dim;
      float mx = -INFINITY;
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = k + j * stride + h * head_dim;
        // 8 independent lanes (the compiler vectorises them), then a fixed-order sum.
        float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t d = 0;
        for (; d + 8 <= head_dim; d += 8)
          for (int l = 0; l < 8; ++l) lane[l] += qt[d + l] * kj[d + l];
        float acc = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                    ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        for (; d < head_dim; ++d) acc += qt[d] * kj[d];
        p[j - j0] = acc * scale;
        mx = std::max(mx, p[j - j0]);
      }
      float sum = 0.f;
      for (auto& e : p) {
        e = std::exp(e - mx);
        sum += e;
      }
      float* o = out + t * stride + h * head_dim;
      std::fill(o, o + head_dim, 0.f);
      for (int64_t j = j0; j < j1; ++j) {
        const float* vj = v + j * stride + h * head_dim;
        const float pj = p[j - j0] / sum;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * vj[d];
      }
    }
  });
}

}  // namespace m3::kernels::cpu
