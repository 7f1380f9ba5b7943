// Each CUDA op (kernels/cuda/ops.h) against its CPU op (kernels/cpu/ops.h) on the same inputs,
// over shape grids with M3's real shapes (hidden 6144, 64/4 heads × 128, rotary 64, index 4 × 128,
// 128-token pages, top-16, 128 experts top-4, intermediate 3072) and odd sizes / edge cases.
// Selected block ids and expert ids must match exactly; floats within tolerances derived where
// they are used (u = 2^-24, the fp32 unit roundoff). Every test skips where no GPU is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace {

using m3::testing::gpu_unavailable_reason;
using m3::testing::kU;
using m3::testing::randn;
using m3::testing::to_bf16;

namespace cpu = m3::kernels::cpu;
namespace gk = m3::kernels::cuda;
using m3::DType;
using m3::gpu::DeviceBuffer;
using m3::gpu::Stream;

// Multiples of 1/8 in [-r/8, r/8]: dot products of up to 2^10 such values are exact in fp32
// (each product is a multiple of 1/64 below r²/64, and every partial sum stays far below 2^24/64),
// so any summation order gives bit-identical scores.
std::vector<float> rand_eighths(size_t n, std::mt19937& g, int r) {
  std::uniform_int_distribution<int> d(-r, r);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(g)) / 8.f;
  return v;
}

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& v) {
  return DeviceBuffer<T>(v);
}

// A device float buffer of n NaNs (all bytes 0xff), so an output the kernel never writes fails.
DeviceBuffer<float> nan_buffer(size_t n) {
  DeviceBuffer<float> b(n);
  b.fill_bytes(0xff);
  return b;
}

bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Counts elements with |got - want| > tol(i) (or a NaN), reporting the first few.
template <class Tol>
int64_t count_mismatches(const std::vector<float>& got, const std::vector<float>& want, Tol tol,
                         const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= tol(i))) {
      if (++bad <= 5)
        ADD_FAILURE() << what << ": element " << i << " gpu " << got[i] << " cpu " << want[i]
                      << " |diff| " << d << " tol " << tol(i);
    }
  }
  return bad;
}

// ---------------------------------------------------------------- linear, embedding

TEST(CudaLinear, MatchesCpuOverShapes) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t n, m, k;
    DType dt;
  };
  const Case cases[] = {
      {1, 8192, 6144, DType::kBF16},    // q_proj, one decode token
      {37, 6144, 8192, DType::kBF16},   // o_proj, odd token count
      {130, 3072, 6144, DType::kBF16},  // expert gate/up, > 2 token tiles
      {5, 6144, 3072, DType::kF32},     // expert down, f32 weight
      {3, 128, 6144, DType::kF32},      // router
      {1, 1, 1, DType::kBF16},         {7, 33, 17, DType::kF32},
      {65, 70, 100, DType::kBF16},     {2, 5, 0, DType::kF32},  // k = 0: y = 0
  };
  std::mt19937 g(11);
  Stream stream;
  for (const Case& c : cases) {
    const std::string what = "linear n=" + std::to_string(c.n) + " m=" + std::to_string(c.m) +
                             " k=" + std::to_string(c.k) + " " + m3::dtype_name(c.dt);
    auto x = randn(c.n * c.k, g);
    auto wf = randn(c.m * c.k, g, 0.05f);
    auto wb = to_bf16(wf);
    if (c.dt == DType::kBF16)
      for (size_t i = 0; i < wf.size(); ++i) wf[i] = m3::bf16_to_f32(wb[i]);  // same values
    const void* wh = c.dt == DType::kBF16 ? static_cast<const void*>(wb.data()) : wf.data();
    std::vector<float> want(c.n * c.m);
    cpu::linear(x.data(), c.n, cpu::MatRef{wh, c.dt, c.m, c.k}, want.data());

    auto dx = upload(x);
    DeviceBuffer<uint16_t> dwb;
    DeviceBuffer<float> dwf;
    if (c.dt == DType::kBF16)
      dwb = upload(wb);
    else
      dwf = upload(wf);
    const void* dw = c.dt == DType::kBF16 ? static_cast<const void*>(dwb.data()) : dwf.data();
    auto dy = nan_buffer(c.n * c.m);
    gk::linear(dx.data(), c.n, gk::MatRef{dw, c.dt, c.m, c.k}, dy.data(), stream.get());
    stream.synchronize();
    const auto got = dy.to_host();

    // Both sides sum the same k fp32 products in different orders. The rounding error of such
    // a sum grows like a random walk, ~sqrt(k)·u·Σ|x_i w_i| (the worst case k·u·Σ would be too
    // loose to notice a dropped term), and Σ|x_i w_i| <= |x|·|w| (Cauchy-Schwarz). 8·sqrt(k)·u
    // covers both sides with a wide margin yet stays below one average term, ~(2/π)|x||w|/k:
    // at k = 8192 the tolerance is 4.3e-5·|x||w| and a dropped term ~7.8e-5·|x||w|.
    std::vector<double> xn(c.n, 0.0), wn(c.m, 0.0);
    for (int64_t t = 0; t < c.n; ++t)
      for (int64_t i = 0; i < c.k; ++i) xn[t] += double(x[t * c.k + i]) * x[t * c.k + i];
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t i = 0; i < c.k; ++i) wn[r] += double(wf[r * c.k + i]) * wf[r * c.k + i];
    const double f = 8.0 * std::sqrt(double(std::max<int64_t>(c.k, 1))) * kU;
    EXPECT_EQ(
        0, count_mismatches(
               got, want,
               [&](size_t i) { return f * std::sqrt(xn[i / c.m] * wn[i % c.m]) + 1e-30; }, what));
  }
}

