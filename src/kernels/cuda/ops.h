// The CUDA (sm_90a) versions of the CPU ops in kernels/cpu/ops.h: same argument lists and
// semantics, plus the stream to launch on. Called by the GPU forward path; tested op by op
// against the CPU ops (tests/kernels/). Invariant: every pointer (including those inside MatRef,
// VecRef, KvPages and TokenLayout) is a device pointer; ops only enqueue work on `stream` (no
// host sync, no allocation) and check each launch. Phase 1: correctness first, simple kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cpu/ops.h"

namespace m3::kernels::cuda {

// The CPU op's views, reused: on this path their data pointers point to device memory.
using cpu::KvPages;
using cpu::MatRef;
using cpu::TokenLayout;
using cpu::VecRef;

// y[n, w.rows] = x[n, w.cols] · wᵀ; fp32 x, bf16 or f32 w, fp32 accumulation (tiled SIMT GEMM;
// cuBLASLt / wgmma come later).
void linear(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream);

// out[i, :] = table[ids[i], :] in fp32. An id out of range traps the kernel (a caller bug).
void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out,
               cudaStream_t stream);

// Gemma RMSNorm: out = x * rsqrt(mean(x²) + eps) * (1 + w), rows x dim; out may alias x.
void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                   float* out, cudaStream_t stream);

// Partial NeoX RoPE in place on x [n, num_heads, head_dim]; inv_freq is computed on the host
// exactly as the CPU op does (fp32), angles as float(pos) * inv_freq. rot_dim <= 2 * kMaxRopeHalf.
inline constexpr int64_t kMaxRopeHalf = 256;
void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta, cudaStream_t stream);

// SwiGLU-OAI over gate/up [n, inter] (see the CPU op).
void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                float limit, float beta, float* out, cudaStream_t stream);

// Sigmoid router top-k: ids [n, k] in descending biased score (ties: lower id), weights the
// renormalised sigmoid scores × scale. One warp per token.
void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias,
                 int64_t k, float scale, int32_t* ids, float* weights, cudaStream_t stream);

// Writes k, v (and ik if non-null) of each token into its cache slot.
void kv_write(const KvPages& cache, const TokenLayout& layout, const float* k, const float* v,
              const float* ik, cudaStream_t stream);

// Causal paged attention, GQA, dense (blocks == null) or over selected blocks
// [num_tokens, num_kv_heads, max_blocks] (-1 padded). One thread block per (token, kv head),
// online softmax in fp32.
void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                     const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                     float scale, float* out, cudaStream_t stream);

// MSA block selection (see the CPU op): out [num_tokens, num_index_heads, topk], ascending,
// -1 padded. One thread block per (token, index head). A sequence may span at most
// kMaxMsaBlocks blocks (the scores live in shared memory); more traps the kernel.
inline constexpr int64_t kMaxMsaBlocks = 16384;
void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                       const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int32_t* out, cudaStream_t stream);

}  // namespace m3::kernels::cuda
