// The quantized-weight GPU ops (kernels/cuda/quant.h) against their CPU twins: gemv_quant vs
// kernels::cpu::linear over the same quantized MatRef, dequantize_bf16 vs dequantize_row rounded
// to bf16 (bit for bit), for every format, row counts off the CTA's row tile, 1..9 tokens (token
// groups of kGemvTokens and a partial one), up to M3's [3072, 6144] expert shape. Then the ops
// the model calls: dequantize_bf16_unscaled (exact in bf16), linear_quant (GEMV and dequantise +
// GEMM sides of kQuantGemvMaxTokens) against cpu::linear, and moe_experts over quantized
// experts (the grouped quantized GEMV and the per-expert dequantise path) against
// cpu::moe_experts on the same views.
// Tolerance of gemv_quant: both sides sum the same exact products (code x block scale; the
// per-channel scale is applied to the GPU's row sum, one more rounding) in fp32 in different
// orders, so |gpu - cpu| <= 2 * k * u * sum |x * w| (u = 2^-24), with a factor 2 of margin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_stream.cuh"

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

// The bf16 GEMM precision for one test; the process-wide quantized-path settings it may change
// (precision, quantized GEMM variant, FP8 activations) are restored after it.
struct Bf16Settings {
  cuda::GemmPrecision precision = cuda::gemm_precision();
  int variant = cuda::quant_gemm_variant();
  bool fp8 = cuda::fp8_activations();
  Bf16Settings() { cuda::set_gemm_precision(cuda::GemmPrecision::kBf16); }
  ~Bf16Settings() {
    cuda::set_gemm_precision(precision);
    cuda::set_quant_gemm_variant(variant);
    cuda::set_fp8_activations(fp8);
  }
};

// qstream's tensor-core kernel for fp8_per_channel (on by default) set for one scope (restored
// after), for up to 4 tokens of a dense matrix (the default is 1).
struct MmaOn {
  bool was = cuda::qstream::mma_on();
  int tokens = cuda::qstream::mma_tokens();
  explicit MmaOn(bool on) {
    cuda::qstream::set_mma_on(on);
    cuda::qstream::set_mma_tokens(4);
  }
  ~MmaOn() {
    cuda::qstream::set_mma_on(was);
    cuda::qstream::set_mma_tokens(tokens);
  }
};

const WeightQuant kAll[] = {WeightQuant::kFp8Channel, WeightQuant::kMxfp8, WeightQuant::kNvfp4,
                            WeightQuant::kMxfp4};

TEST(QuantCuda, GemvMatchesTheCpuLinear) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(31);
  for (WeightQuant q : kAll) {
    // For the 4-bit formats the last three take the streaming one-token kernel at n = 1
    // (quant_stream.cu: rows for every warp of the grid, k a multiple of 512; 2560 ends in a
    // chunk of 512, half a warp segment; 1999 rows give uneven warp shares and a partial row
    // group; the last, 16384: x staged whole at the kernels' largest k).
    for (auto [m, k] : {std::pair<int64_t, int64_t>{5, 16},
                        {37, 96},
                        {300, 512},
                        {1999, 2560},
                        {3072, 6144},
                        {1056, 16384}}) {
      const HostQ h = make(q, m, k, g);
      DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
      MatRef dw = h.m;
      dw.data = dd.data();
      dw.scale = ds.data();
      ASSERT_TRUE(cuda::quant_op_supported(dw));
      // fp8_per_channel takes qstream's tensor-core kernel where the rows are whole 8-row
      // groups for every SM (3072 x 6144, 1056 x 16384), here at 1-4 tokens (MmaOn; 4 tokens of
      // k = 16384 do not fit and take the group kernel); n = 0 stands for n = 1 with it off
      // (quant_gemv.cu's group kernel).
      for (int64_t n_or_mma : {1, 2, 3, 4, 5, 9, 0}) {
        const bool mma = n_or_mma != 0;
        const int64_t n = mma ? n_or_mma : 1;
        if (!mma && q != WeightQuant::kFp8Channel) continue;
        const MmaOn mma_scope(mma);
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
              ADD_FAILURE() << weight_quant_name(q) << (mma ? "" : " (mma off)") << " m " << m
                            << " k " << k << " n " << n << " row " << r << " token " << t << ": "
                            << got[t * m + r] << " vs " << want[t * m + r] << " (tol " << tol
                            << ")";
            }
          }
        }
        EXPECT_EQ(bad, 0) << weight_quant_name(q) << (mma ? "" : " (mma off)") << " m " << m
                          << " k " << k << " n " << n;
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

