// M3ModelCuda: the MiniMax-M3 text model on one GPU: the one forward pass (model/m3_forward.h)
// over the CUDA ops (model/cuda/cuda_ops.h), the same layer stack M3Model runs on the CPU ops.
// What is the GPU's own: the weights on the device, the step's arrays staged in pinned memory,
// CUDA graphs of the layers, and sampling next to the logits. Loading reuses M3Model::load (config,
// checkpoint, weight checks) on the host, then uploads every weight once as stored (bf16/f32, and
// quantized linears as their codes and scales where the quantized kernels read them);
// synthetic() instead generates M3-shaped weights on the device (no host weights at all). The model
// keeps its own M3Config. Called by the GPU backends of src/runtime/cuda (`serve`, `generate`),
// runtime/cuda/cuda_backend.cpp and tests/model_cuda.
// Tensor parallelism: from_host() of a shard (M3Model::make_shard) runs that rank's part of the
// forward on its GPU with the same plan and collectives as the CPU shard, the collectives
// enqueued on a device communicator's stream ordered after/before the model's stream by events
// (so they are captured into the decode graphs too); runtime/cuda/cuda_shard_backend.cpp drives it.
// Attention data parallel (a data_sharded() shard): each rank's forward() runs only its own
// sequences, unsharded except the routed experts, whose all-gather / reduce-scatter every rank
// joins each step; runtime/cuda/cuda_dp_backend.cpp drives it.
// Invariant: forward() has M3Model::forward's contract (host batch in, host logits out, K/V/index-K
// of every step token written before any attention reads them) and has finished on the device
// when it returns. Not thread-safe: one forward at a time (it owns its stream and scratch space).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "gpu/device_buffer.h"
#include "kernels/cuda/attn_flash.h"
#include "model/config.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/m3_model.h"
#include "model/weights.h"

namespace m3::model {
struct AuxCapture;     // model/m3_forward.h
struct EmbedOverride;  // model/m3_forward.h

class CudaOps;
class VisionTowerCuda;
template <class Ops>
class M3Forward;

class M3ModelCuda {
 public:
  // Loads on the host, checks the GPU (present, enough free memory) and uploads the weights.
  static Result<std::unique_ptr<M3ModelCuda>> load(const std::string& model_dir,
                                                   const LoadOptions& opts = {}, int device = 0);
  // Uploads an already-loaded host model (tests reuse one for the CPU comparison).
  // A shard (host->shard_plan().sharded()) needs `comm`, a communicator of the same
  // rank/world over device memory of `device` that enqueues its collectives on `comm_stream`
  // (dist::NcclCommunicator and its stream()); every tensor-parallel rank must then call
  // forward() with the same batch, every data-parallel rank forward() with its own sequences
  // or forward_dp_idle(), after set_dp_step_rows(). Errors: as load().
  static Result<std::unique_ptr<M3ModelCuda>> from_host(std::unique_ptr<M3Model> host,
                                                        int device = 0,
                                                        dist::Communicator* comm = nullptr,
                                                        cudaStream_t comm_stream = nullptr);
  // Weights generated on the device from `seed` (model/cuda/synthetic_weights.h) for `cfg`
  // (model/synthetic_model.h's synthetic_m3_config): uniform with std 1/sqrt(fan_in) for the
  // matrices, std 1 for the embedding, near-zero Gemma norm weights ((1 + w) ~ 1) and a small
  // router bias, so activations stay O(1) through the layers. MoE expert weights of a layer are
  // one allocation per projection (experts[e].w1.data == experts[0].w1.data + e*inter*hidden).
  // Errors: no GPU, weights that do not fit in the free memory (names the numbers and layers=).
  // With `shard` (a plan of make_shard_plan(cfg, ...)) only that rank's slices are generated,
  // each element drawn at its index in the whole tensor, so the ranks together hold exactly the
  // unsharded model's weights; a tensor-parallel shard then needs `comm` and `comm_stream` as
  // from_host() does before forward() (weights alone, e.g. for checksums, need neither).
  // `weights` (model/synthetic_model.h SyntheticSpec::weights; one GPU only): the linears in a
  // stored format, the same bf16 values quantized on the device (quantize_bf16_rows) and held
  // quantized like a checkpoint's.
  static Result<std::unique_ptr<M3ModelCuda>> synthetic(
      const M3Config& cfg, uint64_t seed, int device = 0, const ShardPlan* shard = nullptr,
      dist::Communicator* comm = nullptr, cudaStream_t comm_stream = nullptr,
      kernels::WeightQuant weights = kernels::WeightQuant::kNone);

