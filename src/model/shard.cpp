#include "model/shard.h"

#include <cstring>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "model/tensor_table.h"

namespace m3::model {

namespace {

Error split_error(const std::string& what, int64_t size, int world, const std::string& fix) {
  return Error{ErrorCode::kInvalidArgument,
               "--tensor-parallel-size " + std::to_string(world) + " does not divide " + what +
                   " (" + std::to_string(size) + ")" + (fix.empty() ? "" : "; " + fix),
               "--tensor-parallel-size"};
}

std::string divisors_of(int64_t n) {
  std::string s;
  for (int64_t d = 1; d <= n && d <= 64; ++d)
    if (n % d == 0) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// Columns [c0, c0 + n) of `m`, copied into storage owned by `owner` (inner vectors never move
// their heap buffers when the outer vector grows, so the view stays valid).
MatRef copy_cols(const MatRef& m, int64_t c0, int64_t n, M3Weights& owner) {
  M3_CHECK(c0 >= 0 && c0 + n <= m.cols);
  if (c0 == 0 && n == m.cols) return m;  // whole (data parallel): the view itself
  MatRef r = m;
  r.cols = n;
  if (m.quantized()) {
    // A column range on block boundaries keeps the format: the codes' bytes and the blocks'
    // scales (per-channel scales whole). Anything else is dequantised exactly to f32.
    const int64_t blk = kernels::weight_quant_block(m.quant);
    const bool four = kernels::weight_quant_is_4bit(m.quant);
    const bool aligned = (blk == 0 || (c0 % blk == 0 && (n % blk == 0 || c0 + n == m.cols))) &&
                         (!four || (c0 % 2 == 0 && n % 2 == 0));
    if (aligned) {
      const int64_t rb = r.row_bytes(), b0 = four ? c0 / 2 : c0;
      auto& q = owner.owned_u8.emplace_back(static_cast<size_t>(m.rows * rb));
      const uint8_t* src = static_cast<const uint8_t*>(m.data);
      for (int64_t i = 0; i < m.rows; ++i)
        std::memcpy(q.data() + i * rb, src + i * m.row_bytes() + b0, static_cast<size_t>(rb));
      r.data = q.data();
      owner.bytes_owned += q.size();
      if (blk > 0) {
        const int64_t sb = r.scale_row_bytes(), s0 = c0 / blk;
        auto& sc = owner.owned_u8.emplace_back(static_cast<size_t>(m.rows * sb));
        const uint8_t* ssrc = static_cast<const uint8_t*>(m.scale);
        for (int64_t i = 0; i < m.rows; ++i)
          std::memcpy(sc.data() + i * sb, ssrc + i * m.scale_row_bytes() + s0,
                      static_cast<size_t>(sb));
        r.scale = sc.data();
        owner.bytes_owned += sc.size();
      }
      return r;
    }
    auto& buf = owner.owned_f32.emplace_back(static_cast<size_t>(m.rows * n));
    std::vector<float> row(static_cast<size_t>(m.cols));
    for (int64_t i = 0; i < m.rows; ++i) {
      kernels::cpu::dequantize_row(m, i, row.data());
      std::memcpy(buf.data() + i * n, row.data() + c0, n * sizeof(float));
    }
    r = MatRef{buf.data(), DType::kF32, m.rows, n};
    owner.bytes_owned += buf.size() * sizeof(float);
    return r;
  }
  if (m.dtype == DType::kF32) {
    auto& buf = owner.owned_f32.emplace_back(static_cast<size_t>(m.rows * n));
    const float* src = static_cast<const float*>(m.data);
    for (int64_t i = 0; i < m.rows; ++i)
      std::memcpy(buf.data() + i * n, src + i * m.cols + c0, n * sizeof(float));
    r.data = buf.data();
    owner.bytes_owned += buf.size() * sizeof(float);
  } else {
    M3_CHECK(m.dtype == DType::kBF16, "copy_cols: dtype %s", dtype_name(m.dtype));
    auto& buf = owner.owned_u16.emplace_back(static_cast<size_t>(m.rows * n));
    const uint16_t* src = static_cast<const uint16_t*>(m.data);
    for (int64_t i = 0; i < m.rows; ++i)
      std::memcpy(buf.data() + i * n, src + i * m.cols + c0, n * sizeof(uint16_t));
    r.data = buf.data();
    owner.bytes_owned += buf.size() * sizeof(uint16_t);
  }
  return r;
}

// KV-cache bytes per token (fp32, all layers) for `kv_heads` heads per layer.
int64_t kv_bytes_per_token(const M3Config& cfg, int64_t kv_heads) {
  return (cfg.num_hidden_layers * 2 * kv_heads * cfg.head_dim +
          cfg.num_sparse_layers() * cfg.index_head_dim) *
         static_cast<int64_t>(sizeof(float));
}

bool any_dense(const M3Config& cfg) {
  for (bool m : cfg.layer_is_moe)
    if (!m) return true;
  return false;
}
bool any_moe(const M3Config& cfg) {
  for (bool m : cfg.layer_is_moe)
    if (m) return true;
  return false;
}

// Attention data parallel: everything whole except the routed experts.
Result<ShardPlan> make_dp_plan(const M3Config& cfg, const ShardSpec& spec) {
  const int W = spec.world;
  ShardPlan p;
  p.rank = spec.rank;
  p.world = W;
  p.expert_parallel = spec.expert_parallel;
  p.data_parallel = true;
  p.dp_pages_per_rank = spec.dp_pages_per_rank;
  p.moe_all_to_all = spec.expert_parallel && spec.moe_dispatch != MoeDispatch::kAllGather;
  p.num_q_heads = cfg.num_attention_heads;
  p.gqa_group = cfg.num_attention_heads / cfg.num_key_value_heads;
  p.num_kv_heads = cfg.num_key_value_heads;
  p.dense_inter = cfg.dense_intermediate_size;
  p.shared_inter = cfg.shared_intermediate_size;
  p.vocab_chunk = p.vocab_count = cfg.vocab_size;
  if (spec.expert_parallel) {
    if (cfg.num_local_experts % W != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--data-parallel-size " + std::to_string(W) +
                            " does not divide the routed experts (" +
                            std::to_string(cfg.num_local_experts) +
                            "); expert parallelism gives each rank whole experts",
                        "--data-parallel-size");
    }
    p.num_experts = cfg.num_local_experts / W;
    p.expert_begin = spec.rank * p.num_experts;
    p.expert_inter = cfg.intermediate_size;
  } else {
    if (cfg.intermediate_size % W != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--data-parallel-size " + std::to_string(W) +
                            " does not divide the routed experts' intermediate size (" +
                            std::to_string(cfg.intermediate_size) +
                            "); try --enable-expert-parallel",
                        "--data-parallel-size");
    }
    p.num_experts = cfg.num_local_experts;
    p.expert_inter = cfg.intermediate_size / W;
    p.expert_inter_begin = spec.rank * p.expert_inter;
  }
  return p;
}

}  // namespace

