// M3Forward<Ops>: the MiniMax-M3 text model's forward pass (m3-model.md §3-4), written once over
// the M3 ops. `Ops` is model/cpu_ops.h's CpuOps (the reference kernels/cpu ops on host memory)
// or model/cuda/cuda_ops.h's CudaOps (the kernels/cuda ops on one GPU stream); both offer the
// same member functions, the op's arguments less the stream, plus scratch buffers by name and the
// collectives of a shard. M3Model (CPU) and M3ModelCuda (GPU) each own one M3Forward and one Ops
// and add only what differs by device: where the step's arrays live, CUDA graphs, sampling.
// Layer order, the attention with MSA, the dense MLP and the MoE (router, expert parallel, shared
// expert), the collectives at the tensor-parallel and data-parallel seams, the final norm and the
// lm_head exist here and nowhere else.
// Invariants: K, V and index-K of every step token are written into its page before any
// attention reads the cache; no allocation or host sync inside run_layers beyond what Ops does
// when a buffer grows (the CUDA graphs capture run_layers after an eager run sized everything),
// except the MSA capture (a host copy) and, on the GPU, a MoE above its grouped-path size.
// Data parallel (plan.data_sharded()): the host splits each step by sequence owner
// (model/dp_batch_split.h); every rank runs run_layers on its own tokens, or run_idle() when it
// has none, after set_dp_step_rows(the step's largest rank token count).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/check.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/m3_model.h"
#include "model/shard.h"
#include "model/weights.h"

namespace m3::model {

// Named scratch buffers of a forward (the Ops own them; a name's buffer keeps its contents while
// it does not grow, and grows only by Ops::f32 / Ops::i32 asking for more).
enum class Buf {
  kX,
  kA,
  kQ,
  kK,
  kV,
  kAttn,
  kY,
  kIq,
  kIk,
  kProj,
  kG,
  kU,
  kRouterLogits,
  kRouteW,
  kHs,
  kLogits,
  kTpMine,
  kTpLocal,
  kTpAll,
  kDpSend,
  kDpAll,
  kDpRouted,
  kDpSendW,  // all-to-all dispatch (MoeDispatch::kAllToAll): the picks' weights sent / received
  kDpRecvW,
  kDpBack,  // the experts' results of this rank's rows, back from their ranks
  kDpAcc,   // their rank-ordered sum
  kDpTmp,
  kAux,  // AuxCapture's rows where the caller keeps them in Ops memory (the GPU model)
  kCount
};
enum class IBuf {
  kSel,
  kRouteIds,
  kSelAll,
  kDpCounts,     // all-to-all dispatch: this rank's send counts, then every rank's
  kDpTok,        // the source slot of each row sent, grouped by destination
  kDpPicks,      // [rows sent, k] the picks localised to the destination (-1: not its expert)
  kDpRecvPicks,  // [rows received, k]
  kCount
};

// Input embeddings given for some rows of a step (image tokens): x[rows[i]] = values[i, :].
struct EmbedOverride {
  const int32_t* rows = nullptr;  // [n] ascending row indices of the step
  const float* values = nullptr;  // [n, hidden] f32
  int64_t n = 0;
};

// The residual stream entering some layers, copied out for an EAGLE-3 draft (speculative
// decoding): for each j, layer layers[j]'s input (layers[j] == num_hidden_layers: the output of
// the last layer, before the final norm) into columns [j * hidden, (j + 1) * hidden) of
// out [T, n * hidden] f32 (the Ops' memory).
struct AuxCapture {
  const int32_t* layers = nullptr;  // [n] host
  int64_t n = 0;
  float* out = nullptr;
};

template <class Ops>
class M3Forward {
 public:
  using MatRef = kernels::MatRef;
  using VecRef = kernels::VecRef;
  using KvPages = kernels::KvPages;
  using TokenLayout = kernels::TokenLayout;

  // `w` holds the views the forward reads (host or device memory, the Ops' kind), `fused_proj`
  // per layer one q|k|v(|index q|index k) matrix or a null MatRef where the projections are
  // separate. Both must outlive this object. Router biases stored in bf16 are widened here once
  // (host memory only; the GPU model uploads them as f32).
  M3Forward(const M3Config& cfg, const ShardPlan& plan, const M3Weights& w,
            std::vector<MatRef> fused_proj)
      : cfg_(cfg), plan_(plan), w_(w), fused_proj_(std::move(fused_proj)) {
    if (fused_proj_.empty()) fused_proj_.assign(w_.layers.size(), MatRef{});
    M3_CHECK(fused_proj_.size() == w_.layers.size());
    moe_.resize(w_.layers.size());
    for (size_t li = 0; li < w_.layers.size(); ++li) {
      if (cfg_.layer_is_moe[li]) moe_[li] = describe_moe(w_.layers[li]);
    }
  }