TEST(CudaEmbedding, GathersExactRowsBf16AndF32) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(12);
  const int64_t vocab = 1000, dim = 6144;
  auto tf = randn(vocab * dim, g);
  auto tb = to_bf16(tf);
  Stream stream;
  for (const std::vector<int32_t>& ids :
       {std::vector<int32_t>{0}, std::vector<int32_t>{999, 0, 17, 17, 500, 998, 1}}) {
    const int64_t n = static_cast<int64_t>(ids.size());
    auto dids = upload(ids);
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const void* th = dt == DType::kBF16 ? static_cast<const void*>(tb.data()) : tf.data();
      std::vector<float> want(n * dim);
      cpu::embedding(cpu::MatRef{th, dt, vocab, dim}, ids.data(), n, want.data());
      DeviceBuffer<uint16_t> dtb;
      DeviceBuffer<float> dtf;
      if (dt == DType::kBF16)
        dtb = upload(tb);
      else
        dtf = upload(tf);
      const void* dtab = dt == DType::kBF16 ? static_cast<const void*>(dtb.data()) : dtf.data();
      auto out = nan_buffer(n * dim);
      gk::embedding(gk::MatRef{dtab, dt, vocab, dim}, dids.data(), n, out.data(), stream.get());
      stream.synchronize();
      // A gather and an exact bf16 -> f32 widening: bit-identical.
      EXPECT_TRUE(bits_equal(out.to_host(), want))
          << "embedding n=" << n << " " << m3::dtype_name(dt);
    }
  }
}

// ---------------------------------------------------------------- rmsnorm, rope, swiglu

TEST(CudaRmsNorm, MatchesCpuIncludingInPlace) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(13);
  Stream stream;
  struct Case {
    int64_t rows, dim;
  };
  for (Case c : {Case{1, 6144}, Case{7, 6144}, Case{192, 128}, Case{5, 1}, Case{3, 100},
                 Case{2, 3000}, Case{2, 8192}, Case{2, 10240}}) {
    auto x = randn(c.rows * c.dim, g, 3.f);
    auto wf = randn(c.dim, g, 0.3f);
    auto wb = to_bf16(wf);
    for (DType dt : {DType::kBF16, DType::kF32}) {
      for (bool in_place : {false, true}) {
        const std::string what = "rmsnorm rows=" + std::to_string(c.rows) +
                                 " dim=" + std::to_string(c.dim) + " " + m3::dtype_name(dt) +
                                 (in_place ? " in place" : "");
        const void* wh = dt == DType::kBF16 ? static_cast<const void*>(wb.data()) : wf.data();
        std::vector<float> want(x.size());
        cpu::rmsnorm_gemma(x.data(), c.rows, c.dim, cpu::VecRef{wh, dt, c.dim}, 1e-6f, want.data());
        DeviceBuffer<uint16_t> dwb;
        DeviceBuffer<float> dwf;
        if (dt == DType::kBF16)
          dwb = upload(wb);
        else
          dwf = upload(wf);
        const void* dw = dt == DType::kBF16 ? static_cast<const void*>(dwb.data()) : dwf.data();
        auto dx = upload(x);
        auto dout = nan_buffer(x.size());
        float* out = in_place ? dx.data() : dout.data();
        gk::rmsnorm_gemma(dx.data(), c.rows, c.dim, gk::VecRef{dw, dt, c.dim}, 1e-6f, out,
                          stream.get());
        stream.synchronize();
        const auto got = in_place ? dx.to_host() : dout.to_host();
        // out = x·inv·(1+w): only mean(x²) is summed in a different order. A sum of dim
        // positive terms in blocked order (CPU: 8 lanes of dim/8; GPU: 256 strided lanes of
        // dim/256, or for dim % 4 == 0 up to 8192 a row in registers, 8 terms a thread, then a
        // tree) errs by at most (dim/8 + 8)·u relatively: 776·u = 4.6e-5 at 6144. rsqrt halves
        // that; the products add 3u a side. 3e-5 relative is that bound (6e-5 at 10240).
        EXPECT_EQ(0, count_mismatches(
                         got, want,
                         [&](size_t i) {
                           return (c.dim > 6144 ? 6e-5 : 3e-5) * std::fabs(want[i]) + 1e-37;
                         },
                         what));
      }
    }
  }
}

