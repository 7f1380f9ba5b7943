// Fused CUDA ops of the GPU forward (kernels/cuda/fused_prep.cu): each equals a sequence of the
// CPU ops in kernels/cpu/ops.h run one after another, and is tested against that sequence
// (tests/kernels/fused_cuda_test.cpp). They exist to cut launches and activation round trips in
// decode steps. Invariant: device pointers only; enqueue on `stream`, no host sync.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"

namespace m3::kernels::cuda {

// x[r] += y[r], then out[r] = rmsnorm_gemma(x[r]) with `w` (rows x dim; out must not alias x).
void add_rmsnorm_gemma(float* x, const float* y, int64_t rows, int64_t dim, const VecRef& w,
                       float eps, float* out, cudaStream_t stream);

// One attention layer's preparation after its projections:
//   q_out  = rope(rmsnorm_gemma(q, q_norm), rot_dim)        per query head
//   iq_out = rope(rmsnorm_gemma(iq, iq_norm), index_rot_dim) per index head (if any)
//   page K = rope(rmsnorm_gemma(k, k_norm), rot_dim), page V = v, per KV head
//   page index-K = rope(rmsnorm_gemma(ik, ik_norm), index_rot_dim) (if any)
// i.e. rmsnorm_gemma + rope_neox on each, then kv_write. The inputs are token rows `in_stride`
// floats apart (one fused projection's output: q | k | v | iq | ik columns), or packed per
// tensor when in_stride is 0; q_out / iq_out are packed [T, heads, dim] and may equal q / iq
// when those are packed. Full-attention layers pass num_index_heads = 0.
struct AttnPrepArgs {
  const float* q = nullptr;
  float* q_out = nullptr;
  int64_t num_q_heads = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0, rot_dim = 0;
  VecRef q_norm, k_norm;
  const float* iq = nullptr;
  float* iq_out = nullptr;
  const float* ik = nullptr;
  int64_t num_index_heads = 0;
  int64_t index_dim = 0, index_rot_dim = 0;
  VecRef iq_norm, ik_norm;
  int64_t in_stride = 0;  // floats between token rows of q, k, v, iq, ik (0: packed)
  float eps = 1e-6f;
  double theta = 10000.0;
};
void attn_prep(const AttnPrepArgs& a, const KvPages& cache, const TokenLayout& layout,
               cudaStream_t stream);

// SwiGLU-OAI over one fused gate|up projection: gate_up [n, 2 * inter] (row t = gate(inter) then
// up(inter)) -> out [n, inter], i.e. swiglu_oai(gate, up) on the two halves.
void swiglu_oai_rows(const float* gate_up, int64_t n, int64_t inter, float alpha, float limit,
                     float beta, float* out, cudaStream_t stream);

}  // namespace m3::kernels::cuda
