// The vision tower on the GPU: each new CUDA op (kernels/cuda/vision.h, scatter_rows) against
// its CPU twin; the GPU tower (model/cuda/vision_cuda.h) against the CPU tower and the
// transformers goldens on the tiny golden checkpoint (tests/golden/vision/model), under the
// exact and the bf16 GEMM precision; and whole image (and, where the build decodes video,
// video) prompts through the engine on the CUDA backend against transformers' logprobs. Every
// GPU test skips where no GPU is usable.
//
// Tolerances.
// - kOpTol (exact ops): the CUDA ops compute the CPU formulas in fp32; LayerNorm's statistics
//   are fp32 here, double there (2^-24 relative of a mean of O(1) values), erff / expf differ by
//   ulps and the attention's dot products by summation order: ~sqrt(K) 2^-24 of O(1) values for
//   K <= 2304 keys, ~3e-6. 2e-5 absolute on O(1) outputs is a few times that.
// - Attention under bf16: Q, K, V and P rounded to bf16 (2^-9 relative each) with fp32
//   accumulation: scores of |s| <~ 3 move by ~3 * 2 * 2^-9 ~ 1e-2 before the softmax, outputs
//   (weighted means of O(1) values) by ~1e-2; 3e-2 absolute, while a wrong segment or head
//   layout moves them by O(1).
// - kTowerTol (GPU tower, exact, against transformers): the CPU tower's 1e-4
//   (tests/model/vision_golden_test.cpp derives it); the GPU adds fp32 summation-order noise of
//   the same size as the CPU's own.
// - kTowerBf16Rel (bf16 tower against the exact CPU tower, relative to the largest |value|):
//   every GEMM input is rounded to bf16 (2^-9 = 2e-3 relative) through patch embed, 2 layers of
//   5 GEMMs and the attention, projector and merge (4 GEMMs): errors of ~2e-3 per GEMM add up
//   over ~12 GEMMs to ~1e-2 (random-walk sqrt(12) * 2e-3 ~ 7e-3); 3e-2 of the output scale
//   leaves room while a layout bug (the two RoPE layouts differ by > 5e-2 absolute on outputs
//   of O(1)) still fails.
// - Whole model: the CPU golden tests' kLogprobTol / kGreedyMarginFloor (golden_util.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>

#include "engine/engine.h"
#include "gpu/device_buffer.h"
#include "gpu_test_util.h"
#include "kernels/cpu/vision.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/vision.h"
#include "model/cuda/m3_model_cuda.h"
#include "model/cuda/vision_cuda.h"
#include "model/engine_golden_util.h"
#include "model/golden_util.h"
#include "model/m3_model.h"
#include "model/vision_tower.h"
#include "runtime/cuda/cuda_backend.h"
#include "vision/image_decode.h"
#include "vision/image_processor.h"

