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

// Positions per CTA tile for P positions over ne experts: 128 from a mean of 64 per expert, 64
// from 16, else 32 (decode batches: less padding in the MMAs, which otherwise rival the weight
// reads).
int tile_rows_quant(int64_t P, int64_t ne);
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
