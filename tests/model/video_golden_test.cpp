// Video input against transformers 5.17 (tests/golden/vision/video.json, made by
// tools/goldens/make_video_goldens.py on the tiny checkpoint of tests/golden/vision/model): the
// server's own preparation (server/media_input.h: file:// fetch, libav decode, frame sampling,
// the video processor, the prompt text with timestamps substituted before tokenizing, the image
// placeholders expanded after) must give MiniMaxM3VLProcessor's prompt ids exactly; then the
// prompts through the engine (images and videos as separate tower calls, the per-frame-pair
// placeholder runs, chunked prefill, the prefix cache keyed by the video's content): prompt
// logprobs and the greedy continuation within the model goldens' tolerance
// (tests/model/model_golden_test.cpp derives kLogprobTol).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "engine/engine.h"
#include "model/engine_golden_util.h"
#include "model/golden_util.h"
#include "server/media_input.h"
#include "text/tokenizer.h"
#include "vision/video_decode.h"

namespace m3 {
namespace {

const std::string kRoot = std::string(M3_SOURCE_DIR) + "/tests/golden/vision";
const std::string kModelDir = kRoot + "/model";

nlohmann::json golden() {
  return model::golden::read_json(kRoot + "/video.json");
}

engine::ModelInfo vision_info() {
  engine::ModelInfo info;
  info.image_input = true;
  info.image_token_id = 2641;
  info.video_token_id = 2642;
  return info;
}

// The server's preparation of a golden case: ids and the media inputs in prompt order.
struct Prepared {
  std::vector<int32_t> ids;
  std::vector<engine::ImageInput> media;
};

Prepared prepare(const nlohmann::json& c, const text::Tokenizer& tok, uint64_t salt) {
  server::MediaConfig cfg;
  cfg.allowed_local_media_path = kRoot;
  std::vector<server::MediaPart> parts;
  for (const auto& m : c["media"]) {
    const std::string kind = m[0], name = m[1];
    const std::string dir = kind == "video" ? "/videos/" : "/images/";
    parts.push_back({kind, "file://" + kRoot + dir + name, "messages[0].content[0]"});
  }
  const engine::ModelInfo info = vision_info();
  Prepared p;
  auto videos = server::prepare_videos(parts, cfg, info, nullptr);
  EXPECT_TRUE(videos.has_value()) << videos.error().message;
  if (!videos) return p;
  std::string prompt = c["rendered"].get<std::string>();
  EXPECT_TRUE(server::expand_video_text(prompt, *videos).has_value());
  p.ids = tok.encode(prompt);
  auto images = server::prepare_images(parts, cfg, info, nullptr);
  EXPECT_TRUE(images.has_value());
  EXPECT_TRUE(server::expand_image_placeholders(p.ids, *images, 2641, {2645}, {2646}).has_value());
  auto st = server::locate_video_tokens(p.ids, *videos, 2642);
  EXPECT_TRUE(st.has_value()) << st.error().message;
  for (auto& im : *images) p.media.push_back(std::move(im));
  for (auto& v : *videos) p.media.push_back(std::move(v.input));
  std::stable_sort(p.media.begin(), p.media.end(),
                   [](const auto& a, const auto& b) { return a.token_offset < b.token_offset; });
  for (auto& m : p.media) m.content_hash += salt;
  return p;
}

TEST(VideoGolden, ServerPreparationGivesTheHfPromptIds) {
  if (!vision::video_decoding_available()) GTEST_SKIP() << "built without libav";
  auto tok = text::Tokenizer::from_file(kModelDir + "/tokenizer.json");
  ASSERT_TRUE(tok.has_value()) << tok.error().message;
  const auto g = golden();
  ASSERT_GE(g["cases"].size(), 2u);
  for (const auto& c : g["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const Prepared p = prepare(c, **tok, 0);
    EXPECT_EQ(p.ids, c["prompt_ids"].get<std::vector<int32_t>>());
    size_t v = 0;
    for (const auto& m : p.media) {
      if (!m.video) continue;
      ASSERT_LT(v, c["video_grid_thw"].size());
      EXPECT_EQ(m.grid_t, c["video_grid_thw"][v][0].get<int64_t>());
      EXPECT_EQ(m.grid_h, c["video_grid_thw"][v][1].get<int64_t>());
      EXPECT_EQ(m.grid_w, c["video_grid_thw"][v][2].get<int64_t>());
      EXPECT_EQ(static_cast<int64_t>(m.group_offsets.size()), m.grid_t);
      ++v;
    }
    EXPECT_EQ(v, c["video_grid_thw"].size());
  }
}

// Pass 0 with prompt logprobs (off the prefix cache), pass 1 caches the pages, pass 2 hits them
// (the tower does not run when every video position is cached), pass 3 claims other content
// behind the same ids (another hash): nothing past the first media block may be reused.
TEST(VideoGolden, WholeModelThroughEngine) {
  if (!vision::video_decoding_available()) GTEST_SKIP() << "built without libav";
  auto tok = text::Tokenizer::from_file(kModelDir + "/tokenizer.json");
  ASSERT_TRUE(tok.has_value());
  engine::EngineConfig ec;
  ec.model_dir = kModelDir;
  ec.max_num_seqs = 4;
  ec.max_num_batched_tokens = 64;  // chunked prefill: the frame pairs split across steps
  ec.block_size = 8;
  auto eng = engine::Engine::create(ec);
  ASSERT_TRUE(eng.has_value()) << eng.error().message;
  ASSERT_TRUE((*eng)->model_info().image_input);
  ASSERT_EQ((*eng)->model_info().video_token_id, 2642);
  const auto g = golden();
  for (int pass = 0; pass < 4; ++pass) {
    for (const auto& c : g["cases"]) {
      SCOPED_TRACE(c["name"].get<std::string>() + " pass " + std::to_string(pass));
      Prepared p = prepare(c, **tok, pass == 3 ? 1 : 0);
      ASSERT_FALSE(p.media.empty());
      engine::GenerateRequest req;
      req.prompt_token_ids = p.ids;
      const int32_t first_media = p.media.front().token_offset;
      const auto last_spans = p.media.back().spans();
      const int32_t media_end = last_spans.back().first + last_spans.back().second;
      req.images = std::move(p.media);
      req.params.temperature = 0.f;
      req.params.max_tokens = static_cast<int>(c["greedy"].size());
      req.params.ignore_eos = true;
      req.params.logprobs = 0;
      if (pass == 0) req.params.prompt_logprobs = 0;
      const int64_t encodes_before = (*eng)->stats().image_encodes;
      auto s = (*eng)->submit(std::move(req));
      ASSERT_TRUE(s.has_value()) << s.error().message;
      const model::golden::EngineRun run = model::golden::collect(**s);
      ASSERT_FALSE(run.timed_out);
      const engine::RequestOutput& o = run.last;
      ASSERT_NE(o.finish_reason, "error") << o.error;
      if (pass == 2) {
        EXPECT_GT(o.num_cached_tokens, first_media + 8);
      }
      const int64_t encodes = (*eng)->stats().image_encodes - encodes_before;
      EXPECT_EQ(encodes, o.num_cached_tokens >= media_end ? 0 : 1);
      if (pass == 3) {
        EXPECT_LE(o.num_cached_tokens, first_media);
      }
      const int compared = model::golden::compare_greedy(run, c["greedy"]);
      ASSERT_GE(compared, 0);
      EXPECT_GE(compared, 4);
      if (pass == 0) model::golden::expect_prompt_logprobs(run, c["prompt_logprobs"]);
    }
  }
}

// A video's placeholder runs at the engine's door: each run must be the video token.
TEST(VideoGolden, EngineRefusesMismatchedVideoRuns) {
  engine::EngineConfig ec;
  ec.model_dir = kModelDir;
  ec.block_size = 8;
  auto eng = engine::Engine::create(ec);
  ASSERT_TRUE(eng.has_value());
  auto make = [](int32_t image_or_video_token, std::vector<int32_t> offsets) {
    engine::GenerateRequest req;
    // 3 text, run of 2, 2 text, run of 2, 1 text.
    req.prompt_token_ids = {5, 5, 5, 2642, 2642, 7, 7, 2642, 2642, 6};
    req.prompt_token_ids[3] = req.prompt_token_ids[4] = image_or_video_token;
    engine::ImageInput im;
    im.video = true;
    im.grid_t = 2;
    im.grid_h = 2;
    im.grid_w = 4;
    im.num_tokens = 4;
    im.patches.assign(2 * 2 * 4 * 1176, 0.f);
    im.group_offsets = std::move(offsets);
    im.token_offset = im.group_offsets.empty() ? 0 : im.group_offsets[0];
    req.images.push_back(std::move(im));
    req.params.max_tokens = 1;
    return req;
  };
  EXPECT_TRUE((*eng)->submit(make(2642, {3, 7})).has_value());
  for (auto req : {make(2641, {3, 7}), make(2642, {3, 6}), make(2642, {3}), make(2642, {7, 3})}) {
    auto r = (*eng)->submit(std::move(req));
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message.find("video 0"), std::string::npos) << r.error().message;
  }
}

}  // namespace
}  // namespace m3