  M3ModelCuda(const M3ModelCuda&) = delete;
  M3ModelCuda& operator=(const M3ModelCuda&) = delete;

  const M3Config& config() const { return cfg_; }
  // The host model the weights came from (same numbers on the CPU path); null for synthetic().
  const M3Model* host() const { return host_.get(); }
  Status validate_prompt(std::span<const int32_t> ids) const {
    return validate_prompt_ids(cfg_, ids);
  }
  size_t weight_bytes() const { return weight_bytes_; }
  // Image input: the vision tower on this GPU (model/cuda/vision_cuda.h), uploaded from the
  // host model's tower (null when it was loaded with --language-model-only or has none) or, for
  // a synthetic model whose config has cfg.vision, generated. encode_images() runs it on the
  // model's stream (after any launched step) and returns the embeddings on the host; forward()
  // then takes them through ForwardBatch::embed_rows / embed_values.
  bool has_vision() const { return vision_ != nullptr; }
  const VisionTowerCuda* vision() const { return vision_.get(); }
  void encode_images(std::span<const VisionImage> images, std::vector<float>* embeds);
  // The device views of every weight (device pointers), e.g. for checksums in tests.
  const M3Weights& device_weights() const { return dev_; }
  // What this model holds of the whole (the unsharded plan unless built from a shard); a
  // rank's KvCacheCuda must hold shard_plan().num_kv_heads heads.
  const ShardPlan& shard_plan() const { return plan_; }

  // Decode-sized steps (at most kGraphMaxTokens tokens, no capture_msa) replay a CUDA graph of
  // the layers, captured per (tokens, key-count bucket, cache) on the second step of that shape
  // (the first runs eagerly and sizes every buffer) and re-captured when a buffer grows.
  // The embedding, logits and sampling run eagerly around it.
  void forward(const ForwardBatch& batch, KvCacheCuda& cache, ForwardResult* out,
               bool capture_msa = false);
  // Async scheduling (runtime::ForwardBackend::launch): enqueues forward()'s work on the stream
  // and returns without waiting, unless the step copies logits rows or aux states to the host
  // (those copies go to pageable memory and wait); collect() waits for the oldest launched step
  // and gives its result. The batch's prev_sample_tokens are filled on the device from the ids
  // the previously enqueued step sampled. At most two steps launched and not collected.
  void launch(const ForwardBatch& batch, KvCacheCuda& cache);
  void collect(ForwardResult* out);
  // The host KV tier: the next enqueued step (forward or launch) waits, layer by layer, for
  // these events (one per layer, recorded by runtime::HostKvTierCuda after that layer's copies)
  // before it first touches the layer's pages; a step that replays a CUDA graph waits for all
  // of them before the graph. Consumed by that step.
  void wait_for_kv_copies(std::vector<cudaEvent_t> layer_events);
  // The stream every step's work is enqueued on (the tier's copies are ordered after it; a
  // device draft enqueues its steps on it, after the target's).
  cudaStream_t stream() const { return stream_.get(); }
  // The step sizes (token counts) that replay CUDA graphs: every size up to kGraphMaxTokens
  // (256) when empty (the default), else exactly the listed ones (vLLM's
  // cudagraph_capture_sizes; other sizes run eagerly: steps are not padded to a listed size).
  void set_graph_sizes(std::vector<int64_t> sizes);
  // Graphs on (default) or off (--enforce-eager, or M3_ENFORCE_EAGER=1 in the environment).
  void set_use_graphs(bool on);
  // Attention data parallel only: the largest token count any rank has in the coming step (the
  // host knows every rank's count, so no device sync). Each MoE layer all-gathers this many rows
  // from every rank (this rank's tokens, zero-padded), so set it before every step on every rank.
  // It is part of a decode graph's key.
  void set_dp_step_rows(int64_t max_rows);
  // Attention data parallel: the step of a rank with no tokens. Joins every MoE layer's
  // collectives with 0 rows of its own (the other ranks' tokens still meet this rank's experts);
  // returns when they have finished on the device.
  void forward_dp_idle();
  bool use_graphs() const { return use_graphs_; }
  // Benchmarks only: tensor-parallel collectives become no-ops (wrong results; bench/bench_tp
  // times a step without its communication). Set before the first forward.
  void set_skip_collectives_for_timing(bool on);
  // Speculative decoding: the aux hidden states of the last step that asked for them with
  // ForwardBatch::aux_on_device, [its tokens, aux_layers * hidden] f32 on the device, valid until
  // the next step; aux_state_rows() is that step's token count (0: none).
  const float* aux_states() const;
  int64_t aux_state_rows() const { return aux_rows_; }
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graph_captures() const { return graph_captures_; }
  ~M3ModelCuda();

