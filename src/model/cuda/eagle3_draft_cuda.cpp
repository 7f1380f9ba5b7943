#include "model/cuda/eagle3_draft_cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/env.h"
#include "core/log.h"
#include "gpu/cuda_check.h"
#include "kernels/cuda/sample.h"
#include "model/cuda/cuda_ops.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/cuda/synthetic_weights.h"
#include "model/eagle3_forward.h"

namespace m3::model {

namespace ops = kernels::cuda;
using kernels::MatRef;
using kernels::VecRef;

Eagle3DraftCuda::Eagle3DraftCuda(Eagle3Config cfg, M3ModelCuda& target, int device)
    : cfg_(std::move(cfg)), target_(target), device_(device) {
  cache_cfg_.num_hidden_layers = 1;
  cache_cfg_.num_attention_heads = cfg_.num_attention_heads;
  cache_cfg_.num_key_value_heads = cfg_.num_key_value_heads;
  cache_cfg_.head_dim = cfg_.head_dim;
  cache_cfg_.hidden_size = cfg_.hidden_size;
  cache_cfg_.sparse_block_size = target.config().sparse_block_size;
  cache_cfg_.layer_is_sparse = {false};
  cache_cfg_.layer_is_moe = {false};
  // bf16 K/V: the serving default's KV format (the CPU draft keeps f32).
  cache_cfg_.kv_cache_dtype = kernels::KvDtype::kBf16;
}

Eagle3DraftCuda::Eagle3DraftCuda(Eagle3Config cfg, const Eagle3Weights& host, M3ModelCuda& target,
                                 int device)
    : Eagle3DraftCuda(std::move(cfg), target, device) {
  M3_CUDA_CHECK(cudaSetDevice(device_));
  dev_.fc = upload(host.fc);
  dev_.q_proj = upload(host.q_proj);
  dev_.k_proj = upload(host.k_proj);
  dev_.v_proj = upload(host.v_proj);
  dev_.o_proj = upload(host.o_proj);
  dev_.gate_proj = upload(host.gate_proj);
  dev_.up_proj = upload(host.up_proj);
  dev_.down_proj = upload(host.down_proj);
  dev_.input_norm = upload(host.input_norm);
  dev_.hidden_norm = upload(host.hidden_norm);
  dev_.post_attention_norm = upload(host.post_attention_norm);
  dev_.final_norm = upload(host.final_norm);
  dev_.own_embed = host.own_embed;
  dev_.own_lm_head = host.own_lm_head;
  if (host.own_embed) dev_.embed_tokens = upload(host.embed_tokens);
  if (host.own_lm_head) dev_.lm_head = upload(host.lm_head);
  share_target();
  if (!host.draft_to_target.empty()) d2t_ = gpu::DeviceBuffer<int32_t>(host.draft_to_target);
  init_forward();
}

Eagle3DraftCuda::~Eagle3DraftCuda() {
  cudaStreamSynchronize(target_.stream());  // nothing launched may still read what is freed
  clear_graphs();
  for (cudaEvent_t e : ev_)
    if (e != nullptr) cudaEventDestroy(e);
  if (stage_ != nullptr) cudaFreeHost(stage_);
  if (out_host_ != nullptr) cudaFreeHost(out_host_);
}

void Eagle3DraftCuda::clear_graphs() {
  for (auto& [key, e] : graphs_)
    if (e.exec) cudaGraphExecDestroy(e.exec);
  graphs_.clear();
}

void Eagle3DraftCuda::set_use_graphs(bool on) {
  use_graphs_ = on;
  if (!on) clear_graphs();
}

bool Eagle3DraftCuda::use_graphs() const {
  return use_graphs_ && target_.use_graphs();
}

Result<std::unique_ptr<Eagle3DraftCuda>> Eagle3DraftCuda::load(const std::string& model,
                                                               M3ModelCuda& target, int device,
                                                               uint64_t seed) {
  const M3Config& tc = target.config();
  size_t free_b = 0, total_b = 0;
  M3_CUDA_CHECK(cudaSetDevice(device));
  M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  auto fits = [&](const Eagle3Config& c, bool own_embed, bool own_head) -> Status {
    const int64_t H = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                  kv = c.num_key_value_heads * c.head_dim;
    int64_t n = H * static_cast<int64_t>(c.aux_layer_ids.size()) * c.target_hidden_size +
                (q + 2 * kv) * 2 * H + H * q + 3 * H * c.intermediate_size;
    if (own_embed) n += c.vocab_size * H;
    if (own_head) n += c.draft_vocab_size * H;
    const double need = static_cast<double>(n) * 2.0;  // bf16
    if (need > static_cast<double>(free_b)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "the EAGLE-3 draft's weights (" + std::to_string(need / (1 << 20)) +
                            " MiB in bf16) do not fit in the " +
                            std::to_string(static_cast<double>(free_b) / (1 << 20)) +
                            " MiB free on cuda:" + std::to_string(device) +
                            " after the target's weights",
                        "--speculative-config");
    }
    return {};
  };
  if (is_synthetic_draft(model)) {
    M3_TRY(Eagle3Config c, synthetic_eagle3_config(model, tc));
    M3_TRY_STATUS(fits(c, false, false));
    std::unique_ptr<Eagle3DraftCuda> d(new Eagle3DraftCuda(std::move(c), target, device));
    d->name_ = model;
    d->generate(seed);
    d->share_target();
    d->init_forward();
    return d;
  }
  // A host target keeps its embedding for the checks (and a host draft); the GPU draft reads
  // the device copies either way.
  std::shared_ptr<const M3Weights> host_w =
      target.host() != nullptr ? target.host()->base_weights() : nullptr;
  M3_TRY(Eagle3Checkpoint ck, load_eagle3_checkpoint(model, tc, host_w));
  M3_TRY_STATUS(fits(ck.config, ck.weights->own_embed, ck.weights->own_lm_head));
  auto d = std::make_unique<Eagle3DraftCuda>(std::move(ck.config), *ck.weights, target, device);
  d->name_ = model;
  return d;
}

