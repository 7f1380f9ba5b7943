// server/media_input.h: base64, URL handling and its refusals, the processed-image LRU, the
// placeholder expansion (the HF processor's "]<]start of image[>[" + N x image + end).
#include <gtest/gtest.h>

#include <fstream>

#include "server/media_input.h"

namespace m3::server {
namespace {

TEST(MediaInput, Base64IsStrict) {
  auto d = base64_decode("aGVsbG8=");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(std::string(d->begin(), d->end()), "hello");
  EXPECT_EQ(base64_decode("aGVsbG8h")->size(), 6u);
  EXPECT_FALSE(base64_decode("aGVsbG8").has_value());    // not a multiple of 4
  EXPECT_FALSE(base64_decode("aGV sbG8=").has_value());  // space
  EXPECT_FALSE(base64_decode("aGVs*G8=").has_value());
}

TEST(MediaInput, UrlsAndTheirRefusals) {
  MediaConfig cfg;
  auto err = [&](const std::string& url) {
    auto r = fetch_media_bytes(MediaPart{"image", url, "messages[0].content[2]"}, cfg);
    EXPECT_FALSE(r.has_value()) << url;
    if (r) return std::string();
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_EQ(r.error().param, "messages[0].content[2]");
    EXPECT_EQ(r.error().message.rfind("messages[0].content[2]: ", 0), 0u) << r.error().message;
    return r.error().message;
  };
  EXPECT_NE(err("http://x/a.png").find("not fetched"), std::string::npos);
  EXPECT_NE(err("https://x/a.png").find("data: URL"), std::string::npos);
  EXPECT_NE(err("data:image/png,abc").find("not base64"), std::string::npos);
  EXPECT_NE(err("data:image/png;base64").find("','"), std::string::npos);
  EXPECT_NE(err("data:image/png;base64,!!!!").find("not valid base64"), std::string::npos);
  EXPECT_NE(err("ftp://x").find("unsupported"), std::string::npos);
  EXPECT_NE(err("file:///etc/hostname").find("--allowed-local-media-path DIR"), std::string::npos);
  const std::string dir = std::string(M3_SOURCE_DIR) + "/tests/golden/vision/images";
  cfg.allowed_local_media_path = dir;
  EXPECT_NE(err("file:///etc/hostname").find("outside"), std::string::npos);
  EXPECT_NE(err("file://" + dir + "/../processor.json").find("outside"), std::string::npos);
  EXPECT_NE(err("file://" + dir + "/missing.png").find("cannot open"), std::string::npos);
  auto ok = fetch_media_bytes(MediaPart{"image", "file://" + dir + "/exact.png", "p"}, cfg);
  ASSERT_TRUE(ok.has_value()) << ok.error().message;
  EXPECT_GT(ok->size(), 100u);
  auto d = fetch_media_bytes(MediaPart{"image", "data:image/png;base64,aGVsbG8=", "p"}, cfg);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->size(), 5u);
}

TEST(MediaInput, LimitsAndAvailability) {
  MediaConfig cfg;
  cfg.max_images_per_prompt = 2;
  engine::ModelInfo info;
  info.image_input = true;
  std::vector<MediaPart> parts(3, MediaPart{"image", "data:,", "messages[0].content[0]"});
  auto r = check_media_parts(parts, cfg, info);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("--limit-mm-per-prompt"), std::string::npos);
  parts.resize(2);
  EXPECT_TRUE(check_media_parts(parts, cfg, info).has_value());
  info.image_input = false;
  info.image_refusal = "no tower";
  r = check_media_parts(parts, cfg, info);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("no tower"), std::string::npos);
  parts = {MediaPart{"video", "data:,", "messages[1].content[0]"}};
  r = check_media_parts(parts, cfg, info);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().param, "messages[1].content[0]");
}

TEST(MediaInput, VideoLimits) {
  MediaConfig cfg;
  cfg.max_videos_per_prompt = 1;
  engine::ModelInfo info;
  info.image_input = true;
  std::vector<MediaPart> parts = {MediaPart{"video", "data:,", "messages[0].content[0]"},
                                  MediaPart{"video", "data:,", "messages[0].content[1]"}};
  auto r = check_media_parts(parts, cfg, info);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().param, vision::video_decoding_available() ? "messages[0].content[1]"
                                                                : "messages[0].content[0]");
  EXPECT_NE(r.error().message.find(vision::video_decoding_available() ? "--limit-mm-per-prompt"
                                                                      : "no video decoding"),
            std::string::npos)
      << r.error().message;
  parts.resize(1);
  EXPECT_EQ(check_media_parts(parts, cfg, info).has_value(), vision::video_decoding_available());
  cfg.max_videos_per_prompt = 0;
  EXPECT_FALSE(check_media_parts(parts, cfg, info).has_value());
}

