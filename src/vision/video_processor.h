// The MiniMax-M3 video processor, as transformers 5.17's MiniMaxM3VLVideoProcessor and
// MiniMaxM3VLProcessor compute it (m3-model.md §7):
//  * frame sampling: HF's BaseVideoProcessor.sample_frames at the processor's fps (1.0):
//    n = int(total / video_fps * fps), indices = int32(float32(i * total / n)) for i < ceil(total
//    / (total / n)) (torch.arange(0, total, total / n).int()). MiniMaxM3VLVideoProcessor declares
//    min_frames (4) and max_frames (768) but its inherited sample_frames ignores them (and divides
//    by zero for n = 0, refuses n > total); m3serve clamps n into [min_frames, max_frames] and to
//    total, so a clip under 4 s still gives 4 frames (or all it has).
//  * every sampled frame: smart_resize to multiples of 28 within [min_pixels, max_pixels] (3136,
//    602112: the video processor's budget, not the image one), the same antialiased bicubic uint8
//    resize and CLIP normalisation as images; an odd frame count repeats the last frame; rows of
//    1176 values per patch, temporal pairs outermost, each in merge-window order.
//  * the prompt: per temporal pair g, "]<]{t:.1f} seconds[>[" (t = frame index
//    indices[min(2g, n-1)] / video_fps) + "]<]start of image[>[" + N x "]<]video[>[" +
//    "]<]end of image[>[", N = grid_h * grid_w / merge^2
//    (MiniMaxM3VLProcessor.replace_video_token).
// Called by the server per video (HTTP thread); pure, thread-safe.
// Invariant: pixels.grid_t == ceil(frames / temporal_patch_size); timestamps.size() == grid_t.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "vision/image_processor.h"

namespace m3::vision {

struct VideoProcessorConfig {
  ProcessorConfig frame{14, 2, 2, 4 * 28 * 28, 768 * 28 * 28};  // min 3136, max 602112 pixels
  double fps = 1.0;                                             // frames sampled per second
  int64_t min_frames = 4, max_frames = 768;
  int64_t total_pixels = static_cast<int64_t>(64000 * 28 * 28 * 0.9);  // all sampled frames
};

// The sampled frame numbers of a video of `total` frames at `video_fps`.
std::vector<int64_t> sample_frame_indices(int64_t total, double video_fps,
                                          const VideoProcessorConfig& cfg);

// The size every frame of an h x w video is resized to (smart_resize at the video budget).
// Errors: an aspect ratio over 200, frames that resize to no patches.
Result<std::pair<int64_t, int64_t>> video_frame_size(int64_t h, int64_t w,
                                                     const VideoProcessorConfig& cfg);

// `frames` sampled frames of rh x rw (padded to whole temporal pairs) within total_pixels.
Status check_video_budget(int64_t frames, int64_t rh, int64_t rw, const VideoProcessorConfig& cfg);

struct ProcessedVideo {
  ProcessedImage pixels;                // grid_t temporal pairs
  std::vector<std::string> timestamps;  // per temporal pair, "%.1f" seconds
  int64_t num_frames = 0;               // sampled (before the repeat to a pair)
};

// frames: the sampled frames, indices their frame numbers, video_fps the stream's; src_h x
// src_w the video's frame size (0: the frames' own), so frames may come already resized to
// video_frame_size(src_h, src_w) (decode_video's map) or at the source size (resized here).
// Errors (kInvalidArgument): no frames, video_frame_size's, check_video_budget's, frames of
// another size.
Result<ProcessedVideo> preprocess_video(const std::vector<RgbImage>& frames,
                                        const std::vector<int64_t>& indices, double video_fps,
                                        const VideoProcessorConfig& cfg, int64_t src_h = 0,
                                        int64_t src_w = 0);

// The text MiniMaxM3VLProcessor puts in place of the video's "]<]video[>[" placeholder.
std::string video_prompt_text(const ProcessedVideo& v, int64_t merge_size);

}  // namespace m3::vision
