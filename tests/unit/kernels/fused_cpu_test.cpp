// The CPU twins of the CUDA ops the forward calls (kernels/cpu/fused.h and moe_experts.cpp:
// add_rmsnorm_gemma, attn_prep, swiglu_oai_rows, moe_localize_ids, moe_experts,
// embedding_vocab_slice and the row ops), each against an independent naive reference written
// here (double precision where it computes), plus the equalities their contracts promise bit
// for bit (fused layout == packed layout, scattered experts == contiguous experts, a batch ==
// one token at a time, the fused op == the plain ops it stands for) and their aborts.
// Integer and copy outputs must match exactly. Float tolerances (u = 2^-24, fp32 unit roundoff)
// are derived where they are used, each a first-order rounding bound doubled for margin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/fused.h"
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

std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_f32(v[i]);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Death tests re-run the binary: the process thread pool's workers do not survive a fork.
void threadsafe_death_tests() {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
}

// ---------------------------------------------------------------- naive references

// Gemma RMSNorm of one row in double: x * 1/sqrt(mean(x²) + eps) * (1 + w).
std::vector<double> norm_ref(const float* x, int64_t dim, const std::vector<float>& w, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / double(dim) + double(eps));
  std::vector<double> o(dim);
  for (int64_t i = 0; i < dim; ++i) o[i] = x[i] * inv * (1.0 + double(w[i]));
  return o;
}

// Partial NeoX RoPE of one head in double. The angle is the model's fp32 angle (m3-model.md
// §3.5: inv_freq = 1 / theta^(2i/rot) and float(p) * inv_freq in fp32, as HF computes it);
// cos, sin and the rotation are in double.
void rope_ref(double* v, int64_t rot, int32_t pos, double theta) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(rot);
    const float inv = 1.0f / std::pow(static_cast<float>(theta), e);
    const double a = static_cast<float>(static_cast<float>(pos) * inv);
    const double x1 = v[i], x2 = v[i + half];
    v[i] = x1 * std::cos(a) - x2 * std::sin(a);
    v[i + half] = x2 * std::cos(a) + x1 * std::sin(a);
  }
}

// norm then rope of one head vs the op's output `got` (dim floats).
// Tolerance: the fp32 norm sums dim squares (relative error <= dim*u, positive terms), then
// /dim, +eps, sqrt (halves it), 1/x, two products and the rounded 1 + w: <= (dim/2 + 7)u
// relative. RoPE: float cos/sin of the same fp32 angle (<= 1u each), two products and a sum:
// <= (dim/2 + 11)u * (|n1| + |n2|) for a rotated pair. Doubled: (dim + 16)u|n| pass-through,
// (dim + 24)u(|n1| + |n2|) rotated. dim = 128: ~1e-5 relative, far below a wrong formula.
void expect_norm_rope(const float* x, const float* got, int64_t dim, int64_t rot,
                      const std::vector<float>& w, float eps, int32_t pos, double theta,
                      const std::string& what) {
  auto n = norm_ref(x, dim, w, eps);
  const auto unrotated = n;
  rope_ref(n.data(), rot, pos, theta);
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < dim; ++i) {
    double tol;
    if (i < rot) {
      const int64_t j = i < half ? i : i - half;
      tol = (dim + 24) * kU * (std::fabs(unrotated[j]) + std::fabs(unrotated[j + half]));
    } else {
      tol = (dim + 16) * kU * std::fabs(unrotated[i]);
    }
    ASSERT_NEAR(got[i], n[i], tol + 1e-30) << what << " dim " << i;
  }
}

// ---------------------------------------------------------------- add_rmsnorm_gemma

TEST(FusedCpu, AddRmsnormGemmaIsAddThenNorm) {
  std::mt19937 g(1);
  for (int64_t rows : {1, 3, 17}) {
    for (int64_t dim : {1, 7, 128, 6144}) {
      for (bool bf : {true, false}) {
        const auto x0 = randn(rows * dim, g, 3.f), y = randn(rows * dim, g);
        const auto wf = randn(dim, g, 0.3f);
        const auto wb = to_bf16(wf);
        const std::vector<float> wv = bf ? from_bf16(wb) : wf;
        const VecRef w{bf ? static_cast<const void*>(wb.data()) : wf.data(),
                       bf ? DType::kBF16 : DType::kF32, dim};
        auto x = x0;
        std::vector<float> out(rows * dim, NAN);
        add_rmsnorm_gemma(x.data(), y.data(), rows, dim, w, 1e-6f, out.data());
        const std::string what = "rows " + std::to_string(rows) + " dim " + std::to_string(dim) +
                                 (bf ? " bf16" : " f32");
        // The residual: one fp32 addition per element, exact to the bit.
        for (int64_t i = 0; i < rows * dim; ++i) ASSERT_EQ(x[i], x0[i] + y[i]) << what << " " << i;
        // The norm of the new residual; tolerance (dim + 16)u relative (see expect_norm_rope).
        for (int64_t r = 0; r < rows; ++r) {
          const auto ref = norm_ref(x.data() + r * dim, dim, wv, 1e-6f);
          for (int64_t i = 0; i < dim; ++i)
            ASSERT_NEAR(out[r * dim + i], ref[i], (dim + 16) * kU * std::fabs(ref[i]) + 1e-30)
                << what << " row " << r << " col " << i;
        }
        // And what the twin stands for: rmsnorm_gemma of the sum, bit for bit.
        std::vector<float> plain(rows * dim);
        rmsnorm_gemma(x.data(), rows, dim, w, 1e-6f, plain.data());
        EXPECT_TRUE(same_bits(out, plain)) << what;
      }
    }
  }
}

