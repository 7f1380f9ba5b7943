#include "model/cuda/m3_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "kernels/cuda/ops.h"
#include "model/cuda/row_ops.h"

namespace m3::model {

namespace ops = kernels::cuda;

namespace {
// Left free after the weights for the KV cache, scratch and the CUDA context's own needs.
constexpr size_t kHeadroomBytes = size_t{512} << 20;

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}
}  // namespace

Result<std::unique_ptr<M3ModelCuda>> M3ModelCuda::load(const std::string& model_dir,
                                                       const LoadOptions& opts, int device) {
  // Probe first: without a GPU there is no point reading the checkpoint.
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(device));
  (void)info;
  M3_TRY(auto host, M3Model::load(model_dir, opts));
  return from_host(std::move(host), device);
}

Result<std::unique_ptr<M3ModelCuda>> M3ModelCuda::from_host(std::unique_ptr<M3Model> host,
                                                            int device) {
  M3_CHECK(host != nullptr);
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(device));  // also makes `device` current
  const M3Weights& w = host->weights();
  const size_t need = w.bytes_in_place + w.bytes_owned;
  if (need + kHeadroomBytes > info.free_bytes) {
    return make_error(ErrorCode::kUnavailable,
                      "the model's weights need " + gib(need) + " of GPU memory (plus " +
                          gib(kHeadroomBytes) + " headroom) but " + info.name + " (device " +
                          std::to_string(device) + ") has " + gib(info.free_bytes) +
                          " free; use a smaller model or --device cpu",
                      "--device");
  }
  std::unique_ptr<M3ModelCuda> m(new M3ModelCuda(std::move(host)));
  m->upload_weights();
  return m;
}

M3ModelCuda::M3ModelCuda(std::unique_ptr<M3Model> host) : host_(std::move(host)) {}

MatRef M3ModelCuda::upload(const MatRef& m) {
  MatRef r = m;
  if (m.data == nullptr || m.rows * m.cols == 0) return r;
  const size_t bytes = static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype);
  storage_.emplace_back(bytes);
  storage_.back().copy_from(static_cast<const uint8_t*>(m.data), bytes);
  weight_bytes_ += bytes;
  r.data = storage_.back().data();
  return r;
}

VecRef M3ModelCuda::upload(const VecRef& v) {
  VecRef r = v;
  if (v.data == nullptr || v.n == 0) return r;
  const size_t bytes = static_cast<size_t>(v.n) * dtype_size(v.dtype);
  storage_.emplace_back(bytes);
  storage_.back().copy_from(static_cast<const uint8_t*>(v.data), bytes);
  weight_bytes_ += bytes;
  r.data = storage_.back().data();
  return r;
}

VecRef M3ModelCuda::upload_f32(const VecRef& v) {
  VecRef r = v;
  if (v.data == nullptr || v.n == 0) return r;
  std::vector<float> f(v.n);
  v.to_f32(f.data());  // exactly what the CPU forward feeds router_topk
  const size_t bytes = f.size() * sizeof(float);
  storage_.emplace_back(bytes);
  storage_.back().copy_from(reinterpret_cast<const uint8_t*>(f.data()), bytes);
  weight_bytes_ += bytes;
  r.data = storage_.back().data();
  r.dtype = DType::kF32;
  return r;
}

