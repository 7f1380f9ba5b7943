// The batch-1 weight GEMV (kernels/cuda linear at n tokens <= blas::kGemvMaxTokens) at M3's decode
// shapes, as a decode step runs it: R launches over R different weight copies (more bytes than
// the L2 holds, so every launch streams from HBM) captured into one CUDA graph, launch after
// launch as the layers issue them (programmatic overlap as configured). Prints, per shape, the
// time per launch, its GB/s of weight bytes against the copy bandwidth measured in the same run,
// and the fixed cost per launch fitted from two matrix heights of the same width (t = a + bytes /
// rate). With `gap`, an RMSNorm of one row runs between the GEMVs (the layer's HBM-idle kernels).
// Usage: bench_gemv [iters=20] [n=1] [gap|nogap] [name filter]. Exits 1 where no GPU is usable.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
using m3::DType;
using m3::gpu::DeviceBuffer;

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 1;
  const bool gap = argc > 3 && std::string(argv[3]) == "gap";
  const std::string only = argc > 4 ? argv[4] : "";  // shapes whose name contains it
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_gemv: %s\n", dev.error().message.c_str());
    return 1;
  }
  m3::gpu::Stream stream;
  const cudaStream_t s = stream.get();
  const double copy_gbs = m3::bench::copy_bandwidth() / 1e9;
  std::printf("device: %s, %d SMs; copy %.0f GB/s (read + write); n = %lld%s\n", dev->name.c_str(),
              dev->num_sms, copy_gbs, static_cast<long long>(n),
              gap ? "; an RMSNorm between launches" : "");

  struct Shape {
    int64_t m, k;
    const char* name;
  };
  // M3 at TP1 (bf16): the fused q|k|v(|index) rows of a dense / sparse layer, o_proj, the dense
  // MLP's down, the shared expert's fused gate|up (as two matrices here) and down, and pairs of
  // heights for the fit.
  const Shape shapes[] = {
      {9216, 6144, "q|k|v 6144->9216"},  {9856, 6144, "q|k|v|idx 6144->9856"},
      {6144, 8192, "o_proj 8192->6144"}, {6144, 12288, "dense down 12288->6144"},
      {6144, 6144, "6144->6144"},        {24576, 6144, "6144->24576"},
      {12288, 8192, "8192->12288"},      {49152, 6144, "6144->49152"}};
  const size_t budget = size_t{3} << 30;  // weight copies per shape: >= 3 GiB, at least 8
  const int64_t kmax = 12288;
  std::vector<float> hx(n * kmax);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& v : hx) v = u(g);
  DeviceBuffer<float> x(hx), y(n * 49152), a(n * kmax);
  std::vector<float> hnw(kmax, 1.f);
  DeviceBuffer<float> nw(hnw);
  DeviceBuffer<uint16_t> pool(budget / 2 + size_t{49152} * 6144);
  {
    std::vector<uint16_t> blk(size_t{1} << 24);
    std::normal_distribution<float> d(0.f, 0.02f);
    for (auto& v : blk) v = m3::f32_to_bf16(d(g));
    m3::bench::fill_tiled_from_host(pool.data(), pool.size() * 2, blk.data(), blk.size() * 2);
  }
  std::printf("%-24s %6s %9s %9s %9s %7s\n", "shape", "copies", "MB", "us/launch", "GB/s",
              "of copy");
  struct Row {
    int64_t m, k;
    double us, mb;
  };
  std::vector<Row> rows;
  for (const Shape& sh : shapes) {
    if (!only.empty() && std::string(sh.name).find(only) == std::string::npos) continue;
    const size_t bytes = static_cast<size_t>(sh.m * sh.k) * 2;
    const int64_t copies = std::max<int64_t>(8, static_cast<int64_t>(budget / bytes));
    const size_t stride = std::max<size_t>(bytes / 2, (pool.size() - bytes / 2) / copies) / 64 * 64;
    auto launches = [&] {
      for (int64_t c = 0; c < copies; ++c) {
        const size_t off = (static_cast<size_t>(c) * stride) % (pool.size() - bytes / 2) / 64 * 64;
        const uint16_t* w = pool.data() + off;
        if (gap)
          gk::rmsnorm_gemma(x.data(), n, sh.k, gk::VecRef{nw.data(), DType::kF32, sh.k}, 1e-6f,
                            a.data(), s);
        gk::linear(gap ? a.data() : x.data(), n, gk::MatRef{w, DType::kBF16, sh.m, sh.k}, y.data(),
                   s);
      }
    };
    const double us = m3::bench::graph_ms(s, iters, launches) * 1e3 / copies;
    const double mb = bytes / 1e6;
    rows.push_back({sh.m, sh.k, us, mb});
    std::printf("%-24s %6lld %9.1f %9.2f %9.0f %6.1f%%\n", sh.name, static_cast<long long>(copies),
                mb, us, mb / us * 1e3, 100.0 * mb / us * 1e3 / copy_gbs);
  }
  // Fixed cost and streaming rate from pairs of the same width: (6144, 24576 / 49152 rows) x 6144,
  // (6144, 12288) x 8192.
  auto fit = [&](int64_t k, int64_t m0, int64_t m1) {
    const Row *r0 = nullptr, *r1 = nullptr;
    for (const Row& r : rows) {
      if (r.k == k && r.m == m0) r0 = &r;
      if (r.k == k && r.m == m1) r1 = &r;
    }
    if (r0 == nullptr || r1 == nullptr) return;
    const double rate = (r1->mb - r0->mb) / (r1->us - r0->us);  // MB per us
    std::printf("fit k=%lld, %lld vs %lld rows: %.2f us fixed per launch + bytes at %.0f GB/s\n",
                static_cast<long long>(k), static_cast<long long>(m0), static_cast<long long>(m1),
                r0->us - r0->mb / rate, rate * 1e3);
  };
  fit(6144, 6144, 24576);
  fit(6144, 6144, 49152);
  fit(8192, 6144, 12288);
  return 0;
}
