#include "model/cuda/m3_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "core/env.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "kernels/cuda/fused.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample.h"
#include "model/cuda/cuda_ops.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/synthetic_weights.h"
#include "model/cuda/vision_cuda.h"
#include "model/m3_forward.h"
#include "model/synthetic_model.h"
#include "model/tensor_table.h"

namespace m3::model {

namespace ops = kernels::cuda;
using kernels::WeightQuant;

namespace {
// Left free after the weights for the KV cache, scratch and the CUDA context's own needs.
constexpr size_t kHeadroomBytes = size_t{512} << 20;
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
  // What upload_weights will allocate: every tensor of the table as this rank's views hold it.
  const size_t need =
      view_bytes(host->weights(), m3_tensors(host->config()), /*as_uploaded=*/true) +
      (host->vision() != nullptr
           ? static_cast<size_t>(VisionTowerCuda::weight_bytes(host->config()))
           : 0);
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
  // The tower on one GPU only: the sharded backends refuse image input.
  if (!m->plan_.sharded() && m->host_->vision() != nullptr) {
    m->vision_ = VisionTowerCuda::upload(m->cfg_, m->host_->vision()->weights(), m->stream_.get());
    M3_LOG_INFO("vision tower on cuda:%d: %s", device, gib(m->vision_->device_bytes()).c_str());
  }
  m->fuse_attention_projections();
  m->reserve_quant_workspace();
  m->init_forward();
  return m;
}

void M3ModelCuda::reserve_quant_workspace() {
  // The prefill path of a quantized linear dequantises the whole matrix into one bf16 buffer
  // (kernels::cuda::linear_quant): sized here for the largest, before the KV pool takes the free
  // memory. (The routed experts' per-expert path has its own, in the MoE workspace.)
  size_t most = 0;
  auto see = [&](const MatRef& m) {
    if (m.quantized() && m.data != nullptr)
      most = std::max(most, static_cast<size_t>(m.rows * m.cols) * sizeof(uint16_t));
  };
  for (const MatRef& f : fused_proj_) see(f);
  for (const LayerWeights& L : dev_.layers) {
    for (const MatRef* m :
         {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.index_q_proj, &L.index_k_proj,
          &L.gate_proj, &L.up_proj, &L.down_proj, &L.shared_gate, &L.shared_up, &L.shared_down})
      see(*m);
  }
  see(dev_.lm_head);
  if (most == 0) return;
  ops_->reserve_quant_workspace(most);
  M3_LOG_INFO("quantized linears: %s of GPU workspace for their prefill dequantisation",
              gib(ops_->quant_workspace_bytes()).c_str());
}

void M3ModelCuda::attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream) {
  M3_CHECK(comm != nullptr && comm_stream != nullptr,
           "a tensor-parallel GPU shard needs a device communicator and its stream");
  M3_CHECK(comm->rank() == plan_.rank && comm->world_size() == plan_.world,
           "communicator rank %d/%d does not match the shard %d/%d", comm->rank(),
           comm->world_size(), plan_.rank, plan_.world);
  ops_->attach_communicator(comm, comm_stream);
}

void M3ModelCuda::init_forward() {
  fw_ = std::make_unique<M3Forward<CudaOps>>(cfg_, plan_, dev_, fused_proj_);
}

Result<std::unique_ptr<M3ModelCuda>> M3ModelCuda::synthetic(const M3Config& cfg, uint64_t seed,
                                                            int device, const ShardPlan* shard,
                                                            dist::Communicator* comm,
                                                            cudaStream_t comm_stream,
                                                            WeightQuant weights) {
  M3_TRY(gpu::DeviceInfo info, gpu::probe_device(device));  // also makes `device` current
  if (weights != WeightQuant::kNone) {
    // A stored format: bf16 values generated as for weights=bf16, then quantized on the device
    // (unsharded only: a rank's column slice would get other block scales than the whole).
    if (shard != nullptr && shard->sharded()) {
      return make_error(ErrorCode::kUnsupported,
                        std::string("synthetic weights=") + weight_quant_name(weights) +
                            " is generated for one GPU only; use weights=bf16 with tensor or data "
                            "parallelism",
                        "--model");
    }
    const auto plan = make_shard_plan(cfg, ShardSpec{});
    M3_CHECK(plan.has_value());
    const size_t need = static_cast<size_t>(synthetic_weight_bytes(cfg, *plan, weights));
    if (need + kHeadroomBytes > info.free_bytes) {
      return make_error(ErrorCode::kUnavailable,
                        "synthetic:layers=" + std::to_string(cfg.num_hidden_layers) +
                            ",weights=" + weight_quant_name(weights) + " needs " + gib(need) +
                            " of GPU memory (plus " + gib(kHeadroomBytes) + " headroom) but " +
                            info.name + " has " + gib(info.free_bytes) + " free; use fewer layers",
                        "--model");
    }
    std::unique_ptr<M3ModelCuda> m(new M3ModelCuda(cfg, nullptr));
    m->generate_weights(seed, weights);
    m->fuse_attention_projections();
    m->reserve_quant_workspace();
    m->init_forward();
    m->add_synthetic_vision(seed, device);
    return m;
  }
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
    m->generate_weights(seed, WeightQuant::kNone);
    m->fuse_attention_projections();
    m->init_forward();
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
  m->generate_weights(seed, WeightQuant::kNone);
  m->fuse_attention_projections();
  m->init_forward();
  m->add_synthetic_vision(seed, device);
  return m;
}

