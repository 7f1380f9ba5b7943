// Eagle3Forward<Ops>: the EAGLE-3 draft layer's forward (model/eagle3_draft.h), written once over
// the same ops as M3Forward (CpuOps; CudaOps offers the same members), so the GPU reuses it.
// Called by Eagle3Draft::forward. Invariant: the step's K/V are written into the draft's pages
// (attn_prep) before attention_paged reads them; no allocation beyond the Ops' buffer growth.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/check.h"
#include "kernels/views.h"
#include "model/eagle3_draft.h"
#include "model/m3_forward.h"

namespace m3::model {

template <class Ops>
class Eagle3Forward {
 public:
  Eagle3Forward(const Eagle3Config& cfg, const Eagle3Weights& w) : cfg_(cfg), w_(w) {}

  // tokens [T], hidden_in [T, hidden_in_width] (aux rows through fc when hidden_is_aux, else the
  // previous step's pre-norm rows), all in the Ops' memory. Leaves the pre-norm output in
  // Buf::kX [T, hidden] and, for the R rows `rows`, the draft logits [R, draft_vocab] in `logits`.
  template <class Pages>
  void run(Ops& ops, const int32_t* tokens, const kernels::TokenLayout& layout, const Pages& pages,
           const float* hidden_in, bool hidden_is_aux, int64_t max_kv_len, const int32_t* rows,
           int64_t R, float* logits) const {
    const int64_t T = layout.num_tokens, H = cfg_.hidden_size, nq = cfg_.num_attention_heads,
                  nkv = cfg_.num_key_value_heads, d = cfg_.head_dim, inter = cfg_.intermediate_size;
    const float eps = static_cast<float>(cfg_.rms_norm_eps);
    float* x = ops.f32(Buf::kX, T * H);  // residual: the hidden branch [T, hidden] f32
    if (hidden_is_aux) {
      ops.linear(hidden_in, T, w_.fc, x);  // fc: [T, aux * target_hidden] -> [T, hidden]
    } else {
      ops.copy(x, hidden_in, T * H);
    }
    float* e = ops.f32(Buf::kY, T * H);  // embeddings, then their norm
    ops.embedding(w_.embed_tokens, tokens, T, e);
    ops.rmsnorm_gemma(e, T, H, w_.input_norm, eps, e);
    float* hn = ops.f32(Buf::kA, T * H);
    ops.rmsnorm_gemma(x, T, H, w_.hidden_norm, eps, hn);
    float* cat = ops.f32(Buf::kProj, T * 2 * H);  // [T, norm(embed) | norm(hidden)]
    ops.copy_rows_2d(cat, 2 * H, e, H, H, T);
    ops.copy_rows_2d(cat + H, 2 * H, hn, H, H, T);
    float* q = ops.f32(Buf::kQ, T * nq * d);
    float* k = ops.f32(Buf::kK, T * nkv * d);
    float* v = ops.f32(Buf::kV, T * nkv * d);
    ops.linear(cat, T, w_.q_proj, q);  // q: [T, nq, d]
    ops.linear(cat, T, w_.k_proj, k);  // k: [T, nkv, d]
    ops.linear(cat, T, w_.v_proj, v);  // v: [T, nkv, d]
    kernels::AttnPrepArgs pa;
    pa.q = q;
    pa.q_out = q;
    pa.num_q_heads = nq;
    pa.k = k;
    pa.v = v;
    pa.num_kv_heads = nkv;
    pa.head_dim = d;
    pa.rot_dim = d;  // Llama: the whole head rotates (NeoX halves)
    pa.eps = eps;    // q_norm / k_norm left empty: no QK-norm
    pa.theta = cfg_.rope_theta;
    ops.attn_prep(pa, pages, layout);
    float* attn = ops.f32(Buf::kAttn, T * nq * d);
    ops.attention_paged(q, nq, pages, layout, nullptr, 0, 1.0f / std::sqrt(static_cast<float>(d)),
                        max_kv_len, attn);
    float* y = ops.f32(Buf::kY, T * H);
    ops.linear(attn, T, w_.o_proj, y);                                   // y: [T, hidden]
    ops.add_rmsnorm_gemma(x, y, T, H, w_.post_attention_norm, eps, hn);  // x += y; hn = norm(x)
    float* g = ops.f32(Buf::kG, T * inter);
    float* u = ops.f32(Buf::kU, T * inter);
    ops.linear(hn, T, w_.gate_proj, g);
    ops.linear(hn, T, w_.up_proj, u);
    // SiLU(gate) * up is SwiGLU-OAI with alpha 1, no clamp and no up offset.
    ops.swiglu_oai(g, u, T, inter, 1.0f, FLT_MAX, 0.0f, g);
    ops.linear(g, T, w_.down_proj, y);
    ops.add_inplace(x, y, T * H);  // x: the pre-norm output [T, hidden]
    if (R == 0) return;
    float* hs = ops.f32(Buf::kHs, R * H);
    ops.gather_rows(x, rows, R, H, hs);
    ops.rmsnorm_gemma(hs, R, H, w_.final_norm, eps, hs);
    ops.linear(hs, R, w_.lm_head, logits);  // logits: [R, draft_vocab]
  }

 private:
  const Eagle3Config& cfg_;
  const Eagle3Weights& w_;
};

}  // namespace m3::model
