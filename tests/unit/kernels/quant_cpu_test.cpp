// The quantized weight formats on the CPU (kernels/views.h WeightQuant, docs/QUANTIZATION.md):
// E2M1 conversions, dequantize_row against each format's definition written out here element by
// element, linear against a naive double-precision product, slice_rows of every format, and the
// MoE experts over quantized views. These are the CPU twins the GPU ops will be compared to.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {
namespace {

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

TEST(E2m1, ValuesRoundingAndSaturation) {
  const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(std::fabs(v), mag[c & 7]) << c;
    EXPECT_EQ(std::signbit(v), (c & 8) != 0) << c;
    EXPECT_EQ(f32_to_e2m1(v), c == 8 ? 8 : c) << c;  // every code round-trips (-0 too)
  }
  // Ties go to the even code: 0.25 -> 0, 0.75 -> 1 (code 2), 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
  // 3.5 -> 4, 5 -> 4; off-tie values to the nearest; above 6 saturates.
  const std::pair<float, float> cases[] = {{0.25f, 0.f},  {0.75f, 1.f}, {1.25f, 1.f}, {1.75f, 2.f},
                                           {2.5f, 2.f},   {3.5f, 4.f},  {5.f, 4.f},   {5.01f, 6.f},
                                           {0.26f, 0.5f}, {100.f, 6.f}, {-2.6f, -3.f}};
  for (auto [in, want] : cases) EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(in)), want) << in;
}

// A random matrix in format q with its storage.
struct QMat {
  std::vector<uint8_t> data, scale;
  MatRef m;
};

uint8_t random_fp8(std::mt19937& g) {
  std::uniform_int_distribution<int> d(0, 255);
  for (;;) {
    const int c = d(g);
    if ((c & 0x7f) != 0x7f) return static_cast<uint8_t>(c);  // not NaN
  }
}

QMat make(WeightQuant q, int64_t rows, int64_t cols, std::mt19937& g) {
  QMat r;
  r.m.rows = rows;
  r.m.cols = cols;
  r.m.quant = q;
  r.m.dtype = weight_quant_is_4bit(q) ? DType::kU8 : DType::kF8E4M3;
  r.data.resize(static_cast<size_t>(rows * r.m.row_bytes()));
  std::uniform_int_distribution<int> byte(0, 255), e8(118, 134), s8(0x18, 0x58);
  for (auto& b : r.data)
    b = weight_quant_is_4bit(q) ? static_cast<uint8_t>(byte(g)) : random_fp8(g);
  r.scale.resize(static_cast<size_t>(rows * r.m.scale_row_bytes()));
  if (q == WeightQuant::kFp8Channel) {
    std::uniform_real_distribution<float> u(0.001f, 0.05f);
    for (int64_t i = 0; i < rows; ++i) {
      const float s = u(g);
      std::memcpy(r.scale.data() + i * 4, &s, 4);
    }
  } else {
    for (auto& s : r.scale) s = static_cast<uint8_t>(q == WeightQuant::kNvfp4 ? s8(g) : e8(g));
  }
  if (q == WeightQuant::kNvfp4) r.m.global_scale = 0.0173f;
  r.m.data = r.data.data();
  r.m.scale = r.scale.data();
  return r;
}

// W[r, c] by the format's definition, written out independently of dequantize_row.
float element(const QMat& a, int64_t r, int64_t c) {
  const MatRef& m = a.m;
  const uint8_t* srow = a.scale.data() + r * m.scale_row_bytes();
  switch (m.quant) {
    case WeightQuant::kFp8Channel: {
      float s;
      std::memcpy(&s, srow, 4);
      return fp8_e4m3_to_f32(a.data[r * m.cols + c]) * s;
    }
    case WeightQuant::kMxfp8:
      return fp8_e4m3_to_f32(a.data[r * m.cols + c]) *
             std::ldexp(1.f, static_cast<int>(srow[c / 32]) - 127);
    case WeightQuant::kNvfp4:
    case WeightQuant::kMxfp4: {
      const uint8_t byte = a.data[r * m.row_bytes() + c / 2];
      const uint8_t code = c % 2 == 0 ? (byte & 15) : (byte >> 4);  // low nibble = even column
      const float s = m.quant == WeightQuant::kNvfp4
                          ? fp8_e4m3_to_f32(srow[c / 16]) * m.global_scale
                          : std::ldexp(1.f, static_cast<int>(srow[c / 32]) - 127);
      return e2m1_to_f32(code) * s;
    }
    case WeightQuant::kNone:
      break;
  }
  return NAN;
}