void M3ModelCuda::add_synthetic_vision(uint64_t seed, int device) {
  if (!cfg_.vision.present) return;
  vision_ = VisionTowerCuda::synthetic(cfg_, seed, stream_.get());
  M3_LOG_INFO("synthetic vision tower on cuda:%d: %s", device,
              gib(vision_->device_bytes()).c_str());
}

void M3ModelCuda::encode_images(std::span<const VisionImage> images, std::vector<float>* embeds) {
  M3_CHECK(vision_ != nullptr, "encode_images on a GPU model without its vision tower");
  vision_->encode(images, embeds);
}

M3ModelCuda::M3ModelCuda(M3Config cfg, std::unique_ptr<M3Model> host)
    : cfg_(std::move(cfg)), host_(std::move(host)), ops_(std::make_unique<CudaOps>(stream_.get())) {
  if (host_) {
    plan_ = host_->shard_plan();
  } else {
    auto plan = make_shard_plan(cfg_, ShardSpec{});
    M3_CHECK(plan.has_value(), "unsharded plan: %s", plan ? "" : plan.error().message.c_str());
    plan_ = *plan;
  }
  use_graphs_ = !env_switch("M3_ENFORCE_EAGER", false);
  if (kernels::cuda::flash_prefill_built() && !env_switch("M3_NO_FLASHINFER", false))
    flash_ = std::make_unique<kernels::cuda::FlashPrefill>();
}

MatRef M3ModelCuda::fuse_rows(const std::vector<MatRef*>& parts) {
  if (parts.empty()) return MatRef{};
  const MatRef& p0 = *parts[0];
  int64_t rows = 0;
  bool ok = true;
  for (MatRef* m : parts) {
    // One format (bf16, or one quantized format held quantized; NVFP4 with one global scale)
    // and one width.
    ok = ok && m->data != nullptr && m->dtype == p0.dtype && m->quant == p0.quant &&
         m->cols == p0.cols && m->global_scale == p0.global_scale &&
         (m->quantized() ? uploads_quantized(*m) : m->dtype == DType::kBF16);
    rows += m->rows;
  }
  if (!ok) return MatRef{};  // e.g. f32 matrices, mixed formats: kept separate
  // One matrix of the parts' rows back to back (codes, then the scales of every row at an
  // aligned offset); the old buffers are released (each part is a whole tensor of its own
  // allocation, starting at its data) and the views become row slices of the new one.
  const size_t row_bytes = static_cast<size_t>(p0.row_bytes());
  const size_t srow_bytes = static_cast<size_t>(p0.scale_row_bytes());
  const size_t codes = static_cast<size_t>(rows) * row_bytes;
  const size_t scale_at = (codes + 255) / 256 * 256;
  gpu::DeviceBuffer<uint8_t> fused(scale_at + static_cast<size_t>(rows) * srow_bytes);
  size_t at = 0, sat = scale_at;
  for (MatRef* m : parts) {
    const size_t bytes = static_cast<size_t>(m->rows) * row_bytes;
    M3_CUDA_CHECK(cudaMemcpy(fused.data() + at, m->data, bytes, cudaMemcpyDeviceToDevice));
    if (m->quantized()) {
      const size_t sb = static_cast<size_t>(m->rows) * srow_bytes;
      M3_CUDA_CHECK(cudaMemcpy(fused.data() + sat, m->scale, sb, cudaMemcpyDeviceToDevice));
      m->scale = fused.data() + sat;
      sat += sb;
    }
    for (auto& b : storage_) {
      if (b.data() == m->data) b = gpu::DeviceBuffer<uint8_t>();
    }
    m->data = fused.data() + at;
    at += bytes;
  }
  MatRef r = p0;
  r.data = fused.data();
  r.rows = rows;
  if (p0.quantized()) r.scale = fused.data() + scale_at;
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
    // gate | up of the dense MLP or the shared expert (dense_mlp sees them adjacent; it fuses
    // bf16 only, so quantized ones stay two matrices).
    if (cfg_.layer_is_moe[li]) {
      if (L.has_shared_expert && !L.shared_gate.quantized())
        fuse_rows({&L.shared_gate, &L.shared_up});
    } else if (!L.gate_proj.quantized()) {
      fuse_rows({&L.gate_proj, &L.up_proj});
    }
  }
  // The uploads and these fusing copies ran on the legacy default stream, which the model's
  // non-blocking streams do not wait for (a pageable cudaMemcpy may return before its DMA
  // lands; a device-to-device one does not wait at all): finish them before any kernel reads.
  M3_CUDA_CHECK(cudaDeviceSynchronize());
}

void* M3ModelCuda::alloc_weight(size_t bytes) {
  return device_alloc(storage_, &weight_bytes_, bytes);
}