TEST(FusedCpuDeath, AddRmsnormGemmaOutAliasingXAborts) {
  threadsafe_death_tests();
  std::vector<float> x(8, 1.f), y(8, 1.f);
  const std::vector<uint16_t> wb(4, 0);
  const VecRef w{wb.data(), DType::kBF16, 4};
  EXPECT_DEATH(add_rmsnorm_gemma(x.data(), y.data(), 2, 4, w, 1e-6f, x.data()), "must not alias");
}

// ---------------------------------------------------------------- swiglu_oai_rows

TEST(FusedCpu, SwigluOaiRowsIsSwigluOnTheHalves) {
  std::mt19937 g(2);
  const float alpha = 1.702f, limit = 7.f, beta = 1.f;
  for (int64_t n : {1, 3, 33}) {
    for (int64_t inter : {1, 7, 64}) {
      auto gu = randn(n * 2 * inter, g, 4.f);  // beyond the clamp limit too
      // Edge values in the first row: at and beyond the limits, up = -beta (a zero factor).
      const float edges[] = {-100.f, -7.f, 0.f, 7.f, 8.f, 100.f, -1.f};
      for (int64_t i = 0; i < std::min<int64_t>(inter, 7); ++i) {
        gu[i] = edges[i];
        gu[inter + i] = edges[6 - i];
      }
      std::vector<float> out(n * inter, NAN);
      swiglu_oai_rows(gu.data(), n, inter, alpha, limit, beta, out.data());
      const std::string what = "n " + std::to_string(n) + " inter " + std::to_string(inter);
      // Naive: gate = row[0, inter), up = row[inter, 2 inter), in double. Tolerance: -alpha*gc
      // is rounded (u|z| absolute on the exponent with z = alpha*gc, so u|z| relative on exp),
      // expf <= 2u, then 1 + e, 1/x, gc*s, uc + beta and the product: (|z| + 8)u relative,
      // doubled: (2 alpha |gc| + 16)u.
      std::vector<float> gate(n * inter), up(n * inter);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < inter; ++i) {
          const float gv = gu[t * 2 * inter + i], uv = gu[t * 2 * inter + inter + i];
          gate[t * inter + i] = gv;
          up[t * inter + i] = uv;
          const double gc = std::min<double>(gv, limit);
          const double uc = std::clamp<double>(uv, -limit, limit);
          const double ref = gc / (1.0 + std::exp(-double(alpha) * gc)) * (uc + beta);
          const double tol = (2 * alpha * std::fabs(gc) + 16) * kU * std::fabs(ref);
          ASSERT_NEAR(out[t * inter + i], ref, tol + 1e-30) << what << " t " << t << " i " << i;
        }
      std::vector<float> plain(n * inter);
      swiglu_oai(gate.data(), up.data(), n, inter, alpha, limit, beta, plain.data());
      EXPECT_TRUE(same_bits(out, plain)) << what;
    }
  }
}

// ---------------------------------------------------------------- attn_prep

struct Geometry {
  int64_t nq, nkv, d, rot, ni, di, irot, page;
};

struct PrepCase {
  std::vector<int> lens, news;  // tokens already cached / new this step, per sequence
  bool sparse;
};