TEST(CudaRope, MatchesCpuAtLargePositions) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(14);
  Stream stream;
  struct Case {
    int64_t n, heads, head_dim, rot;
    double theta;
  };
  const std::vector<int32_t> special = {0, 1, 127, 128, 2047, 131071, 196607, 1000003};
  for (Case c : {Case{8, 64, 128, 64, 5e6}, Case{9, 4, 128, 64, 5e6}, Case{1, 64, 128, 64, 5e6},
                 Case{5, 1, 128, 128, 1e4}, Case{3, 3, 10, 6, 1e4}, Case{2, 2, 16, 0, 1e4}}) {
    const std::string what = "rope n=" + std::to_string(c.n) + " heads=" + std::to_string(c.heads) +
                             " rot=" + std::to_string(c.rot);
    std::vector<int32_t> pos(c.n);
    std::uniform_int_distribution<int32_t> pd(0, 300000);
    for (int64_t t = 0; t < c.n; ++t)
      pos[t] = t < static_cast<int64_t>(special.size()) ? special[t] : pd(g);
    auto x = randn(c.n * c.heads * c.head_dim, g);
    auto want = x;
    cpu::rope_neox(want.data(), c.n, c.heads, c.head_dim, c.rot, pos.data(), c.theta);
    auto dx = upload(x);
    auto dpos = upload(pos);
    gk::rope_neox(dx.data(), c.n, c.heads, c.head_dim, c.rot, dpos.data(), c.theta, stream.get());
    stream.synchronize();
    const auto got = dx.to_host();
    // Angles are bit-identical (same inv_freq, one fp32 multiply). cosf/sinf: CUDA is within
    // 2 ulp, glibc within 1, so |Δcos|, |Δsin| <= 3·2^-24; the products and the sum add <= 3u a
    // side. |Δ| <= 9u·(|x1|+|x2|) = 5.4e-7·(|x1|+|x2|); tol 1e-6·(...). Dims past rot: exact.
    const int64_t half = c.rot / 2;
    EXPECT_EQ(0, count_mismatches(
                     got, want,
                     [&](size_t i) {
                       const int64_t dpos_in_head = static_cast<int64_t>(i) % c.head_dim;
                       if (dpos_in_head >= c.rot) return 0.0;
                       const size_t head0 = i - dpos_in_head;
                       const int64_t j = dpos_in_head % std::max<int64_t>(half, 1);
                       return 1e-6 * (std::fabs(x[head0 + j]) + std::fabs(x[head0 + j + half])) +
                              1e-37;
                     },
                     what));
  }
}

TEST(CudaSwiglu, MatchesCpuAcrossTheClamp) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(15);
  Stream stream;
  struct Case {
    int64_t n, inter;
  };
  for (Case c : {Case{1, 3072}, Case{5, 3072}, Case{3, 1}, Case{4, 77}}) {
    // scale 5: |g|, |u| > limit 7 for ~16% of the entries, so both clamps are exercised.
    auto gate = randn(c.n * c.inter, g, 5.f), up = randn(c.n * c.inter, g, 5.f);
    std::vector<float> want(gate.size());
    cpu::swiglu_oai(gate.data(), up.data(), c.n, c.inter, 1.702f, 7.0f, 1.0f, want.data());
    auto dg = upload(gate), du = upload(up);
    auto dout = nan_buffer(gate.size());
    gk::swiglu_oai(dg.data(), du.data(), c.n, c.inter, 1.702f, 7.0f, 1.0f, dout.data(),
                   stream.get());
    stream.synchronize();
    // Same clamps and argument bits; exp differs by <= 3 ulp (CUDA 2, glibc 1), then 1+e, the
    // reciprocal and two products add <= 4u a side: |Δ| <= 11u·|out| = 6.6e-7·|out|; tol 2e-6.
    EXPECT_EQ(0,
              count_mismatches(
                  dout.to_host(), want, [&](size_t i) { return 2e-6 * std::fabs(want[i]) + 1e-37; },
                  "swiglu n=" + std::to_string(c.n) + " inter=" + std::to_string(c.inter)));
  }
}

// ---------------------------------------------------------------- router

