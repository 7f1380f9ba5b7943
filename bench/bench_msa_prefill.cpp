// MSA prefill of one M3 sparse layer on the GPU (kernels/cuda/ops.h), issue #16 item 2: a prompt
// of N tokens from scratch (positions 0..N-1, one sequence, its pages one contiguous run) at
// M3's shapes (64 q / 4 KV heads x 128, one shared index-K head of 128 with 4 index-q heads,
// 128-token pages = MSA blocks, top-16, local block forced), per cache format (bf16 K/V + bf16
// index-K, fp8 + fp8 with per-tensor K/V and per-token index-K scales): the time of the block
// selection (index scores over every earlier block + top-k) and of the block-sparse attention
// over the selected blocks, as ms and TFLOP/s counted as vLLM's anchor counts them
// (../shared/anchors/vllm_msa: index = 2 x 4 heads x 128 x the keys each query scores;
// sparse = 4 x 64 heads x 128 x 128 x the blocks each query selected, whole tiles). The dense
// bf16 GEMM rate (cuBLASLt 8192^3) is printed as the tensor-core ceiling from the same run.
// "top-k ms": the selection with every block forced (nothing scored), i.e. the top-k's share.
// The sparse attention (the block-sparse prefill kernel, msa_sparse_prefill.cu; "per-token":
// the decode kernel per (token, kv head) the prefill ran before it) is timed over two selection
// patterns, both chosen by the real selection: "random" (N(0, 1) index queries and keys:
// neighbouring tokens share little beyond the local block) and "local" (each index head's
// query is one N(0, 1) vector per run of 64 tokens plus 0.25 x N(0, 1) noise per token, so
// neighbours pick mostly the same blocks, as a trained model's do); "union" = the mean number
// of distinct blocks over 4 consecutive tokens (16 = all equal, ~61 = disjoint at 32K).
// vLLM 0.33's Triton sparse attention ran 130 TFLOP/s at 32K (../shared/anchors/vllm_msa).
// Usage: bench_msa_prefill [iters=3] [lengths=8192,32768,131072]. Exits 1 where no GPU is usable.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/dtype.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/ops.h"

