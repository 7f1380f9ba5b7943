// The CUDA (sm_90a) versions of the CPU ops in kernels/cpu/ops.h: same argument lists and
// semantics, plus the stream to launch on. Called by the GPU forward path; tested op by op
// against the CPU ops (tests/kernels/). Invariant: every pointer (including those inside MatRef,
// VecRef, KvPages and TokenLayout) is a device pointer; ops only enqueue work on `stream` (no
// host sync, no allocation) and check each launch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::kernels::cuda {

// The device-neutral views (kernels/views.h): on this path their data pointers point to device
// memory.
using kernels::AttnPrepArgs;
using kernels::KvPages;
using kernels::MatRef;
using kernels::MoeExpertWeights;
using kernels::SwigluParams;
using kernels::TokenLayout;
using kernels::VecRef;
using kernels::Workspace;

// y[n, w.rows] = x[n, w.cols] · wᵀ; fp32 x, bf16 or f32 w, fp32 accumulation (bandwidth-bound
// GEMVs for a few tokens, cuBLASLt GEMMs above; see GemmPrecision).
void linear(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream);

// ---- quantized weights (the formats of kernels/views.h WeightQuant; kernels/cuda/quant.h) ----
// Largest token count linear_quant and the MoE's per-expert path send to the quantized GEMV: one
// pass over the weights serves up to quant.h's kGemvTokens = 4 tokens, n = 8 takes two, and from
// n = 8 on dequantise + bf16 GEMM is faster (bench_quant_gemv, docs/PERFORMANCE.md).
inline constexpr int64_t kQuantGemvMaxTokens = 4;
// Above it and up to kQuantGemmMaxTokens tokens, under GemmPrecision::kBf16, linear_quant runs a
// tensor-core GEMM that reads the codes as stored (converted to bf16 with their block scales in
// shared memory, K split to fill the GPU; moe_grouped_quant.cu) where the workspace holds bf16(x)
// and the split partials (the decode range; a prefill chunk takes dequantise + cuBLAS, whose
// GEMM outruns the mma.sync kernel once the dequantise is amortised).
inline constexpr int64_t kQuantGemmMaxTokens = 256;
// Bytes of workspace linear_quant needs for n tokens of w (0 where the GEMV serves them).
size_t linear_quant_workspace_bytes(int64_t n, const MatRef& w);
// y[n, w.rows] = x[n, w.cols] . w^T for a quantized w (quant_op_supported): up to
// kQuantGemvMaxTokens tokens gemv_quant reads the codes as stored; then, in the bf16 precision
// up to kQuantGemmMaxTokens, the quantized tensor-core GEMM above (ws holds bf16(x) and its
// partials; where it cannot, the next path); above, ws receives
// dequantize_bf16_unscaled(w) (exact in bf16), linear()'s tensor-core GEMM multiplies it under
// the GEMM precision, and apply_row_factor applies the per-channel / global scale. ws.bytes >=
// linear_quant_workspace_bytes(n, w).
void linear_quant(const float* x, int64_t n, const MatRef& w, float* y, Workspace ws,
                  cudaStream_t stream);

// out[i, :] = table[ids[i], :] in fp32. An id out of range traps the kernel (a caller bug).
void embedding(const MatRef& table, const int32_t* ids, int64_t n, float* out, cudaStream_t stream);

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
void router_topk(const float* logits, int64_t n, int64_t num_experts, const float* bias, int64_t k,
                 float scale, int32_t* ids, float* weights, cudaStream_t stream);

// The decode router in one launch: logits [n, ne] = x [n, hidden] · router^T (f32 [ne, hidden])
// by one CTA per expert row with no split-K round trip, then router_topk's ids and weights from
// them (the same picks and arithmetic) by the last CTA to finish. `counter`: a device unsigned
// that is 0 at the call; the kernel leaves it 0 again (one per stream: launches on one counter
// must not overlap). Needs router_fused_supported: n <= kRouterFusedMaxTokens, an f32 router of
// <= kRouterFusedMaxExperts rows, hidden % 4 == 0 and <= 8192, 16-byte aligned x and weights.
inline constexpr int64_t kRouterFusedMaxTokens = 8;
inline constexpr int64_t kRouterFusedMaxExperts = 256;
bool router_fused_supported(int64_t n, const MatRef& router, int64_t k, const float* x);
void router_fused(const float* x, int64_t n, const MatRef& router, const float* bias, int64_t k,
                  float scale, float* logits, int32_t* ids, float* weights, unsigned* counter,
                  cudaStream_t stream);

