// Dense causal prefill attention through FlashInfer's Hopper kernel (FA3-class: TMA for Q,
// wgmma, warp-specialised producer / consumers; `flashinfer-python`'s headers with the CUTLASS it
// bundles, a build-time dependency: docs/KV_CACHE.md, tools/gpu_deps.sh). Used for the prefill
// runs of a step when the cache is bf16, head_dim 128 and the build has the headers
// (M3_FLASHINFER); otherwise the query-tiled kernel of attn_prefill.cu serves them.
// A FlashPrefill gets the step's runs on the host, plans them at the first dense layer
// (FlashInfer's SM90 work scheduler: longest-processing-time first onto persistent CTAs) and
// runs every dense layer of the step from that plan: q (fp32, the run rows) is gathered into a bf16
// buffer, FlashInfer attends over the paged K/V in place (our block table is its page-index list),
// and the bf16 output is scattered back into the fp32 output rows. Invariant: plan() and run() are
// called outside CUDA-graph capture (the plan copies to the device and buffers may grow); the owner
// syncs the stream between steps (the pinned plan buffer is reused).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::kernels::cuda {

// Whether this build has FlashInfer's kernel.
bool flash_prefill_built();

class FlashPrefill {
 public:
  // One run: the tokens [first_token, first_token + num_tokens) of the batch, all of one
  // sequence at consecutive positions kv_len - num_tokens .. kv_len - 1, whose pages start at
  // block_table[page_offset].
  struct Run {
    int32_t first_token, num_tokens, kv_len, page_offset;
  };
  FlashPrefill();
  ~FlashPrefill();
  FlashPrefill(const FlashPrefill&) = delete;
  FlashPrefill& operator=(const FlashPrefill&) = delete;

  // The step's runs (host); the FlashInfer plan follows at the first run() of each geometry. An
  // empty list clears them.
  void set_runs(const std::vector<Run>& runs, cudaStream_t stream);
  bool has_runs() const;
  // Whether run() serves this cache: bf16 K/V, head_dim 128, runs set.
  bool serves(const KvPages& c) const;
  // out rows of the runs' tokens = causal attention of q over the paged cache.
  void run(const float* q, int64_t num_heads, const KvPages& c, const TokenLayout& L, float scale,
           float* out, cudaStream_t stream);

  struct Impl;  // attn_flash.cu

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::kernels::cuda