void* Eagle3DraftCuda::alloc(size_t bytes) {
  return device_alloc(storage_, &weight_bytes_, bytes);
}

MatRef Eagle3DraftCuda::upload(const MatRef& m) {
  return device_copy(storage_, &weight_bytes_, m, "EAGLE-3 draft");
}

VecRef Eagle3DraftCuda::upload(const VecRef& v) {
  return device_copy(storage_, &weight_bytes_, v);
}

void Eagle3DraftCuda::generate(uint64_t seed) {
  const int64_t H = cfg_.hidden_size, q = cfg_.num_attention_heads * cfg_.head_dim,
                kv = cfg_.num_key_value_heads * cfg_.head_dim, I = cfg_.intermediate_size;
  const int64_t in_fc = static_cast<int64_t>(cfg_.aux_layer_ids.size()) * cfg_.target_hidden_size;
  cudaStream_t s = target_.stream();
  uint64_t id = 0x5eed'0000;  // tensor ids apart from the target's (its table indices)
  // As M3ModelCuda::synthetic: uniform with std 1/sqrt(fan_in), so activations stay O(1).
  auto mat = [&](int64_t rows, int64_t cols) {
    auto* p = static_cast<uint16_t*>(alloc(static_cast<size_t>(rows * cols) * 2));
    fill_uniform_bf16(p, static_cast<size_t>(rows * cols),
                      std::sqrt(3.0f) / std::sqrt(static_cast<float>(cols)), seed, ++id, s);
    return MatRef{p, DType::kBF16, rows, cols};
  };
  // Norm weights w - 1 near 0 (the scale near 1, still exercised).
  auto norm = [&](int64_t n) {
    auto* p = static_cast<float*>(alloc(static_cast<size_t>(n) * sizeof(float)));
    fill_uniform_f32(p, static_cast<size_t>(n), 0.1f, seed, ++id, s);
    return VecRef{p, DType::kF32, n};
  };
  dev_.fc = mat(H, in_fc);
  dev_.q_proj = mat(q, 2 * H);
  dev_.k_proj = mat(kv, 2 * H);
  dev_.v_proj = mat(kv, 2 * H);
  dev_.o_proj = mat(H, q);
  dev_.gate_proj = mat(I, H);
  dev_.up_proj = mat(I, H);
  dev_.down_proj = mat(H, I);
  dev_.input_norm = norm(H);
  dev_.hidden_norm = norm(H);
  dev_.post_attention_norm = norm(H);
  dev_.final_norm = norm(H);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
}

