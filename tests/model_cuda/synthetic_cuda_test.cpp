// Synthetic MiniMax-M3 weights on the GPU (M3ModelCuda::synthetic, `--model synthetic:layers=N`):
// 4 layers at the real shapes (3 dense + full attention, 1 MoE + MSA) build, prefill and decode
// with finite, non-degenerate logits; the same seed gives bit-identical weights and another seed
// different ones; MoE experts are contiguous per projection; the engine runs the synthetic model
// through the CUDA backend (what `serve --model synthetic:layers=4 --device cuda` does) and
// refuses a --max-model-len whose pages do not fit; a tensor-parallel rank's weights are its
// slices of the whole model's. Skips where no GPU is usable.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "engine/engine.h"
#include "gpu/device.h"
#include "gpu/device_buffer.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/cuda/synthetic_weights.h"
#include "model/kv_cache.h"
#include "model/synthetic_model.h"
#include "runtime/cuda/cuda_backend.h"
#include "runtime/sequence_runner.h"

namespace m3::model {
namespace {

using namespace m3::runtime;  // backends and the sequence runner

std::string no_gpu_reason() {
  auto info = gpu::probe_device(0);
  return info ? std::string() : info.error().message;
}

#define SKIP_WITHOUT_GPU() \
  if (!no_gpu_reason().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu_reason()

size_t mat_bytes(const MatRef& m) {
  return static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype);
}

// Checksums of a few whole tensors: embedding, a dense layer's q, the MoE layer's router and
// its whole w1 block (128 experts, 4.8 GB), and the lm_head.
std::vector<uint64_t> checksums(const M3ModelCuda& m) {
  const M3Weights& w = m.device_weights();
  const LayerWeights& moe = w.layers[3];
  cudaStream_t s = nullptr;  // legacy default stream: ordered after the generation's sync
  return {
      device_checksum(w.embed_tokens.data, mat_bytes(w.embed_tokens), s),
      device_checksum(w.layers[0].q_proj.data, mat_bytes(w.layers[0].q_proj), s),
      device_checksum(moe.router.data, mat_bytes(moe.router), s),
      device_checksum(moe.experts[0].w1.data, mat_bytes(moe.experts[0].w1) * moe.experts.size(), s),
      device_checksum(w.lm_head.data, mat_bytes(w.lm_head), s)};
}

TEST(SyntheticCuda, FourLayersAtRealShapesDecodeFiniteLogits) {
  SKIP_WITHOUT_GPU();
  const M3Config cfg = synthetic_m3_config(4);
  auto m = M3ModelCuda::synthetic(cfg, 1234);
  ASSERT_TRUE(m) << m.error().message;
  M3ModelCuda& model = **m;
  EXPECT_EQ(model.weight_bytes(), static_cast<size_t>(synthetic_weight_bytes(cfg)));
  EXPECT_EQ(model.host(), nullptr);
  // Task A's grouped MoE kernels index experts from experts[0]: one allocation per projection.
  const LayerWeights& L = model.device_weights().layers[3];
  ASSERT_EQ(L.experts.size(), 128u);
  const int64_t per = cfg.intermediate_size * cfg.hidden_size;
  for (size_t e = 0; e < L.experts.size(); ++e) {
    EXPECT_EQ(L.experts[e].w1.data, static_cast<const uint16_t*>(L.experts[0].w1.data) + e * per);
    EXPECT_EQ(L.experts[e].w3.data, static_cast<const uint16_t*>(L.experts[0].w3.data) + e * per);
    EXPECT_EQ(L.experts[e].w2.data, static_cast<const uint16_t*>(L.experts[0].w2.data) + e * per);
  }
  EXPECT_EQ(L.router.dtype, DType::kF32);
  EXPECT_EQ(L.router_bias.dtype, DType::kF32);

  // A 300-token prompt (3 pages, so the MSA layer sees several blocks), then 2 decode steps.
  SequenceRunner runner(borrow_cuda_backend(model, 512, 1));
  const int seq = runner.add_sequence();
  std::vector<int32_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % 200000);
  ForwardResult r = runner.step({{seq, prompt, false}});
  const int64_t V = cfg.vocab_size;
  for (int step = 0; step < 3; ++step) {
    ASSERT_EQ(r.vocab_size, V);
    ASSERT_EQ(r.logits.size(), static_cast<size_t>(V));
    double sum = 0, sq = 0;
    size_t bad = 0, argmax = 0;
    for (size_t i = 0; i < r.logits.size(); ++i) {
      const float x = r.logits[i];
      if (!std::isfinite(x)) ++bad;
      sum += x;
      sq += static_cast<double>(x) * x;
      if (x > r.logits[argmax]) argmax = i;
    }
    EXPECT_EQ(bad, 0u) << "step " << step;
    const double mean = sum / V, sd = std::sqrt(std::max(0.0, sq / V - mean * mean));
    // lm_head rows have std 1/sqrt(hidden) over a unit-RMS final hidden state, so logits have a
    // std near 1; anything far outside [0.1, 10] means activations collapsed or blew up.
    EXPECT_GT(sd, 0.1) << "step " << step;
    EXPECT_LT(sd, 10.0) << "step " << step;
    EXPECT_LT(std::abs(mean), 1.0) << "step " << step;
    if (step == 2) break;
    const int32_t next = static_cast<int32_t>(argmax);
    r = runner.step({{seq, std::span<const int32_t>(&next, 1), false}});
  }
  EXPECT_EQ(runner.length(seq), 302);
}

TEST(SyntheticCuda, SameSeedSameWeightsOtherSeedOtherWeights) {
  SKIP_WITHOUT_GPU();
  const M3Config cfg = synthetic_m3_config(4);
  std::vector<uint64_t> a, b, c;
  {
    auto m = M3ModelCuda::synthetic(cfg, 7);
    ASSERT_TRUE(m) << m.error().message;
    a = checksums(**m);
  }
  {
    auto m = M3ModelCuda::synthetic(cfg, 7);
    ASSERT_TRUE(m) << m.error().message;
    b = checksums(**m);
  }
  {
    auto m = M3ModelCuda::synthetic(cfg, 8);
    ASSERT_TRUE(m) << m.error().message;
    c = checksums(**m);
  }
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), c.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i], c[i]) << "tensor " << i;
  // Distinct tensors of one seed draw distinct streams.
  EXPECT_NE(a[0], a[4]);
}