// The unscaled dequantisation: w's values divided by its row factor, each exact in bf16 (so its
// f32 value is the CPU's dequantize_row of the same codes with the factor set to 1, bit for bit).
TEST(QuantCuda, DequantizeUnscaledIsExactInBf16) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(33);
  for (WeightQuant q : kAll) {
    const int64_t m = 45, k = 272;
    HostQ h = make(q, m, k, g);
    DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
    MatRef dw = h.m;
    dw.data = dd.data();
    dw.scale = ds.data();
    EXPECT_EQ(cuda::has_row_factor(dw), q == WeightQuant::kFp8Channel || q == WeightQuant::kNvfp4);
    DeviceBuffer<uint16_t> out(static_cast<size_t>(m * k));
    cuda::dequantize_bf16_unscaled(dw, out.data(), nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(static_cast<size_t>(m * k));
    out.copy_to(got.data(), got.size());
    // The CPU view without the factor: per-channel scales of 1, an NVFP4 global scale of 1.
    MatRef unit = h.m;
    std::vector<uint8_t> ones;
    if (q == WeightQuant::kFp8Channel) {
      ones.resize(h.scale.size());
      const float one = 1.f;
      for (int64_t r = 0; r < m; ++r) std::memcpy(ones.data() + 4 * r, &one, 4);
      unit.scale = ones.data();
    }
    unit.global_scale = 1.f;
    std::vector<float> row(static_cast<size_t>(k));
    int64_t differ = 0;
    for (int64_t r = 0; r < m; ++r) {
      cpu::dequantize_row(unit, r, row.data());
      for (int64_t c = 0; c < k; ++c) differ += bf16_to_f32(got[r * k + c]) != row[c];
    }
    EXPECT_EQ(differ, 0) << weight_quant_name(q);
  }
}