void Eagle3DraftCuda::share_target() {
  const M3Weights& t = target_.device_weights();
  if (!dev_.own_embed) dev_.embed_tokens = t.embed_tokens;
  if (!dev_.own_lm_head) dev_.lm_head = t.lm_head;
  M3_CHECK(dev_.embed_tokens.data != nullptr && dev_.lm_head.data != nullptr,
           "EAGLE-3 draft: the target's device embedding or LM head is missing");
  M3_CHECK(!dev_.lm_head.quantized() && !dev_.embed_tokens.quantized(),
           "EAGLE-3 draft: a quantized embedding or LM head");
}

void Eagle3DraftCuda::init_forward() {
  ops_ = std::make_unique<CudaOps>(target_.stream());
  fw_ = std::make_unique<Eagle3Forward<CudaOps>>(cfg_, dev_);
  use_graphs_ = !env_switch("M3_DRAFT_EAGER", false);
}

int64_t Eagle3DraftCuda::kv_page_bytes() const {
  return KvCache::page_bytes(cache_cfg_);
}

int64_t Eagle3DraftCuda::kv_bytes_per_token() const {
  return kv_page_bytes() / cache_cfg_.sparse_block_size;
}

void Eagle3DraftCuda::allocate_kv(int64_t num_pages) {
  M3_CHECK(cache_ == nullptr, "EAGLE-3 draft: allocate_kv twice");
  M3_CUDA_CHECK(cudaSetDevice(device_));
  cache_ = std::make_unique<KvCacheCuda>(cache_cfg_, num_pages);
}

namespace {

// Where each array of one draft step sits in the staged words.
struct StepPlan {
  int64_t T = 0, S = 0, R = 0;
  int64_t tok_at = -1;  // context pass only: its input ids
  int64_t pos_at = 0, seq_at = 0, bto_at = 0, bt_at = 0, rows_at = 0;
  int64_t src_at = 0;     // hidden source rows: aux rows (context), prev step's rows (drafts)
  int64_t srcid_at = -1;  // drafts: each token's row among the previous step's ids
  int64_t out_at = 0;     // its ids' offset in the mapped ids of all steps
  int64_t max_kv_len = 0;
  int64_t words = 0;  // drafts: the step's arrays are one block of `words` from pos_at
};

// A draft step's arrays in its block (what its graph reads at fixed offsets for R rows):
// positions, seq ids, logits rows, hidden source rows, previous-id rows [R] each, then the block
// table offsets [R + 1] and the block table.
struct StepBlock {
  int64_t pos = 0, seq, rows, src, srcid, bto, bt;
  explicit StepBlock(int64_t R)
      : seq(R), rows(2 * R), src(3 * R), srcid(4 * R), bto(5 * R), bt(6 * R + 1) {}
};

// The draft steps' bound of the key count, rounded up as the target's decode steps round theirs
// (M3ModelCuda, kKvLenBucket): it sizes the attention's KV splits, so one captured graph serves
// every step of its bucket, and eager steps use the same bound (the same numbers either way).
constexpr int64_t kDraftKvLenBucket = 1024;
constexpr size_t kMaxDraftGraphs = 256;

}  // namespace

