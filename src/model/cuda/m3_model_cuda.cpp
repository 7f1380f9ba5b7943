#include "model/cuda/m3_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/check.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "kernels/cuda/fused.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample.h"
#include "model/cuda/row_ops.h"
#include "model/cuda/synthetic_weights.h"
#include "model/synthetic_model.h"

namespace m3::model {

namespace ops = kernels::cuda;

namespace {
// Left free after the weights for the KV cache, scratch and the CUDA context's own needs.
constexpr size_t kHeadroomBytes = size_t{512} << 20;
// MSA scores beyond this are computed token chunk by token chunk (prefill at long contexts).
constexpr size_t kAttnWorkspaceCap = size_t{64} << 20;
// Steps of up to this many tokens replay CUDA graphs: the MoE's grouped path (no host sync)
// takes this many; above it the MoE reads its expert counts on the host.
constexpr int64_t kGraphMaxTokens = ops::kMoeGemvMaxTokens;
// The key-count bound passed to attention / MSA is rounded up to this many tokens.
constexpr int64_t kKvLenBucket = 1024;
constexpr size_t kMaxGraphs = 1024;

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
                                                            int device, dist::Communicator* comm,
                                                            cudaStream_t comm_stream) {
  M3_CHECK(host != nullptr);
  const ShardPlan& plan = host->shard_plan();
  if (plan.sharded()) {  // tensor parallel, or attention data parallel (its MoE collectives)
    M3_CHECK(comm != nullptr && comm_stream != nullptr,
             "a sharded GPU model needs a device communicator and its stream");
    M3_CHECK(comm->rank() == plan.rank && comm->world_size() == plan.world,
             "communicator rank %d/%d does not match the shard %d/%d", comm->rank(),
             comm->world_size(), plan.rank, plan.world);
  }
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(device));  // also makes `device` current
  const M3Weights& w = host->weights();
  // A shard's views do not count their bytes (shard_weights): add up what will be uploaded.
  size_t need = w.bytes_in_place + w.bytes_owned;
  if (plan.sharded()) {
    auto bytes = [](const MatRef& m) {
      return m.data ? static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype) : size_t{0};
    };
    need = bytes(w.embed_tokens) + (w.lm_head.data == w.embed_tokens.data ? 0 : bytes(w.lm_head));
    for (const LayerWeights& L : w.layers) {
      for (const MatRef* m : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.index_q_proj,
                              &L.index_k_proj, &L.gate_proj, &L.up_proj, &L.down_proj, &L.router,
                              &L.shared_gate, &L.shared_up, &L.shared_down})
        need += bytes(*m);
      for (const ExpertWeights& E : L.experts) need += bytes(E.w1) + bytes(E.w2) + bytes(E.w3);
    }
  }
  if (need + kHeadroomBytes > info.free_bytes) {
    return make_error(ErrorCode::kUnavailable,
                      "the model's weights need " + gib(need) + " of GPU memory (plus " +
                          gib(kHeadroomBytes) + " headroom) but " + info.name + " (device " +
                          std::to_string(device) + ") has " + gib(info.free_bytes) +
                          " free; use a smaller model or --device cpu",
                      "--device");
  }
  M3Config cfg = host->config();
  std::unique_ptr<M3ModelCuda> m(new M3ModelCuda(std::move(cfg), std::move(host)));
  if (m->plan_.sharded()) m->attach_communicator(comm, comm_stream);
  m->upload_weights();
  m->fuse_attention_projections();
  return m;
}

void M3ModelCuda::attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream) {
  M3_CHECK(comm != nullptr && comm_stream != nullptr,
           "a tensor-parallel GPU shard needs a device communicator and its stream");
  M3_CHECK(comm->rank() == plan_.rank && comm->world_size() == plan_.world,
           "communicator rank %d/%d does not match the shard %d/%d", comm->rank(),
           comm->world_size(), plan_.rank, plan_.world);
  comm_ = comm;
  comm_stream_ = comm_stream;
  M3_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
  M3_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
}

Result<std::unique_ptr<M3ModelCuda>> M3ModelCuda::synthetic(const M3Config& cfg, uint64_t seed,
                                                            int device, const ShardPlan* shard,
                                                            dist::Communicator* comm,
                                                            cudaStream_t comm_stream) {
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(device));  // also makes `device` current
  if (shard != nullptr && shard->sharded()) {
    const size_t need = static_cast<size_t>(synthetic_weight_bytes(cfg, *shard));
    if (need + kHeadroomBytes > info.free_bytes) {
      return make_error(ErrorCode::kUnavailable,
                        "synthetic:layers=" + std::to_string(cfg.num_hidden_layers) + " needs " +
                            gib(need) + " of weights on rank " + std::to_string(shard->rank) +
                            " of " + std::to_string(shard->world) + " (plus " +
                            gib(kHeadroomBytes) + " headroom) but " + info.name + " (device " +
                            std::to_string(device) + ") has " + gib(info.free_bytes) +
                            " free; use fewer layers or more ranks",
                        "--model");
    }
    std::unique_ptr<M3ModelCuda> m(new M3ModelCuda(cfg, nullptr));
    m->plan_ = *shard;
    if (comm != nullptr) m->attach_communicator(comm, comm_stream);
    m->generate_weights(seed);
    m->fuse_attention_projections();
    return m;
  }
  const size_t need = static_cast<size_t>(synthetic_weight_bytes(cfg));
  if (need + kHeadroomBytes > info.free_bytes) {
    // What fits: the fixed part (embeddings, dense layers 0-2) plus whole MoE layers.
    const int64_t per_moe = cfg.num_hidden_layers > 3
                                ? synthetic_weight_bytes(synthetic_m3_config(4)) -
                                      synthetic_weight_bytes(synthetic_m3_config(3))
                                : 0;
    int64_t max_layers = 0;
    for (int64_t l = 1; l <= kSyntheticMaxLayers; ++l) {
      if (static_cast<size_t>(synthetic_weight_bytes(synthetic_m3_config(l))) + kHeadroomBytes <=
          info.free_bytes)
        max_layers = l;
    }
    return make_error(ErrorCode::kUnavailable,
                      "synthetic:layers=" + std::to_string(cfg.num_hidden_layers) + " needs " +
                          gib(need) + " of weights on the GPU (plus " + gib(kHeadroomBytes) +
                          " headroom; " + gib(static_cast<size_t>(per_moe)) +
                          " per MoE layer) but " + info.name + " (device " +
                          std::to_string(device) + ") has " + gib(info.free_bytes) +
                          " free; use layers=" + std::to_string(max_layers) + " or fewer",
                      "--model");
  }
  std::unique_ptr<M3ModelCuda> m(new M3ModelCuda(cfg, nullptr));
  m->generate_weights(seed);
  m->fuse_attention_projections();
  return m;
}