// linear_quant on both sides of kQuantGemvMaxTokens, exact GEMM precision (x split into bf16
// terms that carry all its bits): the dequantised values are exact in bf16 and the row factor
// is one more rounding, so the bound is gemv_quant's (both sides sum exact products in fp32 in
// different orders; the split's residual, 2^-26 of |x|, is far below it).
TEST(QuantCuda, LinearQuantMatchesTheCpuLinear) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(34);
  for (WeightQuant q : kAll) {
    for (auto [m, k] : {std::pair<int64_t, int64_t>{37, 96}, {300, 512}}) {
      const HostQ h = make(q, m, k, g);
      DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
      MatRef dw = h.m;
      dw.data = dd.data();
      dw.scale = ds.data();
      for (int64_t n :
           {int64_t{1}, cuda::kQuantGemvMaxTokens, cuda::kQuantGemvMaxTokens + 1, int64_t{64}}) {
        const auto x = m3::testing::randn(static_cast<size_t>(n * k), g);
        std::vector<float> want(static_cast<size_t>(n * m));
        cpu::linear(x.data(), n, h.m, want.data());
        DeviceBuffer<float> dx(x), dy(static_cast<size_t>(n * m));
        const size_t wsb = cuda::linear_quant_workspace_bytes(n, dw);
        EXPECT_EQ(wsb == 0, n <= cuda::kQuantGemvMaxTokens);
        DeviceBuffer<uint8_t> ws(std::max<size_t>(wsb, 1));
        cuda::linear_quant(dx.data(), n, dw, dy.data(), cuda::Workspace{ws.data(), wsb}, nullptr);
        M3_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got(static_cast<size_t>(n * m));
        dy.copy_to(got.data(), got.size());
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

// linear_quant under the bf16 precision above the GEMV's range: the quantized tensor-core GEMM
// (codes converted in shared memory; K split over CTAs where the matrix is small: [136, 2048],
// [64, 1056] with a K tail) and, where it cannot run (rows not a multiple of 8, the workspace
// too small for bf16(x) at 256 tokens), dequantise + cuBLAS. Both multiply bf16(x) by the exact
// weights, so the reference is cpu::linear on bf16(x) and the tolerance linear's fp32-order one.
TEST(QuantCuda, LinearQuantBf16MatchesTheCpuLinearOnBf16X) {
  SKIP_WITHOUT_GPU();
  const Bf16Settings settings;
  std::mt19937 g(37);
  for (int variant = 0; variant < cuda::quant_gemm_variants(); ++variant)
    for (WeightQuant q : kAll) {
      cuda::set_quant_gemm_variant(variant);
      for (auto [m, k] :
           {std::pair<int64_t, int64_t>{37, 96}, {136, 2048}, {64, 1056}, {300, 512}}) {
        const HostQ h = make(q, m, k, g);
        DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
        MatRef dw = h.m;
        dw.data = dd.data();
        dw.scale = ds.data();
        for (int64_t n : {cuda::kQuantGemvMaxTokens + 1, int64_t{8}, int64_t{40}, int64_t{100},
                          cuda::kQuantGemmMaxTokens}) {
          const std::string what = std::string(weight_quant_name(q)) + " m " + std::to_string(m) +
                                   " k " + std::to_string(k) + " n " + std::to_string(n) +
                                   " variant " + std::to_string(variant);
          auto x = m3::testing::randn(static_cast<size_t>(n * k), g);
          std::vector<float> xb(x.size());
          for (size_t i = 0; i < x.size(); ++i) xb[i] = bf16_to_f32(f32_to_bf16(x[i]));
          std::vector<float> want(static_cast<size_t>(n * m));
          cpu::linear(xb.data(), n, h.m, want.data());
          DeviceBuffer<float> dx(x), dy(static_cast<size_t>(n * m));
          const size_t wsb = cuda::linear_quant_workspace_bytes(n, dw);
          DeviceBuffer<uint8_t> ws(std::max<size_t>(wsb, 1));
          cuda::linear_quant(dx.data(), n, dw, dy.data(), cuda::Workspace{ws.data(), wsb}, nullptr);
          M3_CUDA_CHECK(cudaDeviceSynchronize());
          std::vector<float> got(static_cast<size_t>(n * m));
          dy.copy_to(got.data(), got.size());
          std::vector<float> row(static_cast<size_t>(k));
          int bad = 0;
          for (int64_t r = 0; r < m; ++r) {
            cpu::dequantize_row(h.m, r, row.data());
            for (int64_t t = 0; t < n; ++t) {
              double mag = 0;
              for (int64_t c = 0; c < k; ++c) mag += std::fabs(xb[t * k + c] * row[c]);
              const double tol = 4 * k * kU * mag + 1e-30;
              if (!(std::fabs(got[t * m + r] - want[t * m + r]) <= tol) && ++bad <= 3)
                ADD_FAILURE() << what << " row " << r << " token " << t << ": " << got[t * m + r]
                              << " vs " << want[t * m + r] << " (tol " << tol << ")";
            }
          }
          EXPECT_EQ(bad, 0) << what;
        }
      }
    }
}

// Per-token FP8 activations: the GPU's codes and scales are the CPU twin's, bit for bit (rows of
// normal values, a zero row, a row with one huge value and subnormal codes, a NaN).
TEST(QuantCuda, Fp8PerTokenQuantizeIsTheCpuTwin) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(41);
  for (auto [n, k] : {std::pair<int64_t, int64_t>{5, 96}, {64, 6144}, {3, 1000}}) {
    auto x = m3::testing::randn(static_cast<size_t>(n * k), g, 3.f);
    for (int64_t c = 0; c < k; ++c) x[static_cast<size_t>(k + c)] = 0.f;  // row 1: zeros
    x[static_cast<size_t>(2 * k)] = 1e6f;                                 // row 2: one outlier
    if (n > 3) x[static_cast<size_t>(3 * k + 7)] = std::nanf("");
    std::vector<uint8_t> wq(static_cast<size_t>(n * k));
    std::vector<float> ws(static_cast<size_t>(n));
    cpu::quantize_fp8_per_token(x.data(), n, k, wq.data(), ws.data());
    DeviceBuffer<float> dx(x), dsc(static_cast<size_t>(n));
    DeviceBuffer<uint8_t> dq(static_cast<size_t>(n * k));
    cuda::quantize_fp8_per_token(dx.data(), n, k, dq.data(), dsc.data(), nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> gq(wq.size());
    std::vector<float> gs(ws.size());
    dq.copy_to(gq.data(), gq.size());
    dsc.copy_to(gs.data(), gs.size());
    EXPECT_EQ(std::memcmp(gs.data(), ws.data(), ws.size() * 4), 0) << "n " << n << " k " << k;
    EXPECT_EQ(gq, wq) << "n " << n << " k " << k;
    EXPECT_EQ(ws[1], 1.f);
  }
}

// fp8_linear = the FP8 GEMM on the quantized activations: against the exact product of the
// same codes (each x row's e4m3 codes times its scale, each weight row's codes times its
// channel scale, summed in double), within the accumulation's rounding; then linear_quant
// with FP8 activations on sends prefill-sized calls there (the same bits) and, off, does not.
TEST(QuantCuda, Fp8LinearMatchesTheExactProductOfItsCodes) {
  SKIP_WITHOUT_GPU();
  const Bf16Settings settings;
  std::mt19937 g(43);
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{256, 512, 300},
                         {1024, 2048, 520},
                         {96, 6144, 257},
                         {8192, 6144, 1024}}) {
    const HostQ h = make(WeightQuant::kFp8Channel, m, k, g);
    DeviceBuffer<uint8_t> dd(h.data), ds(h.scale);
    MatRef dw = h.m;
    dw.data = dd.data();
    dw.scale = ds.data();
    ASSERT_TRUE(cuda::fp8_linear_supported(dw));
    const auto x = m3::testing::randn(static_cast<size_t>(n * k), g);
    std::vector<uint8_t> q(static_cast<size_t>(n * k));
    std::vector<float> sx(static_cast<size_t>(n));
    cpu::quantize_fp8_per_token(x.data(), n, k, q.data(), sx.data());
    DeviceBuffer<float> dx(x), dy(static_cast<size_t>(n * m)), dy2(static_cast<size_t>(n * m));
    ASSERT_TRUE(cuda::fp8_linear(dx.data(), n, dw, dy.data(), nullptr))
        << "cuBLASLt has no FP8 algorithm for m " << m << " k " << k << " n " << n;
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got(static_cast<size_t>(n * m));
    dy.copy_to(got.data(), got.size());
    const std::string what =
        "m " + std::to_string(m) + " k " + std::to_string(k) + " n " + std::to_string(n);
    std::vector<float> row(static_cast<size_t>(k));
    int bad = 0;
    // Every row for the small shapes; a strided sample of the 8192 x 1024 one.
    const int64_t rstep = m > 1024 ? 61 : 1, tstep = n > 600 ? 37 : 1;
    for (int64_t r = 0; r < m; r += rstep) {
      cpu::dequantize_row(h.m, r, row.data());
      for (int64_t t = 0; t < n; t += tstep) {
        double exact = 0, mag = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double a = static_cast<double>(fp8_e4m3_to_f32(q[t * k + c])) * sx[t];
          exact += a * row[c];
          mag += std::fabs(a * row[c]);
        }
        // fp32 summation order, plus Hopper's FP8 MMA accumulating at reduced precision inside
        // cuBLASLt's fp32-promoted chunks (about 14 bits): 2^-12 of the magnitude.
        const double tol = (4 * k * kU + 1.0 / 4096) * mag + 1e-30;
        if (!(std::fabs(got[t * m + r] - exact) <= tol) && ++bad <= 3)
          ADD_FAILURE() << what << " row " << r << " token " << t << ": " << got[t * m + r]
                        << " vs " << exact << " (tol " << tol << ")";
      }
    }
    EXPECT_EQ(bad, 0) << what;
    // Through linear_quant: on, the same bits; off, the bf16 path (other bits).
    const size_t wsb = cuda::linear_quant_workspace_bytes(n, dw);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(wsb, 1));
    std::vector<float> via(got.size());
    cuda::set_fp8_activations(true);
    cuda::linear_quant(dx.data(), n, dw, dy2.data(), cuda::Workspace{ws.data(), wsb}, nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    dy2.copy_to(via.data(), via.size());
    EXPECT_EQ(std::memcmp(via.data(), got.data(), got.size() * 4), 0) << what;
    cuda::set_fp8_activations(false);
    cuda::linear_quant(dx.data(), n, dw, dy2.data(), cuda::Workspace{ws.data(), wsb}, nullptr);
    M3_CUDA_CHECK(cudaDeviceSynchronize());
    dy2.copy_to(via.data(), via.size());
    EXPECT_NE(std::memcmp(via.data(), got.data(), got.size() * 4), 0) << what;
  }
}