// Logits whose top-(k+1) biased scores are either exactly tied (same logit and bias, so both
// sides compute the same bits) or at least 1e-5 apart. CUDA's expf and glibc's differ by a few
// ulps (|Δchoice| <= 4u ≈ 2.4e-7), which may legitimately flip a nearer tie; such rows are
// redrawn so the expert ids must match exactly.
void router_logits(int64_t n, int64_t E, int64_t k, const std::vector<float>& bias, std::mt19937& g,
                   bool with_ties, std::vector<float>& logits) {
  std::uniform_real_distribution<float> d(-4.f, 4.f);
  logits.assign(n * E, 0.f);
  std::vector<float> choice(E);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < n; ++t) {
    float* l = logits.data() + t * E;
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 1000) << "could not draw separable router logits";
      for (int64_t e = 0; e < E; ++e) l[e] = d(g);
      if (with_ties && t % 3 == 0) {
        for (int64_t e = 0; e < E; ++e) l[e] = 0.5f;  // all equal: ids must be 0..k-1 if no bias
      } else if (with_ties && t % 3 == 1) {
        for (int64_t e = 1; e < E; e += 2) l[e] = l[e - 1];  // pairs tie
      }
      for (int64_t e = 0; e < E; ++e)
        choice[e] = 1.0f / (1.0f + std::exp(-l[e])) + (bias.empty() ? 0.f : bias[e]);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      bool ok = true;
      for (int64_t j = 0; j + 1 < E && j < k; ++j) {
        const int32_t a = order[j], b = order[j + 1];
        const float gap = choice[a] - choice[b];
        const bool same_inputs = l[a] == l[b] && (bias.empty() || bias[a] == bias[b]);
        if (!(gap > 1e-5f || (gap == 0.f && same_inputs))) ok = false;
      }
      if (ok) break;
    }
  }
}

TEST(CudaRouter, ExpertIdsExactWeightsClose) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(16);
  Stream stream;
  struct Case {
    int64_t n, E, k;
    bool bias, ties;
    float scale;
  };
  for (Case c : {Case{33, 128, 4, true, false, 2.0f}, Case{1, 128, 4, false, false, 2.0f},
                 Case{30, 128, 4, false, true, 2.0f}, Case{12, 128, 4, true, true, 2.0f},
                 Case{20, 8, 8, true, false, 1.0f}, Case{10, 256, 1, true, false, 2.5f},
                 Case{17, 300, 6, false, false, 1.0f}}) {
    const std::string what = "router n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) +
                             " k=" + std::to_string(c.k) + (c.bias ? " bias" : "") +
                             (c.ties ? " ties" : "");
    std::vector<float> bias;
    if (c.bias) {
      // Quarter steps: a bias shared by many experts, so ties in s + bias stay exact.
      std::uniform_int_distribution<int> bd(-2, 2);
      bias.resize(c.E);
      for (auto& b : bias) b = 0.25f * static_cast<float>(bd(g));
    }
    std::vector<float> logits;
    router_logits(c.n, c.E, c.k, bias, g, c.ties, logits);
    if (HasFatalFailure()) return;
    std::vector<int32_t> want_ids(c.n * c.k);
    std::vector<float> want_w(c.n * c.k);
    cpu::router_topk(logits.data(), c.n, c.E, c.bias ? bias.data() : nullptr, c.k, c.scale,
                     want_ids.data(), want_w.data());
    auto dl = upload(logits);
    DeviceBuffer<float> db;
    if (c.bias) db = upload(bias);
    DeviceBuffer<int32_t> dids(c.n * c.k);
    dids.fill_bytes(0xff);
    auto dw = nan_buffer(c.n * c.k);
    gk::router_topk(dl.data(), c.n, c.E, c.bias ? db.data() : nullptr, c.k, c.scale, dids.data(),
                    dw.data(), stream.get());
    stream.synchronize();
    EXPECT_EQ(dids.to_host(), want_ids) << what;
    // w = s/Σs·scale: s differs by <= 4u (exp ulps, add, reciprocal), Σ of k terms adds k·u,
    // the division and scale 2u: |Δ| <= (8 + 2k)·u·|w| on each side's account; tol doubles it.
    const double f = (16.0 + 4.0 * c.k) * kU;
    EXPECT_EQ(0, count_mismatches(
                     dw.to_host(), want_w,
                     [&](size_t i) { return f * std::fabs(want_w[i]) + 1e-37; }, what));
  }
}

