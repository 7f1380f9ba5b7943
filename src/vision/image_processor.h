// The MiniMax-M3 image processor (m3-model.md §7), as transformers 5.17's MiniMaxM3VLImageProcessor
// computes it: smart_resize to multiples of patch*merge (28) inside [min_pixels, max_pixels],
// antialiased bicubic resize on uint8 (vision/image_resize.h), CLIP normalisation in fp32
// ((x - 255*mean) / (255*std), the processor's fused rescale), the frame repeated for the
// temporal patch (2), and patches flattened into rows of channels*temporal*patch*patch (1176)
// values ordered so that each merge*merge window is `merge*merge` consecutive rows.
// Called by the server per image (HTTP thread); pure, thread-safe.
// Invariant: pixel_values.size() == grid_t*grid_h*grid_w * row_size(); grid_h and grid_w are
// multiples of merge_size; num_tokens() == grid_t*grid_h*grid_w / merge^2.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "vision/image_decode.h"

namespace m3::vision {

struct ProcessorConfig {
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t merge_size = 2;
  int64_t min_pixels = 4 * 28 * 28;  // 3136
  int64_t max_pixels = 451584;       // 672 * 672
};

struct ProcessedImage {
  int64_t grid_t = 1, grid_h = 0, grid_w = 0;  // in patches
  int64_t resized_h = 0, resized_w = 0;        // in pixels
  int64_t row_size = 0;                        // channels * temporal * patch * patch
  std::vector<float> pixel_values;             // [grid_t*grid_h*grid_w, row_size] f32
  int64_t num_patches() const { return grid_t * grid_h * grid_w; }
};

// Number of merged tokens the image becomes.
inline int64_t num_image_tokens(const ProcessedImage& p, int64_t merge_size) {
  return p.num_patches() / (merge_size * merge_size);
}

// smart_resize: (height, width) -> the resized (height, width), multiples of `factor`.
// Python's round() (half to even), floor and ceil as transformers computes them. Errors
// (kInvalidArgument): an aspect ratio over 200.
Result<std::pair<int64_t, int64_t>> smart_resize(int64_t height, int64_t width, int64_t factor,
                                                 int64_t min_pixels, int64_t max_pixels);

Result<ProcessedImage> preprocess_image(const RgbImage& img, const ProcessorConfig& cfg);

// The normalised patch rows of resized frames ([rh, rw, 3] uint8 each; frames.size() a multiple
// of temporal_patch_size): frames.size() / temporal groups, each in merge-window order, into
// dst (groups * (rh/patch) * (rw/patch) rows of row_size floats). Shared by images (one frame
// repeated) and videos (vision/video_processor.h).
void write_patch_rows(std::span<const uint8_t* const> frames, int64_t rh, int64_t rw,
                      const ProcessorConfig& cfg, float* dst);

}  // namespace m3::vision