void M3ModelCuda::generate_weights(uint64_t seed, WeightQuant weights) {
  const M3Config& c = cfg_;
  const ShardPlan& p = plan_;  // the whole model unless this is a rank's shard
  cudaStream_t s = stream_.get();
  // Every tensor of the table, its rank's block (model/tensor_table.h) drawn at its indices in
  // the whole tensor; tensor id = its index in the table, so the same seed gives the same weights.
  const std::vector<TensorSpec> table = m3_tensors(c);
  size_views(dev_, c, table, p.num_experts);
  // The uniform bound b of [-b, b) (std b/sqrt(3)). Matrices: std 1/sqrt(fan_in) of the whole
  // matrix (a rank's columns are the whole model's), so unit-variance inputs give unit-variance
  // outputs; the embedding std 1; Gemma norms scale by (1 + w): small w keeps the scale near 1
  // while still exercising w; the f32 router's logits of std 1 spread the sigmoid; the
  // selection-only bias stays small next to them, so routing still depends on the token.
  auto bound = [](const TensorSpec& t) {
    switch (t.init) {
      case SyntheticInit::kLinear:
        return 1.0f / std::sqrt(static_cast<float>(t.cols)) * std::sqrt(3.0f);
      case SyntheticInit::kEmbedding:
        return 1.0f * std::sqrt(3.0f);
      case SyntheticInit::kNorm:
        return 0.05f;
      case SyntheticInit::kRouter:
        return std::sqrt(3.0f / static_cast<float>(t.cols));
      case SyntheticInit::kRouterBias:
        return 0.01f;
    }
    return 0.0f;
  };
  for (size_t id = 0; id < table.size(); ++id) {
    const TensorSpec& t = table[id];
    if (t.may_tie) {  // tied: the embedding's view, no second copy
      t.mat(dev_) = dev_.embed_tokens;
      continue;
    }
    const TensorBlock b = shard_block(t, c, p);
    const WeightQuant q = synthetic_format_of(t, weights);
    if (q != WeightQuant::kNone) {
      // The bf16 values of weights=bf16, quantized: codes of every expert back to back, then
      // their scales (the layout upload_weights gives a checkpoint's quantized experts).
      M3_CHECK(t.synthetic_dtype == DType::kBF16 && !t.vector, "%s: quantized synthetic tensor",
               t.names[0].c_str());
      const FillBlock fb{b.experts,   b.rows,      b.cols,      b.expert_begin, b.expert_count,
                         b.row_begin, b.row_count, b.col_begin, b.col_count};
      gpu::DeviceBuffer<uint16_t> tmp(b.size());
      fill_uniform_bf16_block(tmp.data(), fb, bound(t), seed, id, s);
      MatRef one;
      one.quant = q;
      one.dtype = kernels::weight_quant_is_4bit(q) ? DType::kU8 : DType::kF8E4M3;
      one.rows = b.row_count;
      one.cols = b.col_count;
      // NVFP4: the values lie in [-bound, bound), so bound / (448 * 6) keeps every block scale
      // within e4m3 (the checkpoints' amax / (448 * 6) rule with amax <= bound).
      one.global_scale = q == WeightQuant::kNvfp4 ? bound(t) / (448.f * 6.f) : 1.f;
      const int64_t ne = t.count_in(dev_) > 0 ? t.count_in(dev_) : 1;
      const size_t db = static_cast<size_t>(one.data_bytes()),
                   sb = static_cast<size_t>(one.scale_bytes());
      const size_t scale_at = (db * ne + 255) / 256 * 256;
      auto* base = static_cast<uint8_t*>(alloc_weight(scale_at + sb * ne));
      quantize_bf16_rows(tmp.data(), ne * one.rows, one.cols, q, one.global_scale, base,
                         base + scale_at, s);
      stream_.synchronize();  // tmp is freed next
      if (t.experts == 0) {
        one.data = base;
        one.scale = base + scale_at;
        t.mat(dev_) = one;
        continue;
      }
      for (int64_t e = 0; e < t.count_in(dev_); ++e) {
        MatRef m = one;
        m.data = base + e * db;
        m.scale = base + scale_at + e * sb;
        t.mat(dev_, e) = m;
      }
      continue;
    }
    void* data = nullptr;
    if (t.synthetic_dtype == DType::kF32) {
      M3_CHECK(t.split == SplitDim::kReplicated && t.experts == 0, "%s: f32 tensors are whole",
               t.names[0].c_str());
      auto* f = static_cast<float*>(alloc_weight(b.size() * sizeof(float)));
      fill_uniform_f32(f, b.size(), bound(t), seed, id, s);
      data = f;
    } else {
      M3_CHECK(t.synthetic_dtype == DType::kBF16, "%s: synthetic dtype %s", t.names[0].c_str(),
               dtype_name(t.synthetic_dtype));
      const FillBlock fb{b.experts,   b.rows,      b.cols,      b.expert_begin, b.expert_count,
                         b.row_begin, b.row_count, b.col_begin, b.col_count};
      auto* p16 = static_cast<uint16_t*>(alloc_weight(b.size() * sizeof(uint16_t)));
      fill_uniform_bf16_block(p16, fb, bound(t), seed, id, s);
      data = p16;
    }
    if (t.vector) {
      t.vec(dev_) = VecRef{data, t.synthetic_dtype, b.row_count};
      continue;
    }
    // Routed experts: one allocation per projection, this rank's experts back to back.
    const size_t per =
        static_cast<size_t>(b.row_count * b.col_count) * dtype_size(t.synthetic_dtype);
    for (int64_t e = 0; e < t.count_in(dev_); ++e) {
      t.mat(dev_, e) = MatRef{static_cast<uint8_t*>(data) + e * per, t.synthetic_dtype, b.row_count,
                              b.col_count};
    }
  }
  stream_.synchronize();  // weights are complete before any forward reads them
}

