// GEMM and MoE timings at M3's real shapes (kernels/cuda: linear, moe_experts), next to the
// ceilings measured in the same run: device copy bandwidth (cudaMemcpy D2D, bytes read + written
// per second) and a plain bf16 cuBLASLt 8192^3 GEMM. Prints the GEMV bandwidth (GB/s of weight
// bytes) at n = 1 and 8, GEMV vs cuBLASLt around the threshold, cuBLASLt TFLOP/s at n = 8192 and
// 32768 in both GEMM precisions, and the MoE block (router + shared expert + 128 experts top-4)
// at n = 1 to 32768 in each engine (grouped GEMV, grouped GEMM on mma.sync and on wgmma,
// per-expert cuBLASLt) with the bytes of the experts it touched per second and the routed
// experts' TFLOP/s.
// Usage: bench_gemm_moe [iters=20] [quick]. Exits 1 with the probe's message where no GPU is
// usable.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
namespace blas = m3::kernels::cuda::blas;
using m3::DType;
using m3::gpu::DeviceBuffer;

using m3::bench::time_ms;

// A device array of `count` bf16 values spread over [-0.05, 0.05] (a repeating random block:
// filling billions of values on the host would take minutes; values do not change timings).
DeviceBuffer<uint16_t> bf16_weights(size_t count, uint32_t seed) {
  DeviceBuffer<uint16_t> d(count);
  const size_t block = std::min<size_t>(count, size_t{1} << 24);
  std::vector<uint16_t> h(block);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (auto& v : h) v = m3::f32_to_bf16(u(g));
  for (size_t off = 0; off < count; off += block)
    M3_CUDA_CHECK(cudaMemcpy(d.data() + off, h.data(), std::min(block, count - off) * 2,
                             cudaMemcpyHostToDevice));
  return d;
}

DeviceBuffer<float> f32_values(size_t count, uint32_t seed, float r = 1.f) {
  std::vector<float> h(count);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-r, r);
  for (auto& v : h) v = u(g);
  return DeviceBuffer<float>(h);
}

