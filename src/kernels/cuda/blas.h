// The dense-matmul engines behind kernels::cuda::linear and the MoE expert GEMMs: a cuBLASLt
// GEMM (bf16 tensor cores with fp32 accumulation, or exact fp32) and a bandwidth-bound GEMV for
// a few tokens. Called by linear.cu and moe_experts.cu; the bench and tests call the explicit
// paths to compare them. Invariant: one cuBLASLt handle per device, created lazily under a lock;
// temporaries (bf16 split activations, cuBLASLt workspace) come from a per-device stream-ordered
// memory pool, so a call enqueues work on its stream only (no host sync) and streams never share
// scratch. A failing CUDA/cuBLAS call ends the process naming the call.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cpu/ops.h"

namespace m3::kernels::cuda {

enum class GemmPrecision;  // ops.h

namespace blas {

// Which engine linear() uses; kAuto picks by token count and weight layout.
enum class LinearPath { kAuto, kGemv, kGemm, kSimt };

// y[n, w.rows] = x[n, w.cols] · wᵀ through `path` (kGemv/kGemm fall back to kSimt where the
// layout does not allow them: cols not a multiple of 8 (bf16) / 4 (f32), or misaligned data).
void linear_with(LinearPath path, const float* x, int64_t n, const cpu::MatRef& w, float* y,
                 cudaStream_t stream);

// The path kAuto takes for these arguments (tests use it to cover both sides of the threshold).
LinearPath auto_path(int64_t n, const cpu::MatRef& w);

// Largest token count kAuto sends to the GEMV. Measured on the H200 (bench_gemm_moe, % of the
// copy bandwidth): q_proj 6144 -> 8192 GEMV 79% at n = 1, 70% at 2, 55% at 4, 39% at 8, the
// stacked-split cuBLASLt GEMM (exact) 71% at n = 4 and 69% at 8; expert-sized 6144 -> 3072 GEMV
// 62% / 45% / 27% at n = 1 / 2 / 4, the GEMM 28% at n = 4. The GEMV does n CUDA-core FMAs per
// weight element and its warps load then compute, so past n = 2 the tensor cores win.
inline constexpr int64_t kGemvMaxTokens = 2;

// Up to this many tokens the split GEMM stacks its bf16 terms into one GEMM (W read once: the
// weight-bound regime); above it one GEMM per term accumulates through beta = 1.
inline constexpr int64_t kConcatMaxTokens = 512;

// Whether the GEMV kernel can read `w` (16-byte aligned rows of whole 16-byte vectors).
bool gemv_supports(const cpu::MatRef& w);

// Number of bf16 terms x is split into under GemmPrecision::kExact: 3 unless the environment
// variable M3_GEMM_EXACT_TERMS says 1..3 (read once). 3 terms carry all 24 bits of an fp32 x
// (2^-26 relative), 2 terms 2^-17. Measured on the golden models (model_cuda_test, GPU vs CPU
// logprobs): 2 terms 3.7e-4 (over the test's 2e-4), 3 terms 3.5e-5; so 3 is the default, and
// weight-bound calls (n <= kConcatMaxTokens) read W once however many terms there are.
int exact_split_terms();

// The cuBLASLt path of linear() under the current precision (bf16 w: split activations;
// f32 w: exact fp32 SGEMM, no TF32). Returns false, enqueuing nothing, where cuBLASLt offers
// no algorithm for the layout (the caller falls back).
bool gemm(const float* x, int64_t n, const cpu::MatRef& w, float* y, cudaStream_t stream);

// One cuBLASLt GEMM on bf16 activations xb [n, w.cols]: y = xb · wᵀ + beta * y, fp32
// accumulation and output (w bf16). The building block of gemm(); the bench's ceiling.
bool gemm_bf16(const void* xb, int64_t n, const cpu::MatRef& w, float* y, float beta,
               cudaStream_t stream);

// A strided-batched GEMM in cuBLASLt's column-major terms: C_i[m, n] = op(A_i)[m, k] . op(B_i)
// [k, n] for i < batch, X_i = X + i * stride_x elements, fp32 accumulation and fp32 C. A and B
// are bf16 (bf16 = true: the tensor cores) or f32 (exact fp32, no TF32). The vision tower's
// attention (kernels/cuda/vision.cu) multiplies every head of a segment in one call this way.
struct BatchedGemm {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  int64_t batch = 1;
  bool bf16 = true;
};
// Returns false, enqueuing nothing, where cuBLASLt offers no algorithm for the layout.
bool gemm_strided_batched(const BatchedGemm& g, const void* a, const void* b, float* c,
                          cudaStream_t stream);

// One cuBLASLt FP8 GEMM: y[n, w.rows] (fp32) = (qx . codes(w)^T) scaled by sx[t] * sw[r], with
// qx [n, w.cols] e4m3 codes of per-token scales sx [n] (f32, device) and w a kFp8Channel matrix
// (e4m3 codes, f32 per-row scales sw), fp32 accumulation (no fast accumulation). cuBLASLt
// applies the two scale vectors itself where it has an algorithm for its outer-vector scale
// mode, else the unscaled product (fp32, or bf16 when that is all it offers) is scaled by
// scale_outer below. Returns false, enqueuing nothing, where cuBLASLt has no FP8 algorithm for
// the shape (k a multiple of 16 and 16-byte aligned rows are needed).
bool gemm_fp8(const void* qx, const float* sx, int64_t n, const cpu::MatRef& w, float* y,
              cudaStream_t stream);

// y[t, r] = (src_bf16 ? bf16 src[t, r] : y[t, r]) * sx[t] * sw[r] for t < n, r < m (fp8_linear.cu;
// gemm_fp8's epilogue where cuBLASLt does not scale).
void scale_outer(float* y, const uint16_t* src_bf16, int64_t n, int64_t m, const float* sx,
                 const float* sw, cudaStream_t stream);

// Multiprocessors of the current device (cached).
int num_sms();

// Stream-ordered scratch from the current device's pool (freed with pool_free on the same
// stream). Used by the MoE prefill path and by linear's split activations.
void* pool_alloc(size_t bytes, cudaStream_t stream);
void pool_free(void* p, cudaStream_t stream);

}  // namespace blas
}  // namespace m3::kernels::cuda