// Runs attn_prep over sequences with shuffled pages in three ways: packed inputs normed in
// place (q_out == q), the fused projection layout (one row per token: q | k | v | iq | ik,
// in_stride apart, q / iq to separate outputs), and the plain ops one after another. Checks
// the first against the naive reference, slot by slot, and the other two against it bit for bit.
void check_attn_prep(const Geometry& G, const PrepCase& c, uint32_t seed) {
  std::mt19937 g(seed);
  const bool sparse = c.sparse;
  std::vector<int32_t> offsets{0}, table, positions, seq_ids;
  int32_t num_pages = 0;
  for (size_t s = 0; s < c.lens.size(); ++s) {
    const int total = c.lens[s] + c.news[s];
    const int pages = static_cast<int>((total + G.page - 1) / G.page) + 1;  // one spare
    for (int p = 0; p < pages; ++p) table.push_back(num_pages++);
    offsets.push_back(static_cast<int32_t>(table.size()));
    for (int j = 0; j < c.news[s]; ++j) {
      positions.push_back(c.lens[s] + j);
      seq_ids.push_back(static_cast<int32_t>(s));
    }
  }
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g);
  for (auto& p : table) p = perm[p];
  const int64_t T = static_cast<int64_t>(positions.size());
  const int64_t cq = G.nq * G.d, ckv = G.nkv * G.d, ciq = sparse ? G.ni * G.di : 0,
                cik = sparse ? G.di : 0;
  const auto q = randn(T * cq, g, 2.f), k = randn(T * ckv, g, 2.f), v = randn(T * ckv, g);
  const auto iq = randn(T * ciq, g, 2.f), ik = randn(T * cik, g, 2.f);
  const auto qn = to_bf16(randn(G.d, g, 0.2f)), kn = to_bf16(randn(G.d, g, 0.2f)),
             iqn = to_bf16(randn(G.di, g, 0.2f)), ikn = to_bf16(randn(G.di, g, 0.2f));
  const size_t kv_n = static_cast<size_t>(num_pages * G.page * ckv);
  const size_t ik_n = static_cast<size_t>(num_pages * G.page * G.di);
  const auto ck0 = randn(kv_n, g), cv0 = randn(kv_n, g), cik0 = randn(ik_n, g);  // prior contents
  const double theta = 5e6;
  const float eps = 1e-6f;
  const TokenLayout L{T, positions.data(), seq_ids.data(), offsets.data(), table.data()};

  auto base_args = [&] {
    AttnPrepArgs a;
    a.num_q_heads = G.nq;
    a.num_kv_heads = G.nkv;
    a.head_dim = G.d;
    a.rot_dim = G.rot;
    a.q_norm = {qn.data(), DType::kBF16, G.d};
    a.k_norm = {kn.data(), DType::kBF16, G.d};
    if (sparse) {
      a.num_index_heads = G.ni;
      a.index_dim = G.di;
      a.index_rot_dim = G.irot;
      a.iq_norm = {iqn.data(), DType::kBF16, G.di};
      a.ik_norm = {ikn.data(), DType::kBF16, G.di};
    }
    a.eps = eps;
    a.theta = theta;
    return a;
  };
  struct Out {
    std::vector<float> q, iq, ck, cv, cik;
  };
  auto pages_of = [&](Out& o) {
    o.ck = ck0;
    o.cv = cv0;
    o.cik = cik0;
    // A dense layer's cache has no index-K pages; a sparse one's must be written.
    return KvPages::fp32(o.ck.data(), o.cv.data(), sparse ? o.cik.data() : nullptr, num_pages,
                         G.page, G.nkv, G.d, sparse ? G.di : 0);
  };

  // 1. Packed, in place.
  Out packed;
  packed.q = q;
  packed.iq = iq;
  {
    AttnPrepArgs a = base_args();
    a.q = a.q_out = packed.q.data();
    a.k = k.data();
    a.v = v.data();
    if (sparse) {
      a.iq = a.iq_out = packed.iq.data();
      a.ik = ik.data();
    }
    attn_prep(a, pages_of(packed), L);
  }
  // 2. The fused projection layout, with a 3-float gap after ik so that in_stride is no sum
  //    of the widths.
  Out fused;
  fused.q.assign(T * cq, NAN);
  fused.iq.assign(T * ciq, NAN);
  {
    const int64_t row = cq + 2 * ckv + ciq + cik + 3;
    std::vector<float> proj(T * row, NAN);
    for (int64_t t = 0; t < T; ++t) {
      float* r = proj.data() + t * row;
      std::copy_n(q.data() + t * cq, cq, r);
      std::copy_n(k.data() + t * ckv, ckv, r + cq);
      std::copy_n(v.data() + t * ckv, ckv, r + cq + ckv);
      std::copy_n(iq.data() + t * ciq, ciq, r + cq + 2 * ckv);
      std::copy_n(ik.data() + t * cik, cik, r + cq + 2 * ckv + ciq);
    }
    const auto proj0 = proj;
    AttnPrepArgs a = base_args();
    a.in_stride = row;
    a.q = proj.data();
    a.q_out = fused.q.data();
    a.k = proj.data() + cq;
    a.v = proj.data() + cq + ckv;
    if (sparse) {
      a.iq = proj.data() + cq + 2 * ckv;
      a.iq_out = fused.iq.data();
      a.ik = proj.data() + cq + 2 * ckv + ciq;
    }
    attn_prep(a, pages_of(fused), L);
    EXPECT_TRUE(same_bits(proj, proj0)) << "the fused projection is input only";
  }
  // 3. The plain ops the twin stands for.
  Out plain;
  plain.q = q;
  plain.iq = iq;
  {
    auto kk = k, ikk = ik;
    rmsnorm_gemma(plain.q.data(), T * G.nq, G.d, {qn.data(), DType::kBF16, G.d}, eps,
                  plain.q.data());
    rope_neox(plain.q.data(), T, G.nq, G.d, G.rot, positions.data(), theta);
    rmsnorm_gemma(kk.data(), T * G.nkv, G.d, {kn.data(), DType::kBF16, G.d}, eps, kk.data());
    rope_neox(kk.data(), T, G.nkv, G.d, G.rot, positions.data(), theta);
    if (sparse) {
      rmsnorm_gemma(plain.iq.data(), T * G.ni, G.di, {iqn.data(), DType::kBF16, G.di}, eps,
                    plain.iq.data());
      rope_neox(plain.iq.data(), T, G.ni, G.di, G.irot, positions.data(), theta);
      rmsnorm_gemma(ikk.data(), T, G.di, {ikn.data(), DType::kBF16, G.di}, eps, ikk.data());
      rope_neox(ikk.data(), T, 1, G.di, G.irot, positions.data(), theta);
    }
    kv_write(pages_of(plain), L, kk.data(), v.data(), sparse ? ikk.data() : nullptr);
  }

  const std::string what = std::string(sparse ? "sparse" : "dense") + " T=" + std::to_string(T) +
                           " d=" + std::to_string(G.d) + " seed " + std::to_string(seed);
  // The naive reference, token by token, head by head, slot by slot.
  const auto qnf = from_bf16(qn), knf = from_bf16(kn), iqnf = from_bf16(iqn), iknf = from_bf16(ikn);
  std::vector<char> written(static_cast<size_t>(num_pages * G.page), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t p = positions[t], s = seq_ids[t];
    const int64_t slot = int64_t(table[offsets[s] + p / G.page]) * G.page + p % G.page;
    ASSERT_FALSE(written[slot]) << "test layout: two tokens in one slot";
    written[slot] = 1;
    const std::string tw = what + " token " + std::to_string(t);
    for (int64_t h = 0; h < G.nq; ++h)
      expect_norm_rope(q.data() + (t * G.nq + h) * G.d, packed.q.data() + (t * G.nq + h) * G.d, G.d,
                       G.rot, qnf, eps, p, theta, tw + " q head " + std::to_string(h));
    for (int64_t h = 0; h < G.nkv; ++h) {
      expect_norm_rope(k.data() + (t * G.nkv + h) * G.d, packed.ck.data() + slot * ckv + h * G.d,
                       G.d, G.rot, knf, eps, p, theta, tw + " page K head " + std::to_string(h));
    }
    for (int64_t i = 0; i < ckv; ++i)
      ASSERT_EQ(packed.cv[slot * ckv + i], v[t * ckv + i]) << tw << " page V (a copy) " << i;
    if (sparse) {
      for (int64_t h = 0; h < G.ni; ++h)
        expect_norm_rope(iq.data() + (t * G.ni + h) * G.di,
                         packed.iq.data() + (t * G.ni + h) * G.di, G.di, G.irot, iqnf, eps, p,
                         theta, tw + " iq head " + std::to_string(h));
      expect_norm_rope(ik.data() + t * G.di, packed.cik.data() + slot * G.di, G.di, G.irot, iknf,
                       eps, p, theta, tw + " page index-K");
    }
  }
  // Every other slot keeps its contents; a dense layer writes no index-K page.
  for (int64_t slot = 0; slot < num_pages * G.page; ++slot) {
    if (written[slot]) continue;
    ASSERT_EQ(0, std::memcmp(packed.ck.data() + slot * ckv, ck0.data() + slot * ckv, ckv * 4))
        << what << " unwritten K slot " << slot;
    ASSERT_EQ(0, std::memcmp(packed.cv.data() + slot * ckv, cv0.data() + slot * ckv, ckv * 4))
        << what << " unwritten V slot " << slot;
  }
  for (int64_t slot = 0; slot < num_pages * G.page; ++slot) {
    if (sparse && written[slot]) continue;
    ASSERT_EQ(0, std::memcmp(packed.cik.data() + slot * G.di, cik0.data() + slot * G.di, G.di * 4))
        << what << " index-K slot " << slot << (sparse ? " (unwritten)" : " (dense layer)");
  }
  // The three ways agree bit for bit.
  for (const Out* o : {&fused, &plain}) {
    const char* name = o == &fused ? " fused layout" : " plain ops";
    EXPECT_TRUE(same_bits(o->q, packed.q)) << what << name << " q";
    EXPECT_TRUE(same_bits(o->ck, packed.ck)) << what << name << " page K";
    EXPECT_TRUE(same_bits(o->cv, packed.cv)) << what << name << " page V";
    EXPECT_TRUE(same_bits(o->cik, packed.cik)) << what << name << " index-K pages";
    if (sparse) {
      EXPECT_TRUE(same_bits(o->iq, packed.iq)) << what << name << " iq";
    }
  }
}

