// The CUDA page writes for every KV / index-K element format (kernels/cuda/ops.h kv_write,
// kernels/cuda/fused.h attn_prep) against their CPU twins (docs/KV_CACHE.md). kv_write gets
// the same fp32 rows on both sides, so every byte must be equal: bf16 round to nearest even
// (halfway cases included), fp8 E4M3 fp8(x * (1 / scale)) with saturation at 448 and
// subnormals, the per-token power-of-two index-K scale (zero rows: scale 1). attn_prep computes
// its rows with fp32 norm + RoPE (a few ulp apart between CPU and GPU), so a stored element may
// sit one rounding step away where a row value lies next to a rounding boundary: the test
// bounds that and counts it. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fused.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/fused.h"
#include "kernels/cuda/ops.h"

namespace {

using m3::testing::gpu_unavailable_reason;
using m3::testing::randn;
using m3::testing::to_bf16;

namespace cpu = m3::kernels::cpu;
namespace gk = m3::kernels::cuda;
using m3::DType;
using m3::gpu::DeviceBuffer;
using m3::gpu::Stream;
using m3::kernels::kv_dtype_name;
using m3::kernels::kv_dtype_size;
using m3::kernels::KvDtype;

const KvDtype kAll[] = {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8};

// One layer's pages in given formats, host and device, filled with the same garbage bytes.
struct Pages {
  int64_t num_pages, bs, nkv, d, di;
  KvDtype kvd, ikd;
  float k_scale, v_scale;
  std::vector<uint8_t> k, v, ik;
  std::vector<float> ik_scale;
  DeviceBuffer<uint8_t> dk, dv, dik;
  DeviceBuffer<float> dscale;
  Pages(int64_t np, int64_t bs_, int64_t nkv_, int64_t d_, int64_t di_, KvDtype kv, KvDtype ikt,
        float ks, float vs, std::mt19937& g)
      : num_pages(np),
        bs(bs_),
        nkv(nkv_),
        d(d_),
        di(di_),
        kvd(kv),
        ikd(ikt),
        k_scale(ks),
        v_scale(vs) {
    std::uniform_int_distribution<int> byte(0, 255);
    auto fill = [&](std::vector<uint8_t>& b, size_t n) {
      b.resize(n);
      for (auto& x : b) x = static_cast<uint8_t>(byte(g));
    };
    fill(k, np * bs * nkv * d * kv_dtype_size(kv));
    fill(v, k.size());
    fill(ik, np * bs * di * kv_dtype_size(ikt));
    ik_scale.assign(np * bs, -7.f);
    dk = DeviceBuffer<uint8_t>(k);
    dv = DeviceBuffer<uint8_t>(v);
    dik = DeviceBuffer<uint8_t>(ik);
    dscale = DeviceBuffer<float>(ik_scale);
  }
  cpu::KvPages view(bool device) {
    cpu::KvPages c = cpu::KvPages::fp32(nullptr, nullptr, nullptr, num_pages, bs, nkv, d, di);
    c.k = device ? static_cast<void*>(dk.data()) : k.data();
    c.v = device ? static_cast<void*>(dv.data()) : v.data();
    c.ik = device ? static_cast<void*>(dik.data()) : ik.data();
    c.ik_scale = device ? dscale.data() : ik_scale.data();
    c.kv_dtype = kvd;
    c.ik_dtype = ikd;
    c.k_scale = k_scale;
    c.v_scale = v_scale;
    return c;
  }
};

// Rows with the cases that decide bytes: bf16 halfway points (both parities), values past
// E4M3's 448 (after the scale), fp8 subnormals and underflow, signed zeros, one all-zero row.
std::vector<float> tricky_rows(int64_t rows, int64_t n, std::mt19937& g) {
  std::vector<float> x = randn(rows * n, g, 3.f);
  std::uniform_int_distribution<int> pick(0, 7);
  for (size_t i = 0; i < x.size(); ++i) {
    switch (pick(g)) {
      case 0: {  // an exact bf16 halfway value
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        u = (u & 0xffff0000u) | 0x8000u;
        std::memcpy(&x[i], &u, 4);
        break;
      }
      case 1:
        x[i] *= 400.f;  // saturates in fp8
        break;
      case 2:
        x[i] *= 1e-3f;  // fp8 subnormals
        break;
      case 3:
        x[i] = (i % 2) ? -0.f : 1e-9f;
        break;
      default:
        break;
    }
  }
  if (rows > 1) std::fill(x.begin() + n, x.begin() + 2 * n, 0.f);  // row 1: all zero
  return x;
}

TEST(KvPagesCuda, KvWriteSameBytesAsCpuForEveryFormat) {
  SKIP_WITHOUT_GPU();
  const int64_t bs = 16, nkv = 2, d = 64, di = 128, np = 6;
  for (KvDtype kvd : kAll)
    for (KvDtype ikd : kAll) {
      std::mt19937 g(static_cast<uint32_t>(10 * int(kvd) + int(ikd)));
      Pages P(np, bs, nkv, d, di, kvd, ikd, kvd == KvDtype::kFp8 ? 0.37f : 1.f,
              kvd == KvDtype::kFp8 ? 3.f : 1.f, g);
      // 40 tokens of two sequences over shuffled pages (some slots stay as they were).
      std::vector<int32_t> table{4, 1, 5, 0, 2, 3}, offsets{0, 3, 6}, positions, seq_ids;
      for (int p = 0; p < 25; ++p) positions.push_back(p), seq_ids.push_back(0);
      for (int p = 30; p < 45; ++p) positions.push_back(p), seq_ids.push_back(1);
      const int64_t T = static_cast<int64_t>(positions.size());
      const auto k = tricky_rows(T, nkv * d, g), v = tricky_rows(T, nkv * d, g),
                 ik = tricky_rows(T, di, g);
      cpu::kv_write(P.view(false),
                    {T, positions.data(), seq_ids.data(), offsets.data(), table.data()}, k.data(),
                    v.data(), ik.data());
      DeviceBuffer<float> dkk(k), dvv(v), dikk(ik);
      DeviceBuffer<int32_t> dpos(positions), dseq(seq_ids), doff(offsets), dtab(table);
      Stream s;
      gk::kv_write(P.view(true), {T, dpos.data(), dseq.data(), doff.data(), dtab.data()},
                   dkk.data(), dvv.data(), dikk.data(), s.get());
      s.synchronize();
      const std::string what =
          std::string("kv ") + kv_dtype_name(kvd) + ", index-K " + kv_dtype_name(ikd);
      EXPECT_EQ(P.dk.to_host(), P.k) << what << ": K bytes";
      EXPECT_EQ(P.dv.to_host(), P.v) << what << ": V bytes";
      EXPECT_EQ(P.dik.to_host(), P.ik) << what << ": index-K bytes";
      const auto sc = P.dscale.to_host();
      EXPECT_EQ(std::memcmp(sc.data(), P.ik_scale.data(), sc.size() * 4), 0)
          << what << ": index-K scales";
    }
}

// Element i of a host cache array as its value (fp8 times `scale`).
double decode(const std::vector<uint8_t>& b, KvDtype dt, size_t i, float scale) {
  if (dt == KvDtype::kF32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  if (dt == KvDtype::kBf16) {
    uint16_t h;
    std::memcpy(&h, b.data() + 2 * i, 2);
    return m3::bf16_to_f32(h);
  }
  return static_cast<double>(m3::fp8_e4m3_to_f32(b[i])) * scale;
}

// Two arrays written from rows that agree to fp32 rounding: equal bytes, or (near a rounding
// boundary) one step of the format apart: relative 2^-7 (bf16), 2^-3 (fp8, or one subnormal
// step of 2^-9 · scale). At most 1% of a rounded format's elements may differ.
void expect_one_step(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, KvDtype dt,
                     const std::vector<float>& scales, int64_t row_len, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  const size_t es = kv_dtype_size(dt), n = got.size() / es;
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(got.data() + i * es, want.data() + i * es, es) == 0) continue;
    ++differ;
    const float sc = scales.empty() ? 1.f : scales[i / row_len];
    const double a = decode(got, dt, i, sc), b = decode(want, dt, i, sc);
    const double mag = std::max(std::fabs(a), std::fabs(b));
    const double step = dt == KvDtype::kF32 ? 1e-5 * std::max(1.0, mag)
                        : dt == KvDtype::kBf16
                            ? std::ldexp(mag, -7)
                            : std::max(std::ldexp(mag, -3), std::ldexp(double(sc), -9));
    ASSERT_LE(std::fabs(a - b), step * 1.0001) << what << " element " << i;
  }
  // fp32 rows differ by an ulp in a few percent of elements (cosf / sinf / rsqrt): all bounded
  // above; a rounded format may move only where a value sits at a rounding boundary.
  if (dt != KvDtype::kF32) {
    EXPECT_LE(differ, n / 100 + 1) << what << ": " << differ << " of " << n << " elements differ";
  }
}

