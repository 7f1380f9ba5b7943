// The video processor against transformers 5.17's MiniMaxM3VLVideoProcessor (goldens made by
// tools/goldens/make_video_goldens.py, tests/golden/vision/video.json): the frames m3serve samples,
// the decoded RGB of those frames (libav here, PyAV there: the test videos are lossless RGB, so
// the bytes must be identical), the resized frames and the float32 pixel values byte for byte
// (tolerance zero, as for images: the same integer resize and fp32 normalisation), the grid and
// the timestamps the HF processor writes. Plus the bad-input refusals of the decoder.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "vision/image_resize.h"
#include "vision/video_decode.h"
#include "vision/video_processor.h"
#include "vision_test_util.h"

namespace m3::vision {
namespace {

const std::string kDir = std::string(M3_SOURCE_DIR) + "/tests/golden/vision";
constexpr int kLossyMaxDiff = 3;
constexpr double kLossyMeanDiff = 0.5;

using test::hex64;
using test::read_file;

nlohmann::json goldens() {
  std::ifstream f(kDir + "/video.json");
  return nlohmann::json::parse(f);
}

FrameSampler sampler(const VideoProcessorConfig& cfg) {
  return [cfg](const VideoHeader& h) -> Result<std::vector<int64_t>> {
    return sample_frame_indices(h.total_frames, h.fps, cfg);
  };
}

TEST(VideoSampling, MatchesHfSampleFrames) {
  const auto g = goldens();
  VideoProcessorConfig cfg;
  for (const auto& [key, want] : g["videos"].items()) {
    SCOPED_TRACE(key);
    EXPECT_EQ(sample_frame_indices(want["total_num_frames"].get<int64_t>(),
                                   want["fps"].get<double>(), cfg),
              want["frames_indices"].get<std::vector<int64_t>>());
  }
  // HF's arithmetic: 25 frames at 7 fps -> int(3.57) = 3, clamped to min_frames 4, step 6.25.
  EXPECT_EQ(sample_frame_indices(25, 7.0, cfg), (std::vector<int64_t>{0, 6, 12, 18}));
  // 300 frames at 30 fps: 10 frames, every 30th.
  auto ten = sample_frame_indices(300, 30.0, cfg);
  ASSERT_EQ(ten.size(), 10u);
  EXPECT_EQ(ten[9], 270);
  // Capped by max_frames; all frames when fewer than min_frames.
  EXPECT_EQ(sample_frame_indices(100000, 1.0, cfg).size(), 768u);
  EXPECT_EQ(sample_frame_indices(3, 30.0, cfg), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(sample_frame_indices(0, 30.0, cfg).empty());
}

TEST(VideoProcessor, MatchesHfProcessorByteForByte) {
  if (!video_decoding_available()) GTEST_SKIP() << "built without libav";
  const auto g = goldens();
  ASSERT_GE(g["videos"].size(), 5u);
  int checked = 0;
  for (const auto& [key, want] : g["videos"].items()) {
    if (want.contains("lossy")) continue;  // LossyCodecIsClose
    SCOPED_TRACE(key);
    VideoProcessorConfig cfg;
    if (want["kwargs"].contains("max_pixels"))
      cfg.frame.max_pixels = want["kwargs"]["max_pixels"].get<int64_t>();
    const auto bytes = read_file(kDir + "/videos/" + want["file"].get<std::string>());
    ASSERT_FALSE(bytes.empty());
    auto v = decode_video(bytes, sampler(cfg), VideoLimits{});
    ASSERT_TRUE(v.has_value()) << v.error().message;
    EXPECT_EQ(v->header.width, want["width"].get<int64_t>());
    EXPECT_EQ(v->header.height, want["height"].get<int64_t>());
    EXPECT_EQ(v->header.total_frames, want["total_num_frames"].get<int64_t>());
    EXPECT_EQ(v->header.fps, want["fps"].get<double>());
    EXPECT_EQ(v->indices, want["frames_indices"].get<std::vector<int64_t>>());
    std::vector<uint8_t> all, all_resized;
    const int64_t rh = want["resized_height"], rw = want["resized_width"];
    for (const auto& f : v->frames) {
      all.insert(all.end(), f.rgb.begin(), f.rgb.end());
      const auto r = resize_bicubic_aa(f.rgb.data(), f.height, f.width, 3, rh, rw);
      all_resized.insert(all_resized.end(), r.begin(), r.end());
    }
    EXPECT_EQ(hex64(all.data(), all.size()), want["frames_xxh64"].get<std::string>())
        << "decoded frames differ from PyAV's rgb24";
    EXPECT_EQ(hex64(all_resized.data(), all_resized.size()),
              want["resized_xxh64"].get<std::string>());
    auto p = preprocess_video(v->frames, v->indices, v->header.fps, cfg);
    ASSERT_TRUE(p.has_value()) << p.error().message;
    EXPECT_EQ(p->pixels.grid_t, want["grid_thw"][0].get<int64_t>());
    EXPECT_EQ(p->pixels.grid_h, want["grid_thw"][1].get<int64_t>());
    EXPECT_EQ(p->pixels.grid_w, want["grid_thw"][2].get<int64_t>());
    EXPECT_EQ(num_image_tokens(p->pixels, 2), want["num_tokens"].get<int64_t>());
    EXPECT_EQ(p->timestamps, want["timestamps"].get<std::vector<std::string>>());
    for (size_t i = 0; i < want["pixel_values_head"].size(); ++i)
      EXPECT_EQ(p->pixels.pixel_values[i], want["pixel_values_head"][i].get<float>()) << i;
    EXPECT_EQ(hex64(p->pixels.pixel_values.data(), p->pixels.pixel_values.size() * sizeof(float)),
              want["pixel_values_xxh64"].get<std::string>())
        << "pixel values differ from the HF video processor's";
    // The server's way: each frame resized as it is decoded, then processed at the source size.
    const FrameMap map = [&](RgbImage f) -> Result<RgbImage> {
      RgbImage r;
      r.height = rh;
      r.width = rw;
      r.rgb = resize_bicubic_aa(f.rgb.data(), f.height, f.width, 3, rh, rw);
      return r;
    };
    auto v2 = decode_video(bytes, sampler(cfg), VideoLimits{}, map);
    ASSERT_TRUE(v2.has_value()) << v2.error().message;
    auto p2 = preprocess_video(v2->frames, v2->indices, v2->header.fps, cfg, v2->header.height,
                               v2->header.width);
    ASSERT_TRUE(p2.has_value()) << p2.error().message;
    EXPECT_EQ(p2->pixels.pixel_values, p->pixels.pixel_values);
    ++checked;
  }
  std::printf("checked %d videos\n", checked);
}

// H.264 (yuv420p): the YUV -> RGB conversion is each side's own swscale build (Debian's libav
// here, PyAV's bundled one there), so the frames are compared for closeness, not bytes: the
// same sampled frames, and per value at most a few levels apart (measured: identical bytes,
// Debian 12's libswscale 6.7 against PyAV 18.1's 9.5, both bilinear; the margin is for other
// builds).
TEST(VideoDecode, LossyCodecIsClose) {
  if (!video_decoding_available()) GTEST_SKIP() << "built without libav";
  const auto g = goldens();
  const auto& want = g["videos"]["h264.mp4"];
  auto v = decode_video(read_file(kDir + "/videos/h264.mp4"), sampler({}), VideoLimits{});
  ASSERT_TRUE(v.has_value()) << v.error().message;
  EXPECT_EQ(v->header.codec, "h264");
  EXPECT_EQ(v->header.total_frames, want["total_num_frames"].get<int64_t>());
  EXPECT_EQ(v->indices, want["frames_indices"].get<std::vector<int64_t>>());
  const auto ref = read_file(kDir + "/videos/h264.rgb");
  std::vector<uint8_t> got;
  for (const auto& f : v->frames) got.insert(got.end(), f.rgb.begin(), f.rgb.end());
  ASSERT_EQ(got.size(), ref.size());
  int worst = 0;
  double sum = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = std::abs(static_cast<int>(got[i]) - static_cast<int>(ref[i]));
    worst = std::max(worst, d);
    sum += d;
  }
  std::printf("h264 vs PyAV: max |diff| %d, mean %.4f levels\n", worst, sum / got.size());
  EXPECT_LE(worst, kLossyMaxDiff);
  EXPECT_LE(sum / got.size(), kLossyMeanDiff);
}

TEST(VideoProcessor, PromptTextIsTheHfExpansion) {
  ProcessedVideo v;
  v.pixels.grid_t = 2;
  v.pixels.grid_h = 4;
  v.pixels.grid_w = 2;
  v.timestamps = {"0.0", "2.5"};
  const std::string s = video_prompt_text(v, 2);
  EXPECT_EQ(s,
            "]<]0.0 seconds[>[]<]start of image[>[]<]video[>[]<]video[>[]<]end of image[>["
            "]<]2.5 seconds[>[]<]start of image[>[]<]video[>[]<]video[>[]<]end of image[>[");
}

TEST(VideoProcessor, RefusesTooManyPixels) {
  VideoProcessorConfig cfg;
  cfg.total_pixels = 3 * 56 * 84;  // 4 frames of 84x56 do not fit
  std::vector<RgbImage> frames(4);
  for (auto& f : frames) {
    f.width = 84;
    f.height = 56;
    f.rgb.assign(84 * 56 * 3, 7);
  }
  auto p = preprocess_video(frames, {0, 1, 2, 3}, 1.0, cfg);
  ASSERT_FALSE(p.has_value());
  EXPECT_NE(p.error().message.find("too large"), std::string::npos) << p.error().message;
}

TEST(VideoDecode, RefusesBadInput) {
  if (!video_decoding_available()) {
    auto r = decode_video(read_file(kDir + "/videos/pair.mov"), sampler({}), VideoLimits{});
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("no video decoding"), std::string::npos);
    GTEST_SKIP() << "built without libav: only the refusal is checked";
  }
  const auto mov = read_file(kDir + "/videos/pair.mov");
  const auto avi = read_file(kDir + "/videos/odd.avi");
  auto refused = [](std::span<const uint8_t> b, const VideoLimits& lim, const char* what) {
    auto r = decode_video(b, sampler({}), lim);
    ASSERT_FALSE(r.has_value()) << what;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument) << what;
    EXPECT_NE(r.error().message.find(what), std::string::npos) << r.error().message;
  };
  refused({}, {}, "empty");
  const auto png = read_file(kDir + "/images/exact.png");
  refused(png, {}, "not a video file");  // an image is not a container we read
  const std::string junk(4096, 'x');
  refused({reinterpret_cast<const uint8_t*>(junk.data()), junk.size()}, {}, "not a video file");
  // A playlist would make the demuxer open other URLs: never read.
  const std::string m3u8 = "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n";
  refused({reinterpret_cast<const uint8_t*>(m3u8.data()), m3u8.size()}, {}, "not a video file");
  // Truncated: the header promises frames the data no longer holds.
  refused(std::span(mov).first(mov.size() * 2 / 3), {}, "truncated");
  refused(std::span(avi).first(avi.size() / 2), {}, "truncated");
  VideoLimits small;
  small.max_frame_pixels = 84 * 56 - 1;
  refused(mov, small, "over the decoder limit");
  VideoLimits few;
  few.max_decoded_frames = 5;
  refused(mov, few, "over the limit of 5");
  VideoLimits slow;
  slow.max_seconds = 1e-9;  // over before the first frame
  refused(mov, slow, "decoding the video took over 1e-09 s (the limit VLLM_VIDEO_FETCH_TIMEOUT");
  // A codec libavcodec does not know: the AVI's FourCC renamed.
  auto unknown = avi;
  for (size_t i = 0; i + 4 <= unknown.size(); ++i)
    if (std::memcmp(unknown.data() + i, "FFV1", 4) == 0) std::memcpy(unknown.data() + i, "ZQ9X", 4);
  refused(unknown, {}, "unsupported video codec");
}

TEST(VideoDecode, SurvivesMutatedFiles) {
  if (!video_decoding_available()) GTEST_SKIP() << "built without libav";
  // Flipped bytes and cuts anywhere: an Error or a video, never a crash.
  for (const char* name : {"pair.mov", "odd.avi"}) {
    const auto base = read_file(kDir + "/videos/" + name);
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    int ok = 0, refused = 0;
    for (int i = 0; i < 60; ++i) {
      auto b = base;
      for (int k = 0; k < 1 + i % 8; ++k) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        b[(s >> 17) % b.size()] ^= static_cast<uint8_t>(1u << ((s >> 7) % 8));
      }
      if (i % 3 == 0) b.resize((s >> 11) % b.size());
      auto r = decode_video(b, sampler({}), VideoLimits{});
      (r.has_value() ? ok : refused)++;
      if (r) {
        EXPECT_EQ(r->frames.size(), r->indices.size());
      }
    }
    std::printf("%s: %d decoded, %d refused\n", name, ok, refused);
  }
}

}  // namespace
}  // namespace m3::vision
