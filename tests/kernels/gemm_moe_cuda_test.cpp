// The fast GEMM paths (GEMV, cuBLASLt split-bf16 / bf16 / fp32, SIMT fallback) of
// kernels::cuda::linear and the GPU MoE experts (moe_experts) against the CPU ops, at M3's real
// shapes (hidden 6144, q 8192, expert inter 3072, router 128 x 6144 f32, vocab 200064) and odd
// ones, over token counts on both sides of every threshold. Two kinds of data:
// - "eighths": multiples of 1/8 with small numerators, so every dot product is exact in fp32
//   (and bf16(x) == x, so the split GEMM is exact too): every path must match the CPU bit for
//   bit, which catches any indexing or dropped-term bug;
// - normal data, with tolerances derived where they are used (u = 2^-24, fp32 unit roundoff).
// The MoE's expected values are its CPU twin, cpu::moe_experts (itself tested against a naive
// per-token MoE in tests/unit/kernels/fused_cpu_test). Expert ids must match exactly.
// Every test skips where no GPU is usable.
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
#include "kernels/cpu/ops.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"

namespace {

using m3::testing::gpu_unavailable_reason;
using m3::testing::kU;
using m3::testing::randn;
using m3::testing::to_bf16;

namespace cpu = m3::kernels::cpu;
namespace gk = m3::kernels::cuda;
namespace blas = m3::kernels::cuda::blas;
using m3::DType;
using m3::gpu::DeviceBuffer;
using m3::gpu::Stream;

// Restores the process-wide precision when a test ends.
struct PrecisionGuard {
  gk::GemmPrecision saved = gk::gemm_precision();
  ~PrecisionGuard() { gk::set_gemm_precision(saved); }
};

// A fast generator (xorshift64*): the real shapes need billions of values.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  // Multiple of 1/8 in [-r/8, r/8].
  float eighth(int r) {
    return static_cast<float>(static_cast<int>(next() % (2 * r + 1)) - r) / 8.f;
  }
};

std::vector<float> eighths(size_t n, uint64_t seed, int r) {
  Rng g(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = g.eighth(r);
  return v;
}

DeviceBuffer<float> nan_buffer(size_t n) {
  DeviceBuffer<float> b(n);
  b.fill_bytes(0xff);
  return b;
}

// A weight matrix on host and device. Values are exact in bf16 (bf16 matrices are generated
// as f32 then rounded, and `f` holds the rounded values).
struct Weight {
  std::vector<float> f;
  std::vector<uint16_t> b;
  DeviceBuffer<uint8_t> dev;
  DType dt;
  int64_t m, k;
  cpu::MatRef host() const {
    return {dt == DType::kBF16 ? static_cast<const void*>(b.data()) : f.data(), dt, m, k};
  }
  gk::MatRef device() const { return {dev.data(), dt, m, k}; }
};

Weight make_weight(int64_t m, int64_t k, DType dt, bool exact, uint64_t seed) {
  Weight w;
  w.dt = dt;
  w.m = m;
  w.k = k;
  if (exact) {
    w.f = eighths(m * k, seed, 2);
  } else {
    std::mt19937 g(static_cast<uint32_t>(seed));
    w.f = randn(m * k, g, 0.05f);
  }
  size_t bytes = w.f.size() * sizeof(float);
  const void* src = w.f.data();
  if (dt == DType::kBF16) {
    w.b = to_bf16(w.f);
    for (size_t i = 0; i < w.f.size(); ++i) w.f[i] = m3::bf16_to_f32(w.b[i]);
    bytes = w.b.size() * sizeof(uint16_t);
    src = w.b.data();
  }
  w.dev = DeviceBuffer<uint8_t>(bytes);
  w.dev.copy_from(static_cast<const uint8_t*>(src), bytes);
  return w;
}

// Rows checked against the CPU: all of a small matrix, else the first and last 96 (the CPU
// reference of a 200064-row matrix at 1024 tokens would take minutes).
std::vector<std::pair<int64_t, int64_t>> checked_rows(int64_t m) {
  if (m <= 512) return {{0, m}};
  return {{0, 96}, {m - 96, 96}};
}

// Compares y [n, m] from the GPU with the CPU op on the checked rows; tol_rel(k) scales
// |x_t|·|w_r|. Returns a description of the first mismatches (empty when all match).
int64_t check_linear(const std::vector<float>& got, const std::vector<float>& x, int64_t n,
                     const Weight& w, double tol_rel, bool exact, const std::string& what) {
  int64_t bad = 0;
  // Every output written (the buffer starts as NaN) and finite.
  for (size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i]) && ++bad <= 3)
      ADD_FAILURE() << what << ": y[" << i << "] = " << got[i];
  std::vector<double> xn(n, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < w.k; ++i) xn[t] += double(x[t * w.k + i]) * x[t * w.k + i];
  for (auto [r0, cnt] : checked_rows(w.m)) {
    std::vector<float> want(n * cnt);
    cpu::linear(x.data(), n, w.host().slice_rows(r0, cnt), want.data());
    for (int64_t r = 0; r < cnt; ++r) {
      double wn = 0.0;
      for (int64_t i = 0; i < w.k; ++i)
        wn += double(w.f[(r0 + r) * w.k + i]) * w.f[(r0 + r) * w.k + i];
      for (int64_t t = 0; t < n; ++t) {
        const float g = got[t * w.m + r0 + r], c = want[t * cnt + r];
        const double tol = exact ? 0.0 : tol_rel * std::sqrt(xn[t] * wn) + 1e-30;
        // Exact data: equal values (== also equates +0 and -0; a NaN fails).
        const bool ok = exact ? g == c : std::fabs(double(g) - c) <= tol;
        if (!ok && ++bad <= 5)
          ADD_FAILURE() << what << ": token " << t << " row " << r0 + r << " gpu " << g << " cpu "
                        << c << " tol " << tol;
      }
    }
  }
  return bad;
}