namespace m3 {
namespace {

namespace kc = kernels::cuda;
using gpu::DeviceBuffer;
using kernels::VecRef;

constexpr double kOpTol = 2e-5;
constexpr double kAttnBf16Tol = 3e-2;
constexpr double kTowerTol = 1e-4;
constexpr double kTowerBf16Rel = 3e-2;

const std::string kRoot = std::string(M3_SOURCE_DIR) + "/tests/golden/vision";
const std::string kModelDir = kRoot + "/model";

double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    w = std::max(w, std::fabs(static_cast<double>(a[i]) - b[i]));
  return a.size() == b.size() ? w : INFINITY;
}

double max_abs(const std::vector<float>& a) {
  double w = 0;
  for (float x : a) w = std::max(w, std::fabs(static_cast<double>(x)));
  return w;
}

// Restores the process-wide GEMM precision when a test ends.
struct PrecisionScope {
  explicit PrecisionScope(kc::GemmPrecision p) : old(kc::gemm_precision()) {
    kc::set_gemm_precision(p);
  }
  ~PrecisionScope() { kc::set_gemm_precision(old); }
  kc::GemmPrecision old;
};

TEST(VisionCudaOps, LayerNormBiasGeluMatchCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(7);
  for (int64_t dim : {16, 1280, 1000}) {
    const int64_t rows = 37;
    auto x = testing::randn(rows * dim, g, 2.f);
    for (auto& v : x) v += 3.f;  // a mean away from 0
    auto w = testing::randn(dim, g), b = testing::randn(dim, g);
    auto wb = testing::to_bf16(w);
    DeviceBuffer<float> dx(x), dout(rows * dim), db(b);
    DeviceBuffer<uint16_t> dw(wb);
    const VecRef hw{wb.data(), DType::kBF16, dim}, hb{b.data(), DType::kF32, dim};
    const VecRef gw{dw.data(), DType::kBF16, dim}, gb{db.data(), DType::kF32, dim};
    std::vector<float> want(rows * dim);
    kernels::cpu::layer_norm(x.data(), rows, dim, hw, hb, 1e-5f, want.data());
    kc::layer_norm(dx.data(), rows, dim, gw, gb, 1e-5f, dout.data(), nullptr);
    EXPECT_LE(max_abs(dout.to_host(), want), kOpTol) << "layer_norm dim " << dim;
    // In place.
    kc::layer_norm(dx.data(), rows, dim, gw, gb, 1e-5f, dx.data(), nullptr);
    EXPECT_LE(max_abs(dx.to_host(), want), kOpTol) << "layer_norm in place, dim " << dim;
    // Bias rows, then GELU.
    kernels::cpu::add_bias_rows(want.data(), rows, hb);
    kc::add_bias_rows(dx.data(), rows, gb, nullptr);
    EXPECT_LE(max_abs(dx.to_host(), want), kOpTol) << "add_bias_rows dim " << dim;
    kernels::cpu::gelu_erf(want.data(), rows * dim);
    kc::gelu_erf(dx.data(), rows * dim, nullptr);
    EXPECT_LE(max_abs(dx.to_host(), want), kOpTol) << "gelu dim " << dim;
  }
}

TEST(VisionCudaOps, RopeCosSinMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(3);
  // M3's head_dim 80 with the reference layout's 78 rotary dims, and a whole-head rotation.
  for (auto [heads, d, rot] : {std::tuple{16, 80, 78}, {2, 8, 8}}) {
    const int64_t n = 29;
    auto x = testing::randn(n * heads * d, g);
    std::vector<float> cs(n * rot), sn(n * rot);
    std::uniform_real_distribution<float> ang(-3.f, 3.f);
    for (int64_t i = 0; i < n * rot; ++i) {
      const float a = ang(g);
      cs[i] = std::cos(a);
      sn[i] = std::sin(a);
    }
    DeviceBuffer<float> dx(x), dc(cs), ds(sn);
    kernels::cpu::rope_cos_sin(x.data(), n, heads, d, rot, cs.data(), sn.data());
    kc::rope_cos_sin(dx.data(), n, heads, d, rot, dc.data(), ds.data(), nullptr);
    EXPECT_LE(max_abs(dx.to_host(), x), kOpTol) << "d " << d;
  }
}

TEST(VisionCudaOps, AttentionSegmentsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(11);
  struct Case {
    int64_t heads, d;
    std::vector<int64_t> seg;
  };
  // M3's 16 x 80 over three images of different sizes; a tiny head dim; long segments (one
  // head, 3000 and 4500 keys: score rows longer than the softmax block's 256 threads by far).
  for (const Case& c : {Case{16, 80, {0, 64, 100, 356}}, Case{2, 8, {0, 5, 6, 30}},
                        Case{4, 80, {0, 1200}}, Case{1, 16, {0, 3000}}, Case{1, 8, {0, 4500}}}) {
    const int64_t n = c.seg.back(), w = c.heads * c.d;
    const auto q = testing::randn(n * w, g), k = testing::randn(n * w, g),
               v = testing::randn(n * w, g);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    const int64_t nseg = static_cast<int64_t>(c.seg.size()) - 1;
    std::vector<float> want(n * w);
    kernels::cpu::attention_segments(q.data(), k.data(), v.data(), n, c.heads, c.d, c.seg.data(),
                                     nseg, scale, want.data());
    DeviceBuffer<float> dq(q), dk(k), dv(v), dout(n * w);
    for (auto p : {kc::GemmPrecision::kExact, kc::GemmPrecision::kBf16}) {
      PrecisionScope ps(p);
      int64_t longest = 0;
      for (int64_t s = 0; s < nseg; ++s) longest = std::max(longest, c.seg[s + 1] - c.seg[s]);
      // A workspace for 7 query rows: several chunks per segment.
      for (int64_t rows : {longest, int64_t{7}}) {
        const size_t bytes = kc::attention_segments_workspace_bytes(n, c.heads, c.d, rows, longest);
        DeviceBuffer<uint8_t> ws(bytes);
        dout.fill_bytes(0xff);
        kc::attention_segments(dq.data(), dk.data(), dv.data(), n, c.heads, c.d, c.seg.data(), nseg,
                               scale, kernels::Workspace{ws.data(), bytes}, dout.data(), nullptr);
        const double err = max_abs(dout.to_host(), want);
        std::printf("attention_segments heads %lld d %lld %s rows %lld: max |err| %.3g\n",
                    static_cast<long long>(c.heads), static_cast<long long>(c.d),
                    p == kc::GemmPrecision::kExact ? "exact" : "bf16", static_cast<long long>(rows),
                    err);
        EXPECT_LE(err, p == kc::GemmPrecision::kExact ? kOpTol : kAttnBf16Tol);
      }
    }
  }
}

TEST(VisionCudaOps, ScatterRowsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 g(5);
  const int64_t T = 20, H = 24;
  auto x = testing::randn(T * H, g);
  const std::vector<int32_t> rows = {2, 3, 4, 11, 19};
  auto vals = testing::randn(rows.size() * H, g);
  DeviceBuffer<float> dx(x), dv(vals);
  DeviceBuffer<int32_t> dr(rows);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy(vals.begin() + i * H, vals.begin() + (i + 1) * H, x.begin() + rows[i] * H);
  kc::scatter_rows(dx.data(), dr.data(), static_cast<int64_t>(rows.size()), H, dv.data(), nullptr);
  EXPECT_EQ(dx.to_host(), x);
}

// ---- the tower on the golden checkpoint ----

nlohmann::json golden() {
  return model::golden::read_json(kModelDir + "/golden.json");
}

using model::golden::load_golden_image;

std::vector<float> flat(const nlohmann::json& rows) {
  std::vector<float> out;
  for (const auto& r : rows)
    for (const auto& v : r) out.push_back(v.get<float>());
  return out;
}

TEST(VisionTowerCuda, MatchesCpuTowerAndTransformers) {
  SKIP_WITHOUT_GPU();
  model::LoadOptions lo;
  lo.language_model_only = false;
  auto m = model::M3Model::load(kModelDir, lo);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  const model::VisionTower* cpu = (*m)->vision();
  ASSERT_NE(cpu, nullptr);
  gpu::Stream stream;
  auto tower = model::VisionTowerCuda::upload((*m)->config(), cpu->weights(), stream.get());
  const auto g = golden();
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    std::vector<vision::ProcessedImage> imgs;
    for (const auto& n : c["images"]) imgs.push_back(load_golden_image(n.get<std::string>()));
    std::vector<model::VisionImage> vi;
    for (const auto& p : imgs) vi.push_back({p.grid_t, p.grid_h, p.grid_w, p.pixel_values.data()});
    std::vector<float> want_e, want_h;
    cpu->encode(vi, &want_e, &want_h);
    {
      PrecisionScope ps(kc::GemmPrecision::kExact);
      std::vector<float> e, h;
      tower->encode(vi, &e, &h);
      const double de = max_abs(e, want_e), dh = max_abs(h, want_h);
      const double ge = max_abs(e, flat(c["image_embeds"])),
                   gh = max_abs(h, flat(c["tower_hidden"]));
      std::printf("GPU tower exact: vs CPU embeds %.3g hidden %.3g; vs transformers %.3g / %.3g\n",
                  de, dh, ge, gh);
      EXPECT_LE(de, kTowerTol);
      EXPECT_LE(dh, kTowerTol);
      EXPECT_LE(ge, kTowerTol);
      EXPECT_LE(gh, kTowerTol);
    }
    {
      PrecisionScope ps(kc::GemmPrecision::kBf16);
      std::vector<float> e, h;
      tower->encode(vi, &e, &h);
      const double re = max_abs(e, want_e) / max_abs(want_e),
                   rh = max_abs(h, want_h) / max_abs(want_h);
      std::printf("GPU tower bf16: vs CPU embeds %.3g, hidden %.3g (relative to max |value|)\n", re,
                  rh);
      EXPECT_LE(re, kTowerBf16Rel);
      EXPECT_LE(rh, kTowerBf16Rel);
    }
  }
}

