// The CUDA (sm_90a) versions of the vision tower's CPU ops (kernels/cpu/vision.h): LayerNorm with
// bias, bias add, exact (erf) GELU, rotary embedding from cos/sin tables, and bidirectional
// attention inside segments. Same argument lists and semantics as the CPU ops, device pointers
// (except the segment starts, a host array: they size the launches), the stream last. Called by
// model/cuda/vision_cuda.cpp (VisionCudaOps); tested against the CPU ops (vision_cuda_test).
// Invariant: every op only enqueues work on `stream` (no host sync, no allocation; the attention
// takes a caller's workspace) and checks each launch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/views.h"

namespace m3::kernels::cuda {

// out[r] = (x[r] - mean) / sqrt(var + eps) * w + b over rows of `dim` (biased variance); fp32
// statistics (two passes over the row). out may alias x.
void layer_norm(const float* x, int64_t rows, int64_t dim, const VecRef& w, const VecRef& b,
                float eps, float* out, cudaStream_t stream);

// y[r, :] += bias for rows x bias.n.
void add_bias_rows(float* y, int64_t rows, const VecRef& bias, cudaStream_t stream);

// x = 0.5 * x * (1 + erf(x / sqrt(2))) in place.
void gelu_erf(float* x, int64_t n, cudaStream_t stream);

// NeoX rotary on the first rot_dim dims of each head from cos/sin [n, rot_dim] (device), as the
// CPU op (the duplicated layout: the second half uses cos/sin[t, i + half]).
void rope_cos_sin(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
                  const float* cos, const float* sin, cudaStream_t stream);

// Bidirectional multi-head attention of q, k, v [n, num_heads, head_dim] inside the segments
// [seg_starts[s], seg_starts[s + 1]) (host array of num_segments + 1 entries, 0 .. n). Per
// segment and chunk of query rows: one strided-batched cuBLASLt GEMM over the heads for the
// scores S = Q·Kᵀ, a softmax kernel (fp32, scale inside, exp of s - max), and one for P·V into
// out [n, num_heads, head_dim]. Under GemmPrecision::kBf16 Q, K, V and P are rounded to bf16
// for the tensor cores (fp32 accumulation); under kExact everything is fp32 (no TF32).
// ws.bytes >= attention_segments_workspace_bytes(n, num_heads, head_dim, 1, longest segment):
// more lets more query rows share one GEMM.
void attention_segments(const float* q, const float* k, const float* v, int64_t n,
                        int64_t num_heads, int64_t head_dim, const int64_t* seg_starts,
                        int64_t num_segments, float scale, Workspace ws, float* out,
                        cudaStream_t stream);
// Bytes of workspace for query chunks of `chunk_rows` rows against segments of up to
// `max_seg_len` keys, under the current GEMM precision.
size_t attention_segments_workspace_bytes(int64_t n, int64_t num_heads, int64_t head_dim,
                                          int64_t chunk_rows, int64_t max_seg_len);

}  // namespace m3::kernels::cuda
