// The quantized-weight GPU ops (kernels/cuda/quant.h) against their CPU twins: gemv_quant vs
// kernels::cpu::linear over the same quantized MatRef, dequantize_bf16 vs dequantize_row rounded
// to bf16 (bit for bit), for every format, row counts off the CTA's row tile, 1..9 tokens (token
// groups of kGemvTokens and a partial one), up to M3's [3072, 6144] expert shape.
// Tolerance of gemv_quant: both sides sum the same exact products (code x block scale; the
// per-channel scale is applied to the GPU's row sum, one more rounding) in fp32 in different
// orders, so |gpu - cpu| <= 2 * k * u * sum |x * w| (u = 2^-24), with a factor 2 of margin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/quant.h"

namespace m3::kernels {
namespace {

using gpu::DeviceBuffer;
using m3::testing::kU;

struct HostQ {
  std::vector<uint8_t> data, scale;
  MatRef m;  // host pointers
};

uint8_t random_fp8(std::mt19937& g) {
  std::uniform_int_distribution<int> d(0, 255);
  for (;;) {
    const int c = d(g);
    if ((c & 0x7f) != 0x7f) return static_cast<uint8_t>(c);
  }
}

HostQ make(WeightQuant q, int64_t rows, int64_t cols, std::mt19937& g) {
  HostQ h;
  h.m.rows = rows;
  h.m.cols = cols;
  h.m.quant = q;
  h.m.dtype = weight_quant_is_4bit(q) ? DType::kU8 : DType::kF8E4M3;
  h.data.resize(static_cast<size_t>(rows * h.m.row_bytes()));
  std::uniform_int_distribution<int> byte(0, 255), e8(118, 134), s8(0x18, 0x58);
  for (auto& b : h.data)
    b = weight_quant_is_4bit(q) ? static_cast<uint8_t>(byte(g)) : random_fp8(g);
  h.scale.resize(static_cast<size_t>(rows * h.m.scale_row_bytes()));
  if (q == WeightQuant::kFp8Channel) {
    std::uniform_real_distribution<float> u(0.001f, 0.05f);
    for (int64_t i = 0; i < rows; ++i) {
      const float s = u(g);
      std::memcpy(h.scale.data() + i * 4, &s, 4);
    }
  } else {
    for (auto& s : h.scale) s = static_cast<uint8_t>(q == WeightQuant::kNvfp4 ? s8(g) : e8(g));
  }
  if (q == WeightQuant::kNvfp4) h.m.global_scale = 0.0173f;
  h.m.data = h.data.data();
  h.m.scale = h.scale.data();
  return h;
}

const WeightQuant kAll[] = {WeightQuant::kFp8Channel, WeightQuant::kMxfp8, WeightQuant::kNvfp4,
                            WeightQuant::kMxfp4};

TEST(QuantCuda, GemvMatchesTheCpuLinear) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(31);
  for (WeightQuant q : kAll) {
    for (auto [m, k] : {std::pair<int64_t, int64_t>{5, 16}, {37, 96}, {300, 512}, {3072, 6144}}) {
      const HostQ h = make(q, m, k, g);
      DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
      MatRef dw = h.m;
      dw.data = dd.data();
      dw.scale = ds.data();
      ASSERT_TRUE(cuda::quant_op_supported(dw));
      for (int64_t n : {1, 2, 3, 4, 5, 9}) {
        if (m * k > 1000000 && n > 4) continue;  // the big shape at decode sizes only
        const auto x = m3::testing::randn(static_cast<size_t>(n * k), g);
        std::vector<float> want(static_cast<size_t>(n * m));
        cpu::linear(x.data(), n, h.m, want.data());
        DeviceBuffer<float> dx(x), dy(static_cast<size_t>(n * m));
        cuda::gemv_quant(dx.data(), n, dw, dy.data(), nullptr);
        M3_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got(static_cast<size_t>(n * m));
        dy.copy_to(got.data(), got.size());
        // sum |x * w| per output, from the CPU's dequantised rows.
        std::vector<float> row(static_cast<size_t>(k));
        int bad = 0;
        for (int64_t r = 0; r < m; ++r) {
          cpu::dequantize_row(h.m, r, row.data());
          for (int64_t t = 0; t < n; ++t) {
            double mag = 0;
            for (int64_t c = 0; c < k; ++c) mag += std::fabs(x[t * k + c] * row[c]);
            const double tol = 4 * k * kU * mag + 1e-30;
            if (std::fabs(got[t * m + r] - want[t * m + r]) > tol && ++bad <= 3) {
              ADD_FAILURE() << weight_quant_name(q) << " m " << m << " k " << k << " n " << n
                            << " row " << r << " token " << t << ": " << got[t * m + r] << " vs "
                            << want[t * m + r] << " (tol " << tol << ")";
            }
          }
        }
        EXPECT_EQ(bad, 0) << weight_quant_name(q) << " m " << m << " k " << k << " n " << n;
      }
    }
  }
}

TEST(QuantCuda, DequantizeBf16IsTheCpuDequantisationRounded) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(32);
  for (WeightQuant q : kAll) {
    const int64_t m = 77, k = 160;
    const HostQ h = make(q, m, k, g);
    DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
    MatRef dw = h.m;
    dw.data = dd.data();
    dw.scale = ds.data();
    DeviceBuffer<uint16_t> out(static_cast<size_t>(m * k));
    cuda::dequantize_bf16(dw, out.data(), nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(static_cast<size_t>(m * k));
    out.copy_to(got.data(), got.size());
    std::vector<float> row(static_cast<size_t>(k));
    int64_t differ = 0;
    for (int64_t r = 0; r < m; ++r) {
      cpu::dequantize_row(h.m, r, row.data());
      for (int64_t c = 0; c < k; ++c) differ += got[r * k + c] != f32_to_bf16(row[c]);
    }
    EXPECT_EQ(differ, 0) << weight_quant_name(q);
  }
}

}  // namespace
}  // namespace m3::kernels