// Both sides sum the same k fp32 products in different orders: the rounding error grows like
// a random walk, ~sqrt(k)·u·Σ|x_i w_i| <= sqrt(k)·u·|x||w| (Cauchy-Schwarz); 8·sqrt(k)·u covers
// both sides with margin yet stays below one dropped term, ~(2/π)|x||w|/k (k = 8192: 4.3e-5 vs
// 7.8e-5). The bf16 splits add their representation error of x: hi + lo is within 2^-18|x_i|
// of x_i (each RNE step halves an ulp of 2^-8 relative), bf16(x) within 2^-9|x_i|; summed over
// the products that is at most 2^-18 (2^-9)·|x||w|, doubled for margin: 2^-17 (kExact) and 2^-8
// (kBf16), 2^-26 with 3 terms (split_rel). The GEMV path computes in fp32 on the unrounded x.
// The split's relative representation bound, doubled: each bf16 term removes 9 more bits
// (1 + 8 of mantissa, RNE), so `terms` terms leave 2^-9·terms, doubled: 2^-(9·terms - 1).
double split_rel(gk::GemmPrecision p) {
  const int terms = p == gk::GemmPrecision::kBf16 ? 1 : blas::exact_split_terms();
  return std::ldexp(1.0, -(9 * terms - 1));
}

double linear_tol(int64_t n, const Weight& w, gk::GemmPrecision p) {
  const double acc = 8.0 * std::sqrt(double(std::max<int64_t>(w.k, 1))) * kU;
  const bool gemm = blas::auto_path(n, w.device()) != blas::LinearPath::kGemv;
  if (!gemm || w.dt == DType::kF32) return acc;
  if (p == gk::GemmPrecision::kBf16) return acc + std::ldexp(1.0, -8);
  return acc + split_rel(p);
}

struct Shape {
  int64_t m, k;
  DType dt;
  const char* name;
};

const Shape kShapes[] = {
    {8192, 6144, DType::kBF16, "q_proj"},       {6144, 8192, DType::kBF16, "o_proj"},
    {3072, 6144, DType::kBF16, "expert w1"},    {6144, 3072, DType::kBF16, "expert w2"},
    {128, 6144, DType::kF32, "router"},         {1000, 72, DType::kBF16, "72 cols (k tail)"},
    {70, 100, DType::kBF16, "100 cols (SIMT)"}, {33, 17, DType::kF32, "17 cols f32 (SIMT)"},
    {300, 1032, DType::kF32, "1032 cols f32"},  {4100, 2056, DType::kBF16, "odd rows, 2056 cols"},
};
const int64_t kTokens[] = {1, 2, 3, 7, 8, 9, 16, 17, 64, 65, 300, 1024};

void run_linear_grid(bool exact_data) {
  Stream stream;
  PrecisionGuard guard;
  uint64_t seed = exact_data ? 100 : 200;
  for (const Shape& s : kShapes) {
    const Weight w = make_weight(s.m, s.k, s.dt, exact_data, ++seed);
    for (int64_t n : kTokens) {
      std::mt19937 g(static_cast<uint32_t>(seed * 131 + n));
      const auto x = exact_data ? eighths(n * s.k, seed * 977 + n, 8) : randn(n * s.k, g);
      DeviceBuffer<float> dx(x);
      for (auto p : {gk::GemmPrecision::kExact, gk::GemmPrecision::kBf16}) {
        gk::set_gemm_precision(p);
        auto dy = nan_buffer(n * s.m);
        gk::linear(dx.data(), n, w.device(), dy.data(), stream.get());
        stream.synchronize();
        const std::string what = std::string(s.name) + " n=" + std::to_string(n) +
                                 (p == gk::GemmPrecision::kExact ? " exact" : " bf16") +
                                 (exact_data ? " eighths" : " normal");
        // Eighths are exact in bf16, so even kBf16 must match bit for bit.
        EXPECT_EQ(0, check_linear(dy.to_host(), x, n, w, linear_tol(n, w, p), exact_data, what));
      }
    }
  }
}

TEST(CudaGemm, LinearMatchesCpuBitForBitOnExactData) {
  SKIP_WITHOUT_GPU();
  run_linear_grid(true);
}

TEST(CudaGemm, LinearMatchesCpuWithinDerivedTolerance) {
  SKIP_WITHOUT_GPU();
  run_linear_grid(false);
}

TEST(CudaGemm, LmHeadShape) {
  SKIP_WITHOUT_GPU();
  Stream stream;
  const Weight w = make_weight(200064, 6144, DType::kBF16, true, 7);
  for (int64_t n : {1, 8, 16, 17, 64}) {
    const auto x = eighths(n * w.k, 1000 + n, 8);
    DeviceBuffer<float> dx(x);
    auto dy = nan_buffer(n * w.m);
    gk::linear(dx.data(), n, w.device(), dy.data(), stream.get());
    stream.synchronize();
    EXPECT_EQ(0, check_linear(dy.to_host(), x, n, w, 0.0, true, "lm_head n=" + std::to_string(n)));
  }
}

TEST(CudaGemm, EveryPathForcedMatchesOnExactData) {
  SKIP_WITHOUT_GPU();
  Stream stream;
  for (DType dt : {DType::kBF16, DType::kF32}) {
    const Weight w = make_weight(520, 2048, dt, true, 9);
    for (int64_t n : {1, 5, 16, 40, 129}) {
      const auto x = eighths(n * w.k, 50 + n, 8);
      DeviceBuffer<float> dx(x);
      for (auto path :
           {blas::LinearPath::kGemv, blas::LinearPath::kGemm, blas::LinearPath::kSimt}) {
        auto dy = nan_buffer(n * w.m);
        blas::linear_with(path, dx.data(), n, w.device(), dy.data(), stream.get());
        stream.synchronize();
        EXPECT_EQ(0, check_linear(dy.to_host(), x, n, w, 0.0, true,
                                  std::string(m3::dtype_name(dt)) + " path " +
                                      std::to_string(static_cast<int>(path)) +
                                      " n=" + std::to_string(n)));
      }
    }
  }
}