// Checksum of rows [r0, + nr) x columns [c0, + nc) of a device matrix (copied out densely).
uint64_t block_checksum(const MatRef& m, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const size_t es = dtype_size(m.dtype);
  gpu::DeviceBuffer<uint8_t> tmp(static_cast<size_t>(nr * nc) * es);
  EXPECT_EQ(cudaMemcpy2D(tmp.data(), nc * es,
                         static_cast<const uint8_t*>(m.data) + (r0 * m.cols + c0) * es, m.cols * es,
                         nc * es, nr, cudaMemcpyDeviceToDevice),
            cudaSuccess);
  return device_checksum(tmp.data(), tmp.size(), nullptr);
}
uint64_t whole_checksum(const MatRef& m) {
  return device_checksum(m.data, mat_bytes(m), nullptr);
}

// A tensor-parallel rank's synthetic weights are exactly its slices of the unsharded model's
// (M3ModelCuda::synthetic with a ShardPlan): what makes `synthetic:layers=N` under TP compute what
// TP1 computes. Every shard of TP2, TP4 + EP and TP8 (KV heads replicated) is generated on this
// one GPU and compared slice by slice with the whole model.
TEST(SyntheticCuda, RankShardsAreSlicesOfTheWholeModel) {
  SKIP_WITHOUT_GPU();
  const M3Config cfg = synthetic_m3_config(4);
  auto whole = M3ModelCuda::synthetic(cfg, 11);
  ASSERT_TRUE(whole) << whole.error().message;
  const M3Weights& W = (*whole)->device_weights();
  const int64_t d = cfg.head_dim, di = cfg.index_head_dim;
  struct Split {
    int world;
    bool ep;
  };
  for (const Split sp : {Split{2, false}, Split{4, true}, Split{8, false}}) {
    for (int r = 0; r < sp.world; ++r) {
      ShardSpec spec;
      spec.rank = r;
      spec.world = sp.world;
      spec.expert_parallel = sp.ep;
      auto plan = make_shard_plan(cfg, spec);
      ASSERT_TRUE(plan) << plan.error().message;
      const ShardPlan& p = *plan;
      auto shard = M3ModelCuda::synthetic(cfg, 11, 0, &p);
      ASSERT_TRUE(shard) << shard.error().message;
      const M3Weights& S = (*shard)->device_weights();
      EXPECT_EQ((*shard)->weight_bytes(), static_cast<size_t>(synthetic_weight_bytes(cfg, p)));
      const std::string where =
          "TP" + std::to_string(sp.world) + (sp.ep ? "+EP" : "") + " rank " + std::to_string(r);
      EXPECT_EQ(whole_checksum(S.embed_tokens),
                block_checksum(W.embed_tokens, p.vocab_begin, p.vocab_count, 0, cfg.hidden_size))
          << where;
      EXPECT_EQ(whole_checksum(S.lm_head),
                block_checksum(W.lm_head, p.vocab_begin, p.vocab_count, 0, cfg.hidden_size))
          << where;
      EXPECT_EQ(device_checksum(S.final_norm.data, S.final_norm.n * 2, nullptr),
                device_checksum(W.final_norm.data, W.final_norm.n * 2, nullptr));
      for (int64_t li : {0, 3}) {  // a dense layer and the MoE + MSA layer
        const LayerWeights &A = S.layers[li], &B = W.layers[li];
        const std::string at = where + " layer " + std::to_string(li);
        EXPECT_EQ(whole_checksum(A.q_proj),
                  block_checksum(B.q_proj, p.q_head_begin * d, p.num_q_heads * d, 0, B.q_proj.cols))
            << at;
        EXPECT_EQ(whole_checksum(A.v_proj), block_checksum(B.v_proj, p.kv_head_begin * d,
                                                           p.num_kv_heads * d, 0, B.v_proj.cols))
            << at;
        EXPECT_EQ(whole_checksum(A.o_proj),
                  block_checksum(B.o_proj, 0, B.o_proj.rows, p.q_head_begin * d, p.num_q_heads * d))
            << at;
        if (li == 0) {
          EXPECT_EQ(whole_checksum(A.down_proj), block_checksum(B.down_proj, 0, B.down_proj.rows,
                                                                p.dense_inter_begin, p.dense_inter))
              << at;
          EXPECT_EQ(whole_checksum(A.up_proj), block_checksum(B.up_proj, p.dense_inter_begin,
                                                              p.dense_inter, 0, B.up_proj.cols))
              << at;
          continue;
        }
        EXPECT_EQ(whole_checksum(A.index_q_proj),
                  block_checksum(B.index_q_proj, p.kv_head_begin * di, p.num_kv_heads * di, 0,
                                 B.index_q_proj.cols))
            << at;
        EXPECT_EQ(whole_checksum(A.index_k_proj), whole_checksum(B.index_k_proj)) << at;
        EXPECT_EQ(whole_checksum(A.router), whole_checksum(B.router)) << at;
        EXPECT_EQ(whole_checksum(A.shared_down),
                  block_checksum(B.shared_down, 0, B.shared_down.rows, p.shared_inter_begin,
                                 p.shared_inter))
            << at;
        ASSERT_EQ(static_cast<int64_t>(A.experts.size()), p.num_experts) << at;
        for (int64_t e : {int64_t{0}, p.num_experts - 1}) {
          const ExpertWeights &X = A.experts[e], &Y = B.experts[p.expert_begin + e];
          EXPECT_EQ(whole_checksum(X.w1),
                    block_checksum(Y.w1, p.expert_inter_begin, p.expert_inter, 0, Y.w1.cols))
              << at << " expert " << e;
          EXPECT_EQ(whole_checksum(X.w2),
                    block_checksum(Y.w2, 0, Y.w2.rows, p.expert_inter_begin, p.expert_inter))
              << at << " expert " << e;
        }
      }
    }
  }
}

