// linear, embedding, weight views. The GEMM is written for the shapes the CPU path sees:
// a few to a few thousand tokens against bf16 weights read in place, or quantized weights
// (kernels/views.h WeightQuant) kept in their own format. Rows of W are converted to fp32 in
// blocks (kRowBlock rows per block; a quantized row is dequantised exactly as its format defines)
// and reused across all tokens, so each weight byte is read once per call; dot products use 8
// independent lanes the compiler can vectorise.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

namespace {

constexpr int64_t kRowBlock = 8;

// E4M3 byte -> f32, all 256 codes (exact).
const float* fp8_table() {
  static const auto t = [] {
    std::array<float, 256> a{};
    for (int c = 0; c < 256; ++c) a[c] = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    return a;
  }();
  return t.data();
}

}  // namespace

void dequantize_row(const MatRef& w, int64_t r, float* out) {
  const int64_t k = w.cols;
  const uint8_t* q = static_cast<const uint8_t*>(w.data) + r * w.row_bytes();
  const uint8_t* s = static_cast<const uint8_t*>(w.scale) + r * w.scale_row_bytes();
  switch (w.quant) {
    case WeightQuant::kNone:
      if (w.dtype == DType::kF32) {
        std::memcpy(out, reinterpret_cast<const float*>(q), k * sizeof(float));
      } else {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(q);
        for (int64_t i = 0; i < k; ++i) out[i] = bf16_to_f32(src[i]);
      }
      return;
    case WeightQuant::kFp8Channel: {
      const float* lut = fp8_table();
      float sc;
      std::memcpy(&sc, s, sizeof(float));
      for (int64_t i = 0; i < k; ++i) out[i] = lut[q[i]] * sc;
      return;
    }
    case WeightQuant::kMxfp8: {
      const float* lut = fp8_table();
      for (int64_t b0 = 0; b0 < k; b0 += 32) {
        const float sc = e8m0_to_f32(s[b0 / 32]);
        const int64_t b1 = std::min(k, b0 + 32);
        for (int64_t i = b0; i < b1; ++i) out[i] = lut[q[i]] * sc;
      }
      return;
    }
    case WeightQuant::kNvfp4:
    case WeightQuant::kMxfp4: {
      const bool nv = w.quant == WeightQuant::kNvfp4;
      const int64_t blk = nv ? 16 : 32;
      for (int64_t b0 = 0; b0 < k; b0 += blk) {
        // NVFP4: the block's scale is fp8(scale) * global in f32, then times the code.
        const float sc =
            nv ? fp8_e4m3_to_f32(s[b0 / blk]) * w.global_scale : e8m0_to_f32(s[b0 / blk]);
        const int64_t b1 = std::min(k, b0 + blk);
        for (int64_t i = b0; i < b1; ++i) {
          const uint8_t byte = q[i / 2];
          out[i] = e2m1_to_f32((i & 1) ? byte >> 4 : byte & 15) * sc;
        }
      }
      return;
    }
  }
  M3_CHECK(false, "dequantize_row: format %d", static_cast<int>(w.quant));
}

namespace {

inline void row_to_f32(const MatRef& w, int64_t r, float* out) {
  dequantize_row(w, r, out);
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

void quantize_fp8_per_token(const float* x, int64_t n, int64_t k, uint8_t* q, float* scale) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * k;
    float amax = 0.f;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(xr[c]));
    const float s = amax > 0.f ? amax / 448.f : 1.f;
    scale[t] = s;
    for (int64_t c = 0; c < k; ++c) q[t * k + c] = f32_to_fp8_e4m3(xr[c] / s);
  }
}

void linear(const float* x, int64_t n, const MatRef& w, float* y) {
  M3_CHECK(w.quantized() || w.dtype == DType::kBF16 || w.dtype == DType::kF32,
           "linear: weight dtype %s", dtype_name(w.dtype));
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