TEST(CudaGemm, GemvRowsDoNotDependOnTokenCount) {
  // A token's GEMV output is the same whether it runs alone or with others (the GEMV's order
  // depends on the weight shape only), so grouped MoE results do not depend on the batch. One
  // token over a bf16 matrix whose rows fill the SMs takes the streaming kernel (gemv.cuh
  // stream_kernel), 16 tokens gemv_kernel: the shapes below cover its even row shares (q_proj,
  // o_proj), a row count no warp count divides with a k tail past the last 256-wide segment
  // (4999 x 1000), and the widest x it stages (dense down, k = 12288).
  SKIP_WITHOUT_GPU();
  Stream stream;
  std::mt19937 g(3);
  const Shape odd{4999, 1000, DType::kBF16, "4999 rows, 1000 cols"};
  const Shape down{6144, 12288, DType::kBF16, "dense down"};
  for (const Shape& s : {kShapes[0], kShapes[1], kShapes[4], odd, down}) {
    const Weight w = make_weight(s.m, s.k, s.dt, false, 77);
    const auto x = randn(16 * s.k, g);
    DeviceBuffer<float> dx(x);
    auto all = nan_buffer(16 * s.m);
    blas::linear_with(blas::LinearPath::kGemv, dx.data(), 16, w.device(), all.data(), stream.get());
    auto one = nan_buffer(s.m);
    blas::linear_with(blas::LinearPath::kGemv, dx.data() + 5 * s.k, 1, w.device(), one.data(),
                      stream.get());
    stream.synchronize();
    const auto a = all.to_host(), o = one.to_host();
    EXPECT_EQ(0, std::memcmp(a.data() + 5 * s.m, o.data(), s.m * sizeof(float))) << s.name;
  }
}

// ---------------------------------------------------------------- MoE

struct MoeCase {
  int64_t ne, k, hidden, inter;
  DType dt;
};

struct MoeSetup {
  MoeCase c;
  std::vector<float> w1, w3, w2;  // [ne, rows, cols] f32 values (exact in the dtype)
  std::vector<uint16_t> b1, b3, b2;
  DeviceBuffer<uint8_t> d1, d3, d2;
  gk::MoeExpertWeights dev() const {
    return {d1.data(), d3.data(), d2.data(), c.dt, c.ne, c.inter, c.hidden};
  }
  // The same experts in host memory, for cpu::moe_experts (contiguous layout).
  cpu::MoeExpertWeights host_weights() const {
    if (c.dt == DType::kBF16)
      return {b1.data(), b3.data(), b2.data(), c.dt, c.ne, c.inter, c.hidden};
    return {w1.data(), w3.data(), w2.data(), c.dt, c.ne, c.inter, c.hidden};
  }
  cpu::MatRef host(int which, int64_t e) const {
    const int64_t rows = which == 2 ? c.hidden : c.inter, cols = which == 2 ? c.inter : c.hidden;
    const int64_t off = e * rows * cols;
    if (c.dt == DType::kBF16) {
      const auto& b = which == 1 ? b1 : which == 3 ? b3 : b2;
      return {b.data() + off, c.dt, rows, cols};
    }
    const auto& f = which == 1 ? w1 : which == 3 ? w3 : w2;
    return {f.data() + off, c.dt, rows, cols};
  }
};

MoeSetup make_moe(const MoeCase& c, uint64_t seed) {
  MoeSetup s;
  s.c = c;
  auto gen = [&](std::vector<float>& f, std::vector<uint16_t>& b, DeviceBuffer<uint8_t>& d,
                 int64_t count, uint64_t sd) {
    f = eighths(count, sd, 2);  // products with eighths x are exact: gate/up are exact
    size_t bytes = count * sizeof(float);
    const void* src = f.data();
    if (c.dt == DType::kBF16) {
      b = to_bf16(f);
      bytes = count * sizeof(uint16_t);
      src = b.data();
    }
    d = DeviceBuffer<uint8_t>(bytes);
    d.copy_from(static_cast<const uint8_t*>(src), bytes);
  };
  gen(s.w1, s.b1, s.d1, c.ne * c.inter * c.hidden, seed);
  gen(s.w3, s.b3, s.d3, c.ne * c.inter * c.hidden, seed + 1);
  gen(s.w2, s.b2, s.d2, c.ne * c.hidden * c.inter, seed + 2);
  return s;
}

