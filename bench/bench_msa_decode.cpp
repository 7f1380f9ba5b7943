// MSA decode of one M3 sparse layer on the GPU (kernels/cuda/ops.h): 64 q heads over 4 KV heads
// of 128, one shared index-K head of 128 with 4 index-q heads, 128-token pages, top-16, local 1.
// For each cache format (fp32 K/V + fp32 index-K, the oracle mode; bf16 + bf16; fp8 + fp8, with
// per-tensor K/V scales and per-token index-K scales), batch 1 and 8, contexts 8K..1M: the time
// of the selection (index scan + top-k), of the sparse attention over the 16 selected blocks, of
// both as one CUDA graph (how the engine runs a decode step), and the bytes they must read (the
// index-K of every block, fp8 scales included, plus the selected pages' K/V) with the time
// those bytes take at the device copy bandwidth measured in the same run (the ceiling). Then the
// dense decode attention over all K/V at 128K..1M for each K/V format, beside its ceiling; compare
// with bench/sdpa_reference.py (PyTorch SDPA, bf16) and vLLM's Triton kernels
// (../shared/anchors/vllm_msa) run in the same GPU session. Timings are warm loops (at 8K a
// layer's index-K fits the 60 MB L2, as it does for the others).
// Pages: each sequence's pages are one contiguous run of the pool, as vLLM's anchor lays them out
// (and as a fresh pool hands them out); `shuffled` scatters them over the whole pool instead.
// Usage: bench_msa_decode [iters=20] [max_context=1048576] [shuffled]. Exits 1 where no GPU is
// usable. M3_BENCH_FORMATS=float32,bfloat16,fp8_e4m3 (a subset, by KV format name) and
// M3_BENCH_CONTEXTS=8192,1048576 (a subset of the contexts) narrow a run (profiling, quick reruns);
// M3_BENCH_DENSE_ONLY=1 times the dense attention alone; M3_BENCH_LAYOUT_PROBE=1 adds the layout
// probe below.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
using m3::gpu::DeviceBuffer;
using m3::kernels::kv_dtype_name;
using m3::kernels::kv_dtype_size;
using m3::kernels::KvDtype;

using namespace m3::bench::msa;  // the layer's shapes

using m3::bench::graph_ms;
using m3::bench::time_ms;

// Fills `bytes` bytes of device memory by tiling a seed block.
void fill_tiled(void* dst, size_t bytes, const DeviceBuffer<uint8_t>& seed, cudaStream_t s) {
  for (size_t off = 0; off < bytes; off += seed.size()) {
    const size_t m = std::min(seed.size(), bytes - off);
    M3_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + off, seed.data(), m,
                                  cudaMemcpyDeviceToDevice, s));
  }
}

// 64 MiB of N(0, 1) values stored as `dt` (fp8: divided by `scale` first).
DeviceBuffer<uint8_t> seed_block(KvDtype dt, float scale, std::mt19937& g) {
  return DeviceBuffer<uint8_t>(m3::bench::normal_kv_bytes(dt, scale, size_t{64} << 20, g));
}