const WeightQuant kAll[] = {WeightQuant::kFp8Channel, WeightQuant::kMxfp8, WeightQuant::kNvfp4,
                            WeightQuant::kMxfp4};

TEST(QuantWeights, DequantizeRowIsTheFormatsDefinition) {
  std::mt19937 g(7);
  // Column counts on and off the 16/32 block grid (the last block partial).
  for (WeightQuant q : kAll) {
    for (int64_t cols : {2, 16, 32, 48, 70, 96}) {
      const QMat a = make(q, 5, cols, g);
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < 5; ++r) {
        dequantize_row(a.m, r, row.data());
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(row[c], element(a, r, c))
              << weight_quant_name(q) << " cols " << cols << " at " << r << "," << c;
      }
    }
  }
}

TEST(QuantWeights, LinearMatchesNaiveAndSlicedRowsMatchTheWhole) {
  std::mt19937 g(8);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (WeightQuant q : kAll) {
    for (auto [n, m, k] : {std::tuple{1, 3, 32}, {4, 17, 64}, {3, 9, 48}, {2, 33, 96}}) {
      const QMat a = make(q, m, k, g);
      std::vector<float> x(static_cast<size_t>(n * k));
      for (auto& v : x) v = nd(g);
      std::vector<float> y(static_cast<size_t>(n * m));
      linear(x.data(), n, a.m, y.data());
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < m; ++r) {
          double ref = 0, mag = 0;
          for (int c = 0; c < k; ++c) {
            const double w = element(a, r, c);
            ref += x[t * k + c] * w;
            mag += std::fabs(x[t * k + c] * w);
          }
          // fp32 accumulation of k exact products: |error| <= k * u * sum |terms| (with margin).
          EXPECT_NEAR(y[t * m + r], ref, 4 * k * kU * mag + 1e-30) << weight_quant_name(q);
        }
      // Rows [2, m - 1) as a view: both arrays advance with the rows.
      const MatRef s = a.m.slice_rows(2, m - 3);
      std::vector<float> ys(static_cast<size_t>(n * (m - 3)));
      linear(x.data(), n, s, ys.data());
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < m - 3; ++r)
          EXPECT_EQ(ys[t * (m - 3) + r], y[t * m + r + 2]) << weight_quant_name(q) << " slice";
    }
  }
}

// Per-token FP8 activations (the GPU FP8 GEMM's input; quant_cuda_test checks the GPU twin bit
// for bit): the row's largest magnitude maps to 448 exactly, codes round to nearest even, a zero
// row gets scale 1, and codes x scale reconstruct x to 2^-4 relative in e4m3's normal range.
TEST(QuantActivations, Fp8PerTokenScalesRoundAndReconstruct) {
  const int64_t n = 3, k = 64;
  std::vector<float> x(static_cast<size_t>(n * k));
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (auto& v : x) v = nd(g);
  for (int64_t c = 0; c < k; ++c) x[static_cast<size_t>(k + c)] = 0.f;
  x[5] = -9.f;  // row 0's largest magnitude (|N(0, 2)| < 9 here)
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(static_cast<size_t>(n));
  cpu::quantize_fp8_per_token(x.data(), n, k, q.data(), s.data());
  EXPECT_EQ(s[0], 9.f / 448.f);
  EXPECT_EQ(q[5], 0x80 | 0x7e);  // -448
  EXPECT_EQ(s[1], 1.f);
  for (int64_t c = 0; c < k; ++c) EXPECT_EQ(q[static_cast<size_t>(k + c)], 0);
  for (int64_t t : {int64_t{0}, int64_t{2}}) {
    for (int64_t c = 0; c < k; ++c) {
      const float v = x[static_cast<size_t>(t * k + c)];
      EXPECT_EQ(q[static_cast<size_t>(t * k + c)], f32_to_fp8_e4m3(v / s[t]));
      const float back = fp8_e4m3_to_f32(q[static_cast<size_t>(t * k + c)]) * s[t];
      if (std::fabs(v / s[t]) >= 1.f / 64) {  // e4m3's smallest normal is 2^-6
        EXPECT_LE(std::fabs(back - v), std::fabs(v) / 16) << t << " " << c;
      }
    }
  }
}