TEST(FusedCpu, AttnPrepEqualsNormRopeKvWriteSmall) {
  // GQA 2, partial rotary, full index rotary, 4-token pages.
  const Geometry G{4, 2, 16, 8, 2, 8, 8, 4};
  check_attn_prep(G, {{0}, {1}, true}, 1);               // one token
  check_attn_prep(G, {{5, 3, 12}, {1, 1, 1}, true}, 2);  // decode batch, page edges
  check_attn_prep(G, {{0}, {11}, true}, 3);              // prefill, partial last page
  check_attn_prep(G, {{7, 0}, {1, 9}, false}, 4);        // full-attention layer, mixed
  check_attn_prep({6, 3, 40, 16, 3, 24, 24, 4}, {{0, 9}, {10, 1}, true}, 5);  // odd sizes
  check_attn_prep({8, 8, 64, 0, 8, 32, 8, 16}, {{3}, {40}, true}, 6);         // no rotary
}

TEST(FusedCpu, AttnPrepEqualsNormRopeKvWriteAtM3Geometry) {
  // 64 q / 4 kv heads x 128, rotary 64, index 4 x 128 rotary 64, 128-token pages.
  const Geometry m3{64, 4, 128, 64, 4, 128, 64, 128};
  check_attn_prep(m3, {{5, 300, 127}, {1, 1, 1}, true}, 7);
  check_attn_prep(m3, {{0}, {130}, true}, 8);
  check_attn_prep(m3, {{64}, {3}, false}, 9);
}

TEST(FusedCpuDeath, AttnPrepChecksItsArguments) {
  threadsafe_death_tests();
  std::vector<float> q(4 * 8, 1.f), k(2 * 8, 1.f), v(2 * 8, 1.f), ck(4 * 2 * 8), cv(4 * 2 * 8);
  const std::vector<uint16_t> w(8, 0);
  std::vector<int32_t> pos{9}, seq{0}, off{0, 2}, tab{0, 1};  // position 9 in a 2-page table
  const KvPages pages = KvPages::fp32(ck.data(), cv.data(), nullptr, 2, 2, 2, 8, 0);
  const TokenLayout L{1, pos.data(), seq.data(), off.data(), tab.data()};
  AttnPrepArgs a;
  a.q = q.data();
  a.num_q_heads = 4;
  a.k = k.data();
  a.v = v.data();
  a.num_kv_heads = 2;
  a.head_dim = 8;
  a.q_norm = a.k_norm = {w.data(), DType::kBF16, 8};
  EXPECT_DEATH(attn_prep(a, pages, L), "q_out != nullptr");
  a.q_out = q.data();
  EXPECT_DEATH(attn_prep(a, pages, L), "beyond the block table");
  pos[0] = 1;
  a.num_index_heads = 1;  // an index head without iq / iq_out / ik
  a.index_dim = 8;
  EXPECT_DEATH(attn_prep(a, pages, L), "index heads need index-K pages");
}

// ---------------------------------------------------------------- moe_localize_ids