// Whether `item` is in the comma-separated list of environment variable `var` (unset: every item).
bool listed(const char* var, const std::string& item) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return true;
  const std::string list = std::string(",") + v + ",";
  return list.find("," + item + ",") != std::string::npos;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t max_ctx = argc > 2 ? std::atoll(argv[2]) : (int64_t{1} << 20);
  const bool shuffled = argc > 3 && std::string(argv[3]) == "shuffled";
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_msa_decode: %s\n", dev.error().message.c_str());
    return 1;
  }
  const int64_t max_batch = 8;
  const int64_t max_tokens = max_batch * max_ctx;
  const int64_t pages = max_tokens / kPage;
  const size_t kv_bytes = static_cast<size_t>(pages * kPage * kKvHeads * kDim) * 4;  // fp32 size
  const size_t ik_bytes = static_cast<size_t>(pages * kPage * kIndexDim) * 4;
  std::printf(
      "device: %s; one layer: %lld q / %lld kv heads x %lld, index %lld x %lld, page %lld, "
      "top-%lld; %lld pages (%.1f GiB of fp32 K/V/index-K)\n",
      dev->name.c_str(), (long long)kHeads, (long long)kKvHeads, (long long)kDim,
      (long long)kIndexHeads, (long long)kIndexDim, (long long)kPage, (long long)kTopk,
      (long long)pages, (2.0 * kv_bytes + ik_bytes) / (1 << 30));

  m3::gpu::Stream stream;
  cudaStream_t s = stream.get();
  DeviceBuffer<uint8_t> k(kv_bytes), v(kv_bytes), ik(ik_bytes);
  DeviceBuffer<float> ik_scale(pages * kPage);

  // The copy ceiling: a 2 GiB device-to-device copy (GB/s counts the bytes read and written).
  double copy_gbs = 0;
  {
    const size_t n = std::min<size_t>(kv_bytes / 2, size_t{1} << 31);
    const double ms = time_ms(s, 5, [&] {
      M3_CUDA_CHECK(cudaMemcpyAsync(k.data() + n, k.data(), n, cudaMemcpyDeviceToDevice, s));
    });
    copy_gbs = 2.0 * n / ms / 1e6;
    std::printf("device copy: %.0f GB/s (read + write of %.1f GiB); ceiling = bytes / that\n",
                copy_gbs, n / double(1 << 30));
  }
  auto ceil_us = [&](double bytes) { return bytes / copy_gbs / 1e3; };

  struct Mode {
    KvDtype kv, ik;
  };
  const Mode modes[] = {{KvDtype::kF32, KvDtype::kF32},
                        {KvDtype::kBf16, KvDtype::kBf16},
                        {KvDtype::kFp8, KvDtype::kFp8}};
  const float k_scale = 0.05f, v_scale = 0.05f;  // fp8 K/V: N(0,1) / 0.05 within E4M3's range
  std::mt19937 g(11);
  // Fills the pool in a format (a seed block tiled over it); fp8 index-K scales 2^-5.
  auto fill = [&](const Mode& m) {
    const auto sk = seed_block(m.kv, k_scale, g);
    fill_tiled(k.data(), kv_bytes / 4 * kv_dtype_size(m.kv), sk, s);
    fill_tiled(v.data(), kv_bytes / 4 * kv_dtype_size(m.kv), sk, s);
    const auto si = seed_block(m.ik, 1.f / 32, g);
    fill_tiled(ik.data(), ik_bytes / 4 * kv_dtype_size(m.ik), si, s);
    std::vector<float> sc(ik_scale.size(), 1.f / 32);
    ik_scale.copy_from(sc.data(), sc.size());
    stream.synchronize();
  };
  auto view = [&](const Mode& m) {
    gk::KvPages c =
        gk::KvPages::fp32(nullptr, nullptr, nullptr, pages, kPage, kKvHeads, kDim, kIndexDim);
    c.k = k.data();
    c.v = v.data();
    c.ik = ik.data();
    c.ik_scale = m.ik == KvDtype::kFp8 ? ik_scale.data() : nullptr;
    c.kv_dtype = m.kv;
    c.ik_dtype = m.ik;
    c.k_scale = m.kv == KvDtype::kFp8 ? k_scale : 1.f;
    c.v_scale = m.kv == KvDtype::kFp8 ? v_scale : 1.f;
    return c;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  struct Step {
    int64_t batch, ctx;
    DeviceBuffer<int32_t> perm, off, pos, seq;
    DeviceBuffer<float> q, iq, out;
    DeviceBuffer<int32_t> sel;
  };
  // The decode step of `batch` sequences of `ctx` tokens, pages shuffled over the pool.
  auto make_step = [&](int64_t batch, int64_t ctx) {
    const int64_t nbps = ctx / kPage;
    std::vector<int32_t> perm(batch * nbps);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffled) std::shuffle(perm.begin(), perm.end(), g);
    std::vector<int32_t> offsets(batch + 1), positions(batch), seq_ids(batch);
    for (int64_t b = 0; b <= batch; ++b) offsets[b] = static_cast<int32_t>(b * nbps);
    for (int64_t b = 0; b < batch; ++b) {
      positions[b] = static_cast<int32_t>(ctx - 1);
      seq_ids[b] = static_cast<int32_t>(b);
    }
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q(batch * kHeads * kDim), iq(batch * kIndexHeads * kIndexDim);
    for (auto& x : q) x = nd(g);
    for (auto& x : iq) x = nd(g);
    return Step{batch,
                ctx,
                DeviceBuffer<int32_t>(perm),
                DeviceBuffer<int32_t>(offsets),
                DeviceBuffer<int32_t>(positions),
                DeviceBuffer<int32_t>(seq_ids),
                DeviceBuffer<float>(q),
                DeviceBuffer<float>(iq),
                DeviceBuffer<float>(batch * kHeads * kDim),
                DeviceBuffer<int32_t>(batch * kIndexHeads * kTopk)};
  };
  std::vector<int64_t> contexts;
  for (int64_t ctx : {int64_t{8192}, int64_t{131072}, int64_t{524288}, int64_t{1048576}})
    if (ctx <= max_ctx && listed("M3_BENCH_CONTEXTS", std::to_string(ctx))) contexts.push_back(ctx);

  std::printf("\nMSA decode, one layer (us; ceiling = bytes at the copy bandwidth); pages %s\n",
              shuffled ? "shuffled over the pool" : "contiguous per sequence");
  std::printf("%-14s %5s %8s | %9s %9s %9s %9s | %9s %9s %8s\n", "kv/index-K", "batch", "context",
              "select", "attn", "MSA eager", "MSA graph", "MB read", "ceiling", "GB/s");
  struct Dense {
    KvDtype kv;
    int64_t batch, ctx;
    double us, bytes;
  };
  std::vector<Dense> dense_rows;
  for (const Mode& m : modes) {
    if (!listed("M3_BENCH_FORMATS", kv_dtype_name(m.kv))) continue;
    fill(m);
    const gk::KvPages cache = view(m);
    for (int64_t batch : {int64_t{1}, max_batch}) {
      for (int64_t ctx : contexts) {
        Step st = make_step(batch, ctx);
        const gk::TokenLayout layout{batch, st.pos.data(), st.seq.data(), st.off.data(),
                                     st.perm.data()};
        const size_t ws_bytes =
            std::max({gk::msa_select_workspace_bytes(batch, kIndexHeads, cache, ctx),
                      gk::attention_workspace_bytes(batch, kHeads, cache, kTopk, ctx),
                      gk::attention_workspace_bytes(batch, kHeads, cache, 0, ctx)});
        DeviceBuffer<uint8_t> ws(ws_bytes);
        const gk::Workspace w{ws.data(), ws_bytes};
        auto select = [&] {
          gk::msa_select_blocks(st.iq.data(), kIndexHeads, cache, layout, kTopk, 0, 1, ctx, w,
                                st.sel.data(), s);
        };
        auto sparse = [&] {
          gk::attention_paged(st.q.data(), kHeads, cache, layout, st.sel.data(), kTopk, scale, ctx,
                              w, st.out.data(), s);
        };
        auto msa = [&] {
          select();
          sparse();
        };
        const double kv_row = 2.0 * kKvHeads * kDim * kv_dtype_size(m.kv);
        // M3_BENCH_DENSE_ONLY=1: the dense rows alone (profiling the dense kernel).
        if (std::getenv("M3_BENCH_DENSE_ONLY") == nullptr) {
          const double t_sel = time_ms(s, iters, select) * 1e3;
          const double t_att = time_ms(s, iters, sparse) * 1e3;
          const double t_msa = time_ms(s, iters, msa) * 1e3;
          const double t_graph = graph_ms(s, iters, msa) * 1e3;
          // Bytes that must be read: every block's index-K (+ fp8 scales; the top-k reads only
          // the small score rows) plus the selected pages' K and V.
          const double ik_row = kIndexDim * kv_dtype_size(m.ik) + (m.ik == KvDtype::kFp8 ? 4 : 0);
          const double bytes =
              batch * (ctx * ik_row + std::min<int64_t>(ctx, kTopk * kPage) * kv_row);
          char name[32];
          std::snprintf(name, sizeof name, "%s/%s", kv_dtype_name(m.kv), kv_dtype_name(m.ik));
          std::printf("%-14s %5lld %8lld | %9.1f %9.1f %9.1f %9.1f | %9.1f %9.1f %8.0f\n", name,
                      (long long)batch, (long long)ctx, t_sel, t_att, t_msa, t_graph, bytes / 1e6,
                      ceil_us(bytes), bytes / t_graph / 1e3);
        }
        if (ctx >= 131072) {
          auto dense = [&] {
            gk::attention_paged(st.q.data(), kHeads, cache, layout, nullptr, 0, scale, ctx, w,
                                st.out.data(), s);
          };
          dense_rows.push_back({m.kv, batch, ctx, time_ms(s, std::max(2, iters / 4), dense) * 1e3,
                                batch * ctx * kv_row});
        }
      }
    }
  }
  // Layout probe (M3_BENCH_LAYOUT_PROBE=1): the same dense attention grid and per-CTA work over
  // two layouts of the same bytes. A: batch 1 at 1M over 4 KV heads interleaved per key (a key's
  // rows of head g at stride 4 x 256 B, the cache's layout). B: batch 4 at 1M over 1 KV head of
  // 16 q heads (each CTA column streams contiguous 256-byte rows). Same grid (4 x splits).
  if (std::getenv("M3_BENCH_LAYOUT_PROBE") != nullptr) {
    const int64_t ctx = std::min<int64_t>(max_ctx, int64_t{1} << 20);
    for (const Mode& m : modes) {
      if (m.kv == KvDtype::kF32 || !listed("M3_BENCH_FORMATS", kv_dtype_name(m.kv))) continue;
      fill(m);
      const gk::KvPages ca = view(m);
      gk::KvPages cb = ca;
      cb.num_kv_heads = 1;
      cb.num_pages = pages * kKvHeads;
      const double bytes = 2.0 * ctx * kKvHeads * kDim * kv_dtype_size(m.kv);
      for (int variant = 0; variant < 2; ++variant) {
        const int64_t batch = variant == 0 ? 1 : kKvHeads;
        const int64_t heads = variant == 0 ? kHeads : kHeads / kKvHeads;
        const gk::KvPages& c = variant == 0 ? ca : cb;
        Step st = make_step(batch, ctx);
        const gk::TokenLayout layout{batch, st.pos.data(), st.seq.data(), st.off.data(),
                                     st.perm.data()};
        const size_t ws_bytes = gk::attention_workspace_bytes(batch, heads, c, 0, ctx);
        DeviceBuffer<uint8_t> ws(ws_bytes);
        const gk::Workspace w{ws.data(), ws_bytes};
        const double us = time_ms(s, std::max(4, iters / 2),
                                  [&] {
                                    gk::attention_paged(st.q.data(), heads, c, layout, nullptr, 0,
                                                        scale, ctx, w, st.out.data(), s);
                                  }) *
                          1e3;
        std::printf(
            "layout probe %s %s: %.1f us, %.0f GB/s\n", kv_dtype_name(m.kv),
            variant == 0 ? "A (4 heads interleaved, batch 1)" : "B (1 head contiguous, batch 4)",
            us, bytes / us / 1e3);
      }
    }
  }
  std::printf("\nDense decode attention over all K/V, one layer (us)\n");
  std::printf("%-9s %5s %8s | %10s %10s %8s\n", "kv", "batch", "context", "dense", "ceiling",
              "GB/s");
  for (const Dense& d : dense_rows)
    std::printf("%-9s %5lld %8lld | %10.1f %10.1f %8.0f\n", kv_dtype_name(d.kv), (long long)d.batch,
                (long long)d.ctx, d.us, ceil_us(d.bytes), d.bytes / d.us / 1e3);
  return 0;
}