TEST(QuantWeights, BytesCountCodesAndScales) {
  std::mt19937 g(9);
  const QMat f = make(WeightQuant::kFp8Channel, 4, 64, g);
  EXPECT_EQ(f.m.bytes(), 4 * 64 + 4 * 4);
  const QMat mx = make(WeightQuant::kMxfp8, 4, 70, g);
  EXPECT_EQ(mx.m.bytes(), 4 * 70 + 4 * 3);  // ceil(70 / 32) = 3 scales a row
  const QMat nv = make(WeightQuant::kNvfp4, 4, 64, g);
  EXPECT_EQ(nv.m.bytes(), 4 * 32 + 4 * 4);
  const QMat m4 = make(WeightQuant::kMxfp4, 4, 64, g);
  EXPECT_EQ(m4.m.bytes(), 4 * 32 + 4 * 2);
}

TEST(QuantWeights, MoeExpertsOverQuantizedViewsEqualTheirDequantisation) {
  const SwigluParams act{1.702f, 7.f, 1.f};
  std::mt19937 g(10);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t ne = 4, hidden = 64, inter = 32, k = 2, n = 7;
  for (WeightQuant q : kAll) {
    std::vector<QMat> qm;
    std::vector<std::vector<float>> f32;
    std::vector<MatRef> views, deq;
    for (int64_t e = 0; e < ne; ++e) {
      for (int p = 0; p < 3; ++p) {
        const int64_t rows = p == 2 ? hidden : inter, cols = p == 2 ? inter : hidden;
        qm.push_back(make(q, rows, cols, g));
      }
    }
    for (const QMat& a : qm) {
      auto& d = f32.emplace_back(static_cast<size_t>(a.m.rows * a.m.cols));
      for (int64_t r = 0; r < a.m.rows; ++r) dequantize_row(a.m, r, d.data() + r * a.m.cols);
    }
    for (size_t i = 0; i < qm.size(); ++i) {
      views.push_back(qm[i].m);
      deq.push_back(MatRef{f32[i].data(), DType::kF32, qm[i].m.rows, qm[i].m.cols});
    }
    MoeExpertWeights wq, wd;
    for (MoeExpertWeights* w : {&wq, &wd}) {
      w->num_experts = ne;
      w->inter = inter;
      w->hidden = hidden;
    }
    wq.quant = q;
    wq.mats_of = views.data();
    wd.dtype = DType::kF32;
    wd.mats_of = deq.data();
    std::vector<float> x(static_cast<size_t>(n * hidden));
    for (auto& v : x) v = nd(g);
    std::vector<int32_t> ids(static_cast<size_t>(n * k));
    std::vector<float> wts(static_cast<size_t>(n * k), 0.5f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j) ids[t * k + j] = static_cast<int32_t>((t + 3 * j) % ne);
    std::vector<float> a(static_cast<size_t>(n * hidden)), b(a.size());
    moe_experts(x.data(), n, ids.data(), wts.data(), k, wq, act, nullptr, a.data());
    moe_experts(x.data(), n, ids.data(), wts.data(), k, wd, act, nullptr, b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << weight_quant_name(q);
    double norm = 0;
    for (float v : a) norm += std::fabs(v);
    EXPECT_GT(norm, 0.0) << weight_quant_name(q);
  }
}

}  // namespace
}  // namespace m3::kernels::cpu