TEST(MoeCpu, LocalizeIdsMapsEachExpertToExactlyOneRank) {
  std::mt19937 g(10);
  const int64_t ne = 10, n = 200;
  std::uniform_int_distribution<int32_t> pick(-1, static_cast<int32_t>(ne - 1));
  std::vector<int32_t> ids(n);
  for (auto& i : ids) i = pick(g);
  ids[0] = 0;
  ids[1] = static_cast<int32_t>(ne - 1);
  ids[2] = -1;
  // Uneven slices too: [first, first + count) partitions [0, ne).
  for (const std::vector<int64_t>& counts :
       {std::vector<int64_t>{10}, {5, 5}, {4, 4, 2}, {3, 3, 3, 1}, {0, 6, 4}}) {
    std::vector<int> owners(n, 0);
    int64_t first = 0;
    for (int64_t count : counts) {
      auto local = ids;
      moe_localize_ids(local.data(), n, first, count);
      for (int64_t i = 0; i < n; ++i) {
        const bool mine = ids[i] >= first && ids[i] < first + count;
        ASSERT_EQ(local[i], mine ? ids[i] - first : -1)
            << "slice [" << first << ", +" << count << ") id " << ids[i];
        owners[i] += mine;
      }
      first += count;
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(owners[i], ids[i] >= 0 ? 1 : 0) << ids[i];
  }
}

// ---------------------------------------------------------------- moe_experts

// Experts with values exact in their dtype, contiguous ([ne, rows, cols] per projection) and
// the same values scattered (one allocation per expert and projection, bases left null).
struct MoeWeights {
  int64_t ne = 0, inter = 0, hidden = 0;
  DType dt = DType::kBF16;
  std::vector<float> f[3];  // w1 (gate), w3 (up), w2 (down) values
  std::vector<uint16_t> b[3];
  std::vector<std::vector<uint8_t>> parts[3];
  std::vector<const void*> ptrs[3];

  size_t esize() const { return static_cast<size_t>(inter * hidden); }
  MoeExpertWeights contiguous() const {
    auto base = [&](int i) -> const void* {
      return dt == DType::kBF16 ? static_cast<const void*>(b[i].data()) : f[i].data();
    };
    MoeExpertWeights w;
    w.w1 = base(0);
    w.w3 = base(1);
    w.w2 = base(2);
    w.dtype = dt;
    w.num_experts = ne;
    w.inter = inter;
    w.hidden = hidden;
    return w;
  }
  MoeExpertWeights scattered() const {
    MoeExpertWeights w = contiguous();
    w.w1 = w.w3 = w.w2 = nullptr;  // ignored when the per-expert arrays are given
    w.w1_of = ptrs[0].data();
    w.w3_of = ptrs[1].data();
    w.w2_of = ptrs[2].data();
    return w;
  }
  // Experts [first, first + count) as their own contiguous weights (an EP rank's).
  MoeExpertWeights slice(int64_t first, int64_t count) const {
    MoeExpertWeights w = contiguous();
    const size_t off = first * esize() * dtype_size(dt);
    w.w1 = static_cast<const uint8_t*>(w.w1) + off;
    w.w3 = static_cast<const uint8_t*>(w.w3) + off;
    w.w2 = static_cast<const uint8_t*>(w.w2) + off;
    w.num_experts = count;
    return w;
  }
  float gate(int64_t e, int64_t i, int64_t c) const { return f[0][e * esize() + i * hidden + c]; }
  float up(int64_t e, int64_t i, int64_t c) const { return f[1][e * esize() + i * hidden + c]; }
  float down(int64_t e, int64_t c, int64_t i) const { return f[2][e * esize() + c * inter + i]; }
};

MoeWeights make_moe(int64_t ne, int64_t inter, int64_t hidden, DType dt, uint32_t seed) {
  std::mt19937 g(seed);
  MoeWeights w;
  w.ne = ne;
  w.inter = inter;
  w.hidden = hidden;
  w.dt = dt;
  const size_t es = w.esize(), bytes = es * dtype_size(dt);
  for (int i = 0; i < 3; ++i) {
    w.f[i] = randn(ne * es, g, 0.4f);
    if (dt == DType::kBF16) {
      w.b[i] = to_bf16(w.f[i]);
      w.f[i] = from_bf16(w.b[i]);
    }
    const uint8_t* src = dt == DType::kBF16 ? reinterpret_cast<const uint8_t*>(w.b[i].data())
                                            : reinterpret_cast<const uint8_t*>(w.f[i].data());
    // Allocated last expert first, so the experts are not in address order.
    w.parts[i].resize(ne);
    w.ptrs[i].assign(ne, nullptr);
    for (int64_t e = ne - 1; e >= 0; --e) {
      w.parts[i][e].assign(src + e * bytes, src + (e + 1) * bytes);
      w.ptrs[i][e] = w.parts[i][e].data();
    }
  }
  return w;
}

// The MoE after its router, token by token, pick by pick, in double, with a per-element error
// bound `tol` of the fp32 op (first order, doubled):
//   gate/up: fp32 dots of `hidden` products, |Δg_i| <= hidden·u·Σ_c|x_c w1_ic| (any order);
//   act = min(g, L)·σ(α·min(g, L))·(clamp(u, ±L) + β): |∂act/∂g| <= 1.1·|uc + β| (the max of
//     d/dz[z σ(z)] is 1.0998), |∂act/∂u| <= |gc|, plus its own rounding (2α|gc| + 16)u|act|
//     (see SwigluOaiRowsIsSwigluOnTheHalves);
//   down: Σ_i |w2_ci| |Δact_i| + inter·u·Σ_i |w2_ci act_i|;
//   combine: shared + Σ_j w_j y_j adds Σ_j |w_j| |Δy_j| + (k + 2 + extra)·u·(|shared| +
//     Σ_j |w_j y_j|) (k + 1 sums, the products; `extra` more sums, e.g. over EP ranks).
// An id of -1 adds nothing.
struct MoeRef {
  std::vector<double> out, tol;
};

MoeRef moe_ref(const MoeWeights& W, const std::vector<float>& x, int64_t n,
               const std::vector<int32_t>& ids, const std::vector<float>& wts, int64_t k,
               const SwigluParams& act, const float* shared, int extra = 0) {
  const int64_t H = W.hidden, I = W.inter;
  MoeRef r;
  r.out.assign(n * H, 0.0);
  r.tol.assign(n * H, 0.0);
  std::vector<double> a(I), da(I), err(H), mag(H);
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x.data() + t * H;
    for (int64_t c = 0; c < H; ++c) {
      r.out[t * H + c] = shared ? shared[t * H + c] : 0.0;
      mag[c] = shared ? std::fabs(shared[t * H + c]) : 0.0;
      err[c] = 0.0;
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e == -1) continue;
      const double wj = wts[t * k + j];
      for (int64_t i = 0; i < I; ++i) {
        double gv = 0, gm = 0, uv = 0, um = 0;
        for (int64_t c = 0; c < H; ++c) {
          gv += double(xt[c]) * W.gate(e, i, c);
          gm += std::fabs(double(xt[c]) * W.gate(e, i, c));
          uv += double(xt[c]) * W.up(e, i, c);
          um += std::fabs(double(xt[c]) * W.up(e, i, c));
        }
        const double gc = std::min<double>(gv, act.limit);
        const double uc = std::clamp<double>(uv, -act.limit, act.limit);
        a[i] = gc / (1.0 + std::exp(-double(act.alpha) * gc)) * (uc + act.beta);
        da[i] = 1.1 * std::fabs(uc + act.beta) * H * kU * gm + std::fabs(gc) * H * kU * um +
                (2 * act.alpha * std::fabs(gc) + 16) * kU * std::fabs(a[i]);
      }
      for (int64_t c = 0; c < H; ++c) {
        double y = 0, ym = 0, dy = 0;
        for (int64_t i = 0; i < I; ++i) {
          y += W.down(e, c, i) * a[i];
          ym += std::fabs(W.down(e, c, i) * a[i]);
          dy += std::fabs(W.down(e, c, i)) * da[i];
        }
        dy += I * kU * ym;
        r.out[t * H + c] += wj * y;
        mag[c] += std::fabs(wj * y);
        err[c] += std::fabs(wj) * dy;
      }
    }
    for (int64_t c = 0; c < H; ++c)
      r.tol[t * H + c] = 2.0 * (err[c] + (k + 2 + extra) * kU * mag[c]) + 1e-30;
  }
  return r;
}

