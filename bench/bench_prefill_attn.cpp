// Dense causal prefill attention at M3's shapes (64 q / 4 KV heads x 128, 128-token pages):
// FlashInfer's Hopper kernel (attn_flash.cu, bf16 cache, builds with FlashInfer) and the
// query-tiled tensor-core kernel (attn_prefill.cu) beside the per-token kernel they replace for
// prefill, per KV format, as ms and TFLOP/s (causal FLOPs: 4 x heads x 128 x the keys each query
// attends to). Two shapes per length N: a prefill from scratch (N queries over themselves) and
// the last 8192-token chunk of an N-token prompt over its cached prefix (the chunked-prefill
// step). The anchor, torch SDPA on the same shapes, is bench/sdpa_prefill.py (run it in the
// same job). Usage: bench_prefill_attn [iters=5] [lengths=8192,32768,131072] [old_max=32768]
// (the per-token kernel runs only up to old_max tokens: it is ~10x slower).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/attn_flash.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
using m3::bench::fill_repeat;
using m3::bench::time_ms;
using m3::gpu::DeviceBuffer;
using m3::kernels::KvDtype;

constexpr int64_t kHeads = 64, kKvHeads = 4, kDim = 128, kPage = 128, kChunk = 8192;

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::vector<int64_t> lengths =
      m3::bench::int_list_arg(argc, argv, 2, {8192, 32768, 131072});
  const int64_t old_max = argc > 3 ? std::atoll(argv[3]) : 32768;
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_prefill_attn: %s\n", dev.error().message.c_str());
    return 1;
  }
  std::printf(
      "device: %s, %d SMs; dense causal attention, %lld q / %lld kv heads x %lld, "
      "%lld-token pages\n",
      dev->name.c_str(), dev->num_sms, (long long)kHeads, (long long)kKvHeads, (long long)kDim,
      (long long)kPage);
  m3::gpu::Stream stream;
  const cudaStream_t s = stream.get();
  int64_t max_n = 0;
  for (int64_t n : lengths) max_n = std::max(max_n, n);
  const int64_t pages = (max_n + kPage - 1) / kPage;
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  // K / V pages (bf16 bits, or fp8 codes) and q, out for the longest shape.
  const size_t kv_elems = static_cast<size_t>(pages * kPage * kKvHeads * kDim);
  DeviceBuffer<uint8_t> kb(kv_elems * 2), vb(kv_elems * 2);
  std::vector<uint8_t> kblock(size_t{1} << 24), vblock(size_t{1} << 24);
  DeviceBuffer<float> q(static_cast<size_t>(max_n * kHeads * kDim)),
      out(static_cast<size_t>(max_n * kHeads * kDim));
  {
    std::vector<float> qblock(size_t{1} << 22);
    for (auto& x : qblock) x = nd(g);
    fill_repeat(q, qblock);
  }
  auto fill_kv = [&](KvDtype kvd) {
    for (size_t i = 0; i < kblock.size(); ++i) {
      if (kvd == KvDtype::kBf16) {
        // little-endian bf16 bits of a normal draw
        if (i % 2 == 0) {
          const uint16_t kbits = m3::f32_to_bf16(nd(g)), vbits = m3::f32_to_bf16(nd(g));
          kblock[i] = kbits & 0xff;
          kblock[i + 1] = kbits >> 8;
          vblock[i] = vbits & 0xff;
          vblock[i + 1] = vbits >> 8;
        }
      } else {
        kblock[i] = m3::f32_to_fp8_e4m3(nd(g));
        vblock[i] = m3::f32_to_fp8_e4m3(nd(g));
      }
    }
    fill_repeat(kb, kblock);
    fill_repeat(vb, vblock);
  };
  std::printf("%-8s %-7s %8s %7s | %10s %8s | %10s %8s | %10s %8s\n", "kv", "shape", "context",
              "queries", "flash ms", "TFLOP/s", "tiled ms", "TFLOP/s", "old ms", "TFLOP/s");
  m3::kernels::cuda::FlashPrefill flash;
  for (KvDtype kvd : {KvDtype::kBf16, KvDtype::kFp8}) {
    fill_kv(kvd);
    gk::KvPages cache =
        gk::KvPages::fp32(nullptr, nullptr, nullptr, pages, kPage, kKvHeads, kDim, 0);
    cache.k = kb.data();
    cache.v = vb.data();
    cache.kv_dtype = kvd;
    cache.k_scale = kvd == KvDtype::kFp8 ? 0.5f : 1.f;
    cache.v_scale = kvd == KvDtype::kFp8 ? 0.5f : 1.f;
    for (int64_t n : lengths) {
      for (int shape = 0; shape < 2; ++shape) {
        // shape 0: N queries at positions 0..N-1; shape 1: the last chunk of N.
        const int64_t nq = shape == 0 ? n : std::min(kChunk, n);
        if (shape == 1 && nq == n) continue;
        const int64_t first = n - nq;
        std::vector<int32_t> pos(nq), seq(nq, 0), off = {0, static_cast<int32_t>(n / kPage + 1)};
        std::vector<int32_t> table(off[1]);
        for (int64_t i = 0; i < nq; ++i) pos[i] = static_cast<int32_t>(first + i);
        for (int32_t i = 0; i < off[1]; ++i) table[i] = i;
        DeviceBuffer<int32_t> dpos(pos), dseq(seq), doff(off), dtab(table);
        gk::TokenLayout layout{nq, dpos.data(), dseq.data(), doff.data(), dtab.data()};
        double flops = 0;
        for (int64_t i = 0; i < nq; ++i) flops += 4.0 * kHeads * kDim * double(pos[i] + 1);
        const float scale = 1.f / std::sqrt(static_cast<float>(kDim));
        const size_t ws_bytes = gk::attention_workspace_bytes(nq, kHeads, cache, 0, n);
        DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
        // mode 0: per-token kernel; 1: query-tiled; 2: FlashInfer (its plan made once, as a
        // step does for its dense layers).
        flash.set_runs({{0, static_cast<int32_t>(nq), static_cast<int32_t>(n), 0}}, s);
        auto run = [&](int mode) {
          layout.multi_token_seqs = mode >= 1;
          layout.flash_prefill = mode == 2 ? &flash : nullptr;
          gk::attention_paged(q.data(), kHeads, cache, layout, nullptr, 0, scale, n,
                              gk::Workspace{ws.data(), ws_bytes}, out.data(), s);
        };
        const int it = n >= 131072 ? std::max(1, iters / 2) : iters;
        auto cell = [&](double ms) {
          if (ms > 0)
            std::printf(" %10.3f %8.1f |", ms, flops / (ms * 1e-3) / 1e12);
          else
            std::printf(" %10s %8s |", "-", "-");
        };
        const double t_fi = flash.serves(cache) ? time_ms(s, it, [&] { run(2); }) : 0;
        const double t_new = time_ms(s, it, [&] { run(1); });
        double t_old = 0;
        if (n <= old_max) t_old = time_ms(s, std::max(1, it / 2), [&] { run(0); });
        std::printf("%-8s %-7s %8lld %7lld |", m3::kernels::kv_dtype_name(kvd),
                    shape == 0 ? "scratch" : "chunk", (long long)n, (long long)nq);
        cell(t_fi);
        cell(t_new);
        cell(t_old);
        std::printf("\n");
      }
    }
  }
  return 0;
}