void Eagle3DraftCuda::draft_step(int64_t R, int64_t max_kv_len, bool first) {
  cudaStream_t st = target_.stream();
  const int64_t H = cfg_.hidden_size, Vd = cfg_.draft_vocab_size;
  const kernels::KvPages pages = cache_->layer(0);
  const int32_t* map = d2t_.size() > 0 ? d2t_.data() : nullptr;
  auto body = [&] {
    const StepBlock at(R);
    const int32_t* in = step_in_.data();
    kernels::TokenLayout layout;
    layout.num_tokens = R;
    layout.positions = in + at.pos;
    layout.seq_ids = in + at.seq;
    layout.block_table_offsets = in + at.bto;
    layout.block_table = in + at.bt;
    layout.multi_token_seqs = false;
    // hidden: the step before's pre-norm rows; tokens: its greedy ids (target ids)
    float* hid = hidden_.data();
    ops_->gather_rows(ops_->f32(Buf::kX, 0), in + at.src, R, H, hid);
    const int32_t* prev = first ? mapped_.data() : step_ids_.data();
    ops::gather_mapped_ids(prev, in + at.srcid, R, nullptr, tokens_.data(), st);
    float* logits = ops_->f32(Buf::kLogits, R * Vd);
    fw_->run(*ops_, tokens_.data(), layout, pages, hid, false, max_kv_len, in + at.rows, R, logits);
    ops::sample_rows(logits, Vd, Vd, greedy_.data(), R, ids_.data(), st);
    ops::gather_mapped_ids(ids_.data(), nullptr, R, map, step_ids_.data(), st);
  };
  if (!use_graphs()) {
    body();
    return;
  }
  if (graphs_.size() > kMaxDraftGraphs) clear_graphs();
  GraphEntry& e = graphs_[{R, max_kv_len, first}];
  if (e.exec && e.generation == ops_->generation()) {
    M3_CUDA_CHECK(cudaGraphLaunch(e.exec, st));
    ++graph_replays_;
    return;
  }
  if (!e.seen || e.seen_generation != ops_->generation()) {
    // First step of this shape (or buffers moved since): eager, which also sizes every buffer
    // the capture will use, so nothing allocates or synchronises inside the capture.
    body();
    e.seen = true;
    e.seen_generation = ops_->generation();
    return;
  }
  if (e.exec) {
    M3_CUDA_CHECK(cudaGraphExecDestroy(e.exec));
    e.exec = nullptr;
  }
  const uint64_t gen = ops_->generation();
  M3_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  body();
  cudaGraph_t g = nullptr;
  M3_CUDA_CHECK(cudaStreamEndCapture(st, &g));
  M3_CHECK(gen == ops_->generation(), "EAGLE-3 draft: a buffer grew while capturing a CUDA graph");
  M3_CUDA_CHECK(cudaGraphInstantiate(&e.exec, g, 0));
  M3_CUDA_CHECK(cudaGraphDestroy(g));
  e.generation = gen;
  ++graph_captures_;
  M3_CUDA_CHECK(cudaGraphLaunch(e.exec, st));
  ++graph_replays_;
}

