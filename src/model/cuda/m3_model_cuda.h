// M3ModelCuda: the MiniMax-M3 text model on one GPU, computing what M3Model::forward computes,
// op by op, with the CUDA ops of kernels/cuda. Loading reuses M3Model::load (config, checkpoint,
// weight checks) on the host, then uploads every weight once, bf16/f32 as stored; synthetic()
// instead generates M3-shaped weights on the device (no host weights at all). The model keeps its
// own M3Config. Called by `m3serve generate|serve --device cuda`, SequenceRunnerCuda,
// model/cuda/cuda_backend.cpp and tests/model_cuda.
// Tensor parallelism: from_host() of a shard (M3Model::make_shard) runs that rank's part of the
// forward on its GPU with the same plan and collectives as the CPU shard, the collectives
// enqueued on a device communicator's stream ordered after/before the model's stream by events
// (so they are captured into the decode graphs too); model/cuda/cuda_shard_backend.cpp drives it.
// Attention data parallel (a data_sharded() shard): each rank's forward() runs only its own
// sequences, unsharded except the routed experts, whose all-gather / reduce-scatter every rank
// joins each step; model/cuda/cuda_dp_backend.cpp drives it.
// Invariant: forward() has M3Model::forward's contract (host batch in, host logits out, K/V/index-K
// of every step token written before any attention reads them) and has finished on the device
// when it returns. Not thread-safe: one forward at a time (it owns its stream and scratch space).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"
#include "gpu/device_buffer.h"
#include "model/config.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/m3_model.h"
#include "model/weights.h"

namespace m3::model {

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
  static Result<std::unique_ptr<M3ModelCuda>> synthetic(const M3Config& cfg, uint64_t seed,
                                                        int device = 0,
                                                        const ShardPlan* shard = nullptr,
                                                        dist::Communicator* comm = nullptr,
                                                        cudaStream_t comm_stream = nullptr);

  M3ModelCuda(const M3ModelCuda&) = delete;
  M3ModelCuda& operator=(const M3ModelCuda&) = delete;

  const M3Config& config() const { return cfg_; }
  // The host model the weights came from (same numbers on the CPU path); null for synthetic().
  const M3Model* host() const { return host_.get(); }
  Status validate_prompt(std::span<const int32_t> ids) const {
    return validate_prompt_ids(cfg_, ids);
  }
  size_t weight_bytes() const { return weight_bytes_; }
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
  void set_skip_collectives_for_timing(bool on) { skip_collectives_ = on; }
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
  // Every layer of the step on the stream, device work only (no host sync unless msa_out, or
  // the MoE has more tokens than its graph-safe grouped path takes).
  void run_layers(const StepShape& shape, const int32_t* tokens,
                  const kernels::cpu::TokenLayout& layout, ForwardResult* msa_out);
  void replay_or_capture(const StepShape& shape, const int32_t* tokens,
                         const kernels::cpu::TokenLayout& layout);
  void clear_graphs();

  M3ModelCuda(M3Config cfg, std::unique_ptr<M3Model> host);
  // Tensor-parallel shards: the communicator and its stream, and the fork/join events.
  void attach_communicator(dist::Communicator* comm, cudaStream_t comm_stream);
  void upload_weights();
  void generate_weights(uint64_t seed);  // synthetic(): fills dev_ on the device
  void* alloc_weight(size_t bytes);      // one weight allocation, counted in weight_bytes_
  // Stores each layer's q|k|v(|index q|index k) projections as one bf16 matrix (fused_proj_);
  // the per-projection views become its row slices.
  void fuse_attention_projections();
  // Moves bf16 matrices of equal width into one allocation, rows back to back (null MatRef and
  // nothing moved when a part is missing or not bf16).
  MatRef fuse_rows(const std::vector<MatRef*>& parts);
  MatRef upload(const MatRef& m);
  VecRef upload(const VecRef& v);
  VecRef upload_f32(const VecRef& v);  // widened to f32 on the host first (router bias)