// The tolerance scale of the MoE: mag[t, c] = Σ_j |wt_j| · Σ_i |w2[c, i]| |act_i| over t's
// picks with an id >= 0 (ids global, every expert in `s`), act from the CPU ops (gate/up
// linear, swiglu_oai) grouped per expert. Only the bound: the expected values are cpu::moe_experts.
// sens (optional): the same sum over sens_i = |u_i| |glu(g_i)| + 1.2 |u_i + beta| |g_i| in place
// of |act_i|, the first-order change of act_i when g_i and u_i are each off by one part in 1
// (|d glu / dg| <= 1.1 everywhere; clamping only lowers it): the bound of rounding gate and up
// to bf16 before the SwiGLU (the wgmma engine), 2^-9 of it.
std::vector<double> moe_mag(const MoeSetup& s, const std::vector<float>& x, int64_t n,
                            const std::vector<int32_t>& ids, const std::vector<float>& wts,
                            const gk::SwigluParams& a, std::vector<double>* sens = nullptr) {
  const auto& c = s.c;
  std::vector<double> mag(n * c.hidden, 0.0);
  if (sens) sens->assign(n * c.hidden, 0.0);
  for (int64_t e = 0; e < c.ne; ++e) {
    std::vector<int32_t> toks;
    std::vector<float> tw;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < c.k; ++j)
        if (ids[t * c.k + j] == e) {
          toks.push_back(static_cast<int32_t>(t));
          tw.push_back(wts[t * c.k + j]);
        }
    if (toks.empty()) continue;
    const int64_t m = static_cast<int64_t>(toks.size());
    std::vector<float> xe(m * c.hidden), g(m * c.inter), u(m * c.inter);
    for (int64_t i = 0; i < m; ++i)
      std::copy(x.begin() + toks[i] * c.hidden, x.begin() + (toks[i] + 1) * c.hidden,
                xe.begin() + i * c.hidden);
    cpu::linear(xe.data(), m, s.host(1, e), g.data());
    cpu::linear(xe.data(), m, s.host(3, e), u.data());
    std::vector<float> sg(sens ? g.size() : 0);
    for (size_t i = 0; i < sg.size(); ++i) {
      const double gc = std::min<double>(g[i], a.limit);
      const double glu = gc / (1.0 + std::exp(-a.alpha * gc));
      sg[i] = static_cast<float>(std::fabs(u[i]) * std::fabs(glu) +
                                 1.2 * std::fabs(u[i] + a.beta) * std::fabs(g[i]));
    }
    cpu::swiglu_oai(g.data(), u.data(), m, c.inter, a.alpha, a.limit, a.beta, g.data());
    // |w2|·|act| (and |w2|·sens) for the tolerance.
    std::vector<float> absg(g.size()), absw2(c.hidden * c.inter), yabs(m * c.hidden);
    for (size_t i = 0; i < g.size(); ++i) absg[i] = std::fabs(g[i]);
    const auto& w2 = s.w2;
    for (int64_t i = 0; i < c.hidden * c.inter; ++i)
      absw2[i] = std::fabs(w2[e * c.hidden * c.inter + i]);
    const cpu::MatRef absw2_ref{absw2.data(), DType::kF32, c.hidden, c.inter};
    cpu::linear(absg.data(), m, absw2_ref, yabs.data());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t col = 0; col < c.hidden; ++col)
        mag[toks[i] * c.hidden + col] += std::fabs(tw[i]) * yabs[i * c.hidden + col];
    if (sens) {
      cpu::linear(sg.data(), m, absw2_ref, yabs.data());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t col = 0; col < c.hidden; ++col)
          (*sens)[toks[i] * c.hidden + col] += std::fabs(tw[i]) * yabs[i * c.hidden + col];
    }
  }
  return mag;
}

