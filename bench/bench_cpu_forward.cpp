// CPU forward-pass throughput: prefill tokens/s and decode tokens/s (batch 1 and 8) of a model
// directory, next to the machine's ceilings measured in the same run (a streaming read of a
// large buffer for bytes/s, and an fp32 FMA loop for FLOP/s).
// Usage: bench_cpu_forward MODEL_DIR [prefill_len=512] [decode_steps=32]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "model/m3_model.h"
#include "runtime/sequence_runner.h"

using Clock = std::chrono::steady_clock;

static double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Read bandwidth over all threads: sum a 512 MiB buffer.
static double measure_read_bw() {
  const size_t n = (size_t{512} << 20) / sizeof(float);
  std::vector<float> buf(n, 1.0f);
  std::vector<double> partial(m3::cpu_pool().num_threads() * 4, 0.0);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    std::atomic<int> slot{0};
    m3::parallel_for(
        static_cast<int64_t>(n),
        [&](int64_t b, int64_t e) {
          float acc[8] = {0};
          for (int64_t i = b; i + 8 <= e; i += 8)
            for (int l = 0; l < 8; ++l) acc[l] += buf[i + l];
          partial[slot++ % partial.size()] += acc[0] + acc[7];
        },
        1 << 16);
    best = std::max(best, n * sizeof(float) / seconds_since(t0));
  }
  if (partial[0] < 0) std::printf("?");
  return best;
}

// fp32 FMA throughput over all threads (8 independent accumulator lanes x 4 chains).
static double measure_flops() {
  const int64_t iters = 20'000'000;
  const int threads = m3::cpu_pool().num_threads();
  std::vector<float> sink(threads * 4 * 64, 0.f);
  auto t0 = Clock::now();
  m3::parallel_for(threads * 4, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      float a[32];
      for (int l = 0; l < 32; ++l) a[l] = 1.0f + l * 1e-3f;
      const float m = 0.999999f, c = 1e-7f;
      for (int64_t i = 0; i < iters / 4; ++i)
        for (int l = 0; l < 32; ++l) a[l] = a[l] * m + c;
      for (int l = 0; l < 32; ++l) sink[w * 64 + l] = a[l];
    }
  });
  const double t = seconds_since(t0);
  return 2.0 * 32 * (iters / 4) * threads * 4 / t;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [prefill_len] [decode_steps]\n", argv[0]);
    return 2;
  }
  const int prefill_len = argc > 2 ? std::atoi(argv[2]) : 512;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 32;
  auto m = m3::model::M3Model::load(argv[1]);
  if (!m) {
    std::fprintf(stderr, "error: %s\n", m.error().message.c_str());
    return 1;
  }
  const auto& cfg = (*m)->config();
  std::mt19937 g(1);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  std::printf("model: %s\nthreads: %d\n", cfg.summary().c_str(), m3::cpu_pool().num_threads());
  const double bw = measure_read_bw();
  const double flops = measure_flops();
  std::printf("ceiling: read bandwidth %.1f GB/s, fp32 FMA %.1f GFLOP/s\n", bw / 1e9, flops / 1e9);

  const double weight_bytes =
      static_cast<double>((*m)->weights().bytes_in_place + (*m)->weights().bytes_owned);
  for (int batch : {1, 8}) {
    m3::runtime::SequenceRunner r(**m, static_cast<int64_t>(batch) * (prefill_len + steps + 1),
                                  batch);
    std::vector<int> seqs;
    std::vector<std::vector<int32_t>> prompts(batch);
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(r.add_sequence());
      for (int i = 0; i < prefill_len; ++i) prompts[b].push_back(tok(g));
    }
    auto t0 = Clock::now();
    for (int b = 0; b < batch; ++b) r.step({{seqs[b], prompts[b], false}});
    const double tp = seconds_since(t0);
    std::vector<int32_t> next(batch, 1);
    t0 = Clock::now();
    for (int s = 0; s < steps; ++s) {
      std::vector<m3::runtime::SequenceRunner::Chunk> chunks;
      for (int b = 0; b < batch; ++b)
        chunks.push_back({seqs[b], std::span<const int32_t>(&next[b], 1), false});
      auto out = r.step(chunks);
      for (int b = 0; b < batch; ++b) {
        const float* row = out.logits.data() + static_cast<int64_t>(b) * cfg.vocab_size;
        next[b] = static_cast<int32_t>(std::max_element(row, row + cfg.vocab_size) - row);
      }
    }
    const double td = seconds_since(t0);
    std::printf(
        "batch %d: prefill %d tokens x %d: %.1f tokens/s | decode %d steps: %.1f tokens/s, "
        "%.2f ms/step, all weight bytes / step time %.2f GB/s (%.0f%% of the read ceiling)\n",
        batch, prefill_len, batch, batch * prefill_len / tp, steps, batch * steps / td,
        1e3 * td / steps, weight_bytes * steps / td / 1e9, 100.0 * weight_bytes * steps / td / bw);
  }
  return 0;
}
