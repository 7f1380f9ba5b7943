// ForwardBackend: the runtime's seam between the engine and what runs the model. One backend owns
// (or borrows) a model and the KV pages its forward reads and writes (CPU: M3Model + KvCache;
// sharded CPU ranks: runtime/cpu_sharded_backend.cpp; GPU: M3ModelCuda + KvCacheCuda in
// runtime/cuda/cuda_backend.h), so the engine's ModelRunner and the SequenceRunner drive any
// device through this header alone and never include CUDA headers. Called from one thread.
// Invariant: page ids in a batch's block tables index [0, num_pages()); forward() has
// M3Model::forward's contract (host batch in, host logits out) and has finished when it returns.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/error.h"
#include "model/config.h"
#include "model/eagle3_draft.h"
#include "model/m3_model.h"
#include "model/vision_tower.h"

namespace m3::runtime {

// The model's step types, used throughout the runtime.
using model::ForwardBatch;
using model::ForwardResult;
using model::M3Config;
using model::M3Model;

// One KV page copied between the device pool and the host KV tier (the engine's
// sched::KvPageCopy): K, V, index-K and index-K scales of every layer.
struct HostPageCopy {
  int32_t device_page = 0;
  int32_t host_slot = 0;
};

// One contiguous array of the KV pool in host memory: page p's bytes of it are
// [base + p * page_bytes, base + (p + 1) * page_bytes). A page is the same page in every region.
struct KvRegion {
  void* base = nullptr;
  int64_t page_bytes = 0;
  int64_t num_pages = 0;
};

class ForwardBackend {
 public:
  virtual ~ForwardBackend() = default;

  virtual const M3Config& config() const = 0;
  // KV pages of config().sparse_block_size tokens each; the scheduler hands out exactly these.
  virtual int64_t num_pages() const = 0;
  virtual void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) = 0;
  // True when forward() honours ForwardBatch::device_samples / host_logits_rows (the GPU
  // backend samples next to the logits and copies back token ids instead of vocabulary rows;
  // the CPU backend draws them with the same CPU sampler the engine's host path calls).
  virtual bool samples_on_device() const { return false; }

  // Async scheduling (engine/engine.cpp): launch() starts a step (forward()'s contract,
  // capture_msa off) and may return before it ran; collect() waits for the oldest launched step
  // not collected yet and gives its result. At most two steps are launched and not collected.
  // The batch's prev_sample_tokens take the ids the previously launched step sampled (indices
  // into its device_samples), so a step can be launched before the host has the tokens of the
  // one before it. Only when samples_on_device(). The default runs forward() inside launch()
  // (resolving prev_sample_tokens from the previous result first): nothing overlaps, but the
  // engine's pipeline runs as on a GPU. `batch` need not outlive launch().
  virtual void launch(const ForwardBatch& batch);
  virtual void collect(ForwardResult* out);
  // True when launch() returns while the step still runs (a GPU stream): async scheduling then
  // overlaps the host's work with the device's and is on by default.
  virtual bool launch_overlaps() const { return false; }
  // Empty while the backend can run steps; else why it no longer can (ranks on another node
  // were lost: runtime/multi_node.h). Thread-safe. A step during which it became non-empty has
  // no usable result: the engine fails its requests with this text instead of reading it.
  virtual std::string fault() const { return ""; }
  // For logs and the start-up line, e.g. "cpu" or "cuda:0 (NVIDIA H200)".
  virtual std::string device_name() const = 0;
  // The command-line flag that sizes this backend's KV cache, named in "too small" errors.
  virtual std::string kv_cache_flag() const = 0;
  // Partitions N of the page-id space (attention data parallel: one per rank): pages
  // [p * num_pages() / N, (p + 1) * num_pages() / N) live on rank p; the scheduler keeps each
  // sequence's pages in one partition. num_pages() % N == 0.
  virtual int num_kv_partitions() const { return 1; }
  // Attention data parallel: the bytes all ranks' MoE dispatch has sent between ranks since the
  // backend started (model::MoeDispatch; the payloads, summed over ranks). 0 elsewhere.
  virtual int64_t moe_dispatch_bytes() const { return 0; }

