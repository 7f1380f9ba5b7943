// Each CPU op against a naive double-precision reference written from m3-model.md, over odd
// sizes and edge cases. Tolerances: an fp32 sum of K products differs from the exact sum by at
// most ~K * 2^-24 * sum|a_i b_i| (sequential rounding bound); we allow 4x that, computed per
// output from the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {
namespace {

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

std::vector<float> randn(size_t n, std::mt19937& g, float s = 1.f) {
  std::normal_distribution<float> d(0.f, s);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = f32_to_bf16(v[i]);
  return r;
}

TEST(Linear, MatchesNaiveBf16AndF32) {
  std::mt19937 g(1);
  for (auto [n, m, k] : {std::tuple{1, 1, 1}, {3, 17, 33}, {5, 64, 128}, {2, 9, 7}}) {
    auto x = randn(n * k, g), wf = randn(m * k, g);
    auto wb = to_bf16(wf);
    for (bool bf : {true, false}) {
      MatRef w{bf ? (const void*)wb.data() : (const void*)wf.data(),
               bf ? DType::kBF16 : DType::kF32, m, k};
      std::vector<float> y(n * m);
      linear(x.data(), n, w, y.data());
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < m; ++r) {
          double ref = 0, mag = 0;
          for (int c = 0; c < k; ++c) {
            const double wv = bf ? bf16_to_f32(wb[r * k + c]) : wf[r * k + c];
            ref += x[t * k + c] * wv;
            mag += std::fabs(x[t * k + c] * wv);
          }
          EXPECT_NEAR(y[t * m + r], ref, 4 * k * kU * mag + 1e-30) << n << " " << m << " " << k;
        }
    }
  }
}

TEST(Embedding, GathersRows) {
  std::mt19937 g(2);
  auto tf = randn(10 * 6, g);
  auto tb = to_bf16(tf);
  MatRef t{tb.data(), DType::kBF16, 10, 6};
  std::vector<int32_t> ids = {3, 0, 9, 3};
  std::vector<float> out(4 * 6);
  embedding(t, ids.data(), 4, out.data());
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 6; ++c) EXPECT_EQ(out[i * 6 + c], bf16_to_f32(tb[ids[i] * 6 + c]));
}

TEST(RmsNorm, GemmaOnePlusWeight) {
  std::mt19937 g(3);
  for (int dim : {1, 7, 128}) {
    auto x = randn(3 * dim, g, 3.f), wf = randn(dim, g, 0.3f);
    auto wb = to_bf16(wf);
    VecRef w{wb.data(), DType::kBF16, dim};
    std::vector<float> out(3 * dim);
    rmsnorm_gemma(x.data(), 3, dim, w, 1e-6f, out.data());
    for (int r = 0; r < 3; ++r) {
      double ss = 0;
      for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
      const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
      for (int i = 0; i < dim; ++i) {
        const double ref = x[r * dim + i] * inv * (1.0 + bf16_to_f32(wb[i]));
        // mean of squares: dim-term sum (dim*u) + sqrt/div/mul (~4u) relative error.
        EXPECT_NEAR(out[r * dim + i], ref, (4 * dim + 8) * kU * std::fabs(ref) + 1e-30);
      }
    }
    // in place gives the same
    std::vector<float> y = x;
    rmsnorm_gemma(y.data(), 3, dim, w, 1e-6f, y.data());
    EXPECT_EQ(y, out);
  }
}

