// The fused CUDA ops (kernels/cuda/fused.h) against their CPU twins (kernels/cpu/fused.h, each
// the sequence of plain CPU ops it stands for, tested in tests/unit/kernels/fused_cpu_test):
// add_rmsnorm_gemma, swiglu_oai_rows, and attn_prep (rmsnorm_gemma + rope_neox on q, k, index q,
// index k + kv_write) with the same arguments on both sides, packed and in the fused projection
// layout (in_stride), at M3's geometry (64 q / 4 kv heads x 128, rotary 64, index 4 x 128) and
// odd ones, for one token, a decode batch over several sequences and a prefill with a partial
// last page.
// Tolerances (u = 2^-24): a norm of dim terms sums dim squares (relative error <= dim*u worst
// case), then 2-3 rounded products, and RoPE adds two products and a sum: for |v| <= ~10,
// abs error <= (dim*u + 8u) * |v| + 4u; we use 2 * dim * u * max(1, |v|) (dim = 128: 1.5e-5;
// dim = 6144: 7.3e-4), generous against the worst case and far below a wrong formula (~1e-1).
// Unwritten cache slots must stay equal (both sides start from the same contents).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fused.h"
#include "kernels/cuda/fused.h"

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

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double dim,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 2.0 * dim * kU * std::max(1.0, std::fabs(static_cast<double>(want[i])));
    ASSERT_NEAR(got[i], want[i], tol) << what << " at " << i;
  }
}

TEST(CudaFused, AddRmsnormGemmaMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(1);
  for (int64_t rows : {1, 7, 64}) {
    for (int64_t dim : {6144, 100, 1, 10240}) {
      auto x = randn(rows * dim, g, 3.f), y = randn(rows * dim, g);
      const auto wf = randn(dim, g, 0.1f);
      const auto wb = to_bf16(wf);
      cpu::VecRef w{wb.data(), DType::kBF16, dim};
      std::vector<float> want_x = x, want(rows * dim);
      cpu::add_rmsnorm_gemma(want_x.data(), y.data(), rows, dim, w, 1e-6f, want.data());
      DeviceBuffer<float> dx(x), dy(y), dout(rows * dim);
      DeviceBuffer<uint16_t> dw(wb);
      cpu::VecRef wd{dw.data(), DType::kBF16, dim};
      Stream s;
      gk::add_rmsnorm_gemma(dx.data(), dy.data(), rows, dim, wd, 1e-6f, dout.data(), s.get());
      s.synchronize();
      const std::string what = "rows " + std::to_string(rows) + " dim " + std::to_string(dim);
      EXPECT_EQ(dx.to_host(), want_x) << what << ": the residual sum is one rounding, exact";
      expect_close(dout.to_host(), want, static_cast<double>(dim), what);
    }
  }
}

TEST(CudaFused, SwigluOaiRowsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(3);
  for (int64_t n : {1, 3, 65}) {
    for (int64_t inter : {3072, 7}) {
      const auto gu = randn(n * 2 * inter, g, 4.f);  // beyond the clamp limit too
      std::vector<float> want(n * inter);
      cpu::swiglu_oai_rows(gu.data(), n, inter, 1.702f, 7.f, 1.f, want.data());
      DeviceBuffer<float> dgu(gu), dout(n * inter);
      Stream s;
      gk::swiglu_oai_rows(dgu.data(), n, inter, 1.702f, 7.f, 1.f, dout.data(), s.get());
      s.synchronize();
      // Elementwise: expf may differ by 2 ulps (CUDA's documented bound) between libraries,
      // then 3 rounded ops: 8u relative.
      const auto got = dout.to_host();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 8 * kU * std::max(1.f, std::fabs(want[i]))) << i;
    }
  }
}

struct Geometry {
  int64_t nq, nkv, d, rot, ni, di, irot, page;
};

// One side's buffers of attn_prep (host for the CPU twin, device for the CUDA op): inputs
// packed per tensor (q / iq normed in place) or one fused projection row per token
// (q | k | v | iq | ik, the layout of the GPU forward's fused projection) with separate packed
// q / iq outputs.
struct PrepPtrs {
  const float *q, *k, *v, *iq, *ik;
  float *q_out, *iq_out;
  const void *qn, *kn, *iqn, *ikn;
  int64_t in_stride;
};