  // The host KV tier (`--kv-transfer-config` offloading, `--kv-offloading-size`): a second pool
  // of `num_slots` pages in host memory. Default: unsupported (the message names the backend).
  virtual Status enable_host_kv_tier(int64_t num_slots);
  // Runs one step's tier copies before its forward: every offload (device page -> host slot),
  // then every restore (host slot -> device page). Only after enable_host_kv_tier succeeded.
  virtual void copy_host_kv_pages(std::span<const HostPageCopy> offloads,
                                  std::span<const HostPageCopy> restores);
  // Speculative decoding: "" when forward() honours ForwardBatch::aux_layers (the target's aux
  // hidden states for an EAGLE-3 draft, make_draft()), else why not.
  virtual std::string speculative_refusal() const {
    return "speculative decoding is not implemented on the " + device_name() +
           " backend yet; serve --speculative-config on one GPU (--tensor-parallel-size 1) or "
           "on the CPU backend (--device cpu)";
  }
  // The EAGLE-3 draft `model` (its directory; or synthetic:mha / synthetic:gqa, benchmark drafts
  // of random weights, where the backend can make them) for this backend's target, with its own
  // KV cache of num_pages() pages over the same page ids. Default: the draft on the host CPU ops
  // (Eagle3Draft::load), sharing the target's host embedding and LM head `target_weights`.
  // Errors: Eagle3Draft::load's; a synthetic draft (host: refused naming --device cuda).
  virtual Result<std::unique_ptr<model::DraftProposer>> make_draft(
      const std::string& model, std::shared_ptr<const model::M3Weights> target_weights);
  // The KV pool's arrays (K, V, index-K, index-K scales of every layer, in that order), for a
  // transfer engine to read or write pages directly (P/D disaggregation). Empty: this backend
  // cannot share its pages that way (the caller refuses the feature by name).
  virtual std::vector<KvRegion> kv_regions() { return {}; }
  // Image input: whether forward() honours ForwardBatch::embed_rows and encode_images() runs the
  // model's vision tower; when false, image_refusal() says why (for the 400 the server sends).
  virtual bool supports_image_input() const { return false; }
  // Why a backend whose model has no tower loaded refuses images: none in the checkpoint, or
  // --language-model-only.
  static std::string missing_tower_refusal(const model::M3Config& cfg) {
    return cfg.vision.present
               ? "the vision tower is not loaded (the server runs with --language-model-only)"
               : "this model has no vision tower (config.json has no vision_config)";
  }
  virtual std::string image_refusal() const {
    return "image input is not implemented on the " + device_name() +
           " backend yet; serve on the CPU backend (--device cpu) for images";
  }
  // Embeddings [sum of tokens, hidden] of one request's images (model/vision_tower.h).
  virtual void encode_images(std::span<const model::VisionImage> images,
                             std::vector<float>* embeds) {
    M3_CHECK(false, "encode_images on a backend without image input");
  }

 private:
  // The default launch()/collect(): results of launched steps, oldest first, and the samples of
  // the last launched step.
  std::deque<ForwardResult> launched_;
  std::vector<int32_t> last_sampled_;
};

// The CPU backend: `model` and a zeroed KvCache of `num_pages` pages. Errors: num_pages < 1.
Result<std::unique_ptr<ForwardBackend>> make_cpu_backend(std::unique_ptr<M3Model> model,
                                                         int64_t num_pages);
// The same over a model the caller keeps alive (SequenceRunner over a test's or a shard's model):
// a KvCache of `num_pages` pages with the model's cache_kv_heads(). num_pages >= 1 and a model
// with weights are the caller's to ensure (checked).
std::unique_ptr<ForwardBackend> borrow_cpu_backend(const M3Model& model, int64_t num_pages);

// Tensor-parallel (optionally expert-parallel) CPU backend: `tensor_parallel_size` ranks as
// threads of this process over a CpuCommunicator, each with its shard of `model` (model/shard.h)
// and a KvCache of `num_pages` pages holding only its KV heads. With data_parallel_size D > 1
// (and tensor_parallel_size 1) the D ranks are attention data-parallel instead: each runs its own
// sequences with all heads (a full-head KvCache of num_pages pages per rank) and the routed
// experts are split over all D. forward() runs every rank on the same batch (rank 0 on the
// calling thread) and returns rank 0's logits, which equal every rank's. Logs the split and the
// per-rank KV memory at start. With dp_kv_partitions (data parallel only) the num_pages are split
// over the D ranks instead: rank r caches pages [r * P, (r + 1) * P), P = num_pages / D, and the
// backend reports D partitions (num_kv_partitions) so the scheduler keeps each sequence in one;
// drivers that hand out pages themselves (SequencePages) leave it off. Errors: num_pages < 1 (or
// fewer than D when partitioned), a config-only model, TP and DP both > 1, or a split that does
// not divide the model (the message names the flag).
Result<std::unique_ptr<ForwardBackend>> make_cpu_sharded_backend(
    std::unique_ptr<M3Model> model, int64_t num_pages, int tensor_parallel_size,
    bool expert_parallel, int data_parallel_size = 1, bool dp_kv_partitions = false,
    model::MoeDispatch moe_dispatch = model::MoeDispatch::kAuto);

struct MultiNodeSpec;  // runtime/multi_node.h

// Tensor parallel over several processes (runtime/multi_node.h, `nodes.nnodes` > 1): node 0's
// backend for the engine: this node's tensor_parallel_size / nnodes ranks as threads over
// TcpCommunicators, the others on the nodes that join at nodes.master_addr:master_port, all with
// `num_pages` pages. Blocks until every node has joined. Errors: make_cpu_sharded_backend's, a
// split that is not even over the nodes, --data-parallel-size > 1, the rendezvous' (naming the
// flags), a node whose model or flags differ.
Result<std::unique_ptr<ForwardBackend>> make_cpu_multi_node_backend(std::unique_ptr<M3Model> model,
                                                                    int64_t num_pages,
                                                                    int tensor_parallel_size,
                                                                    bool expert_parallel,
                                                                    const MultiNodeSpec& nodes);
// A node R > 0 (--headless): joins the group, builds its ranks with node 0's page count and runs
// the steps node 0 sends until it shuts down (ok) or the group breaks (the error says why).
Status run_cpu_headless_node(std::unique_ptr<M3Model> model, int tensor_parallel_size,
                             bool expert_parallel, const MultiNodeSpec& nodes);

}  // namespace m3::runtime
