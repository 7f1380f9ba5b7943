// The CPU ops of the M3 forward pass: the reference the CUDA ops are tested against, and what CI
// and GPU-less machines run. Called by the one forward (model/m3_forward.h, through
// model/cpu_ops.h) once per layer per step. Every CUDA op in kernels/cuda has its twin here with
// the same name and arguments less the stream (the fused ones in kernels/cpu/fused.h).
// Conventions: activations are fp32 row-major; weights are read in place from the checkpoint
// mapping as bf16 or f32 (MatRef/VecRef); every reduction accumulates in fp32. Ops are
// multithreaded over the process pool (core/thread_pool.h) and deterministic for a given input.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "kernels/views.h"

namespace m3::kernels::cpu {

// The device-neutral views (kernels/views.h): on this path they point to host memory.
using kernels::AttnPrepArgs;
using kernels::KvPages;
using kernels::MatRef;
using kernels::MoeExpertWeights;
using kernels::SwigluParams;
using kernels::TokenLayout;
using kernels::VecRef;
using kernels::Workspace;

// ---- dense linear algebra ----
// y[n, w.rows] = x[n, w.cols] · wᵀ, fp32 accumulation. w in any format of kernels/views.h
// (WeightQuant): rows are dequantised exactly (dequantize_row) before the fp32 dot products.
void linear(const float* x, int64_t n, const MatRef& w, float* y);

// Row r of w as f32 [w.cols], by its format's definition (kernels/views.h WeightQuant): the
// reference dequantisation every quantized op is compared against.
void dequantize_row(const MatRef& w, int64_t r, float* out);

// Per-token dynamic FP8 activations (the input of the GPU's FP8 GEMM, kernels/cuda/quant.h
// fp8_linear): row t of x [n, k] gets scale[t] = amax_t / 448 (1 for an all-zero row) and codes
// q[t, c] = e4m3(x[t, c] / scale[t]), rounded to nearest even and saturating (f32_to_fp8_e4m3),
// so q[t, c] * scale[t] is x to 2^-4 relative (e4m3's 3 mantissa bits) above e4m3's normals.
void quantize_fp8_per_token(const float* x, int64_t n, int64_t k, uint8_t* q, float* scale);

// out[i, :] = table[ids[i], :] (converted to fp32). An id outside the table aborts.
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
// The same with a context extension (kernels::RopeScaling: YaRN frequencies, cos and sin scaled
// by its attention_factor).
void rope_neox(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, double theta, const RopeScaling& scaling);

// ---- MLP ----
// SwiGLU-OAI: out = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, ±limit) + beta)
// with g = gate, u = up, each [n, inter] (M3's gate and up are separate, non-interleaved).
void swiglu_oai(const float* gate, const float* up, int64_t n, int64_t inter, float alpha,
                float limit, float beta, float* out);

// ---- MoE routing ----
// Sigmoid router: s = sigmoid(logits); experts chosen by top-k of s + bias (bias may be null);
// weights = s of the chosen, renormalised to sum 1, times `scale`. Ties pick the lower expert id.
// logits [n, num_experts] f32 -> ids [n, k], weights [n, k].
void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias, int64_t k,
                 float scale, int32_t* ids, float* weights);

// ---- paged KV cache + attention ----
// KvPages (kernels/views.h): per-layer cache storage, fp32. TokenLayout: where each token of a
// step lives (positions, sequences, CSR block tables).

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

// ---- MoE experts and expert parallelism (moe_experts.cpp) ----
// Expert parallel: ids [n] of global expert ids -> this rank's local ids (id - first for ids in
// [first, first + count)), -1 for every other expert, in place.
void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count);

// out[t] = shared[t] (if non-null) + the sum over t's k routed experts, in ascending expert id,
// of weights[t, j] * down(swiglu_oai(gate(x[t]), up(x[t]))): ids/weights [n, k] from
// router_topk; x, shared, out: [n, hidden] f32 (out may alias shared). An id of -1 is a pick of
// an expert another rank owns and adds nothing. Each expert runs once over its tokens (grouped
// ascending), so every token's result is what a per-token loop computes.
void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                 const MoeExpertWeights& w, const SwigluParams& act, const float* shared,
                 float* out);

// ---- tensor parallelism ----
// The embedding of a rank that holds vocabulary rows [vocab_begin, vocab_begin + table.rows):
// out[i, :] = table[ids[i] - vocab_begin, :] for ids in that range, zeros for every other id
// (a sum over the ranks is the whole embedding exactly). Ids outside [0, vocab_size) abort.
void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                           int64_t hidden, const int32_t* ids, int64_t n, float* out);

// ---- rows and residuals ----
// dst[i, :] = src[rows[i], :] for i < n, cols floats per row.
void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst);
// x[i] += y[i] for i < n.
void add_inplace(float* x, const float* y, int64_t n);
// rows x width floats from src (rows src_stride floats apart) to dst (dst_stride apart).
void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                  int64_t width, int64_t rows);
void fill_zero(float* x, int64_t n);
void copy(float* dst, const float* src, int64_t n);

// ---- output ----
// log_softmax over each row of logits [n, vocab] into out (may alias).
void log_softmax(const float* logits, int64_t n, int64_t vocab, float* out);

}  // namespace m3::kernels::cpu
