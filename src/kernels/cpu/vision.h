// The CPU ops of the MiniMax-M3 vision tower (m3-model.md §7): LayerNorm with bias, bias add,
// exact (erf) GELU, rotary embedding from precomputed cos/sin rows, and bidirectional attention
// inside segments (one segment per image: the block-diagonal mask without materialising it).
// Called by the tower's forward (model/vision_forward.h through model/vision_ops.h) per layer.
// Conventions as kernels/cpu/ops.h: fp32 activations row-major, bf16/f32 weights in place,
// fp32 accumulation (LayerNorm statistics in double), deterministic, multithreaded.
#pragma once

#include <cstdint>

#include "kernels/views.h"

namespace m3::kernels::cpu {

// out[r] = (x[r] - mean) / sqrt(var + eps) * w + b over rows of `dim` (biased variance, as
// torch.nn.LayerNorm). out may alias x.
void layer_norm(const float* x, int64_t rows, int64_t dim, const VecRef& w, const VecRef& b,
                float eps, float* out);

// y[r, :] += bias for rows x bias.n.
void add_bias_rows(float* y, int64_t rows, const VecRef& bias);

// x = 0.5 * x * (1 + erf(x / sqrt(2))) in place (torch's exact "gelu").
void gelu_erf(float* x, int64_t n);

// NeoX rotary on the first rot_dim dims of each head of x [n, num_heads, head_dim] in place:
// with half = rot_dim / 2, (x1, x2) = (x[i], x[i + half]) -> (x1 c - x2 s, x2 c' + x1 s') where
// c = cos[t, i], s = sin[t, i], c' = cos[t, i + half], s' = sin[t, i + half]; cos/sin are
// [n, rot_dim] (the duplicated layout transformers builds).
void rope_cos_sin(float* x, int64_t n, int64_t num_heads, int64_t head_dim, int64_t rot_dim,
                  const float* cos, const float* sin);

// Bidirectional multi-head attention of q, k, v [n, num_heads, head_dim] within segments
// [seg_starts[s], seg_starts[s + 1]) (num_segments + 1 entries, 0 .. n): a token attends to every
// token of its segment and none other. out [n, num_heads, head_dim]; fp32 softmax.
void attention_segments(const float* q, const float* k, const float* v, int64_t n,
                        int64_t num_heads, int64_t head_dim, const int64_t* seg_starts,
                        int64_t num_segments, float scale, float* out);

}  // namespace m3::kernels::cpu
