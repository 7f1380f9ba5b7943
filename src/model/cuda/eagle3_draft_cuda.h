// Eagle3DraftCuda: the EAGLE-3 draft head (model/eagle3_draft.h) on the target's GPU: the one
// draft forward (model/eagle3_forward.h) over CudaOps on the target model's stream, its weights on
// the device as stored (a bf16 checkpoint stays bf16; the Llama norms as f32 w - 1), the target's
// device embedding and LM head shared, its paged KV cache (one layer, bf16, the target's page ids
// and page count) in device memory, and the target step's aux hidden states read where
// M3ModelCuda left them (no host copy). propose() stages every step's arrays in one pinned
// transfer, runs the context pass and the K - 1 draft steps back to back (greedy ids from the
// device sampler, d2t-mapped and fed to the next step on the device) and copies the proposals
// back once. The draft steps read their inputs at fixed device addresses (a device copy of the
// step's staged arrays, the step before's ids) and replay CUDA graphs captured per (rows, KV
// length bucket, first step or later); the context pass (a varying token count) runs eagerly. Made
// by the single-GPU backend (runtime/cuda/cuda_backend.cpp); also the synthetic benchmark drafts
// (synthetic:mha / synthetic:gqa: random device weights of M3's draft shapes). Invariant: the
// draft's K/V at a position is written before its attention reads it (as on the CPU); propose()
// returns with the device idle; not thread-safe (the engine thread).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>

#include "core/error.h"
#include "gpu/device_buffer.h"
#include "kernels/cpu/sample.h"
#include "model/cuda/kv_cache_cuda.h"
#include "model/eagle3_draft.h"

namespace m3::model {

class CudaOps;
class M3ModelCuda;
template <class Ops>
class Eagle3Forward;

class Eagle3DraftCuda final : public DraftProposer {
 public:
  // The draft `model` (a checkpoint directory, read with the target's host weights for the shared
  // tensors' checks, or synthetic:mha / synthetic:gqa generated from `seed`) with its weights on
  // the target's device; its KV cache comes with allocate_kv(). Errors: load_eagle3_checkpoint's,
  // an unknown synthetic name, weights that do not fit in the free GPU memory.
  static Result<std::unique_ptr<Eagle3DraftCuda>> load(const std::string& model,
                                                       M3ModelCuda& target, int device,
                                                       uint64_t seed = 0);
  // Over host weights already loaded (tests: the same numbers as a host Eagle3Draft).
  Eagle3DraftCuda(Eagle3Config cfg, const Eagle3Weights& host, M3ModelCuda& target, int device);
  ~Eagle3DraftCuda() override;

  // One KV page of the draft (bf16 K and V of its KV heads, page_size tokens).
  int64_t kv_page_bytes() const;
  // Allocates `num_pages` zeroed pages (the target pool's count); once, before propose().
  void allocate_kv(int64_t num_pages);
  int64_t kv_bytes() const { return cache_ ? cache_->total_bytes() : 0; }
  size_t weight_bytes() const { return weight_bytes_; }
  const std::string& name() const { return name_; }

  const Eagle3Config& config() const override { return cfg_; }
  int64_t kv_bytes_per_token() const override;
  std::string where() const override { return "cuda:" + std::to_string(device_); }
  bool aux_on_device() const override { return true; }
  std::vector<std::vector<int32_t>> propose(const std::vector<DraftSeq>& seqs,
                                            std::span<const float> aux_hidden, int k) override;

  // Tests: one draft forward of `batch` (hidden on the host, copied up) with the pre-norm output
  // and the logits rows [R, draft_vocab] copied back (the CPU draft's DraftResult plus logits).
  void forward_for_test(const DraftBatch& batch, std::vector<float>* prenorm,
                        std::vector<float>* logits);

  // The one-token draft steps (after the context pass) replay CUDA graphs, one per (rows, KV
  // length bucket, first step or later): on by default, off with the target's graphs
  // (--enforce-eager, M3_ENFORCE_EAGER=1), with M3_DRAFT_EAGER=1 in the environment, or here.
  // Either way a step computes the same numbers (same kernels, same bucketed KV bound).
  void set_use_graphs(bool on);
  bool use_graphs() const;
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graph_captures() const { return graph_captures_; }

