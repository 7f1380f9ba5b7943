// The vision path against transformers 5.17 (tests/golden/vision/model, made by
// tools/goldens/make_vision_goldens.py): the tower's last hidden state and the projected + merged
// image embeddings (transformers layout, and the reference layout against an independent float64
// numpy forward), then whole prompts with images through the engine (placeholder embeddings,
// scheduler, chunked prefill, prefix cache): prompt logprobs and the greedy continuation.
//
// Tolerances. The tower is fp32 on both sides over bf16 weights read exactly: rounding differs
// only by summation order, ~sqrt(K) * 2^-24 relative per dot product of K <= 1176 terms
// (~2e-6), through 2 encoder layers, the projector and the merge with LayerNorms renormalising;
// outputs are O(1), so 1e-4 absolute is ~50x that bound and far below the O(1) changes a wrong
// RoPE axis, mask or row order makes (checked: the two layouts differ by > 0.1). The logprobs
// use the model goldens' kLogprobTol (tests/model/model_golden_test.cpp derives it).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "engine/engine.h"
#include "model/engine_golden_util.h"
#include "model/golden_util.h"
#include "model/m3_model.h"
#include "model/vision_tower.h"
#include "runtime/forward_backend.h"
#include "vision/image_decode.h"
#include "vision/image_processor.h"

namespace m3 {
namespace {

const std::string kRoot = std::string(M3_SOURCE_DIR) + "/tests/golden/vision";
const std::string kModelDir = kRoot + "/model";
constexpr double kTowerTol = 1e-4;

nlohmann::json golden() {
  return model::golden::read_json(kModelDir + "/golden.json");
}

using model::golden::load_golden_image;

double max_abs_diff(const std::vector<float>& got, const nlohmann::json& want, size_t* n) {
  double worst = 0;
  size_t k = 0;
  for (const auto& row : want)
    for (const auto& v : row) {
      EXPECT_LT(k, got.size());
      if (k >= got.size()) return INFINITY;
      worst = std::max(worst, std::fabs(got[k++] - v.get<double>()));
    }
  *n = k;
  EXPECT_EQ(k, got.size());
  return worst;
}

struct Encoded {
  std::vector<float> embeds, hidden;
};

Encoded encode(const model::VisionTower& tower, const nlohmann::json& c) {
  std::vector<vision::ProcessedImage> imgs;
  for (const auto& n : c["images"]) imgs.push_back(load_golden_image(n.get<std::string>()));
  std::vector<model::VisionImage> vi;
  for (const auto& p : imgs) vi.push_back({p.grid_t, p.grid_h, p.grid_w, p.pixel_values.data()});
  Encoded e;
  tower.encode(vi, &e.embeds, &e.hidden);
  return e;
}

TEST(VisionGolden, TowerMatchesTransformers) {
  model::LoadOptions lo;
  lo.language_model_only = false;
  auto m = model::M3Model::load(kModelDir, lo);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  ASSERT_NE((*m)->vision(), nullptr);
  EXPECT_EQ((*m)->config().vision.rope_layout, model::VisionRopeLayout::kTransformers);
  const auto g = golden();
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const Encoded e = encode(*(*m)->vision(), c);
    size_t n = 0;
    EXPECT_LE(max_abs_diff(e.hidden, c["tower_hidden"], &n), kTowerTol);
    EXPECT_LE(max_abs_diff(e.embeds, c["image_embeds"], &n), kTowerTol);
  }
}

TEST(VisionGolden, TowerReferenceLayoutMatchesNumpy) {
  auto cfg = model::load_config(kModelDir);
  ASSERT_TRUE(cfg.has_value());
  cfg->vision.rope_layout = model::VisionRopeLayout::kReference;
  auto ck = model::Checkpoint::open(kModelDir);
  ASSERT_TRUE(ck.has_value());
  auto tower = model::VisionTower::load(std::make_shared<model::Checkpoint>(std::move(*ck)), *cfg);
  ASSERT_TRUE(tower.has_value()) << tower.error().message;
  const auto g = golden();
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const Encoded e = encode(**tower, c);
    size_t n = 0;
    EXPECT_LE(max_abs_diff(e.hidden, c["reference_tower_hidden"], &n), kTowerTol);
    EXPECT_LE(max_abs_diff(e.embeds, c["reference_image_embeds"], &n), kTowerTol);
    // The two layouts really differ (the test would not notice a layout mix-up otherwise).
    EXPECT_GT(max_abs_diff(e.embeds, c["image_embeds"], &n), 0.05);
  }
}