// ne quantized experts of one format (w1, w3 [inter, hidden], w2 [hidden, inter]) on the host
// and on the device as moe_experts takes them (M3ModelCuda's upload: each projection's codes of
// every expert back to back, the scales likewise; NVFP4 global scales per expert and
// projection, on the device).
struct QExperts {
  std::vector<HostQ> hq;  // [3 * ne]: expert e's w1, w3, w2 at 3e..
  std::vector<MatRef> hmats, dmats;
  std::vector<DeviceBuffer<uint8_t>> bufs;
  std::vector<float> globals;
  DeviceBuffer<float> dglobals;
  MoeExpertWeights wh, wd;

  QExperts(WeightQuant q, int64_t ne, int64_t hidden, int64_t inter, std::mt19937& g)
      : dmats(3 * ne), globals(3 * ne) {
    for (int64_t e = 0; e < ne; ++e)
      for (int p = 0; p < 3; ++p) {
        hq.push_back(make(q, p == 2 ? hidden : inter, p == 2 ? inter : hidden, g));
        if (q == WeightQuant::kNvfp4) hq.back().m.global_scale = 0.01f * (1 + e + 3 * p);
      }
    for (const HostQ& h : hq) hmats.push_back(h.m);
    bufs.reserve(6);
    for (int p = 0; p < 3; ++p) {
      const MatRef& f = hq[p].m;
      std::vector<uint8_t> codes, scales;
      for (int64_t e = 0; e < ne; ++e) {
        const HostQ& h = hq[3 * e + p];
        codes.insert(codes.end(), h.data.begin(), h.data.end());
        scales.insert(scales.end(), h.scale.begin(), h.scale.end());
        globals[p * ne + e] = h.m.global_scale;
      }
      bufs.emplace_back(codes);
      bufs.emplace_back(scales);
      const uint8_t* dc = bufs[bufs.size() - 2].data();
      const uint8_t* dsc = bufs.back().data();
      for (int64_t e = 0; e < ne; ++e) {
        MatRef m = hq[3 * e + p].m;
        m.data = dc + e * f.data_bytes();
        m.scale = dsc + e * f.scale_bytes();
        dmats[3 * e + p] = m;
      }
    }
    dglobals = DeviceBuffer<float>(globals);
    wh.num_experts = ne;
    wh.inter = inter;
    wh.hidden = hidden;
    wh.quant = q;
    wh.dtype = hq[0].m.dtype;
    wh.mats_of = hmats.data();
    wd = wh;
    wd.mats_of = dmats.data();
    wd.global_scales = q == WeightQuant::kNvfp4 ? dglobals.data() : nullptr;
  }
};