int64_t count_mismatches(const std::vector<float>& got, const MoeRef& ref,
                         const std::string& what) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(double(got[i]) - ref.out[i]) <= ref.tol[i]) && ++bad <= 5)
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << ref.out[i]
                    << " tol " << ref.tol[i];
  return bad;
}

// Router picks for n tokens (distinct experts per token, renormalised weights x 2.5).
void route(int64_t n, int64_t ne, int64_t k, std::mt19937& g, std::vector<int32_t>& ids,
           std::vector<float>& wts) {
  const auto logits = randn(n * ne, g, 2.f);
  ids.assign(n * k, 0);
  wts.assign(n * k, 0.f);
  router_topk(logits.data(), n, ne, nullptr, k, 2.5f, ids.data(), wts.data());
}

struct MoeShape {
  int64_t ne, k, hidden, inter;
};

// hidden 20 and inter 9 are no multiple of the dot's 8 lanes (the tails).
const MoeShape kMoeShapes[] = {{6, 2, 24, 16}, {8, 3, 20, 9}, {4, 4, 8, 8}};

TEST(MoeCpu, ExpertsMatchThePerTokenNaiveMoe) {
  const SwigluParams act{1.702f, 7.f, 1.f};
  uint32_t seed = 20;
  for (const MoeShape& s : kMoeShapes) {
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const MoeWeights W = make_moe(s.ne, s.inter, s.hidden, dt, ++seed);
      for (int64_t n : {1, 5, 33}) {
        for (bool with_shared : {true, false}) {
          std::mt19937 g(++seed);
          // x at scale 2: gate/up reach ±5 or so, so the clamp at 7 is hit now and then.
          const auto x = randn(n * s.hidden, g, 2.f), shared = randn(n * s.hidden, g, 0.5f);
          std::vector<int32_t> ids;
          std::vector<float> wts;
          route(n, s.ne, s.k, g, ids, wts);
          const float* sh = with_shared ? shared.data() : nullptr;
          const std::string what = "ne " + std::to_string(s.ne) + " k " + std::to_string(s.k) +
                                   " hidden " + std::to_string(s.hidden) + " inter " +
                                   std::to_string(s.inter) + " " + dtype_name(dt) + " n " +
                                   std::to_string(n) + (with_shared ? " shared" : " no shared");
          std::vector<float> out(n * s.hidden, NAN);
          moe_experts(x.data(), n, ids.data(), wts.data(), s.k, W.contiguous(), act, sh,
                      out.data());
          EXPECT_EQ(0, count_mismatches(out, moe_ref(W, x, n, ids, wts, s.k, act, sh), what));

          // The scattered layout computes the same bits.
          std::vector<float> scat(n * s.hidden, NAN);
          moe_experts(x.data(), n, ids.data(), wts.data(), s.k, W.scattered(), act, sh,
                      scat.data());
          EXPECT_TRUE(same_bits(scat, out)) << what << ": scattered vs contiguous";

          // One token at a time computes the same bits (the grouping changes nothing).
          std::vector<float> one(n * s.hidden, NAN);
          for (int64_t t = 0; t < n; ++t)
            moe_experts(x.data() + t * s.hidden, 1, ids.data() + t * s.k, wts.data() + t * s.k, s.k,
                        W.contiguous(), act, sh ? sh + t * s.hidden : nullptr,
                        one.data() + t * s.hidden);
          EXPECT_TRUE(same_bits(one, out)) << what << ": per token vs batch";

          // out may alias shared.
          if (with_shared) {
            auto alias = shared;
            moe_experts(x.data(), n, ids.data(), wts.data(), s.k, W.contiguous(), act, alias.data(),
                        alias.data());
            EXPECT_TRUE(same_bits(alias, out)) << what << ": out aliasing shared";
          }
        }
      }
    }
  }
}