// The decode router in one launch: logits against cpu::linear, the picks exactly those of
// router_topk on the same logits (ties between identical rows included), and the counter left
// ready for the next launch (a second call, and the CUDA-graph replays, give the same bits).
TEST(CudaRouter, FusedGemvTopkMatchesLinearThenTopk) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(21);
  Stream stream;
  struct Case {
    int64_t n, E, hidden, k;
    bool bias, twin_rows;
  };
  DeviceBuffer<unsigned> counter(1);
  counter.fill_bytes(0);
  for (Case c : {Case{1, 128, 6144, 4, true, false}, Case{3, 128, 6144, 4, false, true},
                 Case{8, 128, 6144, 4, true, true}, Case{5, 256, 1024, 8, true, false},
                 Case{2, 8, 8192, 8, false, false}, Case{1, 33, 100, 3, true, true}}) {
    const std::string what = "router_fused n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) +
                             " hidden=" + std::to_string(c.hidden) + " k=" + std::to_string(c.k) +
                             (c.twin_rows ? " twin rows" : "");
    auto x = randn(c.n * c.hidden, g, 1.f);
    auto w = randn(c.E * c.hidden, g, 0.05f);
    if (c.twin_rows)  // experts 2j and 2j + 1 identical: every token has tied pairs
      for (int64_t e = 1; e < c.E; e += 2)
        std::copy_n(w.begin() + (e - 1) * c.hidden, c.hidden, w.begin() + e * c.hidden);
    std::vector<float> bias;
    if (c.bias) {
      std::uniform_int_distribution<int> bd(-2, 2);
      bias.resize(c.E);
      for (auto& b : bias) b = 0.25f * static_cast<float>(bd(g));
      if (c.twin_rows)
        for (int64_t e = 1; e < c.E; e += 2) bias[e] = bias[e - 1];
    }
    const gk::MatRef wm{nullptr, DType::kF32, c.E, c.hidden};
    auto dx = upload(x);
    auto dwt = upload(w);
    gk::MatRef dm = wm;
    dm.data = dwt.data();
    ASSERT_TRUE(gk::router_fused_supported(c.n, dm, c.k, dx.data())) << what;
    DeviceBuffer<float> db;
    if (c.bias) db = upload(bias);
    std::vector<float> want_l(c.n * c.E);
    cpu::linear(x.data(), c.n, cpu::MatRef{w.data(), DType::kF32, c.E, c.hidden}, want_l.data());
    for (int rep = 0; rep < 2; ++rep) {
      auto dl = nan_buffer(c.n * c.E);
      DeviceBuffer<int32_t> dids(c.n * c.k);
      dids.fill_bytes(0xff);
      auto dw = nan_buffer(c.n * c.k);
      gk::router_fused(dx.data(), c.n, dm, c.bias ? db.data() : nullptr, c.k, 2.5f, dl.data(),
                       dids.data(), dw.data(), counter.data(), stream.get());
      stream.synchronize();
      const auto got_l = dl.to_host();
      // A dot product of `hidden` terms in another order: within 2·hidden·u of Σ|w||x|.
      std::vector<double> mag(c.n * c.E, 0.0);
      for (int64_t t = 0; t < c.n; ++t)
        for (int64_t e = 0; e < c.E; ++e)
          for (int64_t i = 0; i < c.hidden; ++i)
            mag[t * c.E + e] += std::fabs(double(x[t * c.hidden + i]) * w[e * c.hidden + i]);
      EXPECT_EQ(0, count_mismatches(
                       got_l, want_l,
                       [&](size_t i) { return 2.0 * c.hidden * kU * mag[i] + 1e-30; }, what));
      // The picks are router_topk's on the same logits, exactly; the weights its arithmetic.
      std::vector<int32_t> want_ids(c.n * c.k);
      std::vector<float> want_w(c.n * c.k);
      cpu::router_topk(got_l.data(), c.n, c.E, c.bias ? bias.data() : nullptr, c.k, 2.5f,
                       want_ids.data(), want_w.data());
      EXPECT_EQ(dids.to_host(), want_ids) << what << " rep " << rep;
      const double f = (16.0 + 4.0 * c.k) * kU;
      EXPECT_EQ(0, count_mismatches(
                       dw.to_host(), want_w,
                       [&](size_t i) { return f * std::fabs(want_w[i]) + 1e-37; }, what));
    }
    EXPECT_EQ(counter.to_host(), std::vector<unsigned>{0u}) << what << ": counter reset";
  }
  // Shapes it does not take: the caller keeps linear + router_topk.
  DeviceBuffer<float> big(16 * 6144);
  gk::MatRef r{big.data(), DType::kF32, 128, 6144};
  EXPECT_FALSE(gk::router_fused_supported(9, r, 4, big.data())) << "9 tokens";
  EXPECT_FALSE(
      gk::router_fused_supported(1, gk::MatRef{big.data(), DType::kBF16, 128, 6144}, 4, big.data()))
      << "a bf16 router";
  EXPECT_FALSE(
      gk::router_fused_supported(1, gk::MatRef{big.data(), DType::kF32, 300, 64}, 4, big.data()))
      << "300 experts";
  EXPECT_FALSE(
      gk::router_fused_supported(1, gk::MatRef{big.data(), DType::kF32, 128, 10000}, 4, big.data()))
      << "hidden 10000";
  EXPECT_FALSE(
      gk::router_fused_supported(1, gk::MatRef{big.data(), DType::kF32, 128, 6142}, 4, big.data()))
      << "hidden not a multiple of 4";
}

// ---------------------------------------------------------------- paged KV, attention, MSA

// Sequences laid out in a shuffled page pool, with CSR block tables, and a step of tokens.
struct PagedSetup {
  int64_t page_size = 0, num_pages = 0;
  std::vector<int32_t> bt_offsets, block_table;
  std::vector<int32_t> positions, seq_ids;  // one step's tokens