// moe_experts over quantized experts (the layout M3ModelCuda uploads: per projection the codes
// of every expert back to back, the scales likewise; NVFP4 global scales per expert on the
// device) against cpu::moe_experts over the host views. Paths: the grouped quantized GEMV
// (n <= kMoeGemvMaxTokens; position groups of 1, 2 and 4) and the per-expert dequantise path
// (n above it). Tolerance: each side computes gate/up/down in fp32 from the same exact products
// in different orders (relative k * u of the magnitudes, k <= 256), swiglu_oai's slope is at
// most ~ limit + beta = 8 and the combine adds k + 1 terms: 2^-12 of the token's largest
// |output| covers that with margin for these sizes; a misread format (a scale off by 2^k, a
// nibble swap, the wrong expert's matrix) moves outputs by O(1) of it.
TEST(QuantCuda, MoeExpertsOverQuantizedWeightsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(35);
  const int64_t ne = 8, topk = 2;
  const SwigluParams act{1.702f, 7.0f, 1.0f};
  for (WeightQuant q : kAll) {
    // {512, 1024}: at n = 1 gate|up and down take qstream's kernels (quant_stream.cuh): the
    // CUDA-core stream for the 4-bit formats, the tensor-core kernel for fp8_per_channel.
    for (auto [hidden, inter] : {std::pair<int64_t, int64_t>{128, 256}, {64, 32}, {512, 1024}}) {
      const QExperts ex(q, ne, hidden, inter, g);
      const MoeExpertWeights &wh = ex.wh, &wd = ex.wd;
      // n = 0: n = 1 with qstream's tensor-core kernel off (fp8_per_channel, the big shape).
      for (int64_t n_or_mma : {int64_t{1}, int64_t{3}, int64_t{5}, int64_t{40},
                               cuda::kMoeGemvMaxTokens + 44, int64_t{0}}) {
        const bool mma = n_or_mma != 0;
        const int64_t n = mma ? n_or_mma : 1;
        if (!mma && (q != WeightQuant::kFp8Channel || hidden != 512)) continue;
        const MmaOn mma_scope(mma);
        // The big shape at a few tokens only: its fp32 order differences grow with k and the
        // MXFP8 scales' range (up to 2^7 x 448 per weight) until a token whose gate lands near
        // swiglu's clamp moves by more than the bound (measured: 0.3-0.7% at n = 40 and 300).
        if (hidden == 512 && n > 5) continue;
        const std::string what = std::string(weight_quant_name(q)) + (mma ? "" : " (mma off)") +
                                 " hidden " + std::to_string(hidden) + " inter " +
                                 std::to_string(inter) + " n " + std::to_string(n);
        const auto x = m3::testing::randn(static_cast<size_t>(n * hidden), g);
        const auto shared = m3::testing::randn(static_cast<size_t>(n * hidden), g, 0.5f);
        const auto logits = m3::testing::randn(static_cast<size_t>(n * ne), g, 2.f);
        std::vector<int32_t> ids(n * topk);
        std::vector<float> wts(n * topk);
        cpu::router_topk(logits.data(), n, ne, nullptr, topk, 2.f, ids.data(), wts.data());
        std::vector<float> want(n * hidden);
        cpu::moe_experts(x.data(), n, ids.data(), wts.data(), topk, wh, act, shared.data(),
                         want.data());
        DeviceBuffer<float> dx(x), dout(shared), dw(wts);
        DeviceBuffer<int32_t> dids(ids);
        const cuda::MoePath path = cuda::moe_path(n, wd, dx.data());
        EXPECT_EQ(path,
                  n <= cuda::kMoeGemvMaxTokens ? cuda::MoePath::kGemv : cuda::MoePath::kPerExpert)
            << what;
        EXPECT_EQ(cuda::moe_experts_graph_safe(n, dx.data(), wd), path == cuda::MoePath::kGemv);
        DeviceBuffer<uint8_t> work(cuda::moe_workspace_bytes(n, topk, wd));
        cuda::moe_experts(dx.data(), n, dids.data(), dw.data(), topk, wd, act, dout.data(),
                          dout.data(), work.data(), nullptr);
        M3_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got(n * hidden);
        dout.copy_to(got.data(), got.size());
        int bad = 0;
        for (int64_t t = 0; t < n; ++t) {
          double big = 0;
          for (int64_t c = 0; c < hidden; ++c)
            big = std::max<double>(big, std::fabs(want[t * hidden + c]));
          const double tol = big / 4096 + 1e-30;
          for (int64_t c = 0; c < hidden; ++c) {
            const double d = std::fabs(double(got[t * hidden + c]) - want[t * hidden + c]);
            if (!(d <= tol) && ++bad <= 3)
              ADD_FAILURE() << what << " token " << t << " col " << c << ": " << got[t * hidden + c]
                            << " vs " << want[t * hidden + c] << " (tol " << tol << ")";
          }
        }
        EXPECT_EQ(bad, 0) << what;
      }
    }
  }
}