// Writes k, v (and ik if non-null) of each token into its cache slot.
void kv_write(const KvPages& cache, const TokenLayout& layout, const float* k, const float* v,
              const float* ik, cudaStream_t stream);

// ---- attention and MSA (attn_paged.cu, msa_select.cu) ----
// Workspace (kernels/views.h): scratch device memory for one call. Contents need not survive
// between calls, so one buffer may serve every op of a step on the same stream. `bytes` may be
// smaller than the op's *_bytes() helper asks for: the op then uses fewer KV splits / scores
// fewer tokens per launch.

// Causal paged attention, GQA, dense (blocks == null) or over selected blocks
// [num_tokens, num_kv_heads, max_blocks] (-1 padded), the CPU op's semantics. max_kv_len: a host
// upper bound of position + 1 over the step's tokens (a device check traps if a token exceeds
// it); it and the workspace size the split-KV ("flash decoding") grid so that a batch of one
// fills the GPU. One CTA per (token, kv head, KV split) serves all query heads of the group, so
// each K/V row is read once per token; a second kernel merges the splits. max_kv_len <= 0 or an
// empty workspace: no split (one CTA per (token, kv head)), still exact.
void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                     const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                     float scale, int64_t max_kv_len, Workspace ws, float* out,
                     cudaStream_t stream);
// Bytes of workspace attention_paged uses at most for such a call (max_blocks = 0: dense).
size_t attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, const KvPages& cache,
                                 int64_t max_blocks, int64_t max_kv_len);
// The block-sparse attention of prefill chunks (msa_sparse_prefill.cu), which attention_paged
// runs for the tokens that share their sequence with a neighbour when blocks != null and
// TokenLayout::multi_token_seqs is set (and msa_sparse_prefill_supported): it writes the output
// rows of exactly those tokens (in_multi_run), others untouched. A CTA takes 4 consecutive
// tokens x one kv head and streams the union of their selected blocks once for all of them
// (T = 4), per pair (T = 2) or per token (T = 1), decided per CTA from the ids;
// tokens_per_tile forces one T everywhere (tests and benches; 0 = decide).
bool msa_sparse_prefill_supported(const KvPages& cache, int64_t group, int64_t max_blocks);
// Whether attention_paged's dense decode rows over this cache take the TMA-ring kernel
// (msa_sparse_prefill.cu): bf16 / fp8, head_dim 128, group <= 16, pages of a multiple of 16 slots
// (unless M3_ATTN_TMA_DECODE=0 or the driver cannot make the tensor maps).
bool attention_decode_tma_supported(const KvPages& cache, int64_t num_heads);
void msa_sparse_prefill(const float* q, int64_t num_heads, const KvPages& cache,
                        const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                        float scale, int64_t max_kv_len, float* out, cudaStream_t stream,
                        int tokens_per_tile = 0);
// Without a workspace: the same op, no KV split (kept for callers without scratch space).
inline void attention_paged(const float* q, int64_t num_heads, const KvPages& cache,
                            const TokenLayout& layout, const int32_t* blocks, int64_t max_blocks,
                            float scale, float* out, cudaStream_t stream) {
  attention_paged(q, num_heads, cache, layout, blocks, max_blocks, scale, 0, Workspace{}, out,
                  stream);
}

// MSA block selection (see the CPU op): out [num_tokens, num_index_heads, topk], ascending,
// -1 padded, ids equal to the CPU op's. Two kernels: (a) index scores, many CTAs per token over
// block ranges, each index-K row read once for all index heads, block maxima into the workspace
// [tokens, index_heads, ceil(max_kv_len / page_size)]; (b) one CTA per (token, index head): radix
// select of the top-k by (score desc, block id asc) with the forced init/local blocks, no limit on
// the number of blocks. max_kv_len as for attention_paged. A workspace too small for all tokens
// is used token-chunk by token-chunk; one too small for one token (or none) falls back to a
// single kernel per (token, index head) holding the scores in shared memory (kMaxMsaBlocks).
void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                       const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                       int64_t local_blocks, int64_t max_kv_len, Workspace ws, int32_t* out,
                       cudaStream_t stream);