Result<MoeDispatch> parse_moe_dispatch(const std::string& s) {
  if (s == "auto") return MoeDispatch::kAuto;
  if (s == "all-gather") return MoeDispatch::kAllGather;
  if (s == "all-to-all") return MoeDispatch::kAllToAll;
  return make_error(ErrorCode::kInvalidArgument,
                    "--moe-dispatch '" + s + "' is unknown; use auto, all-gather or all-to-all",
                    "--moe-dispatch");
}

const char* moe_dispatch_name(MoeDispatch d) {
  switch (d) {
    case MoeDispatch::kAuto:
      return "auto";
    case MoeDispatch::kAllGather:
      return "all-gather";
    case MoeDispatch::kAllToAll:
      return "all-to-all";
  }
  return "?";
}

int64_t ShardPlan::kv_head_begin_of(int r) const {
  if (!kv_replicated) return static_cast<int64_t>(r) * num_kv_heads;
  // num_q_heads per rank divides the GQA group: rank r's heads all use KV head q0 / group.
  return static_cast<int64_t>(r) * num_q_heads / gqa_group;
}

Result<ShardPlan> make_shard_plan(const M3Config& cfg, const ShardSpec& spec) {
  const int W = spec.world;
  if (W < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--tensor-parallel-size must be >= 1, got " + std::to_string(W),
                      "--tensor-parallel-size");
  }
  M3_CHECK(spec.rank >= 0 && spec.rank < W, "shard rank %d outside [0, %d)", spec.rank, W);
  if (spec.comm != nullptr) {
    M3_CHECK(spec.comm->world_size() == W && spec.comm->rank() == spec.rank,
             "communicator rank %d/%d does not match the shard %d/%d", spec.comm->rank(),
             spec.comm->world_size(), spec.rank, W);
  }
  const int64_t nq = cfg.num_attention_heads, nkv = cfg.num_key_value_heads;
  if (spec.moe_dispatch == MoeDispatch::kAllToAll &&
      !(spec.data_parallel && spec.expert_parallel) && W > 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--moe-dispatch all-to-all needs --data-parallel-size > 1 with "
                      "--enable-expert-parallel (tensor parallel ranks all see every token, and "
                      "sliced experts need every row on every rank); drop --moe-dispatch or add "
                      "--enable-expert-parallel",
                      "--moe-dispatch");
  }
  if (spec.data_parallel) return make_dp_plan(cfg, spec);
  if (nq % W != 0) {
    return tl::unexpected(split_error("the query heads", nq, W, "use one of " + divisors_of(nq)));
  }
  ShardPlan p;
  p.rank = spec.rank;
  p.world = W;
  p.expert_parallel = spec.expert_parallel;
  p.num_q_heads = nq / W;
  p.gqa_group = nq / nkv;
  p.q_head_begin = spec.rank * p.num_q_heads;
  if (W <= nkv) {
    if (nkv % W != 0) {
      return tl::unexpected(
          split_error("the KV heads", nkv, W,
                      "use a size that divides " + std::to_string(nkv) + " or a multiple of it"));
    }
    p.num_kv_heads = nkv / W;
    p.kv_head_begin = spec.rank * p.num_kv_heads;
  } else {
    // More ranks than KV heads: each KV head is replicated on W / nkv ranks, which requires the
    // query heads of one rank to fall into a single GQA group.
    if (W % nkv != 0) {
      return tl::unexpected(Error{ErrorCode::kInvalidArgument,
                                  "--tensor-parallel-size " + std::to_string(W) +
                                      " is above the model's " + std::to_string(nkv) +
                                      " KV heads but not a multiple of them, so a rank's query "
                                      "heads would need two KV heads; use a multiple of " +
                                      std::to_string(nkv),
                                  "--tensor-parallel-size"});
    }
    p.kv_replicated = true;
    p.num_kv_heads = 1;
    p.kv_head_begin = p.q_head_begin / p.gqa_group;
  }
  if (any_dense(cfg)) {
    if (cfg.dense_intermediate_size % W != 0)
      return tl::unexpected(
          split_error("the dense MLP intermediate size", cfg.dense_intermediate_size, W, ""));
    p.dense_inter = cfg.dense_intermediate_size / W;
    p.dense_inter_begin = spec.rank * p.dense_inter;
  }
  if (any_moe(cfg)) {
    if (cfg.shared_intermediate_size > 0) {
      if (cfg.shared_intermediate_size % W != 0)
        return tl::unexpected(split_error("the shared-expert intermediate size",
                                          cfg.shared_intermediate_size, W, ""));
      p.shared_inter = cfg.shared_intermediate_size / W;
      p.shared_inter_begin = spec.rank * p.shared_inter;
    }
    if (spec.expert_parallel) {
      if (cfg.num_local_experts % W != 0)
        return tl::unexpected(split_error("the routed experts", cfg.num_local_experts, W,
                                          "expert parallelism gives each rank whole experts"));
      p.num_experts = cfg.num_local_experts / W;
      p.expert_begin = spec.rank * p.num_experts;
      p.expert_inter = cfg.intermediate_size;
    } else {
      if (cfg.intermediate_size % W != 0)
        return tl::unexpected(split_error("the routed experts' intermediate size",
                                          cfg.intermediate_size, W,
                                          "try --enable-expert-parallel"));
      p.num_experts = cfg.num_local_experts;
      p.expert_inter = cfg.intermediate_size / W;
      p.expert_inter_begin = spec.rank * p.expert_inter;
    }
  }
  // Vocabulary: M3 pads its embedding rows, but any V works: chunks of ceil(V / W), the last
  // shorter (possibly empty for tiny vocabularies).
  const int64_t V = cfg.vocab_size;
  p.vocab_chunk = (V + W - 1) / W;
  p.vocab_begin = std::min<int64_t>(V, spec.rank * p.vocab_chunk);
  p.vocab_count = std::min<int64_t>(V, p.vocab_begin + p.vocab_chunk) - p.vocab_begin;
  return p;
}