// Expert parallel over `world` ranks (world = 1: every expert on one rank): rank r holds
// experts [first, first + count) (chunks of ceil(ne / world)), localises the router's ids on
// both sides (moe_localize_ids, exact), runs its slice of the experts (the contiguous weights
// from expert `first` on) and adds the shared expert on rank 0 only; each rank's GPU output
// is compared with cpu::moe_experts on the same arguments.
void run_moe(const MoeSetup& s, int64_t n, gk::GemmPrecision prec, uint64_t seed, int world = 1,
             gk::MoePath path = gk::MoePath::kAuto) {
  const auto& c = s.c;
  const std::string what0 = "moe ne=" + std::to_string(c.ne) + " k=" + std::to_string(c.k) +
                            " hidden=" + std::to_string(c.hidden) +
                            " inter=" + std::to_string(c.inter) + " " + m3::dtype_name(c.dt) +
                            " n=" + std::to_string(n) +
                            (prec == gk::GemmPrecision::kExact ? " exact" : " bf16") +
                            (path == gk::MoePath::kGrouped        ? " grouped"
                             : path == gk::MoePath::kGroupedWgmma ? " wgmma"
                                                                  : "");
  PrecisionGuard guard;
  gk::set_gemm_precision(prec);
  Stream stream;
  std::mt19937 g(static_cast<uint32_t>(seed));
  const auto x = eighths(n * c.hidden, seed, 8);
  const auto logits = randn(n * c.ne, g, 2.f);
  const auto bias = randn(c.ne, g, 0.1f);
  const auto shared = randn(n * c.hidden, g, 0.5f);
  const float scale = 2.5f;
  const gk::SwigluParams act{1.702f, 7.0f, 1.0f};
  std::vector<int32_t> ids(n * c.k);
  std::vector<float> wts(n * c.k);
  cpu::router_topk(logits.data(), n, c.ne, bias.data(), c.k, scale, ids.data(), wts.data());

  DeviceBuffer<float> dl(logits), db(bias), dx(x);
  DeviceBuffer<int32_t> did(n * c.k);
  DeviceBuffer<float> dw(n * c.k);
  gk::router_topk(dl.data(), n, c.ne, db.data(), c.k, scale, did.data(), dw.data(), stream.get());
  stream.synchronize();
  ASSERT_EQ(did.to_host(), ids) << what0 << ": expert ids";

  const int64_t chunk = (c.ne + world - 1) / world;
  for (int r = 0; r < world; ++r) {
    const int64_t first = std::min<int64_t>(c.ne, r * chunk);
    const int64_t count = std::min<int64_t>(c.ne, first + chunk) - first;
    if (count == 0) continue;
    const std::string what =
        what0 +
        (world > 1 ? " EP rank " + std::to_string(r) + "/" + std::to_string(world) : std::string());
    // This rank's ids, on both sides.
    std::vector<int32_t> local = ids;
    DeviceBuffer<int32_t> dlocal(ids);
    if (world > 1) {
      cpu::moe_localize_ids(local.data(), n * c.k, first, count);
      gk::moe_localize_ids(dlocal.data(), n * c.k, first, count, stream.get());
      stream.synchronize();
      ASSERT_EQ(dlocal.to_host(), local) << what << ": localised ids";
    }
    gk::MoeExpertWeights wd = s.dev(), wh = s.host_weights();
    const size_t off = static_cast<size_t>(first * c.inter * c.hidden) * m3::dtype_size(c.dt);
    for (gk::MoeExpertWeights* w : {&wd, &wh}) {
      w->w1 = static_cast<const uint8_t*>(w->w1) + off;
      w->w3 = static_cast<const uint8_t*>(w->w3) + off;
      w->w2 = static_cast<const uint8_t*>(w->w2) + off;
      w->num_experts = count;
    }
    const std::vector<float> base = r == 0 ? shared : std::vector<float>(n * c.hidden, 0.f);
    DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, c.k, wd));
    DeviceBuffer<float> out(base);  // out aliases shared, as in the model
    const gk::MoePath taken = path == gk::MoePath::kAuto ? gk::moe_path(n, wd, dx.data()) : path;
    gk::moe_experts_with(path, dx.data(), n, dlocal.data(), dw.data(), c.k, wd, act,
                         r == 0 ? out.data() : nullptr, out.data(), work.data(), stream.get());
    stream.synchronize();

    std::vector<float> want(n * c.hidden);
    cpu::moe_experts(x.data(), n, local.data(), wts.data(), c.k, wh, act,
                     r == 0 ? shared.data() : nullptr, want.data());
    // The bound's magnitudes over this rank's picks (global ids of its experts).
    std::vector<int32_t> mine = ids;
    for (auto& e : mine)
      if (e < first || e >= first + count) e = -1;
    const bool wgmma = taken == gk::MoePath::kGroupedWgmma;
    std::vector<double> sens;
    const auto mag = moe_mag(s, x, n, mine, wts, act, wgmma ? &sens : nullptr);
    const auto got = out.to_host();
    // gate/up are exact on both sides (eighths); swiglu differs by expf's few ulps (8u relative
    // covers them); the down projection sums `inter` products in another order (8·sqrt(inter)·u
    // of Σ|w2||act|, as for linear) and, on the GEMM path, splits act (2^-17 / 2^-8 of it, see
    // linear_tol); the combine adds k + 1 terms in the same order (fma contraction may differ:
    // (k + 1)·u of the magnitudes).
    // The per-expert path (many tokens, or a layout the GEMV cannot read) may run split GEMMs;
    // the grouped GEMMs round act to bf16 (as the bf16 precision's single split term); the
    // wgmma engine rounds gate and up to bf16 too (2^-9 of sens, doubled for the second order).
    const bool per_expert = taken == gk::MoePath::kPerExpert;
    const bool grouped = taken == gk::MoePath::kGrouped || wgmma;
    const double split = grouped                              ? split_rel(gk::GemmPrecision::kBf16)
                         : !per_expert || c.dt == DType::kF32 ? 0.0
                                                              : split_rel(prec);
    const double rel = 8 * kU + 8 * std::sqrt(double(c.inter)) * kU + split + (c.k + 1) * kU;
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double tol = rel * mag[i] + (c.k + 1) * kU * std::fabs(want[i]) +
                         (wgmma ? std::ldexp(sens[i], -8) : 0.0) + 1e-30;
      if (!(std::fabs(double(got[i]) - want[i]) <= tol) && ++bad <= 5)
        ADD_FAILURE() << what << ": element " << i << " gpu " << got[i] << " cpu " << want[i]
                      << " tol " << tol;
    }
    EXPECT_EQ(bad, 0) << what;

    // Deterministic: the same call gives the same bits.
    DeviceBuffer<float> out2(base);
    gk::moe_experts_with(path, dx.data(), n, dlocal.data(), dw.data(), c.k, wd, act,
                         r == 0 ? out2.data() : nullptr, out2.data(), work.data(), stream.get());
    stream.synchronize();
    const auto got2 = out2.to_host();
    EXPECT_EQ(0, std::memcmp(got.data(), got2.data(), got.size() * sizeof(float))) << what;
  }
}

TEST(CudaMoe, MatchesCpuAtDecodeAndPrefillSizes) {
  SKIP_WITHOUT_GPU();
  // M3's 128 experts top-4 with a scaled-down hidden/inter (the CPU reference bounds the size).
  const MoeSetup s = make_moe({128, 4, 1024, 384, DType::kBF16}, 11);
  for (int64_t n : {1, 2, 8, 9, 17, 64, 65, 256, 1000})
    run_moe(s, n, gk::GemmPrecision::kExact, 100 + n);
  run_moe(s, 300, gk::GemmPrecision::kBf16, 7);
}

TEST(CudaMoe, GroupedGemmMatchesCpu) {
  SKIP_WITHOUT_GPU();
  // The bf16 precision's many-token engine: 64-row tiles (n = 300, 1000: under 64 picks per
  // expert) and 128-row tiles (n = 3000), expert parallel ranks, and the engine forced at decode
  // sizes (one pick per expert, many experts idle).
  const MoeSetup s = make_moe({128, 4, 1024, 384, DType::kBF16}, 21);
  for (int64_t n : {300, 1000, 3000}) {
    run_moe(s, n, gk::GemmPrecision::kBf16, 600 + n);
  }
  for (int world : {2, 8}) run_moe(s, 300, gk::GemmPrecision::kBf16, 700 + world, world);
  for (int64_t n : {1, 8, 64})
    run_moe(s, n, gk::GemmPrecision::kBf16, 800 + n, 1, gk::MoePath::kGrouped);
  // M3's expert matrices (hidden 6144, inter 3072), 8 experts top-4: 128-row tiles, K tails of
  // no remainder; and an inter that is no multiple of the 64-column gate|up tile (N tails).
  const MoeSetup r = make_moe({8, 4, 6144, 3072, DType::kBF16}, 22);
  run_moe(r, 600, gk::GemmPrecision::kBf16, 900);
  const MoeSetup t = make_moe({12, 3, 200, 72, DType::kBF16}, 23);
  for (int64_t n : {5, 400})
    run_moe(t, n, gk::GemmPrecision::kBf16, 950 + n, 1, gk::MoePath::kGrouped);
}