// Bytes of workspace msa_select_blocks uses for all tokens in one launch pair.
size_t msa_select_workspace_bytes(int64_t num_tokens, int64_t num_index_heads, const KvPages& cache,
                                  int64_t max_kv_len);
// Without a workspace: the single-kernel path; a sequence may span at most kMaxMsaBlocks blocks
// (6M tokens at 128-token pages; more traps the kernel).
inline constexpr int64_t kMaxMsaBlocks = 49152;
inline void msa_select_blocks(const float* iq, int64_t num_index_heads, const KvPages& cache,
                              const TokenLayout& layout, int64_t topk, int64_t init_blocks,
                              int64_t local_blocks, int32_t* out, cudaStream_t stream) {
  msa_select_blocks(iq, num_index_heads, cache, layout, topk, init_blocks, local_blocks, 0,
                    Workspace{}, out, stream);
}

// ---- GEMM precision and the MoE experts (blas.cu, linear.cu, moe_experts.cu) ----

// How linear() multiplies fp32 activations by bf16 weights on the tensor cores (more than
// blas::kGemvMaxTokens tokens; the GEMV path is always exact fp32 arithmetic).
//  kExact: x is split into bf16 terms t0 = bf16(x), t1 = bf16(x - t0), t2 = bf16(x - t0 - t1)
//          and y = Σ W·t_i with fp32 accumulation: 3 terms hold all of x's fp32 bits (the
//          default; blas::exact_split_terms() says how many, M3_GEMM_EXACT_TERMS=2 trades
//          accuracy, 2^-17 relative on x, for a third less prefill time).
//  kBf16:  one GEMM on bf16(x) (2^-9 relative on x), what other engines do; the speed mode.
// Process-wide; set it before work is enqueued (a change is not ordered with enqueued work).
enum class GemmPrecision { kExact, kBf16 };
void set_gemm_precision(GemmPrecision p);
GemmPrecision gemm_precision();

// Programmatic dependent launch (Hopper): the decode step's kernels are launched so that each
// may start while the one before it finishes (its CTAs become resident, prefetch weights that
// do not depend on earlier work into L2, then wait in pdl_enter(), common.cuh, until the
// earlier kernels have finished and their writes are visible). Same results bit for bit; only
// the gaps between kernels shrink. On by default on sm_90 and later (the H200 run of 2026-12-02:
// bench_layer batch 1 0.303 -> 0.290 ms, batch 8 1.003 -> 0.979); the environment's M3_PDL=0 at
// first use turns it off. Process-wide; set it before work is
// enqueued or captured (a graph keeps the launches it captured).
bool launch_overlap();
void set_launch_overlap(bool on);
// Whether the attention and MSA selection kernels take part: not by default (M3_PDL_ATTN=1 turns
// them on). Measured on the H200 (2026-12-02, docs/PERFORMANCE.md): with them the MSA decode
// graph step at batch 8 ran 5-8 us slower (8K-128K) for ~1 us gained at batch 1, and bench_layer
// at batch 8-256 0.5-1.3% slower, equal at batch 1.
bool launch_overlap_attention();

// MoeExpertWeights (kernels/views.h): this op takes only the contiguous layout (the per-expert
// arrays must be null). SwigluParams: the constants of swiglu_oai. Quantized experts come as
// mats_of (host array of device views) laid out back to back per projection (codes, and scales,
// each at a fixed stride; M3ModelCuda's upload), with global_scales on the device for NVFP4: up
// to kMoeGemvMaxTokens tokens a grouped GEMV per projection reads the codes as stored
// (gemv_quant_grouped); under GemmPrecision::kBf16 from kMoeGroupedMinTokens tokens the
// grouped tensor-core GEMMs read them as stored too (moe_grouped_quant.cu: converted to bf16
// with their block scales in shared memory; MoePath::kGrouped, no host sync); in the exact
// precision above kMoeGemvMaxTokens the per-expert path dequantises each active expert's
// matrices to bf16 in the workspace, one at a time, before its GEMM (linear_quant).

