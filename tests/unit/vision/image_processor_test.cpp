// The image processor against transformers 5.17's MiniMaxM3VLImageProcessor (goldens made by
// tools/goldens/make_vision_goldens.py): decoded RGB, the resized uint8 image and the float32
// pixel values must be byte-identical (hashes of the bytes), so the tolerance is zero: the
// decoder is the same libjpeg-turbo/libpng/libwebp family as PIL's, the resize is ATen's integer
// algorithm and the normalisation the same fp32 expression. Plus the bad-input refusals.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "vision/image_decode.h"
#include "vision/image_processor.h"
#include "vision/image_resize.h"
#include "vision_test_util.h"

namespace m3::vision {
namespace {

// $M3_VISION_GOLDEN_DIR: another processor.json + images/ (make_vision_goldens.py --fuzz N).
const std::string kDir = std::getenv("M3_VISION_GOLDEN_DIR") != nullptr
                             ? std::string(std::getenv("M3_VISION_GOLDEN_DIR"))
                             : std::string(M3_SOURCE_DIR) + "/tests/golden/vision";

using test::hex64;
using test::read_file;

nlohmann::json goldens() {
  std::ifstream f(kDir + "/processor.json");
  return nlohmann::json::parse(f);
}

// tools/goldens/make_decoder_images.py: JPEG EXIF orientation (the same picture tagged 1..8
// decodes upright, byte for byte as PIL's ImageOps.exif_transpose gives it), a CMYK JPEG and GIFs
// (as PIL's convert("RGB") of frame 0). A build without giflib refuses the GIFs by name.
TEST(ImageProcessor, DecoderMatchesPilOnExifCmykAndGif) {
  std::ifstream f(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/decoder.json");
  const auto g = nlohmann::json::parse(f);
  ASSERT_EQ(g["images"].size(), 14u);
  for (const auto& [name, want] : g["images"].items()) {
    SCOPED_TRACE(name);
    if (name.rfind("gif_", 0) == 0 && !gif_decoding_available()) {
      auto r = decode_image(
          read_file(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/images/" + name), 1 << 26);
      ASSERT_FALSE(r.has_value());
      EXPECT_NE(r.error().message.find("giflib"), std::string::npos);
      continue;
    }
    const auto bytes =
        read_file(std::string(M3_SOURCE_DIR) + "/tests/golden/vision/images/" + name);
    ASSERT_FALSE(bytes.empty());
    auto img = decode_image(bytes, 1 << 26);
    ASSERT_TRUE(img.has_value()) << img.error().message;
    EXPECT_EQ(img->width, want["width"].get<int64_t>());
    EXPECT_EQ(img->height, want["height"].get<int64_t>());
    EXPECT_EQ(hex64(img->rgb.data(), img->rgb.size()), want["rgb_xxh64"].get<std::string>());
  }
  // Payloads that are not an orientation leave the image as stored.
  const uint8_t not_exif[] = {'J', 'F', 'I', 'F', 0, 0, 'I', 'I', 42, 0, 8, 0, 0, 0};
  EXPECT_EQ(exif_orientation(not_exif), 1);
  const uint8_t truncated[] = {'E', 'x', 'i', 'f', 0, 0, 'M', 'M', 0, 42, 0, 0, 0, 8, 0, 5};
  EXPECT_EQ(exif_orientation(truncated), 1);  // 5 entries promised, none present
  // Big-endian TIFF, Orientation = 6.
  const uint8_t be6[] = {'E',  'x',  'i', 'f', 0, 0, 'M', 'M', 0, 42, 0, 0, 0, 8, 0, 1,
                         0x01, 0x12, 0,   3,   0, 0, 0,   1,   0, 6,  0, 0, 0, 0, 0, 0};
  EXPECT_EQ(exif_orientation(be6), 6);
}

TEST(ImageProcessor, MatchesHfProcessorByteForByte) {
  const auto g = goldens();
  ASSERT_GE(g["images"].size(), std::getenv("M3_VISION_GOLDEN_DIR") ? 1u : 8u);
  int checked = 0;
  for (const auto& [name, want] : g["images"].items()) {
    SCOPED_TRACE(name);
    const auto bytes = read_file(kDir + "/images/" + name);
    ASSERT_FALSE(bytes.empty());
    auto img = decode_image(bytes, 1 << 26);
    ASSERT_TRUE(img.has_value()) << img.error().message;
    EXPECT_EQ(img->width, want["width"].get<int64_t>());
    EXPECT_EQ(img->height, want["height"].get<int64_t>());
    EXPECT_EQ(hex64(img->rgb.data(), img->rgb.size()), want["rgb_xxh64"].get<std::string>())
        << "decoded RGB differs from PIL's convert(\"RGB\")";
    const int64_t rh = want["resized_height"], rw = want["resized_width"];
    const auto resized = resize_bicubic_aa(img->rgb.data(), img->height, img->width, 3, rh, rw);
    EXPECT_EQ(hex64(resized.data(), resized.size()), want["resized_xxh64"].get<std::string>())
        << "resized image differs from torchvision's BICUBIC antialias resize";
    auto p = preprocess_image(*img, ProcessorConfig{});
    ASSERT_TRUE(p.has_value()) << p.error().message;
    EXPECT_EQ(p->resized_h, rh);
    EXPECT_EQ(p->resized_w, rw);
    EXPECT_EQ(p->grid_t, want["grid_thw"][0].get<int64_t>());
    EXPECT_EQ(p->grid_h, want["grid_thw"][1].get<int64_t>());
    EXPECT_EQ(p->grid_w, want["grid_thw"][2].get<int64_t>());
    EXPECT_EQ(num_image_tokens(*p, 2), want["num_tokens"].get<int64_t>());
    ASSERT_EQ(p->row_size, 1176);
    for (size_t i = 0; i < want["pixel_values_head"].size(); ++i)
      EXPECT_EQ(p->pixel_values[i], want["pixel_values_head"][i].get<float>()) << "value " << i;
    EXPECT_EQ(hex64(p->pixel_values.data(), p->pixel_values.size() * sizeof(float)),
              want["pixel_values_xxh64"].get<std::string>())
        << "pixel values differ from the HF processor's";
    ++checked;
  }
  std::printf("checked %d images\n", checked);
}

TEST(ImageProcessor, SmartResizeEdges) {
  // Python round() is half-to-even: 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2.
  // (Values from transformers 5.17's smart_resize.)
  EXPECT_EQ(*smart_resize(42, 70, 28, 3136, 451584), std::make_pair(int64_t{56}, int64_t{56}));
  // Below min_pixels: both sides scaled up by ceil.
  EXPECT_EQ(*smart_resize(14, 28, 28, 3136, 451584), std::make_pair(int64_t{56}, int64_t{84}));
  EXPECT_EQ(*smart_resize(5, 900, 28, 3136, 451584), std::make_pair(int64_t{28}, int64_t{756}));
  // 672x672 exactly fits; 673x673 is scaled down by floor.
  EXPECT_EQ(*smart_resize(672, 672, 28, 3136, 451584), std::make_pair(int64_t{672}, int64_t{672}));
  EXPECT_EQ(*smart_resize(1000, 1000, 28, 3136, 451584),
            std::make_pair(int64_t{672}, int64_t{672}));
  auto bad = smart_resize(10, 2100, 28, 3136, 451584);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message.find("aspect ratio"), std::string::npos);
}

TEST(ImageDecode, RefusesBadInput) {
  const auto png = read_file(kDir + "/images/exact.png");
  const auto jpg = read_file(kDir + "/images/photo.jpg");
  const auto webp = read_file(kDir + "/images/lossy.webp");
  auto expect_refused = [](std::span<const uint8_t> b, int64_t max_px, const char* what) {
    auto r = decode_image(b, max_px);
    ASSERT_FALSE(r.has_value()) << what;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument) << what;
    EXPECT_NE(r.error().message.find(what), std::string::npos) << r.error().message;
  };
  expect_refused({}, 1 << 20, "empty");
  const std::string bmp = "BM\x3a\x00\x00\x00\x00\x00\x00\x00\x36\x00\x00\x00";
  expect_refused({reinterpret_cast<const uint8_t*>(bmp.data()), bmp.size()}, 1 << 20,
                 "unsupported image format");
  // A GIF cut inside its header: corrupt (or, without giflib, refused naming it).
  const std::string gif = "GIF89a\x01\x00\x01\x00";
  expect_refused({reinterpret_cast<const uint8_t*>(gif.data()), gif.size()}, 1 << 20,
                 gif_decoding_available() ? "corrupt GIF" : "giflib");
  expect_refused(std::span(png).first(png.size() / 2), 1 << 20, "PNG");
  expect_refused(std::span(jpg).first(jpg.size() / 2), 1 << 22, "JPEG");
  expect_refused(std::span(webp).first(webp.size() / 2), 1 << 20, "WebP");
  // The pixel limit is checked from the header, before decoding.
  expect_refused(png, 100 * 80, "over the decoder's limit");
  expect_refused(jpg, 1000, "over the decoder's limit");
  expect_refused(webp, 1000, "over the decoder's limit");
  // Corrupt bytes inside a valid header.
  std::vector<uint8_t> broken = png;
  for (size_t i = 60; i < broken.size(); i += 7) broken[i] ^= 0x5a;
  expect_refused(broken, 1 << 20, "PNG");
}

// Mutated files (byte flips, truncation, inserted junk; fixed seed) through the decoders and the
// processor: each gives an image or an Error, never a crash or a hang.
TEST(ImageDecode, SurvivesMutatedFiles) {
  uint64_t x = 0x5eed;
  auto rnd = [&](uint64_t n) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return n == 0 ? 0 : x % n;
  };
  int decoded = 0, refused = 0;
  for (const char* name : {"exact.png", "gray.jpg", "lossy.webp", "lossless.webp", "palette.png",
                           "gray.png", "grad_small.png", "gif_interlaced.gif", "gif_anim.gif"}) {
    const auto orig = read_file(kDir + "/images/" + name);
    for (int it = 0; it < 120; ++it) {
      std::vector<uint8_t> b = orig;
      switch (it % 3) {
        case 0:
          for (int k = 0; k < 1 + static_cast<int>(rnd(8)); ++k) b[rnd(b.size())] ^= 1u << rnd(8);
          break;
        case 1:
          b.resize(rnd(b.size()));
          break;
        default: {
          const size_t at = rnd(b.size());
          for (int k = 0; k < 1 + static_cast<int>(rnd(64)); ++k)
            b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rnd(256)));
        }
      }
      auto img = decode_image(b, 1 << 22);
      if (!img) {
        ++refused;
        EXPECT_EQ(img.error().code, ErrorCode::kInvalidArgument);
        continue;
      }
      ++decoded;
      ASSERT_EQ(img->rgb.size(), static_cast<size_t>(img->width * img->height * 3));
      auto p = preprocess_image(*img, ProcessorConfig{});
      if (p) {
        EXPECT_EQ(p->pixel_values.size(), static_cast<size_t>(p->num_patches() * 1176));
      }
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(decoded, 10);  // flips inside pixel data still decode
}

}  // namespace
}  // namespace m3::vision