 private:
  // What a captured graph depends on besides buffer addresses: the token count, the bucketed
  // key-count bound that sizes MSA scores and KV splits, and the cache's pages.
  struct StepShape {
    int64_t num_tokens = 0;
    int64_t max_kv_len = 0;
    KvCacheCuda* cache = nullptr;
  };
  // Every layer of the step on the stream (M3Forward::run_layers), device work only (no host
  // sync unless msa_out, or the MoE has more tokens than its graph-safe grouped path takes).
  void run_layers(const StepShape& shape, const int32_t* tokens,
                  const kernels::cpu::TokenLayout& layout, ForwardResult* msa_out,
                  const AuxCapture* aux = nullptr, const EmbedOverride* emb = nullptr);
  void replay_or_capture(const StepShape& shape, const int32_t* tokens,
                         const kernels::cpu::TokenLayout& layout, const AuxCapture* aux);
  void clear_graphs();
  bool graph_size(int64_t num_tokens) const;
  // forward()'s work on the stream, ending with the step's event; the sampled ids go to the
  // step's pinned buffer (wait_step copies them to out->sampled). A step with embed_rows runs
  // eagerly (its embedding overrides are not part of a captured graph).
  void enqueue(const ForwardBatch& batch, KvCacheCuda& cache, ForwardResult* out, bool capture_msa);
  void wait_step(int slot, ForwardResult* out);

  M3ModelCuda(M3Config cfg, std::unique_ptr<M3Model> host);
  // Shards: the communicator and its stream (CudaOps forks / joins the collectives).
  void attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream);
  // The forward over dev_ and fused_proj_, once both are final.
  void init_forward();
  void upload_weights();
  // Sizes the ops' dequantisation workspace for the largest quantized matrix (none: nothing).
  void reserve_quant_workspace();
  // synthetic(): fills dev_ on the device (linears quantized to `weights` unless kNone).
  void generate_weights(uint64_t seed, kernels::WeightQuant weights);
  // synthetic(): the vision tower of a config with vision (SyntheticSpec::vision), from `seed`.
  void add_synthetic_vision(uint64_t seed, int device);
  void* alloc_weight(size_t bytes);  // one weight allocation, counted in weight_bytes_
  // Stores each layer's q|k|v(|index q|index k) projections as one matrix (fused_proj_), bf16
  // or one quantized format; the per-projection views become its row slices.
  void fuse_attention_projections();
  // Moves matrices of equal width and one format (bf16, or a quantized one held quantized:
  // codes back to back, then the scales) into one allocation, rows back to back (null MatRef
  // and nothing moved when a part is missing or the formats differ).
  MatRef fuse_rows(const std::vector<MatRef*>& parts);
  MatRef upload(const MatRef& m);
  VecRef upload(const VecRef& v);
  VecRef upload_f32(const VecRef& v);  // widened to f32 on the host first (router bias)

