// One MiniMax-M3 MoE + MSA layer at the real shapes (synthetic weights generated on the GPU):
// decode steps at batch 1, 8, 64, 256 (each sequence at `ctx` tokens of context) and prefill of
// 8K and 32K tokens, through M3ModelCuda::forward (the path `serve --device cuda` runs).
// Prints, per decode batch, the bytes of weights and KV the step must read and the achieved rate
// as a fraction of the device copy bandwidth measured in the same run; per prefill, the FLOPs of
// the GEMM and MoE parts over the layer time (a lower bound on their rate: attention, norms and
// routing share the time). Usage: bench_layer [ctx=8192] [iters=20] [bf16|exact] [kv] [index]
// [weights=bf16] [prefill=32768] [batches=1,8,64,256]
// (the GEMM precision, `--gemm-precision` of serve, default bf16; the KV and index-K formats,
// float32|bfloat16|fp8, default bfloat16 and the KV's, as `serve --device cuda` defaults; the
// weight formats, a comma list of synthetic:...,weights= values (bf16, fp8, mxfp8, nvfp4,
// mxfp4), each measured in turn in the same run, with its weight bytes from the device views;
// prefill: the longest prefill measured of 8K and 32K tokens, 0 none; batches: the decode
// batches, a comma list).
#include <algorithm>
#include <chrono>
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
#include "gpu/device_buffer.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/synthetic_model.h"

namespace {

using m3::bench::copy_bandwidth;
using m3::bench::make_batch;
using m3::bench::now_s;
using m3::model::ForwardBatch;
using m3::model::KvCacheCuda;
using m3::model::M3Config;
using m3::model::M3ModelCuda;

int run_format(const M3Config& cfg, const std::string& fmt, m3::kernels::WeightQuant weights,
               double bw, int64_t ctx, int iters, int64_t max_prefill,
               m3::kernels::KvDtype kv_dtype, m3::kernels::KvDtype ik_dtype,
               const std::vector<int>& batches);

}  // namespace

int main(int argc, char** argv) {
  const int64_t ctx = argc > 1 ? std::atoll(argv[1]) : 8192;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  const std::string precision = argc > 3 ? argv[3] : "bf16";
  auto format = [](const std::string& v) {
    return v == "float32" ? m3::kernels::KvDtype::kF32
           : v == "fp8"   ? m3::kernels::KvDtype::kFp8
                          : m3::kernels::KvDtype::kBf16;
  };
  const m3::kernels::KvDtype kv_dtype = format(argc > 4 ? argv[4] : "bfloat16");
  const m3::kernels::KvDtype ik_dtype = argc > 5 ? format(argv[5])
                                        : kv_dtype == m3::kernels::KvDtype::kFp8
                                            ? m3::kernels::KvDtype::kBf16
                                            : kv_dtype;
  m3::kernels::cuda::set_gemm_precision(precision == "bf16"
                                            ? m3::kernels::cuda::GemmPrecision::kBf16
                                            : m3::kernels::cuda::GemmPrecision::kExact);
  auto dev = m3::gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_layer: %s\n", dev.error().message.c_str());
    return 1;
  }
  const std::string formats = argc > 6 ? argv[6] : "bf16";
  const int64_t max_prefill = argc > 7 ? std::atoll(argv[7]) : 32768;
  std::vector<int> batches;
  {
    const std::string list = argc > 8 ? argv[8] : "1,8,64,256";
    size_t at = 0;
    while (at <= list.size()) {
      const size_t end = std::min(list.find(',', at), list.size());
      const int b = std::atoi(list.substr(at, end - at).c_str());
      if (b < 1) {
        std::fprintf(stderr, "bench_layer: batches '%s': each a positive integer\n", list.c_str());
        return 2;
      }
      batches.push_back(b);
      at = end + 1;
    }
  }
  // One layer that is both MoE and MSA (M3's layers 3..59).
  M3Config cfg = m3::model::synthetic_m3_config(1);
  cfg.layer_is_moe.assign(1, true);
  cfg.layer_is_sparse.assign(1, true);
  cfg.kv_cache_dtype = kv_dtype;
  cfg.index_cache_dtype = ik_dtype;
  const double bw = copy_bandwidth();
  std::printf(
      "device: %s; copy bandwidth (read+write) %.0f GB/s; GEMM precision %s; KV %s, index-K "
      "%s\n",
      dev->name.c_str(), bw / 1e9, precision.c_str(), m3::kernels::kv_dtype_name(kv_dtype),
      m3::kernels::kv_dtype_name(ik_dtype));
  size_t from = 0;
  int rc = 0;
  while (from <= formats.size()) {
    const size_t comma = std::min(formats.find(',', from), formats.size());
    const std::string fmt = formats.substr(from, comma - from);
    from = comma + 1;
    auto spec = m3::model::parse_synthetic_spec("synthetic:layers=1,weights=" + fmt);
    if (!spec) {
      std::fprintf(stderr, "bench_layer: %s\n", spec.error().message.c_str());
      return 1;
    }
    rc |= run_format(cfg, fmt, spec->weights, bw, ctx, iters, max_prefill, kv_dtype, ik_dtype,
                     batches);
  }
  return rc;
}

