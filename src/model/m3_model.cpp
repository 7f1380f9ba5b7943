#include "model/m3_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "model/cpu_ops.h"
#include "model/m3_forward.h"
#include "model/quantization.h"
#include "model/synthetic_model.h"
#include "model/tensor_table.h"
#include "model/vision_tower.h"

namespace m3::model {

namespace {
// One scalar of a checkpoint tensor (f32, bf16, f16), by dtype.
float scalar_value(const TensorInfo& t) {
  switch (t.dtype) {
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, t.data, 2);
      return bf16_to_f32(b);
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, t.data, 2);
      return f16_to_f32(b);
    }
    default: {
      float f;
      std::memcpy(&f, t.data, 4);
      return f;
    }
  }
}
}  // namespace

Status load_kv_scales(const Checkpoint& ck, M3Config& cfg) {
  std::vector<float> ks(cfg.num_hidden_layers, 1.f), vs(cfg.num_hidden_layers, 1.f);
  bool any = false;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::string leaf = kv == 0 ? "k_scale" : "v_scale";
      const std::string proj = kv == 0 ? "k_proj." : "v_proj.";
      for (std::string_view root : kCheckpointRoots) {
        const std::string base =
            std::string(root) + "model.layers." + std::to_string(i) + ".self_attn.";
        const TensorInfo* t = ck.find(base + leaf);
        if (t == nullptr) t = ck.find(base + proj + leaf);
        if (t == nullptr) continue;
        if (t->numel() != 1 ||
            (t->dtype != DType::kF32 && t->dtype != DType::kBF16 && t->dtype != DType::kF16)) {
          return make_error(ErrorCode::kInvalidArgument,
                            "KV cache scale " + t->name + " in " + t->file + " has shape " +
                                t->shape_str() + " and dtype " + dtype_name(t->dtype) +
                                "; a per-tensor fp8 KV scale is one f32/bf16/f16 value",
                            t->name);
        }
        const float v = scalar_value(*t);
        if (!(v > 0.f) || !std::isfinite(v)) {
          return make_error(ErrorCode::kInvalidArgument,
                            "KV cache scale " + t->name + " is " + std::to_string(v) +
                                "; a scale must be a positive finite number",
                            t->name);
        }
        (kv == 0 ? ks : vs)[i] = v;
        any = true;
        break;
      }
    }
  }
  if (any) {
    cfg.kv_k_scale = std::move(ks);
    cfg.kv_v_scale = std::move(vs);
  }
  return {};
}

void M3Model::set_kv_cache_format(kernels::KvDtype kv, kernels::KvDtype index) {
  cfg_.kv_cache_dtype = kv;
  cfg_.index_cache_dtype = index;
}

namespace {

// One line when the weights are not all bf16/f32: the formats held and the weight bytes (with
// fp8_per_channel, what the bf16 linears took before).
void log_weight_formats(const M3Weights& w, const M3Config& cfg, const QuantPlan& quant) {
  std::string formats;
  for (int q = 1; q < 5; ++q) {
    if (w.num_quantized[q] == 0) continue;
    formats += (formats.empty() ? "" : ", ") + std::to_string(w.num_quantized[q]) + " " +
               kernels::weight_quant_name(static_cast<kernels::WeightQuant>(q));
  }
  if (formats.empty()) return;
  const double mib = 1024.0 * 1024.0;
  const double bytes = static_cast<double>(view_bytes(w, m3_tensors(cfg)));
  if (quant.online_fp8_per_channel) {
    const double fp8 = static_cast<double>(w.online_source_bytes);
    size_t now = 0;
    for (const TensorSpec& t : m3_tensors(cfg)) {
      if (t.vector || !t.quantizable) continue;
      for (int64_t e = 0; e < t.count_in(w); ++e) now += static_cast<size_t>(t.mat(w, e).bytes());
    }
    M3_LOG_INFO(
        "--quantization fp8_per_channel: %s linears quantized at load to e4m3 + one f32 scale "
        "per output channel: %.2f MiB (were %.2f MiB); weights %.2f MiB in all. On the GPU, "
        "prefill steps above 256 tokens also quantize the activations per token to e4m3 for "
        "FP8 tensor-core GEMMs (M3_FP8_ACTIVATIONS=0: bf16 activations)",
        formats.c_str(), static_cast<double>(now) / mib, fp8 / mib, bytes / mib);
  } else {
    M3_LOG_INFO("weights kept as stored (quant_method %s): %s linears, %.2f MiB in all",
                quant.checkpoint.method.empty() ? "none" : quant.checkpoint.method.c_str(),
                formats.c_str(), bytes / mib);
  }
  // Checkpoints that quantize activations too (NVFP4 is W4A4: ModelOpt's input_scale,
  // compressed-tensors' input_global_scale; compressed-tensors groups declaring
  // input_activations): said once, since the activations are not quantized here.
  std::string declared;
  for (const CheckpointQuant::Group& g : quant.checkpoint.groups)
    if (g.activations) declared += (declared.empty() ? "'" : ", '") + g.name + "'";
  if (!declared.empty()) {
    M3_LOG_INFO(
        "compressed-tensors group %s declares quantized input activations; m3serve runs the "
        "linears weight-only: the activations stay unquantized (bf16 on the GPU, f32 on the "
        "CPU; on the GPU only fp8_per_channel linears quantize their prefill activations per "
        "token, M3_FP8_ACTIVATIONS=0 turns that off)",
        declared.c_str());
  } else if (w.num_quantized[static_cast<size_t>(kernels::WeightQuant::kNvfp4)] > 0) {
    M3_LOG_INFO(
        "NVFP4 linears run weight-only: the checkpoint's activation scales are not used and the "
        "activations stay unquantized (bf16 on the GPU, f32 on the CPU; Hopper has no FP4 "
        "tensor cores)");
  }
}

}  // namespace