const char* prec_name(gk::GemmPrecision p) {
  return p == gk::GemmPrecision::kExact ? "exact" : "bf16";
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  // "quick": prefill GEMMs at n = 8192 only.
  const bool quick = argc > 2 && std::string(argv[2]) == "quick";
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_gemm_moe: %s\n", dev.error().message.c_str());
    return 1;
  }
  std::printf("device: %s, %d SMs; exact split terms %d\n", dev->name.c_str(), dev->num_sms,
              blas::exact_split_terms());
  m3::gpu::Stream stream;
  const cudaStream_t s = stream.get();

  // ---- ceilings
  double copy_gbs = 0, gemm_tf = 0;
  {
    const size_t bytes = size_t{2} << 30;
    DeviceBuffer<uint8_t> a(bytes), b(bytes);
    const double ms = time_ms(s, 10, [&] {
      M3_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s));
    });
    copy_gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
    std::printf("ceiling: device copy %.0f GB/s (read + write)\n", copy_gbs);
  }
  {
    const int64_t N = 8192;
    auto w = bf16_weights(N * N, 1);
    auto xb = bf16_weights(N * N, 2);
    DeviceBuffer<float> y(N * N);
    const gk::MatRef wr{w.data(), DType::kBF16, N, N};
    const double ms = time_ms(s, 10, [&] {
      if (!blas::gemm_bf16(xb.data(), N, wr, y.data(), 0.f, s)) std::abort();
    });
    gemm_tf = 2.0 * N * N * N / (ms * 1e-3) / 1e12;
    std::printf("ceiling: cuBLASLt bf16 8192^3 (fp32 out) %.0f TFLOP/s\n", gemm_tf);
  }

  struct Shape {
    int64_t m, k;
    DType dt;
    const char* name;
  };
  const Shape shapes[] = {{8192, 6144, DType::kBF16, "q_proj 6144->8192"},
                          {6144, 8192, DType::kBF16, "o_proj 8192->6144"},
                          {3072, 6144, DType::kBF16, "expert w1 6144->3072"},
                          {6144, 3072, DType::kBF16, "expert w2 3072->6144"},
                          {12288, 6144, DType::kBF16, "dense gate 6144->12288"},
                          {6144, 12288, DType::kBF16, "dense down 12288->6144"},
                          {200064, 6144, DType::kBF16, "lm_head 6144->200064"},
                          {128, 6144, DType::kF32, "router f32 6144->128"}};

  // ---- GEMV bandwidth (weight bytes / s) at decode sizes, and GEMV vs GEMM near the threshold
  std::printf("\nlinear at decode sizes (GB/s of weight bytes; %% of the copy ceiling)\n");
  for (const Shape& sh : shapes) {
    const size_t wbytes = sh.m * sh.k * m3::dtype_size(sh.dt);
    DeviceBuffer<uint16_t> wb;
    DeviceBuffer<float> wf;
    if (sh.dt == DType::kBF16)
      wb = bf16_weights(sh.m * sh.k, 3);
    else
      wf = f32_values(sh.m * sh.k, 3, 0.05f);
    const gk::MatRef w{sh.dt == DType::kBF16 ? static_cast<const void*>(wb.data()) : wf.data(),
                       sh.dt, sh.m, sh.k};
    // Every shape at n = 1 and 8; the threshold sweep (GEMV vs both GEMM precisions) on q_proj
    // and the expert matrix.
    const bool sweep = sh.m == 8192 || sh.m == 3072;
    for (int64_t n : {1, 2, 4, 8, 16, 32, 64}) {
      if (!sweep && n != 1 && n != 8) continue;
      auto x = f32_values(n * sh.k, 4);
      DeviceBuffer<float> y(n * sh.m);
      for (int v = 0; v < 3; ++v) {
        const auto path = v == 0 ? blas::LinearPath::kGemv : blas::LinearPath::kGemm;
        const auto prec = v == 2 ? gk::GemmPrecision::kBf16 : gk::GemmPrecision::kExact;
        if (v > 0 && (n < 8 || sh.dt == DType::kF32) && !(sweep && n >= 4)) continue;
        gk::set_gemm_precision(prec);
        const double ms =
            time_ms(s, iters, [&] { blas::linear_with(path, x.data(), n, w, y.data(), s); });
        const double gbs = wbytes / (ms * 1e-3) / 1e9;
        std::printf("  %-26s n=%-3lld %-10s %8.4f ms %7.0f GB/s  %5.1f%%\n", sh.name, (long long)n,
                    v == 0   ? "gemv"
                    : v == 1 ? "gemm exact"
                             : "gemm bf16",
                    ms, gbs, 100.0 * gbs / copy_gbs);
      }
      gk::set_gemm_precision(gk::GemmPrecision::kExact);
    }
  }

  // ---- prefill GEMMs
  std::printf("\ncuBLASLt GEMM at prefill sizes (TFLOP/s; %% of the bf16 GEMM ceiling)\n");
  for (const Shape& sh : shapes) {
    if (sh.m == 200064 || sh.dt != DType::kBF16) continue;
    auto wb = bf16_weights(sh.m * sh.k, 5);
    const gk::MatRef w{wb.data(), DType::kBF16, sh.m, sh.k};
    for (int64_t n : {8192, 32768}) {
      if (quick && n > 8192) continue;
      auto x = f32_values(n * sh.k, 6);
      DeviceBuffer<float> y(n * sh.m);
      for (auto p : {gk::GemmPrecision::kExact, gk::GemmPrecision::kBf16}) {
        gk::set_gemm_precision(p);
        const double ms = time_ms(s, std::max(3, iters / 4), [&] {
          blas::linear_with(blas::LinearPath::kGemm, x.data(), n, w, y.data(), s);
        });
        const double tf = 2.0 * n * sh.m * sh.k / (ms * 1e-3) / 1e12;
        std::printf("  %-26s n=%-6lld %-5s %8.3f ms %6.0f TFLOP/s  %5.1f%%\n", sh.name,
                    (long long)n, prec_name(p), ms, tf, 100.0 * tf / gemm_tf);
      }
    }
  }
  gk::set_gemm_precision(gk::GemmPrecision::kExact);

  // ---- the MoE block at real shapes
  std::printf(
      "\nMoE block: router + top-4 of 128 experts + shared expert, hidden 6144, inter 3072\n");
  {
    const int64_t ne = 128, k = 4, h = 6144, inter = 3072;
    const size_t per = inter * h;
    auto w1 = bf16_weights(ne * per, 7), w3 = bf16_weights(ne * per, 8),
         w2 = bf16_weights(ne * per, 9);
    auto sg = bf16_weights(per, 10), su = bf16_weights(per, 11), sd = bf16_weights(per, 12);
    auto router = f32_values(ne * h, 13, 0.02f);
    const gk::MoeExpertWeights ew{w1.data(), w3.data(), w2.data(), DType::kBF16, ne, inter, h};
    const gk::SwigluParams act{};
    struct Run {
      int64_t n;
      gk::GemmPrecision prec;
      gk::MoePath path;
    };
    const Run runs[] = {{1, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {8, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {8, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {32, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {32, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {64, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {64, gk::GemmPrecision::kBf16, gk::MoePath::kAuto},
                        {128, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {128, gk::GemmPrecision::kBf16, gk::MoePath::kAuto},
                        {256, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {256, gk::GemmPrecision::kBf16, gk::MoePath::kAuto},
                        {256, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma},
                        {512, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {512, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma},
                        {1024, gk::GemmPrecision::kExact, gk::MoePath::kAuto},
                        {1024, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {1024, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma},
                        {2048, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {2048, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma},
                        {8192, gk::GemmPrecision::kBf16, gk::MoePath::kPerExpert},
                        {8192, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {8192, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma},
                        {32768, gk::GemmPrecision::kBf16, gk::MoePath::kGrouped},
                        {32768, gk::GemmPrecision::kBf16, gk::MoePath::kGroupedWgmma}};
    // Before / after in one run: the mma.sync grouped GEMM (kGrouped) beside the wgmma one
    // (kGroupedWgmma; what kAuto takes from kMoeWgmmaMinTokens tokens where it is built).
    const bool wgmma = gk::moe_wgmma_available();
    if (!wgmma)
      std::printf("  (this build or device has no wgmma grouped GEMM: its rows are skipped)\n");
    for (const Run& run : runs) {
      const int64_t n = run.n;
      if (run.path == gk::MoePath::kGroupedWgmma && !wgmma) continue;
      gk::set_gemm_precision(run.prec);
      const gk::MoePath path = run.path;
      auto x = f32_values(n * h, 14);
      auto rlog = f32_values(n * ne, 15 + n, 3.f);  // random logits: a realistic expert spread
      DeviceBuffer<float> logits(n * ne), wts(n * k), g(n * inter), u(n * inter), out(n * h);
      DeviceBuffer<int32_t> ids(n * k);
      DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, k, ew));
      // As M3Forward runs it: at decode sizes the router GEMV + top-k in one launch and the
      // shared expert inside the grouped expert GEMVs (router_fused, moe_experts_shared).
      const gk::MatRef rm{router.data(), DType::kF32, ne, h};
      const m3::kernels::MoeSharedExpert sx{gk::MatRef{sg.data(), DType::kBF16, inter, h},
                                            gk::MatRef{su.data(), DType::kBF16, inter, h},
                                            gk::MatRef{sd.data(), DType::kBF16, h, inter}};
      const bool fused = gk::router_fused_supported(n, rm, k, x.data()) &&
                         gk::moe_fuses_shared(n, x.data(), ew, sx);
      DeviceBuffer<unsigned> counter(1);
      counter.fill_bytes(0);
      auto block = [&] {
        if (fused) {
          gk::router_fused(x.data(), n, rm, nullptr, k, 2.5f, logits.data(), ids.data(), wts.data(),
                           counter.data(), s);
          gk::moe_experts_shared(x.data(), n, ids.data(), wts.data(), k, ew, sx, act, out.data(),
                                 work.data(), s);
          return;
        }
        gk::linear(x.data(), n, rm, logits.data(), s);
        gk::router_topk(rlog.data(), n, ne, nullptr, k, 2.5f, ids.data(), wts.data(), s);
        gk::linear(x.data(), n, gk::MatRef{sg.data(), DType::kBF16, inter, h}, g.data(), s);
        gk::linear(x.data(), n, gk::MatRef{su.data(), DType::kBF16, inter, h}, u.data(), s);
        gk::swiglu_oai(g.data(), u.data(), n, inter, act.alpha, act.limit, act.beta, g.data(), s);
        gk::linear(g.data(), n, gk::MatRef{sd.data(), DType::kBF16, h, inter}, out.data(), s);
        gk::moe_experts_with(path, x.data(), n, ids.data(), wts.data(), k, ew, act, out.data(),
                             out.data(), work.data(), s);
      };
      const double ms = time_ms(s, iters, block);
      const auto hid = ids.to_host();
      const std::set<int32_t> touched(hid.begin(), hid.end());
      const double bytes = (touched.size() + 1.0) * 3 * per * 2 + ne * h * 4.0;
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      const double ems = time_ms(s, iters, [&] {
        gk::moe_experts_with(path, x.data(), n, ids.data(), wts.data(), k, ew, act, out.data(),
                             out.data(), work.data(), s);
      });
      const gk::MoePath taken = path == gk::MoePath::kAuto ? gk::moe_path(n, ew, x.data()) : path;
      const char* engine = taken == gk::MoePath::kGemv           ? "gemv"
                           : taken == gk::MoePath::kGrouped      ? "grouped gemm"
                           : taken == gk::MoePath::kGroupedWgmma ? "grouped wgmma"
                                                                 : "per-expert";
      // Routed experts' useful FLOPs: gate, up and down over the n * k picks.
      const double etf = 2.0 * n * k * 3 * h * inter / (ems * 1e-3) / 1e12;
      std::printf(
          "  n=%-5lld %-5s %-13s %3zu experts touched: block%s %8.4f ms, %6.0f GB/s of weights "
          "(%5.1f%% of copy); routed experts alone %8.4f ms = %6.1f TFLOP/s (%5.1f%% of the "
          "bf16 GEMM ceiling)\n",
          (long long)n, prec_name(run.prec), engine, touched.size(), fused ? " (fused)" : "", ms,
          gbs, 100.0 * gbs / copy_gbs, ems, etf, 100.0 * etf / gemm_tf);
    }
    // The wgmma engine's compiled tile configurations and raster orders (variant 0 above).
    if (wgmma) {
      gk::set_gemm_precision(gk::GemmPrecision::kBf16);
      std::printf("\nwgmma grouped GEMM variants: routed experts alone\n");
      for (int64_t n : {int64_t{1024}, int64_t{8192}, int64_t{32768}}) {
        auto x = f32_values(n * h, 14);
        auto rlog = f32_values(n * ne, 15 + n, 3.f);
        DeviceBuffer<float> wts(n * k), out(n * h);
        DeviceBuffer<int32_t> ids(n * k);
        DeviceBuffer<uint8_t> work(gk::moe_workspace_bytes(n, k, ew));
        gk::router_topk(rlog.data(), n, ne, nullptr, k, 2.5f, ids.data(), wts.data(), s);
        for (int v = 0; v < gk::moe_wgmma_variants(); ++v) {
          gk::set_moe_wgmma_variant(v);
          const double ems = time_ms(s, iters, [&] {
            gk::moe_experts_with(gk::MoePath::kGroupedWgmma, x.data(), n, ids.data(), wts.data(), k,
                                 ew, act, nullptr, out.data(), work.data(), s);
          });
          const double etf = 2.0 * n * k * 3 * h * inter / (ems * 1e-3) / 1e12;
          std::printf("  n=%-5lld variant %d (%s): %8.4f ms = %6.1f TFLOP/s (%5.1f%%)\n",
                      (long long)n, v, gk::moe_wgmma_variant_name(v), ems, etf,
                      100.0 * etf / gemm_tf);
        }
        gk::set_moe_wgmma_variant(0);
      }
    }
    gk::set_gemm_precision(gk::GemmPrecision::kExact);
  }
  return 0;
}