TEST(MoeCpu, ExpertsSkipOtherRanksPicks) {
  const SwigluParams act{1.702f, 7.f, 1.f};
  const MoeShape s{8, 3, 20, 9};
  for (DType dt : {DType::kBF16, DType::kF32}) {
    const MoeWeights W = make_moe(s.ne, s.inter, s.hidden, dt, 40);
    std::mt19937 g(41);
    const int64_t n = 17;
    const auto x = randn(n * s.hidden, g, 2.f), shared = randn(n * s.hidden, g, 0.5f);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    route(n, s.ne, s.k, g, ids, wts);
    for (size_t i = 0; i < ids.size(); i += 2) ids[i] = -1;   // every other pick elsewhere
    for (int64_t j = 0; j < s.k; ++j) ids[3 * s.k + j] = -1;  // token 3: none here
    for (bool with_shared : {true, false}) {
      const float* sh = with_shared ? shared.data() : nullptr;
      const std::string what = std::string(dtype_name(dt)) + (with_shared ? " shared" : "");
      std::vector<float> out(n * s.hidden, NAN);
      moe_experts(x.data(), n, ids.data(), wts.data(), s.k, W.contiguous(), act, sh, out.data());
      EXPECT_EQ(0, count_mismatches(out, moe_ref(W, x, n, ids, wts, s.k, act, sh), what));
      for (int64_t c = 0; c < s.hidden; ++c)
        EXPECT_EQ(out[3 * s.hidden + c], with_shared ? shared[3 * s.hidden + c] : 0.f)
            << what << ": a token with no local pick gets shared (or zero) exactly";
    }
    // No pick on this rank at all: out = shared exactly, or zeros.
    const std::vector<int32_t> none(n * s.k, -1);
    std::vector<float> out(n * s.hidden, NAN);
    moe_experts(x.data(), n, none.data(), wts.data(), s.k, W.contiguous(), act, shared.data(),
                out.data());
    EXPECT_EQ(out, shared);
    moe_experts(x.data(), n, none.data(), wts.data(), s.k, W.contiguous(), act, nullptr,
                out.data());
    EXPECT_EQ(out, std::vector<float>(n * s.hidden, 0.f));
  }
}

TEST(MoeCpu, ExpertParallelRanksSumToTheWholeMoe) {
  // Expert parallel: each rank localises the global picks to its experts (moe_localize_ids) and
  // runs its slice of the experts; rank 0 adds the shared expert. Each rank's output equals the
  // whole op with the other ranks' picks set to -1, bit for bit (the same experts in the same
  // order), and the sum over ranks is the whole MoE within the bound (+ world - 1 sums).
  const SwigluParams act{1.702f, 7.f, 1.f};
  const MoeShape s{8, 3, 24, 16};
  const MoeWeights W = make_moe(s.ne, s.inter, s.hidden, DType::kBF16, 50);
  std::mt19937 g(51);
  const int64_t n = 21;
  const auto x = randn(n * s.hidden, g, 2.f), shared = randn(n * s.hidden, g, 0.5f);
  std::vector<int32_t> ids;
  std::vector<float> wts;
  route(n, s.ne, s.k, g, ids, wts);
  const std::vector<int64_t> counts{3, 3, 2};
  std::vector<float> sum(n * s.hidden, 0.f), part(n * s.hidden);
  int64_t first = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    auto local = ids;
    moe_localize_ids(local.data(), n * s.k, first, counts[r]);
    const float* sh = r == 0 ? shared.data() : nullptr;
    moe_experts(x.data(), n, local.data(), wts.data(), s.k, W.slice(first, counts[r]), act, sh,
                part.data());
    auto masked = ids;
    for (auto& e : masked)
      if (e < first || e >= first + counts[r]) e = -1;
    std::vector<float> whole(n * s.hidden);
    moe_experts(x.data(), n, masked.data(), wts.data(), s.k, W.contiguous(), act, sh, whole.data());
    EXPECT_TRUE(same_bits(part, whole)) << "rank " << r;
    add_inplace(sum.data(), part.data(), n * s.hidden);
    first += counts[r];
  }
  const MoeRef ref =
      moe_ref(W, x, n, ids, wts, s.k, act, shared.data(), static_cast<int>(counts.size()) - 1);
  EXPECT_EQ(0, count_mismatches(sum, ref, "EP sum"));
}

TEST(MoeCpuDeath, ExpertsAbortOnABadIdOrDtype) {
  threadsafe_death_tests();
  const MoeWeights W = make_moe(4, 8, 8, DType::kBF16, 60);
  std::vector<float> x(2 * 8, 1.f), out(2 * 8), wts(2 * 2, 0.5f);
  const SwigluParams act;
  std::vector<int32_t> ids{0, 1, 2, 4};  // 4 of 4 experts
  EXPECT_DEATH(
      moe_experts(x.data(), 2, ids.data(), wts.data(), 2, W.contiguous(), act, nullptr, out.data()),
      "expert id 4 of 4");
  ids[3] = -2;  // only -1 means another rank's
  EXPECT_DEATH(
      moe_experts(x.data(), 2, ids.data(), wts.data(), 2, W.contiguous(), act, nullptr, out.data()),
      "expert id -2 of 4");
  ids[3] = 3;
  MoeExpertWeights f16 = W.contiguous();
  f16.dtype = DType::kF16;
  EXPECT_DEATH(moe_experts(x.data(), 2, ids.data(), wts.data(), 2, f16, act, nullptr, out.data()),
               "moe_experts: dtype");
}

// ---------------------------------------------------------------- embedding_vocab_slice

