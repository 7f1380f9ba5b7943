// linear, embedding, weight views. The GEMM is written for the shapes the CPU path sees:
// a few to a few thousand tokens against bf16 weights read in place. Rows of W are converted to
// fp32 in blocks (kRowBlock rows per block) and reused across all tokens, so each weight byte
// is read once per call; dot products use 8 independent lanes the compiler can vectorise.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

namespace {

constexpr int64_t kRowBlock = 8;

inline void row_to_f32(const MatRef& w, int64_t r, float* out) {
  if (w.dtype == DType::kF32) {
    std::memcpy(out, static_cast<const float*>(w.data) + r * w.cols, w.cols * sizeof(float));
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(w.data) + r * w.cols;
    for (int64_t i = 0; i < w.cols; ++i) out[i] = bf16_to_f32(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

}  // namespace

void linear(const float* x, int64_t n, const MatRef& w, float* y) {
  M3_CHECK(w.dtype == DType::kBF16 || w.dtype == DType::kF32, "linear: weight dtype %s",
           dtype_name(w.dtype));
  const int64_t k = w.cols, m = w.rows;
  const int64_t num_blocks = (m + kRowBlock - 1) / kRowBlock;
  parallel_for(num_blocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> wbuf(kRowBlock * k);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kRowBlock, nr = std::min(kRowBlock, m - r0);
      for (int64_t r = 0; r < nr; ++r) row_to_f32(w, r0 + r, wbuf.data() + r * k);
      for (int64_t t = 0; t < n; ++t) {
        const float* xt = x + t * k;
        float* yt = y + t * m + r0;
        for (int64_t r = 0; r < nr; ++r) yt[r] = dot(xt, wbuf.data() + r * k, k);
      }
    }
  });
}

void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out) {
  parallel_for(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      M3_CHECK(ids[t] >= 0 && ids[t] < table.rows, "embedding id %d out of range", ids[t]);
      row_to_f32(table, ids[t], out + t * table.cols);
    }
  });
}

void log_softmax(const float* logits, int64_t n, int64_t vocab, float* out) {
  parallel_for(n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = logits + r * vocab;
      float* o = out + r * vocab;
      float mx = l[0];
      for (int64_t i = 1; i < vocab; ++i) mx = std::max(mx, l[i]);
      double sum = 0.0;
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(l[i] - mx));
      const float lse = mx + static_cast<float>(std::log(sum));
      for (int64_t i = 0; i < vocab; ++i) o[i] = l[i] - lse;
    }
  });
}

}  // namespace m3::kernels::cpu
