// Image decoding for the vision input (issue #20): JPEG (libjpeg-turbo), PNG (libpng) and WebP
// (libwebp) bytes -> 8-bit RGB, as PIL's Image.open(...).convert("RGB") gives them to the HF
// processor: grey is replicated, alpha is dropped (not composited), palettes are expanded, 16-bit
// samples keep their high byte (16-bit grey: clipped to 255, PIL's "I;16" conversion). A JPEG's
// EXIF orientation is applied (the pixels come out upright, as vLLM's image loader and
// transformers' load_image give them; PNG / WebP EXIF is not read). Called by the server on an HTTP
// thread per image part; thread-safe, no global state. Invariant: a returned image has width,
// height >= 1 and rgb.size() == width * height * 3; any malformed, truncated or unsupported input
// is an Error (never an abort).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace m3::vision {

struct RgbImage {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3] row-major
  int orientation = 1;       // while decoding: the file's EXIF Orientation (1..8)
};

// The EXIF Orientation (1..8) in a JPEG APP1 payload ("Exif\0\0" + TIFF); 1 (as stored) when
// the payload is not EXIF, has no orientation tag or an invalid one.
int exif_orientation(std::span<const uint8_t> app1);
// The image as it is meant to be shown: EXIF orientation k undone as PIL's ImageOps.exif_transpose
// does (2 mirror, 3 rotate 180, 4 flip, 5 transpose, 6 rotate 90 clockwise, 7 transverse, 8
// rotate 90 counter-clockwise); 5-8 swap width and height. Other values: unchanged.
RgbImage apply_exif_orientation(RgbImage img, int orientation);

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp, kGif };

// The format from the file's magic bytes (kUnknown when none matches).
ImageFormat sniff_image_format(std::span<const uint8_t> bytes);
const char* image_format_name(ImageFormat f);

// Decodes `bytes`. max_pixels bounds width * height before any pixel is decoded (a decompression
// bomb is refused from its header). Errors (kInvalidArgument): an unknown format (names the
// supported ones), a corrupt or truncated file (the decoder's message), an image over max_pixels
// (both numbers). CMYK / YCCK JPEGs are converted as PIL converts them (Adobe-inverted samples,
// PIL's CMYK -> RGB arithmetic).
Result<RgbImage> decode_image(std::span<const uint8_t> bytes, int64_t max_pixels);
// Whether this build reads GIF (giflib; optional: without it GIF images are refused by name).
bool gif_decoding_available();

}  // namespace m3::vision