TEST(KvPagesCuda, AttnPrepPagesMatchCpuForEveryFormat) {
  SKIP_WITHOUT_GPU();
  // M3's geometry: 64 q / 4 KV heads of 128, rotary 64, 4 index heads of 128, 128-token pages.
  const int64_t nq = 64, nkv = 4, d = 128, ni = 4, di = 128, bs = 128, np = 3;
  for (KvDtype kvd : kAll)
    for (KvDtype ikd : kAll) {
      std::mt19937 g(static_cast<uint32_t>(100 + 10 * int(kvd) + int(ikd)));
      Pages P(np, bs, nkv, d, di, kvd, ikd, kvd == KvDtype::kFp8 ? 0.37f : 1.f,
              kvd == KvDtype::kFp8 ? 3.f : 1.f, g);
      std::vector<int32_t> table{2, 0, 1}, offsets{0, 1, 3}, positions, seq_ids;
      for (int p = 0; p < 7; ++p) positions.push_back(p), seq_ids.push_back(0);
      for (int p = 120; p < 140; ++p) positions.push_back(p), seq_ids.push_back(1);
      const int64_t T = static_cast<int64_t>(positions.size());
      auto q = randn(T * nq * d, g, 2.f), k = randn(T * nkv * d, g, 2.f), v = randn(T * nkv * d, g),
           iq = randn(T * ni * di, g, 2.f), ik = randn(T * di, g, 2.f);
      const auto qn = to_bf16(randn(d, g, 0.2f)), kn = to_bf16(randn(d, g, 0.2f)),
                 iqn = to_bf16(randn(di, g, 0.2f)), ikn = to_bf16(randn(di, g, 0.2f));
      auto args = [&](float* qp, const float* kp, const float* vp, float* iqp, const float* ikp,
                      const void* qnp, const void* knp, const void* iqnp, const void* iknp) {
        gk::AttnPrepArgs a;
        a.q = qp;
        a.q_out = qp;
        a.num_q_heads = nq;
        a.k = kp;
        a.v = vp;
        a.num_kv_heads = nkv;
        a.head_dim = d;
        a.rot_dim = 64;
        a.q_norm = {qnp, DType::kBF16, d};
        a.k_norm = {knp, DType::kBF16, d};
        a.iq = iqp;
        a.iq_out = iqp;
        a.ik = ikp;
        a.num_index_heads = ni;
        a.index_dim = di;
        a.index_rot_dim = 64;
        a.iq_norm = {iqnp, DType::kBF16, di};
        a.ik_norm = {iknp, DType::kBF16, di};
        a.theta = 5e6;
        return a;
      };
      auto qc = q, iqc = iq;
      cpu::attn_prep(args(qc.data(), k.data(), v.data(), iqc.data(), ik.data(), qn.data(),
                          kn.data(), iqn.data(), ikn.data()),
                     P.view(false),
                     {T, positions.data(), seq_ids.data(), offsets.data(), table.data()});
      DeviceBuffer<float> dq(q), dk(k), dv(v), diq(iq), dik(ik);
      DeviceBuffer<uint16_t> dqn(qn), dkn(kn), diqn(iqn), dikn(ikn);
      DeviceBuffer<int32_t> dpos(positions), dseq(seq_ids), doff(offsets), dtab(table);
      Stream s;
      gk::attn_prep(args(dq.data(), dk.data(), dv.data(), diq.data(), dik.data(), dqn.data(),
                         dkn.data(), diqn.data(), dikn.data()),
                    P.view(true), {T, dpos.data(), dseq.data(), doff.data(), dtab.data()}, s.get());
      s.synchronize();
      const std::string what =
          std::string("kv ") + kv_dtype_name(kvd) + ", index-K " + kv_dtype_name(ikd);
      EXPECT_EQ(P.dv.to_host(), P.v) << what << ": V bytes (no arithmetic before the store)";
      const std::vector<float> kscale(np * bs * nkv, P.k_scale);
      expect_one_step(P.dk.to_host(), P.k, kvd,
                      kvd == KvDtype::kFp8 ? kscale : std::vector<float>{}, d, what + ": K");
      const auto gsc = P.dscale.to_host();
      int64_t scale_differ = 0;
      for (size_t i = 0; i < gsc.size(); ++i) scale_differ += gsc[i] != P.ik_scale[i];
      EXPECT_LE(scale_differ, 1) << what << ": index-K scales";  // amax at a power of two
      expect_one_step(P.dik.to_host(), P.ik, ikd,
                      ikd == KvDtype::kFp8 ? P.ik_scale : std::vector<float>{}, di,
                      what + ": index-K");
    }
}

}  // namespace
