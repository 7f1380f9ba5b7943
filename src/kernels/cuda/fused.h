// Fused CUDA ops of the GPU forward (kernels/cuda/fused_prep.cu): each equals a sequence of the
// CPU ops in kernels/cpu/ops.h run one after another, and is tested against its CPU twin in
// kernels/cpu/fused.h, which is that sequence (tests/kernels/fused_cuda_test.cpp). They exist to
// cut launches and activation round trips in decode steps. Invariant: device pointers only; enqueue
// on `stream`, no host sync.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

// x[r] += y[r], then out[r] = rmsnorm_gemma(x[r]) with `w` (rows x dim; out must not alias x).
void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                       float eps, float* out, cudaStream_t stream);

// One attention layer's preparation after its projections (AttnPrepArgs in kernels/views.h):
// rmsnorm_gemma + rope_neox on q, k (and iq, ik), then kv_write.
void attn_prep(const AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout,
               cudaStream_t stream);

// SwiGLU-OAI over one fused gate|up projection: gate_up [n, 2 * inter] (row t = gate(inter) then
// up(inter)) -> out [n, inter], i.e. swiglu_oai(gate, up) on the two halves.
void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                     float beta, float* out, cudaStream_t stream);

}  // namespace m3::kernels::cuda
