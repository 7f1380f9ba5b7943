// Quantized-weight ops on the GPU (docs/QUANTIZATION.md): the decode GEMV that reads FP8 (per
// channel, MXFP8) and 4-bit (NVFP4, MXFP4) weights as stored and applies their scales, and the
// dequantisation to bf16 the prefill path runs before a bf16 tensor-core GEMM. Their CPU twins
// are kernels::cpu::linear / dequantize_row over the same kernels::MatRef (tests/kernels/
// quant_cuda_test.cpp compares them; bench/bench_quant_gemv.cpp measures them).
// Invariant: a weight byte is read once per group of up to kGemvTokens tokens; codes decode
// exactly and each 16- or 4-element group's dot product with x is multiplied by its block scale
// (the CPU twin multiplies each element first: the sums differ by fp32 rounding only). Not yet
// called by the model: M3ModelCuda still uploads quantized linears dequantised to bf16.
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

}  // namespace m3::kernels::cuda