std::vector<std::vector<int32_t>> Eagle3DraftCuda::propose(const std::vector<DraftSeq>& seqs,
                                                           std::span<const float> /*aux_hidden*/,
                                                           int k) {
  M3_CHECK(cache_ != nullptr, "EAGLE-3 draft: propose() before allocate_kv()");
  const auto t_call = std::chrono::steady_clock::now();
  M3_CUDA_CHECK(cudaSetDevice(device_));
  const int64_t H = cfg_.hidden_size, Vd = cfg_.draft_vocab_size;
  const int64_t aux_w = static_cast<int64_t>(cfg_.aux_layer_ids.size()) * cfg_.target_hidden_size;
  const int64_t aux_rows = target_.aux_state_rows();
  std::vector<std::vector<int32_t>> out(seqs.size());
  std::vector<int32_t> w;  // the staged words
  std::vector<StepPlan> plans;
  // Per seq: its logits row and token row in the step just planned (-1: not in it).
  std::vector<int64_t> row_of(seqs.size(), -1), tok_of(seqs.size(), -1), pos(seqs.size(), 0);
  // Per step and seq: the row of its id in that step (the proposals, read back at the end).
  std::vector<std::vector<int64_t>> got;
  int64_t total_r = 0;
  auto push = [&](const std::vector<int32_t>& v) {
    const int64_t at = static_cast<int64_t>(w.size());
    w.insert(w.end(), v.begin(), v.end());
    return at;
  };
  {  // The context pass: every verified position, with the target's aux states there.
    std::vector<int32_t> tok, p, sq, bto{0}, bt, rows, src;
    int32_t s_idx = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const DraftSeq& s = seqs[i];
      if (s.num_valid <= 0) continue;
      M3_CHECK(static_cast<int>(s.next_tokens.size()) == s.num_valid);
      bt.insert(bt.end(), s.block_table.begin(), s.block_table.end());
      bto.push_back(static_cast<int32_t>(bt.size()));
      for (int j = 0; j < s.num_valid; ++j) {
        M3_CHECK(s.first_row + j < aux_rows, "draft: aux row %d of a %lld-token target step",
                 s.first_row + j, static_cast<long long>(aux_rows));
        tok.push_back(s.next_tokens[j]);
        p.push_back(s.start_pos + j);
        sq.push_back(s_idx);
        src.push_back(s.first_row + j);
      }
      tok_of[i] = static_cast<int64_t>(tok.size()) - 1;
      if (s.num_propose > 0) {
        row_of[i] = static_cast<int64_t>(rows.size());
        rows.push_back(static_cast<int32_t>(tok_of[i]));
        pos[i] = s.start_pos + s.num_valid;  // where the first proposal's KV goes
      }
      ++s_idx;
    }
    if (tok.empty()) return out;
    StepPlan pl;
    pl.T = static_cast<int64_t>(tok.size());
    pl.S = s_idx;
    pl.R = static_cast<int64_t>(rows.size());
    pl.max_kv_len = *std::max_element(p.begin(), p.end()) + 1;
    pl.tok_at = push(tok);
    pl.pos_at = push(p);
    pl.seq_at = push(sq);
    pl.bto_at = push(bto);
    pl.bt_at = push(bt);
    pl.rows_at = push(rows);
    pl.src_at = push(src);
    pl.out_at = total_r;
    total_r += pl.R;
    plans.push_back(pl);
    got.push_back(row_of);
  }
  // The draft steps: each proposing seq's last id and the draft's own pre-norm row, one
  // position further (who takes part is known on the host: pages, num_propose).
  for (int step = 1; step < k && plans.back().R > 0; ++step) {
    std::vector<int32_t> p, sq, bto{0}, bt, rows, src, srcid;
    std::vector<int64_t> nrow(seqs.size(), -1);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const DraftSeq& s = seqs[i];
      if (row_of[i] < 0 || step >= s.num_propose || pos[i] >= s.capacity) continue;
      bt.insert(bt.end(), s.block_table.begin(), s.block_table.end());
      bto.push_back(static_cast<int32_t>(bt.size()));
      const int32_t t = static_cast<int32_t>(p.size());
      p.push_back(static_cast<int32_t>(pos[i]));
      sq.push_back(t);
      rows.push_back(t);
      src.push_back(static_cast<int32_t>(tok_of[i]));
      srcid.push_back(static_cast<int32_t>(row_of[i]));
      nrow[i] = t;
    }
    if (p.empty()) break;
    StepPlan pl;
    pl.T = pl.S = pl.R = static_cast<int64_t>(p.size());
    const int64_t max_pos = *std::max_element(p.begin(), p.end());
    pl.max_kv_len = (max_pos / kDraftKvLenBucket + 1) * kDraftKvLenBucket;
    // One block in StepBlock's order (copied whole to the graphs' fixed inputs).
    pl.pos_at = push(p);
    pl.seq_at = push(sq);
    pl.rows_at = push(rows);
    pl.src_at = push(src);
    pl.srcid_at = push(srcid);
    pl.bto_at = push(bto);
    pl.bt_at = push(bt);
    pl.words = static_cast<int64_t>(w.size()) - pl.pos_at;
    pl.out_at = total_r;
    total_r += pl.R;
    plans.push_back(pl);
    for (size_t i = 0; i < seqs.size(); ++i) {
      row_of[i] = tok_of[i] = nrow[i];
      if (nrow[i] >= 0) ++pos[i];
    }
    got.push_back(nrow);
  }
  if (total_r == 0) {
    // Nothing to propose: the context pass still writes the verified positions' KV.
    plans.resize(1);
  }

  cudaStream_t st = target_.stream();
  if (profile_on_ && ev_[0] == nullptr)
    for (cudaEvent_t& e : ev_) M3_CUDA_CHECK(cudaEventCreate(&e));
  const bool prof = profile_on_ && total_r > 0;
  if (prof) M3_CUDA_CHECK(cudaEventRecord(ev_[0], st));
  // Stage every step's arrays in one transfer.
  if (stage_cap_ < w.size()) {
    if (stage_ != nullptr) {
      M3_CUDA_CHECK(cudaStreamSynchronize(st));
      M3_CUDA_CHECK(cudaFreeHost(stage_));
    }
    stage_cap_ = std::max(w.size(), 2 * stage_cap_);
    M3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stage_), stage_cap_ * sizeof(int32_t)));
  }
  std::memcpy(stage_, w.data(), w.size() * sizeof(int32_t));
  int32_t* d = ops_->ensure(step_, static_cast<int64_t>(w.size()));
  M3_CUDA_CHECK(cudaMemcpyAsync(d, stage_, w.size() * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  int64_t max_r = 1, max_t = 1, max_hidden = 1, max_words = 1;
  for (const StepPlan& pl : plans) {
    max_r = std::max(max_r, pl.R);
    max_t = std::max(max_t, pl.T);
    max_hidden = std::max(max_hidden, pl.T * (pl.tok_at >= 0 ? aux_w : H));
    max_words = std::max(max_words, pl.words);
  }
  // Sized before any step runs, so no step (nor its capture) grows them.
  float* hid = ops_->ensure(hidden_, max_hidden);
  ops_->ensure(tokens_, max_t);  // the draft steps' input ids
  int32_t* ids = ops_->ensure(ids_, max_r);
  int32_t* mapped = ops_->ensure(mapped_, std::max<int64_t>(total_r, 1));
  int32_t* step_in = ops_->ensure(step_in_, max_words);
  int32_t* step_ids = ops_->ensure(step_ids_, max_r);
  if (greedy_.size() < static_cast<size_t>(max_r)) {
    std::vector<kernels::cpu::SampleRow> g(static_cast<size_t>(
        std::max<int64_t>(2 * static_cast<int64_t>(greedy_.size()), std::max<int64_t>(max_r, 64))));
    for (size_t r = 0; r < g.size(); ++r) {
      g[r].row = static_cast<int32_t>(r);
      g[r].temperature = 0.f;  // greedy: the argmax, ties to the lower id (as the CPU draft)
    }
    M3_CUDA_CHECK(cudaStreamSynchronize(st));
    greedy_ = gpu::DeviceBuffer<kernels::cpu::SampleRow>(g);
    clear_graphs();  // they read the old rows
  }
  const kernels::KvPages pages = cache_->layer(0);
  const int32_t* map = d2t_.size() > 0 ? d2t_.data() : nullptr;
  for (size_t si = 0; si < plans.size(); ++si) {
    const StepPlan& pl = plans[si];
    if (si > 0) {
      // A draft step: its arrays to the fixed inputs, the step (a graph replay where captured),
      // its ids to their place among every step's.
      if (si == 1 && prof) M3_CUDA_CHECK(cudaEventRecord(ev_[2], st));
      M3_CUDA_CHECK(cudaMemcpyAsync(step_in, d + pl.pos_at,
                                    static_cast<size_t>(pl.words) * sizeof(int32_t),
                                    cudaMemcpyDeviceToDevice, st));
      draft_step(pl.R, pl.max_kv_len, si == 1);
      M3_CUDA_CHECK(cudaMemcpyAsync(mapped + pl.out_at, step_ids,
                                    static_cast<size_t>(pl.R) * sizeof(int32_t),
                                    cudaMemcpyDeviceToDevice, st));
      continue;
    }
    if (prof) M3_CUDA_CHECK(cudaEventRecord(ev_[1], st));
    kernels::TokenLayout layout;
    layout.num_tokens = pl.T;
    layout.positions = d + pl.pos_at;
    layout.seq_ids = d + pl.seq_at;
    layout.block_table_offsets = d + pl.bto_at;
    layout.block_table = d + pl.bt_at;
    layout.multi_token_seqs = pl.T > pl.S;
    // The context pass. hidden: the target's aux rows of these positions [T, aux * target_hidden]
    ops_->gather_rows(target_.aux_states(), d + pl.src_at, pl.T, aux_w, hid);
    float* logits = pl.R > 0 ? ops_->f32(Buf::kLogits, pl.R * Vd) : nullptr;
    fw_->run(*ops_, d + pl.tok_at, layout, pages, hid, true, pl.max_kv_len, d + pl.rows_at, pl.R,
             logits);
    if (pl.R == 0) continue;
    ops::sample_rows(logits, Vd, Vd, greedy_.data(), pl.R, ids, st);
    // At 0 in mapped_ (pl.out_at == 0): where the first draft step's graph reads them.
    ops::gather_mapped_ids(ids, nullptr, pl.R, map, mapped + pl.out_at, st);
  }
  if (total_r == 0) {
    M3_CUDA_CHECK(cudaStreamSynchronize(st));
    return out;
  }
  if (prof) {
    if (plans.size() == 1) M3_CUDA_CHECK(cudaEventRecord(ev_[2], st));
    M3_CUDA_CHECK(cudaEventRecord(ev_[3], st));
  }
  if (out_host_cap_ < static_cast<size_t>(total_r)) {
    M3_CUDA_CHECK(cudaStreamSynchronize(st));
    if (out_host_ != nullptr) M3_CUDA_CHECK(cudaFreeHost(out_host_));
    out_host_cap_ = std::max<size_t>(static_cast<size_t>(total_r), 2 * out_host_cap_);
    M3_CUDA_CHECK(
        cudaMallocHost(reinterpret_cast<void**>(&out_host_), out_host_cap_ * sizeof(int32_t)));
  }
  M3_CUDA_CHECK(cudaMemcpyAsync(out_host_, mapped, static_cast<size_t>(total_r) * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, st));
  M3_CUDA_CHECK(cudaStreamSynchronize(st));
  for (size_t si = 0; si < plans.size(); ++si)
    for (size_t i = 0; i < seqs.size(); ++i)
      if (got[si][i] >= 0) out[i].push_back(out_host_[plans[si].out_at + got[si][i]]);
  if (prof) {
    float a = 0, b = 0, c = 0, span = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&a, ev_[0], ev_[1]));
    M3_CUDA_CHECK(cudaEventElapsedTime(&b, ev_[1], ev_[2]));
    M3_CUDA_CHECK(cudaEventElapsedTime(&c, ev_[2], ev_[3]));
    M3_CUDA_CHECK(cudaEventElapsedTime(&span, ev_[0], ev_[3]));
    ++profile_.calls;
    profile_.draft_steps += static_cast<int64_t>(plans.size()) - 1;
    profile_.stage_ms += a;
    profile_.context_ms += b;
    profile_.steps_ms += c;
    profile_.span_ms += span;
    profile_.wall_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_call)
            .count();
  }
  return out;
}