TEST(CudaMoe, GroupedWgmmaMatchesCpu) {
  SKIP_WITHOUT_GPU();
  if (!gk::moe_wgmma_available()) GTEST_SKIP() << "no wgmma grouped GEMM in this build / device";
  // The Hopper engine forced over the same cases as the mma.sync one: uneven expert loads,
  // idle experts (n = 1, 8: most of the 128 get no token), expert parallel ranks (picks of
  // other ranks: fewer positions than picks), M3's expert matrices, and dims that are no
  // multiple of its 256 x 128 tile (inter 72, hidden 200: partial weight and token tiles).
  const MoeSetup s = make_moe({128, 4, 1024, 384, DType::kBF16}, 31);
  for (int64_t n : {1, 8, 64, 300, 1000, 3000})
    run_moe(s, n, gk::GemmPrecision::kBf16, 1100 + n, 1, gk::MoePath::kGroupedWgmma);
  for (int world : {2, 8})
    run_moe(s, 600, gk::GemmPrecision::kBf16, 1200 + world, world, gk::MoePath::kGroupedWgmma);
  const MoeSetup r = make_moe({8, 4, 6144, 3072, DType::kBF16}, 32);
  run_moe(r, 600, gk::GemmPrecision::kBf16, 1300, 1, gk::MoePath::kGroupedWgmma);
  const MoeSetup t = make_moe({12, 3, 200, 72, DType::kBF16}, 33);
  for (int64_t n : {5, 400})
    run_moe(t, n, gk::GemmPrecision::kBf16, 1400 + n, 1, gk::MoePath::kGroupedWgmma);
}

TEST(CudaMoe, GroupedWgmmaAtPrefillSizes) {
  SKIP_WITHOUT_GPU();
  if (!gk::moe_wgmma_available()) GTEST_SKIP() << "no wgmma grouped GEMM in this build / device";
  // 8K and 32K tokens over 128 experts top-4 (what kAuto gives the engine at prefill; 32K runs
  // as 4 chunks), small matrices so the CPU reference stays quick.
  const MoeSetup s = make_moe({128, 4, 256, 64, DType::kBF16}, 34);
  const DeviceBuffer<float> x(8);
  for (int64_t n : {int64_t{8192}, int64_t{32768}}) {
    {
      PrecisionGuard guard;
      gk::set_gemm_precision(gk::GemmPrecision::kBf16);
      ASSERT_EQ(gk::moe_path(n, s.dev(), x.data()), gk::MoePath::kGroupedWgmma);
    }
    run_moe(s, n, gk::GemmPrecision::kBf16, 1500 + n);
  }
}

TEST(CudaMoe, GroupedWgmmaEveryVariant) {
  SKIP_WITHOUT_GPU();
  if (!gk::moe_wgmma_available()) GTEST_SKIP() << "no wgmma grouped GEMM in this build / device";
  // Each compiled tile configuration and raster order (the default is variant 0, covered above)
  // on uneven loads, an expert parallel rank and partial tiles in both dims.
  const MoeSetup s = make_moe({128, 4, 1024, 384, DType::kBF16}, 35);
  const MoeSetup t = make_moe({12, 3, 200, 72, DType::kBF16}, 36);
  for (int v = 1; v < gk::moe_wgmma_variants(); ++v) {
    SCOPED_TRACE(gk::moe_wgmma_variant_name(v));
    gk::set_moe_wgmma_variant(v);
    run_moe(s, 700, gk::GemmPrecision::kBf16, 1600 + v, 1, gk::MoePath::kGroupedWgmma);
    run_moe(s, 300, gk::GemmPrecision::kBf16, 1700 + v, 3, gk::MoePath::kGroupedWgmma);
    run_moe(t, 400, gk::GemmPrecision::kBf16, 1800 + v, 1, gk::MoePath::kGroupedWgmma);
  }
  gk::set_moe_wgmma_variant(0);
}

TEST(CudaMoe, GroupedGemmChunksLongInputs) {
  SKIP_WITHOUT_GPU();
  // More tokens than one chunk of the workspace: independent chunks, the same result.
  const MoeSetup s = make_moe({16, 2, 256, 128, DType::kBF16}, 24);
  run_moe(s, gk::kMoeGroupedChunk + 300, gk::GemmPrecision::kBf16, 1000);
}

TEST(CudaMoe, PathChoice) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard guard;
  const MoeSetup s = make_moe({16, 4, 64, 32, DType::kBF16}, 25);
  const MoeSetup odd = make_moe({6, 3, 100, 24, DType::kBF16}, 26);
  const MoeSetup f32 = make_moe({8, 2, 64, 32, DType::kF32}, 27);
  DeviceBuffer<float> x(1000 * 128);
  gk::set_gemm_precision(gk::GemmPrecision::kBf16);
  EXPECT_EQ(gk::moe_path(gk::kMoeGroupedMinTokens - 1, s.dev(), x.data()), gk::MoePath::kGemv);
  EXPECT_EQ(gk::moe_path(gk::kMoeGroupedMinTokens, s.dev(), x.data()), gk::MoePath::kGrouped);
  EXPECT_EQ(gk::moe_path(gk::kMoeGemvMaxTokens + 1, s.dev(), x.data()), gk::MoePath::kGrouped);
  EXPECT_TRUE(gk::moe_experts_graph_safe(gk::kMoeGemvMaxTokens + 1, x.data(), s.dev()));
  // From kMoeWgmmaMinTokens the Hopper engine where it is built (and x is 16-byte aligned).
  const gk::MoePath many =
      gk::moe_wgmma_available() ? gk::MoePath::kGroupedWgmma : gk::MoePath::kGrouped;
  EXPECT_EQ(gk::moe_path(gk::kMoeWgmmaMinTokens - 1, s.dev(), x.data()), gk::MoePath::kGrouped);
  EXPECT_EQ(gk::moe_path(gk::kMoeWgmmaMinTokens, s.dev(), x.data()), many);
  EXPECT_EQ(gk::moe_path(gk::kMoeWgmmaMinTokens, s.dev(), x.data() + 1), gk::MoePath::kGrouped);
  EXPECT_TRUE(gk::moe_experts_graph_safe(gk::kMoeWgmmaMinTokens, x.data(), s.dev()));
  EXPECT_EQ(gk::moe_path(gk::kMoeGemvMaxTokens, odd.dev(), x.data()), gk::MoePath::kPerExpert);
  EXPECT_EQ(gk::moe_path(500, odd.dev(), x.data()), gk::MoePath::kPerExpert);
  EXPECT_EQ(gk::moe_path(500, f32.dev(), x.data()), gk::MoePath::kPerExpert);
  gk::set_gemm_precision(gk::GemmPrecision::kExact);
  EXPECT_EQ(gk::moe_path(500, s.dev(), x.data()), gk::MoePath::kPerExpert);
  EXPECT_FALSE(gk::moe_experts_graph_safe(500, x.data(), s.dev()));
}

