// CUDA op timings at M3's shapes (kernels/cuda/ops.h): milliseconds per call (CUDA events, after
// a warm-up) and the rate each op is bound by (TFLOP/s for linear, GB/s of bytes moved for the
// rest), to compare against the H200's ceilings (docs: ~4.3 TB/s copy, ~67 TFLOP/s fp32 SIMT).
// Usage: bench_cuda_ops [iters=20]. Exits 1 with the probe's message where no GPU is usable.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
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

template <class T>
DeviceBuffer<T> filled(size_t n, T lo, T hi, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(static_cast<float>(lo), static_cast<float>(hi));
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(g));
  return DeviceBuffer<T>(v);
}

using m3::bench::time_ms;

void report(const char* what, double ms, double units, const char* unit) {
  std::printf("%-44s %9.4f ms  %9.2f %s\n", what, ms, units / (ms * 1e-3), unit);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_cuda_ops: %s\n", dev.error().message.c_str());
    return 1;
  }
  std::printf("device: %s, %d SMs\n", dev->name.c_str(), dev->num_sms);
  m3::gpu::Stream stream;
  const cudaStream_t s = stream.get();
  char name[128];

  // Ceiling measured in this run: device-to-device copy of 1 GiB (bytes read + written / s).
  {
    const size_t bytes = size_t{1} << 30;
    DeviceBuffer<uint8_t> a(bytes), b(bytes);
    const double ms = time_ms(s, 10, [&] {
      M3_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s));
    });
    std::printf("ceiling: device copy %.0f GB/s (read + write), measured now\n",
                2.0 * bytes / (ms * 1e-3) / 1e9);
  }

  // linear: q_proj (6144 -> 8192), bf16 weights.
  const int64_t hidden = 6144, qdim = 8192;
  DeviceBuffer<uint16_t> w(qdim * hidden);
  {
    std::vector<uint16_t> h(qdim * hidden);
    std::mt19937 g(1);
    std::normal_distribution<float> d(0.f, 0.02f);
    for (auto& x : h) x = m3::f32_to_bf16(d(g));
    w.copy_from(h.data(), h.size());
  }
  for (int64_t n : {1, 64, 512}) {
    auto x = filled<float>(n * hidden, -1.f, 1.f, 2);
    DeviceBuffer<float> y(n * qdim);
    const double ms = time_ms(s, iters, [&] {
      gk::linear(x.data(), n, gk::MatRef{w.data(), DType::kBF16, qdim, hidden}, y.data(), s);
    });
    std::snprintf(name, sizeof name, "linear bf16 %lld x 6144 -> 8192", (long long)n);
    report(name, ms, 2.0 * n * qdim * hidden * 1e-12, "TFLOP/s");
  }

  const int64_t rows = 512;
  {
    auto x = filled<float>(rows * hidden, -2.f, 2.f, 3);
    auto nw = filled<float>(hidden, -0.1f, 0.1f, 4);
    DeviceBuffer<float> out(rows * hidden);
    const double ms = time_ms(s, iters, [&] {
      gk::rmsnorm_gemma(x.data(), rows, hidden, gk::VecRef{nw.data(), DType::kF32, hidden}, 1e-6f,
                        out.data(), s);
    });
    report("rmsnorm 512 x 6144", ms, 2.0 * rows * hidden * 4 * 1e-9, "GB/s");
  }
  {
    auto q = filled<float>(rows * 64 * 128, -1.f, 1.f, 5);
    std::vector<int32_t> hp(rows);
    std::iota(hp.begin(), hp.end(), 100000);
    DeviceBuffer<int32_t> pos(hp);
    const double ms =
        time_ms(s, iters, [&] { gk::rope_neox(q.data(), rows, 64, 128, 64, pos.data(), 5e6, s); });
    report("rope 512 x 64 heads x 128 (rot 64)", ms, 2.0 * rows * 64 * 64 * 4 * 1e-9, "GB/s");
  }
  {
    const int64_t inter = 3072;
    auto gt = filled<float>(rows * inter, -8.f, 8.f, 6),
         up = filled<float>(rows * inter, -8.f, 8.f, 7);
    DeviceBuffer<float> out(rows * inter);
    const double ms = time_ms(s, iters, [&] {
      gk::swiglu_oai(gt.data(), up.data(), rows, inter, 1.702f, 7.f, 1.f, out.data(), s);
    });
    report("swiglu 512 x 3072", ms, 3.0 * rows * inter * 4 * 1e-9, "GB/s");
  }
  {
    auto logits = filled<float>(rows * 128, -4.f, 4.f, 8);
    auto bias = filled<float>(128, -0.5f, 0.5f, 9);
    DeviceBuffer<int32_t> ids(rows * 4);
    DeviceBuffer<float> wts(rows * 4);
    const double ms = time_ms(s, iters, [&] {
      gk::router_topk(logits.data(), rows, 128, bias.data(), 4, 2.f, ids.data(), wts.data(), s);
    });
    report("router 512 x 128 experts, top-4", ms, rows * 128 * 4 * 1e-9, "GB/s");
  }

  // Attention and MSA: batch sequences of `len` tokens, one decode token each (position len-1).
  const int64_t bs = 128, nkv = 4, d = 128, di = 128, len = 8192, batch = 32;
  const int64_t blocks_per_seq = len / bs, pages = batch * blocks_per_seq;
  auto kc = filled<float>(pages * bs * nkv * d, -1.f, 1.f, 10);
  auto vc = filled<float>(pages * bs * nkv * d, -1.f, 1.f, 11);
  auto ikc = filled<float>(pages * bs * di, -1.f, 1.f, 12);
  std::vector<int32_t> offs(batch + 1), table(pages), hpos(batch, len - 1), hseq(batch);
  for (int64_t b = 0; b <= batch; ++b) offs[b] = static_cast<int32_t>(b * blocks_per_seq);
  std::iota(table.begin(), table.end(), 0);
  std::iota(hseq.begin(), hseq.end(), 0);
  DeviceBuffer<int32_t> doffs(offs), dtable(table), dpos(hpos), dseq(hseq);
  const gk::TokenLayout layout{batch, dpos.data(), dseq.data(), doffs.data(), dtable.data()};
  const gk::KvPages cache =
      gk::KvPages::fp32(kc.data(), vc.data(), ikc.data(), pages, bs, nkv, d, di);
  auto q = filled<float>(batch * 64 * d, -1.f, 1.f, 13);
  auto iq = filled<float>(batch * 4 * di, -1.f, 1.f, 14);
  DeviceBuffer<float> out(batch * 64 * d);
  DeviceBuffer<int32_t> sel(batch * nkv * 16);
  {
    const double ms = time_ms(s, iters, [&] {
      gk::attention_paged(q.data(), 64, cache, layout, nullptr, 0, 1.f / std::sqrt(128.f),
                          out.data(), s);
    });
    report("attention dense, 32 decode tokens x 8192 ctx", ms,
           2.0 * batch * len * nkv * d * 4 * 1e-9, "GB/s");
  }
  {
    const double ms = time_ms(s, iters, [&] {
      gk::msa_select_blocks(iq.data(), 4, cache, layout, 16, 0, 1, sel.data(), s);
    });
    report("msa select top-16, 32 tokens x 64 blocks", ms, batch * 4.0 * len * di * 4 * 1e-9,
           "GB/s");
    const double ms2 = time_ms(s, iters, [&] {
      gk::attention_paged(q.data(), 64, cache, layout, sel.data(), 16, 1.f / std::sqrt(128.f),
                          out.data(), s);
    });
    report("attention over 16 selected blocks, 32 tokens", ms2,
           2.0 * batch * 16 * bs * nkv * d * 4 * 1e-9, "GB/s");
  }
  stream.synchronize();
  return 0;
}
