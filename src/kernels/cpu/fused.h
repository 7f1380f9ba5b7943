// The fused M3 ops on the CPU: twins of kernels/cuda/fused.h with the same names and arguments
// (less the stream). Each is the sequence of plain ops in kernels/cpu/ops.h it stands for, run
// one after another, so the CPU forward computes exactly what the unfused reference computes
// and the CUDA fused ops are tested against these (tests/kernels/fused_cuda_test.cpp).
// Called by the one forward (model/m3_forward.h through model/cpu_ops.h).
#pragma once

#include <cstdint>

#include "kernels/cpu/ops.h"

namespace m3::kernels::cpu {

// x[r] += y[r] (add_inplace), then out[r] = rmsnorm_gemma(x[r]) with `w` (rows x dim; out must
// not alias x).
void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                       float eps, float* out);

// One attention layer's preparation after its projections (AttnPrepArgs in kernels/views.h):
// rmsnorm_gemma then rope_neox on q, k (and iq, ik) per head, then kv_write of k, v (and ik).
void attn_prep(const AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout);

// SwiGLU-OAI over one fused gate|up projection: gate_up [n, 2 * inter] (row t = gate(inter) then
// up(inter)) -> out [n, inter], i.e. swiglu_oai(gate, up) on the two halves.
void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                     float beta, float* out);

}  // namespace m3::kernels::cpu