// Up to this many tokens (bench_gemm_moe: n = 256 runs 2.7x faster grouped than per expert) the
// experts run as grouped GEMVs with no host sync; above it, in the exact precision, the counts
// are read back once (one host sync per call) and each active expert runs linear() over its
// gathered tokens (in the bf16 precision the grouped GEMMs below take over from 8 tokens).
inline constexpr int64_t kMoeGemvMaxTokens = 256;

// From kMoeGroupedMinTokens tokens under GemmPrecision::kBf16 (bf16 experts whose dims are
// multiples of 8, 16-byte aligned) the experts run as grouped tensor-core GEMMs, one launch per
// projection and no host sync (bench_gemm_moe at M3's shapes, routed experts: n = 8 0.75 ms
// against the GEMV's 0.83, n = 64 2.97 against 3.90, n = 256 3.43 against 9.17, n = 1024 3.60
// against the per-expert path's 12.2, n = 8192 13.6 against 15.7), over chunks of at most
// kMoeGroupedChunk tokens (the workspace holds one chunk: bf16 x, bf16 activations and fp32
// outputs per pick, ~135 KB per token at M3's shapes).
inline constexpr int64_t kMoeGroupedMinTokens = 8;
inline constexpr int64_t kMoeGroupedChunk = 8192;
// From kMoeWgmmaMinTokens tokens, on an sm_90 device in a build with the CUTLASS headers
// (.deps/flashinfer), the grouped GEMMs run on Hopper's wgmma/TMA engine
// (moe_grouped_sm90.cu: CUTLASS's ptr-array grouped GEMM, gate|up, a SwiGLU pass, down), in the
// same chunks and still without a host sync; below it, or without it, the mma.sync kernels
// (bench_gemm_moe, routed experts at M3's shapes: n = 512 3.59 ms against mma.sync's 3.52,
// n = 1024 3.69 against 3.68, n = 2048 3.91 against 5.43, n = 8192 8.73 against 13.9).
inline constexpr int64_t kMoeWgmmaMinTokens = 1024;

// The engines of moe_experts: kGemv (grouped GEMVs, exact fp32 arithmetic), kGrouped (grouped
// bf16 tensor-core GEMMs on mma.sync), kGroupedWgmma (the same on wgmma/TMA, where
// moe_wgmma_available()), kPerExpert (one host sync, then linear() per active expert under the
// GEMM precision). kAuto picks as described above; the bench and tests force the others.
enum class MoePath { kAuto, kGemv, kGrouped, kGroupedWgmma, kPerExpert };
// Whether this build has the wgmma engine and the current device runs it (sm_90).
bool moe_wgmma_available();
// The wgmma engine's compiled tile configurations x raster orders (0 without it), their names,
// and the one it runs (process-wide; set it before work is enqueued): the environment's
// M3_MOE_WGMMA_VARIANT at first use (an index, anything else is refused) or 0.
// bench_gemm_moe times each and the tests run each.
int moe_wgmma_variants();
const char* moe_wgmma_variant_name(int v);
void set_moe_wgmma_variant(int v);
MoePath moe_path(int64_t n, const MoeExpertWeights& w, const float* x);
// The quantized tensor-core GEMMs' variants (moe_grouped_quant.cuh: 0 bf16 tile in shared
// memory, the default; 1 codes converted straight into the MMA registers), the one calls use
// (process-wide; set it before work is enqueued; M3_QUANT_GEMM_VARIANT at first use, else 0).
// The tests run each.
int quant_gemm_variants();
void set_quant_gemm_variant(int v);
int quant_gemm_variant();

// Whether moe_experts over n tokens of x runs without a host sync (the grouped GEMV or GEMM
// path), so a CUDA graph may capture it.
bool moe_experts_graph_safe(int64_t n, const float* x, const MoeExpertWeights& w);

// Expert parallel: ids [n] of global expert ids -> this rank's local ids (id - first for ids in
// [first, first + count)), -1 for every other expert, in place.
void moe_localize_ids(int32_t* ids, int64_t n, int64_t first, int64_t count, cudaStream_t stream);

// Device bytes moe_experts needs as `workspace` for n tokens.
size_t moe_workspace_bytes(int64_t n, int64_t k, const MoeExpertWeights& w);