M3ModelCuda::M3ModelCuda(M3Config cfg, std::unique_ptr<M3Model> host)
    : cfg_(std::move(cfg)), host_(std::move(host)) {
  if (host_) {
    plan_ = host_->shard_plan();
  } else {
    auto plan = make_shard_plan(cfg_, ShardSpec{});
    M3_CHECK(plan.has_value(), "unsharded plan: %s", plan ? "" : plan.error().message.c_str());
    plan_ = *plan;
  }
  const char* eager = std::getenv("M3_ENFORCE_EAGER");
  use_graphs_ = !(eager != nullptr && std::string(eager) == "1");
}

MatRef M3ModelCuda::fuse_rows(const std::vector<MatRef*>& parts) {
  int64_t rows = 0;
  bool ok = !parts.empty();
  for (MatRef* m : parts) {
    ok = ok && m->data != nullptr && m->dtype == DType::kBF16 && m->cols == parts[0]->cols;
    rows += m->rows;
  }
  if (!ok) return MatRef{};  // e.g. f32 matrices: kept separate
  // One matrix of the parts' rows back to back; the old buffers are released (each part is a
  // whole tensor of its own allocation) and the views become row slices of the new one.
  const size_t row_bytes = static_cast<size_t>(parts[0]->cols) * sizeof(uint16_t);
  gpu::DeviceBuffer<uint8_t> fused(static_cast<size_t>(rows) * row_bytes);
  size_t at = 0;
  for (MatRef* m : parts) {
    const size_t bytes = static_cast<size_t>(m->rows) * row_bytes;
    M3_CUDA_CHECK(cudaMemcpy(fused.data() + at, m->data, bytes, cudaMemcpyDeviceToDevice));
    for (auto& b : storage_) {
      if (b.data() == m->data) b = gpu::DeviceBuffer<uint8_t>();
    }
    m->data = fused.data() + at;
    at += bytes;
  }
  MatRef r{fused.data(), DType::kBF16, rows, parts[0]->cols};
  storage_.push_back(std::move(fused));
  return r;
}

void M3ModelCuda::fuse_attention_projections() {
  fused_proj_.assign(dev_.layers.size(), MatRef{});
  for (size_t li = 0; li < dev_.layers.size(); ++li) {
    LayerWeights& L = dev_.layers[li];
    // q | k | v (| index q | index k): one GEMV/GEMM per layer instead of five.
    std::vector<MatRef*> parts = {&L.q_proj, &L.k_proj, &L.v_proj};
    if (cfg_.layer_is_sparse[li]) {
      parts.push_back(&L.index_q_proj);
      parts.push_back(&L.index_k_proj);
    }
    fused_proj_[li] = fuse_rows(parts);
    // gate | up of the dense MLP or the shared expert (dense_mlp sees them adjacent).
    if (cfg_.layer_is_moe[li]) {
      if (L.has_shared_expert) fuse_rows({&L.shared_gate, &L.shared_up});
    } else {
      fuse_rows({&L.gate_proj, &L.up_proj});
    }
  }
}

void* M3ModelCuda::alloc_weight(size_t bytes) {
  storage_.emplace_back(bytes);
  weight_bytes_ += bytes;
  return storage_.back().data();
}

