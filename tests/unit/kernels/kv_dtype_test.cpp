// The KV cache's element formats on the CPU ops (docs/KV_CACHE.md): the fp8 conversion against an
// independent nearest-value search, the index-K row scale, the bytes kv_write stores for each
// format, attention and MSA selection over a bf16 / fp8 cache equal to the fp32 path over the
// dequantized values, and the near-tie rule of bf16 index-K block choices.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {
namespace {

// The value nearest to x among all finite E4M3 values, ties to the even code, found by scanning
// every code in double precision (independent of f32_to_fp8_e4m3's table search).
uint8_t fp8_reference(float x) {
  if (std::isnan(x)) return 0x7f;
  const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
  int best = 0;
  double best_d = 1e300;
  for (int c = 0; c < 127; ++c) {
    const int e = (c >> 3) & 0xf, m = c & 7;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
}

TEST(KvDtype, Fp8ConversionIsNearestEvenAndSaturates) {
  // Every code round-trips; every midpoint between neighbours goes to the even code.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const float v = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(f32_to_fp8_e4m3(v), c == 0x80 ? 0x80 : c) << c;
    if ((c & 0x7f) < 126) {
      const float next = fp8_e4m3_to_f32(static_cast<uint8_t>(c + 1));
      const float mid = 0.5f * (v + next);
      EXPECT_EQ(f32_to_fp8_e4m3(mid), fp8_reference(mid)) << c;
      EXPECT_EQ(f32_to_fp8_e4m3(mid) % 2, 0) << "tie at " << mid << " not to even";
    }
  }
  std::mt19937 g(3);
  std::uniform_real_distribution<float> e(-14.f, 10.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i % 2 ? -1.f : 1.f) * std::exp2(e(g));
    ASSERT_EQ(f32_to_fp8_e4m3(x), fp8_reference(x)) << x;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1e6f), 126);  // saturates to 448
  EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY), 0x80 | 126);
  EXPECT_EQ(f32_to_fp8_e4m3(NAN) & 0x7f, 0x7f);
  EXPECT_EQ(round_to_fp8_e4m3(464.f), 448.f);  // past the last rounding boundary: still 448
}

TEST(KvDtype, IndexRowScaleIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(fp8_row_scale(0.f), 1.f);
  EXPECT_EQ(fp8_row_scale(NAN), 1.f);
  EXPECT_EQ(fp8_row_scale(448.f), 1.f);
  EXPECT_EQ(fp8_row_scale(449.f), 2.f);
  std::mt19937 g(4);
  std::uniform_real_distribution<float> e(-30.f, 30.f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(e(g));
    const float s = fp8_row_scale(amax);
    int ex = 0;
    ASSERT_EQ(std::frexp(s, &ex), 0.5f) << "not a power of two: " << s;
    ASSERT_LE(amax / s, 448.f) << amax;
    ASSERT_GT(amax / (s * 0.5f), 448.f) << amax;
  }
}

// One sequence of `len` tokens in a shuffled paged cache of the given formats, written through
// kv_write; also an fp32 cache holding exactly the values the formatted one reads back.
struct FormattedCache {
  int64_t page = 8, nkv = 2, d = 16, di = 16, len;
  KvDtype kvd, ikd;
  std::vector<float> k, v, ik, ik_scale;  // the formatted storage (float-aligned bytes)
  std::vector<float> k32, v32, ik32;      // fp32 cache of the read-back values
  std::vector<float> K, V, IK;            // what was written, contiguous
  std::vector<int32_t> bt_off{0}, bt, pos, sid;
  KvPages c, c32;
  TokenLayout L;

