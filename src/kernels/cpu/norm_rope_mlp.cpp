// Elementwise-ish ops: Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI, the sigmoid router.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                   float* out) {
  M3_CHECK(w.n == dim, "rmsnorm: weight has %lld entries, dim %lld", (long long)w.n,
           (long long)dim);
  std::vector<float> scale(dim);
  for (int64_t i = 0; i < dim; ++i) scale[i] = 1.0f + w.at(i);
  parallel_for(
      rows,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* xr = x + r * dim;
          float* o = out + r * dim;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t i = 0;
          for (; i + 8 <= dim; i += 8)
            for (int l = 0; l < 8; ++l) acc[l] += xr[i + l] * xr[i + l];
          float ss = 0.f;
          for (; i < dim; ++i) ss += xr[i] * xr[i];
          for (int l = 0; l < 8; ++l) ss += acc[l];
          const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
          for (int64_t j = 0; j < dim; ++j) o[j] = (xr[j] * inv) * scale[j];
        }
      },
      16);
}

void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta) {
  rope_neox(x, n, num_heads, head_dim, rot_dim, positions, theta, RopeScaling{});
}

void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta, const RopeScaling& scaling) {
  M3_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim);
  if (rot_dim == 0) return;
  const int64_t half = rot_dim / 2;
  // inv_freq exactly as the reference computes it in fp32: 1 / theta^(2i / rot_dim), or YaRN's.
  std::vector<float> inv_freq(half);
  rope_inv_freq(theta, scaling, rot_dim, inv_freq.data());
  const float af = scaling.active() ? scaling.attention_factor : 1.0f;
  parallel_for(
      n,
      [&](int64_t t0, int64_t t1) {
        std::vector<float> c(half), s(half);
        for (int64_t t = t0; t < t1; ++t) {
          const float p = static_cast<float>(positions[t]);
          for (int64_t i = 0; i < half; ++i) {
            const float a = p * inv_freq[i];
            c[i] = std::cos(a) * af;
            s[i] = std::sin(a) * af;
          }
          for (int64_t h = 0; h < num_heads; ++h) {
            float* v = x + (t * num_heads + h) * head_dim;
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = v[i], x2 = v[i + half];
              v[i] = x1 * c[i] - x2 * s[i];
              v[i + half] = x2 * c[i] + x1 * s[i];
            }
          }
        }
      },
      4);
}

void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                float limit, float beta, float* out) {
  parallel_for(
      n,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const float* g = gate + t * inter;
          const float* u = up + t * inter;
          float* o = out + t * inter;
          for (int64_t i = 0; i < inter; ++i) {
            const float gc = std::min(g[i], limit);
            const float uc = std::clamp(u[i], -limit, limit);
            const float glu = gc * (1.0f / (1.0f + std::exp(-alpha * gc)));
            o[i] = (uc + beta) * glu;
          }
        }
      },
      4);
}

}  // namespace m3::kernels::cpu
