// Row gather/scatter and residual adds on device fp32 activations: the glue between the CUDA ops
// that M3ModelCuda needs for MoE dispatch (gather a routed expert's tokens, scatter its weighted
// output back) and for the residual stream. Called only by model/cuda/m3_model_cuda.cpp.
// Invariant: every pointer is a device pointer; functions only enqueue on `stream` and check
// each launch. Arithmetic matches the CPU forward term by term (no fused multiply-add), so these
// steps add no difference between the CPU and GPU paths.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace m3::model {

// dst[i, :] = src[rows[i], :] for i in [0, n); rows of `cols` floats.
void cuda_gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t cols, float* dst,
                      cudaStream_t stream);

// dst[rows[i], :] += weights[i] * src[i, :] for i in [0, n). `rows` must be distinct (one
// expert sees a token at most once), so no two threads write the same element.
void cuda_scatter_add_rows(const float* src, const int32_t* rows, const float* weights, int64_t n,
                           int64_t cols, float* dst, cudaStream_t stream);

// x[i] += y[i] for i in [0, n).
void cuda_add_inplace(float* x, const float* y, int64_t n, cudaStream_t stream);

}  // namespace m3::model