std::string ShardPlan::describe(const M3Config& cfg) const {
  std::ostringstream os;
  if (data_parallel) {
    os << "attention data parallel " << world << (expert_parallel ? " + expert parallel" : "")
       << ": rank " << rank << " runs its own sequences with all " << num_q_heads
       << " query heads and the whole dense MLP, shared expert and vocabulary; routed experts ";
    if (expert_parallel) {
      os << "[" << expert_begin << ", " << expert_begin + num_experts << ")";
    } else {
      os << "1/" << world << " of each";
    }
    os << "; MoE dispatch " << (moe_all_to_all ? "all-to-all" : "all-gather");
    os << "; KV cache " << kv_bytes_per_token(cfg, num_kv_heads)
       << " B/token on this rank (all heads, this rank's sequences only)";
    return os.str();
  }
  os << "tensor parallel " << world << (expert_parallel ? " + expert parallel" : "") << ": rank "
     << rank << " has query heads [" << q_head_begin << ", " << q_head_begin + num_q_heads
     << "), KV heads [" << kv_head_begin << ", " << kv_head_begin + num_kv_heads << ")";
  if (expert_parallel) {
    os << ", experts [" << expert_begin << ", " << expert_begin + num_experts << ")";
  } else if (num_experts > 0) {
    os << ", 1/" << world << " of every expert";
  }
  os << ", vocab rows [" << vocab_begin << ", " << vocab_begin + vocab_count << ")";
  const int64_t full = kv_bytes_per_token(cfg, cfg.num_key_value_heads);
  const int64_t mine = kv_bytes_per_token(cfg, num_kv_heads);
  os << "; KV cache " << mine << " B/token on this rank, " << mine * world
     << " B/token over all ranks vs " << full << " unsharded";
  if (kv_replicated) {
    os << " (the model has " << cfg.num_key_value_heads << " KV heads: each is replicated on "
       << world / cfg.num_key_value_heads << " ranks, and index-K on all " << world << ")";
  } else if (cfg.any_sparse() && world > 1) {
    os << " (index-K, one head, is replicated on all " << world << " ranks)";
  }
  return os.str();
}