void M3ModelCuda::upload_weights() {
  const M3Weights& w = host_->weights();
  dev_.embed_tokens = upload(w.embed_tokens);
  // Tied embeddings share one host tensor: share the device copy too.
  dev_.lm_head = w.lm_head.data == w.embed_tokens.data ? dev_.embed_tokens : upload(w.lm_head);
  dev_.final_norm = upload(w.final_norm);
  dev_.layers.resize(w.layers.size());
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& h = w.layers[i];
    LayerWeights& d = dev_.layers[i];
    d.input_norm = upload(h.input_norm);
    d.post_attention_norm = upload(h.post_attention_norm);
    d.q_proj = upload(h.q_proj);
    d.k_proj = upload(h.k_proj);
    d.v_proj = upload(h.v_proj);
    d.o_proj = upload(h.o_proj);
    d.q_norm = upload(h.q_norm);
    d.k_norm = upload(h.k_norm);
    d.index_q_proj = upload(h.index_q_proj);
    d.index_k_proj = upload(h.index_k_proj);
    d.index_q_norm = upload(h.index_q_norm);
    d.index_k_norm = upload(h.index_k_norm);
    d.gate_proj = upload(h.gate_proj);
    d.up_proj = upload(h.up_proj);
    d.down_proj = upload(h.down_proj);
    d.router = upload(h.router);
    d.router_bias = upload_f32(h.router_bias);
    d.experts.resize(h.experts.size());
    for (size_t e = 0; e < h.experts.size(); ++e) {
      d.experts[e].w1 = upload(h.experts[e].w1);
      d.experts[e].w3 = upload(h.experts[e].w3);
      d.experts[e].w2 = upload(h.experts[e].w2);
    }
    d.has_shared_expert = h.has_shared_expert;
    d.shared_gate = upload(h.shared_gate);
    d.shared_up = upload(h.shared_up);
    d.shared_down = upload(h.shared_down);
  }
}

template <class T>
T* M3ModelCuda::ensure(gpu::DeviceBuffer<T>& b, size_t n) {
  if (b.size() < n) {
    stream_.synchronize();  // kernels may still read the old buffer
    b = gpu::DeviceBuffer<T>(n);
  }
  return b.data();
}

template <class T>
T* M3ModelCuda::upload_async(gpu::DeviceBuffer<T>& b, const T* host, size_t n) {
  T* d = ensure(b, n);
  // From pageable memory the runtime stages the bytes before returning, so `host` may change
  // right after; the copy itself is ordered on the stream before the kernels that read it.
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(d, host, n * sizeof(T), cudaMemcpyHostToDevice, stream_.get()));
  return d;
}

void M3ModelCuda::dense_mlp(const MatRef& gate, const MatRef& up, const MatRef& down,
                            const float* x, int64_t n, float* out) {
  const M3Config& cfg = config();
  const int64_t inter = gate.rows;
  cudaStream_t s = stream_.get();
  float* g = ensure(ws_.g, n * inter);  // [n, inter] f32
  float* u = ensure(ws_.u, n * inter);  // [n, inter] f32
  ops::linear(x, n, gate, g, s);
  ops::linear(x, n, up, u, s);
  ops::swiglu_oai(g, u, n, inter, static_cast<float>(cfg.swiglu_alpha),
                  static_cast<float>(cfg.swiglu_limit), static_cast<float>(cfg.swiglu_beta), g, s);
  ops::linear(g, n, down, out, s);  // out: [n, hidden] f32
}

