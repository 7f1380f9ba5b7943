// Quantized-weight ops on the GPU (docs/QUANTIZATION.md): the decode GEMV that reads FP8 (per
// channel, MXFP8) and 4-bit (NVFP4, MXFP4) weights as stored and applies their scales, and the
// dequantisation to bf16 the prefill path runs before a bf16 tensor-core GEMM. Their CPU twins
// are kernels::cpu::linear / dequantize_row over the same kernels::MatRef (tests/kernels/
// quant_cuda_test.cpp compares them; bench/bench_quant_gemv.cpp measures them).
// Invariant: a weight byte is read once per group of up to kGemvTokens tokens; codes decode
// exactly and each 16- or 4-element group's dot product with x is multiplied by its block scale
// (the CPU twin multiplies each element first: the sums differ by fp32 rounding only). The
// model reaches them through CudaOps::linear (kernels/cuda/ops.h linear_quant) and the MoE
// experts (moe_experts.cu: gemv_quant_grouped for decode, dequantize_bf16_unscaled per expert for
// prefill).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::kernels::cuda {

// Tokens one pass over the weights serves (larger n: several passes; prefill should take
// dequantize_bf16 + a bf16 GEMM instead).
inline constexpr int64_t kGemvTokens = 4;

// Whether gemv_quant / dequantize_bf16 take `w`: a quantized format, cols a multiple of 16 (whole
// 16-element units, 16-byte aligned rows of fp8 codes / 8-byte rows of 4-bit codes).
bool quant_op_supported(const MatRef& w);

// y[n, w.rows] = x[n, w.cols] . w^T, x and y fp32 in device memory (x rows 16-byte aligned),
// w quantized in device memory (data and scale). fp32 accumulation.
void gemv_quant(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream);

// out [w.rows, w.cols] bf16 bits = w's values (kernels::cpu::dequantize_row) rounded to bf16.
void dequantize_bf16(const MatRef& w, uint16_t* out, cudaStream_t stream);

// The prefill path's exact form: out = w's values divided by their row factor (fp8_per_channel:
// scale[r]; NVFP4: global_scale; MXFP8 / MXFP4: none), which bf16 holds exactly (an e4m3 value;
// e2m1 x an e4m3 block scale has at most 6 significant bits; x 2^k), so a bf16 GEMM over them
// followed by apply_row_factor is the fp32 product up to summation order.
void dequantize_bf16_unscaled(const MatRef& w, uint16_t* out, cudaStream_t stream);
// Whether w has a row factor dequantize_bf16_unscaled leaves out.
bool has_row_factor(const MatRef& w);
// y[t, r] *= w's row factor for t < n, r < w.rows (nothing where it has none).
void apply_row_factor(float* y, int64_t n, const MatRef& w, cudaStream_t stream);

// ---- FP8 activations (fp8_linear.cu) ----
// Per-token dynamic FP8: q [n, k] e4m3 codes and scale [n] f32 of x [n, k] (device), by
// kernels::cpu::quantize_fp8_per_token's rule, bit for bit.
void quantize_fp8_per_token(const float* x, int64_t n, int64_t k, uint8_t* q, float* scale,
                            cudaStream_t stream);
// Whether fp8_linear takes `w`: fp8_per_channel codes (kFp8Channel), cols a multiple of 16,
// 16-byte aligned codes.
bool fp8_linear_supported(const MatRef& w);
// y[n, w.rows] = fp8(x) . w^T on the FP8 tensor cores: x quantized per token
// (quantize_fp8_per_token, into stream-ordered scratch), then cuBLASLt's FP8 GEMM with the
// token and channel scales (blas::gemm_fp8). The activations' rounding (2^-4 relative) buys the
// FP8 tensor cores (twice bf16's peak on Hopper; the rate reached is bench_quant_gemv's to
// measure). Returns false where the
// weights or cuBLASLt do not allow it (the caller falls back; the quantization may have run).
bool fp8_linear(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream);
// Whether linear_quant sends fp8_per_channel prefill GEMMs (above kQuantGemmMaxTokens tokens,
// bf16 GEMM precision) to fp8_linear: on by default (docs/QUANTIZATION.md has the measurement),
// off with M3_FP8_ACTIVATIONS=0 in the environment or set_fp8_activations(false) (tests, bench).
bool fp8_activations();
void set_fp8_activations(bool on);

// One projection (w1, w3 or w2) of an MoE layer's routed experts, quantized, laid out back to
// back: expert e's codes at first.data + e * data_stride, its scales at first.scale +
// e * scale_stride, its NVFP4 global scale global_scales[e] (device f32 [experts]; null: all
// first.global_scale). `first` is expert 0's view.
struct QuantExperts {
  MatRef first;
  int64_t data_stride = 0, scale_stride = 0;
  const float* global_scales = nullptr;
};

// The grouped decode GEMV of the routed experts: for every active expert e (CTA row `slot` of
// active[0, *num_active), `slots` >= the most that can be active) and each of its positions p in
// [offsets[e], offsets[e + 1]): y[p, :] = x[x_rows[p]] . W_e^T (x_rows null: x[p]). Each weight
// byte is read once per group of `nt` (1, 2 or 4) positions of its expert; the arithmetic is
// gemv_quant's, so a position's result equals gemv_quant of its row on expert e's view.
void gemv_quant_grouped(const float* x, const int32_t* x_rows, const QuantExperts& w, float* y,
                        const int32_t* offsets, const int32_t* active, const int32_t* num_active,
                        int64_t slots, int nt, cudaStream_t stream);

}  // namespace m3::kernels::cuda