// out[t] = shared[t] (if non-null) + the sum over t's k routed experts, in ascending expert id,
// of weights[t, j] * down(swiglu(gate(x[t]), up(x[t]))): the CPU model's MoE after its router.
// ids/weights: [n, k] from router_topk (device); x, shared, out: [n, hidden] f32 (out may alias
// shared). Tokens are grouped per expert on the device, ascending within an expert, as the CPU
// path orders them; the combine uses no atomics (deterministic). An id of -1 is a pick of an
// expert another rank owns (expert parallel) and adds nothing; any other id out of range traps.
void moe_experts(const float* x, int64_t n, const int32_t* ids, const float* weights, int64_t k,
                 const MoeExpertWeights& w, const SwigluParams& act, const float* shared,
                 float* out, void* workspace, cudaStream_t stream);
// The same through a chosen engine (kGemv needs n <= kMoeGemvMaxTokens and a GEMV layout,
// kGrouped a layout moe_path would give it, kGroupedWgmma that too, moe_wgmma_available() and
// a 16-byte aligned x; otherwise it aborts naming the reason).
void moe_experts_with(MoePath path, const float* x, int64_t n, const int32_t* ids,
                      const float* weights, int64_t k, const MoeExpertWeights& w,
                      const SwigluParams& act, const float* shared, float* out, void* workspace,
                      cudaStream_t stream);

// Whether moe_experts_shared can run `s` inside the grouped GEMVs of n tokens: at most
// kMoeSharedFusedMaxTokens tokens (one token group of the GEMV holds them all, so the shared
// weights are read once; more tokens would re-read them per group), the kGemv path, unquantized
// experts, and s of the routed experts' dtype and shapes (16-byte aligned).
inline constexpr int64_t kMoeSharedFusedMaxTokens = 2;
bool moe_fuses_shared(int64_t n, const float* x, const MoeExpertWeights& w,
                      const MoeSharedExpert& s);
// moe_experts with `shared` = down(swiglu(gate(x), up(x))) of the shared expert `s`, computed
// inside the routed experts' grouped GEMVs as one more expert over all n tokens (one launch for
// every gate|up, one for every down): the same numbers as the shared expert through linear()
// and swiglu_oai_rows, then moe_experts. Needs moe_fuses_shared (else it aborts naming why).
void moe_experts_shared(const float* x, int64_t n, const int32_t* ids, const float* weights,
                        int64_t k, const MoeExpertWeights& w, const MoeSharedExpert& s,
                        const SwigluParams& act, float* out, void* workspace, cudaStream_t stream);

// ---- tensor parallelism (shard_ops.cu) ----
// The embedding of a rank that holds vocabulary rows [vocab_begin, vocab_begin + table.rows):
// out[i, :] = table[ids[i] - vocab_begin, :] for ids in that range, zeros for every other id, so
// a sum over the ranks (all-reduce) is the full embedding exactly (one non-zero term). `table`
// may have 0 rows (a rank past a tiny vocabulary); an id outside [0, vocab_size) traps.
void embedding_vocab_slice(const MatRef& table, int64_t vocab_begin, int64_t vocab_size,
                           int64_t hidden, const int32_t* ids, int64_t n, float* out,
                           cudaStream_t stream);

// ---- rows and residuals (row_ops.cu) ----
// dst[i, :] = src[rows[i], :] for i < n (rows: device ids), cols floats per row.
void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst,
                 cudaStream_t stream);
// dst[rows[i], :] = values[i, :] for i < n (rows: device ids; the image embeddings over their
// placeholder rows), cols floats per row.
void scatter_rows(float* dst, const int32_t* rows, int64_t n, int64_t cols, const float* values,
                  cudaStream_t stream);
// x[i] += y[i] for i < n.
void add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream);
// rows x width floats from src (rows src_stride floats apart) to dst (dst_stride apart).
void copy_rows_2d(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                  int64_t width, int64_t rows, cudaStream_t stream);
void fill_zero(float* x, int64_t n, cudaStream_t stream);
void copy(float* dst, const float* src, int64_t n, cudaStream_t stream);

}  // namespace m3::kernels::cuda