std::unique_ptr<M3Weights> shard_weights(const M3Weights& full, const M3Config& cfg,
                                         const ShardPlan& p) {
  auto w = std::make_unique<M3Weights>();
  w->checkpoint = full.checkpoint;
  if (!p.sharded()) {
    // The unsharded views, unchanged (the owned storage stays with `full`).
    w->embed_tokens = full.embed_tokens;
    w->final_norm = full.final_norm;
    w->lm_head = full.lm_head;
    w->layers = full.layers;
    return w;
  }
  // Each tensor's block of this rank (tensor_table.h): row ranges are views into `full`,
  // column ranges copies, routed experts the plan's experts.
  const std::vector<TensorSpec> table = m3_tensors(cfg);
  size_views(*w, cfg, table, p.num_experts);
  for (const TensorSpec& t : table) {
    if (t.vector) {
      M3_CHECK(t.split == SplitDim::kReplicated, "%s: vectors are replicated", t.names[0].c_str());
      t.vec(*w) = t.vec(full);  // norms and the router bias
      continue;
    }
    const TensorBlock b = shard_block(t, cfg, p);
    for (int64_t e = 0; e < t.count_in(*w); ++e) {
      const MatRef& src = t.mat(full, b.expert_begin + e);
      MatRef& dst = t.mat(*w, e);
      switch (t.split) {
        case SplitDim::kReplicated:
          dst = src;
          break;
        case SplitDim::kRows:
          dst = src.slice_rows(b.row_begin, b.row_count);
          break;
        case SplitDim::kCols:
          dst = copy_cols(src, b.col_begin, b.col_count, *w);
          break;
      }
    }
  }
  return w;
}

}  // namespace m3::model
