// Multi-GPU decode: `synthetic:layers=L` (M3's real shapes, each rank generating its slices of the
// weights) through the ForwardBackend that `serve --device cuda --tensor-parallel-size N
// [--enable-expert-parallel]` (or `--data-parallel-size N --enable-expert-parallel`) runs, at
// TP1, TP N with and without expert parallel, and DP N + EP; batch 1 and 64, every sequence at
// `ctx` tokens of context, one greedy token per sequence per step sampled on the device.
// Per configuration it prints:
//   - the step time, and (TP) the step time with every collective skipped (the same ranks built
//     with CudaBackendOptions::skip_collectives_for_timing): their difference is the
//     communication's share of the step;
//   - the same collectives timed alone on their own NCCL group (all-reduce of the step's
//     [batch, hidden] f32 activations, 1 + 2 per layer, and the lm_head all-gather), and the
//     all-reduce bus bandwidth of a 256 MiB message: the interconnect ceiling of this run;
//   - the bytes one rank must read per step (its weight slices: attention, dense MLP / shared
//     expert, the expected distinct routed experts under uniform routing, lm_head; plus the KV of
//     its sequences) over the step time, as a fraction of the copy bandwidth of the same run;
//   - with two layer counts (default 4 and 8), the per-MoE-layer time and the step time of the
//     60-layer model extrapolated from them (3 dense + 57 MoE layers).
// Usage: bench_tp [--layers 4,8] [--tp 2] [--batches 1,64] [--ctx 1024] [--steps 24]
//                 [--parallel-eager] [--no-ep] [--no-dp]
// Every rank replays CUDA graphs of decode steps (serve's default); --parallel-eager runs the TP
// and DP ranks eagerly (CudaBackendOptions::parallel_graphs off), TP1 still with graphs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "dist/nccl_communicator.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/ops.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "model/shard.h"
#include "model/synthetic_model.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/sequence_runner.h"

namespace {

using namespace m3;
using model::ForwardBatch;
using model::ForwardResult;
using model::M3Config;
using runtime::SequenceChunk;
using runtime::SequencePages;

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

struct Args {
  std::vector<int> layers = {4, 8}, tps = {2}, batches = {1, 64};
  int ctx = 1024, steps = 24;
  bool graphs = true, ep = true, dp = true;
};

struct Config {
  int tp = 1;  // ranks (tensor parallel, or data parallel when dp)
  bool ep = false;
  bool dp = false;  // attention data parallel (--data-parallel-size)
  std::string name() const {
    if (tp == 1) return "TP1";
    return (dp ? "DP" : "TP") + std::to_string(tp) + (ep ? "+EP" : "");
  }
};

// Bytes rank 0 reads in one decode step of `B` sequences at `ctx` tokens (bf16 weights, f32
// router and KV), from its shard plan.
double step_bytes(const M3Config& c, const model::ShardPlan& p, int B, int64_t ctx) {
  const double h = c.hidden_size, d = c.head_dim, di = c.index_head_dim;
  const double E = c.num_local_experts, K = c.num_experts_per_tok;
  const bool tp = p.tensor_sharded();
  // Data parallel: a rank runs its own sequences (half of them at DP2) with whole attention.
  const double seqs = p.data_sharded() ? std::ceil(static_cast<double>(B) / p.world) : B;
  double bytes = p.vocab_count * h * 2;  // lm_head rows
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool sparse = c.layer_is_sparse[l];
    const double ni = sparse ? (tp ? p.num_kv_heads : c.index_n_heads) : 0;
    bytes +=
        ((p.num_q_heads * 2.0 + 2.0 * p.num_kv_heads) * d + (sparse ? (ni + 1) * di : 0)) * h * 2;
    // KV read per sequence: all keys (dense layers) or the selected blocks (MSA), plus index-K.
    const double keys =
        sparse ? std::min<double>(ctx + 1.0, c.sparse_topk_blocks * c.sparse_block_size)
               : ctx + 1.0;
    bytes += seqs * (keys * 2 * p.num_kv_heads * d * 4 + (sparse ? (ctx + 1.0) * di * 4 : 0));
    if (!c.layer_is_moe[l]) {
      bytes += 3.0 * p.dense_inter * h * 2;
      continue;
    }
    bytes += E * h * 4 + 3.0 * p.shared_inter * h * 2;
    // Expected distinct experts among B x top-k uniform picks (every rank's tokens reach every
    // rank's experts, under TP and DP alike); a rank holds 1/W of them (EP) or 1/W of each.
    const double distinct = E * (1.0 - std::pow(1.0 - K / E, B));
    const double mine = p.expert_parallel ? distinct * p.num_experts / E : distinct;
    bytes += mine * 3.0 * p.expert_inter * h * 2;
  }
  return bytes;
}