  PagedSetup(int64_t bs, const std::vector<int64_t>& lens, int64_t spare_pages, std::mt19937& g)
      : page_size(bs) {
    int64_t total = 0;
    bt_offsets.push_back(0);
    for (int64_t len : lens) {
      total += (len + bs - 1) / bs;
      bt_offsets.push_back(static_cast<int32_t>(total));
    }
    num_pages = total + spare_pages;
    std::vector<int32_t> pages(num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), g);
    block_table.assign(pages.begin(), pages.begin() + total);
  }
  void add_token(int32_t seq, int32_t pos) {
    seq_ids.push_back(seq);
    positions.push_back(pos);
  }
  int64_t num_tokens() const { return static_cast<int64_t>(positions.size()); }
};

// The same layout in device memory (owns the arrays the device TokenLayout points to).
struct DeviceLayout {
  DeviceBuffer<int32_t> positions, seq_ids, bt_offsets, block_table;
  explicit DeviceLayout(const PagedSetup& s)
      : positions(s.positions),
        seq_ids(s.seq_ids),
        bt_offsets(s.bt_offsets),
        block_table(s.block_table) {}
  gk::TokenLayout view(int64_t n) const {
    return gk::TokenLayout{n, positions.data(), seq_ids.data(), bt_offsets.data(),
                           block_table.data()};
  }
};

cpu::TokenLayout host_view(const PagedSetup& s) {
  return cpu::TokenLayout{s.num_tokens(), s.positions.data(), s.seq_ids.data(), s.bt_offsets.data(),
                          s.block_table.data()};
}

struct AttnCase {
  int64_t page_size, nkv, heads, d, index_dim;
  std::vector<int64_t> lens;
  bool all_positions;  // query every position (else a sample per sequence)
  int64_t max_blocks;  // selected-block list length per (token, kv head)
};

void run_attention_case(const AttnCase& c, uint32_t seed) {
  std::mt19937 g(seed);
  const std::string what = "attention bs=" + std::to_string(c.page_size) +
                           " nkv=" + std::to_string(c.nkv) + " heads=" + std::to_string(c.heads) +
                           " d=" + std::to_string(c.d);
  Stream stream;
  // 1. kv_write of every token of every sequence, in a shuffled order.
  PagedSetup w(c.page_size, c.lens, 3, g);
  for (size_t s = 0; s < c.lens.size(); ++s)
    for (int64_t p = 0; p < c.lens[s]; ++p) w.add_token(static_cast<int32_t>(s), p);
  {
    std::vector<int64_t> perm(w.num_tokens());
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    auto pos = w.positions, sid = w.seq_ids;
    for (size_t i = 0; i < perm.size(); ++i) {
      w.positions[i] = pos[perm[i]];
      w.seq_ids[i] = sid[perm[i]];
    }
  }
  const int64_t row = c.nkv * c.d;
  const int64_t slots = w.num_pages * c.page_size;
  auto k = randn(w.num_tokens() * row, g), v = randn(w.num_tokens() * row, g);
  auto ik = randn(w.num_tokens() * c.index_dim, g);
  // Unwritten slots hold NaN on both sides: reading one (a causality bug) poisons the output.
  std::vector<float> hk(slots * row), hv(slots * row), hik(slots * c.index_dim);
  for (auto* a : {&hk, &hv, &hik}) std::memset(a->data(), 0xff, a->size() * sizeof(float));
  cpu::KvPages hc = cpu::KvPages::fp32(hk.data(), hv.data(), hik.data(), w.num_pages, c.page_size,
                                       c.nkv, c.d, c.index_dim);
  cpu::kv_write(hc, host_view(w), k.data(), v.data(), ik.data());

  auto dk = nan_buffer(hk.size()), dv = nan_buffer(hv.size()), dik = nan_buffer(hik.size());
  gk::KvPages dc = gk::KvPages::fp32(dk.data(), dv.data(), dik.data(), w.num_pages, c.page_size,
                                     c.nkv, c.d, c.index_dim);
  {
    DeviceLayout dl(w);
    auto dkk = upload(k), dvv = upload(v), dikk = upload(ik);
    gk::kv_write(dc, dl.view(w.num_tokens()), dkk.data(), dvv.data(), dikk.data(), stream.get());
    stream.synchronize();
  }
  // Copies: bit-identical caches, untouched slots included.
  EXPECT_TRUE(bits_equal(dk.to_host(), hk)) << what << ": kv_write K";
  EXPECT_TRUE(bits_equal(dv.to_host(), hv)) << what << ": kv_write V";
  EXPECT_TRUE(bits_equal(dik.to_host(), hik)) << what << ": kv_write index K";

  // 2. A step of query tokens from every sequence.
  PagedSetup qs = w;
  qs.positions.clear();
  qs.seq_ids.clear();
  for (size_t s = 0; s < c.lens.size(); ++s) {
    const int64_t len = c.lens[s];
    std::vector<int64_t> ps;
    if (c.all_positions) {
      for (int64_t p = 0; p < len; ++p) ps.push_back(p);
    } else {
      ps = {len - 1, 0, len / 2, c.page_size - 1, c.page_size, len - 2};
      std::uniform_int_distribution<int64_t> pd(0, len - 1);
      for (int i = 0; i < 3; ++i) ps.push_back(pd(g));
    }
    std::sort(ps.begin(), ps.end());
    ps.erase(std::unique(ps.begin(), ps.end()), ps.end());
    for (int64_t p : ps)
      if (p >= 0 && p < len) qs.add_token(static_cast<int32_t>(s), static_cast<int32_t>(p));
  }
  const int64_t T = qs.num_tokens();
  auto q = randn(T * c.heads * c.d, g);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));

  // Selected blocks per (token, kv head): the token's own block, random others, -1 gaps, in
  // random order (attention must not depend on the list order).
  std::vector<int32_t> sel(T * c.nkv * c.max_blocks, -1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t nb = qs.positions[t] / c.page_size + 1;
    for (int64_t h = 0; h < c.nkv; ++h) {
      std::vector<int32_t> all(nb);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end() - 1, g);  // the past blocks; the own block is nb-1
      std::vector<int32_t> pick;
      pick.push_back(static_cast<int32_t>(nb - 1));
      for (int64_t i = 0; i + 1 < nb && static_cast<int64_t>(pick.size()) < c.max_blocks - 1; ++i)
        pick.push_back(all[i]);
      int32_t* s = sel.data() + (t * c.nkv + h) * c.max_blocks;
      std::vector<int64_t> slot_idx(c.max_blocks);
      std::iota(slot_idx.begin(), slot_idx.end(), 0);
      std::shuffle(slot_idx.begin(), slot_idx.end(), g);
      for (size_t i = 0; i < pick.size(); ++i) s[slot_idx[i]] = pick[i];
    }
  }

  DeviceLayout dq(qs);
  auto dqq = upload(q);
  auto dsel = upload(sel);
  float vmax = 0.f;
  for (float x : v) vmax = std::max(vmax, std::fabs(x));
  for (bool selected : {false, true}) {
    std::vector<float> want(T * c.heads * c.d);
    cpu::attention_paged(q.data(), c.heads, hc, host_view(qs), selected ? sel.data() : nullptr,
                         c.max_blocks, scale, want.data());
    auto dout = nan_buffer(want.size());
    gk::attention_paged(dqq.data(), c.heads, dc, dq.view(T), selected ? dsel.data() : nullptr,
                        c.max_blocks, scale, dout.data(), stream.get());
    stream.synchronize();
    // out = Σ w_j v_j / Σ w_j, so |Δout| <= max_j |Δw_j / w_j| · max|v|. Scores are fp32 dots
    // of length d in different orders: random-walk error ~sqrt(d)·u·scale·Σ|q_i k_i| ≈
    // 11·6e-8·9 ≈ 6e-6 (d = 128, unit normals), which exp turns into the same relative weight
    // error; exp ulps and the online-softmax rescales add a few u per 32-key chunk. 2e-5·max|v|
    // covers that, while one dropped key of a 2500-key softmax moves the output ~4e-4·|v|.
    EXPECT_EQ(0, count_mismatches(
                     dout.to_host(), want, [&](size_t) { return 2e-5 * vmax; },
                     what + (selected ? " selected" : " dense")));
  }
}