MatRef M3ModelCuda::upload(const MatRef& m) {
  MatRef r = m;
  if (m.data == nullptr || m.rows * m.cols == 0) return r;
  if (m.quantized()) {
    if (!uploads_quantized(m)) {
      // A layout the quantized kernels cannot read (cols not a multiple of 16): the format's
      // values in f32, exactly the CPU's (bf16 would round per-channel and NVFP4 values;
      // counted and logged by upload_weights).
      std::vector<float> host;
      return upload(dequantize_to_f32(m, host));
    }
    // Codes and scales as stored, in one allocation (codes first: fuse_rows frees by data).
    const size_t db = static_cast<size_t>(m.data_bytes()),
                 sb = static_cast<size_t>(m.scale_bytes());
    const size_t scale_at = (db + 255) / 256 * 256;
    auto* base = static_cast<uint8_t*>(alloc_weight(scale_at + sb));
    M3_CUDA_CHECK(cudaMemcpy(base, m.data, db, cudaMemcpyHostToDevice));
    M3_CUDA_CHECK(cudaMemcpy(base + scale_at, m.scale, sb, cudaMemcpyHostToDevice));
    r.data = base;
    r.scale = base + scale_at;
    return r;
  }
  return device_copy(storage_, &weight_bytes_, m, "M3ModelCuda");
}

VecRef M3ModelCuda::upload(const VecRef& v) {
  return device_copy(storage_, &weight_bytes_, v);
}

VecRef M3ModelCuda::upload_f32(const VecRef& v) {
  if (v.data == nullptr || v.n == 0) return v;
  std::vector<float> f(v.n);
  v.to_f32(f.data());  // exactly what the CPU forward feeds router_topk
  return device_copy(storage_, &weight_bytes_, VecRef{f.data(), DType::kF32, v.n});
}

void M3ModelCuda::upload_weights() {
  const M3Weights& w = host_->weights();
  const std::vector<TensorSpec> table = m3_tensors(cfg_);
  size_views(dev_, cfg_, table, plan_.num_experts);
  // Quantized linears stay quantized on the GPU (codes and scales as stored) where the kernels
  // read their layout; the others are counted here and uploaded as bf16.
  size_t kept[5] = {0, 0, 0, 0, 0}, as_f32 = 0;
  std::string why_f32;
  auto note_f32 = [&](const std::string& name, const MatRef& m) {
    if (as_f32++ == 0)
      why_f32 =
          name + " (" + weight_quant_name(m.quant) + ", " + std::to_string(m.cols) + " columns)";
  };
  for (const TensorSpec& t : table) {
    if (t.vector) {
      // The router bias widened to f32: exactly what the CPU forward feeds router_topk.
      t.vec(dev_) = t.device_f32 ? upload_f32(t.vec(w)) : upload(t.vec(w));
      continue;
    }
    if (t.may_tie && t.mat(w).data == w.embed_tokens.data) {
      t.mat(dev_) = dev_.embed_tokens;  // tied embeddings share one host tensor: and one copy
      continue;
    }
    if (t.experts == 0) {
      const MatRef& src = t.mat(w);
      if (src.quantized()) {
        if (uploads_quantized(src)) {
          ++kept[static_cast<size_t>(src.quant)];
        } else {
          note_f32(t.name("", 0, 0), src);
        }
      }
      t.mat(dev_) = upload(src);
      continue;
    }
    // Experts: one buffer per projection, expert e at e * (its bytes) (what moe_experts reads):
    // bf16/f32 elements, or quantized codes with the scales after them at a fixed stride.
    const int64_t n = t.count_in(w);
    M3_CHECK(n == t.count_in(dev_), "%s: %lld experts on the host, %lld planned",
             t.names[0].c_str(), static_cast<long long>(n),
             static_cast<long long>(t.count_in(dev_)));
    if (n == 0) continue;
    const MatRef& first = t.mat(w, 0);
    const LayerWeights& HL = w.layers[static_cast<size_t>(t.layer)];
    const bool keep = experts_upload_quantized(HL);
    // Quantized experts in a mix the GPU op cannot read: every projection of the layer as its
    // values in f32 (one dtype for the MoE op, the CPU's values exactly).
    bool any_quant = false;
    for (const ExpertWeights& e : HL.experts)
      any_quant = any_quant || e.w1.quantized() || e.w3.quantized() || e.w2.quantized();
    const bool widen = any_quant && !keep;
    const DType dt = widen ? DType::kF32 : first.dtype;
    const size_t per = keep ? static_cast<size_t>(first.data_bytes())
                            : static_cast<size_t>(first.rows * first.cols) * dtype_size(dt);
    const size_t sper = keep ? static_cast<size_t>(first.scale_bytes()) : 0;
    const size_t codes = per * static_cast<size_t>(n);
    const size_t scale_at = (codes + 255) / 256 * 256;
    auto* base = static_cast<uint8_t*>(
        alloc_weight(keep ? scale_at + sper * static_cast<size_t>(n) : codes));
    std::vector<float> host;
    for (int64_t e = 0; e < n; ++e) {
      MatRef src = t.mat(w, e);
      M3_CHECK(src.dtype == first.dtype && src.quant == first.quant && src.rows == first.rows &&
                   src.cols == first.cols,
               "%s: expert %lld's shape or format differs from expert 0's",
               t.name("", 0, e).c_str(), static_cast<long long>(e));
      if (src.quantized() && keep) ++kept[static_cast<size_t>(src.quant)];
      if (widen) {
        if (src.quantized()) note_f32(t.name("", 0, e), src);
        src = dequantize_to_f32(src, host);
      }
      M3_CUDA_CHECK(cudaMemcpy(base + e * per, src.data, per, cudaMemcpyHostToDevice));
      MatRef& dst = t.mat(dev_, e);
      dst = src;
      dst.data = base + e * per;
      if (keep) {
        uint8_t* sdst = base + scale_at + e * sper;
        M3_CUDA_CHECK(cudaMemcpy(sdst, src.scale, sper, cudaMemcpyHostToDevice));
        dst.scale = sdst;
      }
    }
  }
  // NVFP4 experts: each expert's global scale, on the device for the grouped GEMV.
  for (LayerWeights& L : dev_.layers) {
    if (L.experts.empty() || L.experts[0].w1.quant != WeightQuant::kNvfp4) continue;
    const size_t ne = L.experts.size();
    std::vector<float> g(3 * ne);
    for (size_t e = 0; e < ne; ++e) {
      g[e] = L.experts[e].w1.global_scale;
      g[ne + e] = L.experts[e].w3.global_scale;
      g[2 * ne + e] = L.experts[e].w2.global_scale;
    }
    auto* d = static_cast<float*>(alloc_weight(g.size() * sizeof(float)));
    M3_CUDA_CHECK(cudaMemcpy(d, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice));
    L.expert_global_scales = d;
  }
  size_t num_kept = 0;
  std::string held;
  for (size_t q = 1; q < 5; ++q) {
    if (kept[q] == 0) continue;
    num_kept += kept[q];
    held += (held.empty() ? "" : ", ") + std::to_string(kept[q]) + " " +
            weight_quant_name(static_cast<WeightQuant>(q));
  }
  if (num_kept > 0)
    M3_LOG_INFO("GPU weights: %s, quantized linears held as stored (%s)",
                gib(weight_bytes_).c_str(), held.c_str());
  if (as_f32 > 0) {
    M3_LOG_WARN(
        "%zu quantized linears are uploaded dequantised to f32 (the GPU's quantized kernels "
        "need a multiple of 16 columns, and a MoE layer's experts all in one such format), "
        "first %s: the GPU holds and reads them as f32",
        as_f32, why_f32.c_str());
  }
}