Result<std::unique_ptr<M3Model>> M3Model::load(const std::string& model_dir,
                                               const LoadOptions& opts) {
  if (is_synthetic_model(model_dir)) {
    M3_TRY(SyntheticSpec spec, parse_synthetic_spec(model_dir));
    if (!opts.quantization.empty() && opts.quantization != "none" && opts.quantization != "auto") {
      return make_error(ErrorCode::kInvalidArgument,
                        "--quantization " + opts.quantization +
                            " applies to a checkpoint directory; a synthetic model's weights "
                            "are generated on the GPU in bf16: drop --quantization",
                        "--quantization");
    }
    M3Config cfg = synthetic_m3_config(spec.layers);
    if (spec.vision && !opts.language_model_only) {
      cfg.has_vision_config = true;  // M3's vision_config (model/config.h defaults)
      cfg.vision.present = true;
    }
    std::unique_ptr<M3Model> m = config_only(std::move(cfg));
    m->synthetic_weights_ = spec.weights;  // generated in that format by the GPU backend
    return m;
  }
  M3_TRY(M3Config cfg, load_config(model_dir));
  // The checkpoint's declared quantization against --quantization, before any tensor is read.
  M3_TRY(QuantPlan quant,
         resolve_quantization(opts.quantization, read_checkpoint_quant(model_dir)));
  std::vector<std::string> skip;
  if (opts.language_model_only) {
    skip = {"vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
            "model.multi_modal_projector."};
  }
  M3_TRY(Checkpoint ck, Checkpoint::open(model_dir, skip));
  M3_TRY_STATUS(load_kv_scales(ck, cfg));
  auto ckpt = std::make_shared<Checkpoint>(std::move(ck));
  M3_TRY(auto w, load_weights(ckpt, cfg, quant));
  log_weight_formats(*w, cfg, quant);
  std::shared_ptr<const VisionTower> tower;
  if (!opts.language_model_only && cfg.vision.present) {
    auto t = VisionTower::load(ckpt, cfg);
    if (!t) {
      Error e = t.error();
      e.message +=
          " (the vision tower; to serve the text model alone, start with "
          "--language-model-only)";
      return tl::unexpected(std::move(e));
    }
    tower = std::move(*t);
  }
  auto m = std::make_unique<M3Model>(std::move(cfg), std::move(w));
  m->vision_ = std::move(tower);
  return m;
}

void M3Model::encode_images(std::span<const VisionImage> images, std::vector<float>* embeds) const {
  M3_CHECK(vision_ != nullptr, "encode_images on a model loaded without its vision tower");
  vision_->encode(images, embeds);
}

namespace {
ShardPlan unsharded_plan(const M3Config& cfg) {
  auto p = make_shard_plan(cfg, ShardSpec{});
  M3_CHECK(p.has_value(), "unsharded plan: %s", p ? "" : p.error().message.c_str());
  return *p;
}
}  // namespace

M3Model::M3Model(M3Config cfg, std::unique_ptr<M3Weights> w)
    : cfg_(std::move(cfg)), base_(std::move(w)), w_(base_), plan_(unsharded_plan(cfg_)) {
  init_forward();
}

M3Model::M3Model(M3Config cfg, std::shared_ptr<const M3Weights> base,
                 std::unique_ptr<M3Weights> views, ShardPlan plan, dist::Communicator* comm)
    : cfg_(std::move(cfg)), base_(std::move(base)), w_(std::move(views)), plan_(plan), comm_(comm) {
  init_forward();
}