struct Row {
  std::string config;
  int tp = 1;
  bool dp = false;
  int layers = 0, batch = 0;
  double ms = 0, ms_nocomm = 0, bytes = 0;
};

// Mean wall time of a decode step (ms): B sequences prefilled with `ctx` tokens, then `steps`
// timed steps of one token each (after 3 untimed ones: graph capture happens on the second).
double decode_ms(runtime::ForwardBackend& be, int B, int ctx, int steps) {
  const M3Config& cfg = be.config();
  SequencePages pages(be.num_pages(), cfg.sparse_block_size);
  std::vector<int> seqs;
  std::vector<std::vector<int32_t>> prompts(B);
  for (int s = 0; s < B; ++s) {
    seqs.push_back(pages.add_sequence());
    for (int t = 0; t < ctx; ++t) prompts[s].push_back((7919 * t + 104729 * s + 1) % 200000);
  }
  // Prefill in steps of up to 8K tokens, with bf16 GEMMs (fast; the decode runs exact).
  kernels::cuda::set_gemm_precision(kernels::cuda::GemmPrecision::kBf16);
  ForwardResult r;
  for (int s0 = 0; s0 < B;) {
    std::vector<SequenceChunk> chunks;
    int64_t tokens = 0;
    for (; s0 < B && (chunks.empty() || tokens + ctx <= 8192); ++s0) {
      chunks.push_back({seqs[s0], prompts[s0], false});
      tokens += ctx;
    }
    ForwardBatch b = pages.build_step(chunks);
    be.forward(b, &r, false);
  }
  kernels::cuda::set_gemm_precision(kernels::cuda::GemmPrecision::kExact);
  std::vector<int32_t> feed(B, 17);
  double total = 0;
  for (int i = 0; i < steps + 3; ++i) {
    std::vector<SequenceChunk> chunks;
    for (int s = 0; s < B; ++s)
      chunks.push_back({seqs[s], std::span<const int32_t>(&feed[s], 1), false});
    ForwardBatch b = pages.build_step(chunks);
    for (int32_t row = 0; row < B; ++row) {
      kernels::cpu::SampleRow sr;
      sr.row = row;
      sr.temperature = 0.f;
      b.device_samples.push_back(sr);
    }
    const double t0 = bench::now_s();
    be.forward(b, &r, false);
    if (i >= 3) total += bench::now_s() - t0;
    for (int s = 0; s < B && s < static_cast<int>(r.sampled.size()); ++s)
      feed[s] = std::clamp(r.sampled[s], 0, 199999);
  }
  return total / steps * 1e3;
}

std::unique_ptr<runtime::ForwardBackend> make_backend(const Args& a, const Config& c, int layers,
                                                      int total_seqs, bool skip_comm) {
  auto host = model::M3Model::load("synthetic:layers=" + std::to_string(layers));
  if (!host) {
    std::fprintf(stderr, "bench_tp: %s\n", host.error().message.c_str());
    std::exit(1);
  }
  const M3Config cfg = (*host)->config();
  runtime::CudaBackendOptions opts;
  const int64_t pages = SequencePages::pages_needed(int64_t{a.ctx + a.steps + 8} * total_seqs,
                                                    total_seqs, cfg.sparse_block_size);
  // Every batch size gets its own sequences (decode_ms): room for all of them. Whole-head page
  // bytes, so a TP rank gets at least as many pages.
  opts.kv_cache_memory_bytes = pages * model::KvCache::page_bytes(cfg);
  opts.synthetic_seed = 1;
  opts.parallel_graphs = a.graphs;
  opts.skip_collectives_for_timing = skip_comm;
  opts.dp_kv_partitions = false;  // SequencePages hands out one page-id space (no partitions)
  auto be = c.tp == 1 ? runtime::make_cuda_backend(std::move(*host), opts)
            : c.dp    ? runtime::make_cuda_data_parallel_backend(std::move(*host), opts, c.tp, c.ep)
                      : runtime::make_cuda_sharded_backend(std::move(*host), opts, c.tp, c.ep);
  if (!be) {
    std::fprintf(stderr, "bench_tp: %s %d layers: %s\n", c.name().c_str(), layers,
                 be.error().message.c_str());
    std::exit(1);
  }
  return std::move(*be);
}