  const M3Config& config() const { return cfg_; }
  const ShardPlan& plan() const { return plan_; }

  // Attention data parallel only: the largest token count any rank has in the coming step (the
  // host knows every rank's count, so there is no count exchange). Each MoE layer all-gathers
  // this many rows from every rank (this rank's tokens, zero-padded).
  void set_dp_step_rows(int64_t max_rows) {
    M3_CHECK(plan_.data_sharded() && max_rows >= 1, "set_dp_step_rows(%lld) on a %s model",
             static_cast<long long>(max_rows), plan_.data_sharded() ? "data-parallel" : "non-DP");
    dp_rows_ = max_rows;
  }
  int64_t dp_step_rows() const { return plan_.data_sharded() ? dp_rows_ : 0; }
  // Data parallel: the bytes this rank's MoE layers have sent to other ranks so far (rows,
  // picks, weights, counts and results; the collectives' payloads, not the wire's protocol).
  int64_t moe_dispatch_bytes() const { return dispatch_bytes_; }

  // Embedding and every layer over the step's T tokens (`tokens` and `layout` in the Ops'
  // memory); the residual stream ends in Buf::kX [T, hidden] f32. max_kv_len: a host bound of
  // position + 1 over the tokens (sizes the MSA scores and KV splits on the GPU). msa_out (may
  // be null): per layer the selected blocks [T, num_kv_heads, topk] (host; a shard gathers every
  // rank's heads).
  // emb (may be null): rows whose input embedding replaces the table lookup (image placeholder
  // tokens), in the Ops' memory; applied after the embedding (and its TP all-reduce).
  // aux (may be null): the aux hidden states an EAGLE-3 draft reads (AuxCapture).
  template <class Cache>
  void run_layers(Ops& ops, const int32_t* tokens, const TokenLayout& layout, Cache& cache,
                  int64_t max_kv_len, ForwardResult* msa_out, const EmbedOverride* emb = nullptr,
                  const AuxCapture* aux = nullptr) const {
    const int64_t T = layout.num_tokens;
    const int64_t H = cfg_.hidden_size, nq = plan_.num_q_heads, nkv = plan_.num_kv_heads,
                  d = cfg_.head_dim;
    const bool tp = plan_.tensor_sharded();
    const float eps = static_cast<float>(cfg_.rms_norm_eps);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* x = ops.f32(Buf::kX, T * H);  // residual stream [T, hidden] f32
    float* a = ops.f32(Buf::kA, T * H);  // normed input of the next block
    float* q = ops.f32(Buf::kQ, T * nq * d);
    float* attn = ops.f32(Buf::kAttn, T * nq * d);
    float* y = ops.f32(Buf::kY, T * H);
    if (tp) {
      // This rank's vocabulary rows, zeros elsewhere; the all-reduce adds one non-zero term.
      ops.embedding_vocab_slice(w_.embed_tokens, plan_.vocab_begin, cfg_.vocab_size, H, tokens, T,
                                x);
      ops.all_reduce_sum(x, T * H);
    } else {
      ops.embedding(w_.embed_tokens, tokens, T, x);
    }
    if (emb != nullptr && emb->n > 0) {
      if constexpr (requires { ops.scatter_rows(x, emb->rows, emb->n, H, emb->values); }) {
        ops.scatter_rows(x, emb->rows, emb->n, H, emb->values);
      } else {
        M3_CHECK(false, "embedding overrides (image input) are not implemented on this backend");
      }
    }

    auto capture = [&](int64_t li) {
      for (int64_t j = 0; aux != nullptr && j < aux->n; ++j)
        if (aux->layers[j] == li) ops.copy_rows_2d(aux->out + j * H, aux->n * H, x, H, H, T);
    };
    for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li) {
      capture(li);
      const LayerWeights& L = w_.layers[li];
      const bool sparse = cfg_.layer_is_sparse[li];
      // a = input_norm(x); after the first layer the previous layer's residual add did it.
      if (li == 0) ops.rmsnorm_gemma(x, T, H, L.input_norm, eps, a);
      const KvPages pages = cache.layer(li);
      M3_CHECK(pages.num_kv_heads == nkv, "the KV cache holds %lld KV heads, this model %lld",
               static_cast<long long>(pages.num_kv_heads), static_cast<long long>(nkv));
      // Index-q heads follow the KV heads (index_n_heads == num_key_value_heads, config.cpp).
      const int64_t ni = sparse ? (tp ? nkv : cfg_.index_n_heads) : 0, di = cfg_.index_head_dim;
      float* iq = sparse ? ops.f32(Buf::kIq, T * ni * di) : nullptr;  // [T, ni, di]
      kernels::AttnPrepArgs pa;
      pa.q_out = q;  // q: [T, nq, d] after the prep
      pa.num_q_heads = nq;
      pa.num_kv_heads = nkv;
      pa.head_dim = d;
      pa.rot_dim = cfg_.rotary_dim;
      pa.q_norm = L.q_norm;
      pa.k_norm = L.k_norm;
      pa.eps = eps;
      pa.theta = cfg_.rope_theta;
      pa.scaling = cfg_.rope_scaling;
      if (sparse) {
        pa.iq_out = iq;
        pa.num_index_heads = ni;
        pa.index_dim = di;
        pa.index_rot_dim = std::min(cfg_.rotary_dim, di);
        pa.iq_norm = L.index_q_norm;
        pa.ik_norm = L.index_k_norm;
      }
      const MatRef& fused = fused_proj_[li];
      if (fused.data != nullptr) {
        // One projection: rows [q | k | v | index q | index k] of each token.
        M3_CHECK(fused.rows == (nq + 2 * nkv) * d + (sparse ? (ni + 1) * di : 0),
                 "fused projection of layer %lld has %lld rows", static_cast<long long>(li),
                 static_cast<long long>(fused.rows));
        float* proj = ops.f32(Buf::kProj, T * fused.rows);
        ops.linear(a, T, fused, proj);
        pa.in_stride = fused.rows;
        pa.q = proj;
        pa.k = proj + nq * d;
        pa.v = proj + (nq + nkv) * d;
        if (sparse) {
          pa.iq = proj + (nq + 2 * nkv) * d;
          pa.ik = pa.iq + ni * di;
        }
      } else {
        float* k = ops.f32(Buf::kK, T * nkv * d);
        float* v = ops.f32(Buf::kV, T * nkv * d);
        ops.linear(a, T, L.q_proj, q);  // q: [T, nq, d]
        ops.linear(a, T, L.k_proj, k);  // k: [T, nkv, d]
        ops.linear(a, T, L.v_proj, v);  // v: [T, nkv, d]
        pa.q = q;
        pa.k = k;
        pa.v = v;
        if (sparse) {
          float* ik = ops.f32(Buf::kIk, T * di);  // [T, di] (one shared head)
          ops.linear(a, T, L.index_q_proj, iq);
          ops.linear(a, T, L.index_k_proj, ik);
          pa.iq = iq;
          pa.ik = ik;
        }
      }
      // The host KV tier's copies of this layer (a GPU backend overlaps them with the layers
      // before): this step's first access of the layer's pages.
      if constexpr (requires { ops.wait_kv_layer(li); }) ops.wait_kv_layer(li);
      ops.attn_prep(pa, pages, layout);
      if (sparse) {
        const int64_t topk = cfg_.sparse_topk_blocks;
        int32_t* sel = ops.i32(IBuf::kSel, T * ni * topk);
        ops.msa_select_blocks(iq, ni, pages, layout, topk, cfg_.sparse_init_blocks,
                              cfg_.sparse_local_blocks, max_kv_len, sel);
        ops.attention_paged(q, nq, pages, layout, sel, topk, scale, max_kv_len, attn);
        if (msa_out) capture_msa(ops, sel, T, msa_out->msa_blocks[li]);
      } else {
        ops.attention_paged(q, nq, pages, layout, nullptr, 0, scale, max_kv_len, attn);
      }
      ops.linear(attn, T, L.o_proj, y);      // y: [T, hidden]
      if (tp) ops.all_reduce_sum(y, T * H);  // partial sums over this rank's heads
      ops.add_rmsnorm_gemma(x, y, T, H, L.post_attention_norm, eps, a);  // x += y; a = norm(x)
      if (cfg_.layer_is_moe[li]) {
        moe(ops, li, a, T, y);
      } else {
        dense_mlp(ops, L.gate_proj, L.up_proj, L.down_proj, a, T, y);
      }
      if (tp) ops.all_reduce_sum(y, T * H);  // partial sums over intermediate slices / experts
      if (li + 1 < cfg_.num_hidden_layers) {
        ops.add_rmsnorm_gemma(x, y, T, H, w_.layers[li + 1].input_norm, eps, a);
      } else {
        ops.add_inplace(x, y, T * H);
      }
    }
    capture(cfg_.num_hidden_layers);
  }