void M3ModelCuda::generate_weights(uint64_t seed) {
  const M3Config& c = cfg_;
  const ShardPlan& p = plan_;  // the whole model unless this is a rank's shard
  const int64_t h = c.hidden_size, d = c.head_dim, di = c.index_head_dim;
  cudaStream_t s = stream_.get();
  uint64_t next_id = 0;  // tensor ids in a fixed order: the same seed gives the same weights
  // Uniform in [-b, b) has std b/sqrt(3): b = sqrt(3/fan_in) gives std 1/sqrt(fan_in), so a
  // matrix maps unit-variance inputs to unit-variance outputs (fan_in of the whole matrix, so a
  // rank's columns are the whole model's).
  auto fill = [&](const FillBlock& b, float std_dev) {
    auto* p16 = static_cast<uint16_t*>(alloc_weight(b.size() * sizeof(uint16_t)));
    fill_uniform_bf16_block(p16, b, std_dev * std::sqrt(3.0f), seed, next_id++, s);
    return p16;
  };
  // Rows [r0, r0 + nr) of a [rows, cols] matrix.
  auto rows_of = [&](int64_t rows, int64_t cols, int64_t r0, int64_t nr, float std_dev) {
    FillBlock b = FillBlock::whole(rows, cols);
    b.row_begin = r0;
    b.row_count = nr;
    return MatRef{fill(b, std_dev), DType::kBF16, nr, cols};
  };
  // Columns [c0, c0 + nc) of a [rows, cols] matrix.
  auto cols_of = [&](int64_t rows, int64_t cols, int64_t c0, int64_t nc) {
    FillBlock b = FillBlock::whole(rows, cols);
    b.col_begin = c0;
    b.col_count = nc;
    return MatRef{fill(b, 1.0f / std::sqrt(static_cast<float>(cols))), DType::kBF16, rows, nc};
  };
  auto linear_rows = [&](int64_t out, int64_t in, int64_t r0, int64_t nr) {
    return rows_of(out, in, r0, nr, 1.0f / std::sqrt(static_cast<float>(in)));
  };
  // Gemma norms scale by (1 + w): small w keeps the scale near 1 while still exercising w.
  auto norm = [&](int64_t n) {
    VecRef v;
    v.dtype = DType::kBF16;
    v.n = n;
    auto* p16 = static_cast<uint16_t*>(alloc_weight(static_cast<size_t>(n) * sizeof(uint16_t)));
    fill_uniform_bf16(p16, static_cast<size_t>(n), 0.05f, seed, next_id++, s);
    v.data = p16;
    return v;
  };
  // Experts of a layer: one allocation per projection, this rank's experts back to back; the
  // whole tensor is [all experts, rows, cols], of which the rank holds rows or columns [x0, +nx)
  // of each of its experts.
  auto experts_proj = [&](int64_t rows, int64_t cols, bool slice_rows, int64_t x0, int64_t nx,
                          std::vector<ExpertWeights>& ex, MatRef ExpertWeights::*field) {
    FillBlock b = FillBlock::whole(rows, cols, c.num_local_experts);
    b.outer_begin = p.expert_begin;
    b.outer_count = p.num_experts;
    (slice_rows ? b.row_begin : b.col_begin) = x0;
    (slice_rows ? b.row_count : b.col_count) = nx;
    uint16_t* base = fill(b, 1.0f / std::sqrt(static_cast<float>(cols)));
    const size_t per = static_cast<size_t>(b.row_count * b.col_count);
    for (int64_t e = 0; e < p.num_experts; ++e) {
      ex[e].*field = MatRef{base + e * per, DType::kBF16, b.row_count, b.col_count};
    }
  };

  dev_.embed_tokens = rows_of(c.vocab_size, h, p.vocab_begin, p.vocab_count, 1.0f);
  dev_.final_norm = norm(h);
  dev_.lm_head = linear_rows(c.vocab_size, h, p.vocab_begin, p.vocab_count);
  dev_.layers.resize(c.num_hidden_layers);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& L = dev_.layers[i];
    L.input_norm = norm(h);
    L.post_attention_norm = norm(h);
    L.q_proj = linear_rows(c.q_size(), h, p.q_head_begin * d, p.num_q_heads * d);
    L.k_proj = linear_rows(c.kv_size(), h, p.kv_head_begin * d, p.num_kv_heads * d);
    L.v_proj = linear_rows(c.kv_size(), h, p.kv_head_begin * d, p.num_kv_heads * d);
    L.o_proj = cols_of(h, c.q_size(), p.q_head_begin * d, p.num_q_heads * d);
    L.q_norm = norm(d);
    L.k_norm = norm(d);
    if (c.layer_is_sparse[i]) {
      // Index-q heads follow the KV heads (model/shard.cpp); index-K is whole on every rank.
      const int64_t ni = p.tensor_sharded() ? p.num_kv_heads : c.index_n_heads;
      const int64_t i0 = p.tensor_sharded() ? p.kv_head_begin : 0;
      L.index_q_proj = linear_rows(c.index_n_heads * di, h, i0 * di, ni * di);
      L.index_k_proj = linear_rows(di, h, 0, di);
      L.index_q_norm = norm(di);
      L.index_k_norm = norm(di);
    }
    if (c.layer_is_moe[i]) {
      const int64_t ne = c.num_local_experts, inter = c.intermediate_size;
      // Router f32 [experts, hidden] as in M3 checkpoints; logits of std 1 spread the sigmoid.
      L.router.dtype = DType::kF32;
      L.router.rows = ne;
      L.router.cols = h;
      auto* rw = static_cast<float*>(alloc_weight(static_cast<size_t>(ne * h) * sizeof(float)));
      fill_uniform_f32(rw, static_cast<size_t>(ne * h), std::sqrt(3.0f / static_cast<float>(h)),
                       seed, next_id++, s);
      L.router.data = rw;
      // Selection-only bias, small next to the logits so routing still depends on the token.
      L.router_bias.dtype = DType::kF32;
      L.router_bias.n = ne;
      auto* rb = static_cast<float*>(alloc_weight(static_cast<size_t>(ne) * sizeof(float)));
      fill_uniform_f32(rb, static_cast<size_t>(ne), 0.01f, seed, next_id++, s);
      L.router_bias.data = rb;
      L.experts.resize(p.num_experts);
      experts_proj(inter, h, true, p.expert_inter_begin, p.expert_inter, L.experts,
                   &ExpertWeights::w1);
      experts_proj(inter, h, true, p.expert_inter_begin, p.expert_inter, L.experts,
                   &ExpertWeights::w3);
      experts_proj(h, inter, false, p.expert_inter_begin, p.expert_inter, L.experts,
                   &ExpertWeights::w2);
      L.has_shared_expert = c.shared_intermediate_size > 0;
      if (L.has_shared_expert) {
        const int64_t si = c.shared_intermediate_size;
        L.shared_gate = linear_rows(si, h, p.shared_inter_begin, p.shared_inter);
        L.shared_up = linear_rows(si, h, p.shared_inter_begin, p.shared_inter);
        L.shared_down = cols_of(h, si, p.shared_inter_begin, p.shared_inter);
      }
    } else {
      const int64_t di2 = c.dense_intermediate_size;
      L.gate_proj = linear_rows(di2, h, p.dense_inter_begin, p.dense_inter);
      L.up_proj = linear_rows(di2, h, p.dense_inter_begin, p.dense_inter);
      L.down_proj = cols_of(h, di2, p.dense_inter_begin, p.dense_inter);
    }
  }
  stream_.synchronize();  // weights are complete before any forward reads them
}

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
    // Experts: one buffer per projection, expert e at e * rows * cols (what moe_experts reads).
    d.experts.resize(h.experts.size());
    auto upload_experts = [&](MatRef ExpertWeights::*field) {
      if (h.experts.empty()) return;
      const MatRef& first = h.experts[0].*field;
      const size_t per = static_cast<size_t>(first.rows * first.cols) * dtype_size(first.dtype);
      auto* base = static_cast<uint8_t*>(alloc_weight(per * h.experts.size()));
      for (size_t e = 0; e < h.experts.size(); ++e) {
        const MatRef& src = h.experts[e].*field;
        M3_CHECK(src.dtype == first.dtype && src.rows == first.rows && src.cols == first.cols,
                 "layer %zu expert %zu: shape or dtype differs from expert 0", i, e);
        M3_CUDA_CHECK(cudaMemcpy(base + e * per, src.data, per, cudaMemcpyHostToDevice));
        MatRef& dst = d.experts[e].*field;
        dst = src;
        dst.data = base + e * per;
      }
    };
    upload_experts(&ExpertWeights::w1);
    upload_experts(&ExpertWeights::w3);
    upload_experts(&ExpertWeights::w2);
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
    // Small buffers (step arrays, decode activations) grow geometrically, so a growing block
    // table does not invalidate the captured graphs every step; large ones exactly.
    const size_t want = n * sizeof(T) < (size_t{64} << 20) ? std::max(n, 2 * b.size()) : n;
    b = gpu::DeviceBuffer<T>(want);
    ++generation_;  // captured graphs point at the old buffer
  }
  return b.data();
}