TEST(SyntheticCuda, TooManyLayersForTheGpuAreRefusedWithTheNumbers) {
  SKIP_WITHOUT_GPU();
  auto info = gpu::probe_device(0);
  ASSERT_TRUE(info);
  if (static_cast<double>(info->free_bytes) > 430e9) GTEST_SKIP() << "a GPU that fits 60 layers";
  auto m = M3ModelCuda::synthetic(synthetic_m3_config(60), 1);
  ASSERT_FALSE(m);
  EXPECT_NE(m.error().message.find("synthetic:layers=60 needs"), std::string::npos)
      << m.error().message;
  EXPECT_NE(m.error().message.find("or fewer"), std::string::npos) << m.error().message;
}

engine::EngineConfig synthetic_engine(int64_t kv_bytes, int max_model_len,
                                      const std::string& spec = "synthetic:layers=4,seed=3") {
  engine::EngineConfig ec;
  ec.model_dir = spec;
  ec.max_model_len = max_model_len;
  ec.max_num_seqs = 8;
  ec.num_sampleable_tokens = 2688;  // the demo tokenizer's vocabulary, as serve sets it
  CudaBackendOptions opts;
  opts.kv_cache_memory_bytes = kv_bytes;
  opts.max_model_len = max_model_len;
  opts.synthetic_seed = 3;
  ec.backend_factory = [opts](std::unique_ptr<M3Model> host, int64_t) {
    return make_cuda_backend(std::move(host), opts);
  };
  return ec;
}