void Eagle3DraftCuda::forward_for_test(const DraftBatch& b, std::vector<float>* prenorm,
                                       std::vector<float>* logits) {
  M3_CHECK(cache_ != nullptr, "EAGLE-3 draft: forward_for_test() before allocate_kv()");
  M3_CUDA_CHECK(cudaSetDevice(device_));
  cudaStream_t st = target_.stream();
  const int64_t T = static_cast<int64_t>(b.token_ids.size()), H = cfg_.hidden_size;
  const int64_t R = static_cast<int64_t>(b.logits_indices.size()), Vd = cfg_.draft_vocab_size;
  std::vector<int32_t> w;
  auto push = [&](const std::vector<int32_t>& v) {
    const int64_t at = static_cast<int64_t>(w.size());
    w.insert(w.end(), v.begin(), v.end());
    return at;
  };
  const int64_t tok_at = push(b.token_ids), pos_at = push(b.positions), seq_at = push(b.seq_ids),
                bto_at = push(b.block_table_offsets), bt_at = push(b.block_table),
                rows_at = push(b.logits_indices);
  int32_t* d = ops_->ensure(step_, static_cast<int64_t>(w.size()));
  M3_CUDA_CHECK(cudaMemcpy(d, w.data(), w.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  float* hid = ops_->ensure(hidden_, static_cast<int64_t>(b.hidden.size()));
  M3_CUDA_CHECK(
      cudaMemcpy(hid, b.hidden.data(), b.hidden.size() * sizeof(float), cudaMemcpyHostToDevice));
  kernels::TokenLayout layout;
  layout.num_tokens = T;
  layout.positions = d + pos_at;
  layout.seq_ids = d + seq_at;
  layout.block_table_offsets = d + bto_at;
  layout.block_table = d + bt_at;
  layout.multi_token_seqs = T > static_cast<int64_t>(b.block_table_offsets.size()) - 1;
  const int64_t max_pos = *std::max_element(b.positions.begin(), b.positions.end());
  float* lg = R > 0 ? ops_->f32(Buf::kLogits, R * Vd) : nullptr;
  fw_->run(*ops_, d + tok_at, layout, cache_->layer(0), hid, b.hidden_is_aux, max_pos + 1,
           d + rows_at, R, lg);
  prenorm->resize(static_cast<size_t>(T * H));
  M3_CUDA_CHECK(cudaMemcpyAsync(prenorm->data(), ops_->f32(Buf::kX, 0),
                                prenorm->size() * sizeof(float), cudaMemcpyDeviceToHost, st));
  logits->resize(static_cast<size_t>(R * Vd));
  if (R > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(logits->data(), lg, logits->size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, st));
  M3_CUDA_CHECK(cudaStreamSynchronize(st));
}

}  // namespace m3::model