M3ModelCuda::~M3ModelCuda() {
  clear_graphs();
  if (stage_ != nullptr) cudaFreeHost(stage_);
  if (ev_fork_) cudaEventDestroy(ev_fork_);
  if (ev_join_) cudaEventDestroy(ev_join_);
}

void M3ModelCuda::tp_all_reduce(float* data, int64_t n) {
  if (!plan_.tensor_sharded() || skip_collectives_) return;
  M3_CUDA_CHECK(cudaEventRecord(ev_fork_, stream_.get()));
  M3_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_fork_, 0));
  comm_->all_reduce_sum(data, n);
  M3_CUDA_CHECK(cudaEventRecord(ev_join_, comm_stream_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ev_join_, 0));
}

template <class T>
void M3ModelCuda::tp_all_gather(const T* send, int64_t n, T* recv) {
  M3_CHECK(plan_.tensor_sharded());
  if (skip_collectives_) return;
  M3_CUDA_CHECK(cudaEventRecord(ev_fork_, stream_.get()));
  M3_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_fork_, 0));
  comm_->all_gather(send, n, recv);
  M3_CUDA_CHECK(cudaEventRecord(ev_join_, comm_stream_));
  M3_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ev_join_, 0));
}

void M3ModelCuda::tp_lm_head(const float* hs, int64_t R, float* logits) {
  // As M3Model::lm_head: each rank scores its vocabulary chunk, padded to vocab_chunk columns so
  // the all-gather has one size, then the chunks are laid side by side (strided copies).
  const int64_t V = cfg_.vocab_size, C = plan_.vocab_chunk, W = plan_.world;
  const int64_t n = plan_.vocab_count;
  cudaStream_t s = stream_.get();
  // Every rank grows the same buffers (`uneven` is a property of the split, not of the rank),
  // so the ranks' buffer generations, and with them their graph decisions, stay in step.
  const bool uneven = C * W != V;
  float* mine = ensure(tp_mine_, static_cast<size_t>(R * C));
  float* all = ensure(tp_all_, static_cast<size_t>(W * R * C));
  float* local = uneven ? ensure(tp_local_, static_cast<size_t>(R * C)) : nullptr;
  if (!uneven) {
    ops::linear(hs, R, dev_.lm_head, mine, s);
  } else {
    M3_CUDA_CHECK(cudaMemsetAsync(mine, 0, static_cast<size_t>(R * C) * sizeof(float), s));
    if (n > 0) {
      ops::linear(hs, R, dev_.lm_head, local, s);
      M3_CUDA_CHECK(cudaMemcpy2DAsync(mine, C * sizeof(float), local, n * sizeof(float),
                                      n * sizeof(float), R, cudaMemcpyDeviceToDevice, s));
    }
  }
  tp_all_gather(mine, R * C, all);
  for (int64_t w = 0; w < W; ++w) {
    const int64_t v0 = std::min(V, w * C), nw = std::min(V, v0 + C) - v0;
    if (nw <= 0) continue;
    M3_CUDA_CHECK(cudaMemcpy2DAsync(logits + v0, V * sizeof(float), all + w * R * C,
                                    C * sizeof(float), nw * sizeof(float), R,
                                    cudaMemcpyDeviceToDevice, s));
  }
}

void M3ModelCuda::tp_gather_msa(const int32_t* sel, int64_t T, std::vector<int32_t>& dst) {
  const int64_t k = cfg_.sparse_topk_blocks, nl = plan_.num_kv_heads,
                nkv = cfg_.num_key_value_heads, W = plan_.world;
  int32_t* all = ensure(tp_sel_all_, static_cast<size_t>(W * T * nl * k));
  tp_all_gather(sel, T * nl * k, all);
  std::vector<int32_t> host(static_cast<size_t>(W * T * nl * k));
  M3_CUDA_CHECK(cudaMemcpyAsync(host.data(), all, host.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, stream_.get()));
  stream_.synchronize();
  // With replicated KV heads several ranks hold the same head and the same selection.
  dst.assign(static_cast<size_t>(T * nkv * k), -1);
  for (int w = 0; w < W; ++w) {
    const int64_t g0 = plan_.kv_head_begin_of(w);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < nl; ++j)
        std::copy_n(host.begin() + ((w * T + t) * nl + j) * k, k,
                    dst.begin() + (t * nkv + g0 + j) * k);
  }
}

void M3ModelCuda::clear_graphs() {
  for (auto& [key, e] : graphs_)
    if (e.exec) cudaGraphExecDestroy(e.exec);
  graphs_.clear();
}

void M3ModelCuda::set_use_graphs(bool on) {
  use_graphs_ = on;
  if (!on) clear_graphs();
}

