// The CPU ops of the M3 forward pass: the reference the CUDA ops are tested against, and what CI
// and GPU-less machines run. Called by model/m3_model.cpp once per layer per step.
// Conventions: activations are fp32 row-major; weights are read in place from the checkpoint
// mapping as bf16 or f32 (MatRef/VecRef); every reduction accumulates in fp32. Ops are
// multithreaded over the process pool (core/thread_pool.h) and deterministic for a given input.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace m3::kernels::cpu {

// A weight matrix [rows = out_features, cols = in_features], row-major (PyTorch Linear layout).
struct MatRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;  // kBF16 or kF32
  int64_t rows = 0;
  int64_t cols = 0;
  // Row `r` as a MatRef of one row (for slicing fused matrices).
  MatRef slice_rows(int64_t begin, int64_t count) const;
};

// A weight vector (norm weights, biases), bf16 or f32.
struct VecRef {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
  int64_t n = 0;
  float at(int64_t i) const;
  void to_f32(float* out) const;
};

// ---- dense linear algebra ----
// y[n, w.rows] = x[n, w.cols] · wᵀ, fp32 accumulation.
void linear(const float* x, int64_t n, const MatRef& w, float* y);

// out[i, :] = table[ids[i], :] (converted to fp32). ids must be in range (checked by callers).
void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out);

// ---- normalisation ----
// Gemma RMSNorm over the last dim: out = x * rsqrt(mean(x²) + eps) * (1 + w). rows x dim.
// out may alias x. Also used per head (rows = tokens*heads, dim = head_dim).
void rmsnorm_gemma(const float* x, int64_t rows, int64_t dim, const VecRef& w, float eps,
                   float* out);

// ---- rotary embedding ----
// Partial NeoX RoPE in place on x [n, num_heads, head_dim]: the first rot_dim dims of each
// head rotate as halves (x1 = [0, rot/2), x2 = [rot/2, rot)); the rest pass through.
// inv_freq[i] = 1 / theta^(2i/rot_dim) and angles are computed in fp32 (m3-model.md §3.5).
void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta);

// ---- MLP ----
// SwiGLU-OAI: out = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, ±limit) + beta)
// with g = gate, u = up, each [n, inter] (M3's gate and up are separate, non-interleaved).
void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                float limit, float beta, float* out);

// ---- MoE routing ----
// Sigmoid router: s = sigmoid(logits); experts chosen by top-k of s + bias (bias may be null);
// weights = s of the chosen, renormalised to sum 1, times `scale`. Ties pick the lower expert id.
// logits [n, num_experts] f32 -> ids [n, k], weights [n, k].
void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias,
                 int64_t k, float scale, int32_t* ids, float* weights);

// ---- paged KV cache + attention ----
// Per-layer cache storage, fp32 on the CPU. A page holds `page_size` tokens.
struct KvPages {
  float* k = nullptr;   // [num_pages, page_size, num_kv_heads, head_dim]
  float* v = nullptr;   // [num_pages, page_size, num_kv_heads, head_dim]
  float* ik = nullptr;  // [num_pages, page_size, index_dim] (sparse layers only, else null)
  int64_t num_pages = 0;
  int64_t page_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t index_dim = 0;
};

// Where each token of a step lives: sequence, absolute position, and the sequences' block tables
// in CSR form (block_table[block_table_offsets[s] + b] = physical page of logical block b).
struct TokenLayout {
  int64_t num_tokens = 0;
  const int32_t* positions = nullptr;            // [num_tokens]
  const int32_t* seq_ids = nullptr;              // [num_tokens]
  const int32_t* block_table_offsets = nullptr;  // [num_seqs + 1]
  const int32_t* block_table = nullptr;          // [block_table_offsets[num_seqs]]
};

// Writes k, v [num_tokens, num_kv_heads, head_dim] (and ik [num_tokens, index_dim] if non-null)
// into the slots of their positions.
void kv_write(const KvPages& cache, const TokenLayout& layout, const float* k, const float* v,
              const float* ik);

// Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache, GQA with
// num_heads / num_kv_heads query heads per KV head. `blocks` selects the logical blocks per
// (token, kv head): [num_tokens, num_kv_heads, max_blocks] with -1 padding; null means every
// block up to the token's position (dense). Keys j <= position only. out: [num_tokens,
// num_heads, head_dim]. Softmax and accumulation in fp32.
void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                     const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                     float scale, float* out);

// MSA block selection (m3-model.md §4.3-4.4) for iq [num_tokens, num_index_heads, index_dim]
// against the index-K pages. For each token at position p (nb = p / page_size + 1 blocks) and
// index head g: if nb <= topk every block 0..nb-1 is selected; else the forced blocks (the first
// `init_blocks` and the last `local_blocks`) plus the best-scoring others by
// max_{j in block} <iq, ik_j> (ties: lower block id). out [num_tokens, num_index_heads, topk],
// ascending block ids, -1 padded.
void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                       const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int32_t* out);

// ---- output ----
// log_softmax over each row of logits [n, vocab] into out (may alias).
void log_softmax(const float* logits, int64_t n, int64_t vocab, float* out);

}  // namespace m3::kernels::cpu