// Prompt + images through the engine: greedy tokens and their logprobs, prompt logprobs.
TEST(VisionGolden, WholeModelThroughEngine) {
  engine::EngineConfig ec;
  ec.model_dir = kModelDir;
  ec.max_num_seqs = 4;
  ec.max_num_batched_tokens = 64;  // chunked prefill: images split across steps
  ec.block_size = 8;
  auto eng = engine::Engine::create(ec);
  ASSERT_TRUE(eng.has_value()) << eng.error().message;
  ASSERT_TRUE((*eng)->model_info().image_input);
  const auto g = golden();
  const int32_t image_id = g["image_token_index"];
  // Pass 0 with prompt logprobs (kept off the prefix cache), pass 1 caches the pages, pass 2 hits
  // them; pass 3 claims other image content behind the same placeholder ids (another hash): only
  // the blocks before the first image may be reused.
  for (int pass = 0; pass < 4; ++pass) {
    for (const auto& c : g["cases"]) {
      SCOPED_TRACE(c["name"].get<std::string>() + " pass " + std::to_string(pass));
      engine::GenerateRequest req;
      req.prompt_token_ids = c["prompt_ids"].get<std::vector<int32_t>>();
      req.images = model::golden::golden_image_inputs(req.prompt_token_ids, c["images"], image_id,
                                                      pass == 3 ? 1 : 0);
      req.params.temperature = 0.f;
      req.params.max_tokens = static_cast<int>(c["greedy"].size());
      req.params.ignore_eos = true;
      req.params.logprobs = 0;
      if (pass == 0) req.params.prompt_logprobs = 0;
      const int32_t first_image = req.images.front().token_offset;
      const int32_t images_end = req.images.back().token_offset + req.images.back().num_tokens;
      const int64_t encodes_before = (*eng)->stats().image_encodes;
      auto s = (*eng)->submit(std::move(req));
      ASSERT_TRUE(s.has_value()) << s.error().message;
      const model::golden::EngineRun run = model::golden::collect(**s);
      ASSERT_FALSE(run.timed_out);
      const engine::RequestOutput& o = run.last;
      ASSERT_NE(o.finish_reason, "error") << o.error;
      if (pass == 2) {
        EXPECT_GT(o.num_cached_tokens, first_image + 8);
      }
      // The tower runs unless every image position came from the prefix cache.
      const int64_t encodes = (*eng)->stats().image_encodes - encodes_before;
      EXPECT_EQ(encodes, o.num_cached_tokens >= images_end ? 0 : 1);
      if (pass == 3) {
        EXPECT_LE(o.num_cached_tokens, first_image);
      }
      // Greedy tokens up to the first near-tie of the golden's top-2.
      ASSERT_GE(model::golden::compare_greedy(run, c["greedy"]), 0);
      if (pass == 0) model::golden::expect_prompt_logprobs(run, c["prompt_logprobs"]);
    }
  }
}

// A vision_config the checkpoint does not hold (a third encoder layer) fails the load by name and
// points at --language-model-only, which loads the text model alone.
TEST(VisionGolden, MissingTowerTensorsNameTheFix) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("m3_vision_missing_" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::copy_file(kModelDir + "/model.safetensors", dir / "model.safetensors",
                fs::copy_options::overwrite_existing);
  auto cfg = model::golden::read_json(kModelDir + "/config.json");
  cfg["vision_config"]["num_hidden_layers"] = 3;
  std::ofstream(dir / "config.json") << cfg.dump();
  model::LoadOptions lo;
  lo.language_model_only = false;
  auto m = model::M3Model::load(dir.string(), lo);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().message.find("encoder.layers.2"), std::string::npos) << m.error().message;
  EXPECT_NE(m.error().message.find("--language-model-only"), std::string::npos);
  lo.language_model_only = true;
  auto t = model::M3Model::load(dir.string(), lo);
  ASSERT_TRUE(t.has_value()) << t.error().message;
  EXPECT_EQ((*t)->vision(), nullptr);
  fs::remove_all(dir);
}