TEST(CudaMoe, RealExpertShapesFewExperts) {
  SKIP_WITHOUT_GPU();
  // M3's expert matrices (hidden 6144, inter 3072) with 8 experts top-4 (host memory).
  const MoeSetup s = make_moe({8, 4, 6144, 3072, DType::kBF16}, 12);
  for (int64_t n : {1, 8, 80}) run_moe(s, n, gk::GemmPrecision::kExact, 200 + n);
}

TEST(CudaMoe, OddLayoutsAndF32) {
  SKIP_WITHOUT_GPU();
  // hidden 100 is no multiple of 8: the GEMV cannot read it and the per-expert path serves.
  for (const MoeCase& c :
       {MoeCase{6, 3, 100, 24, DType::kBF16}, MoeCase{16, 4, 64, 24, DType::kBF16},
        MoeCase{8, 2, 64, 32, DType::kF32}, MoeCase{5, 5, 48, 40, DType::kBF16}}) {
    const MoeSetup s = make_moe(c, 13);
    // n = 8 at top-4: 32 picks, the most the gate|up GEMV groups itself (gemv::kRouteMaxPicks);
    // at top-5, 40: the grouping kernel's.
    for (int64_t n : {1, 3, 8, 64, 70}) run_moe(s, n, gk::GemmPrecision::kExact, 300 + n);
  }
}

TEST(CudaMoe, ExpertParallelRanksMatchCpu) {
  SKIP_WITHOUT_GPU();
  // Each rank's experts see the localised ids, -1 for the other ranks' picks (a token may have
  // none here), on the grouped GEMV path and on the per-expert path (n > kMoeGemvMaxTokens).
  const MoeSetup s = make_moe({32, 4, 512, 256, DType::kBF16}, 15);
  for (int world : {2, 3, 8})
    for (int64_t n : {1, 9, 300}) run_moe(s, n, gk::GemmPrecision::kExact, 400 + n + world, world);
  const MoeSetup f = make_moe({8, 2, 64, 32, DType::kF32}, 16);
  for (int64_t n : {3, 70}) run_moe(f, n, gk::GemmPrecision::kExact, 500 + n, 4);
}