void M3ModelCuda::replay_or_capture(const StepShape& shape, const int32_t* tokens,
                                    const ops::TokenLayout& layout) {
  cudaStream_t s = stream_.get();
  if (graphs_.size() > kMaxGraphs) clear_graphs();
  // A data-parallel rank's MoE collectives are sized by the step's largest per-rank row count:
  // part of the key.
  const int64_t dp_rows = plan_.data_sharded() ? dp_rows_ : 0;
  GraphEntry& e = graphs_[{shape.num_tokens, shape.max_kv_len, shape.cache->id(), dp_rows}];
  if (e.exec && e.generation == generation_) {
    M3_CUDA_CHECK(cudaGraphLaunch(e.exec, s));
    ++graph_replays_;
    return;
  }
  if (e.never || !e.seen || e.seen_generation != generation_) {
    // First step of this shape (or buffers moved since): eager, which also sizes every buffer
    // the capture will use, so nothing allocates or synchronises inside the capture. A shape
    // whose eager run synchronised the host (the MoE's per-expert path) is never captured.
    step_syncs_host_ = false;
    run_layers(shape, tokens, layout, nullptr);
    e.seen = true;
    e.seen_generation = generation_;
    if (step_syncs_host_) e.never = true;
    return;
  }
  if (e.exec) {
    M3_CUDA_CHECK(cudaGraphExecDestroy(e.exec));
    e.exec = nullptr;
  }
  const uint64_t gen = generation_;
  M3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  run_layers(shape, tokens, layout, nullptr);
  cudaGraph_t g = nullptr;
  M3_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  M3_CHECK(gen == generation_, "a scratch buffer grew while capturing a CUDA graph");
  M3_CUDA_CHECK(cudaGraphInstantiate(&e.exec, g, 0));
  M3_CUDA_CHECK(cudaGraphDestroy(g));
  e.generation = gen;
  ++graph_captures_;
  M3_CUDA_CHECK(cudaGraphLaunch(e.exec, s));
  ++graph_replays_;
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
  const float alpha = static_cast<float>(cfg.swiglu_alpha),
              limit = static_cast<float>(cfg.swiglu_limit), beta = static_cast<float>(cfg.swiglu_beta);
  float* g = ensure(ws_.g, n * inter);  // [n, inter] f32
  // gate and up stored back to back (fuse_attention_projections): one projection of 2 x inter.
  const bool adjacent = gate.dtype == DType::kBF16 && up.dtype == DType::kBF16 &&
                        gate.cols == up.cols && up.rows == inter &&
                        static_cast<const uint16_t*>(gate.data) + inter * gate.cols == up.data;
  if (adjacent) {
    float* gu = ensure(ws_.u, n * 2 * inter);  // [n, gate | up] f32
    ops::linear(x, n, MatRef{gate.data, DType::kBF16, 2 * inter, gate.cols}, gu, s);
    ops::swiglu_oai_rows(gu, n, inter, alpha, limit, beta, g, s);
  } else {
    float* u = ensure(ws_.u, n * inter);  // [n, inter] f32
    ops::linear(x, n, gate, g, s);
    ops::linear(x, n, up, u, s);
    ops::swiglu_oai(g, u, n, inter, alpha, limit, beta, g, s);
  }
  ops::linear(g, n, down, out, s);  // out: [n, hidden] f32
}

void M3ModelCuda::moe(const LayerWeights& L, const float* x, int64_t n, float* out) {
  if (plan_.data_sharded()) {
    moe_dp(L, x, n, out);
    return;
  }
  if (L.has_shared_expert) {
    dense_mlp(L.shared_gate, L.shared_up, L.shared_down, x, n, out);  // out = shared expert
    routed_experts(L, x, n, out, out);
  } else {
    routed_experts(L, x, n, nullptr, out);
  }
}

void M3ModelCuda::moe_dp(const LayerWeights& L, const float* x, int64_t n, float* out) {
  // Attention data parallel (M3Model::routed_experts_dp): every rank's tokens meet every rank's
  // experts. The rows are padded to the step's largest count (set_dp_step_rows, from the host),
  // so the collectives have one size and no count exchange or host sync is needed; padded rows
  // are zeros, run through the experts like any row, and are dropped by their owner below.
  const int64_t h = config().hidden_size, W = plan_.world, nmax = dp_rows_;
  M3_CHECK(nmax >= 1 && n <= nmax, "data-parallel MoE: %lld rows here but the step's largest is "
           "%lld (set_dp_step_rows)", static_cast<long long>(n), static_cast<long long>(nmax));
  cudaStream_t s = stream_.get();
  float* send = ensure(dp_send_, static_cast<size_t>(nmax * h));
  float* all = ensure(dp_all_, static_cast<size_t>(W * nmax * h));
  float* routed = ensure(dp_routed_, static_cast<size_t>(W * nmax * h));
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(send, x, static_cast<size_t>(n * h) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, s));
  if (n < nmax)
    M3_CUDA_CHECK(cudaMemsetAsync(send + n * h, 0,
                                  static_cast<size_t>((nmax - n) * h) * sizeof(float), s));
  // The collectives run on the communicator's stream, forked from / joined to the model's.
  auto on_comm = [&](auto&& collective) {
    M3_CUDA_CHECK(cudaEventRecord(ev_fork_, s));
    M3_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_fork_, 0));
    collective();
    M3_CUDA_CHECK(cudaEventRecord(ev_join_, comm_stream_));
    M3_CUDA_CHECK(cudaStreamWaitEvent(s, ev_join_, 0));
  };
  on_comm([&] { comm_->all_gather(send, nmax * h, all); });  // all: [W * nmax, hidden]
  // Router (replicated) + this rank's experts (EP: its whole experts; else its intermediate slice
  // of every expert) over every rank's rows: partial sums the reduce-scatter completes.
  routed_experts(L, all, W * nmax, nullptr, routed);
  on_comm([&] { comm_->reduce_scatter_sum(routed, nmax * h, send); });  // send: [nmax, hidden]
  if (n == 0) return;  // a rank without tokens this step only joins the collectives
  if (L.has_shared_expert) {
    dense_mlp(L.shared_gate, L.shared_up, L.shared_down, x, n, out);  // the whole shared expert
    cuda_add_inplace(out, send, n * h, s);
  } else {
    M3_CUDA_CHECK(cudaMemcpyAsync(out, send, static_cast<size_t>(n * h) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, s));
  }
}