namespace {

int run_format(const M3Config& cfg, const std::string& fmt, m3::kernels::WeightQuant weights,
               double bw, int64_t ctx, int iters, int64_t max_prefill,
               m3::kernels::KvDtype kv_dtype, m3::kernels::KvDtype ik_dtype,
               const std::vector<int>& batches) {
  auto model = M3ModelCuda::synthetic(cfg, 1, 0, nullptr, nullptr, nullptr, weights);
  if (!model) {
    std::fprintf(stderr, "bench_layer: %s\n", model.error().message.c_str());
    return 1;
  }
  M3ModelCuda& m = **model;
  const double H = cfg.hidden_size, Ie = cfg.intermediate_size, E = cfg.num_local_experts,
               K = cfg.num_experts_per_tok;
  const double attn_params = (cfg.q_size() + 2.0 * cfg.kv_size() +
                              cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim) *
                                 H +
                             H * cfg.q_size();
  const double expert_params = 3.0 * Ie * H;
  // Bytes a decode step reads of the weights, from the device views (codes and scales in a
  // quantized format): attention and index projections, router, shared expert, and per routed
  // expert its three matrices.
  const m3::model::LayerWeights& L = m.device_weights().layers[0];
  double fixed_w = 0;
  for (const m3::kernels::MatRef* w :
       {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.index_q_proj, &L.index_k_proj, &L.router,
        &L.shared_gate, &L.shared_up, &L.shared_down})
    fixed_w += static_cast<double>(w->bytes());
  const double per_expert = static_cast<double>(L.experts[0].w1.bytes() + L.experts[0].w3.bytes() +
                                                L.experts[0].w2.bytes());
  const double bytes_fixed = fixed_w;
  std::printf(
      "\n## weights=%s: one layer holds %.2f GiB on the GPU (attention + router + shared "
      "%.1f MB, one routed expert %.2f MB)\n",
      fmt.c_str(), static_cast<double>(m.weight_bytes()) / (1 << 30), fixed_w / 1e6,
      per_expert / 1e6);
  const int64_t page = cfg.sparse_block_size;
  const double kvb = static_cast<double>(m3::kernels::kv_dtype_size(kv_dtype));
  const double ikb = static_cast<double>(m3::kernels::kv_dtype_size(ik_dtype)) +
                     (ik_dtype == m3::kernels::KvDtype::kFp8 ? 4.0 / cfg.index_head_dim : 0.0);
  const double kv_token_bytes = 2.0 * cfg.kv_size() * kvb + cfg.index_head_dim * ikb;

  std::printf("\n# decode: one MoE+MSA layer, context %lld tokens per sequence\n",
              static_cast<long long>(ctx));
  std::printf("%6s %10s %12s %12s %10s %8s\n", "batch", "ms/step", "weights MB", "KV MB", "GB/s",
              "of bw");
  for (int B : batches) {
    const int64_t pages_per_seq = (ctx + 1 + page - 1) / page;
    KvCacheCuda cache(cfg, B * pages_per_seq);
    ForwardBatch b = make_batch(B, ctx, 1, pages_per_seq, cfg.vocab_size);
    m.forward(b, cache, nullptr);  // warm-up (scratch allocation)
    m.forward(b, cache, nullptr);
    // An NVTX range per batch size, so a profiler can take one batch's steps
    // (nsys --cuda-graph-trace=node, ncu --nvtx --nvtx-include "decode b=1/").
    const std::string range = "decode b=" + std::to_string(B);
    nvtxRangePushA(range.c_str());
    const double t0 = now_s();
    for (int i = 0; i < iters; ++i) m.forward(b, cache, nullptr);
    const double dt = (now_s() - t0) / iters;
    nvtxRangePop();
    // Experts read: expected distinct experts among B x top-k picks under uniform routing.
    const double experts = E * (1.0 - std::pow(1.0 - K / E, B));
    const double wbytes = bytes_fixed + experts * per_expert;
    const double blocks = std::min<double>(cfg.sparse_topk_blocks, (ctx + 1.0 + page - 1) / page);
    const double kv_bytes =
        B * (blocks * page * 2.0 * cfg.kv_size() * kvb + (ctx + 1.0) * cfg.index_head_dim * ikb +
             kv_token_bytes /*the new token's write*/);
    std::printf("%6d %10.3f %12.1f %12.1f %10.0f %7.1f%%\n", B, dt * 1e3, wbytes / 1e6,
                kv_bytes / 1e6, (wbytes + kv_bytes) / dt / 1e9,
                100.0 * (wbytes + kv_bytes) / dt / bw);
  }

  if (max_prefill < 8192) return 0;
  std::printf("\n# prefill: one sequence through one MoE+MSA layer\n");
  std::printf("%7s %10s %14s %14s %14s\n", "tokens", "ms", "GEMM+MoE TF", "TFLOP/s (lb)",
              "attn TF");
  for (int64_t T : {int64_t{8192}, int64_t{32768}}) {
    if (T > max_prefill) break;
    const int64_t pages = (T + page - 1) / page;
    KvCacheCuda cache(cfg, pages);
    ForwardBatch b = make_batch(1, 0, static_cast<int>(T), pages, cfg.vocab_size);
    m.forward(b, cache, nullptr);  // warm-up
    const int reps = 3;
    const double t0 = now_s();
    for (int i = 0; i < reps; ++i) m.forward(b, cache, nullptr);
    const double dt = (now_s() - t0) / reps;
    const double gemm_flops = 2.0 * T * (attn_params + E * H /*router*/ + expert_params * (1 + K));
    // Causal MSA: each query attends to min(pos+1, topk*page) keys, 64 heads, QK and PV.
    double keys = 0;
    const double cap = static_cast<double>(cfg.sparse_topk_blocks * page);
    for (int64_t p = 0; p < T; ++p) keys += std::min<double>(p + 1, cap);
    const double attn_flops = 4.0 * keys * cfg.head_dim * cfg.num_attention_heads +
                              2.0 * (T * (T + 1) / 2.0) * cfg.index_head_dim * cfg.index_n_heads;
    std::printf("%7lld %10.2f %14.2f %14.1f %14.2f\n", static_cast<long long>(T), dt * 1e3,
                gemm_flops / 1e12, gemm_flops / dt / 1e12, attn_flops / 1e12);
  }
  return 0;
}

}  // namespace
