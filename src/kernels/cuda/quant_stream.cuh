// The streaming one-token GEMV over quantized weights (quant_stream.cu), called by gemv_quant and
// the MoE experts' decode path (quant_gemv.cu, moe_experts.cu). Included by .cu files in this
// folder and by the op test (tests/kernels/quant_cuda_test.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/quant.h"
#include "kernels/views.h"

namespace m3::kernels::cuda::qstream {

// Two kernels (quant_stream.cu): fp8_per_channel on the tensor cores (rows in 8-row groups;
// M3_QUANT_MMA=0 turns it off), and for NVFP4 / MXFP4 a CUDA-core stream; MXFP8 (and whatever
// neither takes) stays on quant_gemv.cu's group kernel, which measured faster for it.
// Whether gemv_quant's one-token calls and the experts' one-token GEMVs take them (on by
// default; M3_QUANT_STREAM=0 in the environment or set_on(false): the unit / group kernels of
// quant_gemv.cu).
bool on();
void set_on(bool v);
// Whether fp8_per_channel takes the tensor-core kernel (on by default; M3_QUANT_MMA=0 or
// set_mma_on(false): the group kernel).
bool mma_on();
void set_mma_on(bool v);
// The most tokens a dense fp8_per_channel call takes it for: 1 by default (at 2-4 tokens it ran
// one M3 layer slower than the group kernel, docs/PERFORMANCE.md session 17); up to 4 with
// M3_QUANT_MMA_TOKENS or set_mma_tokens (tests, benchmarks).
int mma_tokens();
void set_mma_tokens(int n);

// y[t, 0..w.rows) = x[t, 0..w.cols) . w^T for n tokens (t < n), if a kernel here takes the matrix:
// cols a multiple of 512 and at most 16384, rows that give every warp of the grid one, 16-byte
// aligned x, codes and scales; one token for the 4-bit stream, up to mma_tokens() for
// fp8_per_channel on the tensor cores (x of 4 tokens in shared memory: k <= ~14000). False
// (nothing launched) otherwise.
bool dense(const float* x, int64_t n, const MatRef& w, float* y, cudaStream_t stream);

// The experts' GEMVs of one token: for every active expert slot s (< *num_active) and each of
// the `nproj` projections j, y[j][p, :] = x_p . W_{j,e}^T with e = active[s], p = offsets[e] (one
// token: one position per active expert) and x_p = x[x_rows[p]] (x_rows null: x[p]). All
// projections share one shape and format. x_one_row: every position's x is the same row (one
// token's, as the gate and up projections read it), staged once instead of once per slot. False
// (nothing launched) where the streaming kernel does not take them (as dense, but any row
// count; more than kMaxSlots slots; rings that do not fit beside x).
inline constexpr int kMaxSlots = 16;
bool grouped(const float* x, const int32_t* x_rows, bool x_one_row, const QuantExperts* w,
             float* const* y, int nproj, const int32_t* offsets, const int32_t* active,
             const int32_t* num_active, int64_t slots, cudaStream_t stream);

}  // namespace m3::kernels::cuda::qstream