TEST(MediaInput, VideoTextAndTokens) {
  std::vector<PreparedVideo> v(2);
  v[0].prompt_text = "<A>";
  v[1].prompt_text = "<B>";
  std::string p = "x]<]video[>[y]<]video[>[z";
  ASSERT_TRUE(expand_video_text(p, v).has_value());
  EXPECT_EQ(p, "x<A>y<B>z");
  std::string one = "]<]video[>[";
  auto r = expand_video_text(one, v);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().message.find("1 video placeholders for 2"), std::string::npos);
  // Video 0: two frame pairs of 2 tokens, video 1: one pair of 3; 9 is the placeholder.
  v[0].input.video = v[1].input.video = true;
  v[0].input.grid_t = 2;
  v[0].input.num_tokens = 4;
  v[1].input.grid_t = 1;
  v[1].input.num_tokens = 3;
  std::vector<int32_t> ids = {1, 9, 9, 2, 9, 9, 3, 9, 9, 9, 4};
  ASSERT_TRUE(locate_video_tokens(ids, v, 9).has_value());
  EXPECT_EQ(v[0].input.group_offsets, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(v[0].input.token_offset, 1);
  EXPECT_EQ(v[1].input.group_offsets, (std::vector<int32_t>{7}));
  EXPECT_EQ(v[0].input.spans(), (std::vector<std::pair<int32_t, int32_t>>{{1, 2}, {4, 2}}));
  std::vector<int32_t> extra = ids;
  extra.push_back(9);  // the placeholder also typed as text
  EXPECT_FALSE(locate_video_tokens(extra, v, 9).has_value());
  std::vector<int32_t> short_run = {1, 9, 2, 9, 9, 3, 9, 9, 9};
  EXPECT_FALSE(locate_video_tokens(short_run, v, 9).has_value());
}

TEST(MediaInput, CacheIsAnLruBoundedByBytes) {
  auto img = [](size_t floats) {
    auto p = std::make_shared<ProcessedMedia>();
    p->pixels.pixel_values.resize(floats);
    return std::shared_ptr<const ProcessedMedia>(p);
  };
  MediaCache c(1000 * sizeof(float));
  c.put(1, 1, img(400));
  c.put(2, 2, img(400));
  EXPECT_NE(c.get(1, 1), nullptr);  // 1 is now the most recent
  c.put(3, 3, img(400));            // evicts 2
  EXPECT_EQ(c.get(2, 2), nullptr);
  EXPECT_NE(c.get(1, 1), nullptr);
  EXPECT_NE(c.get(3, 3), nullptr);
  EXPECT_EQ(c.get(3, 4), nullptr);  // both halves of the hash are the key
  EXPECT_EQ(c.bytes(), static_cast<int64_t>(800 * sizeof(float)));
  c.put(4, 4, img(2000));  // larger than the whole cache: not kept
  EXPECT_EQ(c.get(4, 4), nullptr);
  EXPECT_EQ(c.hits(), 3);
}

TEST(MediaInput, ExpandsPlaceholders) {
  std::vector<engine::ImageInput> imgs(2);
  imgs[0].num_tokens = 3;
  imgs[1].num_tokens = 1;
  std::vector<int32_t> ids = {5, 9, 6, 9, 7};
  ASSERT_TRUE(expand_image_placeholders(ids, imgs, 9, {100}, {101}).has_value());
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 100, 9, 9, 9, 101, 6, 100, 9, 101, 7}));
  EXPECT_EQ(imgs[0].token_offset, 2);
  EXPECT_EQ(imgs[1].token_offset, 8);
  std::vector<int32_t> ids2 = {9, 9};
  std::vector<engine::ImageInput> one(1);
  one[0].num_tokens = 2;
  auto r = expand_image_placeholders(ids2, one, 9, {}, {});
  ASSERT_FALSE(r.has_value());  // two placeholders for one image
  EXPECT_NE(r.error().message.find("2 image placeholders for 1"), std::string::npos);
  std::vector<int32_t> ids3 = {1, 9, 2};
  ASSERT_TRUE(expand_image_placeholders(ids3, one, 9, {40, 41}, {}).has_value());
  EXPECT_EQ(ids3, (std::vector<int32_t>{1, 40, 41, 9, 9, 2}));
  EXPECT_EQ(one[0].token_offset, 3);
}