void M3ModelCuda::moe(const LayerWeights& L, const float* x, int64_t n, float* out) {
  const M3Config& cfg = config();
  const int64_t h = cfg.hidden_size, ne = cfg.num_local_experts, k = cfg.num_experts_per_tok;
  cudaStream_t s = stream_.get();
  // Router on the GPU (f32 weight, bias for selection only), then ids/weights to the host.
  float* logits = ensure(ws_.router_logits, n * ne);  // [n, experts] f32
  ops::linear(x, n, L.router, logits, s);
  int32_t* ids = ensure(ws_.route_ids, n * k);
  float* wts = ensure(ws_.route_w, n * k);
  ops::router_topk(logits, n, ne, L.router_bias.n > 0 ? static_cast<const float*>(L.router_bias.data)
                                                      : nullptr,
                   k, static_cast<float>(cfg.routed_scaling_factor), ids, wts, s);
  h_ids_.resize(n * k);
  h_w_.resize(n * k);
  M3_CUDA_CHECK(cudaMemcpyAsync(h_ids_.data(), ids, n * k * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, s));
  M3_CUDA_CHECK(cudaMemcpyAsync(h_w_.data(), wts, n * k * sizeof(float), cudaMemcpyDeviceToHost, s));
  stream_.synchronize();

  // Group by expert (counting sort, tokens ascending within an expert, as the CPU path does).
  h_offsets_.assign(ne + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) {
    M3_CHECK(h_ids_[i] >= 0 && h_ids_[i] < ne, "router_topk gave expert %d of %lld", h_ids_[i],
             static_cast<long long>(ne));
    ++h_offsets_[h_ids_[i] + 1];
  }
  for (int64_t e = 0; e < ne; ++e) h_offsets_[e + 1] += h_offsets_[e];
  h_rows_.resize(n * k);
  h_tok_w_.resize(n * k);
  std::vector<int32_t> fill(h_offsets_.begin(), h_offsets_.end() - 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = h_ids_[t * k + j];
      h_rows_[fill[e]] = static_cast<int32_t>(t);
      h_tok_w_[fill[e]] = h_w_[t * k + j];
      ++fill[e];
    }
  }
  const int32_t* rows = upload_async(ws_.tok_rows, h_rows_.data(), h_rows_.size());
  const float* tok_w = upload_async(ws_.tok_w, h_tok_w_.data(), h_tok_w_.size());

  // Each active expert over its gathered tokens, accumulated weighted in expert order.
  float* routed = ensure(ws_.routed, n * h);  // [n, hidden] f32
  float* xe = ensure(ws_.xe, n * h);          // gathered tokens, at most n per expert
  float* ye = ensure(ws_.ye, n * h);
  M3_CUDA_CHECK(cudaMemsetAsync(routed, 0, n * h * sizeof(float), s));
  for (int64_t e = 0; e < ne; ++e) {
    const int64_t begin = h_offsets_[e], m = h_offsets_[e + 1] - begin;
    if (m == 0) continue;
    cuda_gather_rows(x, rows + begin, m, h, xe, s);
    dense_mlp(L.experts[e].w1, L.experts[e].w3, L.experts[e].w2, xe, m, ye);
    cuda_scatter_add_rows(ye, rows + begin, tok_w + begin, m, h, routed, s);
  }
  if (L.has_shared_expert) {
    dense_mlp(L.shared_gate, L.shared_up, L.shared_down, x, n, out);
    cuda_add_inplace(out, routed, n * h, s);
  } else {
    M3_CUDA_CHECK(cudaMemcpyAsync(out, routed, n * h * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
}

void M3ModelCuda::forward(const ForwardBatch& b, KvCacheCuda& cache, ForwardResult* out,
                          bool capture_msa) {
  const M3Config& cfg = config();
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  M3_CHECK(!b.block_table_offsets.empty() && !b.block_table.empty());
  M3_CHECK(cache.page_size() == cfg.sparse_block_size);
  const int64_t H = cfg.hidden_size, nq = cfg.num_attention_heads, nkv = cfg.num_key_value_heads,
                d = cfg.head_dim;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  cudaStream_t s = stream_.get();

  // The step's host arrays, copied to the device once per step.
  const int32_t* tokens = upload_async(ws_.tokens, b.token_ids.data(), T);
  ops::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = upload_async(ws_.positions, b.positions.data(), T);
  layout.seq_ids = upload_async(ws_.seq_ids, b.seq_ids.data(), T);
  layout.block_table_offsets =
      upload_async(ws_.bt_offsets, b.block_table_offsets.data(), b.block_table_offsets.size());
  layout.block_table = upload_async(ws_.block_table, b.block_table.data(), b.block_table.size());

  float* x = ensure(ws_.x, T * H);  // residual stream [T, hidden] f32
  float* a = ensure(ws_.a, T * H);
  float* q = ensure(ws_.q, T * nq * d);
  float* k = ensure(ws_.k, T * nkv * d);
  float* v = ensure(ws_.v, T * nkv * d);
  float* attn = ensure(ws_.attn, T * nq * d);
  float* y = ensure(ws_.y, T * H);
  ops::embedding(dev_.embed_tokens, tokens, T, x, s);

  if (out) {
    out->msa_blocks.clear();
    if (capture_msa) out->msa_blocks.resize(cfg.num_hidden_layers);
  }

  for (int64_t li = 0; li < cfg.num_hidden_layers; ++li) {
    const LayerWeights& L = dev_.layers[li];
    const bool sparse = cfg.layer_is_sparse[li];
    ops::rmsnorm_gemma(x, T, H, L.input_norm, eps, a, s);
    ops::linear(a, T, L.q_proj, q, s);  // q: [T, nq, d]
    ops::linear(a, T, L.k_proj, k, s);  // k: [T, nkv, d]
    ops::linear(a, T, L.v_proj, v, s);  // v: [T, nkv, d]
    ops::rmsnorm_gemma(q, T * nq, d, L.q_norm, eps, q, s);
    ops::rmsnorm_gemma(k, T * nkv, d, L.k_norm, eps, k, s);
    ops::rope_neox(q, T, nq, d, cfg.rotary_dim, layout.positions, cfg.rope_theta, s);
    ops::rope_neox(k, T, nkv, d, cfg.rotary_dim, layout.positions, cfg.rope_theta, s);
    const ops::KvPages pages = cache.layer(li);
    if (sparse) {
      const int64_t ni = cfg.index_n_heads, di = cfg.index_head_dim;
      const int64_t irot = std::min(cfg.rotary_dim, di);
      float* iq = ensure(ws_.iq, T * ni * di);  // [T, ni, di]
      float* ik = ensure(ws_.ik, T * di);       // [T, di] (one shared head)
      ops::linear(a, T, L.index_q_proj, iq, s);
      ops::linear(a, T, L.index_k_proj, ik, s);
      ops::rmsnorm_gemma(iq, T * ni, di, L.index_q_norm, eps, iq, s);
      ops::rmsnorm_gemma(ik, T, di, L.index_k_norm, eps, ik, s);
      ops::rope_neox(iq, T, ni, di, irot, layout.positions, cfg.rope_theta, s);
      ops::rope_neox(ik, T, 1, di, irot, layout.positions, cfg.rope_theta, s);
      ops::kv_write(pages, layout, k, v, ik, s);
      const int64_t topk = cfg.sparse_topk_blocks;
      int32_t* sel = ensure(ws_.sel, T * ni * topk);
      ops::msa_select_blocks(iq, ni, pages, layout, topk, cfg.sparse_init_blocks,
                             cfg.sparse_local_blocks, sel, s);
      ops::attention_paged(q, nq, pages, layout, sel, topk, scale, attn, s);
      if (out && capture_msa) {
        auto& dst = out->msa_blocks[li];
        dst.resize(T * ni * topk);
        M3_CUDA_CHECK(cudaMemcpyAsync(dst.data(), sel, dst.size() * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, s));
        stream_.synchronize();  // sel is rewritten by the next sparse layer
      }
    } else {
      ops::kv_write(pages, layout, k, v, nullptr, s);
      ops::attention_paged(q, nq, pages, layout, nullptr, 0, scale, attn, s);
    }
    ops::linear(attn, T, L.o_proj, y, s);  // y: [T, hidden]
    cuda_add_inplace(x, y, T * H, s);

    ops::rmsnorm_gemma(x, T, H, L.post_attention_norm, eps, a, s);
    if (cfg.layer_is_moe[li]) {
      moe(L, a, T, y);
    } else {
      dense_mlp(L.gate_proj, L.up_proj, L.down_proj, a, T, y);
    }
    cuda_add_inplace(x, y, T * H, s);
  }

  if (!out) {
    stream_.synchronize();  // the cache holds this step's tokens once forward returns
    return;
  }
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  const int64_t V = cfg.vocab_size;
  out->vocab_size = V;
  out->logits.assign(R * V, 0.f);
  if (R == 0) {
    stream_.synchronize();
    return;
  }
  for (int32_t t : b.logits_indices) M3_CHECK(t >= 0 && t < T, "logits index %d of %lld", t,
                                              static_cast<long long>(T));
  const int32_t* rows = upload_async(ws_.logit_rows, b.logits_indices.data(), R);
  float* hs = ensure(ws_.hs, R * H);  // final-normed hidden states of the wanted rows
  cuda_gather_rows(x, rows, R, H, hs, s);
  ops::rmsnorm_gemma(hs, R, H, dev_.final_norm, eps, hs, s);
  float* logits = ensure(ws_.logits, R * V);  // [R, vocab] f32
  ops::linear(hs, R, dev_.lm_head, logits, s);
  M3_CUDA_CHECK(cudaMemcpyAsync(out->logits.data(), logits, R * V * sizeof(float),
                                cudaMemcpyDeviceToHost, s));
  stream_.synchronize();
}

}  // namespace m3::model
