// The grouped expert GEMMs over quantized expert weights (moe_grouped_quant.cu): moe_grouped's
// mma.sync GEMMs (gate|up with SwiGLU, down; the same Tile list from build_tiles, no host sync)
// with the expert matrices read in their stored format (fp8_per_channel, MXFP8, NVFP4, MXFP4;
// QuantExperts of quant.h) and converted to bf16 with their block scales in shared memory,
// exactly (the CPU twin's values up to a row factor applied in fp32 in the epilogue); bf16
// activations (xb, act), fp32 accumulation. Internal to moe_experts.cu.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/moe_grouped.cuh"
#include "kernels/cuda/quant.h"
#include "kernels/views.h"

namespace m3::kernels::cuda::moe_grouped {

// The kernels' variant, process-wide (set it before work is enqueued): 0 converts each B tile
// into a bf16 tile in shared memory read by ldmatrix (2 x 2 warps); 1 converts the codes
// straight into the MMA's B registers (4 warps along N, A stored K-permuted; see the .cu). The
// environment's M3_QUANT_GEMM_VARIANT (0 or 1, anything else is refused) at first use, else 0.
int quant_gemm_variant();
void set_quant_gemm_variant(int v);
// Positions per CTA tile for P positions over ne experts: variant 0 128 from a mean of 64 per
// expert, 64 from 16, else 32; variant 1 128 / 64 from 24 / 32 from 12 / else 16 (decode
// batches: less padding in the MMAs, which otherwise rival the weight reads).
int tile_rows_quant(int64_t P, int64_t ne);
// The A operand of gate_up_quant (and of the dense GEMM): out [rows, cols] = bf16(x) in the
// variant's k order for format q (variant 0: as is).
void to_bf16_quant(const float* x, int64_t rows, int64_t cols, WeightQuant q, uint16_t* out,
                   cudaStream_t stream);
// Whether they read this projection: a quantized format of its dtype, rows a multiple of 8,
// cols a multiple of 16 (fp8) / 32 (4-bit) elements (whole 16-byte code chunks), codes 16-byte
// aligned for every expert, fp8_per_channel's f32 scales 4-byte aligned.
bool supports_quant(const QuantExperts& q);
// gate_up / down of moe_grouped.cuh over w1 + w3 (one format and shape) and w2; bm from
// tile_rows_quant, max_tiles from max_tiles(P, ne, bm).
void gate_up_quant(const uint16_t* xb, const int32_t* pair_token, const Tile* tiles,
                   const int32_t* num_tiles, int64_t max_tiles, int bm, const QuantExperts& w1,
                   const QuantExperts& w3, const SwigluParams& act, uint16_t* act_out,
                   cudaStream_t stream);
void down_quant(const uint16_t* act, const Tile* tiles, const int32_t* num_tiles, int64_t max_tiles,
                int bm, const QuantExperts& w2, float* ye, cudaStream_t stream);

// The same kernel over one quantized matrix (linear_quant above its GEMV's range, under the bf16
// precision): y [n, w.rows] f32 = bf16(x [n, w.cols]) . w^T, tiles of n from blockIdx, K split
// over enough CTAs to fill the GPU (partials in ws, summed in split order: deterministic).
// dense_quant_ok: whether supports_quant takes w, y is 8-byte aligned and ws_bytes hold bf16(x)
// plus the partials.
bool dense_quant_ok(int64_t n, const MatRef& w, const float* y, size_t ws_bytes);
void dense_quant(const float* x, int64_t n, const MatRef& w, float* y, void* ws, size_t ws_bytes,
                 cudaStream_t stream);

}  // namespace m3::kernels::cuda::moe_grouped