TEST(MediaInput, PreparesImagesThroughTheCache) {
  MediaConfig cfg;
  engine::ModelInfo info;
  info.image_input = true;
  MediaCache cache(int64_t{1} << 30);
  std::ifstream f(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/images/exact.png",
                  std::ios::binary);
  std::string raw{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  static const char* kAlpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string b64;
  for (size_t i = 0; i < raw.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(raw[i]) << 16;
    if (i + 1 < raw.size()) v |= static_cast<uint8_t>(raw[i + 1]) << 8;
    if (i + 2 < raw.size()) v |= static_cast<uint8_t>(raw[i + 2]);
    b64 += kAlpha[(v >> 18) & 63];
    b64 += kAlpha[(v >> 12) & 63];
    b64 += i + 1 < raw.size() ? kAlpha[(v >> 6) & 63] : '=';
    b64 += i + 2 < raw.size() ? kAlpha[v & 63] : '=';
  }
  std::vector<MediaPart> parts(2, MediaPart{"image", "data:image/png;base64," + b64, "p"});
  auto r = prepare_images(parts, cfg, info, &cache);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].grid_h, 6);  // 84 px high
  EXPECT_EQ((*r)[0].grid_w, 8);  // 112 px wide
  EXPECT_EQ((*r)[0].num_tokens, 12);
  EXPECT_EQ((*r)[0].patches.size(), 48u * 1176u);
  EXPECT_EQ((*r)[0].content_hash, (*r)[1].content_hash);
  EXPECT_EQ((*r)[0].patches, (*r)[1].patches);
  EXPECT_EQ(cache.hits(), 1);  // the second part came from the cache

  // A smaller pixel budget (--mm-processor-kwargs '{"min_pixels": 784, "max_pixels": 3136}'):
  // smart_resize brings 112x84 within 3136 pixels in multiples of 28 (56x28), so fewer tokens.
  MediaConfig small = cfg;
  small.image.min_pixels = 784;
  small.image.max_pixels = 3136;
  auto s = prepare_images({parts[0]}, small, info, nullptr);
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ((*s)[0].grid_h, 2);
  EXPECT_EQ((*s)[0].grid_w, 4);
  EXPECT_EQ((*s)[0].num_tokens, 2);
}

}  // namespace
}  // namespace m3::server

namespace m3::server {
namespace {

// prepare_videos' limits, each a 400 naming the part: the sampled-pixel budget (checked from the
// header, before decoding), the decoder's frame-pixel limit, the frame count; the cache keys
// videos apart from images.
TEST(MediaInput, PreparesVideosWithinTheirLimits) {
  if (!vision::video_decoding_available()) GTEST_SKIP() << "built without libav";
  const std::string dir = std::string(M3_SOURCE_DIR) + "/tests/golden/vision/videos";
  engine::ModelInfo info;
  info.image_input = true;
  std::vector<MediaPart> parts = {MediaPart{"video", "file://" + dir + "/pair.mov", "m[0].c[3]"}};
  auto refused = [&](const MediaConfig& cfg, const char* what) {
    auto r = prepare_videos(parts, cfg, info, nullptr);
    ASSERT_FALSE(r.has_value()) << what;
    EXPECT_EQ(r.error().param, "m[0].c[3]");
    EXPECT_NE(r.error().message.find(what), std::string::npos) << r.error().message;
  };
  MediaConfig cfg;
  cfg.allowed_local_media_path = dir;
  cfg.video.total_pixels = 6 * 84 * 56 - 1;  // pair.mov samples 6 frames of 84x56
  refused(cfg, "too large");
  cfg = MediaConfig{};
  cfg.allowed_local_media_path = dir;
  cfg.max_image_pixels = 1000;
  refused(cfg, "over the decoder limit");
  cfg = MediaConfig{};
  cfg.allowed_local_media_path = dir;
  cfg.max_video_frames = 11;
  refused(cfg, "over the limit of 11");
  cfg = MediaConfig{};
  cfg.allowed_local_media_path = dir;
  MediaCache cache(int64_t{1} << 30);
  auto a = prepare_videos(parts, cfg, info, &cache);
  ASSERT_TRUE(a.has_value()) << a.error().message;
  ASSERT_EQ(a->size(), 1u);
  EXPECT_TRUE((*a)[0].input.video);
  EXPECT_EQ((*a)[0].input.grid_t, 3);
  EXPECT_EQ((*a)[0].input.num_tokens, 18);
  EXPECT_NE((*a)[0].prompt_text.find("]<]4.0 seconds[>["), std::string::npos);
  auto b = prepare_videos(parts, cfg, info, &cache);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ((*b)[0].input.patches, (*a)[0].input.patches);
  EXPECT_EQ((*b)[0].prompt_text, (*a)[0].prompt_text);
}

}  // namespace
}  // namespace m3::server
