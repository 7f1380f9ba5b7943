// MSA decode of one M3 sparse layer on the GPU (kernels/cuda/ops.h): 64 q heads over 4 KV heads
// of 128, one shared index-K head of 128 with 4 index-q heads, 128-token pages, top-16, local 1,
// fp32 KV cache. For batch 1 and 8 at each context: the time of MSA (select + sparse attention),
// of our dense attention over the full context, the bytes each must read (index-K scan + the
// selected K/V pages; all K/V) as GB/s, and the device copy bandwidth measured in the same run.
// Compare with bench/sdpa_reference.py (PyTorch SDPA, bf16 dense). Timings are warm loops (at 8K
// the whole layer fits the 60 MB L2, as it does for SDPA).
// Usage: bench_msa_decode [iters=20] [max_context=1048576]. Exits 1 where no GPU is usable.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
using m3::gpu::DeviceBuffer;

constexpr int64_t kPage = 128, kKvHeads = 4, kHeads = 64, kDim = 128, kIndexHeads = 4,
                  kIndexDim = 128, kTopk = 16;

using m3::bench::time_ms;

// Fills n floats of device memory with N(0, 1) values: a 16M-value random block, tiled.
void fill_random(float* dst, size_t n, const DeviceBuffer<float>& seed, cudaStream_t s) {
  for (size_t off = 0; off < n; off += seed.size()) {
    const size_t m = std::min(seed.size(), n - off);
    M3_CUDA_CHECK(
        cudaMemcpyAsync(dst + off, seed.data(), m * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t max_ctx = argc > 2 ? std::atoll(argv[2]) : (int64_t{1} << 20);
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_msa_decode: %s\n", dev.error().message.c_str());
    return 1;
  }
  const int64_t max_batch = 8;
  const int64_t max_tokens = max_batch * max_ctx;
  const int64_t pages = max_tokens / kPage;
  std::printf(
      "device: %s; one layer: %lld q / %lld kv heads x %lld, index %lld x %lld, page "
      "%lld, top-%lld; fp32 KV cache of %.1f GiB\n",
      dev->name.c_str(), (long long)kHeads, (long long)kKvHeads, (long long)kDim,
      (long long)kIndexHeads, (long long)kIndexDim, (long long)kPage, (long long)kTopk,
      (double)pages * kPage * (2 * kKvHeads * kDim + kIndexDim) * 4 / (1 << 30));

  m3::gpu::Stream stream;
  cudaStream_t s = stream.get();
  DeviceBuffer<float> seed(size_t{1} << 24);
  {
    std::mt19937 g(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> h(seed.size());
    for (auto& x : h) x = nd(g);
    seed.copy_from(h.data(), h.size());
  }
  DeviceBuffer<float> k(pages * kPage * kKvHeads * kDim), v(k.size()),
      ik(pages * kPage * kIndexDim);
  fill_random(k.data(), k.size(), seed, s);
  fill_random(v.data(), v.size(), seed, s);
  fill_random(ik.data(), ik.size(), seed, s);
  stream.synchronize();
  const gk::KvPages cache =
      gk::KvPages::fp32(k.data(), v.data(), ik.data(), pages, kPage, kKvHeads, kDim, kIndexDim);

  // The copy ceiling: a 2 GiB device-to-device copy (GB/s counts the bytes read and written).
  {
    const size_t n = std::min<size_t>(k.size() / 2, size_t{1} << 29);
    const double ms = time_ms(s, 5, [&] {
      M3_CUDA_CHECK(
          cudaMemcpyAsync(k.data() + n, k.data(), n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    });
    std::printf("device copy: %.0f GB/s (read + write of %.1f GiB)\n", 2.0 * n * 4 / ms / 1e6,
                n * 4.0 / (1 << 30));
    fill_random(k.data(), k.size(), seed, s);
  }

  std::printf("%5s %8s | %9s %9s %9s %8s | %9s %8s | %7s\n", "batch", "context", "select ms",
              "attn ms", "MSA ms", "MSA GB/s", "dense ms", "GB/s", "speedup");
  std::mt19937 g(11);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (int64_t batch : {int64_t{1}, max_batch}) {
    for (int64_t ctx : {int64_t{8192}, int64_t{131072}, int64_t{524288}, int64_t{1048576}}) {
      if (ctx > max_ctx) continue;
      const int64_t nbps = ctx / kPage;
      std::vector<int32_t> perm(batch * nbps);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), g);  // pages anywhere in the pool
      std::vector<int32_t> offsets(batch + 1), positions(batch), seq_ids(batch);
      for (int64_t b = 0; b <= batch; ++b) offsets[b] = static_cast<int32_t>(b * nbps);
      for (int64_t b = 0; b < batch; ++b) {
        positions[b] = static_cast<int32_t>(ctx - 1);
        seq_ids[b] = static_cast<int32_t>(b);
      }
      DeviceBuffer<int32_t> dperm(perm), doff(offsets), dpos(positions), dseq(seq_ids);
      const gk::TokenLayout layout{batch, dpos.data(), dseq.data(), doff.data(), dperm.data()};
      DeviceBuffer<float> q(batch * kHeads * kDim), iq(batch * kIndexHeads * kIndexDim),
          out(batch * kHeads * kDim);
      fill_random(q.data(), q.size(), seed, s);
      fill_random(iq.data(), iq.size(), seed, s);
      DeviceBuffer<int32_t> sel(batch * kIndexHeads * kTopk);
      const size_t ws_bytes =
          std::max({gk::msa_select_workspace_bytes(batch, kIndexHeads, cache, ctx),
                    gk::attention_workspace_bytes(batch, kHeads, cache, kTopk, ctx),
                    gk::attention_workspace_bytes(batch, kHeads, cache, 0, ctx)});
      DeviceBuffer<uint8_t> ws(ws_bytes);
      const gk::Workspace w{ws.data(), ws_bytes};

      auto select = [&] {
        gk::msa_select_blocks(iq.data(), kIndexHeads, cache, layout, kTopk, 0, 1, ctx, w,
                              sel.data(), s);
      };
      auto sparse = [&] {
        gk::attention_paged(q.data(), kHeads, cache, layout, sel.data(), kTopk, scale, ctx, w,
                            out.data(), s);
      };
      auto dense = [&] {
        gk::attention_paged(q.data(), kHeads, cache, layout, nullptr, 0, scale, ctx, w, out.data(),
                            s);
      };
      const double t_sel = time_ms(s, iters, select);
      const double t_att = time_ms(s, iters, sparse);
      const double t_msa = time_ms(s, iters, [&] {
        select();
        sparse();
      });
      const double t_dense = time_ms(s, std::max(2, iters / 4), dense);
      // Bytes that must be read: the index-K of every block (the top-k reads only the small
      // score rows) plus the selected pages' K/V; dense reads all K/V.
      const double kv_row = 2.0 * kKvHeads * kDim * 4;  // K + V bytes per token
      const double msa_bytes =
          batch * (ctx * kIndexDim * 4.0 + std::min<int64_t>(ctx, kTopk * kPage) * kv_row);
      const double dense_bytes = batch * ctx * kv_row;
      std::printf("%5lld %8lld | %9.4f %9.4f %9.4f %8.0f | %9.4f %8.0f | %6.1fx\n",
                  (long long)batch, (long long)ctx, t_sel, t_att, t_msa, msa_bytes / t_msa / 1e6,
                  t_dense, dense_bytes / t_dense / 1e6, t_dense / t_msa);
    }
  }
  return 0;
}