// Tensor parallel on CPU ranks: the same greedy tokens as transformers; data parallel refuses.
TEST(VisionGolden, TensorParallelRanksTakeImages) {
  const auto g = golden();
  const auto& c = g["cases"][1];  // two images
  for (int dp : {1, 2}) {
    engine::EngineConfig ec;
    ec.model_dir = kModelDir;
    ec.block_size = 8;
    ec.backend_factory = [dp](std::unique_ptr<model::M3Model> m, int64_t pages) {
      return runtime::make_cpu_sharded_backend(std::move(m), pages, dp == 1 ? 2 : 1, false, dp);
    };
    auto eng = engine::Engine::create(ec);
    ASSERT_TRUE(eng.has_value()) << eng.error().message;
    if (dp == 2) {
      EXPECT_FALSE((*eng)->model_info().image_input);
      EXPECT_NE((*eng)->model_info().image_refusal.find("--data-parallel-size"), std::string::npos);
      continue;
    }
    ASSERT_TRUE((*eng)->model_info().image_input);
    engine::GenerateRequest req;
    req.prompt_token_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    req.images = model::golden::golden_image_inputs(req.prompt_token_ids, c["images"],
                                                    g["image_token_index"].get<int32_t>());
    req.params.temperature = 0.f;
    req.params.max_tokens = 4;
    req.params.ignore_eos = true;
    auto s = (*eng)->submit(std::move(req));
    ASSERT_TRUE(s.has_value()) << s.error().message;
    std::vector<int32_t> toks;
    for (;;) {
      auto o = (*s)->next(std::chrono::seconds(60));
      ASSERT_TRUE(o.has_value());
      toks.insert(toks.end(), o->new_token_ids.begin(), o->new_token_ids.end());
      if (o->finished) break;
    }
    for (size_t i = 0; i < toks.size(); ++i) {
      const auto& gr = c["greedy"][i];
      if (gr["top"][0][1].get<double>() - gr["top"][1][1].get<double>() <
          model::golden::kGreedyMarginFloor)
        break;
      EXPECT_EQ(toks[i], gr["token"].get<int32_t>()) << i;
    }
  }
}

// Bad image inputs at the engine's door (the server builds them right; this is the contract).
TEST(VisionGolden, EngineRefusesMismatchedImages) {
  engine::EngineConfig ec;
  ec.model_dir = kModelDir;
  ec.block_size = 8;
  auto eng = engine::Engine::create(ec);
  ASSERT_TRUE(eng.has_value());
  vision::ProcessedImage p = load_golden_image("exact.png");  // 12 tokens
  auto make = [&](int32_t offset, int32_t n_tokens, int32_t n_placeholders) {
    engine::GenerateRequest req;
    req.prompt_token_ids.assign(4, 5);
    req.prompt_token_ids.insert(req.prompt_token_ids.end(), n_placeholders, 2641);
    req.prompt_token_ids.push_back(6);
    engine::ImageInput im;
    im.grid_h = p.grid_h;
    im.grid_w = p.grid_w;
    im.patches = p.pixel_values;
    im.token_offset = offset;
    im.num_tokens = n_tokens;
    req.images.push_back(std::move(im));
    req.params.max_tokens = 1;
    return req;
  };
  EXPECT_TRUE((*eng)->submit(make(4, 12, 12)).has_value());
  for (auto req : {make(4, 11, 12), make(3, 12, 12), make(4, 12, 11), make(10, 12, 12)}) {
    auto r = (*eng)->submit(std::move(req));
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message.find("image 0"), std::string::npos) << r.error().message;
  }
}

}  // namespace
}  // namespace m3
