// Device-side generation of synthetic weights: counter-based hash random numbers written straight
// into GPU memory (no host copy of the ~15 GB per MoE layer), and a device checksum to compare
// two generations (or a rank's slice with the whole). Called by M3ModelCuda::synthetic
// (model/cuda/m3_model_cuda.cpp) and the GPU tests. Invariant: element i of a tensor depends only
// on (seed, tensor_id, i), so the same seed gives bit-identical weights whatever the launch shape,
// stream or device.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::model {

// dst[i] = bf16 (round to nearest even) of a uniform value in [-bound, bound).
void fill_uniform_bf16(uint16_t* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                       cudaStream_t stream);
// dst[i] = a uniform f32 value in [-bound, bound).
void fill_uniform_f32(float* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                      cudaStream_t stream);

// A block of a whole tensor viewed as [outer, rows, cols] (row-major): outer indices
// [outer_begin, + outer_count), rows [row_begin, + row_count), columns [col_begin, + col_count).
// Its elements are drawn at their index in the whole tensor, so a tensor-parallel rank generates
// exactly its slice of the unsharded weights (model/shard.h); the full block is the whole tensor.
// M3ModelCuda::generate_weights fills each tensor's shard_block (model/tensor_table.h) so.
struct FillBlock {
  int64_t outer = 1, rows = 0, cols = 0;  // the whole tensor's shape
  int64_t outer_begin = 0, outer_count = 1;
  int64_t row_begin = 0, row_count = 0;
  int64_t col_begin = 0, col_count = 0;
  size_t size() const {
    return static_cast<size_t>(outer_count) * static_cast<size_t>(row_count) *
           static_cast<size_t>(col_count);
  }
  static FillBlock whole(int64_t rows, int64_t cols, int64_t outer = 1) {
    return FillBlock{outer, rows, cols, 0, outer, 0, rows, 0, cols};
  }
};
// dst (block.size() elements, the block's [outer_count, row_count, col_count] row-major) =
// what fill_uniform_bf16 writes at those elements of the whole tensor.
void fill_uniform_bf16_block(uint16_t* dst, const FillBlock& block, float bound, uint64_t seed,
                             uint64_t tensor_id, cudaStream_t stream);

// Quantizes rows x cols bf16 values (row-major, device) into `format` (kernels/views.h
// WeightQuant; not kNone) by the rules of tools/quant/quantize_checkpoint.py: per-channel fp8
// scale amax_row / 448 (1 for a zero row); E8M0 block exponents ceil(log2(amax_block / emax))
// (emax 448 for e4m3, 6 for e2m1); NVFP4 block scales e4m3(amax_block / 6 / global_scale); codes
// rounded to nearest (e4m3 saturating). data: [rows, row_bytes], scale: [rows, scale_row_bytes]
// as a MatRef of that format describes them. For synthetic weights of a stored format (the
// caller picks global_scale, e.g. from the known bound of the values).
void quantize_bf16_rows(const uint16_t* src, int64_t rows, int64_t cols,
                        kernels::WeightQuant format, float global_scale, uint8_t* data,
                        uint8_t* scale, cudaStream_t stream);

// An order-independent 64-bit checksum of `bytes` bytes at device pointer `p` (the sum of a
// mixing hash of each 8-byte word and its index; a tail shorter than 8 bytes is zero-padded).
// Synchronises `stream`.
uint64_t device_checksum(const void* p, size_t bytes, cudaStream_t stream);

}  // namespace m3::model
