// Scaffolding shared by the multi-GPU tests (tp_cuda_test.cpp, dp_cuda_test.cpp): the 2-GPU
// skip, loading a golden checkpoint or a synthetic spec, a reference backend and a sharded one
// driven by the same batches, logprob / greedy-margin helpers, and the teacher-forced comparison
// at M3's real shapes (synthetic:layers=4) both tests run. Header-only.
// Invariant: BackendPair's two backends always see identical batches (one SequencePages).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "core/check.h"
#include "model/golden_util.h"
#include "model/kv_cache.h"
#include "model/m3_model.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/forward_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model::multi_gpu {

using namespace m3::runtime;  // backends and the sequence runner

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define SKIP_UNLESS_TWO_GPUS()                                        \
  do {                                                                \
    const int n_ = ::m3::model::multi_gpu::gpu_count();               \
    if (n_ < 2) GTEST_SKIP() << "needs 2 GPUs, " << n_ << " visible"; \
  } while (0)

// A golden checkpoint by name, or a `synthetic:...` spec (config only: GPU ranks generate their
// weights).
inline std::unique_ptr<M3Model> load(const std::string& name) {
  const bool synthetic = name.rfind("synthetic:", 0) == 0;
  auto m = M3Model::load(synthetic ? name : golden::root() + "/" + name);
  M3_CHECK(m.has_value(), "%s", m ? "" : m.error().message.c_str());
  return std::move(*m);
}

enum class Split { kTensor, kData };

// A backend over `name` (load()): one GPU when ranks == 1, else `ranks` tensor- or data-parallel
// ranks (expert parallel when ep). `pages` whole-head pages of KV per GPU (a TP rank's pages are
// smaller, so it gets at least as many); DP ranks share one page-id space (the test drives pages
// with SequencePages). Synthetic weights from seed 5. graphs: decode steps replay CUDA graphs.
inline std::unique_ptr<ForwardBackend> make_backend(const std::string& name, int ranks, Split split,
                                                    bool ep, int64_t pages, bool graphs) {
  auto host = load(name);
  CudaBackendOptions opts;
  opts.kv_cache_memory_bytes = pages * KvCache::page_bytes(host->config());
  opts.enforce_eager = !graphs;
  opts.parallel_graphs = graphs;
  opts.synthetic_seed = 5;
  opts.dp_kv_partitions = false;
  auto be = ranks == 1 ? make_cuda_backend(std::move(host), opts)
            : split == Split::kTensor
                ? make_cuda_sharded_backend(std::move(host), opts, ranks, ep)
                : make_cuda_data_parallel_backend(std::move(host), opts, ranks, ep);
  M3_CHECK(be.has_value(), "%s", be ? "" : be.error().message.c_str());
  return std::move(*be);
}

// max |logprob got - want| over every row and vocabulary entry; fails on a shape mismatch.
inline double max_logprob_diff(const ForwardResult& got, const ForwardResult& want, int64_t V) {
  EXPECT_EQ(got.logits.size(), want.logits.size());
  if (got.logits.size() != want.logits.size()) return 1e9;
  const auto a = golden::log_softmax_rows(got.logits, V),
             b = golden::log_softmax_rows(want.logits, V);
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max<double>(m, std::fabs(a[i] - b[i]));
  return m;
}

// The top-2 logit margin of row r of `logits` (logits and logprobs differ by a constant).
inline double top2_margin(const std::vector<float>& logits, int64_t r, int64_t V) {
  std::vector<float> row(logits.begin() + r * V, logits.begin() + (r + 1) * V);
  std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
  return static_cast<double>(row[0]) - row[1];
}

// A reference backend (one GPU) and a sharded one, driven by the same batches.
struct BackendPair {
  std::unique_ptr<ForwardBackend> ref, test;
  std::unique_ptr<SequencePages> pages;