TEST(CudaAttention, RealGeometryDenseAndSelected) {
  SKIP_WITHOUT_GPU();
  // 64 query heads over 4 KV heads × 128, 128-token pages; partial last pages; top-16 lists
  // (the 2500-token sequence has 20 blocks: more than 16; the others fewer).
  run_attention_case(AttnCase{128, 4, 64, 128, 128, {1, 129, 700, 2500}, false, 16}, 21);
}

TEST(CudaAttention, SmallOddGeometries) {
  SKIP_WITHOUT_GPU();
  // GQA group 3, head dim 40, 16-token pages, every position of each sequence.
  run_attention_case(AttnCase{16, 2, 6, 40, 24, {1, 17, 50, 16}, true, 3}, 22);
  // MQA (one KV head, 8 query heads), 32-token pages.
  run_attention_case(AttnCase{32, 1, 8, 128, 8, {100, 5}, false, 2}, 23);
  // Group 1 (MHA), head dim 1.
  run_attention_case(AttnCase{8, 3, 3, 1, 4, {20}, true, 4}, 24);
}

struct MsaCase {
  int64_t page_size, index_heads, index_dim, topk, init_blocks, local_blocks;
  std::vector<int64_t> lens;
  bool all_positions;
  int value_range;  // entries are multiples of 1/8 in [-r/8, r/8] (small r: many ties)
};