M3ModelCuda::~M3ModelCuda() {
  cudaStreamSynchronize(stream_.get());  // nothing launched may still read what is freed here
  clear_graphs();
  if (stage_ != nullptr) cudaFreeHost(stage_);
  for (int i = 0; i < 2; ++i) {
    if (ids_host_[i] != nullptr) cudaFreeHost(ids_host_[i]);
    if (step_done_[i] != nullptr) cudaEventDestroy(step_done_[i]);
  }
  if (stage_copied_ != nullptr) cudaEventDestroy(stage_copied_);
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

const float* M3ModelCuda::aux_states() const {
  return ops_->f32(Buf::kAux, 0);
}

void M3ModelCuda::replay_or_capture(const StepShape& shape, const int32_t* tokens,
                                    const ops::TokenLayout& layout, const AuxCapture* aux) {
  cudaStream_t s = stream_.get();
  if (graphs_.size() > kMaxGraphs) clear_graphs();
  // A data-parallel rank's MoE collectives are sized by the step's largest per-rank row count:
  // part of the key.
  const int64_t dp_rows = fw_->dp_step_rows();
  // Aux copies of a device draft's layers: the layer set is fixed for the model's life (one
  // draft), so its count tells the graphs apart.
  GraphEntry& e = graphs_[{shape.num_tokens, shape.max_kv_len, shape.cache->id(), dp_rows,
                           layout.multi_token_seqs, aux != nullptr ? aux->n : 0}];
  if (e.exec && e.generation == ops_->generation()) {
    M3_CUDA_CHECK(cudaGraphLaunch(e.exec, s));
    ++graph_replays_;
    return;
  }
  if (e.never || !e.seen || e.seen_generation != ops_->generation()) {
    // First step of this shape (or buffers moved since): eager, which also sizes every buffer
    // the capture will use, so nothing allocates or synchronises inside the capture. A shape
    // whose eager run synchronised the host (the MoE's per-expert path) is never captured.
    ops_->clear_syncs_host();
    run_layers(shape, tokens, layout, nullptr, aux);
    e.seen = true;
    e.seen_generation = ops_->generation();
    if (ops_->syncs_host()) e.never = true;
    return;
  }
  if (e.exec) {
    M3_CUDA_CHECK(cudaGraphExecDestroy(e.exec));
    e.exec = nullptr;
  }
  const uint64_t gen = ops_->generation();
  M3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  run_layers(shape, tokens, layout, nullptr, aux);
  cudaGraph_t g = nullptr;
  M3_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  M3_CHECK(gen == ops_->generation(), "a scratch buffer grew while capturing a CUDA graph");
  M3_CUDA_CHECK(cudaGraphInstantiate(&e.exec, g, 0));
  M3_CUDA_CHECK(cudaGraphDestroy(g));
  e.generation = gen;
  ++graph_captures_;
  M3_CUDA_CHECK(cudaGraphLaunch(e.exec, s));
  ++graph_replays_;
}

void M3ModelCuda::run_layers(const StepShape& shape, const int32_t* tokens,
                             const ops::TokenLayout& layout, ForwardResult* msa_out,
                             const AuxCapture* aux, const EmbedOverride* emb) {
  fw_->run_layers(*ops_, tokens, layout, *shape.cache, shape.max_kv_len, msa_out, emb, aux);
}

void M3ModelCuda::set_dp_step_rows(int64_t max_rows) {
  fw_->set_dp_step_rows(max_rows);
}

void M3ModelCuda::forward_dp_idle() {
  fw_->run_idle(*ops_);
  stream_.synchronize();
}

void M3ModelCuda::set_skip_collectives_for_timing(bool on) {
  ops_->set_skip_collectives(on);
}

void M3ModelCuda::set_graph_sizes(std::vector<int64_t> sizes) {
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  graph_sizes_ = std::move(sizes);
  clear_graphs();
}

bool M3ModelCuda::graph_size(int64_t num_tokens) const {
  if (num_tokens > kGraphMaxTokens) return false;
  return graph_sizes_.empty() ||
         std::binary_search(graph_sizes_.begin(), graph_sizes_.end(), num_tokens);
}

void M3ModelCuda::forward(const ForwardBatch& b, KvCacheCuda& cache, ForwardResult* out,
                          bool capture_msa) {
  M3_CHECK(launched_.empty(), "M3ModelCuda::forward with %zu launched steps not collected",
           launched_.size());
  const int slot = static_cast<int>(num_enqueued_ % 2);
  enqueue(b, cache, out, capture_msa);
  wait_step(slot, out);
}

void M3ModelCuda::launch(const ForwardBatch& b, KvCacheCuda& cache) {
  M3_CHECK(launched_.size() < 2, "M3ModelCuda::launch: a third step before collect()");
  launched_.emplace_back();
  Launched& l = launched_.back();
  l.slot = static_cast<int>(num_enqueued_ % 2);
  enqueue(b, cache, &l.result, /*capture_msa=*/false);
}

void M3ModelCuda::wait_for_kv_copies(std::vector<cudaEvent_t> layer_events) {
  M3_CHECK(static_cast<int64_t>(layer_events.size()) == cfg_.num_hidden_layers,
           "wait_for_kv_copies: %zu events for %lld layers", layer_events.size(),
           static_cast<long long>(cfg_.num_hidden_layers));
  kv_copy_waits_ = std::move(layer_events);
}

void M3ModelCuda::collect(ForwardResult* out) {
  M3_CHECK(!launched_.empty(), "M3ModelCuda::collect without a launched step");
  Launched& l = launched_.front();
  wait_step(l.slot, &l.result);
  *out = std::move(l.result);
  launched_.pop_front();
}

void M3ModelCuda::wait_step(int slot, ForwardResult* out) {
  M3_CUDA_CHECK(cudaEventSynchronize(step_done_[slot]));
  if (out != nullptr && ids_count_[slot] > 0)
    out->sampled.assign(ids_host_[slot], ids_host_[slot] + ids_count_[slot]);
}

void M3ModelCuda::enqueue(const ForwardBatch& b, KvCacheCuda& cache, ForwardResult* out,
                          bool capture_msa) {
  const M3Config& cfg = config();
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  M3_CHECK(!b.block_table_offsets.empty() && !b.block_table.empty());
  M3_CHECK(cache.page_size() == cfg.sparse_block_size);
  M3_CHECK(b.prev_sample_tokens.size() == b.prev_sample_slots.size());
  cudaStream_t s = stream_.get();
  // Step slot: its sampled-id buffers and its end event (steps alternate between two).
  const int slot = static_cast<int>(num_enqueued_ % 2);
  const int prev = 1 - slot;
  ++num_enqueued_;
  for (cudaEvent_t* ev : {&step_done_[0], &step_done_[1], &stage_copied_})
    if (*ev == nullptr) M3_CUDA_CHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  ids_count_[slot] = 0;
  auto end_step = [&] { M3_CUDA_CHECK(cudaEventRecord(step_done_[slot], s)); };
  // A shard always computes the logits: the lm_head all-gather (and the MSA gather) are
  // collectives every rank joins. Ranks whose caller wants nothing fill a scratch result.
  ForwardResult scratch;
  const bool discard = out == nullptr && plan_.tensor_sharded();
  if (discard) out = &scratch;

  // The step's host arrays, copied to the device once per step (outside any graph: a replay
  // reads them from these buffers).
  // One pinned staging buffer and one copy: [tokens | positions | seq_ids | block-table offsets |
  // block table | logits rows | previous-sample tokens, slots | sample rows], the first four at
  // offsets that depend only on capT (fixed for every graph size), so a replayed graph finds this
  // step's arrays where it captured the last ones; the rest are read by the eager kernels after it.
  const int64_t capT = std::max<int64_t>(T, kGraphMaxTokens);
  const int64_t S1 = static_cast<int64_t>(b.block_table_offsets.size());
  M3_CHECK(S1 <= capT + 1, "%lld sequences for %lld tokens", static_cast<long long>(S1 - 1),
           static_cast<long long>(T));
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  const int64_t np = static_cast<int64_t>(b.prev_sample_tokens.size());
  const int64_t ns = static_cast<int64_t>(b.device_samples.size());
  constexpr int64_t kRowWords = sizeof(ops::SampleRow) / sizeof(int32_t);
  static_assert(sizeof(ops::SampleRow) % (2 * sizeof(int32_t)) == 0);
  const int64_t bt_at = 4 * capT + 1;
  const int64_t rows_at = bt_at + static_cast<int64_t>(b.block_table.size());
  const int64_t prev_at = rows_at + R;
  const int64_t smp_at = (prev_at + 2 * np + 1) / 2 * 2;  // 8-byte aligned for SampleRow
  const int64_t ne = static_cast<int64_t>(b.embed_rows.size());
  M3_CHECK(b.embed_values.size() == static_cast<size_t>(ne * cfg.hidden_size),
           "embed_values holds %zu floats for %lld rows", b.embed_values.size(),
           static_cast<long long>(ne));
  for (int32_t r : b.embed_rows)
    M3_CHECK(r >= 0 && r < T, "embed row %d of %lld", r, static_cast<long long>(T));
  const int64_t emb_at = smp_at + ns * kRowWords;
  const size_t stage_n = static_cast<size_t>(emb_at + ne);
  // The previous step's copy out of stage_ must have run before it is overwritten (with async
  // scheduling that step may still be running).
  if (stage_pending_) M3_CUDA_CHECK(cudaEventSynchronize(stage_copied_));
  if (stage_cap_ < stage_n) {
    if (stage_ != nullptr) M3_CUDA_CHECK(cudaFreeHost(stage_));
    stage_cap_ = std::max(stage_n, 2 * stage_cap_);
    M3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stage_), stage_cap_ * sizeof(int32_t)));
  }
  std::copy(b.token_ids.begin(), b.token_ids.end(), stage_);
  std::copy(b.positions.begin(), b.positions.end(), stage_ + capT);
  std::copy(b.seq_ids.begin(), b.seq_ids.end(), stage_ + 2 * capT);
  std::copy(b.block_table_offsets.begin(), b.block_table_offsets.end(), stage_ + 3 * capT);
  std::copy(b.block_table.begin(), b.block_table.end(), stage_ + bt_at);
  for (int32_t t : b.logits_indices)
    M3_CHECK(t >= 0 && t < T, "logits index %d of %lld", t, static_cast<long long>(T));
  std::copy(b.logits_indices.begin(), b.logits_indices.end(), stage_ + rows_at);
  for (int64_t i = 0; i < np; ++i) {
    M3_CHECK(b.prev_sample_tokens[i] >= 0 && b.prev_sample_tokens[i] < T &&
                 b.prev_sample_slots[i] >= 0 && b.prev_sample_slots[i] < ids_count_[prev],
             "previous sample %d for token %d (the step before sampled %lld)",
             b.prev_sample_slots[i], b.prev_sample_tokens[i],
             static_cast<long long>(ids_count_[prev]));
  }
  std::copy(b.prev_sample_tokens.begin(), b.prev_sample_tokens.end(), stage_ + prev_at);
  std::copy(b.prev_sample_slots.begin(), b.prev_sample_slots.end(), stage_ + prev_at + np);
  for (const auto& sr : b.device_samples)
    M3_CHECK(sr.row >= 0 && sr.row < R, "device sample row %d of %lld", sr.row,
             static_cast<long long>(R));
  if (ns > 0) std::memcpy(stage_ + smp_at, b.device_samples.data(), ns * sizeof(ops::SampleRow));
  std::copy(b.embed_rows.begin(), b.embed_rows.end(), stage_ + emb_at);
  int32_t* dstage = ops_->ensure(step_, static_cast<int64_t>(stage_n));
  M3_CUDA_CHECK(
      cudaMemcpyAsync(dstage, stage_, stage_n * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  M3_CUDA_CHECK(cudaEventRecord(stage_copied_, s));
  stage_pending_ = true;
  // Async scheduling: decode inputs sampled by the step before, read where it left them.
  if (np > 0)
    ops::gather_sampled_ids(smp_ids_[prev].data(), dstage + prev_at, dstage + prev_at + np, np,
                            dstage, s);
  const int32_t* tokens = dstage;
  ops::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = dstage + capT;
  layout.seq_ids = dstage + 2 * capT;
  layout.block_table_offsets = dstage + 3 * capT;
  layout.block_table = dstage + bt_at;
  // Every listed sequence has at least one token: more tokens than sequences means a prefill
  // chunk or a verify run (the attention's query-tiled kernel).
  layout.multi_token_seqs = T > S1 - 1;
  // Image embeddings: their rows in the staged array, their values copied to the device (a
  // pageable copy, staged before the call returns, so `b` need not outlive launch()).
  EmbedOverride emb;
  if (ne > 0) {
    float* vals = ops_->ensure(embed_values_, ne * cfg.hidden_size);
    M3_CUDA_CHECK(cudaMemcpyAsync(vals, b.embed_values.data(),
                                  b.embed_values.size() * sizeof(float), cudaMemcpyHostToDevice,
                                  s));
    emb = EmbedOverride{dstage + emb_at, vals, ne};
  }
  // Aux states copied to the host run eagerly; kept on the device (a device draft) the copies
  // are captured with the layers. Steps with image embeddings run eagerly.
  const bool graph_step = !capture_msa && (b.aux_layers.empty() || b.aux_on_device) && ne == 0 &&
                          use_graphs_ && graph_size(T);
  // An eager step whose every sequence has two or more tokens (a prefill chunk, a verify run)
  // lets the attention skip its per-token kernel; a graph keeps it (replays may carry decode
  // rows, and the flag is not part of the graph's key).
  if (layout.multi_token_seqs && !graph_step) {
    bool single = false;
    for (int64_t t = 0; t < T && !single; ++t)
      single = (t == 0 || b.seq_ids[t - 1] != b.seq_ids[t]) &&
               (t + 1 == T || b.seq_ids[t + 1] != b.seq_ids[t]);
    layout.single_token_seqs = single;
  }
  if (flash_ != nullptr) {
    // An eager step's runs of several tokens go to FlashInfer when each is a chunk of
    // consecutive positions (a prefill or a verify run); otherwise none does.
    std::vector<kernels::cuda::FlashPrefill::Run> runs;
    bool ok = layout.multi_token_seqs && !graph_step;
    for (int64_t t = 0; ok && t < T;) {
      int64_t e = t + 1;
      while (e < T && b.seq_ids[e] == b.seq_ids[t]) {
        ok = ok && b.positions[e] == b.positions[e - 1] + 1;
        ++e;
      }
      if (e - t >= 2)
        runs.push_back({static_cast<int32_t>(t), static_cast<int32_t>(e - t),
                        b.positions[e - 1] + 1, b.block_table_offsets[b.seq_ids[t]]});
      t = e;
    }
    flash_->set_runs(ok ? runs : std::vector<kernels::cuda::FlashPrefill::Run>{}, s);
    if (ok && !runs.empty()) layout.flash_prefill = flash_.get();
  }
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
  // Speculative decoding: the residual streams entering the draft's aux layers, copied out of
  // the layer loop into a device buffer (Buf::kAux). A device draft reads them there
  // (aux_on_device: captured into the graphs with the layers); else they go to out->aux_hidden
  // and the step runs eagerly (the copy to pageable host memory waits).
  const int64_t naux = static_cast<int64_t>(b.aux_layers.size());
  AuxCapture aux;
  if (naux > 0) {
    M3_CHECK(!plan_.sharded(), "aux hidden states on a sharded GPU model");
    aux = AuxCapture{b.aux_layers.data(), naux, ops_->f32(Buf::kAux, T * naux * cfg.hidden_size)};
  }
  // (A data-parallel rank's MoE runs world x dp_rows_ rows: above the grouped path's limit its
  // eager run synchronises the host, and the shape is then never captured.)
  // Host KV tier copies this step depends on (wait_for_kv_copies): an eager step waits for each
  // layer's copies just before that layer touches its pages, so the later layers' copies run
  // under the earlier layers' compute; a graph step (a captured graph cannot wait on events
  // recorded outside it) waits for all of them first.
  std::vector<cudaEvent_t> kv_waits = std::move(kv_copy_waits_);
  kv_copy_waits_.clear();
  if (graph_step) {
    for (cudaEvent_t e : kv_waits) M3_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
    replay_or_capture(shape, tokens, layout, naux > 0 ? &aux : nullptr);
  } else {
    ops_->set_kv_layer_waits(std::move(kv_waits));
    run_layers(shape, tokens, layout, capture_msa ? out : nullptr, naux > 0 ? &aux : nullptr,
               ne > 0 ? &emb : nullptr);
    ops_->set_kv_layer_waits({});
  }
  aux_rows_ = naux > 0 && b.aux_on_device ? T : 0;
  if (out != nullptr && naux > 0 && !b.aux_on_device) {
    out->aux_hidden.resize(static_cast<size_t>(T * naux * cfg.hidden_size));
    M3_CUDA_CHECK(cudaMemcpyAsync(out->aux_hidden.data(), aux.out,
                                  out->aux_hidden.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                  s));
  }

  if (!out) {
    end_step();  // the cache holds this step's tokens once the step has ended
    return;
  }
  const int64_t V = cfg.vocab_size;
  out->vocab_size = V;
  out->logits.clear();
  out->logits_rows.clear();
  out->sampled.clear();
  if (R == 0) {
    end_step();
    return;
  }
  const int32_t* rows = dstage + rows_at;
  float* logits = ops_->f32(Buf::kLogits, R * V);  // [R, vocab] f32
  fw_->logits(*ops_, rows, R, logits);
  if (discard) {
    // Grow what rank 0 grows to sample, so every rank's buffer generation stays the same.
    if (ns > 0) ops_->ensure(smp_ids_[slot], ns);
    end_step();
    return;
  }
  if (ns == 0) {  // every row to the host
    out->logits.resize(R * V);
    M3_CUDA_CHECK(cudaMemcpyAsync(out->logits.data(), logits, R * V * sizeof(float),
                                  cudaMemcpyDeviceToHost, s));
    end_step();
    return;
  }
  // Sample next to the logits; only token ids and the rows the host still needs come back.
  const auto* d_rows = reinterpret_cast<const ops::SampleRow*>(dstage + smp_at);
  int32_t* d_ids = ops_->ensure(smp_ids_[slot], ns);
  const int64_t valid = b.num_sampleable > 0 ? std::min<int64_t>(b.num_sampleable, V) : V;
  ops::sample_rows(logits, V, valid, d_rows, ns, d_ids, s);
  if (ids_host_cap_[slot] < static_cast<size_t>(ns)) {
    // No copy into it is pending: the step that used this slot last has been waited for.
    if (ids_host_[slot] != nullptr) M3_CUDA_CHECK(cudaFreeHost(ids_host_[slot]));
    ids_host_cap_[slot] = std::max<size_t>(static_cast<size_t>(ns), 2 * ids_host_cap_[slot]);
    M3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ids_host_[slot]),
                                 ids_host_cap_[slot] * sizeof(int32_t)));
  }
  M3_CUDA_CHECK(
      cudaMemcpyAsync(ids_host_[slot], d_ids, ns * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  ids_count_[slot] = ns;
  out->logits_rows = b.host_logits_rows;
  out->logits.resize(b.host_logits_rows.size() * V);
  for (size_t j = 0; j < b.host_logits_rows.size(); ++j) {
    const int32_t r = b.host_logits_rows[j];
    M3_CHECK(r >= 0 && r < R, "host logits row %d of %lld", r, static_cast<long long>(R));
    M3_CUDA_CHECK(cudaMemcpyAsync(out->logits.data() + j * V, logits + r * V, V * sizeof(float),
                                  cudaMemcpyDeviceToHost, s));
  }
  end_step();
}

}  // namespace m3::model