void capture_moe_step(int64_t n, gk::GemmPrecision prec) {
  // Stream capture fails on any host synchronisation or synchronous copy: capturing the
  // routing and MoE experts into a graph proves the path enqueues work only.
  PrecisionGuard guard;
  gk::set_gemm_precision(prec);
  const MoeSetup s = make_moe({32, 4, 512, 256, DType::kBF16}, 14);
  Stream stream;
  const auto x = eighths(n * 512, 5, 8);
  DeviceBuffer<float> dx(x), out(n * 512);
  DeviceBuffer<int32_t> did(n * 4);
  DeviceBuffer<float> dw(n * 4);
  DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, 4, s.dev()));
  const Weight router = make_weight(32, 512, DType::kF32, true, 3);
  DeviceBuffer<float> logits(n * 32);
  // The router logits come first (outside the capture: linear's cuBLASLt path takes its
  // temporaries from a stream-ordered pool, which graphs capture as memory nodes of their own).
  gk::linear(dx.data(), n, router.device(), logits.data(), stream.get());
  auto step = [&] {
    gk::router_topk(logits.data(), n, 32, nullptr, 4, 1.f, did.data(), dw.data(), stream.get());
    gk::moe_experts(dx.data(), n, did.data(), dw.data(), 4, s.dev(), {}, nullptr, out.data(),
                    work.data(), stream.get());
  };
  step();  // lazy set-up (pool, kernel attributes) outside the capture
  stream.synchronize();
  const auto want = out.to_host();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  step();
  ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&exec, graph, 0));
  out.fill_bytes(0xff);
  ASSERT_EQ(cudaSuccess, cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  const auto got = out.to_host();
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "n=" << n;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The shared expert inside the grouped GEMVs (moe_experts_shared) against the separate path it
// replaces: linear(gate), linear(up), swiglu_oai, then moe_experts with that output as `shared`.
// Both are the GEMV's fp32 arithmetic with the same per-row sums, so the bits must agree; with
// two tokens each row must also equal that token alone (a row depends on its own token only).
TEST(CudaMoe, SharedExpertInsideTheGemvsMatchesTheSeparatePath) {
  SKIP_WITHOUT_GPU();
  PrecisionGuard guard;
  const MoeSetup s = make_moe({128, 4, 1024, 384, DType::kBF16}, 31);
  const MoeSetup sh = make_moe({1, 1, 1024, 384, DType::kBF16}, 32);  // the shared expert
  const auto& c = s.c;
  const m3::kernels::MoeSharedExpert sx{gk::MatRef{sh.d1.data(), c.dt, c.inter, c.hidden},
                                        gk::MatRef{sh.d3.data(), c.dt, c.inter, c.hidden},
                                        gk::MatRef{sh.d2.data(), c.dt, c.hidden, c.inter}};
  const gk::SwigluParams act{1.702f, 7.0f, 1.0f};
  const gk::MoeExpertWeights wd = s.dev();
  Stream stream;
  std::mt19937 g(33);
  // One step of n tokens through the fused op (ids/weights from router_topk).
  struct Step {
    std::vector<float> x;
    DeviceBuffer<int32_t> ids;
    DeviceBuffer<float> wts;
  };
  auto make_step = [&](int64_t n) {
    Step st;
    st.x = randn(n * c.hidden, g, 1.f);
    const auto logits = randn(n * c.ne, g, 2.f);
    DeviceBuffer<float> dl(logits);
    st.ids = DeviceBuffer<int32_t>(n * c.k);
    st.wts = DeviceBuffer<float>(n * c.k);
    gk::router_topk(dl.data(), n, c.ne, nullptr, c.k, 2.5f, st.ids.data(), st.wts.data(),
                    stream.get());
    stream.synchronize();
    return st;
  };
  auto fused = [&](const float* dx, int64_t n, const int32_t* ids, const float* wts) {
    EXPECT_TRUE(gk::moe_fuses_shared(n, dx, wd, sx)) << "n=" << n;
    DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, c.k, wd));
    DeviceBuffer<float> out(n * c.hidden);
    out.fill_bytes(0xff);
    gk::moe_experts_shared(dx, n, ids, wts, c.k, wd, sx, act, out.data(), work.data(),
                           stream.get());
    stream.synchronize();
    return out.to_host();
  };
  auto separate = [&](const float* dx, int64_t n, const int32_t* ids, const float* wts) {
    DeviceBuffer<float> gt(n * c.inter), up(n * c.inter), out(n * c.hidden);
    gk::linear(dx, n, sx.gate, gt.data(), stream.get());
    gk::linear(dx, n, sx.up, up.data(), stream.get());
    gk::swiglu_oai(gt.data(), up.data(), n, c.inter, act.alpha, act.limit, act.beta, gt.data(),
                   stream.get());
    gk::linear(gt.data(), n, sx.down, out.data(), stream.get());  // out = shared
    DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, c.k, wd));
    gk::moe_experts_with(gk::MoePath::kGemv, dx, n, ids, wts, c.k, wd, act, out.data(), out.data(),
                         work.data(), stream.get());
    stream.synchronize();
    return out.to_host();
  };
  for (auto prec : {gk::GemmPrecision::kExact, gk::GemmPrecision::kBf16}) {
    gk::set_gemm_precision(prec);
    for (int64_t n : {1, 2}) {
      const std::string what =
          "n=" + std::to_string(n) + (prec == gk::GemmPrecision::kExact ? " exact" : " bf16");
      Step st = make_step(n);
      DeviceBuffer<float> dx(st.x);
      const auto got = fused(dx.data(), n, st.ids.data(), st.wts.data());
      {  // linear() is the GEMV too at n <= 2: the same bits
        const auto want = separate(dx.data(), n, st.ids.data(), st.wts.data());
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << what;
      }
      for (int64_t t = 0; t < n; ++t) {  // each token alone, through the separate path
        DeviceBuffer<float> x1(
            std::vector<float>(st.x.begin() + t * c.hidden, st.x.begin() + (t + 1) * c.hidden));
        const auto want = separate(x1.data(), 1, st.ids.data() + t * c.k, st.wts.data() + t * c.k);
        EXPECT_EQ(0, std::memcmp(got.data() + t * c.hidden, want.data(), c.hidden * sizeof(float)))
            << what << " token " << t;
      }
    }
  }
  // Where it does not apply, the model keeps the separate path.
  gk::set_gemm_precision(gk::GemmPrecision::kBf16);
  DeviceBuffer<float> xs(300 * c.hidden);
  EXPECT_FALSE(gk::moe_fuses_shared(300, xs.data(), wd, sx)) << "300 tokens: the grouped GEMMs";
  EXPECT_FALSE(gk::moe_fuses_shared(gk::kMoeSharedFusedMaxTokens + 1, xs.data(), wd, sx))
      << "3 tokens: the shared weights would be read once per token group";
  m3::kernels::MoeSharedExpert half = sx;
  half.gate.rows = half.up.rows = c.inter / 2;
  half.down.cols = c.inter / 2;
  EXPECT_FALSE(gk::moe_fuses_shared(1, xs.data(), wd, half)) << "a narrower shared expert";
  m3::kernels::MoeSharedExpert f32 = sx;
  f32.down.dtype = DType::kF32;
  EXPECT_FALSE(gk::moe_fuses_shared(1, xs.data(), wd, f32)) << "another dtype";
}

TEST(CudaMoe, DecodePathHasNoHostSync) {
  SKIP_WITHOUT_GPU();
  capture_moe_step(8, gk::GemmPrecision::kExact);
}

TEST(CudaMoe, GroupedGemmPathHasNoHostSync) {
  SKIP_WITHOUT_GPU();
  capture_moe_step(gk::kMoeGemvMaxTokens + 44, gk::GemmPrecision::kBf16);
}

TEST(CudaMoe, GroupedWgmmaPathHasNoHostSync) {
  SKIP_WITHOUT_GPU();
  if (!gk::moe_wgmma_available()) GTEST_SKIP() << "no wgmma grouped GEMM in this build / device";
  capture_moe_step(gk::kMoeWgmmaMinTokens + 44, gk::GemmPrecision::kBf16);
}

}  // namespace