void M3ModelCuda::set_dp_step_rows(int64_t max_rows) {
  M3_CHECK(plan_.data_sharded() && max_rows >= 1, "set_dp_step_rows(%lld) on a %s model",
           static_cast<long long>(max_rows), plan_.data_sharded() ? "data-parallel" : "non-DP");
  dp_rows_ = max_rows;
}

void M3ModelCuda::forward_dp_idle() {
  M3_CHECK(plan_.data_sharded(), "forward_dp_idle on a model that is not data parallel");
  // The same MoE layers, in the same order, as the ranks running run_layers.
  for (int64_t li = 0; li < cfg_.num_hidden_layers; ++li)
    if (cfg_.layer_is_moe[li]) moe_dp(dev_.layers[li], nullptr, 0, nullptr);
  stream_.synchronize();
}

void M3ModelCuda::routed_experts(const LayerWeights& L, const float* x, int64_t n,
                                 const float* shared, float* out) {
  const M3Config& cfg = config();
  const int64_t h = cfg.hidden_size, ne = cfg.num_local_experts, k = cfg.num_experts_per_tok;
  cudaStream_t s = stream_.get();
  // Router on the GPU (f32 weight, bias for selection only); ids and weights stay on the device.
  float* logits = ensure(ws_.router_logits, n * ne);  // [n, experts] f32
  ops::linear(x, n, L.router, logits, s);
  int32_t* ids = ensure(ws_.route_ids, n * k);
  float* wts = ensure(ws_.route_w, n * k);
  ops::router_topk(logits, n, ne, L.router_bias.n > 0 ? static_cast<const float*>(L.router_bias.data)
                                                      : nullptr,
                   k, static_cast<float>(cfg.routed_scaling_factor), ids, wts, s);

  // Expert parallel: this rank holds experts [expert_begin, + num_experts); picks of the
  // others become -1 and add nothing here (the all-reduce after the block adds the other ranks';
  // under data parallelism the reduce-scatter in moe_dp).
  const int64_t ne_local = static_cast<int64_t>(L.experts.size());
  if (plan_.expert_parallel && plan_.sharded()) {
    M3_CHECK(ne_local == plan_.num_experts);
    ops::moe_localize_ids(ids, n * k, plan_.expert_begin, plan_.num_experts, s);
  } else {
    M3_CHECK(ne_local == ne);
  }
  // The experts as moe_experts reads them: contiguous per projection (upload_weights and the
  // synthetic factory both lay them out so).
  const MatRef& e0 = L.experts[0].w1;
  ops::MoeExpertWeights ew;
  ew.w1 = e0.data;
  ew.w3 = L.experts[0].w3.data;
  ew.w2 = L.experts[0].w2.data;
  ew.dtype = e0.dtype;
  ew.num_experts = ne_local;
  ew.inter = e0.rows;
  ew.hidden = h;
  const size_t per = static_cast<size_t>(ew.inter * h) * dtype_size(ew.dtype);
  for (int64_t e = 0; e < ne_local; ++e) {
    const ExpertWeights& E = L.experts[e];
    M3_CHECK(E.w1.data == static_cast<const uint8_t*>(ew.w1) + e * per &&
                 E.w3.data == static_cast<const uint8_t*>(ew.w3) + e * per &&
                 E.w2.data == static_cast<const uint8_t*>(ew.w2) + e * per &&
                 E.w1.dtype == ew.dtype && E.w3.dtype == ew.dtype && E.w2.dtype == ew.dtype,
             "MoE layer: expert %lld is not in the contiguous per-projection layout",
             static_cast<long long>(e));
  }
  const ops::SwigluParams act{static_cast<float>(cfg.swiglu_alpha),
                              static_cast<float>(cfg.swiglu_limit),
                              static_cast<float>(cfg.swiglu_beta)};
  uint8_t* work = ensure(ws_.moe, ops::moe_workspace_bytes(n, k, ew));
  if (!ops::moe_experts_graph_safe(n, x, ew)) step_syncs_host_ = true;  // never captured
  ops::moe_experts(x, n, ids, wts, k, ew, act, shared, out, work, s);
}