  FormattedCache(int64_t n, KvDtype kv_dtype, KvDtype ik_dtype, std::mt19937& g, float kscale = 1.f,
                 float vscale = 1.f)
      : len(n), kvd(kv_dtype), ikd(ik_dtype) {
    const int64_t np = (len + page - 1) / page;
    for (int64_t i = 0; i < np; ++i) bt.push_back(static_cast<int32_t>(i));
    std::shuffle(bt.begin(), bt.end(), g);
    bt_off.push_back(static_cast<int32_t>(np));
    const int64_t slots = np * page;
    auto floats = [](int64_t elems, KvDtype dt) { return (elems * kv_dtype_size(dt) + 3) / 4; };
    k.assign(floats(slots * nkv * d, kvd), 0.f);
    v.assign(floats(slots * nkv * d, kvd), 0.f);
    ik.assign(floats(slots * di, ikd), 0.f);
    ik_scale.assign(slots, 0.f);
    c = KvPages::fp32(k.data(), v.data(), ik.data(), np, page, nkv, d, di);
    c.kv_dtype = kvd;
    c.ik_dtype = ikd;
    c.ik_scale = ik_scale.data();
    c.k_scale = kscale;
    c.v_scale = vscale;
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < len * nkv * d; ++i) K.push_back(3.f * nd(g));
    for (int64_t i = 0; i < len * nkv * d; ++i) V.push_back(nd(g));
    for (int64_t i = 0; i < len * di; ++i) IK.push_back(nd(g) * (1.f + i % 7));
    pos.resize(len);
    std::iota(pos.begin(), pos.end(), 0);
    sid.assign(len, 0);
    L = TokenLayout{len, pos.data(), sid.data(), bt_off.data(), bt.data()};
    kv_write(c, L, K.data(), V.data(), IK.data());
    // The fp32 twin: each element as the formatted cache reads it back.
    k32.assign(slots * nkv * d, 0.f);
    v32 = k32;
    ik32.assign(slots * di, 0.f);
    for (int64_t s = 0; s < slots; ++s) {
      for (int64_t i = 0; i < nkv * d; ++i) {
        k32[s * nkv * d + i] =
            read(k.data(), kvd, s * nkv * d + i) * (kvd == KvDtype::kFp8 ? kscale : 1.f);
        v32[s * nkv * d + i] =
            read(v.data(), kvd, s * nkv * d + i) * (kvd == KvDtype::kFp8 ? vscale : 1.f);
      }
      for (int64_t i = 0; i < di; ++i)
        ik32[s * di + i] =
            read(ik.data(), ikd, s * di + i) * (ikd == KvDtype::kFp8 ? ik_scale[s] : 1.f);
    }
    c32 = KvPages::fp32(k32.data(), v32.data(), ik32.data(), np, page, nkv, d, di);
  }
  static float read(const void* base, KvDtype dt, int64_t i) {
    if (dt == KvDtype::kF32) return static_cast<const float*>(base)[i];
    if (dt == KvDtype::kBf16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    return fp8_e4m3_to_f32(static_cast<const uint8_t*>(base)[i]);
  }
  int64_t slot(int64_t t) const { return bt[t / page] * page + t % page; }
};