gk::AttnPrepArgs prep_args(const Geometry& G, bool sparse, const PrepPtrs& p, double theta,
                           bool qk_norm = true) {
  gk::AttnPrepArgs a;
  a.q = p.q;
  a.q_out = p.q_out;
  a.num_q_heads = G.nq;
  a.k = p.k;
  a.v = p.v;
  a.num_kv_heads = G.nkv;
  a.head_dim = G.d;
  a.rot_dim = G.rot;
  if (qk_norm) {  // else none (a layer without QK-norm: an EAGLE-3 draft's)
    a.q_norm = {p.qn, DType::kBF16, G.d};
    a.k_norm = {p.kn, DType::kBF16, G.d};
  }
  if (sparse) {
    a.iq = p.iq;
    a.iq_out = p.iq_out;
    a.ik = p.ik;
    a.num_index_heads = G.ni;
    a.index_dim = G.di;
    a.index_rot_dim = G.irot;
    a.iq_norm = {p.iqn, DType::kBF16, G.di};
    a.ik_norm = {p.ikn, DType::kBF16, G.di};
  }
  a.in_stride = p.in_stride;
  a.eps = 1e-6f;
  a.theta = theta;
  return a;
}

// Sequences with `lens` tokens already in the cache and `news` new tokens each this step; the
// same arguments through cpu::attn_prep and gk::attn_prep, packed or `fused`.
void check_prep(const Geometry& G, const std::vector<int>& lens, const std::vector<int>& news,
                bool sparse, uint32_t seed, bool fused = false, bool qk_norm = true) {
  std::mt19937 g(seed);
  // Pages: each sequence owns enough consecutive pages for lens + news tokens.
  std::vector<int32_t> offsets{0}, table, positions, seq_ids;
  int32_t next_page = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    const int total = lens[s] + news[s];
    const int pages = static_cast<int>((total + G.page - 1) / G.page);
    for (int p = 0; p < pages; ++p) table.push_back(next_page++);
    offsets.push_back(static_cast<int32_t>(table.size()));
    for (int j = 0; j < news[s]; ++j) {
      positions.push_back(lens[s] + j);
      seq_ids.push_back(static_cast<int32_t>(s));
    }
  }
  const int64_t T = static_cast<int64_t>(positions.size());
  const int64_t num_pages = next_page;
  auto q = randn(T * G.nq * G.d, g, 2.f), k = randn(T * G.nkv * G.d, g, 2.f),
       v = randn(T * G.nkv * G.d, g);
  auto iq = randn(T * std::max<int64_t>(1, G.ni) * G.di, g, 2.f), ik = randn(T * G.di, g, 2.f);
  const auto qn = to_bf16(randn(G.d, g, 0.2f)), kn = to_bf16(randn(G.d, g, 0.2f)),
             iqn = to_bf16(randn(G.di, g, 0.2f)), ikn = to_bf16(randn(G.di, g, 0.2f));
  const size_t kv_n = static_cast<size_t>(num_pages * G.page * G.nkv * G.d);
  const size_t ik_n = static_cast<size_t>(num_pages * G.page * G.di);
  const auto ck = randn(kv_n, g), cv = randn(kv_n, g), cik = randn(ik_n, g);  // prior contents
  const double theta = 5e6;
  // The fused layout: per token [q | k | v | iq | ik].
  const int64_t cq = G.nq * G.d, ckv = G.nkv * G.d, ciq = G.ni * G.di,
                row = cq + 2 * ckv + ciq + G.di;
  std::vector<float> fusedrow(T * row);
  for (int64_t t = 0; t < T; ++t) {
    float* r = fusedrow.data() + t * row;
    std::copy_n(q.data() + t * cq, cq, r);
    std::copy_n(k.data() + t * ckv, ckv, r + cq);
    std::copy_n(v.data() + t * ckv, ckv, r + cq + ckv);
    std::copy_n(iq.data() + t * ciq, ciq, r + cq + 2 * ckv);
    std::copy_n(ik.data() + t * G.di, G.di, r + cq + 2 * ckv + ciq);
  }
  // Where q / iq come from and go to, on either side.
  auto ptrs = [&](float* qb, float* kb, float* vb, float* iqb, float* ikb, float* fb, float* qo,
                  float* iqo, const void* qnb, const void* knb, const void* iqnb,
                  const void* iknb) {
    PrepPtrs p{qb, kb, vb, iqb, ikb, qb, iqb, qnb, knb, iqnb, iknb, 0};
    if (fused) {
      p = {fb,
           fb + cq,
           fb + cq + ckv,
           fb + cq + 2 * ckv,
           fb + cq + 2 * ckv + ciq,
           qo,
           iqo,
           qnb,
           knb,
           iqnb,
           iknb,
           row};
    }
    return p;
  };

  // CPU: the twin, on host copies.
  auto q_c = q, iq_c = iq, ck_c = ck, cv_c = cv, cik_c = cik, fused_c = fusedrow;
  std::vector<float> qo_c(T * cq, 0.f), iqo_c(T * std::max<int64_t>(ciq, 1), 0.f);
  {
    const PrepPtrs p =
        ptrs(q_c.data(), k.data(), v.data(), iq_c.data(), ik.data(), fused_c.data(), qo_c.data(),
             iqo_c.data(), qn.data(), kn.data(), iqn.data(), ikn.data());
    cpu::KvPages pc = cpu::KvPages::fp32(ck_c.data(), cv_c.data(), sparse ? cik_c.data() : nullptr,
                                         num_pages, G.page, G.nkv, G.d, sparse ? G.di : 0);
    cpu::TokenLayout lc{T, positions.data(), seq_ids.data(), offsets.data(), table.data()};
    cpu::attn_prep(prep_args(G, sparse, p, theta, qk_norm), pc, lc);
    if (fused) {
      std::copy_n(qo_c.data(), T * cq, q_c.data());
      if (sparse) std::copy_n(iqo_c.data(), T * ciq, iq_c.data());
    }
  }

  // GPU: one fused launch on device copies.
  DeviceBuffer<float> dq(q), dk(k), dv(v), diq(iq), dik(ik), dck(ck), dcv(cv), dcik(cik);
  DeviceBuffer<uint16_t> dqn(qn), dkn(kn), diqn(iqn), dikn(ikn);
  DeviceBuffer<int32_t> dpos(positions), dseq(seq_ids), doff(offsets), dtab(table);
  DeviceBuffer<float> dfused(fusedrow), dqo(std::vector<float>(T * cq, 0.f)),
      diqo(std::vector<float>(T * std::max<int64_t>(ciq, 1), 0.f));
  {
    const PrepPtrs p =
        ptrs(dq.data(), dk.data(), dv.data(), diq.data(), dik.data(), dfused.data(), dqo.data(),
             diqo.data(), dqn.data(), dkn.data(), diqn.data(), dikn.data());
    cpu::KvPages pg = cpu::KvPages::fp32(dck.data(), dcv.data(), sparse ? dcik.data() : nullptr,
                                         num_pages, G.page, G.nkv, G.d, sparse ? G.di : 0);
    cpu::TokenLayout lg{T, dpos.data(), dseq.data(), doff.data(), dtab.data()};
    Stream s;
    gk::attn_prep(prep_args(G, sparse, p, theta, qk_norm), pg, lg, s.get());
    s.synchronize();
  }
  if (fused) {
    dq.copy_from(dqo.to_host().data(), T * cq);
    if (sparse) diq.copy_from(diqo.to_host().data(), T * ciq);
    EXPECT_EQ(dfused.to_host(), fusedrow) << "the fused projection is input only";
  }
  const std::string what = std::string(sparse ? "sparse" : "dense") + " T=" + std::to_string(T) +
                           (fused ? " fused" : " packed");
  expect_close(dq.to_host(), q_c, static_cast<double>(G.d), what + " q");
  expect_close(dck.to_host(), ck_c, static_cast<double>(G.d), what + " page K");
  EXPECT_EQ(dcv.to_host(), cv_c) << what << " page V (a copy)";
  if (sparse) {
    expect_close(diq.to_host(), iq_c, static_cast<double>(G.di), what + " iq");
    expect_close(dcik.to_host(), cik_c, static_cast<double>(G.di), what + " page index-K");
  } else {
    EXPECT_EQ(dcik.to_host(), cik) << what << " index-K pages untouched on a dense layer";
  }
}

