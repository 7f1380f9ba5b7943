// Device-side generation of synthetic weights: counter-based hash random numbers written straight
// into GPU memory (no host copy of the ~15 GB per MoE layer), and a device checksum to compare
// two generations. Called by M3ModelCuda::synthetic (model/cuda/m3_model_cuda.cpp) and the GPU
// tests. Invariant: element i of a tensor depends only on (seed, tensor_id, i), so the same seed
// gives bit-identical weights whatever the launch shape, stream or device.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace m3::model {

// dst[i] = bf16 (round to nearest even) of a uniform value in [-bound, bound).
void fill_uniform_bf16(uint16_t* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                       cudaStream_t stream);
// dst[i] = a uniform f32 value in [-bound, bound).
void fill_uniform_f32(float* dst, size_t n, float bound, uint64_t seed, uint64_t tensor_id,
                      cudaStream_t stream);

// An order-independent 64-bit checksum of `bytes` bytes at device pointer `p` (the sum of a
// mixing hash of each 8-byte word and its index; a tail shorter than 8 bytes is zero-padded).
// Synchronises `stream`.
uint64_t device_checksum(const void* p, size_t bytes, cudaStream_t stream);

}  // namespace m3::model