// The collectives alone on a fresh NCCL group of `tp` GPUs: mean ms of an all-reduce of `n` f32
// (rank 0's stream), and of an all-gather of `g` f32 per rank.
struct CommTimes {
  std::map<int, double> all_reduce_ms, all_gather_ms;  // by batch
  double busbw = 0;                                    // all-reduce, 256 MiB message
};

CommTimes time_collectives(int tp, const std::vector<int>& batches, int64_t hidden,
                           int64_t vocab_chunk) {
  CommTimes out;
  auto id = dist::make_nccl_unique_id();
  if (!id) {
    std::fprintf(stderr, "bench_tp: %s\n", id.error().message.c_str());
    std::exit(1);
  }
  std::vector<std::thread> th;
  for (int r = 0; r < tp; ++r) {
    th.emplace_back([&, r] {
      auto comm = dist::NcclCommunicator::create(r, tp, r, *id);
      if (!comm) {
        std::fprintf(stderr, "bench_tp: %s\n", comm.error().message.c_str());
        std::exit(1);
      }
      cudaStream_t s = (*comm)->stream();
      const int64_t big = int64_t{64} << 20;  // 256 MiB of f32
      gpu::DeviceBuffer<float> buf(
          static_cast<size_t>(std::max<int64_t>(big, 64 * vocab_chunk * tp)));
      M3_CUDA_CHECK(cudaMemset(buf.data(), 0, buf.size() * sizeof(float)));
      for (int B : batches) {
        const int64_t n = B * hidden;
        const double ar = bench::time_ms(s, 200, [&] { (*comm)->all_reduce_sum(buf.data(), n); });
        const int64_t g = B * vocab_chunk;
        const double ag =
            bench::time_ms(s, 50, [&] { (*comm)->all_gather(buf.data(), g, buf.data() + g); });
        if (r == 0) {
          out.all_reduce_ms[B] = ar;
          out.all_gather_ms[B] = ag;
        }
      }
      const double t = bench::time_ms(s, 10, [&] { (*comm)->all_reduce_sum(buf.data(), big); });
      if (r == 0) out.busbw = 2.0 * (tp - 1) / tp * big * 4.0 / (t * 1e-3);
      (*comm)->barrier();
    });
  }
  for (auto& t : th) t.join();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_tp: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--layers")
      a.layers = parse_list(val());
    else if (k == "--tp")
      a.tps = parse_list(val());
    else if (k == "--batches")
      a.batches = parse_list(val());
    else if (k == "--ctx")
      a.ctx = std::atoi(val());
    else if (k == "--steps")
      a.steps = std::atoi(val());
    else if (k == "--parallel-eager")
      a.graphs = false;
    else if (k == "--no-ep")
      a.ep = false;
    else if (k == "--no-dp")
      a.dp = false;
    else {
      std::fprintf(stderr,
                   "usage: bench_tp [--layers 4,8] [--tp 2] [--batches 1,64] [--ctx 1024] "
                   "[--steps 24] [--parallel-eager] [--no-ep] [--no-dp]\n");
      return 2;
    }
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    std::fprintf(stderr, "bench_tp: no usable GPU\n");
    return 1;
  }
  auto dev = gpu::probe_device(0);
  if (!dev) {
    std::fprintf(stderr, "bench_tp: %s\n", dev.error().message.c_str());
    return 1;
  }
  const double bw = bench::copy_bandwidth();
  std::printf(
      "device: %d x %s; copy bandwidth (read+write) %.0f GB/s per GPU; context %d "
      "tokens per sequence; TP / DP ranks %s\n",
      gpus, dev->name.c_str(), bw / 1e9, a.ctx,
      a.graphs ? "replay CUDA graphs (serve's default)" : "run eagerly (--parallel-eager)");
  std::vector<Config> configs = {{1, false}};
  for (int tp : a.tps) {
    if (tp < 2) continue;
    if (tp > gpus) {
      std::printf("(TP%d skipped: %d GPUs visible)\n", tp, gpus);
      continue;
    }
    configs.push_back({tp, false, false});
    if (a.ep) configs.push_back({tp, true, false});
    if (a.dp) configs.push_back({tp, true, true});  // the recipe's DP + EP deployment
  }
  int total_seqs = 0;
  for (int B : a.batches) total_seqs += B;
  std::vector<Row> rows;
  std::map<int, CommTimes> comm;
  for (const Config& c : configs) {
    for (int L : a.layers) {
      const M3Config cfg = model::synthetic_m3_config(L);
      model::ShardSpec spec;
      spec.world = c.tp;
      spec.expert_parallel = c.ep;
      spec.data_parallel = c.dp;
      const model::ShardPlan plan = *model::make_shard_plan(cfg, spec);
      std::map<int, double> with, without;
      for (bool skip : {false, true}) {
        if (skip && (c.tp == 1 || c.dp)) break;  // DP collectives cannot be skipped
        auto be = make_backend(a, c, L, total_seqs, skip);
        for (int B : a.batches) (skip ? without : with)[B] = decode_ms(*be, B, a.ctx, a.steps);
      }
      for (int B : a.batches) {
        rows.push_back({c.name(), c.tp, c.dp, L, B, with[B],
                        without.count(B) ? without[B] : with[B], step_bytes(cfg, plan, B, a.ctx)});
        const Row& r = rows.back();
        std::printf(
            "%-7s layers %2d batch %3d: %8.3f ms/step (%.0f tok/s), no-comm %8.3f ms, "
            "rank reads %.2f GB = %.1f%% of copy bw\n",
            r.config.c_str(), L, B, r.ms, B / (r.ms * 1e-3), r.ms_nocomm, r.bytes / 1e9,
            100.0 * r.bytes / (r.ms * 1e-3) / bw);
        std::fflush(stdout);
      }
    }
    if (c.tp > 1 && !c.dp && !comm.count(c.tp)) {
      const M3Config cfg = model::synthetic_m3_config(4);
      model::ShardSpec spec;
      spec.world = c.tp;
      comm[c.tp] = time_collectives(c.tp, a.batches, cfg.hidden_size,
                                    model::make_shard_plan(cfg, spec)->vocab_chunk);
    }
  }

  std::printf("\n# decode step, %d tokens of context per sequence\n", a.ctx);
  std::printf("%-7s %6s %5s %10s %9s %10s %8s %12s %9s\n", "config", "layers", "batch", "ms/step",
              "tok/s", "no-comm ms", "comm %", "isolated ms", "of bw");
  for (const Row& r : rows) {
    double iso = 0;
    if (auto it = comm.find(r.tp); it != comm.end() && !r.dp) {
      iso = (1 + 2 * r.layers) * it->second.all_reduce_ms[r.batch] +
            it->second.all_gather_ms[r.batch];
    }
    std::printf("%-7s %6d %5d %10.3f %9.0f %10.3f %7.1f%% %12.3f %8.1f%%\n", r.config.c_str(),
                r.layers, r.batch, r.ms, r.batch / (r.ms * 1e-3), r.ms_nocomm,
                100.0 * (r.ms - r.ms_nocomm) / r.ms, iso, 100.0 * r.bytes / (r.ms * 1e-3) / bw);
  }
  for (const auto& [tp, t] : comm) {
    std::printf("TP%d collectives alone:", tp);
    for (const auto& [B, ms] : t.all_reduce_ms)
      std::printf(" all-reduce [%d x hidden] %.1f us, lm_head all-gather %.1f us;", B, ms * 1e3,
                  t.all_gather_ms.at(B) * 1e3);
    std::printf(" all-reduce bus bandwidth (256 MiB) %.0f GB/s\n", t.busbw / 1e9);
  }
  if (a.layers.size() == 2 && a.layers[1] > a.layers[0] && a.layers[0] >= 4) {
    // Layers past the third are MoE + MSA: their per-layer time is the slope between the two
    // layer counts; the 60-layer model has 57 of them.
    const int L0 = a.layers[0], L1 = a.layers[1];
    std::printf("\n# extrapolated to MiniMax-M3's 60 layers (3 dense + 57 MoE)\n");
    std::printf("%-7s %5s %14s %14s %10s %12s\n", "config", "batch", "ms/MoE layer",
                "comm ms/layer", "ms/step", "tok/s");
    for (const Row& r0 : rows) {
      if (r0.layers != L0) continue;
      for (const Row& r1 : rows) {
        if (r1.layers != L1 || r1.config != r0.config || r1.batch != r0.batch) continue;
        const double per = (r1.ms - r0.ms) / (L1 - L0);
        const double per_nc = (r1.ms_nocomm - r0.ms_nocomm) / (L1 - L0);
        const double full = r1.ms + (60 - L1) * per;
        std::printf("%-7s %5d %14.3f %14.3f %10.2f %12.0f\n", r0.config.c_str(), r0.batch, per,
                    per - per_nc, full, r0.batch / (full * 1e-3));
      }
    }
  }
  return 0;
}