  M3Config cfg_;
  std::unique_ptr<M3Model> host_;  // null for synthetic models
  ShardPlan plan_;                 // host_->shard_plan(), or the unsharded plan
  M3Weights dev_;                  // the same views as host_->weights(), pointing to device memory
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  std::vector<MatRef> fused_proj_;  // per layer; data null where the projections stay separate
  size_t weight_bytes_ = 0;
  gpu::Stream stream_;
  std::unique_ptr<CudaOps> ops_;            // on stream_: scratch, collectives
  std::unique_ptr<M3Forward<CudaOps>> fw_;  // reads cfg_, plan_, dev_, fused_proj_

  struct GraphEntry {
    cudaGraphExec_t exec = nullptr;
    uint64_t generation = 0;  // buffer generation the graph was captured at
    bool seen = false;        // an eager step of this shape ran at seen_generation
    bool never = false;       // its eager run synchronised the host: stays eager
    uint64_t seen_generation = 0;
  };
  // Keyed by (tokens, key-count bucket, cache id, data-parallel MoE rows (0 unless DP), whether
  // some sequence has several tokens: the attention then launches its query-tiled kernel too,
  // the aux layers copied out for a device draft (0: none; the copies are part of the graph)).
  std::map<std::tuple<int64_t, int64_t, uint64_t, int64_t, bool, int64_t>, GraphEntry> graphs_;
  int64_t aux_rows_ = 0;  // aux_state_rows()
  // The step's host arrays, staged in pinned memory and copied in one transfer to step_.
  int32_t* stage_ = nullptr;
  size_t stage_cap_ = 0;
  gpu::DeviceBuffer<int32_t> step_;
  gpu::DeviceBuffer<float> embed_values_;  // the step's image embeddings (ForwardBatch)
  std::unique_ptr<VisionTowerCuda> vision_;
  bool use_graphs_ = true;
  int64_t graph_replays_ = 0, graph_captures_ = 0;
  // FlashInfer's prefill for the eager steps' prefill runs (kernels/cuda/attn_flash.h); null
  // where the build has no FlashInfer or M3_NO_FLASHINFER=1 is set.
  std::unique_ptr<kernels::cuda::FlashPrefill> flash_;

  // Device sampling: the sampled ids, one buffer per step slot (steps alternate, so a step's
  // gather of the previous step's ids reads a buffer this step does not write).
  gpu::DeviceBuffer<int32_t> smp_ids_[2];
  // Per step slot: the sampled ids' pinned host copy, their count, the step's end.
  int32_t* ids_host_[2] = {nullptr, nullptr};
  size_t ids_host_cap_[2] = {0, 0};
  int64_t ids_count_[2] = {0, 0};
  cudaEvent_t step_done_[2] = {nullptr, nullptr};
  cudaEvent_t stage_copied_ = nullptr;  // the last H2D copy out of stage_ has run
  bool stage_pending_ = false;
  uint64_t num_enqueued_ = 0;  // steps enqueued so far (slot = count % 2)
  // Launched steps not collected: their results (filled as far as the host has them) and slots.
  struct Launched {
    ForwardResult result;
    int slot = 0;
  };
  std::deque<Launched> launched_;
  std::vector<cudaEvent_t> kv_copy_waits_;  // wait_for_kv_copies, for the next enqueue
  std::vector<int64_t> graph_sizes_;        // ascending; empty: every size up to kGraphMaxTokens
};

}  // namespace m3::model