  // Benchmarks: device time of each propose() in parts, from CUDA events on the stream (off by
  // default: recording them costs a few microseconds per call).
  struct Profile {
    int64_t calls = 0, draft_steps = 0;
    double stage_ms = 0;    // the staged H2D copy (from the first event to the context pass)
    double context_ms = 0;  // the context pass: fc, the layer, LM head, greedy ids
    double steps_ms = 0;    // the K - 1 draft steps (graphs or eager)
    double span_ms = 0;     // first event to the ids' copy back: the device's share of the call
    double wall_ms = 0;     // the whole call on the host
  };
  void set_profile(bool on) { profile_on_ = on; }
  const Profile& profile() const { return profile_; }
  void reset_profile() { profile_ = Profile{}; }

 private:
  Eagle3DraftCuda(Eagle3Config cfg, M3ModelCuda& target, int device);
  void* alloc(size_t bytes);
  kernels::MatRef upload(const kernels::MatRef& m);
  kernels::VecRef upload(const kernels::VecRef& v);
  void generate(uint64_t seed);  // synthetic weights
  void share_target();           // embedding / LM head from the target where not own
  void init_forward();

  Eagle3Config cfg_;
  M3Config cache_cfg_;  // one full-attention layer of bf16 K/V, the target's page size
  M3ModelCuda& target_;
  int device_;
  std::string name_;
  Eagle3Weights dev_;  // device views
  std::vector<gpu::DeviceBuffer<uint8_t>> storage_;
  size_t weight_bytes_ = 0;
  gpu::DeviceBuffer<int32_t> d2t_;  // [draft_vocab] target ids; empty without a map
  std::unique_ptr<KvCacheCuda> cache_;
  std::unique_ptr<CudaOps> ops_;
  std::unique_ptr<Eagle3Forward<CudaOps>> fw_;
  // The step arrays: one pinned staging buffer, one copy to step_.
  int32_t* stage_ = nullptr;
  size_t stage_cap_ = 0;
  gpu::DeviceBuffer<int32_t> step_;
  gpu::DeviceBuffer<float> hidden_;                    // a step's hidden input rows
  gpu::DeviceBuffer<int32_t> tokens_;                  // a draft step's input ids (device-made)
  gpu::DeviceBuffer<int32_t> ids_, mapped_;            // greedy draft ids per row; as target ids
  gpu::DeviceBuffer<kernels::cpu::SampleRow> greedy_;  // rows 0..n-1, temperature 0
  int32_t* out_host_ = nullptr;                        // pinned: every step's mapped ids
  size_t out_host_cap_ = 0;
  // The draft steps' inputs at fixed addresses (what their graphs read): the step's arrays
  // (copied from the staged words), and the ids of the step before (the context pass's are in
  // mapped_ at 0; later steps write theirs to step_ids_, then copied to their place in mapped_).
  gpu::DeviceBuffer<int32_t> step_in_, step_ids_;
  struct GraphEntry {
    cudaGraphExec_t exec = nullptr;
    uint64_t generation = 0;       // the ops' buffer generation it was captured at
    bool seen = false;             // one eager run at seen_generation sized the buffers
    uint64_t seen_generation = 0;  //
  };
  std::map<std::tuple<int64_t, int64_t, bool>, GraphEntry> graphs_;
  bool use_graphs_ = true;
  int64_t graph_replays_ = 0, graph_captures_ = 0;
  void clear_graphs();
  // One draft step of R rows over the fixed inputs: hidden and ids of the step before, the
  // layer, the LM head, greedy ids mapped to target ids into step_ids_.
  void draft_step(int64_t R, int64_t max_kv_len, bool first);
  bool profile_on_ = false;
  Profile profile_;
  cudaEvent_t ev_[4] = {nullptr, nullptr, nullptr, nullptr};
};

}  // namespace m3::model