  // The step of a data-parallel rank with no tokens: joins every MoE layer's collectives with 0
  // rows of its own (the other ranks' tokens still meet this rank's experts).
  void run_idle(Ops& ops) const {
    M3_CHECK(plan_.data_sharded(), "run_idle on a model that is not data parallel");
    for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li)
      if (cfg_.layer_is_moe[li]) moe_dp(ops, li, nullptr, 0, nullptr);
  }

  // logits [R, vocab] f32 (the Ops' memory) of the residual rows `rows` [R] (the Ops' memory)
  // after run_layers: final norm, lm_head, and under tensor parallelism the all-gather of every
  // rank's vocabulary chunk.
  void logits(Ops& ops, const int32_t* rows, int64_t R, float* logits) const {
    const int64_t H = cfg_.hidden_size;
    float* hs = ops.f32(Buf::kHs, R * H);  // final-normed hidden states of the wanted rows
    ops.gather_rows(ops.f32(Buf::kX, 0), rows, R, H, hs);
    ops.rmsnorm_gemma(hs, R, H, w_.final_norm, static_cast<float>(cfg_.rms_norm_eps), hs);
    if (!plan_.tensor_sharded()) {
      ops.linear(hs, R, w_.lm_head, logits);
      return;
    }
    // Each rank scores its vocabulary chunk, padded to vocab_chunk columns so the all-gather has
    // one size, then the chunks are laid side by side. Every rank grows the same buffers
    // (`uneven` is a property of the split, not of the rank), so the ranks' buffer generations,
    // and with them their CUDA graph decisions, stay in step.
    const int64_t V = cfg_.vocab_size, C = plan_.vocab_chunk, W = plan_.world;
    const int64_t n = plan_.vocab_count;
    const bool uneven = C * W != V;
    float* mine = ops.f32(Buf::kTpMine, R * C);
    float* all = ops.f32(Buf::kTpAll, W * R * C);
    if (!uneven) {
      ops.linear(hs, R, w_.lm_head, mine);
    } else {
      float* local = ops.f32(Buf::kTpLocal, R * C);
      ops.fill_zero(mine, R * C);
      if (n > 0) {
        ops.linear(hs, R, w_.lm_head, local);
        ops.copy_rows_2d(mine, C, local, n, n, R);
      }
    }
    ops.all_gather(mine, R * C, all);
    for (int64_t r = 0; r < W; ++r) {
      const int64_t v0 = std::min(V, r * C), nw = std::min(V, v0 + C) - v0;
      if (nw > 0) ops.copy_rows_2d(logits + v0, V, all + r * R * C, C, nw, R);
    }
  }

 private:
  // A MoE layer's routed experts as the ops read them, and the router bias in f32.
  struct MoeLayer {
    kernels::MoeExpertWeights ew;
    std::vector<const void*> w1_of, w3_of, w2_of;  // scattered experts (host weights only)
    std::vector<MatRef> mats;                      // quantized experts: w1, w3, w2 per expert
    const float* bias = nullptr;
    std::vector<float> bias_f32;  // a bf16 bias widened (host weights only)
  };

  MoeLayer describe_moe(const LayerWeights& L) const {
    MoeLayer m;
    M3_CHECK(!L.experts.empty(), "MoE layer without experts");
    const MatRef& e0 = L.experts[0].w1;
    kernels::MoeExpertWeights& ew = m.ew;
    ew.w1 = e0.data;
    ew.w3 = L.experts[0].w3.data;
    ew.w2 = L.experts[0].w2.data;
    ew.dtype = e0.dtype;
    ew.num_experts = static_cast<int64_t>(L.experts.size());
    ew.inter = e0.rows;
    ew.hidden = cfg_.hidden_size;
    // Experts laid out back to back per projection (the GPU model's upload and synthetic
    // weights) are read from the bases; others (a checkpoint read in place) by pointer arrays.
    const size_t per = static_cast<size_t>(ew.inter * ew.hidden) * dtype_size(ew.dtype);
    bool contiguous = true;
    // Quantized experts go by views; a projection may differ in format from the others (a
    // shard's column slice off the block grid is dequantised to f32; the GPU model then uploads
    // the layer's experts as f32).
    const ExpertWeights& E0 = L.experts[0];
    for (const MatRef* p : {&E0.w1, &E0.w3, &E0.w2})
      if (p->quantized()) ew.quant = p->quant;
    ew.global_scales = L.expert_global_scales;  // device NVFP4 scales (GPU model only)
    for (int64_t e = 0; e < ew.num_experts; ++e) {
      const ExpertWeights& E = L.experts[e];
      M3_CHECK(E.w1.quant == E0.w1.quant && E.w3.quant == E0.w3.quant && E.w2.quant == E0.w2.quant,
               "MoE layer: expert %lld's formats differ from expert 0's",
               static_cast<long long>(e));
      if (ew.quant != kernels::WeightQuant::kNone) {
        m.mats.insert(m.mats.end(), {E.w1, E.w3, E.w2});
        contiguous = false;
        continue;
      }
      M3_CHECK(E.w1.dtype == ew.dtype && E.w3.dtype == ew.dtype && E.w2.dtype == ew.dtype &&
                   E.w1.rows == ew.inter && E.w3.rows == ew.inter && E.w2.cols == ew.inter,
               "MoE layer: expert %lld differs from expert 0 in shape or dtype",
               static_cast<long long>(e));
      contiguous = contiguous && E.w1.data == static_cast<const uint8_t*>(ew.w1) + e * per &&
                   E.w3.data == static_cast<const uint8_t*>(ew.w3) + e * per &&
                   E.w2.data == static_cast<const uint8_t*>(ew.w2) + e * per;
      m.w1_of.push_back(E.w1.data);
      m.w3_of.push_back(E.w3.data);
      m.w2_of.push_back(E.w2.data);
    }
    if (contiguous) {
      m.w1_of.clear();
      m.w3_of.clear();
      m.w2_of.clear();
    }
    if (L.router_bias.n > 0) {
      if (L.router_bias.dtype == DType::kF32) {
        m.bias = static_cast<const float*>(L.router_bias.data);
      } else {
        m.bias_f32.resize(L.router_bias.n);
        L.router_bias.to_f32(m.bias_f32.data());
      }
    }
    return m;
  }

  // The views of moe_[li] with its pointer arrays (vectors may have moved with the object).
  kernels::MoeExpertWeights moe_weights(int64_t li, const float** bias) const {
    const MoeLayer& m = moe_[li];
    kernels::MoeExpertWeights ew = m.ew;
    if (!m.mats.empty()) ew.mats_of = m.mats.data();
    if (!m.w1_of.empty()) {
      ew.w1_of = m.w1_of.data();
      ew.w3_of = m.w3_of.data();
      ew.w2_of = m.w2_of.data();
    }
    *bias = m.bias_f32.empty() ? m.bias : m.bias_f32.data();
    return ew;
  }

  // The MSA selection of this step's layer to the host, laid out [T, all KV heads, topk].
  void capture_msa(Ops& ops, const int32_t* sel, int64_t T, std::vector<int32_t>& dst) const {
    const int64_t k = cfg_.sparse_topk_blocks, nl = plan_.num_kv_heads;
    if (!plan_.tensor_sharded()) {
      dst.resize(static_cast<size_t>(T * nl * k));
      ops.download(dst.data(), sel, T * nl * k);
      return;
    }
    // Each rank selected blocks for its KV heads; with replicated KV heads several ranks hold
    // the same head and the same selection.
    const int64_t nkv = cfg_.num_key_value_heads, W = plan_.world;
    int32_t* all = ops.i32(IBuf::kSelAll, W * T * nl * k);
    ops.all_gather(sel, T * nl * k, all);
    std::vector<int32_t> host(static_cast<size_t>(W * T * nl * k));
    ops.download(host.data(), all, W * T * nl * k);
    dst.assign(static_cast<size_t>(T * nkv * k), -1);
    for (int r = 0; r < W; ++r) {
      const int64_t g0 = plan_.kv_head_begin_of(r);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < nl; ++j)
          std::copy_n(host.begin() + ((r * T + t) * nl + j) * k, k,
                      dst.begin() + (t * nkv + g0 + j) * k);
    }
  }

  // out [n, hidden] = down(swiglu_oai(gate(x), up(x))).
  void dense_mlp(Ops& ops, const MatRef& gate, const MatRef& up, const MatRef& down, const float* x,
                 int64_t n, float* out) const {
    const int64_t inter = gate.rows;
    const float alpha = static_cast<float>(cfg_.swiglu_alpha),
                limit = static_cast<float>(cfg_.swiglu_limit),
                beta = static_cast<float>(cfg_.swiglu_beta);
    float* g = ops.f32(Buf::kG, n * inter);  // [n, inter] f32
    // gate and up stored back to back (the GPU model fuses them): one projection of 2 x inter.
    const bool adjacent = gate.dtype == DType::kBF16 && up.dtype == DType::kBF16 &&
                          gate.cols == up.cols && up.rows == inter &&
                          static_cast<const uint16_t*>(gate.data) + inter * gate.cols == up.data;
    if (adjacent) {
      float* gu = ops.f32(Buf::kU, n * 2 * inter);  // [n, gate | up] f32
      ops.linear(x, n, MatRef{gate.data, DType::kBF16, 2 * inter, gate.cols}, gu);
      ops.swiglu_oai_rows(gu, n, inter, alpha, limit, beta, g);
    } else {
      float* u = ops.f32(Buf::kU, n * inter);  // [n, inter] f32
      ops.linear(x, n, gate, g);
      ops.linear(x, n, up, u);
      ops.swiglu_oai(g, u, n, inter, alpha, limit, beta, g);
    }
    ops.linear(g, n, down, out);  // out: [n, hidden] f32
  }

  void moe(Ops& ops, int64_t li, const float* x, int64_t n, float* out) const {
    if (plan_.data_sharded()) {
      moe_dp(ops, li, x, n, out);
      return;
    }
    const LayerWeights& L = w_.layers[li];
    routed_experts(ops, li, x, n, L.has_shared_expert, out);
  }

  // The router over n rows of x: ids [n, k] (global expert ids) and their weights wts [n, k], in
  // fp32 (the router weight is f32 in M3 checkpoints), the bias for selection only.
  void route(Ops& ops, int64_t li, const float* x, int64_t n, const float* bias, int32_t* ids,
             float* wts) const {
    const LayerWeights& L = w_.layers[li];
    const int64_t ne = cfg_.num_local_experts, k = cfg_.num_experts_per_tok;
    float* logits = ops.f32(Buf::kRouterLogits, n * ne);  // [n, experts] f32
    const float scale = static_cast<float>(cfg_.routed_scaling_factor);
    // The GEMV and the top-k in one launch for a decode step's few rows (CudaOps).
    if constexpr (requires {
                    ops.router_fused(x, n, L.router, bias, k, scale, logits, ids, wts);
                  }) {
      if (ops.router_fuses(n, L.router, k, x)) {
        ops.router_fused(x, n, L.router, bias, k, scale, logits, ids, wts);
        return;
      }
    }
    ops.linear(x, n, L.router, logits);
    ops.router_topk(logits, n, ne, bias, k, scale, ids, wts);
  }

  // Router + this rank's experts over n rows of x: out = routed, plus the layer's shared expert
  // with `with_shared` (inside the routed experts' GEMVs where the backend can: CudaOps'
  // moe_experts_shared; else dense_mlp first).
  void routed_experts(Ops& ops, int64_t li, const float* x, int64_t n, bool with_shared,
                      float* out) const {
    const LayerWeights& L = w_.layers[li];
    const int64_t ne = cfg_.num_local_experts, k = cfg_.num_experts_per_tok;
    int32_t* ids = ops.i32(IBuf::kRouteIds, n * k);
    float* wts = ops.f32(Buf::kRouteW, n * k);
    const float* bias = nullptr;
    const kernels::MoeExpertWeights ew = moe_weights(li, &bias);
    route(ops, li, x, n, bias, ids, wts);
    // Expert parallel: this rank holds experts [expert_begin, + num_experts); picks of the
    // others become -1 and add nothing here (the all-reduce after the block adds the other
    // ranks'; under data parallelism the reduce-scatter in moe_dp).
    if (plan_.expert_parallel && plan_.sharded()) {
      M3_CHECK(ew.num_experts == plan_.num_experts);
      ops.moe_localize_ids(ids, n * k, plan_.expert_begin, plan_.num_experts);
    } else {
      M3_CHECK(ew.num_experts == ne);
    }
    const kernels::SwigluParams act{static_cast<float>(cfg_.swiglu_alpha),
                                    static_cast<float>(cfg_.swiglu_limit),
                                    static_cast<float>(cfg_.swiglu_beta)};
    if (!with_shared) {
      ops.moe_experts(x, n, ids, wts, k, ew, act, nullptr, out);
      return;
    }
    if constexpr (requires(kernels::MoeSharedExpert sx) {
                    ops.moe_experts_shared(x, n, ids, wts, k, ew, sx, act, out);
                  }) {
      const kernels::MoeSharedExpert sx{L.shared_gate, L.shared_up, L.shared_down};
      if (ops.moe_fuses_shared(n, x, ew, sx)) {
        ops.moe_experts_shared(x, n, ids, wts, k, ew, sx, act, out);
        return;
      }
    }
    dense_mlp(ops, L.shared_gate, L.shared_up, L.shared_down, x, n, out);  // out = shared
    ops.moe_experts(x, n, ids, wts, k, ew, act, out, out);
  }

  // Attention data parallel: every rank's tokens meet every rank's experts. The rows are padded
  // to the step's largest count (set_dp_step_rows, from the host), so the collectives have one
  // size and no count exchange or host sync is needed; padded rows are zeros, run through the
  // experts like any row (each row's result depends on that row alone), and are dropped by their
  // owner. out = shared expert (local) + the first n rows of the reduce-scatter.
  void moe_dp(Ops& ops, int64_t li, const float* x, int64_t n, float* out) const {
    if (plan_.moe_all_to_all) {
      moe_dp_a2a(ops, li, x, n, out);
      return;
    }
    const LayerWeights& L = w_.layers[li];
    const int64_t h = cfg_.hidden_size, W = plan_.world, nmax = dp_rows_;
    M3_CHECK(nmax >= 1 && n <= nmax,
             "data-parallel MoE: %lld rows here but the step's largest is %lld "
             "(set_dp_step_rows)",
             static_cast<long long>(n), static_cast<long long>(nmax));
    float* send = ops.f32(Buf::kDpSend, nmax * h);
    float* all = ops.f32(Buf::kDpAll, W * nmax * h);
    float* routed = ops.f32(Buf::kDpRouted, W * nmax * h);
    if (n > 0) ops.copy(send, x, n * h);
    if (n < nmax) ops.fill_zero(send + n * h, (nmax - n) * h);
    ops.all_gather(send, nmax * h, all);  // all: [W * nmax, hidden]
    // Router (replicated) + this rank's experts (EP: its whole experts; else its intermediate
    // slice of every expert) over every rank's rows: partial sums the reduce-scatter completes.
    routed_experts(ops, li, all, W * nmax, false, routed);
    ops.reduce_scatter_sum(routed, nmax * h, send);  // send: [nmax, hidden]
    // What this rank sent to the others: its padded rows to each, its partial sums of theirs.
    dispatch_bytes_ += 2 * (W - 1) * nmax * h * static_cast<int64_t>(sizeof(float));
    if (n == 0) return;  // a rank without tokens this step only joins the collectives
    if (L.has_shared_expert) {
      dense_mlp(ops, L.shared_gate, L.shared_up, L.shared_down, x, n, out);  // whole shared
      ops.add_inplace(out, send, n * h);
    } else {
      ops.copy(out, send, n * h);
    }
  }

  // Data parallel + expert parallel with MoeDispatch::kAllToAll. Each rank routes its own n rows
  // and sends row t to rank d once if any of its top-k experts lies in d's range
  // [d * E/W, (d + 1) * E/W). Per destination, rows ascending by source slot, three messages:
  // the hidden rows [m_d, hidden] f32, the picks [m_d, k] i32 localised to d (-1: another rank's
  // expert) and the token's k router weights [m_d, k] f32; the source slot stays here, as the
  // results return in the order sent. Before them, one all-gather of every rank's W row counts
  // (so each rank knows what it receives). The receiver runs its experts over everything it
  // received (rank 0's rows first) in one moe_experts call, returns the [m, hidden] results by the
  // reverse all-to-all, and the source adds them onto zeros in rank order: the reduce-scatter's
  // order in the all-gather path, whose other terms are exact zeros, and every row's expert sum
  // depends on that row alone; so the outputs are the all-gather path's, bitwise on the CPU (up to
  // the sign of an all-zero row). The host reads the routing and the counts (two syncs a layer on
  // a GPU, which is why that backend keeps kAllGather for its CUDA graphs by default).
  void moe_dp_a2a(Ops& ops, int64_t li, const float* x, int64_t n, float* out) const {
    const LayerWeights& L = w_.layers[li];
    const int64_t h = cfg_.hidden_size, k = cfg_.num_experts_per_tok, W = plan_.world,
                  per = plan_.num_experts;
    const int me = plan_.rank;
    const float* bias = nullptr;
    const kernels::MoeExpertWeights ew = moe_weights(li, &bias);
    M3_CHECK(plan_.expert_parallel && ew.num_experts == per,
             "all-to-all MoE dispatch without whole experts per rank");
    A2aHost& hs = a2a_;
    hs.ids.resize(static_cast<size_t>(n * k));
    float* wts = ops.f32(Buf::kRouteW, std::max<int64_t>(1, n * k));
    if (n > 0) {
      int32_t* ids = ops.i32(IBuf::kRouteIds, n * k);
      route(ops, li, x, n, bias, ids, wts);
      ops.download(hs.ids.data(), ids, n * k);
    }
    // The rows for each destination and their localised picks.
    hs.tok.clear();
    hs.picks.clear();
    hs.counts.assign(static_cast<size_t>(W), 0);
    for (int d = 0; d < W; ++d) {
      const int64_t e0 = d * per;
      for (int64_t t = 0; t < n; ++t) {
        const int32_t* row = hs.ids.data() + t * k;
        if (std::none_of(row, row + k, [&](int32_t e) { return e >= e0 && e < e0 + per; }))
          continue;
        hs.tok.push_back(static_cast<int32_t>(t));
        for (int64_t j = 0; j < k; ++j)
          hs.picks.push_back(row[j] >= e0 && row[j] < e0 + per ? static_cast<int32_t>(row[j] - e0)
                                                               : -1);
        ++hs.counts[d];
      }
    }
    const int64_t m = static_cast<int64_t>(hs.tok.size());
    // Counts first: cnt [W] this rank's, then [W, W] every rank's (row s: what s sends to each).
    int32_t* cnt = ops.i32(IBuf::kDpCounts, W + W * W);
    ops.upload(cnt, hs.counts.data(), W);
    ops.all_gather(cnt, W, cnt + W);
    hs.all.resize(static_cast<size_t>(W * W));
    ops.download(hs.all.data(), cnt + W, W * W);
    hs.sc.resize(static_cast<size_t>(2 * W));  // elements to each rank: rows * hidden, rows * k
    hs.rc.resize(static_cast<size_t>(2 * W));
    int64_t R = 0;  // rows received
    for (int s = 0; s < W; ++s) {
      M3_CHECK(hs.all[me * W + s] == hs.counts[s],
               "all-to-all MoE dispatch: rank %d's counts came back changed", me);
      const int64_t rs = hs.all[s * W + me];
      M3_CHECK(rs >= 0, "all-to-all MoE dispatch: rank %d sends %lld rows", s,
               static_cast<long long>(rs));
      hs.sc[s] = hs.counts[s] * h;
      hs.sc[W + s] = hs.counts[s] * k;
      hs.rc[s] = rs * h;
      hs.rc[W + s] = rs * k;
      R += rs;
    }
    const int64_t* sch = hs.sc.data();
    const int64_t* sck = hs.sc.data() + W;
    const int64_t* rch = hs.rc.data();
    const int64_t* rck = hs.rc.data() + W;
    auto at_least_one = [](int64_t v) { return std::max<int64_t>(1, v); };
    int32_t* itok = ops.i32(IBuf::kDpTok, at_least_one(m));
    int32_t* spick = ops.i32(IBuf::kDpPicks, at_least_one(m * k));
    int32_t* rpick = ops.i32(IBuf::kDpRecvPicks, at_least_one(R * k));
    float* sx = ops.f32(Buf::kDpSend, at_least_one(m * h));
    float* sw = ops.f32(Buf::kDpSendW, at_least_one(m * k));
    float* rx = ops.f32(Buf::kDpAll, at_least_one(R * h));
    float* rw = ops.f32(Buf::kDpRecvW, at_least_one(R * k));
    float* ry = ops.f32(Buf::kDpRouted, at_least_one(R * h));
    float* back = ops.f32(Buf::kDpBack, at_least_one(m * h));
    if (m > 0) {
      ops.upload(itok, hs.tok.data(), m);
      ops.upload(spick, hs.picks.data(), m * k);
      ops.gather_rows(x, itok, m, h, sx);
      ops.gather_rows(wts, itok, m, k, sw);
    }
    ops.all_to_all_v(sx, sch, rx, rch);
    ops.all_to_all_v(spick, sck, rpick, rck);
    ops.all_to_all_v(sw, sck, rw, rck);
    if (R > 0) {
      const kernels::SwigluParams act{static_cast<float>(cfg_.swiglu_alpha),
                                      static_cast<float>(cfg_.swiglu_limit),
                                      static_cast<float>(cfg_.swiglu_beta)};
      ops.moe_experts(rx, R, rpick, rw, k, ew, act, nullptr, ry);
    }
    ops.all_to_all_v(ry, rch, back, sch);  // back: [m, hidden], grouped by destination
    {
      const int64_t f = sizeof(float);
      int64_t bytes = (W - 1) * W * static_cast<int64_t>(sizeof(int32_t));
      for (int s = 0; s < W; ++s)
        if (s != me) bytes += (hs.sc[s] + 2 * hs.sc[W + s] + hs.rc[s]) * f;
      dispatch_bytes_ += bytes;
    }
    if (n == 0) return;  // a rank without tokens this step only joins the collectives
    // acc [n, hidden] = the destinations' results added in rank order onto zeros.
    float* acc = ops.f32(Buf::kDpAcc, n * h);
    float* tmp = ops.f32(Buf::kDpTmp, n * h);
    ops.fill_zero(acc, n * h);
    int64_t off = 0;
    for (int d = 0; d < W; ++d) {
      const int64_t c = hs.counts[d];
      if (c == 0) continue;
      ops.fill_zero(tmp, n * h);
      ops.scatter_rows(tmp, itok + off, c, h, back + off * h);
      ops.add_inplace(acc, tmp, n * h);
      off += c;
    }
    if (L.has_shared_expert) {
      dense_mlp(ops, L.shared_gate, L.shared_up, L.shared_down, x, n, out);  // whole shared
      ops.add_inplace(out, acc, n * h);
    } else {
      ops.copy(out, acc, n * h);
    }
  }

  // Host arrays of moe_dp_a2a (kept to reuse their memory; the forward is not reentrant).
  struct A2aHost {
    std::vector<int32_t> ids, tok, picks, counts, all;
    std::vector<int64_t> sc, rc;
  };

  const M3Config& cfg_;
  const ShardPlan& plan_;
  const M3Weights& w_;
  std::vector<MatRef> fused_proj_;
  std::vector<MoeLayer> moe_;
  int64_t dp_rows_ = 0;
  mutable A2aHost a2a_;
  mutable int64_t dispatch_bytes_ = 0;
};

}  // namespace m3::model