TEST(Rope, PartialNeoxHalves) {
  std::mt19937 g(4);
  const int n = 3, heads = 2, hd = 16, rot = 8;
  auto x = randn(n * heads * hd, g);
  std::vector<int32_t> pos = {0, 5, 1000000};
  auto y = x;
  rope_neox(y.data(), n, heads, hd, rot, pos.data(), 5e6);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h) {
      const float* a = x.data() + (t * heads + h) * hd;
      const float* b = y.data() + (t * heads + h) * hd;
      for (int i = 0; i < rot / 2; ++i) {
        const double f = 1.0 / std::pow(5e6, 2.0 * i / rot);
        const double ang = pos[t] * f;
        const double r1 = a[i] * std::cos(ang) - a[i + rot / 2] * std::sin(ang);
        const double r2 = a[i + rot / 2] * std::cos(ang) + a[i] * std::sin(ang);
        // fp32 angle: |p * inv_freq| up to 1e6 carries ~1e6 * 2^-24 ≈ 0.06 rad of absolute
        // error at the largest position (the reference computes angles in fp32 too), so
        // compare loosely there and tightly for small positions.
        const double tol = pos[t] > 1000 ? 0.2 : 1e-5;
        EXPECT_NEAR(b[i], r1, tol);
        EXPECT_NEAR(b[i + rot / 2], r2, tol);
      }
      for (int i = rot; i < hd; ++i) EXPECT_EQ(b[i], a[i]);  // pass-through dims untouched
    }
  // position 0 is the identity
  for (int i = 0; i < heads * hd; ++i) EXPECT_FLOAT_EQ(y[i], x[i]);
}

TEST(SwigluOai, ClampsAlphaAndBeta) {
  std::vector<float> gate = {-10, -1, 0, 0.5, 3, 7, 8, 100};
  std::vector<float> up = {-100, -8, -7, -0.5, 0, 3, 7.5, 100};
  std::vector<float> out(8);
  swiglu_oai(gate.data(), up.data(), 1, 8, 1.702f, 7.f, 1.f, out.data());
  for (int i = 0; i < 8; ++i) {
    const double gc = std::min<double>(gate[i], 7.0);
    const double uc = std::clamp<double>(up[i], -7.0, 7.0);
    const double ref = gc / (1 + std::exp(-1.702 * gc)) * (uc + 1.0);
    EXPECT_NEAR(out[i], ref, 1e-5 * std::max(1.0, std::fabs(ref)));
  }
}

TEST(Router, BiasSelectsButDoesNotWeigh) {
  // Expert 0 has the best raw score, but the bias moves expert 3 into the top-2.
  std::vector<float> logits = {2.0f, 1.0f, 0.5f, 0.0f};
  std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.6f};
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  router_topk(logits.data(), 1, 4, bias.data(), 2, 2.0f, ids.data(), w.data());
  std::set<int32_t> got(ids.begin(), ids.end());
  EXPECT_EQ(got, (std::set<int32_t>{0, 3}));
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  const double s0 = sig(2.0), s3 = sig(0.0);
  for (int j = 0; j < 2; ++j) {
    const double ref = (ids[j] == 0 ? s0 : s3) / (s0 + s3) * 2.0;
    EXPECT_NEAR(w[j], ref, 1e-6);
  }
  // without bias: experts 0 and 1
  router_topk(logits.data(), 1, 4, nullptr, 2, 1.0f, ids.data(), w.data());
  EXPECT_EQ(std::set<int32_t>(ids.begin(), ids.end()), (std::set<int32_t>{0, 1}));
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
}

// A paged cache with pages shuffled, filled for one or two sequences, compared to contiguous
// naive attention.
struct PagedFixture {
  int64_t page = 4, nkv = 2, d = 8, di = 8;
  std::vector<float> k, v, ik;
  KvPages pages;
  std::vector<int32_t> bt_off, bt;
  std::vector<std::vector<float>> K, V, IK;  // per sequence contiguous [len, nkv, d]
  PagedFixture(std::vector<int64_t> lens, std::mt19937& g) {
    int64_t total_pages = 0;
    for (auto l : lens) total_pages += (l + page - 1) / page;
    std::vector<int32_t> perm(total_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    k.assign(total_pages * page * nkv * d, NAN);
    v = k;
    ik.assign(total_pages * page * di, NAN);
    pages = KvPages::fp32(k.data(), v.data(), ik.data(), total_pages, page, nkv, d, di);
    bt_off.push_back(0);
    int64_t next = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t np = (lens[s] + page - 1) / page;
      for (int64_t i = 0; i < np; ++i) bt.push_back(perm[next++]);
      bt_off.push_back(bt.size());
      K.push_back(randn(lens[s] * nkv * d, g));
      V.push_back(randn(lens[s] * nkv * d, g));
      IK.push_back(randn(lens[s] * di, g));
      // write through kv_write
      std::vector<int32_t> pos(lens[s]), sid(lens[s], s);
      std::iota(pos.begin(), pos.end(), 0);
      TokenLayout L{lens[s], pos.data(), sid.data(), bt_off.data(), bt.data()};
      // bt_off may not yet cover later sequences; kv_write only reads this sequence's entries.
      kv_write(pages, L, K[s].data(), V[s].data(), IK[s].data());
    }
  }
};