namespace {

namespace gk = m3::kernels::cuda;
using m3::bench::time_ms;
using m3::gpu::DeviceBuffer;
using m3::kernels::kv_dtype_name;
using m3::kernels::kv_dtype_size;
using m3::kernels::KvDtype;

using namespace m3::bench::msa;  // the layer's shapes

// `bytes` bytes of device memory filled by tiling a 16 MiB block of N(0, 1) values in `dt`
// (fp8: divided by `scale` first).
void fill_random(void* dst, size_t bytes, KvDtype dt, float scale, std::mt19937& g) {
  const auto h = m3::bench::normal_kv_bytes(dt, scale, size_t{16} << 20, g);
  m3::bench::fill_tiled_from_host(dst, bytes, h.data(), h.size());
}

template <class T>
void fill_normal(DeviceBuffer<T>& b, std::mt19937& g) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> block(std::min<size_t>(b.size(), size_t{1} << 22));
  for (auto& x : block) x = nd(g);
  m3::bench::fill_repeat(b, block);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 3;
  const std::vector<int64_t> lengths =
      m3::bench::int_list_arg(argc, argv, 2, {8192, 32768, 131072});
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_msa_prefill: %s\n", dev.error().message.c_str());
    return 1;
  }
  int64_t max_n = 0;
  for (int64_t n : lengths) max_n = std::max(max_n, n);
  const int64_t pages = (max_n + kPage - 1) / kPage;
  std::printf(
      "device: %s, %d SMs; MSA prefill of one layer: %lld q / %lld kv heads x %lld, index %lld x "
      "%lld, page %lld, top-%lld, local block forced\n",
      dev->name.c_str(), dev->num_sms, (long long)kHeads, (long long)kKvHeads, (long long)kDim,
      (long long)kIndexHeads, (long long)kIndexDim, (long long)kPage, (long long)kTopk);
  m3::gpu::Stream stream;
  const cudaStream_t s = stream.get();

  // The tensor-core ceiling: a bf16 8192^3 GEMM through cuBLASLt.
  {
    const int64_t n = 8192;
    DeviceBuffer<uint16_t> a(static_cast<size_t>(n * n)), b(static_cast<size_t>(n * n));
    DeviceBuffer<float> c(static_cast<size_t>(n * n));
    M3_CUDA_CHECK(cudaMemset(a.data(), 0x3c, a.size() * 2));
    M3_CUDA_CHECK(cudaMemset(b.data(), 0x3c, b.size() * 2));
    const gk::MatRef wr{b.data(), m3::DType::kBF16, n, n};
    const double ms = time_ms(s, 5, [&] {
      if (!gk::blas::gemm_bf16(a.data(), n, wr, c.data(), 0.f, s)) std::abort();
    });
    std::printf("ceiling: cuBLASLt bf16 8192^3 (fp32 out) %.0f TFLOP/s\n",
                2.0 * n * n * n / (ms * 1e-3) / 1e12);
    std::printf(
        "anchor (not rerun): vLLM 0.33 Triton sparse attention 16.43 ms = 130 TFLOP/s at 32K\n");
  }

  const size_t kv_elems = static_cast<size_t>(pages * kPage * kKvHeads * kDim);
  const size_t ik_elems = static_cast<size_t>(pages * kPage * kIndexDim);
  DeviceBuffer<uint8_t> kb(kv_elems * 2), vb(kv_elems * 2), ikb(ik_elems * 2);
  DeviceBuffer<float> ik_scale(pages * kPage);
  DeviceBuffer<float> q(static_cast<size_t>(max_n * kHeads * kDim)),
      iq(static_cast<size_t>(max_n * kIndexHeads * kIndexDim)),
      iq_local(static_cast<size_t>(max_n * kIndexHeads * kIndexDim)),
      out(static_cast<size_t>(max_n * kHeads * kDim));
  DeviceBuffer<int32_t> sel(static_cast<size_t>(max_n * kIndexHeads * kTopk));
  std::mt19937 g(5);
  fill_normal(q, g);
  fill_normal(iq, g);
  {  // the "local" index queries: one direction per (run of 64 tokens, head) plus noise
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t row = kIndexHeads * kIndexDim;
    std::vector<float> h(static_cast<size_t>(max_n * row)), base(static_cast<size_t>(row));
    for (int64_t t = 0; t < max_n; ++t) {
      if (t % 64 == 0)
        for (auto& x : base) x = nd(g);
      for (int64_t i = 0; i < row; ++i) h[t * row + i] = base[i] + 0.25f * nd(g);
    }
    iq_local.copy_from(h.data(), h.size());
  }
  {
    std::vector<float> sc(ik_scale.size(), 1.f / 32);
    ik_scale.copy_from(sc.data(), sc.size());
  }
  const float k_scale = 0.05f, v_scale = 0.05f;
  const float scale = 1.f / std::sqrt(static_cast<float>(kDim));

  std::printf("%-10s %8s | %10s %9s %10s | %-34s | %-28s | %10s\n", "kv/idx-K", "tokens",
              "select ms", "TFLOP/s", "(top-k ms)", "random: union, ms, TFLOP/s, per-tok",
              "local: union, ms, TFLOP/s", "MSA ms");
  for (KvDtype dt : {KvDtype::kBf16, KvDtype::kFp8}) {
    fill_random(kb.data(), kv_elems * kv_dtype_size(dt), dt, k_scale, g);
    fill_random(vb.data(), kv_elems * kv_dtype_size(dt), dt, v_scale, g);
    fill_random(ikb.data(), ik_elems * kv_dtype_size(dt), dt, 1.f / 32, g);
    gk::KvPages cache =
        gk::KvPages::fp32(nullptr, nullptr, nullptr, pages, kPage, kKvHeads, kDim, kIndexDim);
    cache.k = kb.data();
    cache.v = vb.data();
    cache.ik = ikb.data();
    cache.ik_scale = dt == KvDtype::kFp8 ? ik_scale.data() : nullptr;
    cache.kv_dtype = cache.ik_dtype = dt;
    cache.k_scale = dt == KvDtype::kFp8 ? k_scale : 1.f;
    cache.v_scale = dt == KvDtype::kFp8 ? v_scale : 1.f;
    for (int64_t n : lengths) {
      std::vector<int32_t> pos(n), seqs(n, 0),
          off = {0, static_cast<int32_t>((n + kPage - 1) / kPage)};
      std::vector<int32_t> table(off[1]);
      for (int64_t i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(i);
      for (int32_t i = 0; i < off[1]; ++i) table[i] = i;
      DeviceBuffer<int32_t> dpos(pos), dseq(seqs), doff(off), dtab(table);
      gk::TokenLayout layout{n, dpos.data(), dseq.data(), doff.data(), dtab.data()};
      layout.multi_token_seqs = true;    // a prefill chunk, as the model marks it
      layout.single_token_seqs = false;  // and no decode token beside it
      gk::TokenLayout per_token = layout;
      per_token.multi_token_seqs = false;  // the decode kernel per (token, kv head)
      const size_t ws_bytes = std::max(gk::msa_select_workspace_bytes(n, kIndexHeads, cache, n),
                                       gk::attention_workspace_bytes(n, kHeads, cache, kTopk, n));
      DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
      const gk::Workspace w{ws.data(), ws_bytes};
      auto select = [&] {
        gk::msa_select_blocks(iq.data(), kIndexHeads, cache, layout, kTopk, 0, 1, n, w, sel.data(),
                              s);
      };
      // Mean distinct blocks over each 4 consecutive tokens of one kv head (the selection in
      // sel once the stream's work is done: `s` is a non-blocking stream, so a plain cudaMemcpy
      // on the legacy stream would not wait for the selection just queued and read whatever an
      // earlier launch left, as it did before this synchronisation).
      auto mean_union = [&] {
        std::vector<int32_t> h(static_cast<size_t>(n * kIndexHeads * kTopk));
        stream.synchronize();
        M3_CUDA_CHECK(cudaMemcpy(h.data(), sel.data(), h.size() * 4, cudaMemcpyDeviceToHost));
        double sum = 0;
        int64_t groups = 0;
        std::vector<int32_t> u;
        for (int64_t t0 = 0; t0 + 4 <= n; t0 += 4)
          for (int64_t hh = 0; hh < kIndexHeads; ++hh, ++groups) {
            u.clear();
            for (int64_t t = t0; t < t0 + 4; ++t)
              for (int64_t k = 0; k < kTopk; ++k)
                if (const int32_t b = h[(t * kIndexHeads + hh) * kTopk + k]; b >= 0) u.push_back(b);
            std::sort(u.begin(), u.end());
            sum += static_cast<double>(std::unique(u.begin(), u.end()) - u.begin());
          }
        return groups ? sum / static_cast<double>(groups) : 0.0;
      };
      // The top-k alone: every block forced local (local_blocks past the sequence), so nothing
      // is scored and the top-k ranks the same number of keys.
      auto topk_only = [&] {
        gk::msa_select_blocks(iq.data(), kIndexHeads, cache, layout, kTopk, 0, n / kPage + 2, n, w,
                              sel.data(), s);
      };
      auto sparse = [&] {
        gk::attention_paged(q.data(), kHeads, cache, layout, sel.data(), kTopk, scale, n, w,
                            out.data(), s);
      };
      auto sparse_per_token = [&] {
        gk::attention_paged(q.data(), kHeads, cache, per_token, sel.data(), kTopk, scale, n, w,
                            out.data(), s);
      };
      const int it = n >= 131072 ? std::max(1, iters / 2) : iters;
      const double t_sel = time_ms(s, it, select);
      const double t_topk = time_ms(s, it, topk_only);
      select();  // the selection the sparse attention reads
      const double u_rand = mean_union();
      const double t_att = time_ms(s, it, sparse);
      const double t_att_pt = time_ms(s, it, sparse_per_token);
      gk::msa_select_blocks(iq_local.data(), kIndexHeads, cache, layout, kTopk, 0, 1, n, w,
                            sel.data(), s);
      const double u_local = mean_union();
      const double t_att_local = time_ms(s, it, sparse);
      // FLOPs as the anchor counts them: every earlier key scored by 4 index heads; 16 (or all
      // earlier, when fewer) whole 128-key tiles attended by 64 heads.
      double f_sel = 0, f_att = 0;
      for (int64_t i = 0; i < n; ++i) {
        f_sel += 2.0 * kIndexHeads * kIndexDim * double(i + 1);
        f_att += 4.0 * kHeads * kDim * kPage * double(std::min<int64_t>(kTopk, i / kPage + 1));
      }
      char name[32];
      std::snprintf(name, sizeof name, "%s/%s", kv_dtype_name(dt), kv_dtype_name(dt));
      std::printf(
          "%-10s %8lld | %10.3f %9.1f %10.3f | %5.1f %8.3f %7.1f %10.3f | %5.1f %8.3f %7.1f %6s | "
          "%10.3f\n",
          name, (long long)n, t_sel, f_sel / (t_sel * 1e-3) / 1e12, t_topk, u_rand, t_att,
          f_att / (t_att * 1e-3) / 1e12, t_att_pt, u_local, t_att_local,
          f_att / (t_att_local * 1e-3) / 1e12, "", t_sel + t_att);
    }
  }
  return 0;
}