TEST(CudaFused, AttnPrepMatchesCpuAtM3Geometry) {
  SKIP_WITHOUT_GPU();
  const Geometry m3{64, 4, 128, 64, 4, 128, 64, 128};
  check_prep(m3, {0}, {1}, true, 1);                           // one token
  check_prep(m3, {5, 300, 127, 2048}, {1, 1, 1, 1}, true, 2);  // decode batch, page edges
  check_prep(m3, {0}, {300}, true, 3);                         // prefill, partial last page
  check_prep(m3, {100, 0}, {1, 77}, false, 4);                 // full-attention layer, mixed
  check_prep(m3, {5, 300, 127}, {1, 1, 1}, true, 8, /*fused=*/true);
  check_prep(m3, {0}, {130}, true, 9, /*fused=*/true);
  check_prep(m3, {64}, {3}, false, 10, /*fused=*/true);
}

TEST(CudaFused, AttnPrepMatchesCpuAtOddGeometries) {
  SKIP_WITHOUT_GPU();
  check_prep({6, 3, 40, 16, 3, 24, 24, 4}, {0, 9}, {10, 1}, true, 5);  // GQA 2, full index rot
  check_prep({8, 8, 64, 0, 8, 32, 8, 16}, {3}, {40}, true, 6);         // no rotary on heads
  check_prep({16, 2, 256, 256, 2, 512, 64, 8}, {0}, {9}, true, 7);     // wide heads
  // No QK-norm, RoPE over the whole head (an EAGLE-3 draft's Llama layer), packed and fused.
  check_prep({12, 3, 128, 128, 0, 128, 0, 16}, {0, 20}, {9, 1}, false, 11, false, false);
  check_prep({12, 3, 128, 128, 0, 128, 0, 16}, {5}, {4}, false, 12, true, false);
}

}  // namespace