// Video-shaped inputs (grid_t > 1: several frame pairs of one segment) and the reference
// layout (one attention block per image): the GPU tower equals the CPU tower.
TEST(VisionTowerCuda, VideoShapesAndReferenceLayoutMatchCpu) {
  SKIP_WITHOUT_GPU();
  PrecisionScope ps(kc::GemmPrecision::kExact);
  for (auto layout :
       {model::VisionRopeLayout::kTransformers, model::VisionRopeLayout::kReference}) {
    auto cfg = model::load_config(kModelDir);
    ASSERT_TRUE(cfg.has_value());
    cfg->vision.rope_layout = layout;
    auto ck = model::Checkpoint::open(kModelDir);
    ASSERT_TRUE(ck.has_value());
    auto cpu = model::VisionTower::load(std::make_shared<model::Checkpoint>(std::move(*ck)), *cfg);
    ASSERT_TRUE(cpu.has_value()) << cpu.error().message;
    gpu::Stream stream;
    auto tower = model::VisionTowerCuda::upload(*cfg, (*cpu)->weights(), stream.get());
    std::mt19937 g(9);
    const int64_t row = cfg->vision.patch_row_size();
    const auto a = testing::randn(3 * 4 * 6 * row, g), b = testing::randn(1 * 2 * 4 * row, g);
    const std::vector<model::VisionImage> vi = {{3, 4, 6, a.data()}, {1, 2, 4, b.data()}};
    std::vector<float> want, got;
    (*cpu)->encode(vi, &want);
    tower->encode(vi, &got);
    EXPECT_LE(max_abs(got, want), kTowerTol)
        << (layout == model::VisionRopeLayout::kReference ? "reference" : "transformers");
  }
}