Result<std::unique_ptr<M3Model>> M3Model::make_shard(const ShardSpec& spec) const {
  if (!has_weights()) {
    return make_error(ErrorCode::kUnsupported,
                      "a config-only (synthetic) model has no host weights to shard",
                      "--tensor-parallel-size");
  }
  M3_CHECK(!plan_.sharded(), "make_shard on a model that is already a shard");
  M3_CHECK(spec.world == 1 || spec.comm != nullptr, "a sharded model needs a communicator");
  M3_TRY(ShardPlan plan, make_shard_plan(cfg_, spec));
  auto views = shard_weights(*base_, cfg_, plan);
  auto shard = std::unique_ptr<M3Model>(
      new M3Model(cfg_, base_, std::move(views), plan, plan.sharded() ? spec.comm : nullptr));
  shard->vision_ = vision_;
  return shard;
}

std::unique_ptr<M3Model> M3Model::config_only(M3Config cfg) {
  return std::make_unique<M3Model>(std::move(cfg), std::make_unique<M3Weights>());
}

Status M3Model::validate_prompt(std::span<const int32_t> ids) const {
  return validate_prompt_ids(cfg_, ids);
}

Status validate_prompt_ids(const M3Config& cfg, std::span<const int32_t> ids) {
  if (ids.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "the prompt is empty; give at least one token",
                      "prompt");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= cfg.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "prompt token " + std::to_string(i) + " has id " + std::to_string(ids[i]) +
                            ", outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")",
                        "prompt");
    }
  }
  return {};
}

void M3Model::init_forward() {
  ops_ = std::make_unique<CpuOps>(comm_);
  fw_ = std::make_unique<M3Forward<CpuOps>>(cfg_, plan_, *w_, std::vector<kernels::MatRef>{});
}

M3Model::~M3Model() = default;

void M3Model::set_dp_step_rows(int64_t max_rows) const {
  fw_->set_dp_step_rows(max_rows);
}

void M3Model::forward_dp_idle() const {
  fw_->run_idle(*ops_);
}

int64_t M3Model::moe_dispatch_bytes() const {
  return fw_->moe_dispatch_bytes();
}

void M3Model::forward(const ForwardBatch& b, KvCache& cache, ForwardResult* out,
                      bool capture_msa) const {
  const int64_t T = static_cast<int64_t>(b.token_ids.size());
  M3_CHECK(T > 0 && b.positions.size() == (size_t)T && b.seq_ids.size() == (size_t)T);
  M3_CHECK(has_weights(), "M3Model::forward on a config-only (synthetic) model");
  M3_CHECK(cache.page_size() == cfg_.sparse_block_size);
  kernels::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = b.positions.data();
  layout.seq_ids = b.seq_ids.data();
  layout.block_table_offsets = b.block_table_offsets.data();
  layout.block_table = b.block_table.data();
  // A tensor shard always produces logits: the lm_head all-gather is a collective every rank
  // joins.
  ForwardResult scratch;
  if (out == nullptr && plan_.tensor_sharded()) out = &scratch;
  if (out) {
    out->msa_blocks.clear();
    if (capture_msa) out->msa_blocks.resize(cfg_.num_hidden_layers);
  }
  const int64_t max_pos = *std::max_element(b.positions.begin(), b.positions.end());
  M3_CHECK(b.embed_values.size() == b.embed_rows.size() * static_cast<size_t>(cfg_.hidden_size),
           "embed_values holds %zu floats for %zu rows", b.embed_values.size(),
           b.embed_rows.size());
  const EmbedOverride emb{b.embed_rows.data(), b.embed_values.data(),
                          static_cast<int64_t>(b.embed_rows.size())};
  const int64_t naux = static_cast<int64_t>(b.aux_layers.size());
  std::vector<float> aux_buf;  // host memory is the Ops' memory
  if (naux > 0) aux_buf.assign(static_cast<size_t>(T * naux * cfg_.hidden_size), 0.f);
  const AuxCapture aux{b.aux_layers.data(), naux, aux_buf.data()};
  fw_->run_layers(*ops_, b.token_ids.data(), layout, cache, max_pos + 1,
                  out && capture_msa ? out : nullptr, &emb, naux > 0 ? &aux : nullptr);
  if (!out) return;
  out->aux_hidden = std::move(aux_buf);
  const int64_t R = static_cast<int64_t>(b.logits_indices.size());
  out->vocab_size = cfg_.vocab_size;
  out->logits.assign(R * cfg_.vocab_size, 0.f);
  out->logits_rows.clear();
  out->sampled.clear();
  if (R == 0) return;
  for (int32_t t : b.logits_indices)
    M3_CHECK(t >= 0 && t < T, "logits index %d of %lld", t, static_cast<long long>(T));
  fw_->logits(*ops_, b.logits_indices.data(), R, out->logits.data());
}

}  // namespace m3::model