TEST(SyntheticCuda, EngineServesTheSyntheticModelAndRefusesATooLongMaxModelLen) {
  SKIP_WITHOUT_GPU();
  const int64_t page = KvCache::page_bytes(synthetic_m3_config(4));
  {
    // 16 pages = 2048 tokens: --max-model-len 4096 needs 32.
    auto e = engine::Engine::create(synthetic_engine(16 * page, 4096));
    ASSERT_FALSE(e);
    EXPECT_NE(e.error().message.find("--max-model-len 4096 needs 32 KV pages"), std::string::npos)
        << e.error().message;
    EXPECT_NE(e.error().message.find("at most 2048"), std::string::npos) << e.error().message;
  }
  auto e = engine::Engine::create(synthetic_engine(64 * page, 2048));
  ASSERT_TRUE(e) << e.error().message;
  EXPECT_EQ((*e)->model_info().num_kv_blocks, 64);
  std::vector<std::shared_ptr<engine::RequestStream>> streams;
  for (int i = 0; i < 4; ++i) {
    engine::GenerateRequest r;
    for (int t = 0; t < 20 + i; ++t) r.prompt_token_ids.push_back(100 + 31 * t + i);
    r.params.temperature = 0;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    auto s = (*e)->submit(r);
    ASSERT_TRUE(s) << s.error().message;
    streams.push_back(*s);
  }
  for (auto& s : streams) {
    std::vector<int32_t> got;
    for (;;) {
      auto o = s->next(std::chrono::milliseconds(120000));
      ASSERT_TRUE(o.has_value()) << "stream timed out";
      ASSERT_NE(o->finish_reason, "error") << o->error;
      got.insert(got.end(), o->new_token_ids.begin(), o->new_token_ids.end());
      if (o->finished) break;
    }
    ASSERT_EQ(got.size(), 6u);
    for (int32_t t : got) EXPECT_TRUE(t >= 0 && t < 2688) << t;  // inside the tokenizer's vocab
  }
}

// `serve --model synthetic:layers=4,weights=nvfp4`: the backend generates the linears in the
// stored format (M3ModelCuda::synthetic's quantize_bf16_rows) and the engine serves them; the
// fewer weight bytes leave more KV pages at the same memory budget than bf16.
TEST(SyntheticCuda, EngineServesASyntheticModelInAStoredFormat) {
  SKIP_WITHOUT_GPU();
  auto host = M3Model::load("synthetic:layers=4,seed=3,weights=nvfp4");
  ASSERT_TRUE(host) << host.error().message;
  ASSERT_EQ((*host)->synthetic_weights(), kernels::WeightQuant::kNvfp4);
  CudaBackendOptions opts;
  opts.max_model_len = 2048;
  opts.synthetic_seed = 3;
  auto bq = make_cuda_backend(std::move(*host), opts);
  ASSERT_TRUE(bq) << bq.error().message;
  const int64_t pages_nvfp4 = (*bq)->num_pages();
  bq->reset();
  auto bf = make_cuda_backend(*M3Model::load("synthetic:layers=4,seed=3"), opts);
  ASSERT_TRUE(bf) << bf.error().message;
  EXPECT_GT(pages_nvfp4, (*bf)->num_pages());
  bf->reset();
  const int64_t page = KvCache::page_bytes(synthetic_m3_config(4));
  auto e = engine::Engine::create(
      synthetic_engine(64 * page, 2048, "synthetic:layers=4,seed=3,weights=nvfp4"));
  ASSERT_TRUE(e) << e.error().message;
  engine::GenerateRequest r;
  for (int t = 0; t < 24; ++t) r.prompt_token_ids.push_back(100 + 31 * t);
  r.params.temperature = 0;
  r.params.max_tokens = 6;
  r.params.ignore_eos = true;
  auto s = (*e)->submit(r);
  ASSERT_TRUE(s) << s.error().message;
  std::vector<int32_t> got;
  for (;;) {
    auto o = (*s)->next(std::chrono::milliseconds(120000));
    ASSERT_TRUE(o.has_value()) << "stream timed out";
    ASSERT_NE(o->finish_reason, "error") << o->error;
    got.insert(got.end(), o->new_token_ids.begin(), o->new_token_ids.end());
    if (o->finished) break;
  }
  ASSERT_EQ(got.size(), 6u);
  for (int32_t t : got) EXPECT_TRUE(t >= 0 && t < 2688) << t;
}

}  // namespace
}  // namespace m3::model