void run_msa_case(const MsaCase& c, uint32_t seed) {
  std::mt19937 g(seed);
  const std::string what =
      "msa bs=" + std::to_string(c.page_size) + " topk=" + std::to_string(c.topk) +
      " init=" + std::to_string(c.init_blocks) + " local=" + std::to_string(c.local_blocks);
  Stream stream;
  PagedSetup s(c.page_size, c.lens, 2, g);
  for (size_t i = 0; i < c.lens.size(); ++i) {
    const int64_t len = c.lens[i];
    std::vector<int64_t> ps;
    if (c.all_positions) {
      for (int64_t p = 0; p < len; ++p) ps.push_back(p);
    } else {
      ps = {len - 1, 0, len / 2, c.page_size * c.topk - 1, c.page_size * c.topk};
      std::uniform_int_distribution<int64_t> pd(0, len - 1);
      for (int j = 0; j < 4; ++j) ps.push_back(pd(g));
    }
    std::sort(ps.begin(), ps.end());
    ps.erase(std::unique(ps.begin(), ps.end()), ps.end());
    for (int64_t p : ps)
      if (p >= 0 && p < len) s.add_token(static_cast<int32_t>(i), static_cast<int32_t>(p));
  }
  const int64_t T = s.num_tokens();
  // Index keys fill every slot of every page (the selection reads whole past blocks only).
  auto ik = rand_eighths(s.num_pages * c.page_size * c.index_dim, g, c.value_range);
  auto iq = rand_eighths(T * c.index_heads * c.index_dim, g, c.value_range);
  cpu::KvPages hc =
      cpu::KvPages::fp32(nullptr, nullptr, ik.data(), s.num_pages, c.page_size, 1, 1, c.index_dim);
  std::vector<int32_t> want(T * c.index_heads * c.topk);
  cpu::msa_select_blocks(iq.data(), c.index_heads, hc, host_view(s), c.topk, c.init_blocks,
                         c.local_blocks, want.data());

  auto dik = upload(ik), diq = upload(iq);
  gk::KvPages dc =
      gk::KvPages::fp32(nullptr, nullptr, dik.data(), s.num_pages, c.page_size, 1, 1, c.index_dim);
  DeviceLayout dl(s);
  DeviceBuffer<int32_t> dout(want.size());
  dout.fill_bytes(0x7f);  // garbage ids, so an unwritten entry fails
  gk::msa_select_blocks(diq.data(), c.index_heads, dc, dl.view(T), c.topk, c.init_blocks,
                        c.local_blocks, dout.data(), stream.get());
  stream.synchronize();
  const auto got = dout.to_host();
  // Scores are exact (see rand_eighths), so the ids must match exactly, ties included.
  int64_t bad = 0;
  for (int64_t w = 0; w < T * c.index_heads; ++w) {
    const std::vector<int32_t> a(got.begin() + w * c.topk, got.begin() + (w + 1) * c.topk);
    const std::vector<int32_t> b(want.begin() + w * c.topk, want.begin() + (w + 1) * c.topk);
    if (a != b && ++bad <= 5) {
      std::string sa, sb;
      for (int32_t x : a) sa += std::to_string(x) + " ";
      for (int32_t x : b) sb += std::to_string(x) + " ";
      ADD_FAILURE() << what << ": token " << w / c.index_heads << " (position "
                    << s.positions[w / c.index_heads] << ") head " << w % c.index_heads
                    << "\n gpu: " << sa << "\n cpu: " << sb;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(CudaMsaSelect, RealGeometryExactIds) {
  SKIP_WITHOUT_GPU();
  // 4 index heads × 128, 128-token pages, top-16, init 0, local 1 (M3). Lengths give 1 block,
  // exactly 16 (all selected), 17 (one dropped), 40 and 157 blocks.
  run_msa_case(MsaCase{128, 4, 128, 16, 0, 1, {1, 128, 2048, 2049, 5000, 20000}, false, 8}, 31);
}

TEST(CudaMsaSelect, TiesAndForcedBlocksExactIds) {
  SKIP_WITHOUT_GPU();
  // Values in {-1/8, 0, 1/8}: many equal block scores, resolved to the lower block id.
  run_msa_case(MsaCase{4, 2, 8, 3, 1, 1, {1, 12, 13, 40}, true, 1}, 32);
  // Forced init + local blocks outnumber top-k (forced ties at +inf go to the lower ids).
  run_msa_case(MsaCase{4, 1, 8, 2, 2, 2, {40}, true, 2}, 33);
  // No initial blocks, only the local one (the op requires a forced local block: the config
  // loader refuses sparse_local_block < 1); odd index dim.
  run_msa_case(MsaCase{16, 3, 40, 4, 0, 1, {100, 300}, true, 8}, 34);
  // Wider value range, top-k larger than a warp's worth of blocks.
  run_msa_case(MsaCase{8, 2, 64, 40, 1, 2, {1000}, false, 8}, 35);
}

TEST(CudaDevice, ProbeReportsAReason) {
  // Runs everywhere: without a GPU the probe must fail with a message naming the fix.
  auto dev = m3::gpu::probe_device(0);
  if (dev) {
    EXPECT_GT(dev->num_sms, 0);
    EXPECT_GT(dev->total_bytes, 0u);
  } else {
    EXPECT_NE(dev.error().message.find("--device cpu"), std::string::npos) << dev.error().message;
  }
}

}  // namespace
