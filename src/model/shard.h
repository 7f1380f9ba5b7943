// ShardSpec / ShardPlan: how one rank of a tensor-parallel (optionally expert-parallel) or
// attention data-parallel group splits the M3 text model, and the per-rank weight views. Called by
// M3Model::make_shard (model/m3_model.h), which runs the same forward on these views plus
// collectives, and by the sharded CPU backend (runtime/forward_backend.h).
// Invariant: make_shard_plan accepts a spec only if every split is exact (heads, KV groups,
// intermediates, experts); the vocabulary may split unevenly (chunks of ceil(V / N) rows, the
// last rank shorter). world == 1 gives a plan whose views are the unsharded model's, unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/error.h"
#include "dist/communicator.h"
#include "model/config.h"
#include "model/weights.h"

namespace m3::model {

// How a data-parallel + expert-parallel MoE layer meets the experts of the other ranks.
// kAllGather: every rank's rows (padded to the step's largest count) go to every rank, each rank
// runs its experts over all of them and a reduce-scatter returns the partial sums (no count
// exchange, no host sync: a CUDA graph can capture it). kAllToAll: each row goes only to the ranks
// that own one of its top-k experts (counts exchanged first, then variable all-to-alls of rows and
// their picks), and the results come back the same way, combined at the source in rank order:
// the same numbers as kAllGather (bitwise on the CPU), less traffic, but the host reads the
// routing every MoE layer (never inside a CUDA graph). kAuto: kAllToAll for data parallel with
// expert parallel, else kAllGather; the GPU data-parallel backend resolves kAuto to kAllGather
// (its decode steps replay CUDA graphs).
enum class MoeDispatch { kAuto, kAllGather, kAllToAll };
// "auto", "all-gather" or "all-to-all" (the --moe-dispatch values); error naming the flag else.
Result<MoeDispatch> parse_moe_dispatch(const std::string& s);
const char* moe_dispatch_name(MoeDispatch d);

struct ShardSpec {
  int rank = 0;
  int world = 1;                       // tensor-parallel size (ranks of the group)
  bool expert_parallel = false;        // MoE: own E/N whole experts instead of slicing each
  dist::Communicator* comm = nullptr;  // required when world > 1; not owned
  // Attention data parallel: the world ranks are DP ranks, each running embedding, attention,
  // dense MLP, shared expert and lm_head in full for its own sequences; only the routed experts
  // are split over the world (EP, or sliced experts without it).
  bool data_parallel = false;
  // Attention data parallel with partitioned page ids: rank r's KV cache holds pages
  // [r * P, (r + 1) * P) as its [0, P), and a sequence's pages all lie in one partition (the
  // scheduler keeps them so, ForwardBackend::num_kv_partitions). 0: one page-id space that every
  // rank caches whole.
  int64_t dp_pages_per_rank = 0;
  // Data parallel + expert parallel only (MoeDispatch); kAllToAll elsewhere is refused.
  MoeDispatch moe_dispatch = MoeDispatch::kAuto;
};

// What this rank holds. Ranges are [begin, begin + count) in the unsharded model's numbering.
struct ShardPlan {
  int rank = 0;
  int world = 1;
  bool expert_parallel = false;
  bool data_parallel = false;     // see ShardSpec; the ranges below are then whole except experts
  int64_t dp_pages_per_rank = 0;  // see ShardSpec
  // The MoE layers dispatch rows by all-to-all (MoeDispatch::kAllToAll; data + expert parallel).
  bool moe_all_to_all = false;
  // Attention: query heads split evenly. KV heads split when world <= num_kv_heads; else each
  // rank keeps the one KV head its query heads use (replicated across world / num_kv_heads ranks).
  // MSA index-q heads follow the KV heads; index-K (one head) is computed on every rank.
  int64_t q_head_begin = 0, num_q_heads = 0;
  int64_t kv_head_begin = 0, num_kv_heads = 0;
  bool kv_replicated = false;
  int64_t gqa_group = 1;  // query heads per KV head (unsharded)
  // MLP intermediates (SwiGLU is elementwise over them: split gate/up rows, down columns).
  int64_t dense_inter_begin = 0, dense_inter = 0;
  int64_t shared_inter_begin = 0, shared_inter = 0;
  int64_t expert_inter_begin = 0, expert_inter = 0;  // whole intermediate under EP
  int64_t expert_begin = 0, num_experts = 0;         // every expert without EP
  // Vocabulary rows of embed_tokens and lm_head: chunks of vocab_chunk rows.
  int64_t vocab_chunk = 0, vocab_begin = 0, vocab_count = 0;

  bool sharded() const { return world > 1; }
  // Tensor parallel: layers split, every rank sees every token.
  bool tensor_sharded() const { return world > 1 && !data_parallel; }
  // Data parallel: each rank runs its own sequences; experts split.
  bool data_sharded() const { return world > 1 && data_parallel; }
  // The DP rank that runs the sequence whose first KV page is `first_page`. Partitioned pages:
  // the partition's rank. Else a function of the first page only, so sequences sharing cached
  // prefix pages always run on the same rank; a mixing hash of it, so owners spread evenly
  // whatever pattern the page allocator follows (the page id modulo the world put every sequence
  // on rank 0 when all prompts filled an even number of pages: bench_tp's first DP2 run).
  int dp_owner(int32_t first_page) const {
    if (dp_pages_per_rank > 0) return static_cast<int>(first_page / dp_pages_per_rank);
    uint32_t x = static_cast<uint32_t>(first_page);
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return static_cast<int>(x % static_cast<uint32_t>(world));
  }
  // Where this rank caches global page `page` of a sequence it owns.
  int32_t dp_local_page(int32_t page) const {
    return dp_pages_per_rank > 0 ? static_cast<int32_t>(page - rank * dp_pages_per_rank) : page;
  }
  // First KV head of rank r (for reassembling per-head outputs such as MSA selections).
  int64_t kv_head_begin_of(int r) const;
  // One start-up line: what is split, what is replicated and its memory cost.
  std::string describe(const M3Config& cfg) const;
};

// Checks the spec against the config (the communicator may be null here: validation only).
// Errors name the dimension that does not divide and the sizes that would.
Result<ShardPlan> make_shard_plan(const M3Config& cfg, const ShardSpec& spec);

// The rank's weight views over `full`: row slices point into `full` (which must outlive the
// result); column slices (o_proj, down projections) are copied into storage the result owns.
std::unique_ptr<M3Weights> shard_weights(const M3Weights& full, const M3Config& cfg,
                                         const ShardPlan& plan);

}  // namespace m3::model