TEST(Attention, DenseAndSelectedMatchNaive) {
  std::mt19937 g(5);
  PagedFixture f({11, 6}, g);
  const int64_t nq = 4;  // group of 2 per kv head
  // queries: seq 0 positions 0, 3, 4, 10; seq 1 position 5
  std::vector<int32_t> pos = {0, 3, 4, 10, 5}, sid = {0, 0, 0, 0, 1};
  const int64_t T = pos.size();
  auto q = randn(T * nq * f.d, g);
  TokenLayout L{T, pos.data(), sid.data(), f.bt_off.data(), f.bt.data()};
  // selection: block lists per (t, kv head); -1 padded, max 2
  std::vector<int32_t> sel = {0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 0, 1, 2, 0, 1, 2, 1, 0, -1, 1};
  for (bool sparse : {false, true}) {
    std::vector<float> out(T * nq * f.d);
    attention_paged(q.data(), nq, f.pages, L, sparse ? sel.data() : nullptr, 2, 0.35f, out.data());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nq; ++h) {
        const int64_t gidx = h / 2;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j <= pos[t]; ++j) {
          bool ok = true;
          if (sparse) {
            ok = false;
            for (int i = 0; i < 2; ++i) ok |= sel[(t * 2 + gidx) * 2 + i] == j / f.page;
          }
          if (ok) keys.push_back(j);
        }
        const auto& K = f.K[sid[t]];
        const auto& V = f.V[sid[t]];
        std::vector<double> s(keys.size());
        double mx = -1e300;
        for (size_t a = 0; a < keys.size(); ++a) {
          double dd = 0;
          for (int64_t i = 0; i < f.d; ++i)
            dd += double(q[(t * nq + h) * f.d + i]) * K[(keys[a] * f.nkv + gidx) * f.d + i];
          s[a] = dd * 0.35;
          mx = std::max(mx, s[a]);
        }
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int64_t i = 0; i < f.d; ++i) {
          double ref = 0;
          for (size_t a = 0; a < keys.size(); ++a)
            ref += s[a] / sum * V[(keys[a] * f.nkv + gidx) * f.d + i];
          // softmax of <= 11 terms and d=8 dots in fp32: well under 1e-5 absolute for unit data.
          EXPECT_NEAR(out[(t * nq + h) * f.d + i], ref, 1e-5) << sparse << " t" << t << " h" << h;
        }
      }
  }
}

TEST(Msa, SelectionMatchesNaiveMaxPoolTopk) {
  std::mt19937 g(6);
  const int64_t len = 29;
  PagedFixture f({len}, g);  // page 4 => up to 8 blocks
  const int64_t ni = 2;
  for (auto [topk, init, local] : {std::tuple{3, 0, 1}, {2, 0, 1}, {4, 1, 1}, {3, 0, 2}}) {
    std::vector<int32_t> pos(len), sid(len, 0);
    std::iota(pos.begin(), pos.end(), 0);
    auto iq = randn(len * ni * f.di, g);
    TokenLayout L{len, pos.data(), sid.data(), f.bt_off.data(), f.bt.data()};
    std::vector<int32_t> out(len * ni * topk);
    msa_select_blocks(iq.data(), ni, f.pages, L, topk, init, local, out.data());
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < ni; ++h) {
        const int64_t nb = pos[t] / f.page + 1;
        std::vector<int32_t> expect;
        if (nb <= topk) {
          for (int b = 0; b < nb; ++b) expect.push_back(b);
        } else {
          std::vector<std::pair<double, int>> sc;
          for (int b = 0; b < nb; ++b) {
            double best = -1e300;
            for (int64_t j = b * f.page; j < std::min<int64_t>((b + 1) * f.page, pos[t] + 1); ++j) {
              double dd = 0;
              for (int64_t i = 0; i < f.di; ++i)
                dd += double(iq[(t * ni + h) * f.di + i]) * f.IK[0][j * f.di + i];
              best = std::max(best, dd);
            }
            if (b < init || b >= nb - local) best = 1e300;
            sc.push_back({-best, b});
          }
          std::sort(sc.begin(), sc.end());
          for (int i = 0; i < topk; ++i) expect.push_back(sc[i].second);
          std::sort(expect.begin(), expect.end());
        }
        while ((int64_t)expect.size() < topk) expect.push_back(-1);
        std::vector<int32_t> got(out.begin() + (t * ni + h) * topk,
                                 out.begin() + (t * ni + h + 1) * topk);
        EXPECT_EQ(got, expect) << "t=" << t << " h=" << h << " topk=" << topk;
      }
  }
}