// A vocab x hidden table split over `world` ranks as model/shard.h does (chunks of
// ceil(V / world) rows, the last shorter or empty): each rank's output is the table row for its
// ids and +0 elsewhere, every element written, and the sum over ranks is the whole embedding
// bit for bit (bf16 -> f32 is exact, one non-zero term per element).
void check_vocab_split(DType dt, int64_t vocab, int64_t hidden, int world, uint32_t seed) {
  std::mt19937 g(seed);
  const auto f = randn(vocab * hidden, g, 2.f);
  const auto b = to_bf16(f);
  const std::vector<float> vals = dt == DType::kBF16 ? from_bf16(b) : f;
  const uint8_t* bytes = dt == DType::kBF16 ? reinterpret_cast<const uint8_t*>(b.data())
                                            : reinterpret_cast<const uint8_t*>(f.data());
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids{0, static_cast<int32_t>(vocab - 1)};
  for (int i = 0; i < 29; ++i) ids.push_back(pick(g));
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t chunk = (vocab + world - 1) / world;
  std::vector<float> sum(n * hidden, 0.f), out(n * hidden);
  for (int r = 0; r < world; ++r) {
    const int64_t v0 = std::min<int64_t>(vocab, r * chunk);
    const int64_t count = std::min<int64_t>(vocab, v0 + chunk) - v0;
    MatRef slice{count > 0 ? bytes + v0 * hidden * dtype_size(dt) : nullptr, dt, count, hidden};
    std::fill(out.begin(), out.end(), NAN);
    embedding_vocab_slice(slice, v0, vocab, hidden, ids.data(), n, out.data());
    for (int64_t t = 0; t < n; ++t) {
      const bool mine = ids[t] >= v0 && ids[t] < v0 + count;
      for (int64_t c = 0; c < hidden; ++c) {
        const float want = mine ? vals[ids[t] * hidden + c] : 0.f;
        const float got = out[t * hidden + c];
        ASSERT_TRUE(got == want && !std::signbit(got) == !std::signbit(want))
            << dtype_name(dt) << " world " << world << " rank " << r << " token " << t << " col "
            << c << ": " << got << " vs " << want;
        sum[t * hidden + c] += got;
      }
    }
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < hidden; ++c)
      ASSERT_EQ(sum[t * hidden + c], vals[ids[t] * hidden + c]) << "sum, token " << t;
}

TEST(ShardCpu, EmbeddingVocabSliceSumsToTheWholeEmbedding) {
  check_vocab_split(DType::kBF16, 64, 16, 2, 70);  // even
  check_vocab_split(DType::kBF16, 37, 12, 3, 71);  // uneven, the last rank shorter
  check_vocab_split(DType::kF32, 41, 8, 4, 72);    // f32, uneven
  check_vocab_split(DType::kBF16, 5, 8, 4, 73);    // chunk 2: the last rank holds no rows
}

TEST(ShardCpuDeath, EmbeddingVocabSliceAbortsOnAnIdOutsideTheVocabulary) {
  threadsafe_death_tests();
  const std::vector<uint16_t> table(10 * 4, 0);
  const MatRef slice{table.data(), DType::kBF16, 5, 4};  // rows [5, 10) of a vocab of 10
  std::vector<float> out(4);
  const int32_t past = 10, negative = -1;
  EXPECT_DEATH(embedding_vocab_slice(slice, 5, 10, 4, &past, 1, out.data()), "id 10 out of range");
  EXPECT_DEATH(embedding_vocab_slice(slice, 5, 10, 4, &negative, 1, out.data()),
               "id -1 out of range");
}

// ---------------------------------------------------------------- rows and residuals

TEST(RowsCpu, GatherRowsCopiesTheNamedRows) {
  std::mt19937 g(80);
  const int64_t src_rows = 9;
  for (int64_t cols : {1, 5, 64}) {
    const auto src = randn(src_rows * cols, g);
    const std::vector<int32_t> rows{8, 0, 3, 3, 7, 0};  // repeats, any order
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<float> dst(n * cols + 3, NAN);  // a tail that must stay untouched
    gather_rows(src.data(), rows.data(), n, cols, dst.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(dst[i * cols + c], src[rows[i] * cols + c]) << "row " << i << " col " << c;
    for (int64_t i = n * cols; i < n * cols + 3; ++i) EXPECT_TRUE(std::isnan(dst[i]));
  }
}

TEST(RowsCpu, CopyRows2dCopiesTheWindowOnly) {
  std::mt19937 g(81);
  const int64_t rows = 5, width = 3, src_stride = 7, dst_stride = 4;
  const auto src = randn(rows * src_stride, g);
  std::vector<float> dst(rows * dst_stride, -5.f);
  copy_rows_2d(dst.data(), dst_stride, src.data() + 2, src_stride, width, rows);  // cols [2, 5)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dst_stride; ++c)
      ASSERT_EQ(dst[r * dst_stride + c], c < width ? src[r * src_stride + 2 + c] : -5.f)
          << "row " << r << " col " << c;
  // Packed to packed (stride == width) and zero rows.
  std::vector<float> packed(rows * width, NAN);
  copy_rows_2d(packed.data(), width, src.data(), width, width, rows);
  EXPECT_TRUE(same_bits(packed, std::vector<float>(src.begin(), src.begin() + rows * width)));
  copy_rows_2d(packed.data(), width, nullptr, width, width, 0);
}

TEST(RowsCpu, AddInplaceFillZeroCopy) {
  std::mt19937 g(82);
  const auto x0 = randn(37, g), y = randn(37, g);
  auto x = x0;
  add_inplace(x.data(), y.data(), 37);
  for (int i = 0; i < 37; ++i) ASSERT_EQ(x[i], x0[i] + y[i]) << i;  // one rounding, exact
  std::vector<float> d(40, NAN);
  copy(d.data(), x.data(), 37);
  EXPECT_TRUE(same_bits(std::vector<float>(d.begin(), d.begin() + 37), x));
  EXPECT_TRUE(std::isnan(d[37]));
  copy(d.data(), d.data(), 37);  // onto itself: unchanged
  EXPECT_TRUE(same_bits(std::vector<float>(d.begin(), d.begin() + 37), x));
  fill_zero(d.data(), 39);
  for (int i = 0; i < 39; ++i) ASSERT_TRUE(d[i] == 0.f && !std::signbit(d[i])) << i;
  EXPECT_TRUE(std::isnan(d[39]));
}

}  // namespace
}  // namespace m3::kernels::cpu