void M3ModelCuda::run_layers(const StepShape& shape, const int32_t* tokens,
                             const ops::TokenLayout& layout, ForwardResult* msa_out) {
  const M3Config& cfg = config();
  const int64_t T = shape.num_tokens, max_kv_len = shape.max_kv_len;
  KvCacheCuda& cache = *shape.cache;
  // This rank's heads (all of them unless sharded; model/shard.h).
  const int64_t H = cfg.hidden_size, nq = plan_.num_q_heads, nkv = plan_.num_kv_heads,
                d = cfg.head_dim;
  const bool tp = plan_.tensor_sharded();
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  cudaStream_t s = stream_.get();
  float* x = ensure(ws_.x, T * H);  // residual stream [T, hidden] f32
  float* a = ensure(ws_.a, T * H);
  float* q = ensure(ws_.q, T * nq * d);
  float* k = ensure(ws_.k, T * nkv * d);
  float* v = ensure(ws_.v, T * nkv * d);
  float* attn = ensure(ws_.attn, T * nq * d);
  float* y = ensure(ws_.y, T * H);
  if (tp) {
    // This rank's vocabulary rows, zeros elsewhere; the all-reduce adds one non-zero term.
    ops::embedding_vocab_slice(dev_.embed_tokens, plan_.vocab_begin, cfg.vocab_size, H, tokens, T,
                               x, s);
    tp_all_reduce(x, T * H);
  } else {
    ops::embedding(dev_.embed_tokens, tokens, T, x, s);
  }

  for (int64_t li = 0; li < cfg.num_hidden_layers; ++li) {
    const LayerWeights& L = dev_.layers[li];
    const bool sparse = cfg.layer_is_sparse[li];
    // a = input_norm(x); after the first layer the previous layer's residual add did it.
    if (li == 0) ops::rmsnorm_gemma(x, T, H, L.input_norm, eps, a, s);
    const ops::KvPages pages = cache.layer(li);
    M3_CHECK(pages.num_kv_heads == nkv, "the KV cache holds %lld KV heads, this model %lld",
             static_cast<long long>(pages.num_kv_heads), static_cast<long long>(nkv));
    // Index-q heads follow the KV heads (index_n_heads == num_key_value_heads, config.cpp).
    const int64_t ni = sparse ? (tp ? nkv : cfg.index_n_heads) : 0, di = cfg.index_head_dim;
    float* iq = sparse ? ensure(ws_.iq, T * ni * di) : nullptr;  // [T, ni, di]
    // Projections, then QK-norm + RoPE of q (and index q) and the K / V / index-K page writes
    // in one launch (kernels/cuda/fused.h).
    ops::AttnPrepArgs pa;
    pa.q_out = q;  // q: [T, nq, d] after the prep
    pa.num_q_heads = nq;
    pa.num_kv_heads = nkv;
    pa.head_dim = d;
    pa.rot_dim = cfg.rotary_dim;
    pa.q_norm = L.q_norm;
    pa.k_norm = L.k_norm;
    pa.eps = eps;
    pa.theta = cfg.rope_theta;
    if (sparse) {
      pa.iq_out = iq;
      pa.num_index_heads = ni;
      pa.index_dim = di;
      pa.index_rot_dim = std::min(cfg.rotary_dim, di);
      pa.iq_norm = L.index_q_norm;
      pa.ik_norm = L.index_k_norm;
    }
    const MatRef& fused = fused_proj_[li];
    if (fused.data != nullptr) {
      // One projection: rows [q | k | v | index q | index k] of each token.
      M3_CHECK(fused.rows == (nq + 2 * nkv) * d + (sparse ? (ni + 1) * di : 0),
               "fused projection of layer %lld has %lld rows", static_cast<long long>(li),
               static_cast<long long>(fused.rows));
      float* proj = ensure(ws_.proj, T * fused.rows);
      ops::linear(a, T, fused, proj, s);
      pa.in_stride = fused.rows;
      pa.q = proj;
      pa.k = proj + nq * d;
      pa.v = proj + (nq + nkv) * d;
      if (sparse) {
        pa.iq = proj + (nq + 2 * nkv) * d;
        pa.ik = pa.iq + ni * di;
      }
    } else {
      ops::linear(a, T, L.q_proj, q, s);  // q: [T, nq, d]
      ops::linear(a, T, L.k_proj, k, s);  // k: [T, nkv, d]
      ops::linear(a, T, L.v_proj, v, s);  // v: [T, nkv, d]
      pa.q = q;
      pa.k = k;
      pa.v = v;
      if (sparse) {
        float* ik = ensure(ws_.ik, T * di);  // [T, di] (one shared head)
        ops::linear(a, T, L.index_q_proj, iq, s);
        ops::linear(a, T, L.index_k_proj, ik, s);
        pa.iq = iq;
        pa.ik = ik;
      }
    }
    ops::attn_prep(pa, pages, layout, s);
    if (sparse) {
      const int64_t topk = cfg.sparse_topk_blocks;
      int32_t* sel = ensure(ws_.sel, T * ni * topk);
      // MSA scores of all tokens, capped (the op then scores token chunk by chunk), or the
      // split-KV partials, whichever is larger; both are consumed before the next op.
      const size_t ws_bytes = std::max(
          std::min(ops::msa_select_workspace_bytes(T, ni, pages, max_kv_len),
                   std::max(kAttnWorkspaceCap,
                            ops::msa_select_workspace_bytes(1, ni, pages, max_kv_len))),
          ops::attention_workspace_bytes(T, nq, pages, topk, max_kv_len));
      const ops::Workspace aws{ensure(ws_.attn_ws, ws_bytes), ws_bytes};
      ops::msa_select_blocks(iq, ni, pages, layout, topk, cfg.sparse_init_blocks,
                             cfg.sparse_local_blocks, max_kv_len, aws, sel, s);
      ops::attention_paged(q, nq, pages, layout, sel, topk, scale, max_kv_len, aws, attn, s);
      if (msa_out && tp) {
        tp_gather_msa(sel, T, msa_out->msa_blocks[li]);
      } else if (msa_out) {
        auto& dst = msa_out->msa_blocks[li];
        dst.resize(T * ni * topk);
        M3_CUDA_CHECK(cudaMemcpyAsync(dst.data(), sel, dst.size() * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, s));
        stream_.synchronize();  // sel is rewritten by the next sparse layer
      }
    } else {
      const size_t ws_bytes = ops::attention_workspace_bytes(T, nq, pages, 0, max_kv_len);
      const ops::Workspace aws{ensure(ws_.attn_ws, ws_bytes), ws_bytes};
      ops::attention_paged(q, nq, pages, layout, nullptr, 0, scale, max_kv_len, aws, attn, s);
    }
    ops::linear(attn, T, L.o_proj, y, s);  // y: [T, hidden]
    tp_all_reduce(y, T * H);               // sharded: partial sums over this rank's heads
    ops::add_rmsnorm_gemma(x, y, T, H, L.post_attention_norm, eps, a, s);  // x += y; a = norm(x)
    if (cfg.layer_is_moe[li]) {
      moe(L, a, T, y);
    } else {
      dense_mlp(L.gate_proj, L.up_proj, L.down_proj, a, T, y);
    }
    tp_all_reduce(y, T * H);  // sharded: partial sums over intermediate slices (routed + shared)
    if (li + 1 < cfg.num_hidden_layers) {
      ops::add_rmsnorm_gemma(x, y, T, H, dev_.layers[li + 1].input_norm, eps, a, s);
    } else {
      cuda_add_inplace(x, y, T * H, s);
    }
  }

}

