// Video decoding for the vision input (issue #20) through Debian's libavformat / libavcodec /
// libswscale, as transformers' PyAV backend (video_utils.read_video_pyav) reads a video for the
// HF processor: the container's first video stream, its frame count from the header
// (`stream.frames`, nb_frames) and its average frame rate, every frame decoded in order and the
// sampled ones converted to 8-bit RGB (rgb24; a frame already rgb24 is copied, other formats go
// through swscale, bilinear, which for lossy YUV codecs may differ from PyAV's own build by a
// level or so; the committed test videos are lossless RGB). Optional at build time
// (M3_HAVE_LIBAV): without the libraries every call returns "this build has no video decoding".
// Called by the server on an HTTP thread per video part; thread-safe, no global state.
// Invariant: a returned video has frames.size() == indices.size() >= 1, every frame
// width x height RGB; any malformed, truncated or unsupported input is an Error (never an abort).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "vision/image_decode.h"

namespace m3::vision {

// Whether this build links libav (video input is refused without it).
bool video_decoding_available();

struct VideoLimits {
  int64_t max_frame_pixels = int64_t{64} << 20;  // width * height of one frame
  int64_t max_decoded_frames = 1 << 17;          // frames read from the stream, sampled or not
  double max_seconds = 30;  // wall time for the whole decode (vLLM's VLLM_VIDEO_FETCH_TIMEOUT)
};

struct VideoHeader {
  int64_t width = 0, height = 0;
  int64_t total_frames = 0;  // the header's count; counted by decoding when the header has none
  double fps = 0;            // average frame rate (frames per second)
  std::string container, codec;
};

struct DecodedVideo {
  VideoHeader header;
  std::vector<int64_t> indices;  // the sampled frame numbers, ascending
  std::vector<RgbImage> frames;  // one per index (after the map, when one is given)
};

// The header -> the frame numbers to keep (ascending, each in [0, total_frames)); an Error
// refuses the video before any frame is converted (e.g. too many sampled pixels).
using FrameSampler = std::function<Result<std::vector<int64_t>>(const VideoHeader&)>;
// Applied to each kept frame as soon as it is converted (e.g. the processor's resize), so only
// one full-size frame is held at a time. May be empty.
using FrameMap = std::function<Result<RgbImage>(RgbImage)>;

// Decodes `bytes` and keeps the frames `sample` picks (through `map` when given). Errors
// (kInvalidArgument): no libav in this build, a container libav does not recognise, no video
// stream, an unsupported codec, a frame over max_frame_pixels (both numbers), corrupt data
// (libav's message), fewer decodable frames than the header promises (truncated), a frame size
// that changes mid-stream, and the sampler's or the map's errors.
Result<DecodedVideo> decode_video(std::span<const uint8_t> bytes, const FrameSampler& sample,
                                  const VideoLimits& limits, const FrameMap& map = nullptr);

}  // namespace m3::vision
