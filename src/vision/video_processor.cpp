#include "vision/video_processor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "vision/image_resize.h"

namespace m3::vision {

std::vector<int64_t> sample_frame_indices(int64_t total, double video_fps,
                                          const VideoProcessorConfig& cfg) {
  std::vector<int64_t> out;
  if (total <= 0 || !(video_fps > 0)) return out;
  // int(total / fps * target): Python's float arithmetic, truncated toward zero.
  const double want = static_cast<double>(total) / video_fps * cfg.fps;
  int64_t n = want >= 9.0e18 ? cfg.max_frames : static_cast<int64_t>(want);
  n = std::clamp(n, cfg.min_frames, cfg.max_frames);
  n = std::clamp<int64_t>(n, 1, total);
  // torch.arange(0, total, step).int(): the length ceil(total / step) in double, each value
  // start + step * i in double, stored as float32, then truncated to int32.
  const double step = static_cast<double>(total) / static_cast<double>(n);
  const int64_t len = static_cast<int64_t>(std::ceil(static_cast<double>(total) / step));
  out.reserve(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) {
    const float v = static_cast<float>(step * static_cast<double>(i));
    out.push_back(std::min<int64_t>(static_cast<int64_t>(v), total - 1));
  }
  return out;
}

Result<std::pair<int64_t, int64_t>> video_frame_size(int64_t h, int64_t w,
                                                     const VideoProcessorConfig& cfg) {
  const ProcessorConfig& pc = cfg.frame;
  const int64_t f = pc.patch_size * pc.merge_size;
  M3_TRY(auto size, smart_resize(h, w, f, pc.min_pixels, pc.max_pixels));
  if (size.first < f || size.second < f) {
    return make_error(ErrorCode::kInvalidArgument,
                      "video frames of " + std::to_string(w) + "x" + std::to_string(h) +
                          " resize to no patches; send a larger video");
  }
  return size;
}

Status check_video_budget(int64_t frames, int64_t rh, int64_t rw, const VideoProcessorConfig& cfg) {
  const int64_t tp = cfg.frame.temporal_patch_size;
  const int64_t padded = (frames + tp - 1) / tp * tp;
  if (padded * rh * rw > cfg.total_pixels) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the video is too large: " + std::to_string(frames) + " sampled frames of " +
                          std::to_string(rw) + "x" + std::to_string(rh) + " = " +
                          std::to_string(padded * rh * rw) + " pixels, over the limit of " +
                          std::to_string(cfg.total_pixels) + "; send a shorter or smaller clip");
  }
  return {};
}

Result<ProcessedVideo> preprocess_video(const std::vector<RgbImage>& frames,
                                        const std::vector<int64_t>& indices, double video_fps,
                                        const VideoProcessorConfig& cfg, int64_t src_h,
                                        int64_t src_w) {
  const ProcessorConfig& pc = cfg.frame;
  const int64_t ps = pc.patch_size, tp = pc.temporal_patch_size;
  if (frames.empty() || frames.size() != indices.size())
    return make_error(ErrorCode::kInvalidArgument, "the video has no sampled frames");
  const int64_t h = src_h > 0 ? src_h : frames[0].height;
  const int64_t w = src_w > 0 ? src_w : frames[0].width;
  M3_TRY(auto size, video_frame_size(h, w, cfg));
  const auto [rh, rw] = size;
  const int64_t nf = static_cast<int64_t>(frames.size());
  const int64_t padded = (nf + tp - 1) / tp * tp;
  M3_TRY_STATUS(check_video_budget(nf, rh, rw, cfg));
  std::vector<std::vector<uint8_t>> resized(static_cast<size_t>(nf));
  std::vector<const uint8_t*> ptrs;
  for (int64_t i = 0; i < nf; ++i) {
    const RgbImage& f = frames[static_cast<size_t>(i)];
    if (f.height == rh && f.width == rw) {
      ptrs.push_back(f.rgb.data());  // already resized (or needing none: the resize is a copy)
    } else if (f.height == h && f.width == w) {
      resized[static_cast<size_t>(i)] = resize_bicubic_aa(f.rgb.data(), h, w, 3, rh, rw);
      ptrs.push_back(resized[static_cast<size_t>(i)].data());
    } else {
      return make_error(ErrorCode::kInvalidArgument, "the video's frames differ in size");
    }
  }
  while (static_cast<int64_t>(ptrs.size()) < padded) ptrs.push_back(ptrs.back());
  ProcessedVideo out;
  out.num_frames = nf;
  ProcessedImage& px = out.pixels;
  px.resized_h = rh;
  px.resized_w = rw;
  px.grid_t = padded / tp;
  px.grid_h = rh / ps;
  px.grid_w = rw / ps;
  px.row_size = 3 * tp * ps * ps;
  px.pixel_values.resize(static_cast<size_t>(px.num_patches() * px.row_size));
  write_patch_rows(ptrs, rh, rw, pc, px.pixel_values.data());
  for (int64_t g = 0; g < px.grid_t; ++g) {
    const int64_t idx = indices[static_cast<size_t>(std::min(g * tp, nf - 1))];
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(idx) / video_fps);
    out.timestamps.emplace_back(buf);
  }
  return out;
}

std::string video_prompt_text(const ProcessedVideo& v, int64_t merge_size) {
  const int64_t per = v.pixels.grid_h * v.pixels.grid_w / (merge_size * merge_size);
  std::string s;
  for (const std::string& t : v.timestamps) {
    s += "]<]" + t + " seconds[>[";
    s += "]<]start of image[>[";
    for (int64_t i = 0; i < per; ++i) s += "]<]video[>[";
    s += "]<]end of image[>[";
  }
  return s;
}

}  // namespace m3::vision