  BackendPair(std::unique_ptr<ForwardBackend> r, std::unique_ptr<ForwardBackend> t)
      : ref(std::move(r)), test(std::move(t)) {
    pages = std::make_unique<SequencePages>(std::min(ref->num_pages(), test->num_pages()),
                                            test->config().sparse_block_size);
  }
  const M3Config& config() const { return test->config(); }

  struct Out {
    ForwardBatch batch;
    ForwardResult want, got;  // reference, sharded
  };
  // greedy_on_device: every logits row sampled greedily on the device, every row still copied.
  Out step(const std::vector<SequenceChunk>& chunks, bool capture = false,
           bool greedy_on_device = false) {
    Out o;
    o.batch = pages->build_step(chunks);
    if (greedy_on_device) {
      for (int32_t r = 0; r < static_cast<int32_t>(o.batch.logits_indices.size()); ++r) {
        kernels::cpu::SampleRow sr;
        sr.row = r;
        sr.temperature = 0.f;
        o.batch.device_samples.push_back(sr);
        o.batch.host_logits_rows.push_back(r);
      }
    }
    ref->forward(o.batch, &o.want, capture);
    test->forward(o.batch, &o.got, capture);
    return o;
  }
};

// Token ids of a fixed pseudo-random prompt (a 64-bit LCG; ids below 200000).
inline std::vector<int32_t> lcg_prompt(size_t n, uint64_t& state) {
  std::vector<int32_t> v(n);
  for (auto& t : v) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    t = static_cast<int32_t>((state >> 33) % 200000);
  }
  return v;
}

// synthetic:layers=4 through `p` (sharded vs one GPU): one batch of a 300- and a 170-token
// prefill (the per-expert MoE path), then 11 decode steps of both (the grouped path, graphs when
// on), the reference's greedy tokens fed to both (teacher forcing). Every logprob within `tol`;
// the sharded backend's device-greedy tokens equal the reference's wherever its top-2 margin is
// above 2 * tol. `after_prefill` may check the prefill step (e.g. which rank ran what).
inline void expect_synthetic_decode_matches(
    BackendPair& p, double tol, const std::string& label,
    const std::function<void(const BackendPair::Out&)>& after_prefill = nullptr) {
  const int64_t V = p.config().vocab_size;
  uint64_t state = 99;
  const std::vector<int32_t> pa = lcg_prompt(300, state), pb = lcg_prompt(170, state);
  const int a = p.pages->add_sequence(), b = p.pages->add_sequence();
  auto o = p.step({{a, pa, false}, {b, pb, false}});
  if (after_prefill) after_prefill(o);
  double worst = 0;
  int64_t compared = 0;
  for (int step = 0; step < 12; ++step) {
    ASSERT_EQ(o.got.logits.size(), 2 * static_cast<size_t>(V)) << label << " step " << step;
    const double e = max_logprob_diff(o.got, o.want, V);
    worst = std::max(worst, e);
    ASSERT_LT(e, tol) << label << " step " << step;
    std::vector<int32_t> feed(2);
    for (int r = 0; r < 2; ++r) {
      const auto row = o.want.logits.begin() + r * V;
      feed[r] = static_cast<int32_t>(std::max_element(row, row + V) - row);
      if (step > 0 && top2_margin(o.want.logits, r, V) > 2 * tol) {
        ASSERT_EQ(o.got.sampled.size(), 2u) << label;
        EXPECT_EQ(o.got.sampled[r], feed[r]) << label << " step " << step << " row " << r;
        ++compared;
      }
    }
    o = p.step({{a, std::span<const int32_t>(&feed[0], 1), false},
                {b, std::span<const int32_t>(&feed[1], 1), false}},
               false, true);
  }
  EXPECT_GT(compared, 10) << label;
  std::printf("  %s on %s: max |logprob - one GPU| %.3g, %lld device-greedy tokens compared\n",
              label.c_str(), p.test->device_name().c_str(), worst,
              static_cast<long long>(compared));
}

}  // namespace m3::model::multi_gpu