TEST(LogSoftmax, NormalisesRows) {
  std::vector<float> l = {1, 2, 3, -1000, 0, 0};
  std::vector<float> o(6);
  log_softmax(l.data(), 2, 3, o.data());
  for (int r = 0; r < 2; ++r) {
    double s = 0;
    for (int i = 0; i < 3; ++i) s += std::exp(double(o[r * 3 + i]));
    EXPECT_NEAR(s, 1.0, 1e-6);
  }
  EXPECT_NEAR(o[4], -std::log(2.0), 1e-6);
}

}  // namespace
// YaRN (transformers' / vLLM's "yarn" rope type) at M3's shapes and the recipe's 1M override:
// dims below the fast correction dim keep the plain frequency, dims past the slow one are divided
// by the factor, the ramp between is linear; cos and sin are scaled by the attention factor.
TEST(Rope, YarnFrequenciesAndScale) {
  const double theta = 5e6;
  const int64_t rot = 64;
  RopeScaling y;
  y.factor = 2.f;
  y.original_max_position = 524288;
  y.attention_factor = static_cast<float>(0.1 * std::log(2.0) + 1.0);
  std::vector<float> plain(rot / 2), yarn(rot / 2);
  rope_inv_freq(theta, RopeScaling{}, rot, plain.data());
  rope_inv_freq(theta, y, rot, yarn.data());
  // The correction range, in double: d * ln(L / (beta * 2 pi)) / (2 ln theta), floor / ceil.
  const double pi2 = 2 * std::acos(-1.0);
  const double low =
      std::max(0.0, std::floor(rot * std::log(524288 / (32 * pi2)) / (2 * std::log(theta))));
  const double high = std::min<double>(
      rot - 1, std::ceil(rot * std::log(524288 / (1 * pi2)) / (2 * std::log(theta))));
  ASSERT_LT(low, high);
  for (int64_t i = 0; i < rot / 2; ++i) {
    EXPECT_FLOAT_EQ(plain[i], 1.0f / std::pow(5e6f, static_cast<float>(2 * i) / rot));
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = plain[i] * (1.0 - ramp) + plain[i] / 2.0 * ramp;
    EXPECT_NEAR(yarn[i], want, 2e-7 * plain[i] + 1e-30) << i;
    if (i <= low) {
      EXPECT_EQ(yarn[i], plain[i]) << i;
    }
  }
  // The rotated pair keeps its norm times the attention factor; unrotated dims are untouched.
  const int64_t d = 128;
  std::vector<float> x(d), xr;
  std::mt19937 g(3);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  xr = x;
  const int32_t pos = 700000;
  rope_neox(xr.data(), 1, 1, d, rot, &pos, theta, y);
  for (int64_t i = 0; i < rot / 2; ++i) {
    const double n0 = std::hypot(x[i], x[i + rot / 2]), n1 = std::hypot(xr[i], xr[i + rot / 2]);
    EXPECT_NEAR(n1, n0 * y.attention_factor, 1e-5 * (1 + n0)) << i;
  }
  for (int64_t i = rot; i < d; ++i) EXPECT_EQ(xr[i], x[i]);
}

}  // namespace m3::kernels::cpu
