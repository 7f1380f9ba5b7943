#include "vision/image_processor.h"

#include <cmath>
#include <string>

#include "vision/image_resize.h"

namespace m3::vision {

Result<std::pair<int64_t, int64_t>> smart_resize(int64_t height, int64_t width, int64_t factor,
                                                 int64_t min_pixels, int64_t max_pixels) {
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  const double ratio = std::max(h, w) / std::min(h, w);
  if (ratio > 200.0) {
    return make_error(ErrorCode::kInvalidArgument, "image aspect ratio " + std::to_string(ratio) +
                                                       " is over 200 (" + std::to_string(width) +
                                                       "x" + std::to_string(height) +
                                                       "); crop or pad the image");
  }
  const double f = static_cast<double>(factor);
  // Python's round(): half to even, which is nearbyint under the default rounding mode.
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(h * w / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (h * w));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return std::make_pair(h_bar, w_bar);
}

void write_patch_rows(std::span<const uint8_t* const> frames, int64_t rh, int64_t rw,
                      const ProcessorConfig& cfg, float* dst) {
  const int64_t ps = cfg.patch_size, ms = cfg.merge_size, tp = cfg.temporal_patch_size;
  // The processor's fused rescale + normalise: fp32 mean*255 and std*255, then (x - m) / s.
  static constexpr float kMean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
  static constexpr float kStd[3] = {0.26862954f, 0.26130258f, 0.27577711f};
  float m[3], s[3];
  for (int c = 0; c < 3; ++c) {
    m[c] = kMean[c] * 255.0f;
    s[c] = kStd[c] * 255.0f;
  }
  const int64_t gh = rh / ps, gw = rw / ps;
  const int64_t gt = static_cast<int64_t>(frames.size()) / tp;
  // Rows in merge-window order: (temporal group, block row, block col, row in window, col in
  // window); inside a row (channel, frame of the group, y, x).
  for (int64_t g = 0; g < gt; ++g)
    for (int64_t bh = 0; bh < gh / ms; ++bh)
      for (int64_t bw = 0; bw < gw / ms; ++bw)
        for (int64_t mh = 0; mh < ms; ++mh)
          for (int64_t mw = 0; mw < ms; ++mw) {
            const int64_t y0 = (bh * ms + mh) * ps, x0 = (bw * ms + mw) * ps;
            for (int c = 0; c < 3; ++c)
              for (int64_t t = 0; t < tp; ++t) {
                const uint8_t* px = frames[static_cast<size_t>(g * tp + t)];
                for (int64_t py = 0; py < ps; ++py)
                  for (int64_t pxi = 0; pxi < ps; ++pxi) {
                    const uint8_t v = px[((y0 + py) * rw + x0 + pxi) * 3 + c];
                    *dst++ = (static_cast<float>(v) - m[c]) / s[c];
                  }
              }
          }
}

Result<ProcessedImage> preprocess_image(const RgbImage& img, const ProcessorConfig& cfg) {
  const int64_t ps = cfg.patch_size, ms = cfg.merge_size, tp = cfg.temporal_patch_size;
  M3_TRY(auto size, smart_resize(img.height, img.width, ps * ms, cfg.min_pixels, cfg.max_pixels));
  const auto [rh, rw] = size;
  if (rh < ps * ms || rw < ps * ms) {
    return make_error(ErrorCode::kInvalidArgument,
                      "image of " + std::to_string(img.width) + "x" + std::to_string(img.height) +
                          " resizes to no patches; send a larger image");
  }
  const std::vector<uint8_t> px =
      resize_bicubic_aa(img.rgb.data(), img.height, img.width, 3, rh, rw);
  ProcessedImage out;
  out.resized_h = rh;
  out.resized_w = rw;
  out.grid_t = 1;
  out.grid_h = rh / ps;
  out.grid_w = rw / ps;
  out.row_size = 3 * tp * ps * ps;
  out.pixel_values.resize(static_cast<size_t>(out.num_patches() * out.row_size));
  // Every frame of the temporal patch is the same image.
  const std::vector<const uint8_t*> frames(static_cast<size_t>(tp), px.data());
  write_patch_rows(frames, rh, rw, cfg, out.pixel_values.data());
  return out;
}

}  // namespace m3::vision