void M3ModelCuda::forward(const ForwardBatch& b, KvCacheCuda& cache, ForwardResult* out,
                          bool capture_msa) {
  const M3Config& cfg = config();
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  M3_CHECK(!b.block_table_offsets.empty() && !b.block_table.empty());
  M3_CHECK(cache.page_size() == cfg.sparse_block_size);
  const int64_t H = cfg.hidden_size;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  cudaStream_t s = stream_.get();
  // A shard always computes the logits: the lm_head all-gather (and the MSA gather) are
  // collectives every rank joins. Ranks whose caller wants nothing fill a scratch result.
  ForwardResult scratch;
  const bool discard = out == nullptr && plan_.tensor_sharded();
  if (discard) out = &scratch;

  // The step's host arrays, copied to the device once per step (outside any graph: a replay
  // reads them from these buffers).
  // One pinned staging buffer and one copy: [tokens | positions | seq_ids | block-table offsets |
  // block table], each section at an offset that depends only on capT (fixed for every graph
  // size), so a replayed graph finds this step's arrays where it captured the last ones.
  const int64_t capT = std::max<int64_t>(T, kGraphMaxTokens);
  const int64_t S1 = static_cast<int64_t>(b.block_table_offsets.size());
  M3_CHECK(S1 <= capT + 1, "%lld sequences for %lld tokens", static_cast<long long>(S1 - 1),
           static_cast<long long>(T));
  const int64_t bt_at = 4 * capT + 1;
  const size_t stage_n = static_cast<size_t>(bt_at) + b.block_table.size();
  if (stage_cap_ < stage_n) {
    if (stage_ != nullptr) M3_CUDA_CHECK(cudaFreeHost(stage_));
    stage_cap_ = std::max(stage_n, 2 * stage_cap_);
    M3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stage_), stage_cap_ * sizeof(int32_t)));
  }
  // The previous step's copy out of stage_ finished: forward() ends with a stream sync.
  std::copy(b.token_ids.begin(), b.token_ids.end(), stage_);
  std::copy(b.positions.begin(), b.positions.end(), stage_ + capT);
  std::copy(b.seq_ids.begin(), b.seq_ids.end(), stage_ + 2 * capT);
  std::copy(b.block_table_offsets.begin(), b.block_table_offsets.end(), stage_ + 3 * capT);
  std::copy(b.block_table.begin(), b.block_table.end(), stage_ + bt_at);
  int32_t* dstage = ensure(step_, stage_n);
  M3_CUDA_CHECK(cudaMemcpyAsync(dstage, stage_, stage_n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                s));
  const int32_t* tokens = dstage;
  ops::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = dstage + capT;
  layout.seq_ids = dstage + 2 * capT;
  layout.block_table_offsets = dstage + 3 * capT;
  layout.block_table = dstage + bt_at;
  // Host bound of the step's key count, rounded up to a bucket: it sizes the MSA score rows
  // and the KV splits, so a captured graph stays valid for every step of its bucket (eager
  // steps use the same bound, so replay and eager compute the same numbers).
  const int64_t max_pos = *std::max_element(b.positions.begin(), b.positions.end());
  const int64_t max_kv_len = (max_pos / kKvLenBucket + 1) * kKvLenBucket;

  if (out) {
    out->msa_blocks.clear();
    if (capture_msa) out->msa_blocks.resize(cfg.num_hidden_layers);
  }
  const StepShape shape{T, max_kv_len, &cache};
  // (A data-parallel rank's MoE runs world x dp_rows_ rows: above the grouped path's limit its
  // eager run synchronises the host, and the shape is then never captured.)
  if (!capture_msa && use_graphs_ && T <= kGraphMaxTokens) {
    replay_or_capture(shape, tokens, layout);
  } else {
    run_layers(shape, tokens, layout, capture_msa ? out : nullptr);
  }
  float* x = ws_.x.data();  // the residual stream after the last layer

  if (!out) {
    stream_.synchronize();  // the cache holds this step's tokens once forward returns
    return;
  }
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  const int64_t V = cfg.vocab_size;
  out->vocab_size = V;
  out->logits.clear();
  out->logits_rows.clear();
  out->sampled.clear();
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
  if (plan_.tensor_sharded()) {
    tp_lm_head(hs, R, logits);
  } else {
    ops::linear(hs, R, dev_.lm_head, logits, s);
  }
  if (discard) {
    // Grow what rank 0 grows to sample, so every rank's buffer generation stays the same.
    if (!b.device_samples.empty()) {
      ensure(smp_rows_, b.device_samples.size());
      ensure(smp_ids_, b.device_samples.size());
    }
    stream_.synchronize();
    return;
  }
  const int64_t ns = static_cast<int64_t>(b.device_samples.size());
  if (ns == 0) {  // every row to the host
    out->logits.resize(R * V);
    M3_CUDA_CHECK(cudaMemcpyAsync(out->logits.data(), logits, R * V * sizeof(float),
                                  cudaMemcpyDeviceToHost, s));
    stream_.synchronize();
    return;
  }
  // Sample next to the logits; only token ids and the rows the host still needs come back.
  for (const auto& sr : b.device_samples)
    M3_CHECK(sr.row >= 0 && sr.row < R, "device sample row %d of %lld", sr.row,
             static_cast<long long>(R));
  const ops::SampleRow* d_rows = upload_async(smp_rows_, b.device_samples.data(), ns);
  int32_t* d_ids = ensure(smp_ids_, ns);
  const int64_t valid = b.num_sampleable > 0 ? std::min<int64_t>(b.num_sampleable, V) : V;
  ops::sample_rows(logits, V, valid, d_rows, ns, d_ids, s);
  out->sampled.resize(ns);
  M3_CUDA_CHECK(cudaMemcpyAsync(out->sampled.data(), d_ids, ns * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, s));
  out->logits_rows = b.host_logits_rows;
  out->logits.resize(b.host_logits_rows.size() * V);
  for (size_t j = 0; j < b.host_logits_rows.size(); ++j) {
    const int32_t r = b.host_logits_rows[j];
    M3_CHECK(r >= 0 && r < R, "host logits row %d of %lld", r, static_cast<long long>(R));
    M3_CUDA_CHECK(cudaMemcpyAsync(out->logits.data() + j * V, logits + r * V, V * sizeof(float),
                                  cudaMemcpyDeviceToHost, s));
  }
  stream_.synchronize();
}

}  // namespace m3::model