  void moe(const LayerWeights& L, const float* x, int64_t n, float* out);
  // Router + this rank's experts over n rows of x: out = shared (when non-null) + routed.
  void routed_experts(const LayerWeights& L, const float* x, int64_t n, const float* shared,
                      float* out);
  // Data parallel MoE: all-gather every rank's rows (padded to dp_rows_), this rank's experts
  // over all of them, reduce-scatter back; out = shared expert (local) + the first n rows.
  void moe_dp(const LayerWeights& L, const float* x, int64_t n, float* out);
  // Tensor-parallel collectives on the model's stream (no-ops unless tensor_sharded): the
  // communicator's stream waits for the model's work so far, runs the collective, and the
  // model's stream waits for it (fork/join by events, legal inside a graph capture).
  void tp_all_reduce(float* data, int64_t n);
  template <class T>
  void tp_all_gather(const T* send, int64_t n, T* recv);
  // logits [R, vocab] from this rank's vocabulary rows + an all-gather of the padded chunks.
  void tp_lm_head(const float* hs, int64_t rows, float* logits);
  // Eager only (host sync): the ranks' MSA selections [T, local KV heads, topk] laid out as
  // [T, all KV heads, topk] in `dst`, as M3Model's gather_msa does.
  void tp_gather_msa(const int32_t* sel, int64_t num_tokens, std::vector<int32_t>& dst);
  void dense_mlp(const MatRef& gate, const MatRef& up, const MatRef& down, const float* x,
                 int64_t n, float* out);

  // Scratch: grown on demand (after a stream sync, so no kernel still reads the old memory).
  template <class T>
  T* ensure(gpu::DeviceBuffer<T>& b, size_t n);
  template <class T>
  T* upload_async(gpu::DeviceBuffer<T>& b, const T* host, size_t n);

  M3Config cfg_;
  std::unique_ptr<M3Model> host_;  // null for synthetic models
  ShardPlan plan_;                 // host_->shard_plan(), or the unsharded plan
  dist::Communicator* comm_ = nullptr;  // non-null iff plan_.tensor_sharded(); not owned
  cudaStream_t comm_stream_ = nullptr;  // where comm_ enqueues its collectives
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
  gpu::DeviceBuffer<float> tp_mine_, tp_local_, tp_all_;  // lm_head chunks: own, unpadded, all
  gpu::DeviceBuffer<int32_t> tp_sel_all_;                 // gathered MSA selections
  int64_t dp_rows_ = 0;  // data parallel: the step's largest per-rank token count
  gpu::DeviceBuffer<float> dp_send_, dp_all_, dp_routed_;  // [dp_rows_ | W x dp_rows_, hidden]
  M3Weights dev_;  // the same views as host_->weights(), pointing to device memory
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  std::vector<MatRef> fused_proj_;  // per layer; data null where the projections stay separate
  size_t weight_bytes_ = 0;
  gpu::Stream stream_;

  struct GraphEntry {
    cudaGraphExec_t exec = nullptr;
    uint64_t generation = 0;       // buffer generation the graph was captured at
    bool seen = false;             // an eager step of this shape ran at seen_generation
    bool never = false;            // its eager run synchronised the host: stays eager
    uint64_t seen_generation = 0;
  };
  // Keyed by (tokens, key-count bucket, cache id, data-parallel MoE rows (0 unless DP)).
  std::map<std::tuple<int64_t, int64_t, uint64_t, int64_t>, GraphEntry> graphs_;
  uint64_t generation_ = 1;  // bumped whenever a scratch buffer is reallocated
  // The step's host arrays, staged in pinned memory and copied in one transfer to step_.
  int32_t* stage_ = nullptr;
  size_t stage_cap_ = 0;
  gpu::DeviceBuffer<int32_t> step_;
  bool use_graphs_ = true;
  bool skip_collectives_ = false;  // set_skip_collectives_for_timing
  bool step_syncs_host_ = false;  // set by a run_layers that took a host-synchronising path
  int64_t graph_replays_ = 0, graph_captures_ = 0;

  struct Scratch {
    gpu::DeviceBuffer<int32_t> tokens, positions, seq_ids, bt_offsets, block_table, logit_rows;
    gpu::DeviceBuffer<float> x, a, q, k, v, attn, y, iq, ik, hs, logits, proj;
    gpu::DeviceBuffer<int32_t> sel;
    gpu::DeviceBuffer<uint8_t> attn_ws;  // attention / MSA workspace (kernels/cuda/ops.h)
    gpu::DeviceBuffer<float> g, u;                         // MLP intermediates
    gpu::DeviceBuffer<float> router_logits, route_w;       // MoE router output
    gpu::DeviceBuffer<int32_t> route_ids;
    gpu::DeviceBuffer<uint8_t> moe;                        // moe_experts' workspace
  } ws_;
  // Device sampling: the step's SampleRow list and the sampled ids.
  gpu::DeviceBuffer<kernels::cpu::SampleRow> smp_rows_;
  gpu::DeviceBuffer<int32_t> smp_ids_;
};

}  // namespace m3::model