TEST(KvDtype, KvWriteStoresEachFormatsBytes) {
  std::mt19937 g(7);
  for (KvDtype dt : {KvDtype::kBf16, KvDtype::kFp8}) {
    FormattedCache f(21, dt, dt, g, 0.5f, 2.f);
    for (int64_t t = 0; t < f.len; ++t) {
      const int64_t s = f.slot(t);
      for (int64_t i = 0; i < f.nkv * f.d; ++i) {
        const float kx = f.K[t * f.nkv * f.d + i], vx = f.V[t * f.nkv * f.d + i];
        if (dt == KvDtype::kBf16) {
          ASSERT_EQ(reinterpret_cast<uint16_t*>(f.k.data())[s * f.nkv * f.d + i], f32_to_bf16(kx));
          ASSERT_EQ(reinterpret_cast<uint16_t*>(f.v.data())[s * f.nkv * f.d + i], f32_to_bf16(vx));
        } else {
          // stored = fp8(x * (1 / scale))
          ASSERT_EQ(reinterpret_cast<uint8_t*>(f.k.data())[s * f.nkv * f.d + i],
                    fp8_reference(kx * 2.f));
          ASSERT_EQ(reinterpret_cast<uint8_t*>(f.v.data())[s * f.nkv * f.d + i],
                    fp8_reference(vx * 0.5f));
        }
      }
      const float* x = f.IK.data() + t * f.di;
      float amax = 0.f;
      for (int64_t i = 0; i < f.di; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float sc = dt == KvDtype::kFp8 ? fp8_row_scale(amax) : 1.f;
      if (dt == KvDtype::kFp8) {
        ASSERT_EQ(f.ik_scale[s], sc);
      }
      for (int64_t i = 0; i < f.di; ++i) {
        if (dt == KvDtype::kBf16) {
          ASSERT_EQ(reinterpret_cast<uint16_t*>(f.ik.data())[s * f.di + i], f32_to_bf16(x[i]));
        } else {
          ASSERT_EQ(reinterpret_cast<uint8_t*>(f.ik.data())[s * f.di + i],
                    fp8_reference(x[i] / sc));
        }
      }
    }
  }
}

TEST(KvDtype, AttentionOverAFormattedCacheEqualsFp32OverItsValues) {
  std::mt19937 g(8);
  for (KvDtype dt : {KvDtype::kBf16, KvDtype::kFp8}) {
    FormattedCache f(37, dt, KvDtype::kBf16, g, 1.5f, 0.25f);
    const int64_t nq = 4;
    std::vector<int32_t> pos = {0, 9, 36}, sid = {0, 0, 0};
    TokenLayout L{3, pos.data(), sid.data(), f.bt_off.data(), f.bt.data()};
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q(3 * nq * f.d), qb(q.size());
    for (auto& x : q) x = nd(g);
    for (size_t i = 0; i < q.size(); ++i) qb[i] = round_to_bf16(q[i]);  // queries enter as bf16
    std::vector<int32_t> sel(3 * f.nkv * 2, -1);
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t h = 0; h < f.nkv; ++h) {
        sel[(t * f.nkv + h) * 2] = 0;
        sel[(t * f.nkv + h) * 2 + 1] = pos[t] / f.page;
      }
    for (const int32_t* blocks :
         {static_cast<const int32_t*>(nullptr), static_cast<const int32_t*>(sel.data())}) {
      std::vector<float> got(q.size()), want(q.size());
      attention_paged(q.data(), nq, f.c, L, blocks, 2, 0.25f, got.data());
      attention_paged(qb.data(), nq, f.c32, L, blocks, 2, 0.25f, want.data());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i], want[i]) << kv_dtype_name(dt) << " " << i;
    }
  }
}

// MSA selection over a long sequence of 8-token blocks, top-4, for one query per block.
std::vector<int32_t> select(const KvPages& c, const FormattedCache& f, const std::vector<float>& iq,
                            int64_t ni, const std::vector<int32_t>& qpos) {
  std::vector<int32_t> sid(qpos.size(), 0), out(qpos.size() * ni * 4);
  TokenLayout L{static_cast<int64_t>(qpos.size()), qpos.data(), sid.data(), f.bt_off.data(),
                f.bt.data()};
  msa_select_blocks(iq.data(), ni, c, L, 4, 0, 1, out.data());
  return out;
}

TEST(KvDtype, MsaSelectionOverAFormattedIndexEqualsFp32OverItsValues) {
  std::mt19937 g(9);
  for (KvDtype dt : {KvDtype::kBf16, KvDtype::kFp8}) {
    FormattedCache f(200, KvDtype::kBf16, dt, g);
    const int64_t ni = 2;
    std::vector<int32_t> qpos;
    for (int32_t p = 40; p < 200; p += 13) qpos.push_back(p);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> iq(qpos.size() * ni * f.di), iqb(iq.size());
    for (auto& x : iq) x = nd(g);
    for (size_t i = 0; i < iq.size(); ++i) iqb[i] = round_to_bf16(iq[i]);
    EXPECT_EQ(select(f.c, f, iq, ni, qpos), select(f.c32, f, iqb, ni, qpos)) << kv_dtype_name(dt);
  }
}