// The grouped tensor-core GEMMs over quantized experts (moe_grouped_quant.cu: the expert
// matrices read as stored and converted to bf16 with their block scales, each variant: in
// shared memory, or into the MMA registers with A K-permuted), the kBf16 precision's path from
// kMoeGroupedMinTokens tokens, against the CPU twin on bf16(x):
// cpu::moe_experts over the same host views. Sizes take every tile height (32, 64, 128
// positions; 16 for variant 1), K tails (96, 160: a last k-tile of 32) and partial weight-row
// tiles (N 96, 160).
// Tolerance: the GPU forms gate/up from bf16(x) (the reference's input) and the dequantised
// weights exactly (both in bf16), so they agree to fp32 summation order; the SwiGLU output is
// rounded to bf16 before down (relative error <= 2^-9), which moves output c of token t by at
// most 2^-9 mag[t, c] with mag = sum_j |wt_j| sum_i |w2_e[c, i]| |act_e,i(t)|; the tolerance is
// 2^-8 mag (fp32 order terms are ~2^-24 k of it). A misread format (a scale off by 2^k, a
// nibble swap, a wrong expert or row factor) moves outputs by O(1) of mag.
TEST(QuantCuda, MoeGroupedQuantGemmMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  const Bf16Settings settings;
  std::mt19937 g(36);
  const int64_t ne = 8, topk = 2;
  const SwigluParams act{1.702f, 7.0f, 1.0f};
  for (int variant = 0; variant < cuda::quant_gemm_variants(); ++variant)
    for (WeightQuant q : kAll) {
      cuda::set_quant_gemm_variant(variant);
      for (auto [hidden, inter] : {std::pair<int64_t, int64_t>{128, 256}, {96, 160}}) {
        const QExperts ex(q, ne, hidden, inter, g);
        // The dequantised experts (the CPU twin's values) for the tolerance's magnitudes.
        std::vector<std::vector<float>> dense(3 * ne);
        for (int64_t i = 0; i < 3 * ne; ++i) {
          const MatRef& m = ex.hmats[i];
          dense[i].resize(static_cast<size_t>(m.rows * m.cols));
          for (int64_t r = 0; r < m.rows; ++r)
            cpu::dequantize_row(m, r, dense[i].data() + r * m.cols);
        }
        for (int64_t n : {int64_t{8}, int64_t{40}, int64_t{60}, int64_t{100}, int64_t{300}}) {
          const std::string what = std::string(weight_quant_name(q)) + " hidden " +
                                   std::to_string(hidden) + " inter " + std::to_string(inter) +
                                   " n " + std::to_string(n) + " variant " +
                                   std::to_string(variant);
          auto x = m3::testing::randn(static_cast<size_t>(n * hidden), g);
          const auto shared = m3::testing::randn(static_cast<size_t>(n * hidden), g, 0.5f);
          const auto logits = m3::testing::randn(static_cast<size_t>(n * ne), g, 2.f);
          std::vector<int32_t> ids(n * topk);
          std::vector<float> wts(n * topk);
          cpu::router_topk(logits.data(), n, ne, nullptr, topk, 2.f, ids.data(), wts.data());
          std::vector<float> xb(x.size());
          for (size_t i = 0; i < x.size(); ++i) xb[i] = bf16_to_f32(f32_to_bf16(x[i]));
          std::vector<float> want(n * hidden);
          cpu::moe_experts(xb.data(), n, ids.data(), wts.data(), topk, ex.wh, act, shared.data(),
                           want.data());
          std::vector<double> mag(n * hidden, 0.0);
          std::vector<float> gt(inter), ut(inter), at(inter);
          for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < topk; ++j) {
              const int64_t e = ids[t * topk + j];
              const float* w1 = dense[3 * e].data();
              const float* w3 = dense[3 * e + 1].data();
              const float* w2 = dense[3 * e + 2].data();
              for (int64_t i = 0; i < inter; ++i) {
                double a = 0, b = 0;
                for (int64_t h = 0; h < hidden; ++h) {
                  a += double(w1[i * hidden + h]) * xb[t * hidden + h];
                  b += double(w3[i * hidden + h]) * xb[t * hidden + h];
                }
                gt[i] = static_cast<float>(a);
                ut[i] = static_cast<float>(b);
              }
              cpu::swiglu_oai(gt.data(), ut.data(), 1, inter, act.alpha, act.limit, act.beta,
                              at.data());
              for (int64_t c = 0; c < hidden; ++c) {
                double m = 0;
                for (int64_t i = 0; i < inter; ++i)
                  m += std::fabs(double(w2[c * inter + i]) * at[i]);
                mag[t * hidden + c] += std::fabs(wts[t * topk + j]) * m;
              }
            }
          DeviceBuffer<float> dx(x), dout(shared), dw(wts);
          DeviceBuffer<int32_t> dids(ids);
          ASSERT_EQ(cuda::moe_path(n, ex.wd, dx.data()), cuda::MoePath::kGrouped) << what;
          EXPECT_TRUE(cuda::moe_experts_graph_safe(n, dx.data(), ex.wd)) << what;
          DeviceBuffer<uint8_t> work(cuda::moe_workspace_bytes(n, topk, ex.wd));
          cuda::moe_experts(dx.data(), n, dids.data(), dw.data(), topk, ex.wd, act, dout.data(),
                            dout.data(), work.data(), nullptr);
          M3_CUDA_CHECK(cudaDeviceSynchronize());
          std::vector<float> got(n * hidden);
          dout.copy_to(got.data(), got.size());
          int bad = 0;
          for (int64_t i = 0; i < n * hidden; ++i) {
            const double tol = mag[i] / 256 + 1e-30;
            const double d = std::fabs(double(got[i]) - want[i]);
            if (!(d <= tol) && ++bad <= 3)
              ADD_FAILURE() << what << " token " << i / hidden << " col " << i % hidden << ": "
                            << got[i] << " vs " << want[i] << " (tol " << tol << ")";
          }
          EXPECT_EQ(bad, 0) << what;
        }
      }
    }
}

}  // namespace
}  // namespace m3::kernels
