// Antialiased bicubic resize of 8-bit images, bit-exact with what the HF MiniMaxM3VL image
// processor runs: torchvision's resize(BICUBIC, antialias=True) on a uint8 CPU tensor, i.e.
// ATen's separable uint8 path (PIL's algorithm: Keys cubic with a = -0.5 stretched by the scale
// when shrinking, weights normalised in double, then fixed-point int16 weights whose precision is
// the largest that keeps every weight of the pass below 2^15; horizontal pass first, then
// vertical, each rounding to uint8; a dimension whose size does not change is not resampled).
// Called by the image processor (vision/image_processor.h). Pure function, thread-safe.
#pragma once

#include <cstdint>
#include <vector>

namespace m3::vision {

// src [in_h, in_w, channels] uint8 -> [out_h, out_w, channels] uint8. All sizes >= 1.
std::vector<uint8_t> resize_bicubic_aa(const uint8_t* src, int64_t in_h, int64_t in_w,
                                       int64_t channels, int64_t out_h, int64_t out_w);

}  // namespace m3::vision