TEST(KvDtype, Bf16IndexChoicesDifferFromFp32OnlyAtNearTies) {
  // The rule: blocks rank by score, equal scores to the lower block id. With a bf16 index-K (and
  // bf16 query) each token score moves by at most |q| |k| 2^-8 (two roundings of 2^-9 each, the
  // products then exact); a block's max-pooled score by no more. So a block chosen with bf16 and
  // not with fp32 (or the reverse) must lie within 2 * that bound of the fp32 top-k boundary.
  std::mt19937 g(10);
  FormattedCache f(400, KvDtype::kF32, KvDtype::kBf16, g);
  // An fp32 index-K cache holding the unrounded rows, in the paged layout.
  std::vector<float> ikf(f.ik32.size(), 0.f);
  for (int64_t t = 0; t < f.len; ++t)
    std::copy_n(f.IK.data() + t * f.di, f.di, ikf.data() + f.slot(t) * f.di);
  KvPages c_ref = KvPages::fp32(f.k32.data(), f.v32.data(), ikf.data(), f.c.num_pages, f.page,
                                f.nkv, f.d, f.di);
  const int64_t ni = 1;
  std::vector<int32_t> qpos;
  for (int32_t p = 100; p < 400; p += 3) qpos.push_back(p);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> iq(qpos.size() * f.di);
  for (auto& x : iq) x = nd(g);
  const auto got = select(f.c, f, iq, ni, qpos), want = select(c_ref, f, iq, ni, qpos);
  int64_t differ = 0;
  for (size_t w = 0; w < qpos.size(); ++w) {
    const int64_t nb = qpos[w] / f.page + 1;
    // fp32 block scores and the per-block error bound.
    std::vector<double> score(nb), bound(nb);
    double qn = 0;
    for (int64_t i = 0; i < f.di; ++i) qn += double(iq[w * f.di + i]) * iq[w * f.di + i];
    for (int64_t b = 0; b < nb - 1; ++b) {
      score[b] = -1e300;
      for (int64_t j = 0; j < f.page; ++j) {
        const float* kr = f.IK.data() + (b * f.page + j) * f.di;
        double dd = 0, kn = 0;
        for (int64_t i = 0; i < f.di; ++i) {
          dd += double(iq[w * f.di + i]) * kr[i];
          kn += double(kr[i]) * kr[i];
        }
        score[b] = std::max(score[b], dd);
        bound[b] = std::max(bound[b], std::sqrt(qn * kn) * std::ldexp(1.0, -8) * 1.01);
      }
    }
    std::vector<int32_t> a(got.begin() + w * 4, got.begin() + w * 4 + 4),
        b(want.begin() + w * 4, want.begin() + w * 4 + 4);
    if (a == b) continue;
    ++differ;
    // The k-th best fp32 score among the scored blocks (the local block is forced).
    std::vector<double> scored(score.begin(), score.begin() + nb - 1);
    std::sort(scored.rbegin(), scored.rend());
    const double edge = 0.5 * (scored[2] + scored[3]);
    for (int32_t blk : a) {
      if (std::find(b.begin(), b.end(), blk) == b.end() && blk != nb - 1) {
        EXPECT_LE(std::fabs(score[blk] - edge), 2 * bound[blk] + 1e-6) << "query " << w;
      }
    }
    for (int32_t blk : b) {
      if (std::find(a.begin(), a.end(), blk) == a.end() && blk != nb - 1) {
        EXPECT_LE(std::fabs(score[blk] - edge), 2 * bound[blk] + 1e-6) << "query " << w;
      }
    }
  }
  // Near-ties are rare on random data: most queries choose identical blocks.
  EXPECT_LT(differ, static_cast<int64_t>(qpos.size()) / 4);
}

TEST(KvDtype, TiesGoToTheLowerBlockId) {
  // Two identical index-K blocks score the same: the lower id is chosen when only one fits.
  std::mt19937 g(11);
  FormattedCache f(48, KvDtype::kBf16, KvDtype::kBf16, g);  // 6 blocks of 8
  // Blocks 1 and 3 hold the same rows, larger than the rest; block 5 is the query's own.
  uint16_t* ik = reinterpret_cast<uint16_t*>(f.ik.data());
  for (int64_t t = 0; t < 40; ++t)
    for (int64_t i = 0; i < f.di; ++i) ik[f.slot(t) * f.di + i] = f32_to_bf16(0.01f);
  for (int64_t j = 0; j < f.page; ++j)
    for (int64_t i = 0; i < f.di; ++i) {
      ik[f.slot(8 + j) * f.di + i] = f32_to_bf16(1.f);
      ik[f.slot(24 + j) * f.di + i] = f32_to_bf16(1.f);
    }
  std::vector<float> iq(f.di, 1.f);
  std::vector<int32_t> qpos = {44}, sid = {0}, out(3);
  TokenLayout L{1, qpos.data(), sid.data(), f.bt_off.data(), f.bt.data()};
  // top-3: the local block 5, then both tied blocks would need 2 more slots: give only 2.
  msa_select_blocks(iq.data(), 1, f.c, L, 2, 0, 1, out.data());
  EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + 2), (std::vector<int32_t>{1, 5}));
}

}  // namespace
}  // namespace m3::kernels::cpu