// ---- the whole model through the engine on the CUDA backend ----

engine::EngineConfig cuda_engine(int64_t max_batched) {
  engine::EngineConfig ec;
  ec.model_dir = kModelDir;
  ec.max_num_seqs = 4;
  ec.max_num_batched_tokens = max_batched;
  ec.block_size = 8;
  runtime::CudaBackendOptions opts;
  opts.kv_cache_memory_bytes = int64_t{64} << 20;
  ec.backend_factory = [opts](std::unique_ptr<model::M3Model> host, int64_t) {
    return runtime::make_cuda_backend(std::move(host), opts);
  };
  return ec;
}

TEST(VisionCudaEngine, ImagePromptsMatchTransformers) {
  SKIP_WITHOUT_GPU();
  PrecisionScope ps(kc::GemmPrecision::kExact);
  // 64: chunked prefill (images split across steps); 4096: one prefill step.
  for (int64_t budget : {int64_t{64}, int64_t{4096}}) {
    auto eng = engine::Engine::create(cuda_engine(budget));
    ASSERT_TRUE(eng.has_value()) << eng.error().message;
    ASSERT_TRUE((*eng)->model_info().image_input) << (*eng)->model_info().image_refusal;
    const auto g = golden();
    const int32_t image_id = g["image_token_index"];
    for (int pass = 0; pass < 2; ++pass) {  // pass 1 hits the prefix cache of pass 0's pages
      for (const auto& c : g["cases"]) {
        SCOPED_TRACE(c["name"].get<std::string>() + " budget " + std::to_string(budget) + " pass " +
                     std::to_string(pass));
        engine::GenerateRequest req;
        req.prompt_token_ids = c["prompt_ids"].get<std::vector<int32_t>>();
        req.images =
            model::golden::golden_image_inputs(req.prompt_token_ids, c["images"], image_id);
        req.params.temperature = 0.f;
        req.params.max_tokens = static_cast<int>(c["greedy"].size());
        req.params.ignore_eos = true;
        req.params.logprobs = 0;
        if (pass == 0) req.params.prompt_logprobs = 0;
        auto s = (*eng)->submit(std::move(req));
        ASSERT_TRUE(s.has_value()) << s.error().message;
        const model::golden::EngineRun run = model::golden::collect(**s);
        ASSERT_FALSE(run.timed_out);
        ASSERT_NE(run.last.finish_reason, "error") << run.last.error;
        EXPECT_GE(model::golden::compare_greedy(run, c["greedy"]), 1);
        if (pass == 0) model::golden::expect_prompt_logprobs(run, c["prompt_logprobs"]);
      }
    }
  }
}

// --language-model-only on the GPU: no tower, image input refused by name.
TEST(VisionCudaEngine, LanguageModelOnlyRefusesImages) {
  SKIP_WITHOUT_GPU();
  engine::EngineConfig ec = cuda_engine(64);
  ec.language_model_only = true;
  auto eng = engine::Engine::create(ec);
  ASSERT_TRUE(eng.has_value()) << eng.error().message;
  EXPECT_FALSE((*eng)->model_info().image_input);
  EXPECT_NE((*eng)->model_info().image_refusal.find("--language-model-only"), std::string::npos)
      << (*eng)->model_info().image_refusal;
}

}  // namespace
}  // namespace m3
