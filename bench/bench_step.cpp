// One whole decode step of `synthetic:layers=N` (M3's real shapes: 3 dense full-attention layers,
// then MoE + MSA layers) as `serve --device cuda` runs it: M3ModelCuda with the embedding, the
// layers (a CUDA graph), the LM head and greedy sampling on the device, only the ids coming back.
// Timed two ways per batch size: `forward()` (each step waits for its ids: the synchronous
// engine loop) and two steps in flight through launch() / collect() (the async engine loop, which
// serve runs by default: the host's launches hide under the step before). Prints each step's
// bytes (every weight it reads, the LM head included, and the KV of `ctx` tokens per sequence)
// against the copy bandwidth measured in the same run: the ceiling bench_serve.py sets TPOT
// against, without the server. The timed steps of each batch size sit in an NVTX range
// `decode b=B` (bench/ncu_step.py --bench build/gpu/bench/bench_step --args "4 2048 10 1").
// Usage: bench_step [layers=4] [ctx=2048] [iters=20] [batches=1,16,64]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "bench_batch.h"
#include "bench_util.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "kernels/cpu/sample.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/synthetic_model.h"

namespace {

using m3::bench::copy_bandwidth;
using m3::bench::now_s;
using m3::model::ForwardBatch;
using m3::model::ForwardResult;
using m3::model::KvCacheCuda;
using m3::model::M3Config;
using m3::model::M3ModelCuda;

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  size_t from = 0;
  while (from < s.size()) {
    const size_t comma = std::min(s.find(',', from), s.size());
    out.push_back(std::atoi(s.substr(from, comma - from).c_str()));
    from = comma + 1;
  }
  return out;
}

// make_batch's decode batch (one token per sequence at position ctx) with every row's logits
// sampled greedily on the device.
ForwardBatch decode_batch(int num_seqs, int64_t ctx, int64_t pages_per_seq, int64_t vocab) {
  ForwardBatch b = m3::bench::make_batch(num_seqs, ctx, 1, pages_per_seq, vocab);
  for (int s = 0; s < num_seqs; ++s) {
    b.logits_indices.push_back(s);
    m3::kernels::cpu::SampleRow row;
    row.row = s;
    row.temperature = 0.f;  // greedy, as bench_serve.py asks
    b.device_samples.push_back(row);
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t layers = argc > 1 ? std::atoll(argv[1]) : 4;
  const int64_t ctx = argc > 2 ? std::atoll(argv[2]) : 2048;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 20;
  const std::vector<int> batches = parse_list(argc > 4 ? argv[4] : "1,16,64");
  if (layers < 1 || ctx < 1 || iters < 1 || batches.empty()) {
    std::fprintf(stderr, "usage: bench_step [layers=4] [ctx=2048] [iters=20] [batches=1,16,64]\n");
    return 2;
  }
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_step: %s\n", dev.error().message.c_str());
    return 1;
  }
  M3Config cfg = m3::model::synthetic_m3_config(layers);
  cfg.kv_cache_dtype = m3::kernels::KvDtype::kBf16;  // serve's defaults on the GPU
  cfg.index_cache_dtype = m3::kernels::KvDtype::kBf16;
  m3::kernels::cuda::set_gemm_precision(m3::kernels::cuda::GemmPrecision::kBf16);
  const double bw = copy_bandwidth();
  auto made = M3ModelCuda::synthetic(cfg, 1, 0);
  if (!made) {
    std::fprintf(stderr, "bench_step: %s\n", made.error().message.c_str());
    return 1;
  }
  M3ModelCuda& m = **made;
  std::printf(
      "device: %s; copy bandwidth (read+write) %.0f GB/s; synthetic:layers=%lld (%.2f GiB of "
      "weights), bf16 GEMMs, bf16 KV and index-K, context %lld tokens per sequence\n",
      dev->name.c_str(), bw / 1e9, static_cast<long long>(layers),
      static_cast<double>(m.weight_bytes()) / (1 << 30), static_cast<long long>(ctx));

  // Bytes a step reads: every weight once, except the embedding (B rows) and the routed experts
  // (the expected distinct count of B x top-k picks under uniform routing, per MoE layer).
  const auto& w = m.device_weights();
  const double E = cfg.num_local_experts, K = cfg.num_experts_per_tok;
  double per_expert = 0;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < layers; ++l) {
    if (!cfg.layer_is_moe[l]) continue;
    ++moe_layers;
    const auto& x = w.layers[l].experts[0];
    per_expert = static_cast<double>(x.w1.bytes() + x.w2.bytes() + x.w3.bytes());
  }
  const double embed_bytes = static_cast<double>(w.embed_tokens.bytes());
  const double row_bytes = embed_bytes / static_cast<double>(cfg.vocab_size);
  const double kv_elem = 2.0;  // bf16
  std::printf("\n%6s %12s %12s %10s %10s %10s %8s %8s\n", "batch", "sync ms", "async ms", "GB/step",
              "ceil ms", "GB/s", "of bw", "async/ceil");
  for (int B : batches) {
    const int64_t page = cfg.sparse_block_size;
    const int64_t pages_per_seq = (ctx + 1 + page - 1) / page;
    KvCacheCuda cache(cfg, B * pages_per_seq);
    ForwardBatch b = decode_batch(B, ctx, pages_per_seq, cfg.vocab_size);
    ForwardResult out;
    m.forward(b, cache, &out);  // sizes the buffers
    m.forward(b, cache, &out);  // captures the graph
    const std::string range = "decode b=" + std::to_string(B);
    nvtxRangePushA(range.c_str());
    double t0 = now_s();
    for (int i = 0; i < iters; ++i) m.forward(b, cache, &out);
    const double sync_s = (now_s() - t0) / iters;
    nvtxRangePop();
    // Two steps in flight, as the async engine loop keeps them.
    m.launch(b, cache);
    t0 = now_s();
    for (int i = 0; i < iters; ++i) {
      m.launch(b, cache);
      m.collect(&out);
    }
    const double async_s = (now_s() - t0) / iters;
    m.collect(&out);
    double bytes = static_cast<double>(m.weight_bytes()) - embed_bytes + B * row_bytes;
    const double distinct = E * (1.0 - std::pow(1.0 - K / E, B));
    bytes -= moe_layers * (E - distinct) * per_expert;
    for (int64_t l = 0; l < layers; ++l) {
      const bool sparse = cfg.layer_is_sparse[l];
      const double kv_tok = 2.0 * cfg.kv_size() * kv_elem;
      const double seen =
          sparse ? std::min<double>(ctx + 1, cfg.sparse_topk_blocks * page) : ctx + 1;
      bytes += B * seen * kv_tok;
      if (sparse) bytes += B * (ctx + 1.0) * cfg.index_head_dim * kv_elem;
    }
    const double ceil_s = bytes / bw;
    std::printf("%6d %12.3f %12.3f %10.2f %10.3f %10.0f %7.1f%% %8.2f\n", B, sync_s * 1e3,
                async_s * 1e3, bytes / 1e9, ceil_s * 1e3, bytes / async_s / 1e9,
                100.0 * ceil_s / async_s, async_s / ceil_s);
  }
  return 0;
}
